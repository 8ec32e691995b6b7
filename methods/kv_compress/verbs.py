"""`icml kv-compress calibrate [RUN] [--model PATH] [--data FILE] [--n 64]`: H̄ for EntroKV.
`icml kv-compress count-probe [RUN] [--ratio 0.3] [--n N]`: where a trained model gathers the counted
value's occurrences, and whether SnapKV keeps them (probe.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from icml.cli import console
from icml.cli.commands import guarded, store
from icml.cli.options import DataFile, Debug, Device, Json, ModelDir, Quiet, RunDir, RunsDir

N = Annotated[Optional[int], typer.Option("--n", help="Calibration prompts (default: the run's n_calibration, 64).",
                                          show_default=False)]
ProbeN = Annotated[Optional[int], typer.Option(
    "--n", help="At most this many aggregation test prompts (default: all the run's eval scores).",
    show_default=False)]
Ratio = Annotated[float, typer.Option("--ratio", help="SnapKV's budget fraction r, in (0, 1].")]


def register(app: typer.Typer) -> None:
    @app.command("calibrate")
    @guarded
    def calibrate_command(run_dir: RunDir = None, model: ModelDir = None, data: DataFile = None, n: N = None,
                          device: Device = "auto", runs_dir: RunsDir = None, json_: Json = False,
                          quiet: Quiet = False, debug: Debug = False):
        """Store H̄, the mean normalised attention entropy over calibration prompts, layers and KV
        heads, in the run's calibration.json (keyed by model); EntroKV eval reads it."""
        from icml.cli.errors import UsageError
        from icml.cli.lifecycle import config_from_run, resolve_device
        from icml.methods.kv_compress import METHOD
        from icml.methods.kv_compress.pipeline import calibrate, model_key

        runs = store(runs_dir)
        run = runs.open(run_dir, METHOD.name) if run_dir else runs.latest(METHOD.name, "train")
        for name, path in (("model", model), ("data", data)):
            if path is not None and not Path(path).exists():
                raise UsageError(f"--{name} '{path}' does not exist", "check the path")
        if n is not None and n <= 0:
            raise UsageError(f"--n must be positive, not {n}", "pass the number of calibration prompts")
        cfg, _, seed = config_from_run(METHOD, run)
        entry = calibrate(run.path, cfg, seed, resolve_device(device),
                          model_path=str(model) if model else None, data=str(data) if data else None, n=n)
        key = model_key(cfg, str(model) if model else None)
        if json_:
            console.emit_json({"run_dir": str(run.path), "model": key, **entry})
        else:
            console.say(f"H̄ = {entry['h_bar']:.4f} over {entry['n']} prompts → {run.path / 'calibration.json'} "
                        f"[{key}]", style="bold green")

    @app.command("count-probe")
    @guarded
    def count_probe_command(run_dir: RunDir = None, ratio: Ratio = 0.3, n: ProbeN = None, device: Device = "auto",
                            runs_dir: RunsDir = None, json_: Json = False, quiet: Quiet = False, debug: Debug = False):
        """On a trained run's aggregation test prompts: the share of the `?`, `v` and `=` rows' history
        attention on the asked value's occurrences, the occurrences SnapKV keeps at --ratio against the
        blind floor, and SnapKV scored by the two question rows alone; rows in count_probe.parquet."""
        from icml.cli.errors import UsageError
        from icml.cli.lifecycle import config_from_run, resolve_device
        from icml.cli.results import write_frame
        from icml.methods.kv_compress import METHOD
        from icml.methods.kv_compress.probe import TABLE, count_probe, summarise

        if not 0 < ratio <= 1:
            raise UsageError(f"--ratio must be a budget fraction in (0, 1], not {ratio}", "pass e.g. --ratio 0.3")
        if n is not None and n <= 0:
            raise UsageError(f"--n must be positive, not {n}", "pass the number of aggregation prompts to probe")
        runs = store(runs_dir)
        run = runs.open(run_dir, METHOD.name) if run_dir else runs.latest(METHOD.name, "train")
        cfg, _, seed = config_from_run(METHOD, run)
        if cfg.data:
            raise UsageError(f"run '{run.path}' evaluates --data '{cfg.data}'; count-probe needs the generated "
                             "aggregation prompts", "probe a run trained without --data")
        if cfg.window < 2:
            raise UsageError(f"run '{run.path}' has window {cfg.window}; the probe needs the question's `v` and "
                             "`?` rows in the observation window", "probe a run with window >= 2")
        checkpoint = run.checkpoints / "model"
        if not cfg.model and not (checkpoint / "config.json").exists():
            raise UsageError(f"run '{run.path}' has no trained model checkpoint ({checkpoint})",
                             f"finish its training (icml kv-compress train --resume {run.path}) or probe another run")
        frame = count_probe(run.path, run.run_id, cfg, seed, ratio, n, resolve_device(device))
        path = run.table_path(TABLE)
        write_frame(path, frame)
        summary = summarise(frame)
        show_probe_summary(summary, ratio, path)
        if json_:
            console.emit_json({"run_dir": str(run.path), "table": str(path), "ratio": ratio, **summary})


def show_probe_summary(summary: dict, ratio: float, path: Path) -> None:
    """Two short tables on stderr: the attention shares per row and layer, and the selections."""
    from rich.table import Table

    def cell(value: float) -> str:
        return "—" if value != value else f"{value:.3f}"  # NaN: nothing to average

    attention = summary["occurrence_attention"]
    layers = len(attention["?"]["per_layer"])
    shares = Table(title=f"share of history attention on the asked value's occurrences "
                         f"({summary['prompts_with_occurrence']} of {summary['prompts']} prompts have one; "
                         f"{summary['mean_occurrences']:.2f} on average)")
    for column in ("row", *(f"layer {layer}" for layer in range(layers)), "mean"):
        shares.add_column(column, justify="left" if column == "row" else "right")
    for row, values in attention.items():
        shares.add_row(row, *map(cell, values["per_layer"]), cell(values["mean_over_layers"]))
    kept = Table(title=f"at r = {ratio:g}: {summary['history_budget']:.1f} of {summary['history_length']:.1f} "
                       f"history positions kept per KV head",
                 caption="kept: share of the occurrences a KV head keeps; all: rate of KV heads keeping every "
                         "one; every head: rate of prompts where all heads do")
    kept.add_column("selection", no_wrap=True)
    for column in ("kept", "all", "every head", "EM"):
        kept.add_column(column, justify="right", no_wrap=True)
    kept.add_row("full", "1.000", "1.000", "1.000", cell(summary["exact_match"]["full"]))
    for variant in ("snapkv", "snapkv_question_rows"):
        chosen = summary[variant]
        kept.add_row(variant, cell(chosen["kept_share"]), cell(chosen["all_kept"]), cell(chosen["all_kept_every_head"]),
                     cell(summary["exact_match"][variant]))
    kept.add_row("blind floor", "", cell(summary["blind_floor"]), "", "")
    console.show(shares)
    console.show(kept)
    console.say(f"per-prompt rows → {path}", style="bold green")
