"""`icml kv-compress` train → calibrate → eval.

train: generate the task mixture, build the word tokenizer, train the tiny Llama (or take a
`--model` checkpoint as it is), then calibrate. calibrate: H̄ = mean normalised entropy over
calibration prompts, layers and KV heads, stored in calibration.json keyed by model. eval: the
budget grid × variants × tasks, metrics.parquet rows and allocations.parquet.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from icml.cli import distributed, runstore
from icml.cli.errors import IcmlError, UsageError
from icml.cli.lifecycle import RunContext
from icml.cli.runstore import atomic_write_json
from icml.cli.threads import intra_op_threads, single_thread
from icml.methods.kv_compress.config import TASKS
from icml.methods.kv_compress.data import build_tokenizer, generate_set, load_jsonl
from icml.methods.kv_compress.evaluation import (analyse, check_lengths, evaluate_example, score_metric, split,
                                                 variant_spec)
from icml.methods.kv_compress.model import load_checkpoint, prefill, tiny_model

TRAINED = "tiny"  # calibration key of the run's own trained model
BOOTSTRAP_PAIR = ("entrokv_snapkv", "snapkv")
CORR_RATIO = 0.3
# (task, task, metric) of the budget-map correlations: the spec's pair shares one context format (`k v ;`
# pairs, only the question differs); the needle's context (filler and one `magic v ;`) is the control
CORR_PAIRS = (("kv_retrieval", "aggregation", "alloc_corr_retrieval_aggregation"),
              ("kv_retrieval", "needle", "alloc_corr_retrieval_needle"),
              ("needle", "aggregation", "alloc_corr_needle_aggregation"))


# ---------------------------------------------------------------------------------------------
# Models and data of a run
# ---------------------------------------------------------------------------------------------
def model_key(cfg, override: str | None = None) -> str:
    path = override or cfg.model
    if not path:
        return TRAINED
    return str(Path(path).resolve()) if Path(path).exists() else path  # a short name (smollm2-135m) as given


def load_model(run_path: Path, cfg, override: str | None, device: str):
    """The model to compress: a `--model` checkpoint, or the run's trained tiny model."""
    path = override or cfg.model
    if path:
        model, tokenizer = load_checkpoint(path)
        return model.to(device), tokenizer
    folder = run_path / "checkpoints" / "model"
    if not (folder / "config.json").exists():
        raise IcmlError(f"the trained model is missing from {folder}",
                        f"re-train: icml kv-compress train --resume {run_path}")
    model, _ = load_checkpoint(folder)
    return model.to(device), build_tokenizer()


def user_split(cfg) -> tuple[list, list]:
    """(calibration, eval) lines of the --data file: the first `calibration_split` lines are held
    apart for H̄, eval scores the next n_per_task; the two never share a line."""
    examples = load_jsonl(cfg.data)
    held, scored = examples[:cfg.calibration_split], examples[cfg.calibration_split:][:cfg.n_per_task]
    if not scored:
        raise UsageError(f"--data '{cfg.data}' has {len(examples)} lines, all held apart for calibration "
                         f"(calibration_split={cfg.calibration_split})",
                         "add lines, or lower --set calibration_split=")
    return held, scored


def eval_examples(cfg, seed: int) -> list:
    """The user's JSONL examples after the calibration lines, or n_per_task generated examples per task."""
    if cfg.data:
        return user_split(cfg)[1]
    return generate_set(TASKS, cfg.n_per_task, seed, cfg.context_min, cfg.context_max, "test")


# ---------------------------------------------------------------------------------------------
# Calibration
# ---------------------------------------------------------------------------------------------
def mean_entropy(model, tokenizer, examples, cfg, device: str) -> float:
    """H̄: mean of H_l^h over the calibration prompts, layers and KV heads (question-aware prefill)."""
    maps = [analyse(prefill(model, split(tokenizer, e, True, device).prefix, cfg.window), cfg).entropy
            for e in examples]
    return float(np.mean(maps))


