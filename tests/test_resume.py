"""Resume is exact, for every method: Ctrl-C inside a test-sized train run, then `--resume`, records the same
train rows as an uninterrupted run of the same config, row for row (timing metrics aside). Each method runs its
CLI tests' own TINY config (tests/test_seeds.py reads the same one); the interrupt comes at the second
progress advance, or at the first where a run's progress has one step (then nothing was checkpointed yet and the
resume starts over). A method whose train has no progress to interrupt (robust-sysid: its jobs are eval's,
checkpointed per job) is interrupted in eval instead, and eval run again on the same run. fgad and kv-compress also pin a mid-grid / mid-training resume in their own CLI tests."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from conftest import interrupt_progress, invoke
from icml.cli.registry import METHODS
from test_seeds import TIMING, tiny_args


def _rows(run, phase: str = "train") -> pd.DataFrame:
    frame = pd.read_parquet(Path(run) / "metrics.parquet")
    frame = frame[(frame["phase"] == phase) & ~frame["metric"].str.contains(TIMING)].drop(columns=["run_id"])
    keys = [c for c in frame.columns if c != "value"]
    return frame.sort_values(keys, na_position="first").reset_index(drop=True)


@pytest.mark.parametrize("name", list(METHODS))
def test_a_resumed_run_records_what_an_uninterrupted_one_does(name, tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    argv = [name, "train", *tiny_args(name), "--runs-dir", runs, "--json"]
    whole = invoke(*argv)
    assert whole.code == 0, whole.err[-2000:]
    stopped = _interrupted(monkeypatch, argv)
    if stopped.code == 0:  # nothing in train to interrupt: eval holds the jobs
        _eval_resumes_exactly(name, runs, whole.json()["run_dir"], argv, monkeypatch)
        return
    assert stopped.code == 130, stopped.err[-2000:]
    interrupted = max((p for p in (runs / name).iterdir() if p.name != whole.json()["run_id"]),
                      key=lambda p: p.stat().st_mtime)
    resumed = invoke(name, "train", "--resume", interrupted, "--runs-dir", runs)
    assert resumed.code == 0, resumed.err[-2000:]
    pd.testing.assert_frame_equal(_rows(interrupted), _rows(whole.json()["run_dir"]), check_exact=True)


def _interrupted(monkeypatch, argv):
    """The command stopped by Ctrl-C at its second progress advance, else at its first."""
    for at in (2, 1):
        restore = interrupt_progress(monkeypatch, lambda calls, units, at=at: calls == at)
        result = invoke(*argv)
        restore()
        if result.code != 0:
            return result
    return result


def _eval_resumes_exactly(name, runs, whole_run, train_argv, monkeypatch):
    assert invoke(name, "eval", whole_run, "--runs-dir", runs).code == 0
    other = invoke(*train_argv)
    assert other.code == 0, other.err[-2000:]
    run = other.json()["run_dir"]
    stopped = _interrupted(monkeypatch, [name, "eval", run, "--runs-dir", runs])
    assert stopped.code == 130, f"{name}: neither train nor eval could be interrupted"
    again = invoke(name, "eval", run, "--runs-dir", runs)
    assert again.code == 0, again.err[-2000:]
    pd.testing.assert_frame_equal(_rows(run, "eval"), _rows(whole_run, "eval"), check_exact=True)
