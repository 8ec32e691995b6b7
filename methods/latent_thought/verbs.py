"""`icml latent-thought generate [RUN] --arm ARM --prompt TEXT [--max-new N] [--temperature T]
[--prefill jacobi|exact] [--json]`: exact cached decoding from a trained arm."""
from __future__ import annotations

from typing import Annotated, Optional

import typer

from icml.cli import console
from icml.cli.commands import guarded, store
from icml.cli.options import Debug, Device, Json, Quiet, RunDir, RunsDir, Seed

Arm = Annotated[str, typer.Option("--arm", help="The trained arm to decode with (vanilla_* or ponderlm2_*).")]
Prompt = Annotated[str, typer.Option("--prompt", help="The prompt text.")]
MaxNew = Annotated[int, typer.Option("--max-new", help="Tokens to generate.")]
Temperature = Annotated[float, typer.Option("--temperature", help="0 = greedy; >0 samples.")]
Prefill = Annotated[str, typer.Option("--prefill", help="jacobi (J = eval_J, the final pass's cache) | exact.")]


def register(app: typer.Typer) -> None:
    @app.command("generate")
    @guarded
    def generate_command(run_dir: RunDir = None, arm: Arm = "ponderlm2_k1", prompt: Prompt = "def ",
                         max_new: MaxNew = 64, temperature: Temperature = 0.0, prefill: Prefill = "jacobi",
                         seed: Seed = None, device: Device = "auto", runs_dir: RunsDir = None, json_: Json = False,
                         quiet: Quiet = False, debug: Debug = False):
        """Decode exactly with the KV cache: K+1 decoder calls per token (position ids count tokens,
        the cache counts slots)."""
        from icml.cli.errors import UsageError
        from icml.cli.lifecycle import config_from_run, resolve_device

        runs = store(runs_dir)
        from icml.methods.latent_thought import METHOD

        run = runs.open(run_dir, METHOD.name) if run_dir else runs.latest(METHOD.name, "train")
        cfg, _, run_seed = config_from_run(METHOD, run)
        if prefill not in ("jacobi", "exact"):
            raise UsageError(f"--prefill must be jacobi or exact, not '{prefill}'", "pass --prefill jacobi|exact")
        if max_new < 1 or temperature < 0:
            raise UsageError("--max-new must be >= 1 and --temperature >= 0", "fix the option")
        if not prompt:
            raise UsageError("--prompt is empty", "pass some text: --prompt 'def '")
        directory = run.checkpoints / arm
        if not (directory / "config.json").exists():
            trained = sorted(p.name for p in run.checkpoints.iterdir()) if run.checkpoints.exists() else []
            raise UsageError(f"run {run.path} has no arm '{arm}'", f"use one of: {', '.join(trained) or 'none'}")
        import time

        import torch

        from icml.methods.latent_thought.model import load_arm
        from icml.methods.latent_thought.pipeline import load_tokenizer, prompt_ids

        model = load_arm(directory, resolve_device(device))
        if not model.cached_decoding:
            raise UsageError(f"arm '{arm}' has no cached decoding", "generate with a vanilla_* or ponderlm2_* arm")
        tokenizer = load_tokenizer(cfg)
        ids = prompt_ids(prompt, tokenizer).to(next(model.parameters()).device)
        generator = torch.Generator(device=ids.device).manual_seed(run_seed if seed is None else seed)
        started = time.perf_counter()
        new, info = model.generate(ids, max_new, temperature, prefill, cfg.eval_J, generator)
        seconds = time.perf_counter() - started
        tokens = new[0].tolist()
        text = bytes(tokens).decode("utf-8", "replace") if tokenizer is None else tokenizer.decode(tokens)
        if json_:
            console.emit_json({"run_dir": str(run.path), "arm": arm, "prompt": prompt, "text": text,
                               "tokens": tokens, "prefill": prefill, "K": model.K,
                               "decoder_calls_per_token": info["decoder_calls_per_token"],
                               "cache_length": info["cache_length"], "gen_tokens_per_s": len(tokens) / seconds})
        else:
            print(prompt + text, flush=True)  # the text itself goes to stdout
