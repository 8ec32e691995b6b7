"""`--preset real` (task_set=real): KV compression of a real chat model on the natural-text tasks of
real_tasks.py, decoded by `model.generate()` through `CompressedCache` (hf_cache.py).

Per example: ONE prefill of the prompt but its last token, recorded by hf_cache's attention function (SDPA,
plus the window queries and, when H2O is an arm, the column sums); the window attention and entropy of that
prefill are computed once (`CompressedCache.prefill_analyses`). Every arm × ratio then gets a cache sharing
those statistics (`CompressedCache.sharing`) and `generate()` greedily decodes the last prompt token and the
short answer through it: the cache compresses on that first step, so the first answer token already sees only
the kept entries (eval's protocol, README "Deviations"). `full` is decoded once and stands for every ratio.

Each finished example's rows are kept under checkpoints/real_eval/: an interrupted eval (Ctrl-C, SIGTERM,
`timeout 2h icml kv-compress eval RUN`) continues where it stopped when `icml kv-compress eval RUN` is run again.
"""
from __future__ import annotations

import json
import shutil
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from icml.cli.errors import UsageError
from icml.cli.results import write_frame
from icml.cli.runstore import atomic_write_json
from icml.cli.threads import intra_op_threads
from icml.methods.kv_compress import real_tasks as rt
from icml.methods.kv_compress.evaluation import charged_ms, normalize_answer, score_metric, token_f1, variant_spec
from icml.methods.kv_compress.model import sliding_window

FOLDER = "real_eval"  # under the run's checkpoints/
MEANS = ["exact_match", "token_f1", "item_recall", "kl_to_full", "kept_entries", "kept_fraction", "memory_bytes",
         "overhead_ms", "decode_ms", "new_tokens", "budget_cv", "mean_entropy"]
PAIRED_WITH = "snapkv"  # every EntroKV arm's paired bootstrap CI is of (arm − SnapKV)


# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------
def lengths(cfg) -> dict[str, int]:
    return {"passkey": cfg.real.tokens, "passkey_long": cfg.real.tokens_long, "multikey": cfg.real.tokens,
            "aggregation": cfg.real.tokens}


def examples(cfg, tokenizer, seed: int, stream: str, n_per_task: int) -> list[rt.RealExample]:
    return rt.real_set(cfg.real.tasks, n_per_task, seed, stream, rt.token_counter(tokenizer), lengths(cfg),
                       cfg.real.needles, cfg.real.facts)


