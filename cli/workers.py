"""Independent jobs of one run, shared by every method: in spawned worker processes on this machine
(executor `local`) or as tasks of a Ray cluster (executor `ray`).

A job is `fn(*args)` with a module-level (picklable, importable) `fn`. Its result comes back to the
parent, which alone records it, so each run table has one writer whichever executor ran the job.
Local workers are spawned, not forked: the parent already holds torch and its thread pools, which a
fork does not copy safely. Callers must make results independent of which worker ran which job
(seeds from the job, not the process), which is also what makes the two executors agree.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Any, Callable

from .errors import UsageError

EXECUTORS = ("local", "ray")
RAY_MISSING = "--executor ray needs Ray, which is not installed"
RAY_INSTALL = "pip install 'icml[ray]' (or pip install ray)"

# Chosen once per command by the CLI (--executor / --ray-address); the environment otherwise.
_executor: str | None = None
_ray_address: str | None = None


def use_executor(executor: str | None) -> None:
    """Select where the jobs of this process's runs go (None: ICML_EXECUTOR, else local)."""
    global _executor
    name = executor or os.environ.get("ICML_EXECUTOR") or "local"
    if name not in EXECUTORS:
        raise UsageError(f"unknown executor '{name}'", f"use one of {', '.join(EXECUTORS)}")
    if name == "ray" and importlib.util.find_spec("ray") is None:  # fail at the command, not at the first grid
        raise UsageError(RAY_MISSING, f"install it: {RAY_INSTALL}")
    _executor = name


def use_ray_address(address: str | None) -> None:
    """The Ray cluster to connect to (None: RAY_ADDRESS, else a local instance started here)."""
    global _ray_address
    _ray_address = address


def executor() -> str:
    if _executor is None:
        use_executor(None)
    return _executor


def run_in_workers(workers: int, jobs: list[tuple[Any, Callable, tuple]],
                   on_done: Callable[[Any, Any], None], *, cpus: float = 1, gpus: float = 0) -> None:
    """Run every job (key, fn, args) and call on_done(key, fn(*args)) here, in completion order.

    Executor local: in `workers` processes, or in this process, in order, when workers ≤ 1 or there
    is at most one job. Executor ray: every job is a Ray task that reserves `cpus` CPUs and `gpus`
    GPUs; the cluster runs as many at once as its resources hold (`workers` is the local process
    count only). Under torchrun every rank runs the jobs in order in its own process: the ranks of one
    job must run it together. A failing job or Ctrl-C cancels the queued jobs (finished ones were
    already handed to on_done) and re-raises.
    """
    from . import distributed

    if distributed.launched() or not jobs:
        workers = 1
    elif executor() == "ray":
        _run_on_ray(jobs, on_done, cpus, gpus)
        return
    if workers <= 1 or len(jobs) <= 1:
        for key, fn, args in jobs:
            with distributed.ranks_stop_together():
                result = fn(*args)
            on_done(key, result)
        return
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_leave_ctrl_c_to_the_parent)
    try:
        pending = {pool.submit(fn, *args): key for key, fn, args in jobs}
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                on_done(pending.pop(future), future.result())
    except BaseException:
        _stop_workers(pool)
        raise
    pool.shutdown(wait=True)


def _leave_ctrl_c_to_the_parent() -> None:
    """In each worker: Ctrl-C reaches the whole process group, and a worker that raised on it would print
    its own traceback and could die while the pool hands it a job (the pool then never shuts down).
    The parent alone reacts, and ends the workers."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _stop_workers(pool) -> None:
    """End a pool's workers now, running jobs included (the run is interrupted or failed: their results
    are not wanted). `shutdown(wait=True)` would wait for every running job to finish, and hangs for good
    when a worker died mid-job; the executor has no public way to reach its processes."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()


# ---------------------------------------------------------------------------------------------
# Ray
# ---------------------------------------------------------------------------------------------
def _import_ray():
    try:
        import ray
    except ImportError:
        raise UsageError(RAY_MISSING, f"install it: {RAY_INSTALL}") from None
    return ray


def _connect_ray():
    """The Ray instance of --ray-address / RAY_ADDRESS, or a local one started here (all this
    machine's cores); one already initialised in this process (e.g. by a test) is reused."""
    import logging

    ray = _import_ray()
    if not ray.is_initialized():
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no phoning home from a CLI run
        address = _ray_address or os.environ.get("RAY_ADDRESS") or None
        try:
            ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
                     log_to_driver=False, configure_logging=True)
        except ConnectionError as exc:
            raise UsageError(f"cannot reach the Ray cluster at '{address}' ({str(exc).splitlines()[0]})",
                             "start it with 'ray start --head' or fix --ray-address / RAY_ADDRESS") from None
    return ray


def _run_on_ray(jobs, on_done, cpus: float, gpus: float) -> None:
    ray = _connect_ray()
    task = ray.remote(_call)
    pending = {task.options(num_cpus=cpus, num_gpus=gpus, max_retries=0).remote(fn, args): key
               for key, fn, args in jobs}
    try:
        while pending:
            finished, _ = ray.wait(list(pending), num_returns=1)
            for ref in finished:
                key = pending.pop(ref)
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayTaskError as exc:  # the job's own error, as a local run raises it
                    cause = getattr(exc, "cause", None)
                    if isinstance(cause, BaseException):
                        raise cause from None
                    raise
                on_done(key, result)
    finally:
        for ref in pending:  # queued ones never start; running ones stop (as Ctrl-C stops local workers)
            ray.cancel(ref, force=True)


def _call(fn: Callable, args: tuple) -> Any:
    """One job in a Ray worker process."""
    return fn(*args)
