"""cli/workers.py: every job's result reaches on_done once, in the parent, whether jobs run in this
process or in spawned workers; a failing job re-raises its error."""
from __future__ import annotations

import pytest

from icml.cli.workers import run_in_workers

JOBS = [(("a", 2), pow, (2, 10)), (("b", 3), pow, (3, 4)), (("c", 5), divmod, (17, 5))]
EXPECTED = {("a", 2): 1024, ("b", 3): 81, ("c", 5): (3, 2)}


def test_in_process_jobs_run_in_order():
    seen = []
    run_in_workers(1, JOBS, lambda key, result: seen.append((key, result)))
    assert seen == list(EXPECTED.items())


def test_worker_processes_hand_every_result_to_the_parent_once():
    seen = []
    run_in_workers(2, JOBS, lambda key, result: seen.append((key, result)))
    assert sorted(seen, key=lambda item: item[0]) == sorted(EXPECTED.items())


@pytest.mark.parametrize("workers", [1, 2])
def test_a_failing_job_raises_its_error(workers):
    with pytest.raises(ValueError, match="invalid literal"):
        run_in_workers(workers, [("ok", pow, (2, 2)), ("bad", int, ("x",))], lambda key, result: None)