def calibration_examples(cfg, tokenizer, seed: int, n: int) -> list[rt.RealExample]:
    """n held-apart prompts of their own stream ("calibration"; eval scores "test"), the tasks in turn."""
    per_task = -(-n // len(cfg.real.tasks))
    pool = examples(cfg, tokenizer, seed, "calibration", per_task)
    return sorted(pool, key=lambda e: (e.example_id, cfg.real.tasks.index(e.task)))[:n]


def check(model, tokenizer, batch: list[rt.RealExample], cfg, source: str) -> list[list[int]]:
    """The prompts' token ids; a model without a chat template, a prompt not longer than the observation
    window, or one past a sliding window is refused in one line."""
    try:
        prompts = [rt.prompt_ids(tokenizer, e) for e in batch]
    except ValueError as exc:
        raise UsageError(f"--model '{cfg.model}': {exc}", "give an instruct checkpoint with a chat template") from None
    window = sliding_window(model.config)
    for example, ids in zip(batch, prompts):
        if len(ids) - 1 <= cfg.window:
            raise UsageError(f"{source} prompt {example.task} {example.example_id} has {len(ids)} tokens, not "
                             f"longer than the observation window ({cfg.window}) + 1",
                             "raise --set real.tokens= or lower --set window=")
        if window is not None and len(ids) + cfg.max_new_tokens > window:
            raise UsageError(f"{source} prompt {example.task} {example.example_id} needs "
                             f"{len(ids) + cfg.max_new_tokens} positions, past this checkpoint's sliding window "
                             f"({window}), which kv-compress does not model", "lower --set real.tokens=")
    return prompts


# ---------------------------------------------------------------------------------------------
# One prefill, many arms
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def record(model, ids: torch.Tensor, cfg, column_sums: bool):
    """The prefill of `ids` [1, N] but its last token, through a recording CompressedCache (never compressed
    itself): every arm's cache is made from it with `CompressedCache.sharing`."""
    from icml.methods.kv_compress.hf_cache import CompressedCache

    recorder = CompressedCache(model, "full", ratio=1.0, config=cfg, column_sums=column_sums)
    prefix = ids[:, :-1]
    model(input_ids=prefix, attention_mask=torch.ones_like(prefix), cache=recorder, use_cache=True,
          logits_to_keep=1)
    return recorder


def mean_entropy(model, tokenizer, batch: list[rt.RealExample], cfg, device: str) -> float:
    """H̄: the mean of H_l^h over the prompts, layers and KV heads (question-aware prefill, as eval's)."""
    maps = []
    for ids in check(model, tokenizer, batch, cfg, "calibration"):
        recorder = record(model, torch.tensor([ids], device=device), cfg, column_sums=False)
        maps.append(recorder.prefill_analyses()[0].entropy)
    return float(np.mean(maps))


STOP = (".", "\n")  # the answer ends at its first full stop or line break: generation stops there


def first_sentence(text: str) -> str:
    """The generation up to its first full stop or line break (the full stop kept; the normalisation drops it)."""
    cut = min((text.index(stop) + (stop == ".") for stop in STOP if stop in text), default=len(text))
    return text[:cut].strip()


_STOPPING: dict[int, object] = {}


def stop_criteria(tokenizer):
    """transformers' StopStringCriteria for STOP, built once per tokenizer (0.1 s for SmolLM2's vocabulary)."""
    from transformers import StoppingCriteriaList
    from transformers.generation.stopping_criteria import StopStringCriteria

    key = id(tokenizer)
    if key not in _STOPPING:
        _STOPPING.clear()
        _STOPPING[key] = (tokenizer, StoppingCriteriaList([StopStringCriteria(tokenizer, list(STOP))]))
    return _STOPPING[key][1]


@torch.no_grad()
def decode(model, tokenizer, ids: torch.Tensor, cache, max_new_tokens: int) -> dict:
    """Greedy `generate()` through `cache` (it decodes the prompt's last token first) until EOS, a full stop or a
    line break: the answer (`first_sentence`), the whole generation, the log-probabilities of the first answer
    token, the tokens generated and the wall time."""
    from transformers import GenerationConfig

    eos = model.generation_config.eos_token_id
    eos = tokenizer.eos_token_id if eos is None else eos
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
                              pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
                              output_logits=True, return_dict_in_generate=True)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, generation_config=config,
                         stopping_criteria=stop_criteria(tokenizer))
    ms = 1000 * (time.perf_counter() - start)
    new = out.sequences[0, ids.shape[1]:]
    generation = tokenizer.decode(new, skip_special_tokens=True)
    return {"text": first_sentence(generation), "generation": generation, "new_tokens": int(new.numel()),
            "first": out.logits[0][0].float().log_softmax(-1), "decode_ms": ms}


def item_recall(prediction: str, items: tuple[str, ...]) -> float:
    """The share of the answer's items (the key, each number) found as whole words in the normalised answer:
    RULER's string_match_all."""
    words = f" {normalize_answer(prediction)} "
    return float(np.mean([f" {normalize_answer(item)} " in words for item in items]))


def scores(prediction: str, example: rt.RealExample) -> dict:
    """exact_match: the normalised answer equals a reference's; token_f1: LongBench's F1, best reference."""
    return {"exact_match": float(any(normalize_answer(prediction) == normalize_answer(r) for r in example.answers)),
            "token_f1": max(token_f1(prediction, r) for r in example.answers),
            "item_recall": item_recall(prediction, example.items)}


