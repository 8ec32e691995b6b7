"""Motive's attribution: masked flow-matching gradients at one shared (t*, ε*), projected, turned
into cosine influence, aggregated over queries by majority vote, and scored as retrieval.

A selector variant is a `Featurizer` setting (mask on/off, shared or fresh noise, length norm,
projection) plus a scoring rule (cosine or, for `no_length_norm`, the raw dot product) and an
aggregation (vote or mean).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from icml.cli.threads import single_thread, threads_for
from icml.data.videos import NULL_PROMPT
from icml.methods.attribute_motion.flow import motion_mask
from icml.methods.attribute_motion.model import frame_weights, seed_of, to_channels, velocity
from icml.methods.attribute_motion.projection import DenseGaussian, Fastfood

DECOYS = ("pan", "jitter", "static")


# the loss --------------------------------------------------------------------------------------
def stacked_mask(mask: torch.Tensor) -> torch.Tensor:
    """(N, T, H, W) → (N, 3T, H, W): the same weight on the three colour channels of a frame."""
    return mask.repeat_interleave(3, dim=1)


def normaliser(mask: torch.Tensor, valid: torch.Tensor, length_norm: str) -> torch.Tensor:
    """Z(x) per clip: valid frames (`frames`), ΣM (`mask_sum`) or 1 (`none`)."""
    if length_norm == "frames":
        return valid.float().sum(1)
    if length_norm == "mask_sum":
        total = mask.sum((1, 2, 3))
        return torch.where(total > 0, total, torch.ones_like(total))  # an all-zero mask has zero loss anyway
    return torch.ones(len(mask))


def masked_fm_loss(denoiser, x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor, labels: torch.Tensor,
                   mask: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """L_mot per clip = Σ M ⊙ (v_θ(x_t, t, c) − (ε − x₀))² / Z, on stacked clips (N, 3T, H, W).

    The mask weights the loss; the network always sees the whole, unmasked x_t."""
    tt = t[:, None, None, None]
    x_t = (1 - tt) * x0 + tt * eps
    error = (denoiser(x_t, t, labels) - (eps - x0)) ** 2
    return (mask * error).sum((1, 2, 3)) / z


# gradients ---------------------------------------------------------------------------------------
def attribution_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """Every denoiser parameter except the class-embedding table (its rows would leak the label)."""
    return [(name, p) for name, p in model.named_parameters() if not name.startswith("class_embedding")]


@dataclass(frozen=True)
class Setting:
    """What a gradient depends on; the cache key of its features."""

    mask: bool = True
    shared_noise: bool = True
    length_norm: str = "frames"
    prompt: str = "null"
    t_star: float = 0.75
    attr_seed: int = 0
    patch: int = 4

    def key(self) -> str:
        return (f"s{self.attr_seed}_t{self.t_star:g}_mask{'on' if self.mask else 'off'}_p{self.patch}_"
                f"{'shared' if self.shared_noise else 'indep'}_{self.length_norm}_{self.prompt}")


def noise_draws(setting: Setting, n: int, shape: tuple, fresh_ids: np.ndarray | None = None):
    """(t, ε) per clip: one shared draw from the attribution seed, or (indep_noise) a fresh draw
    per clip from (seed, clip index)."""
    if setting.shared_noise:
        gen = torch.Generator().manual_seed(seed_of(setting.attr_seed, 7))
        eps = torch.randn(shape, generator=gen)
        return torch.full((n,), setting.t_star), eps.expand(n, *shape)
    ts, epss = [], []
    for i in fresh_ids:
        gen = torch.Generator().manual_seed(seed_of(setting.attr_seed, 11, int(i)))
        ts.append(float(torch.rand((), generator=gen) * 0.9 + 0.05))
        epss.append(torch.randn(shape, generator=gen))
    return torch.tensor(ts), torch.stack(epss)


def clip_masks(flow: torch.Tensor, valid: torch.Tensor, setting: Setting) -> torch.Tensor:
    if setting.mask:
        return stacked_mask(motion_mask(flow, valid, setting.patch))
    n, t, _, h, w = flow.shape
    return frame_weights(valid).expand(n, 3 * t, h, w).clone()  # unmasked: every valid pixel counts


def per_clip_gradients(model, videos, valid, flow, labels, setting: Setting, ids: np.ndarray):
    """Yield (slice, gradients (B, n)) per clip, the loss with Z = 1: length norms are applied to the
    projected features (a per-clip scalar, and projection is linear)."""
    params = attribution_parameters(model)
    for _, p in model.named_parameters():
        p.requires_grad_(False)
    for _, p in params:
        p.requires_grad_(True)
    weights = [p for _, p in params]
    x0 = to_channels(videos)
    masks = clip_masks(flow, valid, setting)
    t, eps = noise_draws(setting, len(x0), tuple(x0.shape[1:]), ids)
    prompt = labels if setting.prompt == "own" else torch.full_like(labels, NULL_PROMPT)
    ones = torch.ones(1)
    denoiser = lambda x, tt, y: velocity(model, x, tt, y)  # noqa: E731
    model.eval()
    for i in range(len(x0)):
        part = slice(i, i + 1)
        with single_thread():
            loss = masked_fm_loss(denoiser, x0[part], eps[part], t[part], prompt[part], masks[part], ones).sum()
            grads = torch.autograd.grad(loss, weights)
            flat = torch.cat([g.reshape(-1) for g in grads])
        yield i, flat
    for _, p in model.named_parameters():
        p.requires_grad_(True)


def featurize(model, videos, valid, flow, labels, ids, setting: Setting, dim: int, proj_seed: int, chunk: int,
              dense: bool, cos_subset: int, progress=None) -> dict:
    """Projected gradients (Z = 1) of every clip: {'fastfood': (N, D), 'dense': (N, D) or None,
    'z': {norm: (N,)}, 'exact_cos' / 'fastfood_cos' / 'dense_cos' on the first `cos_subset` clips, and the
    seconds spent in gradients, Fastfood and the dense projection}."""
    n_params = sum(p.numel() for _, p in attribution_parameters(model))
    fastfood = Fastfood(n_params, dim, proj_seed)
    gaussian = DenseGaussian(n_params, dim, proj_seed) if dense else None
    n = len(videos)
    out_ff = torch.zeros(n, dim)
    out_dense = torch.zeros(n, dim) if dense else None
    subset = []
    seconds = {"grad_s": 0.0, "fastfood_s": 0.0, "dense_s": 0.0}
    buffer, rows = [], []

    def flush():
        if not buffer:
            return
        block = torch.stack(buffer)
        with threads_for(block.numel()):  # million-entry transforms: every intra-op thread helps
            tick = time.perf_counter()
            out_ff[rows] = fastfood(block)
            seconds["fastfood_s"] += time.perf_counter() - tick
            if dense:
                tick = time.perf_counter()
                out_dense[rows] = gaussian(block)
                seconds["dense_s"] += time.perf_counter() - tick
        subset.extend(g.clone() for r, g in zip(rows, block) if r < cos_subset)
        buffer.clear()
        rows.clear()

    tick = time.perf_counter()
    for i, g in per_clip_gradients(model, videos, valid, flow, labels, setting, ids):  # small ops: one thread
        seconds["grad_s"] += time.perf_counter() - tick
        buffer.append(g)
        rows.append(i)
        if len(buffer) == chunk:
            flush()
        if progress is not None:
            progress(1)
        tick = time.perf_counter()
    flush()
    masks = clip_masks(flow, valid, setting)
    z = {norm: normaliser(masks, valid, norm).numpy() for norm in ("frames", "mask_sum", "none")}
    result = {"fastfood": out_ff.numpy(), "dense": None if out_dense is None else out_dense.numpy(), "z": z, **seconds}
    if subset:
        exact = torch.stack(subset)
        result["exact_cos"] = cosine_matrix(exact.double()).numpy()
        result["fastfood_cos"] = cosine_matrix(out_ff[:len(subset)].double()).numpy()
        if dense:
            result["dense_cos"] = cosine_matrix(out_dense[:len(subset)].double()).numpy()
    return result


def cosine_matrix(x: torch.Tensor) -> torch.Tensor:
    unit = x / x.norm(dim=1, keepdim=True).clamp_min(1e-30)
    return unit @ unit.T


def proj_cos_err(exact: np.ndarray, projected: np.ndarray) -> float:
    """Mean |cos(Pg_a, Pg_b) − cos(g_a, g_b)| over pairs a < b."""
    upper = np.triu_indices(len(exact), 1)
    return float(np.abs(projected[upper] - exact[upper]).mean())


# influence and aggregation ----------------------------------------------------------------------------
def influence(pool: np.ndarray, queries: np.ndarray, cosine: bool = True) -> np.ndarray:
    """I (P, Q): ⟨u(x), u(q)⟩ with u = Pg/‖Pg‖ (identity preconditioner); raw dot products if not cosine."""
    if cosine:
        pool = pool / np.maximum(np.linalg.norm(pool, axis=1, keepdims=True), 1e-30)
        queries = queries / np.maximum(np.linalg.norm(queries, axis=1, keepdims=True), 1e-30)
    return pool @ queries.T


def aggregate(scores: np.ndarray, budget: int, agg: str = "vote") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(P, Q) influence → (mean influence, votes, rank 0 = best). `vote`: each query votes for its
    top-`budget` pool clips by signed influence; rank by votes, ties by mean influence. `mean`:
    rank by mean influence."""
    mean = scores.mean(1)
    votes = np.zeros(len(scores), dtype=np.int64)
    if agg == "vote":
        for q in range(scores.shape[1]):
            top = np.argsort(-scores[:, q], kind="stable")[:budget]
            votes[top] += 1
        order = np.lexsort((-mean, -votes))
    else:
        order = np.argsort(-mean, kind="stable")
    rank = np.empty(len(scores), dtype=np.int64)
    rank[order] = np.arange(len(scores))
    return mean, votes, rank


