"""`make bench` hook of attribute-motion: projecting per-clip gradients of the default UNet
(every parameter but the class embedding, zero-padded to n′ = 2^⌈log₂ n⌉) to D = 512 dimensions with
Fastfood, against the dense Gaussian reference projection of the same gradients (ratio < 1:
Fastfood is faster), on all intra-op threads as in `eval`."""
from __future__ import annotations

import statistics
import time


def bench(out_rows: list[dict], repeats: int = 3, batch: int = 8) -> list[dict]:
    import torch

    from icml.methods.attribute_motion.attribution import attribution_parameters
    from icml.methods.attribute_motion.config import preset
    from icml.methods.attribute_motion.model import build_unet
    from icml.methods.attribute_motion.projection import DenseGaussian, Fastfood

    cfg = preset("default")
    model = build_unet(cfg.clips.frames, cfg.clips.size, cfg.unet.block_out_channels, cfg.unet.layers_per_block, 0)
    n = sum(p.numel() for _, p in attribution_parameters(model))
    gradients = torch.randn(batch, n, generator=torch.Generator().manual_seed(0))

    def median_s(project) -> float:
        project(gradients)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            project(gradients)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    fastfood = median_s(Fastfood(n, cfg.attr.dim, 0))
    dense = median_s(DenseGaussian(n, cfg.attr.dim, 0))
    out_rows.append({"bench": f"attribute_motion/fastfood n={n},D={cfg.attr.dim},B={batch}", "seconds": fastfood,
                     "baseline": "dense Gaussian projection", "baseline_seconds": dense, "ratio": fastfood / dense})
    return out_rows
