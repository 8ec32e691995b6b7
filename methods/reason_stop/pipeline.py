"""`icml reason-stop` train → eval.

train: generate the trace corpus, build the word tokenizer, train the tiny Llama (skipped with
`--model`). eval: every variant over the test problems; metrics.parquet rows, atp_events.parquet
(one row per ATP) and generations.parquet (one row per problem and variant).
"""
from __future__ import annotations

import torch

from icml.cli.lifecycle import RunContext
from icml.cli.runstore import load_checkpoint
from icml.cli.threads import intra_op_threads
from icml.cli.workers import run_in_workers
from icml.methods.reason_stop.data import VOCAB, build_tokenizer, encode_trace, generate_traces
from icml.methods.reason_stop.evaluation import (eval_problems, run_variant, stored_generations, summary_rows,
                                                 tables)


def train(ctx: RunContext) -> None:
    from icml.methods.reason_stop.model import tiny_model, train_model

    cfg = ctx.config
    if cfg.model:
        ctx.log(f"--model {cfg.model}: no training; eval runs the controller on it")
        return
    tokenizer = build_tokenizer()
    vocab = {w: i for i, w in enumerate(VOCAB)}
    train_set = [encode_trace(t, vocab) for t in generate_traces(cfg, ctx.seed, "train", cfg.n_train)]
    val_set = [encode_trace(t, vocab) for t in generate_traces(cfg, ctx.seed, "val", cfg.n_val)]
    model = tiny_model(cfg, len(tokenizer), ctx.seed)
    state_path = ctx.checkpoints / "state.pt"
    start, optimizer_state = 0, None
    if ctx.resumed and state_path.exists():
        saved = load_checkpoint(state_path)
        model.load_state_dict(saved["model"])
        start, optimizer_state = saved["step"], saved["optimizer"]
    ctx.log(f"tiny Llama: {sum(p.numel() for p in model.parameters()):,} parameters, vocab {len(tokenizer)}, "
            f"{len(train_set)} training traces")

    def log(step: int, values: dict) -> None:
        split = "val" if "val_loss" in values else "train"
        ctx.record([{"variant": "tiny_llama", "metric": k, "value": v, "step": step} for k, v in values.items()],
                   split=split)
        if split == "val":
            ctx.log(f"  step {step}: val_loss {values['val_loss']:.4f}")

    def checkpoint(step: int, optimizer) -> None:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, state_path)

    with ctx.progress("training steps", cfg.steps - start) as advance, intra_op_threads(cfg.train_threads):
        train_model(model, train_set, val_set, cfg, ctx.seed, ctx.device, tokenizer.pad_token_id, start,
                    optimizer_state, log, checkpoint, advance)
    model.config._attn_implementation = "eager"
    model.save_pretrained(ctx.checkpoints / "model")
    tokenizer.save_pretrained(ctx.checkpoints / "model")


def evaluate(ctx: RunContext) -> None:
    cfg = ctx.config
    problems = eval_problems(cfg, ctx.seed)
    ctx.log(f"{len(problems)} problems × {len(cfg.variants)} variants")
    results: dict[str, list[dict]] = {}
    jobs = [(variant, run_variant, (str(ctx.run.path), cfg, ctx.device, variant, problems, ctx.seed))
            for variant in cfg.variants]
    with ctx.progress("variants", len(jobs)) as advance:
        def done(variant: str, generations: list[dict]) -> None:
            results[variant] = generations
            advance(1)
        run_in_workers(cfg.workers, jobs, done)
    ordered = [g for variant in cfg.variants for g in results[variant]]
    generations, events = tables(ordered, ctx.run.path.name)
    ctx.record(summary_rows(generations, events, cfg), split="test")
    ctx.write_table("atp_events", events)
    ctx.write_table("generations", stored_generations(generations))
