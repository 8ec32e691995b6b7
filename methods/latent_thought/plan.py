"""`icml latent-thought plan`: one training step and one evaluation chunk of each arm, at the preset's sizes, on
the meta device (cli/plan.py). Under torchrun every process trains on batch / processes windows of the global
batch (distributed.shard) and holds the whole model (DDP)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from icml.cli.plan import Hardware, Step
from icml.methods.latent_thought.model import build_arm
from icml.methods.latent_thought.pipeline import EVAL_CHUNK, optimizer_for, spec_of, train_step

LAYOUT = "torchrun: one process per GPU, DDP over the batch"
# The paper's Llama-1.4B arms at 32 windows of 2 048 tokens per process hold their eager attention scores for
# backward: [32, 32 heads, 4 096 slots, 4 096 slots] per layer and Jacobi pass. They need flash attention and
# gradient accumulation (micro-batches), which the arms do not have yet.
DOES_NOT_FIT = "eager attention over 4 096 slots per window, no micro-batches: see the README's paper preset"
OVERSIZE = ["seq_len=16384"]
VOCAB = 256  # from scratch the arms read bytes (pipeline.load_tokenizer: a tokenizer only with --model)


def hardware(preset: str) -> Hardware:
    return Hardware(8, 80e9) if preset == "paper" else Hardware(1, 80e9)


def _arm(cfg, name: str, tracker):
    with torch.device(tracker.device):
        model = build_arm(spec_of(name, cfg), cfg.tiny, 0, cfg.thought_scale, vocab=VOCAB)
    return model


def _train(cfg, name: str, processes: int):
    def run(tracker):
        model = _arm(cfg, name, tracker).train()
        optimizer = optimizer_for(model, cfg)
        tracker.watch(model, optimizer)
        batch = torch.randint(VOCAB, (max(1, cfg.batch // processes), cfg.seq_len + 1), device=tracker.device)
        for _ in range(2):  # the second step holds AdamW's state from its start, as every step after the first
            train_step(model, model, optimizer, batch, max(cfg.train_J), cfg.lr, cfg.clip)
    return run


def _eval(cfg, name: str):
    def run(tracker):
        model = _arm(cfg, name, tracker).eval()
        tracker.watch(model)
        ids = torch.randint(VOCAB, (min(EVAL_CHUNK, cfg.n_val), cfg.seq_len), device=tracker.device)
        with torch.no_grad():
            if model.spec.kind == "ponderlm2":  # evaluate_arm's chunk: every Jacobi iterate kept. The exact solve
                # (cached sequential decoding, one slot per call) holds less and is left out: T·K calls on meta
                solve = model.jacobi(ids, max([*cfg.eval_Js, cfg.eval_J]), all_iterations=True)
                logits = solve.logits[-1]
                for iterate in solve.logits[:-1]:
                    F.cross_entropy(iterate.flatten(0, 1).double(), ids.flatten(), reduction="sum")
            else:
                logits = model(ids, 0)
            F.cross_entropy(logits.flatten(0, 1).double(), ids.flatten(), reduction="sum")
    return run


def steps(cfg, processes: int) -> list[Step]:
    out = []
    for name in cfg.arms:
        J = max(cfg.train_J)
        out.append(Step("train", f"{name}: an AdamW step on {max(1, cfg.batch // processes)} × {cfg.seq_len} tokens "
                                 f"per process (J = {J}, the largest of train_J)", _train(cfg, name, processes),
                        repeats=2))
    for name in cfg.arms:
        out.append(Step("eval", f"{name}: one chunk of {min(EVAL_CHUNK, cfg.n_val)} validation windows",
                        _eval(cfg, name)))
    return out
