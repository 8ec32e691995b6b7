"""The language-model benchmark of `icml spectral-optim`: one optimizer run, and the grid summary.

A grid is variants × LR multipliers. Every run of it starts from the same initial weights and
sees the same batches in the same order (`prepare_grid` builds both once), so the runs differ
only in the optimizer. `train_one` trains one run; `grid_summary` turns the final val losses of
all runs into the paper's stability numbers (best loss, LR spread, divergences, family spreads).
"""
from __future__ import annotations

import contextlib
import copy
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import pandas as pd
import torch

from icml.cli import distributed
from icml.methods.spectral_optim.data import LMBatches, LMData, prepare_data
from icml.methods.spectral_optim.model import initial_model, load_causal_lm, next_token_loss, uniform_loss
from icml.methods.spectral_optim.optim import (PAPER_VARIANTS, VARIANTS, SpectralOptimizer, lr_schedule,
                                               optimizer_state_bytes)


# ---------------------------------------------------------------------------------------------
# What a grid shares
# ---------------------------------------------------------------------------------------------
@dataclass
class Grid:
    """The data, batch order and initial weights every run of a grid shares."""

    data: LMData
    model_init: torch.nn.Module
    vocab_size: int  # classes of the model's softmax: ln(vocab_size) is the loss of a diverged run

    @property
    def batches(self) -> LMBatches:
        return self.data.batches


def output_vocab_size(model) -> int:
    return model.get_output_embeddings().weight.shape[0]


def prepare_grid(cfg, seed: int) -> Grid:
    """The corpus, tokenizer, batches and initial model of `cfg` for run seed `seed`.

    With `cfg.model` the checkpoint's own tokenizer encodes the corpus and the grid fine-tunes
    the checkpoint; otherwise a character tokenizer is built over the corpus and the tiny GPT-2
    is initialised with `seed`. Deterministic: eval can rebuild exactly what train used.
    """
    pretrained, tokenizer = load_causal_lm(cfg.model) if cfg.model else (None, None)
    data = prepare_data(cfg, seed, tokenizer)
    model_init = initial_model(cfg, data.vocab_size, seed, pretrained)
    return Grid(data=data, model_init=model_init, vocab_size=output_vocab_size(model_init))


# ---------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------
@dataclass
class RunSettings:
    """The learning rates of one (variant, multiplier) run: the multiplier scales the paper's
    matrix LR only; the vector LR and both cosine floors are set separately (spec: one LR for all
    variants, or a vector LR tied to the matrix LR, are pitfalls)."""

    variant: str
    family: str
    p: float
    lr_multiplier: float
    lr_matrix: float
    lr_vector: float
    min_lr_matrix: float
    min_lr_vector: float
    warmup_steps: int

    @classmethod
    def of(cls, cfg, variant: str, lr_multiplier: float) -> "RunSettings":
        spec = VARIANTS[variant]
        lr_matrix = spec.lr_matrix * lr_multiplier
        lr_vector = cfg.lr_vector if cfg.lr_vector is not None else spec.lr_vector

        def floor(peak: float) -> float:
            return cfg.min_lr_frac * peak if cfg.min_lr_frac is not None else min(spec.min_lr, peak)

        return cls(variant=variant, family=spec.family, p=spec.p, lr_multiplier=float(lr_multiplier),
                   lr_matrix=lr_matrix, lr_vector=lr_vector, min_lr_matrix=floor(lr_matrix),
                   min_lr_vector=floor(lr_vector), warmup_steps=round(cfg.warmup_frac * cfg.steps))

    def tags(self) -> dict:
        return {"variant": self.variant, "family": self.family, "p": self.p, "lr": self.lr_matrix,
                "lr_multiplier": self.lr_multiplier, "lr_vector": self.lr_vector}


def build_optimizer(cfg, settings: RunSettings, model) -> SpectralOptimizer:
    return SpectralOptimizer(model, settings.variant, lr_matrix=settings.lr_matrix, lr_vector=settings.lr_vector,
                             betas=tuple(cfg.betas), momentum=cfg.momentum, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, ns_iters=cfg.ns_iters, split_qkv=cfg.split_qkv,
                             embeddings_as_vectors=cfg.embeddings_as_vectors)


def set_learning_rates(optimizer, settings: RunSettings, step: int, total_steps: int) -> None:
    """Warmup then cosine, per param group, each to its own floor."""
    for group in optimizer.param_groups:
        if group["kind"] == "matrix":
            peak, floor = settings.lr_matrix, settings.min_lr_matrix
        else:
            peak, floor = settings.lr_vector, settings.min_lr_vector
        group["lr"] = lr_schedule(step, total_steps, peak, settings.warmup_steps, floor)


def mean_loss(model, windows: torch.Tensor, micro_batch: int | None = None) -> torch.Tensor:
    """Mean next-token loss of `windows`, micro_batch windows per forward (no gradient kept between parts:
    call it under no_grad)."""
    if not micro_batch or micro_batch >= windows.shape[0]:
        return next_token_loss(model, windows)
    return sum(next_token_loss(model, part) * (part.shape[0] / windows.shape[0]) for part in windows.split(micro_batch))


