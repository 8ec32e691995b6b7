"""metaphor-bench protocol identities: official frame sampling, prompt assembly, answer parsing,
the rule judge's formula, aggregation with correct multi-label per-type scores, and the loaders."""
from __future__ import annotations

import json
import math

import pytest
from PIL import Image

from icml.methods.metaphor_bench import protocol
from icml.methods.metaphor_bench.judges import rule_judge


def test_sample_indices_follow_the_float_step():
    assert protocol.sample_indices(7) == list(range(7))
    assert protocol.sample_indices(50) == list(range(50))
    # n = 120: ⌊i·2.4⌋, which neither linspace nor rounding reproduces
    got = protocol.sample_indices(120)
    assert got == [math.floor(i * 2.4) for i in range(50)] and got[:6] == [0, 2, 4, 7, 9, 12]
    assert got != [round(i * 119 / 49) for i in range(50)]
    assert protocol.sample_indices(998)[-1] == int(49 * 998 / 50) == 978
    assert protocol.sample_indices(51) == [int(i * 51 / 50) for i in range(50)] and len(set(protocol.sample_indices(51))) == 50


def test_frame_files_are_one_based_and_stop_at_the_first_gap(tmp_path):
    for i in (1, 2, 3, 5):
        Image.new("RGBA", (2000, 1000), (10, 20, 30, 128)).save(tmp_path / f"frame_{i:06d}.png")
        (tmp_path / f"frame_{i:06d}.png").rename(tmp_path / f"frame_{i:06d}.jpg")  # PNG bytes under .jpg
    assert [p.name for p in protocol.frame_paths(tmp_path)] == ["frame_000001.jpg", "frame_000002.jpg", "frame_000003.jpg"]
    encoded = protocol.encode_frame(tmp_path / "frame_000001.jpg")
    import io

    image = Image.open(io.BytesIO(encoded))
    assert image.format == "JPEG" and image.mode == "RGB" and image.size == (1024, 512)  # thumbnail keeps the aspect
    (tmp_path / "frame_000003.jpg").write_bytes(b"not an image")
    assert protocol.encode_frame(tmp_path / "frame_000003.jpg") == b"not an image"  # raw bytes on error


def test_prompt_assembly():
    p = protocol.prompts()
    assert set(p) == {"qa", "judge", "keywords", "descriptions", "final"}
    assert protocol.qa_text("") == p["qa"]
    assert protocol.qa_text("Rain") == "The video title is: Rain" + p["qa"]  # no separator, as the official script
    final = protocol.final_text("Rain", "REF")
    assert "The video title is: Rain" in final and final.count("REF") == 1 and "{" in final and "{{" not in final
    assert protocol.final_text("", "REF").startswith(p["final"].split("{title}")[0])
    judged = protocol.judge_text({"analysis_1": "x"}, ["g1", "g2"])
    assert "{'analysis_1': 'x'}" in judged and "['g1', 'g2']" in judged  # Python str(), not JSON
    # our prompts ask for what the official parser and judge parser read
    assert '"analysis_dict"' in p["qa"] and "implicitly expressing" in p["qa"] and '"keywords"' in p["keywords"]
    assert all(k in p["judge"] for k in ('"reasoning"', '"strict_score"', '"loose_score"'))


def _fake_official_checkout(root, final='Analyse. {title}\nExamples {{"analysis_dict": {{}}}}\nREF {external_reference}'):
    """The official repository's layout with stand-in strings (written here): three Python files."""
    (root / "utlis").mkdir(parents=True)
    (root / "utlis" / "eval_prompts.py").write_text('prompt = \\\n"""QA prompt"""\n')
    (root / "b_1_get_score.py").write_text('import os\n\nprompt = \\\n"""J {model_analysis} | {golden_analysis} {{}}"""\n'
                                           'if __name__ == "__main__":\n    raise SystemExit("never run")\n')
    (root / "utlis" / "MetaphorVU_Boost.py").write_text(
        f'PROMPT_EXTRACT_KEYWORDS = """K"""\nPROMPT_EXTRACT_DESCRIPTIONS = """D"""\nPROMPT_FINAL_ANALYSIS = """{final}"""\n'
        'class MetaphorVU_Boost:\n    pass\n')
    return root


