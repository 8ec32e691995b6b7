"""The wall time of one sweep (spectral-optim's variant × LR grid at the smoke size, 4 independent
jobs) by executor, as ratios against the local executor in one process (workers=1):

- local/workers=2: two spawned worker processes (cli/workers.py's process pool);
- ray/workers=1 and ray/workers=2: a local Ray instance of 1 and 2 CPUs, each job a 1-CPU Ray task.

Each sweep is timed inside its driver process, from `main(argv)` to its return: Python's and the Ray
instance's start-up are left out (a cluster is up before a sweep is sent to it), the job processes'
start-up and every job's data preparation are in. Each row also carries the 1-minute load average
before its sweep and the baseline's (`load`, `baseline_load`): on a machine shared with other work
the ratios say little about scaling, and the load says whether it was. Run by itself
(`python benchmarks/scale_out.py`) or from bench.py through `bench(rows)`.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SWEEP = ["spectral-optim", "train", "--preset", "smoke", "--set", "variants=AdamS,mSGDZ",
         "--set", "lr_multipliers=1,3", "--device", "cpu", "--quiet"]

DRIVER = """
import logging, sys, time
cpus, argv = int(sys.argv[1]), sys.argv[2:]
if cpus:
    import ray
    ray.init(num_cpus=cpus, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
from icml.cli.main import main
start = time.perf_counter()
code = main(argv)
print(time.perf_counter() - start)
sys.exit(code)
"""


def sweep_seconds(executor: str, workers: int) -> tuple[float, float]:
    """One sweep in a fresh driver process, and the 1-minute load average before it; `workers` is the
    local process count or the Ray CPUs."""
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as runs:
        argv = SWEEP + ["--runs-dir", runs, "--executor", executor]
        argv += ["--set", f"workers={workers}"] if executor == "local" else []
        done = subprocess.run([sys.executable, "-c", DRIVER, str(workers if executor == "ray" else 0), *argv],
                              capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1]), load


def bench(rows: list[dict]) -> None:
    baseline, baseline_load = sweep_seconds("local", 1)
    for executor, workers in (("local", 2), ("ray", 1), ("ray", 2)):
        seconds, load = sweep_seconds(executor, workers)
        rows.append({"bench": f"scale_out/sweep/{executor}/workers={workers}", "seconds": seconds,
                     "baseline": "local executor, workers=1 (one process)", "baseline_seconds": baseline,
                     "ratio": seconds / baseline, "load": load, "baseline_load": baseline_load})
        print(f"sweep/{executor}/workers={workers}: {seconds:.1f} s, {seconds / baseline:.3f} × one process "
              f"({baseline:.1f} s); load average {load:.1f} before it, {baseline_load:.1f} before the baseline",
              file=sys.stderr, flush=True)


def main() -> None:
    from bench import write_results  # this folder is on sys.path when run as a script

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/scale_out.parquet"))
    args = parser.parse_args()
    rows: list[dict] = []
    bench(rows)
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