def accumulate_gradients(model, windows: torch.Tensor, micro_batch: int | None = None) -> torch.Tensor:
    """Backward of the mean next-token loss of `windows`, micro_batch windows at a time: each part's loss is
    weighted by its share of the windows, so the summed gradients are the whole batch's. Returns the batch's
    mean loss, detached. Under DDP the gradients are averaged over the ranks on the last part only."""
    if not micro_batch or micro_batch >= windows.shape[0]:
        loss = next_token_loss(model, windows)
        loss.backward()
        return loss.detach()
    parts = windows.split(micro_batch)
    total = None
    for i, part in enumerate(parts):
        syncing = i == len(parts) - 1 or not hasattr(model, "no_sync")
        with contextlib.nullcontext() if syncing else model.no_sync():
            loss = next_token_loss(model, part) * (part.shape[0] / windows.shape[0])
            loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def final_val_loss(model, batches: LMBatches, n_batches: int, micro_batch: int | None = None) -> float:
    """Mean next-token cross-entropy (nats) over the first `n_batches` fixed val batches; the same
    batches for every run of a grid, micro_batch windows per forward. Leaves the model in train mode.
    Under torchrun each rank takes its slice of every batch and the ranks' means are averaged: the same
    value on every rank."""
    device = next(model.parameters()).device
    model.eval()
    with torch.no_grad():
        total = sum(mean_loss(model, distributed.shard(batches.val[i]).to(device), micro_batch).item()
                    for i in range(n_batches))
    model.train()
    return distributed.mean(total / n_batches)


def _synchronise(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def train_one(cfg, variant: str, lr_multiplier: float, model_init, batches: LMBatches, device,
              progress: Callable[[float], None] | None = None) -> tuple[list[dict], dict]:
    """One run of the grid from a copy of `model_init` (which is left untouched).

    Step convention: train_loss at step s is the loss of train batch s before update s;
    val_loss at step s is measured after s updates (s = 0, every cfg.val_every, and cfg.steps).
    A non-finite loss or gradient norm stops the run early and marks it diverged; so does a final
    val_loss above the initial one (the spec's definition). `progress(n)` advances by n steps.
    Under torchrun the model trains data-parallel (cli/distributed.py): each rank takes its slice of
    every global batch, gradients are averaged, and every rank records the global-batch losses.

    Returns (rows, state): metric rows tagged with the run's settings, and
    state = {model_state, initial_val_loss, final_val_loss, diverged, steps_done, step_ms,
    optimizer_state_bytes, train_seconds}.
    """
    settings = RunSettings.of(cfg, variant, lr_multiplier)
    tags = settings.tags()
    rows: list[dict] = []

    def record(metric: str, value: float, step: int, split: str) -> None:
        rows.append({**tags, "metric": metric, "value": float(value), "step": int(step), "split": split})

    model = copy.deepcopy(model_init).to(device)
    model.train()
    optimizer = build_optimizer(cfg, settings, model)  # on the bare model: Ψ_p layouts by its names
    trainable = [param for param in model.parameters() if param.requires_grad]
    replicas = distributed.wrap(model)  # DistributedDataParallel under torchrun; the model itself otherwise

    started = time.perf_counter()
    initial_val = final_val_loss(model, batches, cfg.val_batches, cfg.micro_batch)
    record("val_loss", initial_val, 0, "val")
    last_val = initial_val
    diverged = not math.isfinite(initial_val)
    step_seconds: list[float] = []
    steps_done = 0
    for step in range(cfg.steps):
        if diverged:
            break
        set_learning_rates(optimizer, settings, step, cfg.steps)
        optimizer.zero_grad(set_to_none=True)
        loss = accumulate_gradients(replicas, distributed.shard(batches.train[step]).to(device), cfg.micro_batch)
        loss_value = distributed.mean(loss.item())  # the global batch's: every rank stops alike
        if not math.isfinite(loss_value):
            record("train_loss", loss_value, step, "train")  # the non-finite value itself, for the curves
            diverged = True
            break
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip)
        if not math.isfinite(grad_norm.item()):
            record("train_loss", loss_value, step, "train")
            diverged = True
            break
        _synchronise(device)
        tick = time.perf_counter()
        optimizer.step()
        _synchronise(device)
        step_seconds.append(time.perf_counter() - tick)
        steps_done = step + 1

        if step % cfg.train_log_every == 0 or steps_done == cfg.steps:
            record("train_loss", loss_value, step, "train")
        if steps_done % cfg.val_every == 0 or steps_done == cfg.steps:
            last_val = final_val_loss(model, batches, cfg.val_batches, cfg.micro_batch)
            record("val_loss", last_val, steps_done, "val")
            diverged = not math.isfinite(last_val)
        if progress is not None:
            progress(1)
    if progress is not None and steps_done < cfg.steps:
        progress(cfg.steps - steps_done)  # an early stop still completes the run's share of the bar

    diverged = diverged or last_val > initial_val
    step_ms = 1000.0 * sum(step_seconds) / len(step_seconds) if step_seconds else float("nan")
    state_bytes = optimizer_state_bytes(optimizer)
    record("step_ms", step_ms, steps_done, "train")
    record("optimizer_state_bytes", state_bytes, steps_done, "train")
    record("diverged", float(diverged), steps_done, "train")  # per run: 0 or 1
    state = {
        "model_state": {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()},
        "initial_val_loss": initial_val,
        "final_val_loss": last_val,
        "diverged": diverged,
        "steps_done": steps_done,
        "step_ms": step_ms,
        "optimizer_state_bytes": state_bytes,
        "train_seconds": time.perf_counter() - started,
    }
    return rows, state