def calibrate(run_path: Path, cfg, seed: int, device: str, *, model_path: str | None = None,
              data: str | None = None, n: int | None = None) -> dict:
    """Compute H̄ and store it in <run>/calibration.json under the model's key."""
    n = n or cfg.n_calibration
    if cfg.task_set == "real" and data:
        raise UsageError("a real-task run calibrates on its own held-apart prompts, not on --data",
                         "drop --data (or calibrate a run of another preset)")
    model, tokenizer = load_model(run_path, cfg, model_path, device)
    if cfg.task_set == "real":
        return _store_h_bar(run_path, cfg, model_path, real_h_bar(model, tokenizer, cfg, seed, n, device))
    if data and not (cfg.data and Path(data).resolve() == Path(cfg.data).resolve()):
        examples = load_jsonl(data)[:n]  # a file of its own: eval never scores it
    elif data or cfg.data:
        examples = user_split(cfg)[0][:n]
        if not examples:
            raise UsageError(f"calibration_split is 0, so no line of --data '{cfg.data}' is held apart for H̄",
                             "set --set calibration_split=16 (or pass a calibration file: calibrate --data)")
    else:  # a mixture stream of its own: never the eval examples
        examples = generate_set(TASKS, -(-n // len(TASKS)), seed, cfg.context_min, cfg.context_max,
                                "calibration")[:n]
    check_lengths(tokenizer, examples, cfg, model, "calibration", agnostic=False)
    with single_thread():
        h_bar = mean_entropy(model, tokenizer, examples, cfg, device)
    entry = {"h_bar": h_bar, "n": len(examples), "window": cfg.window, "entropy_norm": cfg.entropy_norm,
             "gqa_agg": cfg.gqa_agg, "data": str(Path(data or cfg.data).resolve()) if (data or cfg.data) else
             "generated mixture", "lines": [e.line for e in examples] if (data or cfg.data) else None}
    return _store_h_bar(run_path, cfg, model_path, entry)


def real_h_bar(model, tokenizer, cfg, seed: int, n: int, device: str) -> dict:
    """H̄ of task_set=real: its own held-apart prompts (stream "calibration"; eval scores "test")."""
    from icml.methods.kv_compress import real

    examples = real.calibration_examples(cfg, tokenizer, seed, n)
    with intra_op_threads(cfg.real.threads):
        h_bar = real.mean_entropy(model, tokenizer, examples, cfg, device)
    return {"h_bar": h_bar, "n": len(examples), "window": cfg.window, "entropy_norm": cfg.entropy_norm,
            "gqa_agg": cfg.gqa_agg, "data": "real tasks, calibration stream",
            "lines": [f"{e.task} {e.example_id}" for e in examples]}


def _store_h_bar(run_path: Path, cfg, model_path: str | None, entry: dict) -> dict:
    path = run_path / "calibration.json"
    try:
        table = json.loads(path.read_text()) if path.exists() else {}
    except json.JSONDecodeError:
        raise IcmlError(f"{path} is not valid JSON", "delete it and run: icml kv-compress calibrate") from None
    table[model_key(cfg, model_path)] = entry
    atomic_write_json(path, table)
    return entry


def stored_h_bar(run_path: Path, cfg) -> float | None:
    path = run_path / "calibration.json"
    if not path.exists():
        return None
    try:
        entry = json.loads(path.read_text()).get(model_key(cfg))
    except (json.JSONDecodeError, AttributeError):
        raise IcmlError(f"{path} is not a valid calibration file",
                        "delete it and run: icml kv-compress calibrate") from None
    return None if entry is None else float(entry["h_bar"])


# ---------------------------------------------------------------------------------------------
# train
# ---------------------------------------------------------------------------------------------
def train(ctx: RunContext) -> None:
    from icml.methods.kv_compress.training import train_model

    cfg = ctx.config
    if cfg.data:
        user_split(cfg)  # a malformed file or one with no line left to score fails before training
    if not cfg.model:
        tokenizer = build_tokenizer()
        model = tiny_model(cfg, len(tokenizer), ctx.seed)
        state_path = ctx.checkpoints / "state.pt"
        start, optimizer_state, pending = 0, None, []
        saved = (runstore.load_checkpoint(state_path)
                 if ctx.resumed and state_path.exists() and distributed.is_main() else None)
        saved = distributed.from_main(saved)  # under torchrun: rank 0's checkpoint, on every rank
        if saved is not None:
            model.load_state_dict(saved["model"])
            start, optimizer_state, pending = saved["step"], saved["optimizer"], saved.get("pending", [])
        ctx.log(f"tiny Llama: {sum(p.numel() for p in model.parameters()):,} parameters, vocab {len(tokenizer)}")
        val = generate_set(TASKS, cfg.val_per_task, ctx.seed, cfg.context_min, cfg.context_max, "val")

        def log(step: int, values: dict) -> None:
            rows = []
            for name, value in values.items():
                metric, _, task = name.partition("/")
                rows.append({"variant": "tiny_llama", "metric": metric, "value": value, "step": step,
                             "task": task or None})
            ctx.record(rows, split="val" if "val_loss" in values else "train")
            if "val_loss" in values:
                ctx.log(f"  step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in values.items()))

        def checkpoint(step: int, optimizer, pending: list[float]) -> None:
            if not distributed.is_main():  # every rank holds the same state; rank 0 writes it
                return
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                        "pending": pending}, state_path)

        with (ctx.progress("training steps", cfg.steps - start) as advance, intra_op_threads(cfg.train_threads),
              distributed.ranks_stop_together()):  # torchrun: a rank that fails stops all with its line
            train_model(model, tokenizer, cfg, ctx.seed, ctx.device, val, start, optimizer_state, log, checkpoint,
                        advance, pending)
        model.config._attn_implementation = "eager"
        if distributed.is_main():
            model.save_pretrained(ctx.checkpoints / "model")
            tokenizer.save_pretrained(ctx.checkpoints / "model")
    if cfg.calibrate_on_train and distributed.is_main():  # one process's forward passes: rank 0's
        entry = calibrate(ctx.run.path, cfg, ctx.seed, ctx.device)
        ctx.log(f"calibration: H̄ = {entry['h_bar']:.4f} over {entry['n']} prompts")


