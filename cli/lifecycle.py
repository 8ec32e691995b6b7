"""The train → eval lifecycle shared by every method.

A method supplies `pipeline.train(ctx)` and `pipeline.evaluate(ctx)`; this module resolves
the config (preset → --config → --set), creates or reopens the run directory, seeds every
generator, records status transitions in run.json, turns Ctrl-C into an `interrupted` run
that `--resume` continues, and hands the method a `RunContext` to record results through.
"""
from __future__ import annotations

import random
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import pandas as pd

from . import config as config_io
from . import console
from .errors import IcmlError, UsageError
from .method import Method
from .results import append_metrics, drop_metrics, metrics_schema, read_metrics, write_frame
from .runstore import Run, RunStore

INTERRUPTED_EXIT = 130


@dataclass
class RunContext:
    """What a method's train/evaluate sees: its run, config, seed, device and a results sink."""

    method: Method
    run: Run
    config: Any
    seed: int
    device: str
    preset: str
    phase: str
    resumed: bool = False
    _buffer: list[dict] = field(default_factory=list)

    @property
    def checkpoints(self) -> Path:
        self.run.checkpoints.mkdir(parents=True, exist_ok=True)
        return self.run.checkpoints

    @property
    def schema(self):
        return metrics_schema(self.method.tags)

    def _complete(self, rows: Iterable[dict], split: str) -> list[dict]:
        run_id = self.run.path.name
        out = []
        for row in rows:
            full = {"run_id": run_id, "method": self.method.name, "phase": self.phase,
                    "step": 0, "split": split, "seed": self.seed}
            full.update(row)
            out.append(full)
        return out

    def record(self, rows: Iterable[dict], split: str = "test") -> None:
        """Record metric rows (metric, value, variant, tags…; step/split/seed optional).

        Train rows are appended to metrics.parquet at once, so an interrupted run keeps
        them; eval rows are written together when eval completes, replacing the rows of
        any earlier eval of this run.
        """
        rows = self._complete(rows, split)
        if not rows:
            return
        if self.phase == "eval":
            self._buffer += rows
        else:
            append_metrics(self.run.metrics_path, rows, self.schema)

    def forget(self, **match) -> None:
        """Drop this phase's recorded rows that match every item (e.g. variant="x"): a job that --resume
        starts over, having no checkpoint of its own, records its rows again rather than twice."""
        drop_metrics(self.run.metrics_path, self.schema, {"phase": self.phase, **match})

    def flush(self) -> None:
        if self.phase == "eval" and self._buffer:
            append_metrics(self.run.metrics_path, self._buffer, self.schema, replace={"phase": "eval"})
            self._buffer = []

    def metrics(self) -> pd.DataFrame:
        """The rows recorded so far (empty frame if none)."""
        if not self.run.metrics_path.exists():
            return pd.DataFrame(columns=self.schema.names)
        return read_metrics(self.run.metrics_path, self.schema)

    def write_table(self, name: str, frame: pd.DataFrame) -> Path:
        path = self.run.table_path(name)
        write_frame(path, frame)
        return path

    @contextmanager
    def progress(self, description: str, total: float | None) -> Iterator[Callable[[float], None]]:
        with console.progress(description, total) as advance:
            yield advance

    def log(self, message: str) -> None:
        console.say(message)


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        if torch.cuda.is_available():
            return "cuda"
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return "mps"
        return "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available here", "use --device cpu or --device auto")
    if name == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise UsageError("--device mps: no Apple MPS device is available here", "use --device cpu or --device auto")
    return name


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def input_overrides(method: Method, inputs: dict[str, Path]) -> list[str]:
    """--data FILE / --model DIR become the `data=` / `model=` config keys of methods that have them
    (or `data.path=` / `model.path=` where the key is a section of its own)."""
    keys = config_io.valid_keys(method.config)
    assignments = []
    for key, path in inputs.items():
        target = key if key in keys else f"{key}.path" if f"{key}.path" in keys else None
        if target is None:
            raise UsageError(f"{method.name} takes no --{key}",
                             f"see 'icml {method.name} train --help' and its README for its inputs")
        if not path.exists():
            raise UsageError(f"--{key} '{path}' does not exist", "check the path")
        assignments.append(f"{target}={path.resolve()}")
    return assignments


