"""The command-line options, defined once and spelled identically in every command."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

DEFAULT_RUNS_DIR = "runs"


def runs_dir_default() -> Path:
    return Path(os.environ.get("ICML_RUNS_DIR", DEFAULT_RUNS_DIR))


Preset = Annotated[Optional[str], typer.Option(
    "--preset", help="smoke | default | paper, or one of the method's own (its train --help lists them; default: default, or the --config file's).",
    show_default=False)]
Seed = Annotated[Optional[int], typer.Option("--seed", help="Run seed (default: 0, or the --config file's).",
                                              show_default=False)]
Device = Annotated[str, typer.Option("--device", help="auto | cpu | cuda | mps.")]
RunsDir = Annotated[Optional[Path], typer.Option(
    "--runs-dir", help="Where runs live (default: ./runs, or the ICML_RUNS_DIR environment variable).",
    show_default=False)]
Set = Annotated[Optional[list[str]], typer.Option(
    "--set", help="Override a config key: --set section.key=value (repeatable).", show_default=False)]
ConfigFile = Annotated[Optional[Path], typer.Option(
    "--config", help="JSON config (a run's config.json reproduces that run).", show_default=False)]
Resume = Annotated[Optional[Path], typer.Option(
    "--resume", help="Continue an interrupted run directory from its last checkpoint.", show_default=False)]
DataFile = Annotated[Optional[Path], typer.Option(
    "--data", help="Your own data, a file or a folder: what this method accepts is listed below.", show_default=False)]
ModelDir = Annotated[Optional[Path], typer.Option(
    "--model", help="A local checkpoint (directory or file): the families this method accepts are listed below.",
    show_default=False)]
Gpus = Annotated[Optional[int], typer.Option(
    "--gpus", min=1, help="Processes, one per GPU (default: the hardware the method's README names for the preset).",
    show_default=False)]
GpuMem = Annotated[Optional[str], typer.Option(
    "--gpu-mem", help="Memory of one GPU, e.g. 80GB or 24GiB (default: as --gpus).", show_default=False)]
Json = Annotated[bool, typer.Option("--json", help="Print exactly one JSON object on stdout.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress or human output on stderr.")]
Debug = Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")]


def _use_executor(value: Optional[str]) -> Optional[str]:
    from .errors import IcmlError
    from .workers import use_executor

    try:
        use_executor(value)
    except IcmlError as exc:  # raised while parsing: click's own one-line usage error
        raise typer.BadParameter(exc.line()) from None
    return value


def _use_ray_address(value: Optional[str]) -> Optional[str]:
    from .workers import use_ray_address

    use_ray_address(value)
    return value


Executor = Annotated[Optional[str], typer.Option(
    "--executor", envvar="ICML_EXECUTOR", callback=_use_executor, show_default=False,
    help="local | ray: where a run's independent jobs (grids, seeds) run (default: local).")]
RayAddress = Annotated[Optional[str], typer.Option(
    "--ray-address", envvar="RAY_ADDRESS", callback=_use_ray_address, show_default=False,
    help="The Ray cluster for --executor ray, e.g. auto or ray://head:10001 (default: start a local "
         "Ray instance).")]
RunDir = Annotated[Optional[Path], typer.Argument(
    help="Run directory (default: the latest suitable run of the method).", show_default=False)]
RunDirs = Annotated[Optional[list[Path]], typer.Argument(
    help="Run directories (default: the latest evaluated run).", show_default=False)]
Format = Annotated[str, typer.Option("--format", "-f", help="terminal | markdown | html | csv | json.")]
Out = Annotated[Optional[Path], typer.Option("--out", "-o", help="Write to FILE instead of stdout.",
                                              show_default=False)]
MethodName = Annotated[Optional[str], typer.Option("--method", "-m", help="Only this method.",
                                                    show_default=False)]
All = Annotated[bool, typer.Option("--all", help="Every run with results.")]
Seeds = Annotated[Optional[str], typer.Option(
    "--seeds", help="Comma-separated seeds, e.g. 0,1,2: one new run per seed, recorded as one group.",
    show_default=False)]
SeedsOfGroup = Annotated[Optional[str], typer.Option(
    "--seeds", help="Comma-separated seeds, e.g. 0,1,2: the runs of these seeds (of --group, else of the newest "
                    "group that has them).", show_default=False)]
Group = Annotated[Optional[str], typer.Option(
    "--group", help="A group id (run.json 'group'): the runs of one multi-seed command.", show_default=False)]
SeedWorkers = Annotated[int, typer.Option(
    "--seed-workers", help="Seeds run at once in worker processes (1: one after another here).")]
PresetFilter = Annotated[Optional[str], typer.Option(
    "--preset", help="With --method: report over the seeds of this preset's runs.", show_default=False)]
PresetOfRuns = Annotated[Optional[str], typer.Option(
    "--preset", help="Report over the seeds of this preset's newest runs (one run per seed).", show_default=False)]


def parse_seeds(text: str) -> list[int]:
    """'0,1,2' -> [0, 1, 2]; anything else is a usage error naming the fix."""
    from .errors import UsageError

    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"--seeds '{text}' is not a comma-separated list of integers", "e.g. --seeds 0,1,2") from None
    if not seeds or any(s < 0 for s in seeds):
        raise UsageError(f"--seeds '{text}' needs at least one non-negative seed", "e.g. --seeds 0,1,2")
    if len(set(seeds)) != len(seeds):
        raise UsageError(f"--seeds '{text}' repeats a seed", "list each seed once (the same seed gives the same run)")
    return seeds
