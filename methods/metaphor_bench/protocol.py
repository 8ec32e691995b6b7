"""The official MetaphorVU protocol: records, frame sampling, prompts, answer parsing, judge
prompt and aggregation. Pure Python + PIL (no torch), so `score` and the tests stay light.

Prompts: `prompts.json` holds this workbench's own prompt texts, written here with the official ones'
slots and answer formats (the official strings are another repository's prose, so they are not shipped).
`prompts=DIR` reads the official strings from a user's checkout of the MetaphorVU repository, for numbers
comparable with the paper's.
"""
from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from icml.cli.errors import UsageError

TYPE_KEYS = {"Body_Language": "bl", "Atmosphere_Language": "al", "Cultural_Symbol": "cs",
             "Naturalistic_Symbol": "ns", "Causal_Montage": "cm", "Analogical_Montage": "am",
             "Performative_Narrative": "pn", "Surreal_Narrative": "sn"}
MAX_FRAME_INDEX = 998
QUERY_TEMPLATE = "This is a scene description related to metaphor understanding: {}"


PROMPT_KEYS = ("qa", "judge", "keywords", "descriptions", "final")
# Where each prompt lives in the official repository: (file, module-level variable).
OFFICIAL_PROMPT_SOURCES = {"qa": ("utlis/eval_prompts.py", "prompt"), "judge": ("b_1_get_score.py", "prompt"),
                           "keywords": ("utlis/MetaphorVU_Boost.py", "PROMPT_EXTRACT_KEYWORDS"),
                           "descriptions": ("utlis/MetaphorVU_Boost.py", "PROMPT_EXTRACT_DESCRIPTIONS"),
                           "final": ("utlis/MetaphorVU_Boost.py", "PROMPT_FINAL_ANALYSIS")}
# The format slots of the two prompts filled with str.format (the official ones have exactly these); the
# other three are used as they are (their JSON braces are literal).
PROMPT_SLOTS = {"judge": {"model_analysis", "golden_analysis"}, "final": {"title", "external_reference"}}


def _string_constant(path: Path, name: str) -> str:
    """The string assigned to module-level `name` in a Python file, read with ast (nothing is executed)."""
    import ast

    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, SyntaxError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {path} ({type(exc).__name__})",
                         "pass prompts=DIR, a checkout of the official MetaphorVU repository") from None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets) \
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return node.value.value
    raise UsageError(f"{path} has no string '{name} = \"\"\"…\"\"\"'",
                     "pass a checkout of the official MetaphorVU repository (its prompts moved or were renamed)")


def _slots(text: str) -> set[str]:
    import string

    return {field for _, field, _, _ in string.Formatter().parse(text) if field is not None}


