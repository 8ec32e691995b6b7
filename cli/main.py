"""The root `icml` command: list, runs, report, and one sub-app per registered method.

Importing this module imports no torch (help and listing stay fast); commands import
their heavy dependencies when they run.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import click
import typer
from typer.core import TyperGroup

from icml.cli import console, registry
from icml.cli.commands import check_format, guarded, report_runs, store
from icml.cli.errors import UsageError
from icml.cli.method_app import method_app
from icml.cli.options import (All, Debug, Format, Group, Json, MethodName, Out, PresetFilter, Quiet, RunDirs, RunsDir,
                              Seeds, parse_seeds)

class RootGroup(TyperGroup):
    """The root command. A method's sub-commands are built only when it is named (`icml fgad …`): building
    all 19 methods' ~70 commands at every start cost more than the rest of `icml --help`. Listed in help
    by their declared summary alone."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return super().list_commands(ctx) + [m for m in registry.METHODS if m not in self.commands]

    def get_command(self, ctx: click.Context, name: str):
        if name in registry.METHODS and name not in self.commands:  # a help listing: name and summary
            return click.Command(name, help=registry.get(name).summary)
        return super().get_command(ctx, name)

    def resolve_command(self, ctx: click.Context, args: list[str]):
        if args and args[0] in registry.METHODS and args[0] not in self.commands:
            command = typer.main.get_command(method_app(registry.get(args[0])))
            command.name = args[0]
            return args[0], command, args[1:]
        return super().resolve_command(ctx, args)


app = typer.Typer(name="icml", cls=RootGroup, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Run, compare and report the methods of ICML 2026 papers.\n\n"
                       "Each method has train → eval → report; results go to runs/<method>/<run-id>/.")


def _version(value: bool) -> None:
    if value:
        from icml.cli import __version__

        print(f"icml {__version__}")
        raise typer.Exit()


@app.callback()
def root(version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="Show the version and exit.")] = False):
    pass


@app.command("list")
@guarded
def list_methods(json_: Json = False, quiet: Quiet = False, debug: Debug = False):
    """The methods: subcommand, result at our scale, status, arXiv id and paper."""
    methods = registry.all_methods()
    if json_:
        console.emit_json({"methods": [{"name": m.name, "title": m.title, "arxiv": m.arxiv, "result": m.result,
                                        "status": m.status, "summary": m.summary} for m in methods]})
        return
    console.listing("icml methods", ["method", "result", "status", "arXiv", "paper"],
                    [[m.name, m.result or "–", m.status, m.arxiv, m.title] for m in methods])


@app.command("runs")
@guarded
def list_runs(method: MethodName = None, runs_dir: RunsDir = None, json_: Json = False,
              quiet: Quiet = False, debug: Debug = False):
    """The runs in the runs directory, oldest first."""
    if method is not None:
        registry.get(method)  # unknown method -> one clear line
    rows = []
    for run in store(runs_dir).runs(method):
        try:
            info = run.info()
        except UsageError as exc:
            rows.append({"run_dir": str(run.path), "status": "corrupt", "error": exc.problem})
            continue
        rows.append({"run_dir": str(run.path), "run_id": info["run_id"], "method": info["method"],
                     "preset": info.get("preset"), "seed": info.get("seed"), "group": info.get("group"),
                     "status": info.get("status"),
                     "phases": {p: v.get("status") for p, v in info.get("phases", {}).items()},
                     "started": info.get("started"), "updated": info.get("updated")})
    if json_:
        console.emit_json({"runs": rows})
        return
    if not rows:
        console.say(f"no runs yet in '{store(runs_dir).root}'")
        return
    table = []
    for row in rows:
        phases = row.get("phases", {})
        table.append([row.get("run_id", Path(row["run_dir"]).name), row.get("method", "?"), str(row.get("preset", "?")),
                      str(row.get("seed", "?")), phases.get("train", row["status"]), phases.get("eval", "–"),
                      str(row.get("started", "")), row["run_dir"]])
    console.listing("runs", ["run", "method", "preset", "seed", "train", "eval", "started", "run dir"], table)


@app.command("report")
@guarded
def report_all(run_dirs: RunDirs = None, method: MethodName = None, all_: All = False,
               format: Format = "terminal", out: Out = None, runs_dir: RunsDir = None,
               group: Group = None, preset: PresetFilter = None, seeds: Seeds = None,
               json_: Json = False, quiet: Quiet = False, debug: Debug = False):
    """Report runs: given directories, the latest of --method, or --all runs with results; --group G, or
    --method M with --preset P / --seeds: every table over seeds (mean ± 95 % t-interval) and the claims."""
    check_format(format)
    runs_store = store(runs_dir)
    if group is not None or preset is not None or seeds is not None:
        from icml.reports.groups import report_group, select_runs

        if run_dirs or all_ or (method is None and group is None):
            raise UsageError("a report over seeds takes --group G, or --method M with --preset/--seeds",
                             "e.g. icml report --method kv-compress --preset default")
        if method is None:
            method = runs_store.group(group)[0].info()["method"]
        registry.get(method)
        runs = select_runs(runs_store, method, group=group, preset=preset,
                           seeds=parse_seeds(seeds) if seeds is not None else None)
        report_group(runs, format, out, json_)
        return
    if run_dirs:
        runs = [runs_store.open(p) for p in run_dirs]
    elif method:
        registry.get(method)
        runs = [r for r in runs_store.runs(method) if r.metrics_path.exists()][-1:]
    elif all_:
        runs = [r for r in runs_store.runs() if r.metrics_path.exists()]
    else:
        raise UsageError("report needs run directories, --method M or --all", "e.g. icml report --all")
    if not runs:
        raise UsageError(f"no runs with results in '{runs_store.root}'", "train and evaluate a method first")
    report_runs(runs, format, out, json_)


# Typer ships its own copy of click; its UsageError is reached through a public subclass.
ClickUsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


def _failed(problem: str, fix: str | None, exit_code: int, argv: list[str] | None) -> int:
    """An error click found before our command ran: the same line, and the JSON object under --json."""
    from icml.cli.commands import fail

    try:
        fail(problem, fix, exit_code, "--json" in (sys.argv[1:] if argv is None else argv))
    except SystemExit:
        return exit_code


def main(argv: list[str] | None = None) -> int:
    """Entry point: click's usage errors become one line and exit code 2."""
    command = typer.main.get_command(app)
    try:
        result = command.main(args=argv, prog_name="icml", standalone_mode=False)
    except ClickUsageError as exc:
        ctx = getattr(exc, "ctx", None)
        if type(exc).__name__ == "NoArgsIsHelpError" and ctx is not None:
            print(ctx.get_help(), file=sys.stderr)
            return 2
        message = exc.format_message()
        path = ctx.command_path if ctx is not None else "icml"
        fix = "run 'icml list' to see the methods" if "No such command" in message else f"see '{path} --help'"
        return _failed(message, fix, 2, argv)
    except typer.Abort:
        return _failed("aborted", None, 130, argv)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
