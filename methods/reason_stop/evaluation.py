"""Evaluation: every variant over the test problems through one code path (tiny or HF model), and
the spec's metrics from the generations.

Variants run as independent jobs (optionally in spawned workers, cli/workers.py); each job loads
the model itself, so results do not depend on which process ran it.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pandas as pd
from icml.cli.errors import IcmlError
from icml.cli.threads import single_thread
from icml.methods.reason_stop.controller import ACTIONS, AttentionRecorder, Codec, generate
from icml.methods.reason_stop.data import Problem, build_tokenizer, load_jsonl, held_out_problems
from icml.methods.reason_stop.model import load_checkpoint

ACTION_METRICS = {f"n_{a}": a for a in ACTIONS}
FIRST_ERROR = "test_first_error"


def load_reasoner(run_path: Path | None, cfg, device: str):
    """(model, tokenizer): a `--model` checkpoint, or the run's trained tiny model."""
    if cfg.model:
        model, tokenizer = load_checkpoint(cfg.model)
        return model.to(device), tokenizer
    folder = Path(run_path) / "checkpoints" / "model"
    if not (folder / "config.json").exists():
        raise IcmlError(f"the trained model is missing from {folder}",
                        f"re-train: icml reason-stop train --resume {run_path}")
    model, _ = load_checkpoint(folder)
    return model.to(device), build_tokenizer()


def eval_problems(cfg, seed: int) -> list[Problem]:
    if cfg.data:
        return load_jsonl(cfg.data)[:cfg.n_eval]
    return held_out_problems(cfg, seed, cfg.n_eval)


def run_variant(run_path: str | None, cfg, device: str, variant: str, problems: list[Problem],
                seed: int = 0) -> list[dict]:
    """One variant over the problems (a worker job): the generations as plain dicts. `seed` (the run's)
    and the problem id seed each problem's sampling stream (cfg.temperature > 0)."""
    with single_thread():
        model, tokenizer = load_reasoner(run_path, cfg, device)
        codec = Codec(tokenizer, model, cfg)
        recorder = AttentionRecorder(model, cfg.n_last_layers)
        try:
            return [dataclasses.asdict(generate(model, codec, recorder, p.question, p.answer, variant, cfg, device,
                                                p.problem_id, seed)) for p in problems]
        finally:
            recorder.remove()


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------
def first_error_ids(events: pd.DataFrame) -> set[int]:
    """Problems whose first-ATP probe answer is wrong. Every probing variant decodes the vanilla
    greedy prefix up to its first ATP, so its first probe is vanilla's first-ATP probe."""
    first = events[(events["atp_index"] == 1) & events["probe_correct"].notna()]
    if first.empty:
        return set()
    first = first.drop_duplicates("problem_id")
    return set(first.loc[~first["probe_correct"].astype(bool), "problem_id"])


def _mean(values) -> float:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return float(np.mean(values)) if values else math.nan


def summary_rows(generations: pd.DataFrame, events: pd.DataFrame, cfg) -> list[dict]:
    """Rows for metrics.parquet: per variant, on `test` and on `test_first_error`."""
    tags = {"lam": cfg.lam, "alpha": cfg.alpha, "max_jumps": cfg.max_jumps, "inject_weight": cfg.inject_weight,
            "window": cfg.window}
    hard = first_error_ids(events)
    splits = {"test": generations, FIRST_ERROR: generations[generations["problem_id"].isin(hard)]}
    rows = []
    for split, frame in splits.items():
        if frame.empty:
            continue
        vanilla = frame[frame["variant"] == "vanilla"].set_index("problem_id")["n_tokens"]
        for variant, group in frame.groupby("variant", sort=False):
            tokens = float(group["n_tokens"].mean())
            base = vanilla.reindex(group["problem_id"])
            compression = tokens / float(base.mean()) if base.notna().all() and len(base) else math.nan
            values = {"accuracy": float(group["correct"].mean()), "mean_tokens": tokens,
                      "compression_rate": compression}
            if split == "test":
                picked = events[events["variant"] == variant]
                later = picked[picked["atp_index"] > 1]
                overhead = float(group["probe_tokens"].mean())
                values |= {"probe_overhead_tokens": overhead, "total_tokens": tokens + overhead,
                           "mean_atp_count": float(group["n_atp"].mean()),
                           "delta_h_correct": _mean(later.loc[later["probe_correct"] == True, "delta_h"]),  # noqa: E712
                           "delta_h_wrong": _mean(later.loc[later["probe_correct"] == False, "delta_h"]),  # noqa: E712
                           "jump_repeat_fraction": _mean(picked.loc[picked["action"] == "jump",
                                                                    "repeats_previous"].astype(float)),
                           "wall_time_s": float(group["wall_time_s"].sum())}
                for metric, action in ACTION_METRICS.items():
                    values[metric] = float(group["counts"].map(lambda c: c[action]).mean())
            rows += [{"variant": variant, "metric": m, "value": v, "split": split, **tags} for m, v in values.items()]
    return rows