@lru_cache(maxsize=4)
def prompts(source: str | None = None) -> dict[str, str]:
    """The five prompt texts: ours (`prompts.json`) when `source` is empty, else read from `source`, a
    checkout of the official repository (its three Python files) or a JSON file with the five keys."""
    if not source:
        texts = json.loads(Path(__file__).with_name("prompts.json").read_text(encoding="utf-8"))
    elif Path(source).is_dir():
        texts = {key: _string_constant(Path(source) / file, name)
                 for key, (file, name) in OFFICIAL_PROMPT_SOURCES.items()}
    else:
        try:
            texts = json.loads(Path(source).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise UsageError(f"prompts file '{source}' cannot be read as JSON ({type(exc).__name__})",
                             f"pass a JSON object with the keys {', '.join(PROMPT_KEYS)}, or the official "
                             "repository's folder") from None
        if not isinstance(texts, dict) or set(texts) != set(PROMPT_KEYS) \
                or not all(isinstance(v, str) for v in texts.values()):
            raise UsageError(f"prompts file '{source}' must map exactly {', '.join(PROMPT_KEYS)} to strings",
                             "fix the file, or pass the official repository's folder")
    for key, slots in PROMPT_SLOTS.items():
        try:
            found = _slots(texts[key])
        except ValueError as exc:  # unbalanced braces
            raise UsageError(f"prompt '{key}' from {source or 'prompts.json'} is not a format string ({exc})",
                             "double the literal braces ({{ }}) as the official prompts do") from None
        if found != slots:
            raise UsageError(f"prompt '{key}' from {source or 'prompts.json'} has the slots {sorted(found)}, "
                             f"not {sorted(slots)}", "use the official prompts' slots")
    return texts


# records -------------------------------------------------------------------------------------------------
@dataclass
class Record:
    video_id: str
    title: str
    golden_answers: list[str]
    metaphor_type: list[str]
    frames_dir: Path
    gold: dict = field(default_factory=dict)  # procedural sidecar (gold_ids.jsonl); empty for the official data


def load_bench(root: Path) -> list[Record]:
    """The official layout: datas.jsonl + videos/<id>/frame_000001.jpg…, or the raw HF release
    test.jsonl + videos_deface/<id>/; a gold_ids.jsonl sidecar is attached when present."""
    root = Path(root)
    for name, frames in (("datas.jsonl", "videos"), ("test.jsonl", "videos_deface")):
        if (root / name).exists():
            jsonl, frame_root = root / name, root / frames
            break
    else:
        raise UsageError(f"benchmark folder '{root}' has neither datas.jsonl nor test.jsonl",
                         "pass a folder in the official layout (see the method README), or omit bench=")
    gold = {}
    if (root / "gold_ids.jsonl").exists():
        for line in (root / "gold_ids.jsonl").read_text(encoding="utf-8").splitlines():
            if line.strip():
                entry = json.loads(line)
                gold[str(entry["video_id"])] = entry
    records = []
    for number, line in enumerate(jsonl.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            types = raw["metaphor_type"]
            record = Record(str(raw["video_id"]), str(raw.get("title") or ""), list(raw["golden_answers"]),
                            [types] if isinstance(types, str) else list(types),
                            frame_root / str(raw["video_id"]), gold.get(str(raw["video_id"]), {}))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise UsageError(f"{jsonl}:{number} is not a benchmark record ({type(exc).__name__}: {exc})",
                             "each line needs video_id, title, golden_answers and metaphor_type") from None
        records.append(record)
    if not records:
        raise UsageError(f"{jsonl} holds no records", "check the file")
    return records


# frames --------------------------------------------------------------------------------------------------
def frame_paths(frames_dir: Path) -> list[Path]:
    """frame_000001.jpg, frame_000002.jpg, … stopping at the first missing one (at most 998)."""
    out = []
    for i in range(1, MAX_FRAME_INDEX + 1):
        path = Path(frames_dir) / f"frame_{i:06d}.jpg"
        if not path.exists():
            break
        out.append(path)
    return out


def sample_indices(n: int, max_images: int = 50) -> list[int]:
    """Official sampling: ⌊i·(n/max_images)⌋ for i < max_images (a float step), else every frame."""
    if n <= max_images:
        return list(range(n))
    step = n / max_images
    return [int(i * step) for i in range(max_images)]


def encode_frame(path: Path, max_size: int = 1024) -> bytes:
    """RGBA/P/LA → RGB, thumbnail into max_size² (LANCZOS), JPEG q85 optimize; raw bytes on error."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            if image.mode in ("RGBA", "P", "LA"):
                image = image.convert("RGB")
            image.thumbnail((max_size, max_size), Image.LANCZOS)
            buffer = io.BytesIO()
            image.save(buffer, format="JPEG", quality=85, optimize=True)
            return buffer.getvalue()
    except Exception:  # the official code sends the file as it is when PIL cannot read it
        return Path(path).read_bytes()


def load_frames(record: Record, max_images: int) -> list[bytes]:
    paths = frame_paths(record.frames_dir)
    if not paths:
        raise UsageError(f"video '{record.video_id}' has no frames under {record.frames_dir}",
                         "frames are frame_000001.jpg, frame_000002.jpg, … in videos/<video_id>/")
    return [encode_frame(paths[i]) for i in sample_indices(len(paths), max_images)]


# prompts -------------------------------------------------------------------------------------------------
def qa_text(title: str, source: str | None = None) -> str:
    """The official QA text: the title sentence glued to the prompt without a separator."""
    prompt = prompts(source)["qa"]
    return ("The video title is: " + title + prompt) if title != "" else prompt


def final_text(title: str, reference: str, source: str | None = None) -> str:
    return prompts(source)["final"].format(external_reference=reference,
                                           title=f"The video title is: {title}" if title else "")


def judge_text(analysis_dict: dict, golden_answers: list[str], source: str | None = None) -> str:
    return prompts(source)["judge"].format(model_analysis=str(analysis_dict), golden_analysis=str(golden_answers))


# parsing -------------------------------------------------------------------------------------------------
def clean_json(output: str):
    """The official answer cleaner: after the last </think>, without box markers, the last ```json
    block, control characters dropped, then json.loads (raises ValueError when it cannot)."""
    text = output.split("</think>")[-1]
    if text.startswith("<|begin_of_box|>"):
        text = text.replace("<|begin_of_box|>", "").replace("<|end_of_box|>", "")
    text = text.split("```json")[-1].split("```")[0]
    text = "".join(ch for ch in text if ord(ch) >= 32 or ch in "\n\r\t")
    return json.loads(text)


def parse_analysis(output: str) -> dict | None:
    try:
        value = clean_json(output)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("analysis_dict"), dict):
        return None
    return value["analysis_dict"]


def parse_keywords(output: str, key: str = "keywords") -> list[str] | None:
    try:
        value = clean_json(output)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get(key), list):
        return None
    return [str(q) for q in value[key]]


def parse_judgement(output: str) -> tuple[int, int] | None:
    try:
        value = clean_json(output)
        strict, loose = int(value["strict_score"]), int(value["loose_score"])
    except (ValueError, KeyError, TypeError):
        return None
    if "reasoning" not in value or strict not in (0, 1) or not 0 <= loose <= 10:
        return None
    return strict, loose


def with_retries(generate, parse, attempts: int):
    """generate(attempt) -> text; the first parsed value and the number of attempts used, or (None, attempts)."""
    for attempt in range(attempts):
        value = parse(generate(attempt))
        if value is not None:
            return value, attempt + 1
    return None, attempts


# aggregation ---------------------------------------------------------------------------------------------
def aggregate(items: list[dict]) -> dict[str, float]:
    """items: {metaphor_types, parse_ok, judge_ok, strict, loose}. overall = mean(loose)·10 over judged
    items (the official mean skips never-parsed items); per type over the multi-label members."""
    judged = [it for it in items if it["parse_ok"] and it["judge_ok"]]
    mean = lambda xs: sum(xs) / len(xs) if xs else math.nan
    out = {"overall": mean([it["loose"] for it in judged]) * 10,
           "overall_all": mean([it["loose"] if it["parse_ok"] and it["judge_ok"] else 0 for it in items]) * 10,
           "strict_pct": mean([it["strict"] for it in judged]) * 100,
           "n_scored": float(len(judged)),
           "parse_fail_rate": mean([0.0 if it["parse_ok"] else 1.0 for it in items]),
           "judge_fail_rate": mean([0.0 if it["judge_ok"] or not it["parse_ok"] else 1.0 for it in items])}
    for name, key in TYPE_KEYS.items():
        out[f"score_{key}"] = mean([it["loose"] for it in judged if name in it["metaphor_types"]]) * 10
    return out


OFFICIAL_PER_TYPE_NOTE = ("the official c_1_show_score.py reads per-type scores under '{type}-Thought_Analysis_Score' "
                          "keys that are never written, so its per-type columns are NaN; these are mean(loose)×10 over "
                          "the items whose metaphor_type contains the type")
