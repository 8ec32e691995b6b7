"""`icml explain-vit explain [RUN | --model PATH] --image a.png [--image b.png] [--target CLASS] [--method dave]
[--n 50] --out DIR`: attribution maps of user images as .npy, heatmap PNG and overlay PNG."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from icml.cli import console
from icml.cli.commands import guarded, store
from icml.cli.options import Debug, Device, Json, ModelDir, Quiet, RunDir, RunsDir

Images = Annotated[list[Path], typer.Option("--image", help="An image file (repeatable).")]
Target = Annotated[Optional[str], typer.Option("--target", help="Class index or name (default: the prediction).",
                                               show_default=False)]
MethodArm = Annotated[str, typer.Option("--method", help="Arm: dave, weff, input_x_grad, gae, … (see the README).")]
N = Annotated[Optional[int], typer.Option("--n", help="DAVE samples N (default: the run's dave.n_samples).",
                                          show_default=False)]
OutDir = Annotated[Path, typer.Option("--out", "-o", help="Folder for the .npy maps and PNGs.")]


def register(app: typer.Typer) -> None:
    @app.command("explain")
    @guarded
    def explain_command(run_dir: RunDir = None, image: Images = None, model: ModelDir = None, target: Target = None,
                        method: MethodArm = "dave", n: N = None, out: OutDir = Path("explanations"),
                        device: Device = "auto", runs_dir: RunsDir = None, json_: Json = False, quiet: Quiet = False,
                        debug: Debug = False):
        """Explain user images with one arm; the model is left unpatched afterwards."""
        from icml.cli.errors import UsageError
        from icml.cli.lifecycle import config_from_run, resolve_device
        from icml.methods.explain_vit import METHOD
        from icml.methods.explain_vit.config import ARMS, check_model, preset

        if not image:
            raise UsageError("no --image given", "pass one or more --image FILE")
        for path in image:
            if not path.is_file():
                raise UsageError(f"--image '{path}' does not exist", "check the path")
        if method not in ARMS:
            raise UsageError(f"unknown --method '{method}'", f"use one of {', '.join(ARMS)}")
        if n is not None and n < 2:
            raise UsageError(f"--n must be >= 2, not {n}", "pass the number of DAVE samples, e.g. 50")
        if model is not None:
            if not (model / "config.json").is_file():
                raise UsageError(f"--model '{model}' is not a transformers checkpoint (no config.json)",
                                 "pass a folder saved with save_pretrained")
            check_model(str(model))  # headers only, before --out is created
            run, cfg, model_dir = None, preset("default"), model
        else:
            run = store(runs_dir).open(run_dir, METHOD.name) if run_dir else store(runs_dir).latest(METHOD.name, "train")
            if run.phase_status("train") != "completed":
                raise UsageError(f"train of {run.path} is {run.phase_status('train') or 'missing'}",
                                 f"finish it first: icml explain-vit train --resume {run.path}")
            cfg, _, _ = config_from_run(METHOD, run)
            model_dir = Path(cfg.model) if cfg.model else run.checkpoints / "model"
        from icml.methods.explain_vit.pipeline import explain_files

        result = explain_files(model_dir, cfg, run, image, target, method, n, out, resolve_device(device))
        if json_:
            console.emit_json(result)
        else:
            for item in result["images"]:
                console.say(f"{item['image']}: {method} map for class {item['target']} ({item['class']}) → "
                            f"{item['overlay']}", style="bold green")
