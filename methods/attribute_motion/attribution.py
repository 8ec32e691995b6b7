"""Motive's attribution: masked flow-matching gradients at one shared (t*, ε*), projected, turned
into influence against unit query directions, aggregated over queries by majority vote, and scored
as retrieval.

A selector variant is a gradient `Setting` (mask on/off, shared or fresh noise, number of draws,
camera compensation) plus a pool clip's normaliser Z(x) (`length_norm`: its own gradient norm, i.e.
the cosine, or valid frames, ΣM or 1), a projection (Fastfood or dense) and an aggregation (vote or
mean). Z(x) is the frame-length correction: one number per clip, never a fit over the pool.
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
from icml.methods.attribute_motion.model import StackedFrames, as_space, masked_fm_loss, seed_of, timesteps_of
from icml.methods.attribute_motion.projection import DenseGaussian, Fastfood

DECOYS = ("pan", "jitter", "static")


# the loss --------------------------------------------------------------------------------------
def stacked_mask(mask: torch.Tensor) -> torch.Tensor:
    """(N, T, H, W) → (N, 3T, H, W): the same weight on the three colour channels of a frame."""
    return StackedFrames.loss_mask(mask)


def normaliser(mask: torch.Tensor | None, valid: torch.Tensor, length_norm: str) -> torch.Tensor:
    """Z(x) of L_mot = Σ M ⊙ r² / Z(x) per clip: valid frames (`frames`), ΣM (`mask_sum`, needs the mask) or
    1 (`none`). A per-clip scalar, and the gradient and its projection are linear, so `influence` divides the
    projected gradient of Σ M ⊙ r² by it (the same number, one gradient pass for every `length_norm`)."""
    if length_norm == "frames":
        return valid.float().sum(1)
    if length_norm == "mask_sum":
        total = mask.sum((1, 2, 3))
        return torch.where(total > 0, total, torch.ones_like(total))  # an all-zero mask has zero loss anyway
    return torch.ones(len(valid))


# gradients ---------------------------------------------------------------------------------------
def attribution_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters a gradient is taken over: every denoiser parameter except the class-embedding table
    (its rows would leak the label); on the Wan path every transformer parameter."""
    return as_space(model).parameters()


@dataclass(frozen=True)
class Setting:
    """What a gradient depends on; the cache key of its features."""

    mask: bool = True
    shared_noise: bool = True
    prompt: str = "null"
    t_star: float = 0.75
    attr_seed: int = 0
    patch: int = 4
    draws: int = 1  # (t, ε) draws the gradient is averaged over (the spec: one)
    camera: str = "median"  # camera-motion compensation of the mask's flow: median | none
    floor: float = 0.25  # px: compensated flow below it is no motion

    def key(self) -> str:
        return (f"s{self.attr_seed}_t{self.t_star:g}_mask{'on' if self.mask else 'off'}_p{self.patch}_"
                f"{'shared' if self.shared_noise else 'indep'}_{self.prompt}_k{self.draws}_"
                f"cam{self.camera}_fl{self.floor:g}")


def noise_draws(setting: Setting, n: int, shape: tuple, fresh_ids: np.ndarray | None = None):
    """(t (n, K), ε (n, K, *shape)): K = `draws` shared draws from the attribution seed, the first of them
    (t*, ε*); or (indep_noise) K fresh draws per clip from (seed, clip index)."""
    k = setting.draws
    if setting.shared_noise:
        gen = torch.Generator().manual_seed(seed_of(setting.attr_seed, 7))
        eps = torch.stack([torch.randn(shape, generator=gen) for _ in range(k)])
        return torch.full((n, k), setting.t_star), eps.expand(n, *eps.shape)
    ts, epss = [], []
    for i in fresh_ids:
        gen = torch.Generator().manual_seed(seed_of(setting.attr_seed, 11, int(i)))
        draws = [(float(torch.rand((), generator=gen) * 0.9 + 0.05), torch.randn(shape, generator=gen)) for _ in range(k)]
        ts.append(torch.tensor([t for t, _ in draws]))
        epss.append(torch.stack([e for _, e in draws]))
    return torch.stack(ts), torch.stack(epss)