# ---------------------------------------------------------------------------------------------
# The grid summary
# ---------------------------------------------------------------------------------------------
def _final_runs(frame: pd.DataFrame, vocab_size: int) -> pd.DataFrame:
    """One row per (variant, lr_multiplier) run: final and initial val_loss and the diverged flag.

    The final val_loss is the last-step `val_loss` of the eval phase when the frame has one for
    the run (more batches), else of training. A run is diverged if any of its losses is
    non-finite, its final val_loss exceeds its initial (step-0) one, or `train_one` flagged it;
    a diverged run's loss counts as ln V in the summary.
    """
    runs = frame[frame["lr_multiplier"].notna()]
    has_phase = "phase" in runs.columns
    out = []
    for (variant, multiplier), run in runs.groupby(["variant", "lr_multiplier"], sort=False):
        losses = run[run["metric"].isin(["train_loss", "val_loss"])]
        val = run[run["metric"] == "val_loss"]
        if val.empty:
            continue
        final_pool = val
        if has_phase and (val["phase"] == "eval").any():
            final_pool = val[val["phase"] == "eval"]
        final = final_pool.loc[final_pool["step"].idxmax()]
        training_val = val[val["phase"] != "eval"] if has_phase else val
        initial = training_val.loc[training_val["step"] == 0, "value"]
        flagged = run.loc[run["metric"] == "diverged", "value"]
        diverged = (not losses["value"].map(math.isfinite).all()
                    or (not initial.empty and final["value"] > initial.iloc[0])
                    or bool((flagged > 0.5).any()))
        out.append({"variant": variant, "lr_multiplier": float(multiplier), "lr": float(final["lr"]),
                    "lr_vector": final.get("lr_vector"), "family": final["family"], "p": final["p"],
                    "step": int(final["step"]), "final_val_loss": float(final["value"]), "diverged": diverged,
                    "effective_loss": uniform_loss(vocab_size) if diverged else float(final["value"])})
    return pd.DataFrame(out)


def grid_summary(rows_or_frame: Iterable[dict] | pd.DataFrame, vocab_size: int) -> list[dict]:
    """Per variant: `best_val_loss` (min over the LR grid of the final val_loss; tagged with the
    argmin's `lr`, `lr_multiplier`), `lr_spread` (max − min over the grid) and `diverged` (count),
    with diverged runs counting as ln(vocab_size); per family (variant = "adam" | "msgd"):
    `family_best_spread` = max − min of the best_val_loss of the family's paper variants (emitted
    when a family has two or more; ablations are left out of it).

    Input: the rows of `train_one` (and, optionally, eval-phase `val_loss` rows with the same
    tags), as a list of dicts or a DataFrame.
    """
    frame = rows_or_frame if isinstance(rows_or_frame, pd.DataFrame) else pd.DataFrame(list(rows_or_frame))
    runs = _final_runs(frame, vocab_size)
    if runs.empty:
        return []
    rows: list[dict] = []
    best_by_variant: dict[str, float] = {}
    for variant, grid in runs.groupby("variant", sort=False):
        # Ties (e.g. every LR diverged, all at ln V) go to the smallest LR, whatever order the
        # runs finished in: with workers > 1 rows arrive in completion order.
        grid = grid.sort_values("lr_multiplier", kind="stable")
        best = grid.loc[grid["effective_loss"].idxmin()]
        common = {"variant": variant, "family": best["family"], "p": float(best["p"]), "split": "val",
                  "step": int(grid["step"].max())}
        rows.append({**common, "metric": "best_val_loss", "value": float(best["effective_loss"]),
                     "lr": float(best["lr"]), "lr_multiplier": float(best["lr_multiplier"]),
                     "lr_vector": best["lr_vector"]})
        rows.append({**common, "metric": "lr_spread",
                     "value": float(grid["effective_loss"].max() - grid["effective_loss"].min())})
        rows.append({**common, "metric": "diverged", "value": float(grid["diverged"].sum())})
        best_by_variant[variant] = float(best["effective_loss"])
    for family in ("adam", "msgd"):
        members = [best for variant, best in best_by_variant.items()
                   if variant in PAPER_VARIANTS and PAPER_VARIANTS[variant].family == family]
        if len(members) >= 2:
            rows.append({"variant": family, "family": family, "metric": "family_best_spread", "split": "val",
                         "step": int(runs["step"].max()), "value": max(members) - min(members)})
    return rows