def test_prompts_from_an_official_checkout(tmp_path):
    root = _fake_official_checkout(tmp_path / "MetaphorVU")
    source = str(root)
    p = protocol.prompts(source)
    assert p == {"qa": "QA prompt", "judge": "J {model_analysis} | {golden_analysis} {{}}", "keywords": "K",
                 "descriptions": "D", "final": 'Analyse. {title}\nExamples {{"analysis_dict": {{}}}}\nREF {external_reference}'}
    assert protocol.qa_text("T", source) == "The video title is: TQA prompt"
    assert protocol.judge_text({"a": 1}, ["g"], source) == "J {'a': 1} | ['g'] {}"
    assert protocol.final_text("", "R", source) == 'Analyse. \nExamples {"analysis_dict": {}}\nREF R'
    # a JSON file with the five keys is the other accepted source
    (tmp_path / "p.json").write_text(json.dumps(p))
    assert protocol.prompts(str(tmp_path / "p.json")) == p


@pytest.mark.parametrize("break_it, message", [
    (lambda root: (root / "b_1_get_score.py").unlink(), "cannot read"),
    (lambda root: (root / "utlis" / "eval_prompts.py").write_text("other = 'x'\n"), "has no string 'prompt"),
    (lambda root: (root / "utlis" / "MetaphorVU_Boost.py").write_text(
        'PROMPT_EXTRACT_KEYWORDS = "K"\nPROMPT_EXTRACT_DESCRIPTIONS = "D"\nPROMPT_FINAL_ANALYSIS = "{title} only"\n'),
     "has the slots ['title'], not ['external_reference', 'title']"),
])
def test_bad_prompt_sources_fail_in_one_line(tmp_path, break_it, message):
    root = _fake_official_checkout(tmp_path / "MetaphorVU")
    break_it(root)
    with pytest.raises(protocol.UsageError, match=message.replace("[", r"\[").replace("]", r"\]")):
        protocol.prompts(str(root))


@pytest.mark.parametrize("text, expected", [
    ('<think>```json\n{"analysis_dict": {"a": 1}}```</think>ok ```json\n{"analysis_dict": {"b": "2"}}\n```', {"b": "2"}),
    ('<|begin_of_box|>{"analysis_dict": {"c": "3"}}<|end_of_box|>', {"c": "3"}),
    ('```json\n{"analysis_dict": {"d": "a\x01b"}}\n```', {"d": "ab"}),  # control characters dropped
    ('```json\n{"analysis_dict": {"e": "x"}}\n```\n```json\n{"analysis_dict": {"f": "y"}}\n```', {"f": "y"}),
    ('```json\n{"keywords": ["x"]}\n```', None),
    ('no json at all', None),
    ('```json\n{"analysis_dict": "flat"}\n```', None),
])
def test_parse_analysis(text, expected):
    assert protocol.parse_analysis(text) == expected


def test_retries_stop_at_the_first_parse():
    calls = []
    value, used = protocol.with_retries(lambda a: calls.append(a) or ("bad" if a < 2 else '{"keywords": ["k"]}'),
                                        protocol.parse_keywords, 8)
    assert value == ["k"] and used == 3 and calls == [0, 1, 2]
    assert protocol.with_retries(lambda a: "bad", protocol.parse_keywords, 4) == (None, 4)
    assert protocol.parse_judgement('{"reasoning": "r", "strict_score": 1, "loose_score": 7}') == (1, 7)
    assert protocol.parse_judgement('{"reasoning": "r", "strict_score": 2, "loose_score": 7}') is None
    assert protocol.parse_judgement('{"strict_score": 1, "loose_score": 7}') is None


