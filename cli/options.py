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
    "--preset", help="smoke | default | paper (default: default, or the --config file's).",
    show_default=False)]
Seed = Annotated[Optional[int], typer.Option("--seed", help="Run seed (default: 0, or the --config file's).",
                                              show_default=False)]
Device = Annotated[str, typer.Option("--device", help="auto | cpu | cuda | mps.")]
RunsDir = Annotated[Optional[Path], typer.Option(
    "--runs-dir", help="Where runs live [env ICML_RUNS_DIR; default ./runs].", show_default=False)]
Set = Annotated[Optional[list[str]], typer.Option(
    "--set", help="Override a config key: --set section.key=value (repeatable).", show_default=False)]
ConfigFile = Annotated[Optional[Path], typer.Option(
    "--config", help="JSON config (a run's config.json reproduces that run).", show_default=False)]
Resume = Annotated[Optional[Path], typer.Option(
    "--resume", help="Continue an interrupted run directory from its last checkpoint.", show_default=False)]
DataFile = Annotated[Optional[Path], typer.Option(
    "--data", help="Your own data file (methods with a `data` config key).", show_default=False)]
ModelDir = Annotated[Optional[Path], typer.Option(
    "--model", help="A local checkpoint directory, loaded with from_pretrained (methods with a `model` key).",
    show_default=False)]
Json = Annotated[bool, typer.Option("--json", help="Print exactly one JSON object on stdout.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress or human output on stderr.")]
Debug = Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")]
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