def clip_masks(flow: torch.Tensor, valid: torch.Tensor, setting: Setting) -> torch.Tensor:
    """(N, T, H, W) motion mask, or (no_mask) every valid pixel."""
    if setting.mask:
        return motion_mask(flow, valid, setting.patch, setting.camera, setting.floor)
    n, t, _, h, w = flow.shape
    return valid.float()[..., None, None].expand(n, t, h, w).clone()


def loss_space_mask(flow: torch.Tensor, valid: torch.Tensor, setting: Setting, space=None) -> torch.Tensor:
    """M in the loss space: stacked (N, 3T, H, W) for the UNet, or on the Wan VAE's latent grid (N, C, T', h, w),
    where the mask is pooled to the grid first. Z(x) is applied to the projected gradient (`influence`)."""
    space = space if space is not None else StackedFrames(None)
    return space.loss_mask(clip_masks(flow, valid, setting))


def clip_gradient(space, weights, x0, eps, timesteps, condition, mask) -> tuple:
    """∇θ of one clip's L_mot averaged over its K draws, one gradient per parameter on the model's device (no flat
    copy): x0, mask (K, …) the clip's copies, eps (K, …), timesteps (K,), condition the K copies' condition."""
    loss = masked_fm_loss(space.denoise, x0, eps, timesteps, condition, mask).mean()
    return torch.autograd.grad(loss, weights)


def per_clip_gradients(model, videos, valid, flow, labels, setting: Setting, ids: np.ndarray, flat: bool = True):
    """Yield (index, gradient) per clip: ∇θ of L_mot averaged over the clip's K draws (one backward
    pass on the K copies). `model` is a loss space (`model.StackedFrames`, `wan.WanSpace`) or a bare
    stacked-frame UNet: the clips are encoded into its space (stacked frames, or Wan VAE latents), the mask
    is taken there and ε* is drawn at the encoded clip's shape. The gradient is a flat host vector (n,), or with
    `flat=False` the tuple of per-parameter gradients where the model is (what `featurize` streams)."""
    space = as_space(model)
    params = space.parameters()
    for _, p in space.model.named_parameters():
        p.requires_grad_(False)
    for _, p in params:
        p.requires_grad_(True)
    weights = [p for _, p in params]
    with torch.no_grad():
        x0 = space.encode(videos)
    masks = loss_space_mask(flow, valid, setting, space).to(x0.device)
    t, eps = noise_draws(setting, len(x0), tuple(x0.shape[1:]), ids)
    timesteps = timesteps_of(t)
    prompt = labels if setting.prompt == "own" else torch.full_like(labels, NULL_PROMPT)
    k = setting.draws
    space.model.eval()
    for i in range(len(x0)):
        copies = lambda a: a[i:i + 1].expand(k, *a.shape[1:])  # noqa: E731
        with single_thread():
            grads = clip_gradient(space, weights, copies(x0), eps[i].to(x0.device), timesteps[i].to(x0.device),
                                  space.condition(copies(prompt)), copies(masks))
            if flat:
                grads = torch.cat([g.reshape(-1) for g in grads]).cpu()
        yield i, grads
        del grads
    for _, p in space.model.named_parameters():
        p.requires_grad_(True)


