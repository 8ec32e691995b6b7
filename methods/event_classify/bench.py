"""`make bench` hook of event-classify: SECNet's Fourier filters forward + backward with their
hand-written backward, against autograd through rfft → multiply → irfft on the same tensors, at
the default preset's shapes (batch 32): Spatial-FA of each stage and Temporal-FA of the last."""
from __future__ import annotations

import statistics
import time


def bench(out_rows: list[dict], repeats: int = 5) -> list[dict]:
    """Append one row per shape (bench, seconds, baseline, baseline_seconds, ratio); ratio < 1
    means the hand-written backward is faster."""
    import torch

    from icml.cli.threads import single_thread
    from icml.methods.event_classify.config import preset
    from icml.methods.event_classify.model import Arch, FourierFilter

    size = preset("default").arch
    batch, tokens, k = 32, list(size.groups), size.k
    widths = Arch(size.n_points, tuple(tokens), k, size.d0, n_classes=10).widths[1:]  # D' of each stage
    cases = [(f"spatial_fa/S={s},D'={d}", (batch, s, k, d), -1, (k, d // 2 + 1))
             for s, d in zip(tokens, widths)]
    cases.append((f"temporal_fa/S={tokens[-1]},D'={widths[-1]}", (batch, tokens[-1], widths[-1]), 1,
                  (tokens[-1] // 2 + 1, widths[-1])))

    def autograd_filter(x, v, dim):
        spectrum = torch.fft.rfft(x, dim=dim, norm="ortho") * v
        return torch.fft.irfft(spectrum, n=x.shape[dim], dim=dim, norm="ortho")

    def median_s(fn, x, v, dim) -> float:
        def once():
            fn(x, v, dim).backward(upstream)
        once()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            once()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    generator = torch.Generator().manual_seed(0)
    with single_thread():
        for name, shape, dim, filter_shape in cases:
            x = torch.randn(shape, generator=generator).requires_grad_()
            v = torch.randn(filter_shape, dtype=torch.complex64, generator=generator).requires_grad_()
            upstream = torch.randn(shape, generator=generator)
            ours = median_s(FourierFilter.apply, x, v, dim)
            reference = median_s(autograd_filter, x, v, dim)
            out_rows.append({"bench": f"event_classify/{name}", "seconds": ours,
                             "baseline": "autograd through rfft·V→irfft", "baseline_seconds": reference,
                             "ratio": ours / reference})
    return out_rows