def evaluate_example(model, tokenizer, example: rt.RealExample, ids: list[int], cfg, specs, ratios: list[float],
                     h_bar: float | None, device: str) -> tuple[list[dict], list[dict]]:
    """Per-(arm, ratio) result rows and allocation rows of one example, from one prefill."""
    from icml.methods.kv_compress.hf_cache import CompressedCache

    prompt = torch.tensor([ids], device=device)
    start = time.perf_counter()
    recorder = record(model, prompt, cfg, column_sums=any(spec.operator == "h2o" for spec in specs))
    prefill_ms = 1000 * (time.perf_counter() - start)
    analysis = recorder.prefill_analyses()[0]
    n = prompt.shape[1] - 1
    base = {"task": example.task, "example_id": example.example_id, "prompt_tokens": prompt.shape[1],
            "depth": float(np.mean([example.depths[i] for i in example.asked])), "answer": example.answer,
            "prefill_ms": prefill_ms}
    full = None
    rows, allocations = [], []
    for spec in specs:
        for ratio in ([1.0] if spec.allocation == "full" else ratios):
            cache = CompressedCache.sharing(recorder, model, spec.name, ratio, h_bar, cfg)
            outcome = decode(model, tokenizer, prompt, cache, cfg.max_new_tokens)
            if spec.allocation == "full":
                full = outcome
            selection = cache.selection[0]
            L, n_kv = selection.budget.shape
            entries = sum(len(kept) for heads in selection.kept for kept in heads)
            budgets = selection.budget.astype(float)
            kl = float((full["first"].exp() * (full["first"] - outcome["first"])).sum()) if full else np.nan
            row = {**base, "variant": spec.name, **scores(outcome["text"], example), "prediction": outcome["text"],
                   "generation": outcome["generation"],
                   "kl_to_full": kl if spec.allocation != "full" else 0.0, "kept_entries": entries,
                   "kept_fraction": entries / (L * n_kv * n), "memory_bytes": cache.compressed_bytes,
                   "overhead_ms": cache.compress_ms + charged_ms(analysis, spec), "decode_ms": outcome["decode_ms"],
                   "new_tokens": outcome["new_tokens"], "budget_cv": budgets.std() / budgets.mean(),
                   "mean_entropy": float(analysis.entropy.mean())}
            # full keeps everything whatever the ratio: its one decode stands for every ratio of the grid
            for r in (ratios if spec.allocation == "full" else [ratio]):
                rows.append({**row, "ratio": r})
                allocations += allocation_rows(spec, example, r, analysis, selection)
            del cache
    if full is None:
        raise ValueError("task_set=real needs the variant full")
    return rows, allocations


def allocation_rows(spec, example, ratio, analysis, selection) -> list[dict]:
    L, n_kv = selection.budget.shape
    return [{"variant": spec.name, "task": example.task, "ratio": ratio, "example_id": example.example_id,
             "layer": layer, "kv_head": head, "entropy": float(analysis.entropy[layer, head]),
             "signal": float(selection.signal[layer, head]) if selection.signal is not None else np.nan,
             "budget_raw": float(selection.budget_raw[layer, head]), "budget": int(selection.budget[layer, head]),
             "kept": len(selection.kept[layer][head])}
            for layer in range(L) for head in range(n_kv)]


def order_specs(specs):
    """full first (its first-token distribution is every KL's reference)."""
    return sorted(specs, key=lambda spec: spec.allocation != "full")