class ExactCosines:
    """Gradient inner products of the first clips (the exact side of `proj_cos_err`), accumulated as the
    gradients stream by: each kept gradient is one float32 copy in `store` memory (the host by default; the
    device only ever holds the current clip's gradient), and a new clip's products with the kept ones are summed
    parameter by parameter in float64 on the gradient's device."""

    def __init__(self, size: int, store="cpu"):
        self.size, self.store = size, store
        self.kept: list[torch.Tensor] = []
        self.gram = torch.zeros(size, size, dtype=torch.float64)

    def add(self, grads, kept=None) -> None:
        """The next clip's per-parameter gradients; `kept` (plan only) stands in for the earlier clips' stored
        copies."""
        kept = self.kept if kept is None else kept
        row = torch.zeros(len(kept) + 1, dtype=torch.float64, device=grads[0].device)
        offset = 0
        for g in grads:
            piece = g.reshape(-1).double()
            n = len(piece)
            for j, other in enumerate(kept):
                row[j] += piece @ other[offset:offset + n].to(piece.device).double()
            row[-1] += piece @ piece
            offset += n
        if kept is self.kept:
            i = len(self.kept)
            copy = torch.empty(offset, device=self.store)
            offset = 0
            for g in grads:
                copy[offset:offset + g.numel()] = g.reshape(-1).to(self.store)
                offset += g.numel()
            self.kept.append(copy)
            self.gram[i, :i + 1] = row.cpu()
            self.gram[:i + 1, i] = row.cpu()

    def cosines(self) -> torch.Tensor:
        n = len(self.kept)
        gram = self.gram[:n, :n]
        norm = gram.diagonal().sqrt().clamp_min(1e-30)
        return gram / norm[:, None] / norm[None, :]


def featurize(model, videos, valid, flow, labels, ids, setting: Setting, dim: int, proj_seed: int, chunk: int,
              dense: bool, cos_subset: int, progress=None) -> dict:
    """Projected gradients of every clip: {'fastfood': (N, D), 'dense': (N, D) or None,
    'exact_cos' / 'fastfood_cos' / 'dense_cos' on the first `cos_subset` clips, and the
    seconds spent in gradients, Fastfood and the dense projection}.

    Streamed (issue 48): each clip's per-parameter gradients go straight into the Fastfood block of its chunk on
    the model's device (`FastfoodBlock.put`), `chunk` clips (at most `Fastfood.BATCH`) per block, and into the
    exact-cosine Gram matrix (`ExactCosines`); no gradient matrix of the pool is ever held. Only the dense
    Gaussian reference (`motive_dense`, toy sizes) still stacks a chunk's flat gradients on the host."""
    space = as_space(model)
    n_params = sum(p.numel() for _, p in space.parameters())
    where = next(space.model.parameters()).device
    fastfood = Fastfood(n_params, dim, proj_seed).to(where)
    gaussian = DenseGaussian(n_params, dim, proj_seed) if dense else None
    n = len(videos)
    out_ff = torch.zeros(n, dim)
    out_dense = torch.zeros(n, dim) if dense else None
    exact = ExactCosines(min(cos_subset, n))
    seconds = {"grad_s": 0.0, "fastfood_s": 0.0, "dense_s": 0.0}
    state = {"block": None, "rows": [], "dense_rows": [], "flat": []}

    def flush():
        rows = state["rows"]
        if rows:
            with threads_for(n_params * len(rows)):  # million-entry transforms: every intra-op thread helps
                tick = time.perf_counter()
                out_ff[rows] = state["block"].finish().cpu()
                seconds["fastfood_s"] += time.perf_counter() - tick
            state.update(block=None, rows=[])

    def flush_dense():  # once per chunk: the dense reference regenerates R per call
        if state["flat"]:
            with threads_for(n_params * len(state["flat"])):
                tick = time.perf_counter()
                out_dense[state["dense_rows"]] = gaussian(torch.stack(state["flat"]))
                seconds["dense_s"] += time.perf_counter() - tick
            state.update(dense_rows=[], flat=[])

    tick = time.perf_counter()
    in_chunk = 0
    for i, grads in per_clip_gradients(space, videos, valid, flow, labels, setting, ids, flat=False):  # one thread
        seconds["grad_s"] += time.perf_counter() - tick
        if state["block"] is None:
            state["block"] = fastfood.block(min(Fastfood.BATCH, chunk - in_chunk, n - i), where)
        with threads_for(n_params):
            tick = time.perf_counter()
            state["block"].put(grads)
            seconds["fastfood_s"] += time.perf_counter() - tick
        state["rows"].append(i)
        if dense:
            state["flat"].append(torch.cat([g.reshape(-1) for g in grads]).cpu())
            state["dense_rows"].append(i)
        if i < exact.size:
            exact.add(grads)
        del grads
        in_chunk += 1
        if len(state["rows"]) == state["block"].width:
            flush()
        if in_chunk == chunk:
            in_chunk = 0
            flush_dense()
        if progress is not None:
            progress(1)
        tick = time.perf_counter()
    flush()
    flush_dense()
    result = {"fastfood": out_ff.numpy(), "dense": None if out_dense is None else out_dense.numpy(), **seconds}
    if exact.kept:
        result["exact_cos"] = exact.cosines().numpy()
        result["fastfood_cos"] = cosine_matrix(out_ff[:len(exact.kept)].double()).numpy()
        if dense:
            result["dense_cos"] = cosine_matrix(out_dense[:len(exact.kept)].double()).numpy()
    return result