def selection_flags(rank: np.ndarray, budget: int) -> np.ndarray:
    """1: selected (top budget by signed influence), −1: bottom budget (negative influence), 0: neither."""
    flags = np.zeros(len(rank), dtype=np.int64)
    flags[rank < budget] = 1
    flags[rank >= len(rank) - budget] = -1
    return flags


# retrieval metrics ----------------------------------------------------------------------------------
def average_precision(relevant_in_order: np.ndarray) -> float:
    hits = np.cumsum(relevant_in_order)
    if hits[-1] == 0:
        return float("nan")
    precision = hits / np.arange(1, len(relevant_in_order) + 1)
    return float((precision * relevant_in_order).sum() / hits[-1])


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's ρ: the Pearson correlation of average ranks (ties share their mean rank)."""
    return float(pd.Series(a).rank().corr(pd.Series(b).rank()))


def retrieval_metrics(pool: pd.DataFrame, rank: np.ndarray, score: np.ndarray, target: str, budget: int,
                      ks: list[int]) -> dict:
    """pool: rows of clips.parquet for the pool (motion, shape, hue, decoy_type, valid_len, twin_of_target)."""
    order = np.argsort(rank)
    relevant = (pool["motion"].to_numpy() == target)
    out = {("p_at_k", k): float(relevant[order[:k]].mean()) for k in ks}
    out["ap"] = average_precision(relevant[order].astype(float))
    selected = rank < budget
    out["decoy_rate"] = float(pool["decoy_type"].isin(DECOYS).to_numpy()[selected].mean())
    same = relevant
    if same.sum() > 2 and pool.loc[same, "valid_len"].nunique() > 1:
        out["length_spearman"] = spearman(score[same], pool.loc[same, "valid_len"].to_numpy())
    twins = np.flatnonzero((pool["decoy_type"] == "twin").to_numpy() & (pool["twin_target"] == target).to_numpy())
    if len(twins):
        better = []
        for a in twins:
            others = relevant & ~((pool["shape"] == pool["shape"].iloc[a]) & (pool["hue"] == pool["hue"].iloc[a])).to_numpy()
            better += list(rank[a] < rank[others])  # a outranks m: a is scored higher
        if better:
            out["appearance_outrank_rate"] = float(np.mean(better))
    return out
