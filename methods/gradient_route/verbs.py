"""`icml gradient-route export [RUN] --profile core+a0 --out DIR`: one profile's served model.

The deployed model (other modules deleted) is merged into a plain GPT2LMHeadModel of MLP width
d_core + Σ d_aux of the kept modules (exactly the same function), saved with save_pretrained, so it
loads anywhere with from_pretrained; a character tokenizer's alphabet is written beside it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from icml.cli import console
from icml.cli.commands import guarded, store
from icml.cli.options import Debug, Json, Quiet, RunDir, RunsDir

Profile = Annotated[str, typer.Option("--profile", help="core, core+a0, … or all (every module kept).")]
OutDir = Annotated[Path, typer.Option("--out", "-o", help="Directory to write the model into.")]
Variant = Annotated[str, typer.Option("--variant", help="A trained GRAM variant (gram, gram_partial, …).")]
Seed = Annotated[Optional[int], typer.Option("--seed", help="Which model seed (default: the run's).",
                                             show_default=False)]


def register(app: typer.Typer) -> None:
    @app.command("export")
    @guarded
    def export_command(run_dir: RunDir = None, profile: Profile = "core", out: OutDir = Path("exported"),
                       variant: Variant = "gram", seed: Seed = None, runs_dir: RunsDir = None,
                       json_: Json = False, quiet: Quiet = False, debug: Debug = False):
        """Write one profile's pruned model (a plain GPT-2 checkpoint) to --out."""
        import json

        from icml.cli.errors import UsageError
        from icml.cli.lifecycle import config_from_run
        from icml.methods.gradient_route import METHOD
        from icml.methods.gradient_route.pipeline import (GRAM_VARIANTS, checkpoint_path, corpus_for,
                                                          deployed_model, retained)
        from icml.methods.gradient_route.model import merged_gpt2

        runs = store(runs_dir)
        run = runs.open(run_dir, METHOD.name) if run_dir else runs.latest(METHOD.name, "train")
        cfg, _, run_seed = config_from_run(METHOD, run)
        seed = run_seed if seed is None else seed
        if variant not in GRAM_VARIANTS or variant not in cfg.variants:
            raise UsageError(f"--variant '{variant}' is not a GRAM variant of this run",
                             f"use one of {', '.join(v for v in cfg.variants if v in GRAM_VARIANTS)}")
        corpus = corpus_for(cfg, run_seed)
        unknown = [m for m in retained(profile, corpus) if m not in corpus.aux] if profile != "all" else []
        if profile.split("+")[0] not in ("core", "all") or unknown:
            raise UsageError(f"--profile '{profile}' is not core, core+<module>… or all",
                             f"the modules are {', '.join(corpus.aux)}")
        if not checkpoint_path(run.checkpoints, variant, None, seed).exists():
            raise UsageError(f"run {run.path} has no {variant} model for seed {seed}", "train it first")
        served = merged_gpt2(deployed_model(cfg, corpus, run.checkpoints, variant, profile, seed, "cpu"))
        out.mkdir(parents=True, exist_ok=True)
        served.save_pretrained(out)
        chars = getattr(corpus.tokenizer, "chars", None)
        if chars is not None:
            (out / "alphabet.json").write_text(json.dumps({"chars": chars, "unk": corpus.tokenizer.unk_id}))
        else:
            corpus.tokenizer.inner.save_pretrained(out)
        summary = {"out": str(out), "profile": profile, "variant": variant, "seed": seed,
                   "params": sum(p.numel() for p in served.parameters()), "mlp_width": served.config.n_inner}
        if json_:
            console.emit_json(summary)
        else:
            console.say(f"{variant} {profile} → {out} ({summary['params']:,} parameters, MLP width "
                        f"{summary['mlp_width']})", style="bold green")
