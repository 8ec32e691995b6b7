"""The rl-sgd lifecycle.

train: θ₀ (the cached SFT warm start of the tiny Llama, or `--model`), then every arm over its LR
grid — first the arms with absolute grids, then those whose grid multiplies another arm's best LR
(sgd_momentum, rmsprop, adam_nomomentum, sgd_bf16_master) — each run saving θ_T.
eval: greedy held-out accuracy of every snapshot, update densities, effective ranks, state bytes,
best-LR selection per arm, the AdamW − SGD gap per regime, and `param_updates.parquet`.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from icml.cli import distributed
from icml.cli.errors import IcmlError
from icml.cli.lifecycle import RunContext
from icml.cli.workers import run_in_workers
from icml.methods.rl_sgd.config import RELATIVE_TO

CACHE_VERSION = 1


def _cache_key(cfg, seed: int) -> str:
    from icml.cli.config import to_dict

    data_hash = hashlib.sha256(Path(cfg.data).read_bytes()).hexdigest() if cfg.data else None
    record = {"version": CACHE_VERSION, "seed": seed, "sft": to_dict(cfg.sft), "llama": to_dict(cfg.llama),
              "data": data_hash, "eval_problems": cfg.eval_problems, "held_out_frac": cfg.held_out_frac,
              "max_new_tokens": cfg.max_new_tokens, "digits": cfg.digits, "reward": cfg.reward, "chat": cfg.use_chat_template}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


def _files_hash(folder: Path) -> str:
    """A checkpoint directory's identity: its small files' bytes and its large files' names and sizes
    (reading multi-GB weight shards on every run would cost minutes)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        size = path.stat().st_size
        digest.update(f"{path.relative_to(folder).as_posix()}:{size}".encode())
        if size < 1 << 24:
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def prepare_theta0(ctx: RunContext) -> tuple[Path, str, list[dict]]:
    """(θ₀ directory, its hash, warm-start log). `--model` with warm_start auto/none is θ₀ itself;
    otherwise the SFT warm start, cached by config, data and seed under <runs>/rl-sgd/_cache/."""
    cfg, seed = ctx.config, ctx.seed
    warm = cfg.warm_start if cfg.warm_start != "auto" else ("none" if cfg.model else "sft")
    if warm == "none":
        if cfg.model is None:
            raise IcmlError("warm_start=none needs a trained policy", "pass --model DIR or use warm_start=sft")
        return Path(cfg.model), _files_hash(Path(cfg.model)), []
    key = _cache_key(cfg, seed) + ("-" + _files_hash(Path(cfg.model)) if cfg.model else "")
    folder = ctx.run.path.parent / "_cache" / f"sft-{key}"
    if (folder / "warm_start.json").exists():
        ctx.log(f"θ₀: cached SFT warm start {folder}")
        return folder, key, json.loads((folder / "warm_start.json").read_text())["history"]
    history = _train_theta0(ctx, folder)
    return folder, key, history


def _train_theta0(ctx: RunContext, folder: Path) -> list[dict]:
    import torch

    from icml.cli.threads import single_thread
    from icml.methods.rl_sgd import task as tasks
    from icml.methods.rl_sgd.model import load_policy, tiny_llama
    from icml.methods.rl_sgd.runs import make_task, warm_start

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the CLI draws its own progress
    cfg, seed = ctx.config, ctx.seed
    try:
        task = make_task(cfg, seed)
        if cfg.model:
            model, tokenizer = load_policy(cfg.model)
        else:
            words = tasks.words_of(task.train_pool) if task.train_pool else None
            tokenizer = tasks.build_tokenizer(words)
            specials = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                        "pad_token_id": tokenizer.pad_token_id}
            m = cfg.llama
            model = tiny_llama(len(tokenizer), m.hidden, m.layers, m.heads, m.kv_heads, m.intermediate,
                               m.max_position, specials, init_seed=seed)
    except ValueError as exc:
        raise IcmlError(str(exc)) from None
    if task.train_pool is None:
        train = tasks.sft_problems(seed, cfg.sft.problems, cfg.sft.three_digit_frac)
        band = tasks.problems_of(seed, tasks.STREAM_BAND, cfg.sft.check_problems, cfg.digits)
    else:
        train, band = task.train_pool, task.train_pool[:cfg.sft.check_problems]
    ctx.log(f"θ₀: SFT warm start ({sum(p.numel() for p in model.parameters()):,} parameters, "
            f"≤ {cfg.sft.max_steps} steps, band {cfg.sft.band})")
    with single_thread(), ctx.progress("SFT warm start (steps)", None):
        history = warm_start(model, tokenizer, train, band, task.reward, cfg.sft, seed, cfg.max_new_tokens,
                             cfg.use_chat_template, log=ctx.log)
    final = history[-1]["band_accuracy"]
    if cfg.sft.band_check and not cfg.sft.band[0] <= final <= cfg.sft.band[1]:
        ctx.log(f"θ₀: band-check accuracy {final:.3f} is outside the band {cfg.sft.band} (README: band stop rule)")
    staging = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    torch.save({n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}, staging / "theta_bf16.pt")
    (staging / "warm_start.json").write_text(json.dumps({"history": history}, indent=1))
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(staging, folder)  # atomic: a concurrent run that got there first wins
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return history


