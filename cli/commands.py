"""What every command shares: error handling (one line, exit code, no traceback unless
--debug), quiet mode, and the run/report plumbing used by both the root and method apps."""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Callable

from icml.cli import console
from icml.cli.errors import IcmlError, UsageError
from icml.cli.options import runs_dir_default
from icml.cli.runstore import Run, RunStore

_debug = False


def debugging() -> bool:
    return _debug or os.environ.get("ICML_DEBUG", "") not in ("", "0")


def guarded(fn: Callable) -> Callable:
    """Wrap a command: apply --quiet/--debug, turn errors into one stderr line + exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        global _debug
        _debug = bool(kwargs.get("debug"))
        console.set_quiet(bool(kwargs.get("quiet")) or bool(kwargs.get("json_")))
        try:
            return fn(*args, **kwargs)
        except IcmlError as exc:
            if debugging():
                raise
            console.error(exc.line())
            raise SystemExit(exc.exit_code) from None
        except KeyboardInterrupt:
            console.error("interrupted")
            raise SystemExit(130) from None
        except (SystemExit, MemoryError):
            raise
        except Exception as exc:  # an unexpected failure: still one line unless --debug
            if debugging():
                raise
            message = str(exc).splitlines()[0] if str(exc) else ""
            console.error(f"{type(exc).__name__}: {message} — rerun with --debug for the traceback")
            raise SystemExit(1) from None

    return wrapper


def store(runs_dir: Path | None) -> RunStore:
    return RunStore(runs_dir if runs_dir is not None else runs_dir_default())


def check_format(fmt: str) -> None:
    from icml.reports.render import FORMATS  # light: pandas only when rendering

    if fmt not in FORMATS:
        raise UsageError(f"unknown report format '{fmt}'", f"use one of {', '.join(FORMATS)}")


def report_runs(runs: list[Run], fmt: str, out: Path | None, as_json: bool) -> None:
    from icml.reports.render import build_section, render

    fmt = "json" if as_json else fmt
    sections = [build_section(run) for run in runs]
    text = render(sections, fmt, out)
    if text is not None:
        print(text, end="" if text.endswith("\n") else "\n")
    if out is not None:
        console.say(f"report written to {out}")
