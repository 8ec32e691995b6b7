"""`make bench`: start-up and smoke-run timings as ratios against baselines measured in the
same run, written to Parquet (not part of `make test`; timings never gate the tests).

- startup: `icml --help` against a bare `python -c pass`, and against a bare Typer app of 19 sub-apps
  (goal ≤ 1.5×: help stays light, no torch or numpy, and a method's commands are built only when named).
- smoke/<method>: train + eval + report at `--preset smoke`, against `python -c "import torch"`
  (the floor any torch method pays) and against the 60 s smoke budget.
- psi_half/<rows>x<cols>: spectral-optim's SVD-free Ψ_½ against torch.linalg.svd of the same matrix
  (ratio < 1: Ψ_½ is faster), one thread, median of 9 calls after warm-up.
- event_classify/<part>: SECNet's Fourier filter forward + backward with its hand-written backward, against
  autograd through rfft → multiply → irfft, at the default preset's shapes.
- attribute_motion/fastfood: Fastfood projection of 8 per-clip gradients of the default UNet to D = 512
  against the dense Gaussian reference projection of the same gradients; attribute_motion/gradient draws=4:
  a clip's attribution gradient averaged over 4 shared (t, ε) draws against the single draw.
- scale_out/<executor>: one spectral-optim smoke sweep (4 jobs) with 2 local workers and on a local Ray
  instance of 1 and 2 CPUs, against the local executor in one process (benchmarks/scale_out.py).
- kv_compress/memory@r=0.3 and kv_compress/overhead@r=0.3: bytes of the compressed KV cache against the
  full cache, and EntroKV's entropy + allocation + selection time against a full prefill.
- kv_compress/generate_time@r=0.3 and kv_compress/generate_memory@r=0.3: `model.generate()` of 64
  tokens through `CompressedCache` (EntroKV+SnapKV) against transformers' DynamicCache: seconds per
  call and K/V bytes held afterwards.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from icml.cli.registry import METHODS
from icml.cli.results import write_frame


def timed(argv: list[str], env: dict | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, env={**os.environ, **(env or {})})
    return time.perf_counter() - start


def median_time(argv: list[str], repeats: int) -> float:
    return statistics.median(timed(argv) for _ in range(repeats))


def psi_half_vs_svd(sizes=((64, 64), (128, 512), (256, 256), (512, 512)), repeats: int = 9) -> list[dict]:
    import torch

    from icml.cli.threads import single_thread
    from icml.methods.spectral_optim.psi import conditioned_matrix, psi

    def svd_half(O):  # the same transform by a float32 SVD, as an optimizer would call it
        u, sigma, vh = torch.linalg.svd(O, full_matrices=False)
        return (u * sigma.sqrt().unsqueeze(-2)) @ vh

    def median_ms(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - start))
        return statistics.median(times)

    out = []
    with single_thread():
        for rows, cols in sizes:
            O = conditioned_matrix(rows, cols, 30.0, torch.Generator().manual_seed(0))
            newton = median_ms(lambda: psi(O, 0.5))
            svd = median_ms(lambda: svd_half(O))
            out.append({"bench": f"psi_half/{rows}x{cols}", "seconds": newton / 1000,
                        "baseline": "torch.linalg.svd (Ψ_½ = U Σ^½ Vᵀ)", "baseline_seconds": svd / 1000,
                        "ratio": newton / svd})
    return out


def write_results(out: Path, rows: list[dict]) -> None:
    """The rows as one Parquet table (atomically), echoed as text."""
    frame = pd.DataFrame(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_frame(out, frame)
    print(frame.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"written to {out}")


# The floor of a Typer CLI shaped like ours: 19 sub-apps of train / eval / report, nothing else imported.
BARE_TYPER = """
import typer
app = typer.Typer()
for i in range(19):
    sub = typer.Typer()
    for verb in ("train", "eval", "report"):
        sub.command(verb)(lambda: None)
    app.add_typer(sub, name=f"m{i}")
app()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/bench.parquet"))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--methods", nargs="*", default=list(METHODS))
    args = parser.parse_args()
    py = sys.executable
    icml = [py, "-m", "icml.cli.main"]
    rows = []

    bare = median_time([py, "-c", "pass"], args.repeats)
    helped = median_time(icml + ["--help"], args.repeats)
    rows.append({"bench": "startup", "seconds": helped, "baseline": "python -c pass",
                 "baseline_seconds": bare, "ratio": helped / bare})
    typer_app = median_time([py, "-c", BARE_TYPER, "--help"], args.repeats)
    rows.append({"bench": "startup", "seconds": helped, "baseline": "bare Typer app, 19 sub-apps (goal ≤ 1.5×)",
                 "baseline_seconds": typer_app, "ratio": helped / typer_app})

    torch_floor = median_time([py, "-c", "import torch"], 3)
    for method in args.methods:
        with tempfile.TemporaryDirectory() as runs:
            env = {"ICML_RUNS_DIR": runs}
            seconds = sum(timed(icml + [method, verb] + (["--preset", "smoke"] if verb == "train" else [])
                                + ["--quiet"], env) for verb in ("train", "eval", "report"))
        rows.append({"bench": f"smoke/{method}", "seconds": seconds, "baseline": "python -c 'import torch'",
                     "baseline_seconds": torch_floor, "ratio": seconds / torch_floor})
        rows.append({"bench": f"smoke/{method}", "seconds": seconds, "baseline": "smoke budget 60 s",
                     "baseline_seconds": 60.0, "ratio": seconds / 60.0})

    rows += psi_half_vs_svd()
    if "event-classify" in args.methods:
        from icml.methods.event_classify.bench import bench as event_classify_bench

        event_classify_bench(rows)
    if "attribute-motion" in args.methods:
        from icml.methods.attribute_motion.bench import bench as attribute_motion_bench

        attribute_motion_bench(rows)
    if "kv-compress" in args.methods:
        from icml.methods.kv_compress.bench import bench as kv_compress_bench

        kv_compress_bench(rows)
    if "spectral-optim" in args.methods:  # the sweep it times is spectral-optim's grid
        sys.path.insert(0, str(Path(__file__).parent))
        from scale_out import bench as scale_out_bench

        scale_out_bench(rows)

    write_results(args.out, rows)


if __name__ == "__main__":
    main()