def test_aggregation_formula_and_multilabel_types():
    items = [{"metaphor_types": ["Body_Language"], "parse_ok": True, "judge_ok": True, "strict": 1, "loose": 8},
             {"metaphor_types": ["Body_Language", "Surreal_Narrative"], "parse_ok": True, "judge_ok": True,
              "strict": 0, "loose": 3},
             {"metaphor_types": ["Surreal_Narrative"], "parse_ok": False, "judge_ok": False, "strict": 0, "loose": 0},
             {"metaphor_types": ["Cultural_Symbol"], "parse_ok": True, "judge_ok": False, "strict": 0, "loose": 0}]
    out = protocol.aggregate(items)
    assert out["overall"] == pytest.approx((8 + 3) / 2 * 10, rel=0, abs=1e-12)
    assert out["overall_all"] == pytest.approx((8 + 3) / 4 * 10, rel=0, abs=1e-12)
    assert out["strict_pct"] == pytest.approx(50.0, abs=1e-12)
    assert out["score_bl"] == pytest.approx(55.0, abs=1e-12)  # both judged BL items
    assert out["score_sn"] == pytest.approx(30.0, abs=1e-12)  # the unparsed SN item is excluded
    assert math.isnan(out["score_cs"]) and math.isnan(out["score_pn"])  # no judged item: NaN, not 0
    assert out["parse_fail_rate"] == 0.25 and out["judge_fail_rate"] == 0.25 and out["n_scored"] == 2


def _entry(element, idea):
    return f"The video presents the {element} content, implicitly expressing the {idea} idea"


def test_rule_judge_weights_contradictions_and_error_class():
    pairs = [("candle", "mortality"), ("clock", "time-passing"), ("bird", "freedom")]
    full = {f"a{i}": _entry(e, i_) for i, (e, i_) in enumerate(pairs)}
    assert rule_judge(full, pairs) == {"strict": 1, "loose": 10, "error_class": "", "perceived": 3, "mapped": 3}
    core_only = rule_judge({"a": _entry("candle", "mortality")}, pairs)
    assert core_only["loose"] == 5 and core_only["strict"] == 0  # core weighs 0.5
    one_other = rule_judge({"a": _entry("clock", "time-passing")}, pairs)
    assert one_other["loose"] == 3 and one_other["error_class"] == "perception"  # 0.25 → 2.5 rounds half up
    contradicted = rule_judge({**full, "x": _entry("bird", "confinement")}, pairs)
    assert contradicted["loose"] == 10 and contradicted["strict"] == 0  # confinement contradicts freedom
    wrong_idea = rule_judge({"a": _entry("candle", "hope")}, [("candle", "mortality")])
    assert wrong_idea == {"strict": 0, "loose": 0, "error_class": "mapping", "perceived": 1, "mapped": 0}
    # the element word in the idea clause does not count as perceived content
    assert rule_judge({"a": _entry("stone", "candle mortality")}, [("candle", "mortality")])["error_class"] == ""


def test_raw_release_layout_and_bad_records(tmp_path):
    (tmp_path / "videos_deface" / "v1").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "videos_deface" / "v1" / "frame_000001.jpg")
    (tmp_path / "test.jsonl").write_text(json.dumps({"video_id": "v1", "title": "", "golden_answers": ["g"],
                                                     "metaphor_type": "Body_Language"}) + "\n")
    (record,) = protocol.load_bench(tmp_path)
    assert record.metaphor_type == ["Body_Language"] and len(protocol.load_frames(record, 50)) == 1
    (tmp_path / "test.jsonl").write_text('{"video_id": "v2"}\n')
    from icml.cli.errors import UsageError

    with pytest.raises(UsageError, match="test.jsonl:1"):
        protocol.load_bench(tmp_path)
    with pytest.raises(UsageError, match="neither datas.jsonl nor test.jsonl"):
        protocol.load_bench(tmp_path / "videos_deface")