def resolve_config(method: Method, preset: str | None, seed: int | None, config_file: Path | None,
                   overrides: list[str], validate: bool = True) -> tuple[Any, str, int]:
    """preset → --config → --set, then the method's validation (`plan` sizes a config without its inputs, so
    it skips the validation that asks for them; keys and types are still checked)."""
    tree, defaults = ({}, {})
    if config_file is not None:
        tree, defaults = config_io.load_config_file(config_file)
        if defaults.get("method") not in (None, method.name):
            raise UsageError(f"config file '{config_file}' is for {defaults['method']}, not {method.name}",
                             f"use 'icml {defaults['method']} train --config …'")
    preset = preset or defaults.get("preset") or "default"
    if preset not in method.preset_names():
        raise UsageError(f"unknown preset '{preset}'", f"use one of {', '.join(method.preset_names())}")
    seed = seed if seed is not None else int(defaults.get("seed", 0))
    cfg = method.preset(preset)
    if tree:
        config_io.apply_tree(cfg, tree, f"config file '{config_file}'")
    config_io.apply_overrides(cfg, overrides)
    if validate and method.validate is not None:
        try:
            method.validate(cfg)
        except ValueError as exc:
            raise UsageError(str(exc), f"see 'icml {method.name} train --help' for its keys and inputs") from None
    return cfg, preset, seed


def check_inputs(method: Method, cfg: Any) -> None:
    """The method's look at the content of its inputs, before any run directory exists: a bad file is a
    usage error (exit 2) whether the problem is its name, its format or its content."""
    if method.check_inputs is None:
        return
    try:
        method.check_inputs(cfg)
    except UsageError:
        raise
    except (ValueError, IcmlError) as exc:
        problem, fix = (exc.problem, exc.fix) if isinstance(exc, IcmlError) else (str(exc), None)
        if fix is None and " — " not in problem:  # a ValueError's line may carry its own fix already
            fix = f"see 'icml {method.name} train --help' for what its inputs are"
        raise UsageError(problem, fix) from None


def config_from_run(method: Method, run: Run) -> tuple[Any, str, int]:
    record = run.config_record()
    preset = record.get("preset", "default")
    cfg = method.preset(preset if preset in method.preset_names() else "default")
    config_io.apply_tree(cfg, record.get("config", {}), f"{run.config_path}")
    return cfg, preset, int(record.get("seed", 0))


def _execute(ctx: RunContext, hook: Callable[[RunContext], None]) -> None:
    """Run one phase's hook with status bookkeeping; Ctrl-C → interrupted (exit 130)."""
    run = ctx.run
    run.set_phase(ctx.phase, "running", device=ctx.device, resumed=ctx.resumed)
    seed_everything(ctx.seed)
    try:
        hook(ctx)
        ctx.flush()
    except KeyboardInterrupt:
        run.set_phase(ctx.phase, "interrupted")
        hint = (f"resume with: icml {ctx.method.name} train --resume {run.path}" if ctx.phase == "train"
                else f"re-run: icml {ctx.method.name} eval {run.path}")
        console.error(f"interrupted; {ctx.phase} state kept in {run.path} — {hint}")
        raise SystemExit(INTERRUPTED_EXIT) from None
    except IcmlError as exc:
        run.set_phase(ctx.phase, "failed", error=exc.line())
        raise
    except Exception as exc:
        run.set_phase(ctx.phase, "failed", error=f"{type(exc).__name__}: {exc}")
        raise
    run.set_phase(ctx.phase, "completed")


def train(method: Method, store: RunStore, *, preset: str | None, seed: int | None, device: str,
          config_file: Path | None, overrides: list[str], resume: Path | None,
          inputs: dict[str, Path] | None = None, group: str | None = None) -> Run:
    inputs = inputs or {}
    if resume is not None:
        if overrides or inputs or config_file is not None or preset is not None or seed is not None:
            raise UsageError("--resume continues a run with its own config, preset and seed",
                             "drop --set/--config/--preset/--seed/--data/--model, or start a new run")
        run = store.open(resume, method.name)
        cfg, preset, seed = config_from_run(method, run)
        if run.phase_status("train") == "completed":
            console.say(f"train of {run.path} already completed; nothing to resume")
            return run
        resumed = True
    else:
        overrides = input_overrides(method, inputs) + overrides
        cfg, preset, seed = resolve_config(method, preset, seed, config_file, overrides)
        check_inputs(method, cfg)
        resumed = False
    device = resolve_device(device)
    pipeline = method.part("pipeline")  # before creating the run: a broken install leaves no husk
    if not resumed:
        run = store.create(method.name, preset, seed, device, config_io.to_dict(cfg), group=group)
    cost = f" ({method.preset_times[preset]})" if preset in method.preset_times else ""  # measured on 2 cores
    console.say(f"{method.name} train · preset {preset}{cost} · seed {seed} · {device} → {run.path}")
    if resumed:
        console.say(resume_point(method, run))
    ctx = RunContext(method, run, cfg, seed, device, preset, "train", resumed=resumed)
    _execute(ctx, pipeline.train)
    return run