def _train_job(cfg, seed, arm, lr, theta0, out):
    from icml.cli.threads import single_thread
    from icml.methods.rl_sgd.runs import train_run

    with single_thread():
        return train_run(cfg, seed, arm, lr, theta0, out)


def best_lr(accuracies: dict[float, float]) -> float:
    """The LR of the highest accuracy; ties go to the smaller LR."""
    return min(accuracies, key=lambda lr: (-accuracies[lr], lr))


def grid_of(cfg, arm: str, best: dict[str, float]) -> list[float]:
    grid = getattr(cfg.grids, arm)
    base = RELATIVE_TO.get(arm)
    return [float(f"{best[base] * m:.6g}") for m in grid] if base else [float(lr) for lr in grid]


def train(ctx: RunContext) -> None:
    cfg, seed = ctx.config, ctx.seed
    # under torchrun θ₀ is rank 0's (the warm start trains there alone; the others wait) and every rank
    # reads it from rank 0's path: on several nodes --runs-dir must be on a filesystem they share
    with distributed.ranks_stop_together():  # if rank 0 fails there, its line alone is printed
        theta0, theta0_hash, history = distributed.from_main(prepare_theta0(ctx) if distributed.is_main() else None)
    ctx.run.update(theta0={"path": str(theta0), "hash": theta0_hash})
    recorded = ctx.metrics()
    if not ctx.resumed or recorded[recorded["variant"] == "warm_start"].empty:
        ctx.record([{"variant": "warm_start", "metric": k, "value": h[k], "step": h["step"], "split": split,
                     "regime": "sft"} for h in history for k, split in (("sft_loss", "train"),
                                                                          ("band_accuracy", "val"))])
    done = recorded[(recorded["metric"] == "accuracy") & (recorded["phase"] == "train")]
    accuracies = {(v, float(lr)): a for v, lr, a in zip(done["variant"], done["lr"], done["value"])
                  if (run_dir(ctx.checkpoints, v, lr) / "theta_bf16.pt").exists()}
    accuracies = distributed.from_main(accuracies)  # under torchrun: the runs rank 0's directory holds
    stages = [[a for a in cfg.arms if a not in RELATIVE_TO], [a for a in cfg.arms if a in RELATIVE_TO]]
    best: dict[str, float] = {}
    for stage in stages:
        jobs = [(arm, lr) for arm in stage for lr in grid_of(cfg, arm, best)]
        todo = [job for job in jobs if job not in accuracies]

        def done_job(key, result):
            rows, summary = result
            ctx.record(rows)
            accuracies[key] = summary["accuracy"]
            ctx.log(f"  {key[0]} lr {key[1]:.3g}: held-out accuracy {summary['accuracy']:.3f} "
                    f"after {summary['steps_done']} steps, {summary['wall_time_s']:.0f} s")

        with ctx.progress(f"runs ({', '.join(stage)})", len(jobs)) as advance:
            advance(len(jobs) - len(todo))
            try:
                run_in_workers(cfg.workers, [((arm, lr), _train_job,
                                              (cfg, seed, arm, lr, theta0, run_dir(ctx.checkpoints, arm, lr)))
                                             for arm, lr in todo],
                               lambda key, result: (done_job(key, result), advance(1)))
            except ValueError as exc:  # a user file or reward that fails at run time
                raise IcmlError(str(exc)) from None
        for arm in stage:
            best[arm] = best_lr({lr: accuracies[(arm, lr)] for lr in grid_of(cfg, arm, best)})


def run_dir(checkpoints: Path, arm: str, lr: float) -> Path:
    from icml.methods.rl_sgd.runs import run_dir as folder

    return folder(checkpoints, arm, lr)


