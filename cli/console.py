"""Where output goes: humans read stderr (messages, progress), pipelines read stdout (listings, reports).

`--json` prints exactly one JSON object on stdout; `--quiet` silences the human channel
but never errors.
"""
from __future__ import annotations

import json
import math
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from rich.console import Console

err = Console(stderr=True, highlight=False, soft_wrap=True)
_quiet = False


def set_quiet(quiet: bool) -> None:
    global _quiet
    _quiet = quiet


def say(message: str, style: str | None = None) -> None:
    """One line for the human reader (stderr); dropped under --quiet."""
    if not _quiet:
        err.print(message, style=style)


def show(renderable: Any) -> None:
    """A rich renderable (table, panel) for the human reader."""
    if not _quiet:
        err.print(renderable)


def error(line: str) -> None:
    """Errors always reach stderr, even under --quiet, and never wrap.

    One write with its newline: `print` writes the text and the newline separately, and under
    torchrun another rank's line can land between the two on the shared stderr pipe.
    """
    sys.stderr.write(f"icml: error: {line}\n")
    sys.stderr.flush()


def listing(title: str, header: list[str], rows: list[list[str]]) -> None:
    """A listing is data: it goes to stdout, whole. On a terminal, a rich table whose first column (the
    key: a method, a run id) is never cut; into a pipe or file, plain columns two spaces apart with no
    width limit, so `icml runs | grep fgad` and `awk '{print $NF}'` see every id and path in full."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    if sys.stdout.isatty():
        from rich.table import Table

        out = Console(highlight=False)
        shown = len(header)  # too narrow a terminal drops columns from the right, never cuts a cell
        while shown > 1 and sum(widths[:shown]) + 3 * shown + 1 > out.width:
            shown -= 1
        table = Table(*header[:shown], title=title, title_justify="left",
                      caption=f"(a wider terminal shows {', '.join(header[shown:])})" if shown < len(header) else None)
        for row in rows:
            table.add_row(*row[:shown])
        out.print(table)
        return
    for cells in [header] + rows:
        line = "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
        sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item"):  # numpy scalars
        return _jsonable(value.item())
    return value


def emit_json(obj: dict) -> None:
    """The single JSON object of a `--json` command, on stdout."""
    sys.stdout.write(json.dumps(_jsonable(obj), indent=None, default=str) + "\n")
    sys.stdout.flush()


@contextmanager
def progress(description: str, total: float | None) -> Iterator[Callable[[float], None]]:
    """A progress bar on stderr when it is a terminal and not --quiet; a no-op otherwise.

    Yields `advance(n)`.
    """
    if _quiet or not err.is_terminal:
        yield lambda n=1: None
        return
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TimeRemainingColumn(), console=err, transient=True)
    with bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)