def resume_point(method: Method, run: Run) -> str:
    """Where a resumed train continues: from the run's checkpoints and the train rows it kept."""
    saved = run.checkpoints.is_dir() and any(p.is_file() for p in run.checkpoints.rglob("*"))
    if not saved:
        return "resume: no checkpoint yet: starting over"
    rows = read_metrics(run.metrics_path, metrics_schema(method.tags)) if run.metrics_path.exists() else None
    train = rows[rows["phase"] == "train"] if rows is not None else []
    if len(train) == 0:
        return "resume: continues from the run's checkpoints (no train rows recorded yet)"
    return (f"resume: continues from the run's checkpoints after train step {int(train['step'].max())} "
            f"({len(train)} train rows kept)")


def evaluate(method: Method, store: RunStore, *, run_dir: Path | None, device: str) -> Run:
    run = store.open(run_dir, method.name) if run_dir else store.latest(method.name, "train")
    if run.phase_status("train") != "completed":
        raise UsageError(f"train of {run.path} is {run.phase_status('train') or 'missing'}",
                         f"finish it first: icml {method.name} train --resume {run.path}")
    cfg, preset, seed = config_from_run(method, run)
    if run.metrics_path.exists():  # fail before the work, not after it, if results cannot be appended
        read_metrics(run.metrics_path, metrics_schema(method.tags))
    device = resolve_device(device)
    pipeline = method.part("pipeline")
    console.say(f"{method.name} eval · preset {preset} · seed {seed} · {device} · {run.path}")
    ctx = RunContext(method, run, cfg, seed, device, preset, "eval")
    _execute(ctx, pipeline.evaluate)
    return run


# seeds as an axis: one run per seed, as jobs of the shared runner -----------------------------
def _train_job(method_name: str, root: str, options: dict) -> str:
    """One seed's train (module level: a worker process can run it); returns the run directory."""
    from . import registry

    return str(train(registry.get(method_name), RunStore(Path(root)), **options).path)


def _eval_job(method_name: str, root: str, run_dir: str, device: str) -> str:
    from . import registry

    return str(evaluate(registry.get(method_name), RunStore(Path(root)), run_dir=Path(run_dir), device=device).path)


def new_group_id(preset: str, seeds: list[int]) -> str:
    import secrets
    from datetime import datetime

    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"g{stamp}-{preset}-s{'-'.join(map(str, seeds))}-{secrets.token_hex(2)}"


def train_seeds(method: Method, store: RunStore, *, seeds: list[int], preset: str | None, device: str,
                config_file: Path | None, overrides: list[str], inputs: dict[str, Path] | None = None,
                workers: int = 1) -> list[Run]:
    """`train --seeds`: one run per seed, all with the same new group id in run.json, run as jobs of
    `run_in_workers` (here one after another for workers ≤ 1). Every bad input fails before any run."""
    from .workers import run_in_workers

    inputs = inputs or {}
    if method.deterministic:
        raise UsageError(f"{method.name} gives the same results at every seed ({method.deterministic}): "
                         "--seeds would make copies, not seeds", "train one run, without --seeds")
    cfg, preset, _ = resolve_config(method, preset, seeds[0], config_file, input_overrides(method, inputs) + overrides)
    check_inputs(method, cfg)
    resolve_device(device)
    group = new_group_id(preset, seeds)
    options = {"preset": preset, "device": device, "config_file": config_file, "overrides": list(overrides),
               "resume": None, "inputs": inputs, "group": group}
    console.say(f"{method.name} train · group {group} · seeds {', '.join(map(str, seeds))}")
    done: dict[int, Run] = {}
    jobs = [(seed, _train_job, (method.name, str(store.root), {**options, "seed": seed})) for seed in seeds]
    run_in_workers(workers, jobs, lambda seed, path: done.__setitem__(seed, Run(Path(path))))
    return [done[seed] for seed in seeds]


def evaluate_runs(method: Method, store: RunStore, runs: list[Run], *, device: str, workers: int = 1) -> list[Run]:
    """`eval` of several runs (a group's seeds), as jobs of `run_in_workers`."""
    from .workers import run_in_workers

    resolve_device(device)
    for run in runs:  # refuse before any work
        if run.phase_status("train") != "completed":
            raise UsageError(f"train of {run.path} is {run.phase_status('train') or 'missing'}",
                             f"finish it first: icml {method.name} train --resume {run.path}")
    done: dict[str, Run] = {}
    jobs = [(str(run.path), _eval_job, (method.name, str(store.root), str(run.path), device)) for run in runs]
    run_in_workers(workers, jobs, lambda key, path: done.__setitem__(key, Run(Path(path))))
    return [done[str(run.path)] for run in runs]