def cosine_matrix(x: torch.Tensor) -> torch.Tensor:
    unit = x / x.norm(dim=1, keepdim=True).clamp_min(1e-30)
    return unit @ unit.T


def proj_cos_err(exact: np.ndarray, projected: np.ndarray) -> float:
    """Mean |cos(Pg_a, Pg_b) − cos(g_a, g_b)| over pairs a < b."""
    upper = np.triu_indices(len(exact), 1)
    return float(np.abs(projected[upper] - exact[upper]).mean())


# influence and aggregation ----------------------------------------------------------------------------
def influence(pool: np.ndarray, queries: np.ndarray, z: np.ndarray | None = None) -> np.ndarray:
    """I (P, Q) = ⟨Pg(x) / Z(x), u(q)⟩ with the identity preconditioner and u(q) = Pg(q)/‖Pg(q)‖.

    Z(x) is the pool clip's own normaliser: None → ‖Pg(x)‖, the cosine (`length_norm=grad_norm`); else the
    given per-clip values (`normaliser`: valid frames, ΣM or 1). Either way a clip without motion (empty
    mask, zero gradient) scores exactly 0 and a clip's score depends on no other pool clip. The query side
    is a unit vector: a positive per-query scalar changes no query's ranking, and each query weighs the
    same in the mean aggregation."""
    queries = queries / np.maximum(np.linalg.norm(queries, axis=1, keepdims=True), 1e-30)
    scale = np.maximum(np.linalg.norm(pool, axis=1), 1e-30) if z is None else np.asarray(z, dtype=np.float64)
    return (pool / scale[:, None]) @ queries.T


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
    """scikit-learn's average precision of a ranking (best first; nan without a relevant clip)."""
    from sklearn.metrics import average_precision_score

    relevant = np.asarray(relevant_in_order) > 0
    if not relevant.any():
        return float("nan")
    return float(average_precision_score(relevant, -np.arange(len(relevant))))


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
    pans = (pool["decoy_type"] == "pan").to_numpy()
    if pans.any() and relevant.any():  # pairs (pan decoy p, target-motion clip m) with p ranked above m
        out["pan_outrank_rate"] = float((rank[pans][:, None] < rank[relevant][None, :]).mean())
    twins = np.flatnonzero((pool["decoy_type"] == "twin").to_numpy() & (pool["twin_target"] == target).to_numpy())
    if len(twins):
        better = []
        for a in twins:
            others = relevant & ~((pool["shape"] == pool["shape"].iloc[a]) & (pool["hue"] == pool["hue"].iloc[a])).to_numpy()
            better += list(rank[a] < rank[others])  # a outranks m: a is scored higher
        if better:
            out["appearance_outrank_rate"] = float(np.mean(better))
    return out
