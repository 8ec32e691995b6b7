"""The errors a user can cause, each carrying the one line that tells them what to do.

Commands raise these; `cli.main` prints `icml: error: <problem> — <fix>` on stderr and exits
with the error's code, without a traceback unless `--debug` is given.
"""
from __future__ import annotations


class IcmlError(Exception):
    """A problem the user can fix: bad input, a missing or corrupt file."""

    exit_code = 1

    def __init__(self, problem: str, fix: str | None = None):
        super().__init__(problem)
        self.problem = problem
        self.fix = fix

    def line(self) -> str:
        return f"{self.problem} — {self.fix}" if self.fix else self.problem


class UsageError(IcmlError):
    """Bad command-line input: unknown name, malformed value, missing argument."""

    exit_code = 2


class RunFailed(IcmlError):
    """A run that started but could not finish (its run.json says failed)."""

    exit_code = 1
