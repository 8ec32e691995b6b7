"""One Typer sub-app per method, built from its declaration: train, eval, report
(+ the method's own verbs). The options are the shared ones of cli.options."""
from __future__ import annotations

import typer

from icml.cli import console
from icml.cli.commands import check_format, guarded, report_runs, store
from icml.cli.errors import UsageError
from icml.cli.method import Method
from icml.cli.options import (ConfigFile, DataFile, Debug, Device, Format, GpuMem, Gpus, Group, Json, ModelDir, Out, Preset,
                              PresetOfRuns, Quiet, Resume, RunDir, RunDirs, RunsDir, Seed, Seeds, SeedsOfGroup,
                              SeedWorkers, Set, parse_seeds)
from icml.cli.options import Executor, RayAddress  # where a run's independent jobs go: cli/workers.py


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


def _group_summary(method: Method, runs: list, phase: str, as_json: bool) -> None:
    """The summary of a multi-seed train/eval: each run's, then how to report the group."""
    from icml.reports.render import build_section

    group = runs[0].info().get("group")
    if as_json:
        rows = []
        for run in runs:
            section = build_section(run, with_plots=False)
            rows.append({"run_dir": str(run.path), "run_id": section.info["run_id"], "seed": section.info.get("seed"),
                         "status": section.info["phases"][phase]["status"], "metrics": section.headline})
        console.emit_json({"group": group, "method": method.name, "phase": phase,
                           "preset": runs[0].info().get("preset"), "runs": rows})
        return
    for run in runs:
        _summary(method, run, phase, False)
    if group:
        console.say(f"group {group}: icml {method.name} report --group {group}", style="bold green")


