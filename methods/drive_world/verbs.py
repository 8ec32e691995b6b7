"""`icml drive-world generate [RUN] --what tiles|rollout --variant V [--n N] --out FILE.npz [--png FILE.png]
[--start-mode warm|cold] [--json]`: sample tiles from a trained generator, or drive one streaming rollout with a
trained policy, and write the arrays (and optionally a picture)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from icml.cli import console
from icml.cli.commands import guarded, store
from icml.cli.options import Debug, Json, Quiet, RunDir, RunsDir, Seed

What = Annotated[str, typer.Option("--what", help="tiles | rollout.")]
Variant = Annotated[Optional[str], typer.Option(
    "--variant", help="tiles: a generator (meanflow_1, meanflow_3, flow_heun24, flow_euler1, meanflow_1_nogate); "
                      "rollout: a policy (idm, deltasim_discrete, deltasim_no_dkal, deltasim, deltasim_proj).")]
Count = Annotated[int, typer.Option("--n", help="tiles: how many (counts and labels drawn from the training tiles).")]
Out = Annotated[Path, typer.Option("--out", help="The .npz file to write.")]
Png = Annotated[Optional[Path], typer.Option("--png", help="Also draw the tiles / the rollout to this PNG.")]
StartMode = Annotated[str, typer.Option("--start-mode", help="rollout: warm (pseudo-history) | cold.")]


def register(app: typer.Typer) -> None:
    @app.command("generate")
    @guarded
    def generate_command(run_dir: RunDir = None, what: What = "tiles", variant: Variant = None, n: Count = 4,
                         out: Out = Path("drive_world.npz"), png: Png = None, start_mode: StartMode = "warm",
                         seed: Seed = None, runs_dir: RunsDir = None, json_: Json = False, quiet: Quiet = False,
                         debug: Debug = False):
        """Tiles from a generator variant, or one rollout of a policy, to .npz (and PNG)."""
        from icml.cli.errors import UsageError
        from icml.cli.lifecycle import config_from_run
        from icml.methods.drive_world import METHOD
        from icml.methods.drive_world.config import POLICIES
        from icml.methods.drive_world.pipeline import GENERATORS

        if what not in ("tiles", "rollout"):
            raise UsageError(f"--what must be tiles or rollout, not '{what}'", "pass --what tiles|rollout")
        valid = list(GENERATORS) if what == "tiles" else list(POLICIES)
        variant = variant or valid[-1 if what == "rollout" else 0]
        if variant not in valid:
            raise UsageError(f"--variant '{variant}' is not a {what[:-1] if what == 'tiles' else what} variant",
                             f"use one of: {', '.join(valid)}")
        if start_mode not in ("warm", "cold"):
            raise UsageError(f"--start-mode must be warm or cold, not '{start_mode}'", "pass --start-mode warm|cold")
        if n < 1:
            raise UsageError(f"--n must be ≥ 1 (got {n})", "pass --n 4")
        if out.suffix != ".npz" or (png is not None and png.suffix != ".png"):
            raise UsageError("--out must end in .npz and --png in .png", "e.g. --out tiles.npz --png tiles.png")
        runs = store(runs_dir)
        run = runs.open(run_dir, METHOD.name) if run_dir else runs.latest(METHOD.name, "train")
        cfg, _, run_seed = config_from_run(METHOD, run)
        missing = [p.name for p in (run.checkpoints / "vae.pt", run.checkpoints / "tiles.npz",
                                    run.checkpoints / "sim_deltasim.pt") if not p.exists()]
        if missing:
            raise UsageError(f"run {run.path} has no {', '.join(missing)} (not trained to the end)",
                             "train it first: icml drive-world train")
        info = _generate(run, cfg, run_seed if seed is None else seed, what, variant, n, out, png, start_mode)
        if json_:
            console.emit_json({"run_dir": str(run.path), "what": what, "variant": variant, "out": str(out),
                               "png": str(png) if png else None, **info})
        else:
            print(f"wrote {out}" + (f" and {png}" if png else "") + f": {info}", flush=True)


def _generate(run, cfg, seed, what, variant, n, out, png, start_mode) -> dict:
    from types import SimpleNamespace

    import numpy as np
    import torch

    from icml.cli.threads import single_thread
    from icml.methods.drive_world import pipeline, rollout
    from icml.methods.drive_world.report import strip_figure, tile_figure

    ctx = SimpleNamespace(config=cfg, checkpoints=run.checkpoints, seed=seed)
    with single_thread():
        train, held = pipeline._data(ctx)
        models = pipeline.Models(ctx)
        if what == "tiles":
            cond = pipeline.generation_cond(train, n, seed)
            tiles = models.generate(variant, cond, torch.Generator().manual_seed(seed))
            arrays = {k: np.stack([t[k] for t in tiles]) for k in tiles[0]}
            np.savez_compressed(out, **arrays)
            if png is not None:
                tile_figure(arrays, f"{variant} tiles").savefig(png, dpi=120)
            return dict(tiles=n, agents=int(arrays["agent_mask"].sum()), lanes=int(arrays["lane_mask"].sum()))
        outpaint = pipeline.outpainter(models, held, cfg.data, seed=1000 * seed)
        res = rollout.run_rollout(10_000 * seed, variant, models.policies.get(variant), models.vocab, start_mode,
                                  cfg, outpaint)
        pipeline.save_trace(out, res)
        if png is not None:
            title = f"{variant} ({start_mode}): {res['km']:.2f} km, {res['end_reason']}"
            strip_figure(np.load(out), title, cfg.data.tile_m).savefig(png, dpi=120)
        return dict(km=res["km"], end_reason=res["end_reason"], n_tiles=res["n_tiles"], npcs=res["spawned"],
                    kin_violation_rate=res["kin_violation_rate"], stitch_gap_m=res["stitch_gap_m"],
                    stitch_fallback_rate=res["stitch_fallback_rate"])
