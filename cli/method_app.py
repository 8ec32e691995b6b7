"""One Typer sub-app per method, built from its declaration: train, eval, report
(+ the method's own verbs). The options are the shared ones of cli.options."""
from __future__ import annotations

import typer

from icml.cli import console
from icml.cli.commands import check_format, guarded, report_runs, store
from icml.cli.errors import UsageError
from icml.cli.method import Method
from icml.cli.options import (ConfigFile, DataFile, Debug, Device, Format, Json, ModelDir, Out, Preset, Quiet,
                              Resume, RunDir, RunDirs, RunsDir, Seed, Set)


def _summary(method: Method, run, phase: str, as_json: bool) -> None:
    from icml.reports.render import build_section

    section = build_section(run, with_plots=False)
    info = section.info
    if as_json:
        console.emit_json({"run_dir": str(run.path), "run_id": info["run_id"], "method": method.name,
                           "phase": phase, "preset": info.get("preset"), "seed": info.get("seed"),
                           "status": info["phases"][phase]["status"], "metrics": section.headline})
        return
    console.say(f"{phase} {info['phases'][phase]['status']}: {run.path}", style="bold green")
    for metric, by_variant in section.headline.items():
        values = ", ".join(f"{v} {x:.4g}" for v, x in by_variant.items())
        console.say(f"  {metric}: {values}")


def method_app(method: Method) -> typer.Typer:
    app = typer.Typer(name=method.name, no_args_is_help=True, add_completion=False,
                      help=f"{method.summary}\n\nPaper: {method.title} (arXiv {method.arxiv}).")

    @app.command("train")
    @guarded
    def train(preset: Preset = None, seed: Seed = None, device: Device = "auto", runs_dir: RunsDir = None,
              set_: Set = None, config: ConfigFile = None, data: DataFile = None, model: ModelDir = None,
              resume: Resume = None, json_: Json = False, quiet: Quiet = False, debug: Debug = False):
        """Train: create a run directory and fill its checkpoints and train metrics."""
        from icml.cli import lifecycle

        inputs = {key: path for key, path in (("data", data), ("model", model)) if path is not None}
        run = lifecycle.train(method, store(runs_dir), preset=preset, seed=seed, device=device,
                              config_file=config, overrides=list(set_ or []), resume=resume, inputs=inputs)
        _summary(method, run, "train", json_)

    @app.command("eval")
    @guarded
    def evaluate(run_dir: RunDir = None, device: Device = "auto", runs_dir: RunsDir = None,
                 json_: Json = False, quiet: Quiet = False, debug: Debug = False):
        """Evaluate a trained run (default: the latest one) and write its eval metrics."""
        from icml.cli import lifecycle

        run = lifecycle.evaluate(method, store(runs_dir), run_dir=run_dir, device=device)
        _summary(method, run, "eval", json_)

    @app.command("report")
    @guarded
    def report(run_dirs: RunDirs = None, format: Format = "terminal", out: Out = None,
               runs_dir: RunsDir = None, json_: Json = False, quiet: Quiet = False, debug: Debug = False):
        """Render tables and plots of runs (default: the latest evaluated run)."""
        check_format(format)
        runs_store = store(runs_dir)
        if run_dirs:
            runs = [runs_store.open(p, method.name) for p in run_dirs]
        else:
            try:
                runs = [runs_store.latest(method.name, "eval")]
            except UsageError:
                runs = [runs_store.latest(method.name, "train")]
        report_runs(runs, format, out, json_)

    if method.extra_verbs:
        method.part("verbs").register(app)
    return app
