"""Training the tiny Llama: a mixture of copy, cue-copy and dense associative-recall sequences and the
three tasks (loss on the supervised tokens only) under a length curriculum, AdamW with a linear
warm-up and cosine decay; validation loss and exact match on held-out examples of the tasks."""
from __future__ import annotations

import math
import random
from typing import Callable

import torch

from icml.cli import distributed
from icml.methods.kv_compress.config import TASKS, row_mixture
from icml.methods.kv_compress.data import (Example, context_count_sequence, context_recall_sequence, copy_sequence,
                                           count_sequence, cue_copy_sequence, generate, recall_sequence)


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


def encode_words(tokenizer, words: list[str], targets: list[bool]) -> tuple[list[int], list[bool]]:
    """Ids of `<bos> words` (one id per word) and their loss targets."""
    return [tokenizer.bos_token_id] + tokenizer.convert_tokens_to_ids(words), [False] + targets


def batch(tokenizer, examples: list[Example]) -> dict[str, torch.Tensor]:
    return pad([encode(tokenizer, e) for e in examples], tokenizer.pad_token_id)


def pad(encoded: list[tuple[list[int], list[bool]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch whose labels are −100 everywhere but the target tokens. No attention mask:
    with right padding and causal attention no real token sees a pad, and sdpa runs 2× faster."""
    length = max(len(ids) for ids, _ in encoded)
    ids = torch.full((len(encoded), length), pad_id)
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


def context_range(step: int, cfg) -> tuple[int, int]:
    """The length curriculum: contexts of train_context_min..train_context_short words for the first
    `curriculum_hold` of training (the induction circuit forms on short sequences, where steps are
    cheap), then both ends grow linearly to context_min..context_max over `curriculum_grow`."""
    start = cfg.curriculum_hold * cfg.steps
    grow = cfg.curriculum_grow * cfg.steps
    progress = (1.0 if step >= start else 0.0) if grow == 0 else min(1.0, max(0.0, (step - start) / grow))
    low = cfg.train_context_min + (cfg.context_min - cfg.train_context_min) * progress
    high = cfg.train_context_short + (cfg.context_max - cfg.train_context_short) * progress
    return round(low), round(high)


def row_counts(mixture: list[tuple[str, float]], rows: int) -> list[int]:
    """Rows per kind, proportional to the weights by cumulative rounding (they sum to `rows`)."""
    total = sum(weight for _, weight in mixture)
    bounds, cumulative = [0], 0.0
    for _, weight in mixture:
        cumulative += weight
        bounds.append(round(cumulative / total * rows))
    return [b - a for a, b in zip(bounds, bounds[1:])]


def training_batch(tokenizer, cfg, seed: int, step: int) -> dict[str, torch.Tensor]:
    """The batch of `step`, from (seed, step) alone: one context length, batch_size rows while the
    contexts are short and fewer (down to min_batch_size, about constant tokens) as they grow, split
    between the row kinds of `rows_short` during the curriculum's hold and of `rows_long` afterwards
    (README, training recipe)."""
    rng = random.Random(f"{seed}/train/{step}")
    length = rng.randint(*context_range(step, cfg))
    rows = max(cfg.min_batch_size, min(cfg.batch_size, cfg.batch_size * cfg.train_context_short // length))
    mixture = row_mixture(cfg.rows_short if step < cfg.curriculum_hold * cfg.steps else cfg.rows_long)
    builders = {
        "copy": lambda i: encode_words(tokenizer, *copy_sequence(rng, length)),
        "cue_copy": lambda i: encode_words(tokenizer, *cue_copy_sequence(rng, length)),
        "recall": lambda i: encode_words(tokenizer, *recall_sequence(rng, length, tuple(cfg.recall_pairs))),
        "count": lambda i: encode_words(tokenizer, *count_sequence(rng, length)),
        "context_recall": lambda i: encode_words(tokenizer, *context_recall_sequence(rng, length)),
        "context_count": lambda i: encode_words(tokenizer, *context_count_sequence(rng, length)),
        "tasks": lambda i: encode(tokenizer, generate(TASKS[i % len(TASKS)], i, rng, length, length,
                                                      cfg.train_questions)),
    }
    encoded = [builders[kind](i) for (kind, _), count in zip(mixture, row_counts(mixture, rows))
               for i in range(count)]
    return pad(encoded, tokenizer.pad_token_id)


def rank_inputs(inputs: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    """Under torchrun, from the global batch every rank builds: this rank's rows and the model's
    `num_items_in_batch` (transformers then divides their summed answer-token loss by it instead of
    taking their mean), so that DDP's average of the ranks' gradients is the global batch's token
    mean. A rank without rows (fewer rows than ranks) trains on row 0 with every target ignored."""
    count = int((inputs["labels"][:, 1:] != -100).sum())  # the targets the shifted loss counts
    mine, real = distributed.share(len(inputs["labels"]))
    inputs = {key: value[mine] for key, value in inputs.items()}
    if not real:
        inputs["labels"] = torch.full_like(inputs["labels"], -100)
    return inputs, {"num_items_in_batch": distributed.sum_divisor(count)}


def train_step(model, replicas, optimizer, inputs: dict[str, torch.Tensor], loss_options: dict, lr: float):
    """One AdamW step on a batch (its tensors on the model's device); returns the loss tensor."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = replicas(**inputs, **loss_options).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss


def train_model(model, tokenizer, cfg, seed: int, device: str, val: list[Example], start_step: int,
                optimizer_state: dict | None, on_log: Callable[[int, dict], None],
                on_checkpoint: Callable[[int, torch.optim.Optimizer, list[float]], None],
                advance: Callable[[float], None], pending: list[float] | None = None):
    """Train from `start_step` to cfg.steps; batches depend on (seed, step) only, so a resumed run
    sees the batches an uninterrupted one would, and `pending` (the losses since the last train_loss row,
    kept in the checkpoint) makes its next train_loss the same mean. Under torchrun the model trains data-parallel
    (cli/distributed.py): every rank builds each global batch and trains on its rows (`rank_inputs`);
    the logged losses are the global batch's, validation runs whole on every rank."""
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    replicas = distributed.wrap(model)  # DistributedDataParallel under torchrun; the model itself otherwise
    running = list(pending or [])
    for step in range(start_step, cfg.steps):
        inputs, loss_options = training_batch(tokenizer, cfg, seed, step), {}
        if distributed.is_replica(replicas):
            inputs, loss_options = rank_inputs(inputs)
        inputs = {k: v.to(device) for k, v in inputs.items()}
        loss = train_step(model, replicas, optimizer, inputs, loss_options, lr_at(step, cfg))
        running.append(distributed.mean(loss.item()))  # the global batch's
        done = step + 1
        if done % cfg.train_log_every == 0 or done == cfg.steps:
            on_log(done, {"train_loss": sum(running) / len(running)})
            running = []
        if done % cfg.val_every == 0 or done == cfg.steps:
            val_loss, exact = validate_model(model, tokenizer, val, device)
            on_log(done, {"val_loss": val_loss, **{f"val_exact_match/{t}": v for t, v in exact.items()}})
            on_checkpoint(done, optimizer, list(running))
        advance(1)
    model.eval()
