"""`icml attribute-motion select [RUN] --target orbit [--frac 0.1] [--variant motive] [--queries auto|DIR]`:
score the pool of a trained run with one selector; writes scores.parquet rows and selections/<…>.json."""
from __future__ import annotations

from typing import Annotated, Optional

import typer

from icml.cli import console
from icml.cli.commands import guarded, store
from icml.cli.options import Debug, Json, Quiet, RunDir, RunsDir

Target = Annotated[Optional[str], typer.Option("--target", help="Target motion (default: the run's primary_target).",
                                               show_default=False)]
Frac = Annotated[Optional[float], typer.Option("--frac", help="Budget as a share of the pool (default: the run's attr.frac).",
                                               show_default=False)]
Variant = Annotated[str, typer.Option("--variant", help="Selector: motive, motive_dense, no_mask, indep_noise, "
                                                         "no_length_norm, mean_agg, motive_frames, multi_draw, random, "
                                                         "flow_magnitude, appearance_match.")]
Queries = Annotated[str, typer.Option("--queries", help="auto (the run's queries of the target) or a folder of .mp4/.webm videos, "
                                                         ".npy/.npz clips or PNG frame folders.")]
AttrSeed = Annotated[Optional[int], typer.Option("--attr-seed", help="Attribution seed (default: the first of attr.attr_seeds).",
                                                 show_default=False)]


def register(app: typer.Typer) -> None:
    @app.command("select")
    @guarded
    def select_command(run_dir: RunDir = None, target: Target = None, frac: Frac = None, variant: Variant = "motive",
                       queries: Queries = "auto", attr_seed: AttrSeed = None, runs_dir: RunsDir = None,
                       json_: Json = False, quiet: Quiet = False, debug: Debug = False):
        """Featurize (cached), score and aggregate one selector; write scores.parquet and a selection list."""
        from icml.cli.errors import UsageError
        from icml.cli.lifecycle import config_from_run
        from icml.methods.attribute_motion import METHOD
        from icml.methods.attribute_motion.pipeline import select

        runs = store(runs_dir)
        run = runs.open(run_dir, METHOD.name) if run_dir else runs.latest(METHOD.name, "train")
        if run.phase_status("train") != "completed":
            raise UsageError(f"train of {run.path} is {run.phase_status('train') or 'missing'}",
                             f"finish it first: icml attribute-motion train --resume {run.path}")
        if frac is not None and not 0 < frac < 1:
            raise UsageError(f"--frac must be in (0, 1), not {frac}", "pass a share of the pool such as 0.1")
        cfg, _, _ = config_from_run(METHOD, run)
        result = select(run.path, cfg, variant, target or cfg.primary_target, frac,
                        None if queries == "auto" else queries, attr_seed)
        if json_:
            console.emit_json({"run_dir": str(run.path), **result})
        else:
            console.say(f"{result['variant']} · {result['target']}: {len(result['clip_ids'])} clips selected "
                        f"→ {result['path']} (scores in {run.path / 'scores.parquet'})", style="bold green")
