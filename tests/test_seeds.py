"""Seeds are seeds, over every method: two run seeds of a method's test-sized config give different
metrics (the run seed reaches its data, init, injection or partition), unless the method declares
itself deterministic by design; and every claim a method declares evaluates on its runs without
averaging a tag it does not pin (reports/claims.py). Copies of one run must never pass for seeds:
a group report over copies once said two fgad claims "hold" on the interval [0.0469, 0.0469].

Each method runs its CLI tests' own TINY config (one source of truth for "test-sized"), at seeds 0
and 1 as one `--seeds` group: the train rows are compared (both seeds are evaluated only when train records
nothing that moves), and the claims are evaluated on seed 0's eval rows."""
from __future__ import annotations

import importlib
import re

import pandas as pd
import pytest

from conftest import invoke
from icml.cli.registry import METHODS, get
from icml.reports.claims import ClaimError, arm_value

# Metrics that measure the machine, not the method: they differ between any two runs.
TIMING = re.compile(r"wall|_s$|_s_|sps|secs|seconds|time|latency|_ms|ms_|throughput|tokens_per_s|peak_mem|rss")


def tiny_args(name: str) -> list[str]:
    args = list(importlib.import_module(f"test_{name.replace('-', '_')}_cli").TINY)
    if "--seed" in args:  # the group's seeds replace a fixed one
        at = args.index("--seed")
        del args[at:at + 2]
    return args


def _ok(result) -> dict:
    assert result.code == 0, result.err[-2000:]
    return result.json()


def _moved(frames: list[pd.DataFrame], phase: str) -> tuple[int, int]:
    """(rows compared, rows whose value differs between the two seeds) of `phase`, timing metrics left out."""
    key = [c for c in frames[0].columns if c not in ("run_id", "seed", "value")]
    a, b = (f[(f["phase"] == phase) & ~f["metric"].str.contains(TIMING)] for f in frames)
    both = a.merge(b, on=key, how="outer", suffixes=("_0", "_1"))
    same = (both["value_0"] == both["value_1"]) | (both["value_0"].isna() & both["value_1"].isna())
    return len(both), int((~same).sum())


@pytest.mark.parametrize("name", list(METHODS))
def test_two_seeds_differ_and_claims_pin_their_tags(name, tmp_path):
    method = get(name)
    runs_dir = ["--runs-dir", tmp_path / "runs"]
    if method.deterministic:
        result = invoke(name, "train", *tiny_args(name), "--seeds", "0,1", *runs_dir)
        assert result.code == 2 and "same results at every seed" in result.err
        return
    workers = ["--seed-workers", "2"]  # the two seeds side by side, one per core
    group = _ok(invoke(name, "train", *tiny_args(name), "--seeds", "0,1", *workers, *runs_dir, "--json"))
    runs = [run["run_dir"] for run in group["runs"]]
    read = lambda: [pd.read_parquet(f"{run}/metrics.parquet") for run in runs]  # noqa: E731
    frames = read()
    compared, moved = _moved(frames, "train")
    if not moved:  # what the seed changes may show only in eval: evaluate both seeds
        _ok(invoke(name, "eval", "--group", group["group"], *workers, *runs_dir, "--json"))
        frames = read()
        compared, moved = _moved(frames, "eval")
    else:  # the claims below need eval rows of one run
        _ok(invoke(name, "eval", runs[0], *runs_dir, "--json"))
        frames = read()
    assert compared and moved, f"{name}: seeds 0 and 1 give identical metrics: the run seed reaches nothing"

    evaluated = frames[0]
    for claim in getattr(method.part("report"), "CLAIMS", ()):  # every claim names rows it does not pool by accident
        for arm in (claim.a, claim.b):
            try:
                arm_value(evaluated, claim, arm)
            except ClaimError as exc:
                pytest.fail(f"{name}: {exc}")
