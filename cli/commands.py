"""What every command shares: error handling (one line, exit code, no traceback unless
--debug), quiet mode, and the run/report plumbing used by both the root and method apps."""
from __future__ import annotations

import functools
import os
import sys
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
        as_json = bool(kwargs.get("json_"))
        try:
            return fn(*args, **kwargs)
        except IcmlError as exc:
            if debugging():
                raise
            fail(exc.problem, exc.fix, exc.exit_code, as_json)
        except KeyboardInterrupt:
            fail("interrupted", None, 130, as_json)
        except SystemExit as exc:  # the lifecycle's Ctrl-C (130) has printed its line; --json still gets its object
            if as_json and exc.code == 130:
                console.emit_json({"status": "interrupted", "error": "interrupted", "fix": None, "exit_code": 130})
            raise
        except BrokenPipeError:  # `icml list | head`: the reader has gone, nothing failed here
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush is quiet too
            raise SystemExit(0) from None
        except MemoryError:
            raise
        except Exception as exc:  # an unexpected failure: still one line unless --debug
            if debugging():
                raise
            message = str(exc).splitlines()[0] if str(exc) else ""
            fail(f"{type(exc).__name__}: {message}", "rerun with --debug for the traceback", 1, as_json)

    return wrapper


def fail(problem: str, fix: str | None, exit_code: int, as_json: bool = False):
    """End a command on an error: one line on stderr and, under --json, one JSON object on stdout
    (status, error, fix, exit_code), so `RD=$(icml … --json | jq -r .run_dir)` fails on a clear object
    rather than reading an empty stdout."""
    console.error(f"{problem} — {fix}" if fix else problem)
    if as_json:
        console.emit_json({"status": "error", "error": problem, "fix": fix, "exit_code": exit_code})
    raise SystemExit(exit_code) from None


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