def tables(results: list[dict], run_id: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(generations, atp_events) frames from the generations of every variant."""
    generations, events = [], []
    for g in results:
        generations.append({"run_id": run_id, "variant": g["variant"], "problem_id": g["problem_id"],
                            "n_tokens": len(g["output_ids"]), "n_atp": g["n_atp"], "probe_tokens": g["probe_tokens"],
                            "answer": g["answer"], "correct": g["correct"], "wall_time_s": g["wall_time_s"],
                            "counts": g["counts"], "text": g["text"]})
        for e in g["events"]:
            events.append({"run_id": run_id, "variant": g["variant"], "problem_id": g["problem_id"], **e})
    columns = ["run_id", "variant", "problem_id", "atp_index", "position", "word", "repeats_previous", "confidence",
               "probe_answer", "probe_correct", "entropy_h", "delta_h", "a_prev", "a_self", "trap", "action"]
    events_frame = pd.DataFrame(events, columns=columns)
    events_frame["probe_correct"] = events_frame["probe_correct"].astype("boolean")
    return pd.DataFrame(generations), events_frame


def stored_generations(generations: pd.DataFrame) -> pd.DataFrame:
    """generations.parquet: the per-problem rows without the action-count dicts (one column each)."""
    out = generations.drop(columns=["counts"]).copy()
    for metric, action in ACTION_METRICS.items():
        out[metric] = generations["counts"].map(lambda c: c[action])
    return out


# ---------------------------------------------------------------------------------------------
# One annotated trace (the `generate` verb)
# ---------------------------------------------------------------------------------------------
def synthetic_truth(question: str) -> str | None:
    """The answer of a synthetic question `Q 3 + 5 - 9 =` (None if it is not one)."""
    from icml.methods.reason_stop.data import solve

    words = question.split()
    if len(words) < 4 or words[0] != "Q" or words[-1] != "=" or len(words) % 2:
        return None
    operands, ops = words[1:-1:2], words[2:-1:2]
    if not all(w.isdigit() and len(w) == 1 for w in operands) or not all(op in "+-" for op in ops):
        return None
    return str(solve(tuple(map(int, operands)), tuple(ops)))


def generate_one(run_path: Path, cfg, device: str, variant: str, question: str, answer: str | None, seed: int = 0):
    with single_thread():
        model, tokenizer = load_reasoner(run_path, cfg, device)
        codec = Codec(tokenizer, model, cfg)
        recorder = AttentionRecorder(model, cfg.n_last_layers)
        truth = answer if answer is not None else (None if cfg.data else synthetic_truth(question))
        try:
            generation = generate(model, codec, recorder, question, truth, variant, cfg, device, seed=seed)
        finally:
            recorder.remove()
    generation.pieces = [tokenizer.decode(generation.output_ids[a:b]) for a, b in zip(
        [0] + [e["position"] for e in generation.events],
        [e["position"] for e in generation.events] + [len(generation.output_ids)])]
    return generation


def _fmt(x) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def annotated_trace(generation) -> str:
    """The generated text with `⟨ATP i · C · ΔH · trap → action⟩` where each ATP was met."""
    parts = [generation.pieces[0]]
    for event, piece in zip(generation.events, generation.pieces[1:]):
        probe = "" if event["probe_answer"] is None and math.isnan(event["confidence"]) else \
            f" · probe {event['probe_answer']} C={_fmt(event['confidence'])}" + \
            ("" if event["probe_correct"] is None else (" ✓" if event["probe_correct"] else " ✗"))
        parts.append(f" ⟨ATP {event['atp_index']} {event['word']}{probe} · H={_fmt(event['entropy_h'])} "
                     f"ΔH={_fmt(event['delta_h'])} · a_prev={_fmt(event['a_prev'])} a_self={_fmt(event['a_self'])} "
                     f"trap={'yes' if event['trap'] else 'no'} → {event['action']}⟩ ")
        parts.append(piece)
    verdict = "correct" if generation.correct else "wrong"
    return "".join(parts).strip() + (f"\n\nanswer {generation.answer} ({verdict}) · {generation.tokens} tokens · "
                                     f"probe overhead {generation.probe_tokens} tokens · actions "
                                     + ", ".join(f"{k} {v}" for k, v in generation.counts.items() if v))