def readme_path(method: Method) -> str:
    """Where the method's README (its user page) is installed, found without importing the package."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec(method.package)
    folders = list(spec.submodule_search_locations or []) if spec else []
    return str(Path(folders[0]) / "README.md") if folders else f"methods/{method.package.rsplit('.', 1)[-1]}/README.md"


def inputs_of(method: Method) -> dict[str, str]:
    """--data / --model → what the method's config says they accept (the `data` / `model` key's comment),
    for the methods that take them."""
    from icml.cli import config as config_io

    keys = {key: meaning for key, _, meaning in config_io.describe(method.preset("default"))}
    out = {}
    for name in ("data", "model"):
        key = name if name in keys else f"{name}.path" if f"{name}.path" in keys else None
        if key is not None:
            out[name] = keys[key] or f"sets the config key '{key}'"
    return out


def train_epilog(method: Method) -> str:
    """The method's own part of `train --help`: presets, inputs, every config key with its default and
    meaning (from the config dataclasses), and where its README is."""
    from rich.markup import escape

    from icml.cli import config as config_io

    presets = ", ".join(f"{p} ({method.preset_times[p]})" if p in method.preset_times else p for p in method.preset_names())
    lines = [f"Presets (times measured on 2 CPU cores): {presets}; without --preset: default.", ""]
    inputs = inputs_of(method)
    for name, meaning in inputs.items():
        lines.append(f"--{name}: {meaning}")
    if not inputs:
        lines.append(f"{method.name} takes no --data or --model (a file it can read is a config key below).")
    lines += ["", "Config keys (--set key=value), with the default preset's values:"]
    for key, value, meaning in config_io.describe(method.preset("default")):
        lines.append(f"  {key} = {value}" + (f"  — {meaning}" if meaning else ""))
    lines += ["", f"All presets' values: icml {method.name} config --preset P. README: {readme_path(method)}"]
    return escape("\n".join(lines))


def _without(fn, names: set[str]):
    """`fn` with the parameters `names` left out of its signature: Typer then neither shows nor accepts them."""
    import inspect

    signature = inspect.signature(fn, eval_str=True)  # Typer reads a set __signature__'s annotations as they are
    fn.__signature__ = signature.replace(parameters=[p for p in signature.parameters.values() if p.name not in names])
    return fn


def method_app(method: Method) -> typer.Typer:
    app = typer.Typer(name=method.name, no_args_is_help=True, add_completion=False,
                      help=f"{method.summary}\n\nPaper: {method.title} (arXiv {method.arxiv}).")
    absent_inputs = {"data", "model"} - set(inputs_of(method))

    @app.command("config")
    @guarded
    def show_config(preset: Preset = None, set_: Set = None, config: ConfigFile = None, json_: Json = False,
                    quiet: Quiet = False, debug: Debug = False):
        """Print the resolved config (preset → --config → --set) as JSON: what `train` would run."""
        from icml.cli import config as config_io
        from icml.cli import lifecycle

        cfg, preset, _ = lifecycle.resolve_config(method, preset, None, config, list(set_ or []))
        console.emit_json({"method": method.name, "preset": preset, "config": config_io.to_dict(cfg)})

    @app.command("plan")
    @guarded
    def plan(preset: Preset = None, set_: Set = None, config: ConfigFile = None, gpus: Gpus = None,
             gpu_mem: GpuMem = None, json_: Json = False, quiet: Quiet = False, debug: Debug = False):
        """Size one step of each phase before running it: peak memory per process and its parts, FLOPs per step,
        the largest tensor, and whether it fits the GPUs (measured on torch's meta device: no weights, no GPU)."""
        from icml.cli import lifecycle
        from icml.cli import plan as planning

        cfg, preset, _ = lifecycle.resolve_config(method, preset, None, config, list(set_ or []), validate=False)
        hardware = None
        if gpus is not None or gpu_mem is not None:
            default = planning.default_hardware(method, preset)
            hardware = planning.Hardware(gpus if gpus is not None else default.gpus,
                                         planning.parse_mem(gpu_mem) if gpu_mem is not None else default.gpu_mem)
        result = planning.plan(method, cfg, hardware, preset)
        if json_:
            console.emit_json(result)
        else:
            print(planning.render(result))

    def train(preset: Preset = None, seed: Seed = None, device: Device = "auto", runs_dir: RunsDir = None,
              set_: Set = None, config: ConfigFile = None, data: DataFile = None, model: ModelDir = None,
              resume: Resume = None, seeds: Seeds = None, seed_workers: SeedWorkers = 1, json_: Json = False,
              quiet: Quiet = False, debug: Debug = False, executor: Executor = None,
              ray_address: RayAddress = None):
        """Train: create a run directory and fill its checkpoints and train metrics (--seeds: one run per seed)."""
        from icml.cli import lifecycle

        inputs = {key: path for key, path in (("data", data), ("model", model)) if path is not None}
        if seeds is not None:
            if seed is not None or resume is not None:
                raise UsageError("--seeds starts one new run per seed", "drop --seed/--resume, or drop --seeds")
            runs = lifecycle.train_seeds(method, store(runs_dir), seeds=parse_seeds(seeds), preset=preset,
                                         device=device, config_file=config, overrides=list(set_ or []),
                                         inputs=inputs, workers=seed_workers)
            _group_summary(method, runs, "train", json_)
            return
        from icml.cli.distributed import rank_store  # under torchrun: rank 0 alone writes the run

        run = lifecycle.train(method, rank_store(store(runs_dir), device), preset=preset, seed=seed, device=device,
                              config_file=config, overrides=list(set_ or []), resume=resume, inputs=inputs)
        _summary(method, run, "train", json_)

    app.command("train", epilog=train_epilog(method))(_without(guarded(train), absent_inputs))

    @app.command("eval")
    @guarded
    def evaluate(run_dir: RunDir = None, device: Device = "auto", runs_dir: RunsDir = None,
                 seeds: SeedsOfGroup = None, group: Group = None, seed_workers: SeedWorkers = 1,
                 json_: Json = False, quiet: Quiet = False, debug: Debug = False, executor: Executor = None,
                 ray_address: RayAddress = None):
        """Evaluate a trained run (default: the latest one) and write its eval metrics (--seeds/--group:
        every run of the group)."""
        from icml.cli import lifecycle

        if seeds is not None or group is not None:
            from icml.reports.groups import select_runs

            if run_dir is not None:
                raise UsageError("a run directory and --seeds/--group both name the runs", "pass one of them")
            runs_store = store(runs_dir)
            runs = select_runs(runs_store, method.name, group=group,
                               seeds=parse_seeds(seeds) if seeds is not None else None, phase="train")
            runs = lifecycle.evaluate_runs(method, runs_store, runs, device=device, workers=seed_workers)
            _group_summary(method, runs, "eval", json_)
            return

        run = lifecycle.evaluate(method, store(runs_dir), run_dir=run_dir, device=device)
        _summary(method, run, "eval", json_)

    @app.command("report")
    @guarded
    def report(run_dirs: RunDirs = None, format: Format = "terminal", out: Out = None,
               runs_dir: RunsDir = None, seeds: SeedsOfGroup = None, group: Group = None, preset: PresetOfRuns = None,
               json_: Json = False, quiet: Quiet = False, debug: Debug = False):
        """Render tables and plots of runs (default: the latest evaluated run); --group/--seeds/--preset:
        every table over seeds (mean ± 95 % t-interval) and the method's claims."""
        check_format(format)
        runs_store = store(runs_dir)
        if seeds is not None or group is not None or preset is not None:
            from icml.reports.groups import report_group, select_runs

            if run_dirs:
                raise UsageError("run directories and --seeds/--group/--preset both name the runs", "pass one of them")
            runs = select_runs(runs_store, method.name, group=group, preset=preset,
                               seeds=parse_seeds(seeds) if seeds is not None else None)
            report_group(runs, format, out, json_)
            return
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
