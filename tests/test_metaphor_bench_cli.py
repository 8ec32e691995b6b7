"""`icml metaphor-bench` end to end at a test-sized config built from the smoke preset: train → eval
→ report through the CLI, every arm/split/metric/tag of the spec, items.parquet; the generate and
score verbs (gold predictions score 100); one-line bad input."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from conftest import train_eval_report

TINY = ["--preset", "smoke", "--set", "n_train=16", "--set", "n_test_heldout=3", "--set", "n_test_seen=3",
        "--set", "steps=8", "--set", "batch_size=8", "--set", "d_model=32", "--set", "n_head=2"]
SPEC_METRICS = {"overall", "overall_all", "strict_pct", "score_bl", "score_al", "score_cs", "score_ns", "score_cm",
                "score_am", "score_pn", "score_sn", "parse_fail_rate", "judge_fail_rate", "n_scored",
                "ref_chars_mean", "ref_truncated_frac", "mapping_acc_given_elements"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return train_eval_report("metaphor-bench", tmp_path_factory.mktemp("runs"), TINY)


def test_every_arm_split_metric_and_tag(tiny_run):
    from icml.methods.metaphor_bench.config import VARIANTS

    frame = pd.read_parquet(tiny_run / "metrics.parquet")
    evaluated = frame[frame["phase"] == "eval"]
    assert SPEC_METRICS <= set(evaluated["metric"])
    assert {"train_loss", "val_loss"} <= set(frame.loc[frame["phase"] == "train", "metric"])
    assert set(evaluated["variant"]) == set(VARIANTS) and set(evaluated["split"]) == {"test_heldout", "test_seen"}
    assert set(evaluated["judge"]) == {"rule"} and set(evaluated["model"]) == {"tiny-mllm"}
    tags = evaluated.drop_duplicates("variant").set_index("variant")
    assert tags.loc["kg_h2", "hops"] == 2 and tags.loc["kg_h1", "hops"] == 1 and tags.loc["kg_h2", "top_k"] == 10
    assert tags.loc["kg_k0", "top_k"] == 0 and tags.loc["random_kg", "kg"] == "random" and tags.loc["oracle_kg", "kg"] == "oracle"
    overall = evaluated[evaluated["metric"] == "overall"]["value"].dropna()
    assert overall.between(0, 100).all()
    items = pd.read_parquet(tiny_run / "items.parquet")
    assert {"run_id", "variant", "split", "video_id", "metaphor_types", "strict", "loose", "parse_ok", "judge_ok",
            "keywords", "reference_chars", "error_class", "answer_json"} <= set(items.columns)
    assert len(items) == len(VARIANTS) * 6
    oracle = items[items["variant"] == "oracle_kg"]
    assert oracle["reference_chars"].gt(0).all()  # the oracle reference is never empty
    assert items.loc[items["variant"] == "kg_k0", "reference_chars"].eq(0).all()
    assert items.loc[items["variant"] == "no_kg", "reference_chars"].isna().all()
    html = (tiny_run.parent.parent / "r.html").read_text()
    assert "Scores per arm and metaphor type" in html and "Thought_Analysis_Score" in html


def test_report_json(tiny_run):
    from conftest import invoke

    result = invoke("metaphor-bench", "report", tiny_run, "--json", "--runs-dir", tiny_run.parent.parent)
    assert result.code == 0, result.err
    assert "test_heldout" in json.dumps(result.json())


def test_generate_and_score_gold_predictions(icml, tmp_path):
    out = tmp_path / "bench"
    result = icml("metaphor-bench", "generate", "--out", out, "--preset", "smoke", "--json")
    assert result.code == 0, result.err
    assert result.json()["test_videos"] == 16
    records = [json.loads(l) for l in (out / "test" / "datas.jsonl").read_text().splitlines()]
    pred = tmp_path / "pred.jsonl"
    pred.write_text("\n".join(json.dumps({"video_id": r["video_id"], "analysis_dict": {
        f"analysis_{k}": a for k, a in enumerate(r["golden_answers"], 1)}}) for r in records))
    scored = icml("metaphor-bench", "score", "--bench", out / "test", "--pred", pred, "--json")
    assert scored.code == 0, scored.err
    summary = scored.json()
    assert summary["overall"] == 100.0 and summary["strict_pct"] == 100.0 and summary["n_scored"] == 16
    pred.write_text('{"video_id": "nope", "analysis_dict": {}}\n')
    bad = icml("metaphor-bench", "score", "--bench", out / "test", "--pred", pred)
    assert bad.code != 0 and "pred.jsonl:1 is not a prediction" in bad.err and "Traceback" not in bad.err


@pytest.mark.parametrize("argv, message", [
    (["--set", "variants=no_kg,nope"], "unknown or no variant(s) ['nope']"),
    (["--set", "judge=llm"], "judge=llm needs judge_model=PATH"),
    (["--set", "bench=/no/such/bench"], "bench '/no/such/bench' does not exist"),
    (["--set", "kg_json=/tmp"], "kg_json and kg_emb go together"),
    (["--set", "top_k=-1"], "top_k must be >= 0"),
    (["--set", "query_mode=descriptions"], "query_mode=descriptions needs model=PATH"),
    (["--preset", "paper"], "judge=llm needs judge_model=PATH"),
])
def test_bad_input_is_one_line(icml, argv, message):
    argv = argv if "--preset" in argv else ["--preset", "smoke", *argv]
    result = icml("metaphor-bench", "train", *argv)
    assert result.code == 2
    lines = [line for line in result.err.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.err


def test_official_layout_needs_its_model_and_kg(icml, tmp_path):
    (tmp_path / "test.jsonl").write_text('{"video_id": "v", "title": "", "golden_answers": ["g"], "metaphor_type": ["Body_Language"]}\n')
    result = icml("metaphor-bench", "train", "--preset", "smoke", "--set", f"bench={tmp_path}")
    assert result.code == 2 and "needs model=PATH" in result.err
    result = icml("metaphor-bench", "train", "--preset", "smoke", "--set", f"bench={tmp_path}", "--set", f"model={tmp_path}",
                  "--set", "judge=llm", "--set", f"judge_model={tmp_path}")
    assert result.code == 2 and "need a KG: pass kg_json" in result.err