# ---------------------------------------------------------------------------------------------
# eval: resumable, example by example
# ---------------------------------------------------------------------------------------------
def evaluate(ctx, model, tokenizer, h_bar: float | None) -> None:
    from icml.methods.kv_compress.pipeline import summary_tags

    cfg = ctx.config
    specs = order_specs([variant_spec(name, cfg) for name in cfg.variants])
    batch = examples(cfg, tokenizer, ctx.seed, "test", cfg.n_per_task)
    prompts = check(model, tokenizer, batch, cfg, "test")
    folder = ctx.checkpoints / FOLDER
    meta = {"h_bar": h_bar, "variants": list(cfg.variants), "ratios": list(cfg.ratios), "seed": ctx.seed,
            "model": str(cfg.model)}
    meta_path = folder / "meta.json"
    if folder.exists() and (not meta_path.exists() or json.loads(meta_path.read_text()) != meta):
        ctx.log(f"{folder}: kept results were made with another H̄ or grid: starting over")
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(meta_path, meta)
    done = [e for e in batch if _rows_path(folder, e).exists()]
    sizes = {task: max(len(ids) for e, ids in zip(batch, prompts) if e.task == task) for task in cfg.real.tasks}
    ctx.log(f"{len(batch)} examples ({', '.join(f'{t} ≤ {sizes[t]} tokens' for t in cfg.real.tasks)}) × "
            f"{len(cfg.ratios)} ratios × {len(specs)} arms through generate(); H̄ = {h_bar}"
            + (f"; {len(done)} done before, kept in {folder}" if done else ""))
    with ctx.progress("examples (one prefill, every arm)", len(batch)) as advance, intra_op_threads(cfg.real.threads), \
            sigterm_interrupts():
        advance(len(done))
        for example, ids in zip(batch, prompts):
            path = _rows_path(folder, example)
            if path.exists():
                continue
            rows, allocations = evaluate_example(model, tokenizer, example, ids, cfg, specs, cfg.ratios, h_bar,
                                                 ctx.device)
            write_frame(_alloc_path(folder, example), pd.DataFrame(allocations))
            write_frame(path, pd.DataFrame(rows))  # written last: its presence marks the example done
            advance(1)
    per_example = pd.concat([pd.read_parquet(_rows_path(folder, e)) for e in batch], ignore_index=True)
    allocation_frame = pd.concat([pd.read_parquet(_alloc_path(folder, e)) for e in batch], ignore_index=True)
    allocation_frame.insert(0, "run_id", ctx.run.path.name)
    ctx.record(summary_rows(per_example, cfg, ctx.seed, summary_tags(cfg, specs)), split="test")
    ctx.write_table("allocations", allocation_frame)
    ctx.write_table("examples", per_example)


@contextmanager
def sigterm_interrupts():
    """SIGTERM (what `timeout` and `kill` send) stops the eval as Ctrl-C does: the finished examples stay kept
    and the run is marked interrupted. (A job started with `&` ignores SIGINT, so `timeout -s INT` would not.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _rows_path(folder: Path, example) -> Path:
    return folder / f"{example.task}-{example.example_id:04d}.parquet"


def _alloc_path(folder: Path, example) -> Path:
    return folder / f"{example.task}-{example.example_id:04d}-allocations.parquet"


def summary_rows(per_example: pd.DataFrame, cfg, seed: int, tags) -> list[dict]:
    """Means per (arm, task, ratio), retention (of the run's score, token F1 at the preset) against full,
    and the paired bootstrap CI of each EntroKV arm − SnapKV on exact match and token F1."""
    from icml.methods.kv_compress.pipeline import _bootstrap

    score = score_metric(cfg)
    means = per_example.groupby(["variant", "task", "ratio"], sort=False)[MEANS].mean().reset_index()
    full_score = per_example[per_example["variant"] == "full"].groupby("task")[score].mean()
    rows = []
    for record in means.to_dict("records"):
        base = tags(record["variant"], record["task"], record["ratio"])
        rows += [{**base, "metric": metric, "value": float(record[metric])} for metric in MEANS]
        denominator = full_score.get(record["task"], np.nan)
        retention = record[score] / denominator if denominator and denominator > 0 else np.nan
        rows.append({**base, "metric": "retention", "value": float(retention)})
    prefill = per_example[per_example["variant"] == "full"].groupby(["task", "ratio"])["prefill_ms"].mean()
    rows += [{**tags("full", task, ratio), "metric": "prefill_ms", "value": float(value)}
             for (task, ratio), value in prefill.items()]
    arms = [v for v in per_example["variant"].unique() if v.startswith("entrokv")]
    if PAIRED_WITH in set(per_example["variant"]):
        for arm in arms:
            for metric, name in (("exact_match", "em_diff"), ("token_f1", "token_f1_diff")):
                wide = per_example[per_example["variant"].isin([arm, PAIRED_WITH])].pivot_table(
                    index=["task", "ratio", "example_id"], columns="variant", values=metric)
                for (task, ratio), group in wide.groupby(level=["task", "ratio"]):
                    low, high = _bootstrap((group[arm] - group[PAIRED_WITH]).to_numpy(), cfg.bootstrap, seed)
                    rows += [{**tags(arm, task, ratio), "metric": f"{name}_ci_low", "value": low},
                             {**tags(arm, task, ratio), "metric": f"{name}_ci_high", "value": high}]
    return rows