# ---------------------------------------------------------------------------------------------
# eval
# ---------------------------------------------------------------------------------------------
def _bootstrap(diffs: np.ndarray, resamples: int, seed: int) -> tuple[float, float]:
    """95% percentile CI of the mean of paired differences."""
    rng = np.random.default_rng(seed)
    means = diffs[rng.integers(0, len(diffs), size=(resamples, len(diffs)))].mean(1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def summary_rows(per_example: pd.DataFrame, allocations: pd.DataFrame, cfg, seed: int) -> list[dict]:
    """Averages per (variant, task, ratio), retention, the paired bootstrap CI and the
    retrieval/aggregation allocation correlation."""
    specs = {name: variant_spec(name, cfg) for name in per_example["variant"].unique()}
    score = score_metric(cfg)
    diff = "em_diff" if score == "exact_match" else "token_f1_diff"
    metrics = [score, "answer_nll", "kl_to_full", "kept_entries", "kept_fraction", "memory_bytes",
               "overhead_ms", "budget_cv", "mean_entropy"]
    means = per_example.groupby(["variant", "task", "ratio"], sort=False)[metrics].mean().reset_index()
    full_score = per_example[per_example["variant"] == "full"].groupby("task")[score].mean() \
        if "full" in specs else pd.Series(dtype=float)
    rows = []
    tags = summary_tags(cfg, list(specs.values()))

    for record in means.to_dict("records"):
        base = tags(record["variant"], record["task"], record["ratio"])
        for metric in metrics:
            rows.append({**base, "metric": metric, "value": float(record[metric])})
        denominator = full_score.get(record["task"], np.nan)
        retention = record[score] / denominator if denominator and denominator > 0 else np.nan
        rows.append({**base, "metric": "retention", "value": float(retention)})
    if all(v in specs for v in BOOTSTRAP_PAIR):
        wide = per_example[per_example["variant"].isin(BOOTSTRAP_PAIR)].pivot_table(
            index=["task", "ratio", "example_id"], columns="variant", values=score)
        for (task, ratio), group in wide.groupby(level=["task", "ratio"]):
            diffs = (group[BOOTSTRAP_PAIR[0]] - group[BOOTSTRAP_PAIR[1]]).to_numpy()
            low, high = _bootstrap(diffs, cfg.bootstrap, seed)
            base = tags(BOOTSTRAP_PAIR[0], task, ratio)
            rows += [{**base, "metric": f"{diff}_ci_low", "value": low},
                     {**base, "metric": f"{diff}_ci_high", "value": high}]
    for first, second, metric, corr in budget_map_correlations(allocations):
        rows.append({**tags("entrokv_snapkv", f"{first}|{second}", CORR_RATIO), "metric": metric, "value": corr})
    return rows


def summary_tags(cfg, specs):
    """tags(variant, task, ratio) -> the tag columns of a summary row."""
    by_name = {spec.name: spec for spec in specs}

    def tags(variant: str, task: str, ratio: float) -> dict:
        spec = by_name[variant]
        return {"variant": variant, "task": task, "ratio": float(ratio), "window": cfg.window,
                "alpha": spec.alpha, "scope": spec.scope, "operator": spec.operator,
                "question_aware": int(spec.question_aware)}

    return tags


def budget_map_correlations(allocations) -> list[tuple[str, str, str, float]]:
    """(task, task, metric, Pearson r) of the two tasks' mean entrokv_snapkv budget maps (layer × KV head)
    at r = CORR_RATIO, for each pair of CORR_PAIRS both evaluated; NaN where a map is constant."""
    picked = allocations[(allocations["variant"] == "entrokv_snapkv") & np.isclose(allocations["ratio"], CORR_RATIO)]
    maps = picked.groupby(["task", "layer", "kv_head"])["budget"].mean()
    out = []
    for first, second, metric in CORR_PAIRS:
        if {first, second} <= set(picked["task"]):
            a, b = maps[first].to_numpy(float), maps[second].to_numpy(float)
            corr = float(np.corrcoef(a, b)[0, 1]) if a.std() > 0 and b.std() > 0 else np.nan
            out.append((first, second, metric, corr))
    return out


def evaluate(ctx: RunContext) -> None:
    cfg = ctx.config
    specs = [variant_spec(name, cfg) for name in cfg.variants]
    h_bar = cfg.h_bar
    if h_bar is None and any(spec.allocation == "entropy" for spec in specs):
        h_bar = stored_h_bar(ctx.run.path, cfg)
        if h_bar is None:
            raise UsageError(f"EntroKV variants need H̄, and {ctx.run.path}/calibration.json has none for "
                             f"model '{model_key(cfg)}'",
                             f"run: icml kv-compress calibrate {ctx.run.path} (or train with --set h_bar=0.3)")
    model, tokenizer = load_model(ctx.run.path, cfg, None, ctx.device)
    if cfg.task_set == "real":
        from icml.methods.kv_compress import real

        return real.evaluate(ctx, model, tokenizer, h_bar)
    examples = eval_examples(cfg, ctx.seed)
    check_lengths(tokenizer, examples, cfg, model, f"--data '{cfg.data}'" if cfg.data else "generated",
                  agnostic=any(not spec.question_aware for spec in specs))
    if cfg.data:
        ctx.log(f"eval scores lines {examples[0].line}–{examples[-1].line} of {cfg.data} "
                f"(the first {cfg.calibration_split} are held apart for calibration)")
    ctx.log(f"{len(examples)} examples × {len(cfg.ratios)} ratios × {len(specs)} variants; H̄ = {h_bar}")
    results, allocations = [], []
    with ctx.progress("examples", len(examples)) as advance, single_thread():
        for example in examples:
            rows, alloc = evaluate_example(model, tokenizer, example, cfg, specs, cfg.ratios, h_bar, ctx.device)
            results += rows
            allocations += alloc
            advance(1)
    per_example = pd.DataFrame(results)
    allocation_frame = pd.DataFrame(allocations)
    allocation_frame.insert(0, "run_id", ctx.run.path.name)
    ctx.record(summary_rows(per_example, allocation_frame, cfg, ctx.seed), split="test")
    ctx.write_table("allocations", allocation_frame)
    ctx.write_table("examples", per_example)
