"""`make bench` hook of attribute-motion.

- fastfood: projecting per-clip gradients of the default UNet (every parameter but the class embedding,
  zero-padded to n′ = 2^⌈log₂ n⌉) to D = 512 dimensions with Fastfood, against the dense Gaussian
  reference projection of the same gradients (ratio < 1: Fastfood is faster), on all intra-op threads as
  in `eval`.
- gradient draws=K: one clip's attribution gradient averaged over K shared (t, ε) draws (`attr.draws`),
  against the spec's single draw (ratio: the featurisation cost of K draws), on one thread as in `eval`.
"""
from __future__ import annotations

import statistics
import time


def bench(out_rows: list[dict], repeats: int = 3, batch: int = 8, draws: int = 4) -> list[dict]:
    import numpy as np
    import torch

    from icml.cli.threads import single_thread
    from icml.data.videos import make_clip, random_spec
    from icml.methods.attribute_motion.attribution import Setting, attribution_parameters, per_clip_gradients
    from icml.methods.attribute_motion.config import preset
    from icml.methods.attribute_motion.model import build_unet
    from icml.methods.attribute_motion.projection import DenseGaussian, Fastfood

    cfg = preset("default")
    model = build_unet(cfg.clips.frames, cfg.clips.size, cfg.unet.block_out_channels, cfg.unet.layers_per_block, 0)
    n = sum(p.numel() for _, p in attribution_parameters(model))
    gradients = torch.randn(batch, n, generator=torch.Generator().manual_seed(0))

    def median_s(work) -> float:
        work()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            work()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    fastfood = median_s(lambda: Fastfood(n, cfg.attr.dim, 0)(gradients))
    dense = median_s(lambda: DenseGaussian(n, cfg.attr.dim, 0)(gradients))
    out_rows.append({"bench": f"attribute_motion/fastfood n={n},D={cfg.attr.dim},B={batch}", "seconds": fastfood,
                     "baseline": "dense Gaussian projection", "baseline_seconds": dense, "ratio": fastfood / dense})

    rng = np.random.default_rng(0)
    clips = [make_clip(random_spec(rng, "orbit")) for _ in range(batch)]
    videos = torch.as_tensor(np.stack([c.frames for c in clips]))
    valid = torch.as_tensor(np.stack([c.valid for c in clips]))
    flow = torch.as_tensor(np.stack([c.flow for c in clips]))
    labels = torch.tensor([c.prompt_id for c in clips])

    def gradient_pass(k: int):
        setting = Setting(draws=k)
        with single_thread():
            for _ in per_clip_gradients(model, videos, valid, flow, labels, setting, np.arange(batch)):
                pass

    one = median_s(lambda: gradient_pass(1)) / batch
    many = median_s(lambda: gradient_pass(draws)) / batch
    out_rows.append({"bench": f"attribute_motion/gradient draws={draws} (s per clip)", "seconds": many,
                     "baseline": "draws=1 (the spec's one shared (t*, ε*))", "baseline_seconds": one,
                     "ratio": many / one})
    return out_rows
