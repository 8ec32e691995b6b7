"""cli/workers.py's Ray backend on a local Ray instance of 2 CPUs (one per module): every job's result
reaches on_done once, in the driver; a failing job raises its own error; Ctrl-C cancels the queued
and running jobs; a grid run with `--executor ray` writes the same metrics.parquet values as the
local executor; and without Ray, `--executor ray` says in one line how to install it."""
from __future__ import annotations

import importlib.util
import logging
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from icml.cli import workers
from icml.cli.workers import run_in_workers

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow  # torchrun / Ray start-up: seconds of CPU each

JOBS = [(("a", 2), pow, (2, 10)), (("b", 3), pow, (3, 4)), (("c", 5), divmod, (17, 5))]
EXPECTED = {("a", 2): 1024, ("b", 3): 81, ("c", 5): (3, 2)}


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    workers.use_executor("ray")
    yield
    workers._executor = None  # back to ICML_EXECUTOR / local for the modules that follow
    ray.shutdown()


def test_every_result_reaches_the_driver_once():
    seen = []
    run_in_workers(1, JOBS, lambda key, result: seen.append((key, result)))
    assert sorted(seen, key=lambda item: item[0]) == sorted(EXPECTED.items())


def test_a_failing_job_raises_its_own_error():
    with pytest.raises(ValueError, match="invalid literal") as raised:
        run_in_workers(2, [("ok", pow, (2, 2)), ("bad", int, ("x",))], lambda key, result: None)
    assert type(raised.value) is ValueError  # the job's error, not Ray's wrapper with its traceback


def touch_after(path: str, seconds: float) -> str:
    time.sleep(seconds)
    Path(path).touch()
    return path


def test_ctrl_c_cancels_the_other_jobs(tmp_path):
    # each job writes its file after 6 s: long enough that a loaded machine still cancels the running one first
    files = [tmp_path / f"job{i}" for i in range(3)]
    jobs = [("fast", pow, (2, 2))] + [(str(f), touch_after, (str(f), 6.0)) for f in files]

    def interrupt(key, result):
        raise KeyboardInterrupt

    # the Ray workers cannot import this test module: its functions travel by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        with pytest.raises(KeyboardInterrupt):
            run_in_workers(2, jobs, interrupt)
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    time.sleep(7.0)  # longer than any job would have needed
    assert not [f for f in files if f.exists()]  # queued ones never ran, the running one was stopped


def test_a_grid_on_ray_writes_the_local_executors_metrics(tmp_path):
    from conftest import invoke
    from test_spectral_optim_cli import TINY

    def metrics(*executor: str) -> pd.DataFrame:
        result = invoke("spectral-optim", "train", *TINY, "--set", "lr_multipliers=1,3", "--set", "variants=AdamS,mSGDZ",
                        "--runs-dir", tmp_path / executor[-1], *executor, "--json")
        assert result.code == 0, result.err
        frame = pd.read_parquet(Path(result.json()["run_dir"]) / "metrics.parquet")
        columns = ["variant", "lr_multiplier", "metric", "step", "split", "value"]
        frame = frame.loc[frame["metric"] != "step_ms", columns]  # a timing, the only machine-dependent value
        return frame.sort_values(columns[:-1]).reset_index(drop=True)

    on_ray = metrics("--executor", "ray")
    local = metrics("--executor", "local")
    assert len(on_ray) == len(local) > 0
    pd.testing.assert_frame_equal(on_ray, local, check_exact=True)


def test_executor_ray_without_ray_says_how_to_install_it(icml, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    result = icml("spectral-optim", "train", "--preset", "smoke", "--executor", "ray")
    assert result.code == 2
    (line,) = result.err.strip().splitlines()
    assert line.startswith("icml: error: Invalid value for '--executor'")
    assert "--executor ray needs Ray, which is not installed — install it: pip install 'icml[ray]'" in line
    monkeypatch.undo()
    workers.use_executor("ray")  # the module's executor again, for tests that follow
