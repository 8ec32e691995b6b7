"""`icml kv-compress calibrate [RUN] [--model PATH] [--data FILE] [--n 64]`: H̄ for EntroKV."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from icml.cli import console
from icml.cli.commands import guarded, store
from icml.cli.options import DataFile, Debug, Device, Json, ModelDir, Quiet, RunDir, RunsDir

N = Annotated[Optional[int], typer.Option("--n", help="Calibration prompts (default: the run's n_calibration, 64).",
                                          show_default=False)]


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
