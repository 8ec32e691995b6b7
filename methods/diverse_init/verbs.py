"""`icml diverse-init generate [RUN] --class C --n 16 --variant divin --tau 0.5 --cfg 4 [--traj cads]
[--model PATH] --out grid.png`: samples of one class from a trained run's digits model (or any local
class-conditional UNet2DModel/pipeline directory), an image grid plus a .npy of the samples."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from icml.cli import console
from icml.cli.commands import guarded, store
from icml.cli.options import Debug, Json, Quiet, RunDir, RunsDir

ClassId = Annotated[int, typer.Option("--class", help="Class index to condition on.")]
Count = Annotated[int, typer.Option("--n", help="Number of samples.")]
Variant = Annotated[str, typer.Option("--variant", help="base | divin | divin_no_noise | divin_no_prior | sail.")]
Tau = Annotated[Optional[float], typer.Option("--tau", help="DivIn τ (default: auto, τ* of the model).",
                                              show_default=False)]
Cfg = Annotated[float, typer.Option("--cfg", help="Classifier-free guidance scale w.")]
Traj = Annotated[Optional[str], typer.Option("--traj", help="Trajectory options, comma-separated: cads, ig, pg.",
                                             show_default=False)]
Model = Annotated[Optional[Path], typer.Option("--model", help="A local UNet2DModel or pipeline directory "
                                               "(default: the run's digits model).", show_default=False)]
Param = Annotated[str, typer.Option("--param", help="The run's digits model to use: eps | flow.")]
Steps = Annotated[int, typer.Option("--steps", help="Sampler steps.")]
Seed = Annotated[int, typer.Option("--seed", help="Sampling seed.")]
Out = Annotated[Path, typer.Option("--out", "-o", help="PNG grid to write (the .npy goes beside it).")]


def register(app: typer.Typer) -> None:
    @app.command("generate")
    @guarded
    def generate_command(run_dir: RunDir = None, class_id: ClassId = 0, n: Count = 16, variant: Variant = "divin",
                         tau: Tau = None, cfg_scale: Cfg = 4.0, traj: Traj = None, model: Model = None,
                         param: Param = "eps", steps: Steps = 25, seed: Seed = 0, out: Out = Path("grid.png"),
                         runs_dir: RunsDir = None, json_: Json = False, quiet: Quiet = False, debug: Debug = False):
        """Sample one class with DivIn (or an ablation / baseline), optionally with CADS, IG or PG."""
        from icml.cli.errors import UsageError
        from icml.cli.lifecycle import config_from_run
        from icml.methods.diverse_init import METHOD
        from icml.methods.diverse_init.config import INIT_ARMS, TRAJECTORIES, preset

        if variant not in INIT_ARMS:
            raise UsageError(f"unknown --variant '{variant}'", f"use one of {', '.join(INIT_ARMS)} (trajectory "
                             "methods go in --traj)")
        options = [t for t in (traj or "").split(",") if t]
        if any(t not in TRAJECTORIES for t in options):
            raise UsageError(f"unknown --traj '{traj}'", "use a comma-separated subset of cads, ig, pg")
        if n < 1 or steps < 1 or cfg_scale < 0:
            raise UsageError("--n and --steps must be positive and --cfg non-negative", "fix the value")
        if tau is not None and tau < 0:
            raise UsageError(f"--tau must be ≥ 0, not {tau}", "omit it for the auto τ*")
        if param not in ("eps", "flow"):
            raise UsageError(f"--param must be eps or flow, not '{param}'", "pick the run's model to sample")
        if model is not None:
            if not model.exists():
                raise UsageError(f"--model '{model}' does not exist", "check the path")
            cfg, run_path = preset("default"), None
            cfg.model = str(model)
        else:
            runs = store(runs_dir)
            run = runs.open(run_dir, METHOD.name) if run_dir else runs.latest(METHOD.name, "train")
            if run.phase_status("train") != "completed":
                raise UsageError(f"train of {run.path} is {run.phase_status('train') or 'missing'}",
                                 f"finish it first: icml diverse-init train --resume {run.path}")
            cfg, _, _ = config_from_run(METHOD, run)
            run_path = run.path
        from icml.methods.diverse_init.pipeline import generate

        result = generate(run_path, cfg, class_id=class_id, n=n, variant=variant, tau=tau, cfg_scale=cfg_scale,
                          traj=options, param=param, steps=steps, seed=seed, out=out)
        if json_:
            console.emit_json(result)
        else:
            console.say(f"{n} samples of class {class_id} ({variant}{'+' + '+'.join(options) if options else ''}, "
                        f"w={cfg_scale}, τ={result['tau']:.4g}) → {result['png']} and {result['npy']}",
                        style="bold green")
