"""The spectral-optim lifecycle: train runs the LR grid (variants × multipliers) from shared
initial weights and batches; eval measures every run's final val_loss on more batches, summarises
the grid and runs the Ψ_p accuracy/speed study."""
from __future__ import annotations

from pathlib import Path

from icml.cli import distributed
from icml.cli.errors import IcmlError
from icml.cli.lifecycle import RunContext
from icml.cli.runstore import atomic_torch_save, load_checkpoint
from icml.cli.workers import run_in_workers


def _grid(ctx: RunContext):
    from icml.methods.spectral_optim.lm import prepare_grid

    try:
        return prepare_grid(ctx.config, ctx.seed)
    except ValueError as exc:  # an unusable corpus, data file or --model directory
        raise IcmlError(str(exc)) from None


def run_path(ctx: RunContext, variant: str, multiplier: float) -> Path:
    return ctx.checkpoints / "runs" / f"{variant}_x{multiplier:g}.pt"



# The grid of this process: the parent's, or one a worker rebuilt for its first job.
_worker_grid = None


def _train_job(cfg, seed: int, variant: str, multiplier: float, device: str, path: Path) -> tuple[list, dict]:
    """One grid run, in this process or a worker: train, save its checkpoint, return rows + summary.

    A worker rebuilds the grid from (cfg, seed) — deterministic, so every run still starts from the
    same weights and batches — and keeps it for its next jobs.
    """
    from icml.cli.threads import single_thread
    from icml.methods.spectral_optim.lm import prepare_grid, train_one

    global _worker_grid
    if _worker_grid is None:
        _worker_grid = prepare_grid(cfg, seed)
    with single_thread():  # small matrices, and step_ms that the other process cannot stall
        rows, state = train_one(cfg, variant, multiplier, _worker_grid.model_init, _worker_grid.batches, device)
    if distributed.is_main():  # under torchrun every rank holds the same weights; rank 0 writes them
        atomic_torch_save({"variant": variant, "lr_multiplier": multiplier, **state}, path)
    return rows, {k: state[k] for k in ("final_val_loss", "diverged", "step_ms")}


def train(ctx: RunContext) -> None:
    cfg = ctx.config
    global _worker_grid
    _worker_grid = grid = _grid(ctx)
    ctx.log(f"data: {grid.data.source}; vocab {grid.vocab_size}; "
            f"{sum(p.numel() for p in grid.model_init.parameters()):,} parameters; "
            + (f"{distributed.world_size()} torchrun ranks (data-parallel)" if distributed.launched()
               else f"{cfg.workers} worker(s)"))
    recorded = ctx.metrics()
    timed = recorded[recorded["metric"] == "step_ms"]
    finished = set(zip(timed["variant"], timed["lr_multiplier"]))
    jobs = [(variant, float(multiplier)) for variant in cfg.variants for multiplier in cfg.lr_multipliers
            if not ((variant, float(multiplier)) in finished and run_path(ctx, variant, multiplier).exists())]
    jobs = distributed.from_main(jobs)  # under torchrun: what rank 0's run directory still lacks
    skipped = len(cfg.variants) * len(cfg.lr_multipliers) - len(jobs)  # --resume: a whole run is the unit

    def done(variant, multiplier, rows, summary):
        ctx.record(rows)
        ctx.log(f"  {variant} ×{multiplier:g}: val_loss {summary['final_val_loss']:.3f}"
                f"{' (diverged)' if summary['diverged'] else ''}, {summary['step_ms']:.1f} ms/step")

    with ctx.progress("LR grid (runs)", skipped + len(jobs)) as advance:
        advance(skipped)
        # recorded here, in the parent; results do not depend on which worker ran what
        run_in_workers(cfg.workers, [((variant, multiplier), _train_job,
                                      (cfg, ctx.seed, variant, multiplier, ctx.device, run_path(ctx, variant, multiplier)))
                                     for variant, multiplier in jobs],
                       lambda key, result: (done(*key, *result), advance(1)),
                       gpus=1 if ctx.device == "cuda" else 0)  # on Ray: a GPU per run when training on GPUs
    if distributed.is_main():
        save_best_checkpoints(ctx, grid)


def save_best_checkpoints(ctx: RunContext, grid) -> None:
    """checkpoints/best/<variant>/: the best-LR run of each variant, loadable with from_pretrained."""
    import copy

    import torch
    from transformers.utils import logging as hf_logging

    from icml.methods.spectral_optim.lm import grid_summary

    hf_logging.disable_progress_bar()  # our own progress is on stderr already
    for row in grid_summary(ctx.metrics(), grid.vocab_size):
        if row["metric"] != "best_val_loss":
            continue
        state = load_checkpoint(run_path(ctx, row["variant"], row["lr_multiplier"]))
        model = copy.deepcopy(grid.model_init)
        model.load_state_dict(state["model_state"])
        folder = ctx.checkpoints / "best" / row["variant"]
        model.save_pretrained(folder)
        grid.data.tokenizer.save_pretrained(folder)


def evaluate(ctx: RunContext) -> None:
    import copy

    import pandas as pd
    import torch

    from icml.cli.threads import single_thread
    from icml.methods.spectral_optim.config import parse_size
    from icml.methods.spectral_optim.lm import RunSettings, final_val_loss, grid_summary
    from icml.methods.spectral_optim.psi import psi_benchmark

    cfg = ctx.config
    grid = _grid(ctx)
    model = copy.deepcopy(grid.model_init).to(ctx.device)
    final_rows = []
    jobs = [(variant, multiplier) for variant in cfg.variants for multiplier in cfg.lr_multipliers]
    with ctx.progress("final val_loss (runs)", len(jobs)) as advance:
        for variant, multiplier in jobs:
            path = run_path(ctx, variant, multiplier)
            if not path.exists():
                raise IcmlError(f"checkpoint {path} is missing",
                                f"re-train the run: icml spectral-optim train --resume {ctx.run.path}")
            state = load_checkpoint(path, map_location=ctx.device)
            model.load_state_dict(state["model_state"])
            loss = final_val_loss(model, grid.batches, cfg.eval_val_batches, cfg.micro_batch)
            final_rows.append({**RunSettings.of(cfg, variant, multiplier).tags(), "metric": "val_loss",
                               "value": loss, "step": state["steps_done"], "split": "val"})
            advance(1)
    ctx.record(final_rows)
    train_rows = ctx.metrics()
    train_rows = train_rows[train_rows["phase"] == "train"]
    summary_input = pd.concat([train_rows, pd.DataFrame(final_rows).assign(phase="eval")], ignore_index=True)
    ctx.record(grid_summary(summary_input, grid.vocab_size))

    sizes = [parse_size(size) for size in cfg.psi_sizes]
    with ctx.progress("Ψ_p accuracy and speed", None), single_thread():
        ctx.record(psi_benchmark(sizes, cfg.psi_kappas, repeats=cfg.psi_repeats, seed=ctx.seed,
                                 ns_iters=cfg.ns_iters), split="bench")
