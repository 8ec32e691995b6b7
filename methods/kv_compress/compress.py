"""EntroKV and the baselines at prefill: window attention, normalised history entropy per
(layer, KV head), the stabilised signal, budgets that conserve the uniform total exactly, the
PyramidKV / Ada-KV allocations, and the SnapKV / H2O / StreamingLLM selections.

Shapes: L layers, Hkv KV heads, Hq query heads (group g = Hq / Hkv), N prompt tokens, w window.
History = positions < N − w; the window (the last w tokens) is always kept.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from icml.methods.kv_compress.model import Prefill


# ---------------------------------------------------------------------------------------------
# Window attention and entropy
# ---------------------------------------------------------------------------------------------
def window_log_attention(queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """log A [Hq, w, N], A = softmax(Q_win Kᵀ/√d) over all N keys, causal inside the window. Kept in
    log space: a sharp head can put all but 1e-40 of its mass on the window, and renormalising an
    underflowed history in probability space would divide 0 by 0."""
    Hq, w, _ = queries.shape
    N = keys.shape[1]
    scores = (queries @ keys.repeat_interleave(Hq // keys.shape[0], 0).transpose(1, 2)).float() * scaling
    row = torch.arange(w, device=keys.device)[:, None] + (N - w)
    scores = scores.masked_fill(torch.arange(N, device=keys.device)[None, :] > row, float("-inf"))
    return scores.log_softmax(-1)


def head_entropy(log_attention: torch.Tensor, norm: str = "history") -> torch.Tensor:
    """H_q [Hq] in [0, 1]: window-mean entropy of each row restricted to the history keys and
    renormalised there, divided by log(N − w) (norm=history) or log N (norm=prompt)."""
    w, N = log_attention.shape[-2:]
    log_p = log_attention[..., :N - w].log_softmax(-1)  # the history renormalisation, in log space
    p = log_p.exp()
    entropy = -torch.where(p > 0, p * log_p, torch.zeros_like(p)).sum(-1)  # 0·log 0 = 0
    scale = math.log(N - w) if norm == "history" else math.log(N)
    return entropy.mean(-1) / scale


def group_heads(per_query_head: torch.Tensor, n_kv: int, how: str = "mean") -> torch.Tensor:
    """[Hq, …] → [Hkv, …]: mean (or max) over the query heads sharing a KV head."""
    grouped = per_query_head.reshape(n_kv, -1, *per_query_head.shape[1:])
    return grouped.mean(1) if how == "mean" else grouped.amax(1)


def kv_head_entropy_tensor(state: Prefill, log_attentions: list[torch.Tensor], norm: str, how: str) -> torch.Tensor:
    """H_l^h [L, Hkv] on the device."""
    _, n_kv, _ = state.shape
    return torch.stack([group_heads(head_entropy(a, norm), n_kv, how) for a in log_attentions])


def kv_head_entropy(state: Prefill, log_attentions: list[torch.Tensor], norm: str, how: str) -> np.ndarray:
    """H_l^h [L, Hkv] on the host."""
    return kv_head_entropy_tensor(state, log_attentions, norm, how).double().cpu().numpy()


# ---------------------------------------------------------------------------------------------
# Budgets
# ---------------------------------------------------------------------------------------------
def uniform_capacity(n: int, window: int, ratio: float) -> int:
    """C = min(N, max(w + 1, ⌊rN⌋)): entries per head under uniform allocation, window included."""
    return min(n, max(window + 1, math.floor(ratio * n + 1e-9)))


def largest_remainder(raw: np.ndarray, total: int, low: int, high: int) -> np.ndarray:
    """Integers B with Σ B = total and low ≤ B ≤ high, closest to `raw`: floor, clamp, then
    add one unit to the head with the largest raw − B below the cap (or remove one from the head
    with the largest B − raw above the floor) until the total is met."""
    if not raw.size * low <= total <= raw.size * high:
        raise ValueError(f"total {total} cannot be split into {raw.size} budgets in [{low}, {high}]")
    budget = np.clip(np.floor(raw), low, high).astype(np.int64)
    flat_raw, flat = raw.reshape(-1), budget.reshape(-1)
    while (gap := int(flat.sum()) - total) != 0:
        if gap < 0:
            room = np.where(flat < high, flat_raw - flat, -np.inf)
            flat[int(np.argmax(room))] += 1
        else:
            room = np.where(flat > low, flat - flat_raw, -np.inf)
            flat[int(np.argmax(room))] -= 1
    return budget


def stabilised_signal(entropy: np.ndarray, alpha: float, h_bar: float) -> np.ndarray:
    """s = (1 − α)·H̄ + α·H."""
    return (1 - alpha) * h_bar + alpha * entropy


def entropy_budgets(signal: np.ndarray, n: int, window: int, ratio: float,
                    scope: str = "global") -> tuple[np.ndarray, np.ndarray]:
    """(raw B̃, integer B) [L, Hkv] of history entries, conserving T = L·Hkv·(C − w) over all heads
    (scope=global) or Hkv·(C − w) within each layer (scope=per_layer)."""
    per_head = uniform_capacity(n, window, ratio) - window
    cap = n - window
    if scope == "global":
        raw = signal.size * per_head * signal / signal.sum()
        return raw, largest_remainder(raw, signal.size * per_head, 1, cap)
    raw = signal.shape[1] * per_head * signal / signal.sum(1, keepdims=True)
    return raw, np.stack([largest_remainder(r, signal.shape[1] * per_head, 1, cap) for r in raw])


def uniform_budgets(shape: tuple[int, int], n: int, window: int, ratio: float) -> np.ndarray:
    return np.full(shape, uniform_capacity(n, window, ratio) - window, dtype=np.int64)


def pyramid_budgets(shape: tuple[int, int], n: int, window: int, ratio: float,
                    beta: float) -> tuple[np.ndarray, np.ndarray]:
    """PyramidKV: layer budgets linear in depth from 2b̄ − b̄/β (bottom) to b̄/β (top), uniform
    within a layer; integerised to conserve the uniform total."""
    L, n_kv = shape
    mean = uniform_capacity(n, window, ratio) - window
    top, bottom = mean / beta, 2 * mean - mean / beta
    if bottom > n - window:  # the bottom layer cannot hold more than the history: flatten the pyramid
        bottom = n - window
        top = 2 * mean - bottom
    per_layer = bottom - (bottom - top) * np.arange(L) / max(1, L - 1) if L > 1 else np.array([float(mean)])
    raw = np.repeat(per_layer[:, None], n_kv, axis=1)
    return raw, largest_remainder(raw, L * n_kv * mean, 1, n - window)


def adakv_budgets(scores: torch.Tensor, mean: int, floor_fraction: float) -> np.ndarray:
    """Ada-KV for one layer: each head first gets ⌊φ·b̄⌋ entries, the rest of the layer's Hkv·b̄ go
    to the top scores across the concatenated heads. scores [Hkv, N − w] → budgets [Hkv]."""
    n_kv, history = scores.shape
    guaranteed = min(math.floor(floor_fraction * mean), history)
    order = scores.argsort(-1, descending=True)
    taken = torch.zeros_like(scores, dtype=torch.bool)
    taken.scatter_(1, order[:, :guaranteed], True)
    rest = n_kv * mean - n_kv * guaranteed
    if rest > 0:
        pool = scores.masked_fill(taken, float("-inf")).reshape(-1)
        taken.view(-1)[pool.topk(rest).indices] = True
    return taken.sum(-1).cpu().numpy().astype(np.int64)


# ---------------------------------------------------------------------------------------------
# Scores and selection
# ---------------------------------------------------------------------------------------------
def snapkv_scores(attention: torch.Tensor, n_kv: int, kernel: int, pool: str) -> torch.Tensor:
    """[Hkv, N − w]: window-mean attention on history columns (group mean), 1-D pooled (stride 1,
    same padding)."""
    w, N = attention.shape[-2:]
    votes = group_heads(attention[..., :N - w].mean(1), n_kv, "mean")[:, None]
    if pool == "max":
        votes = F.max_pool1d(votes, kernel, stride=1, padding=kernel // 2)
    else:
        votes = F.avg_pool1d(votes, kernel, stride=1, padding=kernel // 2)
    return votes[:, 0]


def h2o_scores(column_sums: torch.Tensor, n_kv: int, window: int) -> torch.Tensor:
    """[Hkv, N − w]: attention accumulated over all prompt rows of the causal prefill (group mean)."""
    return group_heads(column_sums[:, :column_sums.shape[1] - window], n_kv, "mean")


def top_positions(scores: torch.Tensor, budget: int) -> torch.Tensor:
    return scores.topk(budget).indices.sort().values


def streaming_positions(history: int, budget: int, sinks: int) -> torch.Tensor:
    """The first `sinks` tokens and the budget − sinks most recent history tokens."""
    first = min(sinks, budget)
    return torch.cat([torch.arange(first), torch.arange(history - (budget - first), history)])


@dataclass
class Selection:
    kept: list[list[torch.Tensor]]  # [L][Hkv] sorted positions, window included
    budget_raw: np.ndarray  # [L, Hkv] history budgets before integerising
    budget: np.ndarray  # [L, Hkv] integer history budgets B
    signal: np.ndarray | None  # EntroKV's s, or None


def select(operator: str, scores: list[torch.Tensor] | None, budgets: np.ndarray, n: int, window: int,
           sinks: int) -> list[list[torch.Tensor]]:
    """Per layer and KV head, the B best history positions plus the whole window."""
    win = torch.arange(n - window, n)
    out = []
    for layer, row in enumerate(budgets):
        heads = []
        for h, b in enumerate(row.tolist()):
            if operator == "streamingllm":
                history = streaming_positions(n - window, b, sinks)
            else:
                history = top_positions(scores[layer][h], b).cpu()
            heads.append(torch.cat([history, win]))
        out.append(heads)
    return out