def evaluate(ctx: RunContext) -> None:
    import pandas as pd
    import torch

    from icml.cli.threads import single_thread
    from icml.methods.rl_sgd.model import load_policy
    from icml.methods.rl_sgd.runs import accuracy, make_task, run_tags
    from icml.methods.rl_sgd.updates import summarise, tensor_updates

    cfg, seed = ctx.config, ctx.seed
    theta0 = Path(ctx.run.info().get("theta0", {}).get("path", ""))
    if not (theta0 / "config.json").exists():
        raise IcmlError(f"θ₀ checkpoint '{theta0}' of this run is missing",
                        f"re-train: icml rl-sgd train --config {ctx.run.config_path}")
    try:
        task = make_task(cfg, seed)
        model, tokenizer = load_policy(theta0)
    except ValueError as exc:
        raise IcmlError(str(exc)) from None
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_rows = ctx.metrics()
    train_rows = train_rows[train_rows["phase"] == "train"]
    grid = train_rows[train_rows["metric"] == "accuracy"][["variant", "lr"]].drop_duplicates()
    rows, tables, results = [], [], []
    with single_thread(), ctx.progress("snapshots", len(grid) + 1) as advance:
        acc0 = accuracy(model, tokenizer, task.held_out, task.reward, cfg.max_new_tokens, cfg.use_chat_template)
        rows.append({"variant": "theta0", "metric": "accuracy", "value": acc0, "split": "test"})
        advance(1)
        for arm, lr in grid.itertuples(index=False):
            folder = run_dir(ctx.checkpoints, arm, lr)
            if not (folder / "theta_master.pt").exists():
                raise IcmlError(f"snapshot {folder} is missing", f"re-train: icml rl-sgd train --resume {ctx.run.path}")
            master = torch.load(folder / "theta_master.pt", weights_only=True)
            meta = json.loads((folder / "run.json").read_text())
            model.load_state_dict({n: t.float() for n, t in master.items()}, strict=False)
            acc = accuracy(model, tokenizer, task.held_out, task.reward, cfg.max_new_tokens, cfg.use_chat_template)
            records = tensor_updates(start, master, tol=cfg.density_tol, rank_source=cfg.rank_source,
                                     energy=cfg.rank_energy)
            tags = run_tags(cfg, arm, lr)
            metrics = {"accuracy": acc, **summarise(records), "optimizer_state_bytes": meta["optimizer_state_bytes"],
                       "wall_time_s": meta["wall_time_s"]}
            results.append({**tags, **metrics})
            tables += [{"run_id": ctx.run.run_id, "variant": arm, "lr": float(lr), "regime": tags["regime"],
                        **{k: r[k] for k in ("param_name", "shape", "numel", "density_bf16", "density_tol",
                                             "density_fp32", "effective_rank_99", "effective_rank_99_bf16", "max_rank",
                                             "delta_fro")}}
                       for r in records]
            advance(1)
    model.load_state_dict(start, strict=False)
    frame = pd.DataFrame(results)
    for arm, group in frame.groupby("variant", sort=False):
        chosen = best_lr(dict(zip(group["lr"], group["accuracy"])))
        for result in group.to_dict("records"):
            selected = "true" if result["lr"] == chosen else "false"
            tags = {k: result[k] for k in ("variant", "optimizer", "lr", "regime", "master_dtype", "group_size")}
            rows += [{**tags, "selected": selected, "metric": m, "value": float(result[m]), "split": "test"}
                     for m in ("accuracy", "update_density_bf16", "update_density_bf16_matrices", "update_density_tol",
                               "update_density_fp32", "effective_rank_99", "effective_rank_99_bf16", "optimizer_state_bytes",
                               "wall_time_s")]
            if selected == "true":
                rows.append({**tags, "selected": "true", "metric": "best_accuracy", "value": float(result["accuracy"]),
                             "split": "test"})
    best = {r["variant"]: r["value"] for r in rows if r["metric"] == "best_accuracy"}
    for regime, (adam, sgd) in {"rl": ("adamw", "sgd"), "sft": ("sft_adamw", "sft_sgd")}.items():
        if adam in best and sgd in best:
            rows.append({"variant": f"{adam}-{sgd}", "regime": regime, "metric": "gap_adamw_minus_sgd",
                         "value": best[adam] - best[sgd], "split": "test"})
    ctx.record(rows)
    ctx.write_table("param_updates", pd.DataFrame(tables))
