"""`icml reason-stop generate [RUN] --prompt TEXT [--variant asag]`: one trace, annotated at each ATP."""
from __future__ import annotations

from typing import Annotated, Optional

import typer

from icml.cli import console
from icml.cli.commands import guarded, store
from icml.cli.options import Debug, Device, Json, Quiet, RunDir, RunsDir

Prompt = Annotated[str, typer.Option("--prompt", help="The question, e.g. 'Q 3 + 5 - 9 ='.")]
Variant = Annotated[str, typer.Option("--variant", help="vanilla | nothinking | deer | asag | asag_exit | "
                                                        "asag_exit_inject | asag_exit_jump | oracle_first_correct.")]
Answer = Annotated[Optional[str], typer.Option("--answer", help="The ground truth, for probe correctness "
                                               "(synthetic questions: computed when omitted).", show_default=False)]


def register(app: typer.Typer) -> None:
    @app.command("generate")
    @guarded
    def generate_command(run_dir: RunDir = None, prompt: Prompt = "Q 3 + 5 - 9 + 2 =", variant: Variant = "asag",
                         answer: Answer = None, device: Device = "auto", runs_dir: RunsDir = None,
                         json_: Json = False, quiet: Quiet = False, debug: Debug = False):
        """Generate one trace with a variant's controller and print it, annotated at every ATP with
        the probe confidence C, ΔH, the trap test and the action."""
        from icml.cli.errors import UsageError
        from icml.cli.lifecycle import config_from_run, resolve_device
        from icml.methods.reason_stop import METHOD
        from icml.methods.reason_stop.config import VARIANTS
        from icml.methods.reason_stop.evaluation import annotated_trace, generate_one

        if variant not in VARIANTS:
            raise UsageError(f"unknown variant '{variant}'", f"use one of {', '.join(VARIANTS)}")
        if not prompt.strip():
            raise UsageError("--prompt is empty", "pass a question, e.g. --prompt 'Q 3 + 5 ='")
        runs = store(runs_dir)
        run = runs.open(run_dir, METHOD.name) if run_dir else runs.latest(METHOD.name, "train")
        cfg, _, seed = config_from_run(METHOD, run)
        generation = generate_one(run.path, cfg, resolve_device(device), variant, prompt, answer, seed)
        if json_:
            console.emit_json({"run_dir": str(run.path), "variant": variant, "text": generation.text,
                               "answer": generation.answer, "correct": generation.correct,
                               "tokens": generation.tokens, "probe_tokens": generation.probe_tokens,
                               "events": generation.events})
            return
        print(annotated_trace(generation))
