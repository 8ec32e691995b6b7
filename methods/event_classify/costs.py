"""Analytic cost of SECNet per part, as the spec's metric definitions count it, plus timing.

- Linear and conv layers: in · out · positions.
- An rFFT or irFFT over length L with C columns: L·C·⌈log₂L⌉ + 2LC per call (fvcore's handler).
- A complex filter multiply: 4 per complex element.
- Attention pooling: the score layer (D'·1 per neighbour) plus the weighted sum (D' per neighbour).
- BN, activations, softmax and normalisation are not counted; the grouping (FPS distance evaluations
  S·N_in·3 and EF-KNN distance MACs S·N_in·D) is reported separately as `grouping_ops`.
"""
from __future__ import annotations

import math
import statistics
import time

PARTS = ("embed", "spatial_fa", "pool", "temporal_fa", "residual", "head")


def fft_macs(length: int, columns: int) -> int:
    """One rFFT or irFFT call over `length` with `columns` independent columns."""
    return length * columns * math.ceil(math.log2(length)) + 2 * length * columns


def secnet_costs(n_points: int, groups: list[int] | tuple[int, ...], k: int, d0: int, n_classes: int,
                 spatial: str = "fft", pool: str = "attn", temporal: str = "fft", knn_space: str = "feature"
                 ) -> dict[str, int]:
    """MACs per part for one sample, `grouping_ops`, `params_temporal_fa` and, inside
    `macs_temporal_fa`, its S² part `macs_temporal_scores` (QKᵀ and AV of the attention baseline,
    0 for the filter): the term whose N² growth the paper contrasts with the filter's N log N."""
    cost = dict.fromkeys(PARTS, 0)
    scores = 0
    cost["embed"] = 4 * d0 * n_points
    grouping = params_tfa = 0
    n_in, d = n_points, d0
    for s in groups:
        dp = 2 * d + 4
        grouping += s * n_in * 3 + s * n_in * (d if knn_space == "feature" else 3)
        positions = s * k
        if spatial == "fft":
            cost["spatial_fa"] += 2 * fft_macs(dp, positions) + 4 * positions * (dp // 2 + 1)
        else:
            cost["spatial_fa"] += dp * dp * positions
        if pool == "attn":
            cost["pool"] += dp * positions + dp * positions  # score layer + weighted sum
        if temporal == "fft":
            cost["temporal_fa"] += 2 * fft_macs(s, dp) + 4 * (s // 2 + 1) * dp
            params_tfa += 2 * (s // 2 + 1) * dp
        elif temporal == "attn":
            cost["temporal_fa"] += 4 * dp * dp * s + 2 * s * s * dp  # q, k, v, out projections; QKᵀ and AV
            scores += 2 * s * s * dp
        else:
            cost["temporal_fa"] += dp * dp * s
        cost["residual"] += 2 * dp * (dp // 2) * s
        n_in, d = s, dp
    cost["head"] = 2 * d * 256 + 256 * n_classes
    out = {f"macs_{part}": value for part, value in cost.items()}
    out["macs_total"] = sum(cost.values())
    out["macs_temporal_scores"] = scores  # part of macs_temporal_fa, not added to the total again
    out["grouping_ops"] = grouping
    out["params_temporal_fa"] = params_tfa
    return out


def layer_macs(model, cloud) -> int:
    """in · out · positions of every Linear/Conv layer over one forward pass (hooks); for the
    baselines, and to cross-check the analytic layer counts of SECNet."""
    import torch
    from torch import nn

    total = [0]

    def hook(module, inputs, output):
        if isinstance(module, nn.Linear):
            total[0] += module.in_features * output.numel()
        else:
            kernel = math.prod(module.kernel_size)
            total[0] += module.in_channels // module.groups * kernel * output.numel()

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d))]
    try:
        with torch.no_grad():
            model(cloud)
    finally:
        for h in handles:
            h.remove()
    return total[0] // cloud.shape[0]


def parameters(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def time_forward(model, cloud, runs: int, warmups: int) -> float:
    """Median wall time (ms) of a no-grad forward pass after warm-ups."""
    import torch

    times = []
    with torch.no_grad():
        for i in range(warmups + runs):
            start = time.perf_counter()
            model(cloud)
            if i >= warmups:
                times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def time_parts(model, cloud, runs: int) -> dict[str, float]:
    """Median ms per part over `runs` forward passes (SECNet family, through its PartTimer)."""
    import torch

    from icml.methods.event_classify.model import PartTimer

    samples: dict[str, list[float]] = {}
    with torch.no_grad():
        for _ in range(runs):
            timer = PartTimer()
            model.set_timer(timer)
            model(cloud)
            for part, ms in timer.ms.items():
                samples.setdefault(part, []).append(ms)
    model.set_timer(None)
    return {part: statistics.median(v) for part, v in samples.items()}
