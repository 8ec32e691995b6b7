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


SLEEPY = '''
import os, sys, time
from pathlib import Path
from icml.cli.workers import run_in_workers

def job(i, folder):
    (Path(folder) / f"{os.getpid()}.pid").write_text("")
    time.sleep(60)
    return i

if __name__ == "__main__":
    import signal
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal, even if our parent ignores it
    print("ready", flush=True)
    try:
        run_in_workers(2, [(i, job, (i, sys.argv[1])) for i in range(4)], lambda key, result: None)
    except KeyboardInterrupt:
        sys.exit(130)
'''


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("after", [0.0, 1.5, 4.0])
def test_ctrl_c_ends_every_worker_and_exits_130(tmp_path, after):
    """SIGINT as the workers are spawned (0 s), while they import (1.5 s) and while they run jobs (4 s):
    the parent exits 130 at once and leaves no worker behind, and no worker prints a traceback (the
    pool used to wait for running jobs, and to hang for good when a worker died mid-start)."""
    import signal
    import subprocess
    import sys
    import time

    script, pids = tmp_path / "sleepy.py", tmp_path / "pids"
    script.write_text(SLEEPY)
    pids.mkdir()
    process = subprocess.Popen([sys.executable, str(script), str(pids)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "ready\n"
    time.sleep(after)
    started = time.monotonic()
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 130 and time.monotonic() - started < 15, err
    assert "Traceback" not in err, err
    workers = [int(p.stem) for p in pids.iterdir()]
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in workers)
