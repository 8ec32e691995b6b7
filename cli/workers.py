"""Independent jobs of one run in spawned worker processes, shared by every method.

A job is `fn(*args)` with a module-level (picklable) `fn`. Its result comes back to the parent,
which alone records it, so each run table has one writer. Workers are spawned, not forked: the
parent already holds torch and its thread pools, which a fork does not copy safely. Callers must
make results independent of which worker ran which job (seeds from the job, not the process).
"""
from __future__ import annotations

from typing import Any, Callable


def run_in_workers(workers: int, jobs: list[tuple[Any, Callable, tuple]],
                   on_done: Callable[[Any, Any], None]) -> None:
    """Run every job (key, fn, args) and call on_done(key, fn(*args)) here, in completion order: in
    `workers` processes, or in this process, in order, when workers ≤ 1 or there is at most one job.
    A failing job or Ctrl-C cancels the queued jobs (finished ones were already handed to on_done)
    and re-raises."""
    if workers <= 1 or len(jobs) <= 1:
        for key, fn, args in jobs:
            on_done(key, fn(*args))
        return
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        pending = {pool.submit(fn, *args): key for key, fn, args in jobs}
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                on_done(pending.pop(future), future.result())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
