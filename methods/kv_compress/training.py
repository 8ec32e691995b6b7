"""Training the tiny Llama on the task mixture: loss on the answer tokens only, AdamW with a
linear warm-up and cosine decay; validation loss and exact match on held-out examples."""
from __future__ import annotations

import math
import random
from typing import Callable

import torch

from icml.methods.kv_compress.config import TASKS
from icml.methods.kv_compress.data import Example, generate


def encode(tokenizer, example: Example) -> tuple[list[int], list[bool]]:
    """Ids of `<bos> context q1 a1 q2 a2 …` and which of them are answer tokens (the loss targets)."""
    ids = tokenizer(example.context)["input_ids"]
    targets = [False] * len(ids)
    for question, answer in ((example.question, example.answer), *example.more):
        q = tokenizer(f" {question}", add_special_tokens=False)["input_ids"]
        a = tokenizer(f" {answer}", add_special_tokens=False)["input_ids"]
        ids += q + a
        targets += [False] * len(q) + [True] * len(a)
    return ids, targets


def batch(tokenizer, examples: list[Example]) -> dict[str, torch.Tensor]:
    """Right-padded batch whose labels are −100 everywhere but the answer tokens. No attention mask:
    with right padding and causal attention no real token sees a pad, and sdpa runs 2× faster."""
    encoded = [encode(tokenizer, e) for e in examples]
    length = max(len(ids) for ids, _ in encoded)
    ids = torch.full((len(encoded), length), tokenizer.pad_token_id)
    labels = torch.full((len(encoded), length), -100)
    for row, (sequence, targets) in enumerate(encoded):
        ids[row, :len(sequence)] = torch.tensor(sequence)
        answer = torch.tensor(targets)
        labels[row, :len(sequence)] = torch.where(answer, torch.tensor(sequence), -100)
    return {"input_ids": ids, "labels": labels}


@torch.no_grad()
def validate_model(model, tokenizer, examples: list[Example], device: str) -> tuple[float, dict[str, float]]:
    """(answer-token loss, exact match per task) with the model's own full-attention forward."""
    model.eval()
    losses, hits = [], {}
    for start in range(0, len(examples), 16):
        chunk = examples[start:start + 16]
        inputs = {k: v.to(device) for k, v in batch(tokenizer, chunk).items()}
        out = model(**inputs)
        losses.append(float(out.loss) * len(chunk))
        predicted = out.logits[:, :-1].argmax(-1)
        target = inputs["labels"][:, 1:]
        correct = ((predicted == target) | (target == -100)).all(1)
        for example, ok in zip(chunk, correct.tolist()):
            hits.setdefault(example.task, []).append(ok)
    model.train()
    return sum(losses) / len(examples), {task: sum(v) / len(v) for task, v in hits.items()}


def lr_at(step: int, cfg) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * progress))


def train_model(model, tokenizer, cfg, seed: int, device: str, val: list[Example], start_step: int,
                optimizer_state: dict | None, on_log: Callable[[int, dict], None],
                on_checkpoint: Callable[[int, torch.optim.Optimizer], None], advance: Callable[[float], None]):
    """Train from `start_step` to cfg.steps; batches depend on (seed, step) only, so a resumed run
    sees the batches an uninterrupted one would."""
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    running = []
    for step in range(start_step, cfg.steps):
        rng = random.Random(f"{seed}/train/{step}")
        # a length curriculum: the longest context grows linearly to context_max over the first half of
        # training (short contexts make the retrieval circuit form far sooner); one length per batch
        # leaves no padding to waste compute on
        longest = cfg.train_context_min + (cfg.context_max - cfg.train_context_min) * min(1.0, 2 * step / cfg.steps)
        length = rng.randint(cfg.train_context_min, round(longest))
        examples = [generate(TASKS[i % len(TASKS)], i, rng, length, length, cfg.train_questions)
                    for i in range(cfg.batch_size)]
        inputs = {k: v.to(device) for k, v in batch(tokenizer, examples).items()}
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = model(**inputs).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running.append(loss.item())
        done = step + 1
        if done % cfg.train_log_every == 0 or done == cfg.steps:
            on_log(done, {"train_loss": sum(running) / len(running)})
            running = []
        if done % cfg.val_every == 0 or done == cfg.steps:
            val_loss, exact = validate_model(model, tokenizer, val, device)
            on_log(done, {"val_loss": val_loss, **{f"val_exact_match/{t}": v for t, v in exact.items()}})
            on_checkpoint(done, optimizer)
        advance(1)
    model.eval()
