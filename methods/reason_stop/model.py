"""The reasoner: the tiny Llama trained on the traces, or a local HF checkpoint (eager attention),
and its training loop (AdamW, linear warm-up then cosine decay, loss on the thinking-block tokens)."""
from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Callable

import torch

from icml.cli.errors import UsageError
from icml.methods.reason_stop.config import SUPPORTED_FAMILIES


def quiet_transformers() -> None:
    """No transformers progress bars or deprecation chatter: the CLI's own output governs."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def tiny_model(cfg, vocab_size: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    quiet_transformers()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=cfg.tiny.hidden, intermediate_size=cfg.tiny.intermediate,
                         num_hidden_layers=cfg.tiny.layers, num_attention_heads=cfg.tiny.heads,
                         num_key_value_heads=cfg.tiny.kv_heads, max_position_embeddings=cfg.tiny.max_position,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"  # training speed; the saved model loads with eager attention
    return LlamaForCausalLM(config)


def load_checkpoint(path: str | Path):
    """(model, tokenizer) of a local HF causal-LM directory with eager attention (the controller
    reads attention weights, which SDPA/flash kernels never materialise), in eval mode."""
    from icml.cli import checkpoints

    checkpoints.check(str(path), SUPPORTED_FAMILIES, "reason-stop")
    return checkpoints.load_causal_lm(str(path), attn_implementation="eager")


def load_tokenizer(path: str | Path):
    """The tokenizer of a local HF checkpoint directory (alone: check_inputs reads it before a run)."""
    from transformers import AutoTokenizer

    from icml.cli import checkpoints

    quiet_transformers()
    ckpt = checkpoints.resolve(str(path))
    try:
        return AutoTokenizer.from_pretrained(*ckpt.args(), **ckpt.kwargs())
    except (OSError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(f"cannot load the tokenizer of model '{path}' ({reason})",
                         "save it beside the weights (tokenizer.save_pretrained(DIR))") from None


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------
def pad_batch(encoded: list[tuple[list[int], int]], pad_id: int, max_length: int) -> dict[str, torch.Tensor]:
    """Right-padded ids and labels (−100 on padding and on the prompt up to `<think>`). No attention
    mask: with right padding and causal attention no real token sees a pad."""
    length = min(max_length, max(len(ids) for ids, _ in encoded))
    ids = torch.full((len(encoded), length), pad_id)
    labels = torch.full((len(encoded), length), -100)
    for row, (sequence, think_at) in enumerate(encoded):
        sequence = sequence[:length]
        ids[row, :len(sequence)] = torch.tensor(sequence)
        labels[row, think_at + 1:len(sequence)] = torch.tensor(sequence[think_at + 1:])
    return {"input_ids": ids, "labels": labels}


def lr_at(step: int, cfg) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def validation_loss(model, encoded: list[tuple[list[int], int]], cfg, pad_id: int, device: str) -> float:
    """Token cross-entropy over every target token of the validation traces."""
    model.eval()
    total, count = 0.0, 0
    # a sum over traces: sorted by length, each chunk of 64 pads to its own longest (not to the
    # 182-token tail of the whole set)
    encoded = sorted(encoded, key=lambda item: len(item[0]))
    for start in range(0, len(encoded), 64):
        batch = {k: v.to(device) for k, v in pad_batch(encoded[start:start + 64], pad_id, cfg.max_length).items()}
        logits = model(input_ids=batch["input_ids"]).logits[:, :-1].float()
        target = batch["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                 ignore_index=-100, reduction="sum")
        total += loss.item()
        count += int((target != -100).sum())
    model.train()
    return total / count


def accumulate_batch_gradient(model, encoded: list[tuple[list[int], int]], pad_id: int, max_length: int,
                              micro_batch: int, device: str) -> float:
    """Backpropagate the batch's mean token cross-entropy (the loss of one right-padded batch, as HF's
    `model(**pad_batch(encoded)).loss`) and return it. The traces are sorted by length and run in
    micro-batches of `micro_batch`, each padded to its own longest trace, each loss summed and divided
    by the token count of the whole batch: the same loss and gradient, without the ~40 % padding of a
    batch padded to its longest trace (lengths 25–182, mean 105). Pads are never attended (right
    padding, causal attention) and carry no label, so dropping them changes no real token."""
    encoded = sorted(encoded, key=lambda item: len(item[0]))
    n_targets = sum(max(0, min(len(ids), max_length) - think_at - 1) for ids, think_at in encoded)
    total = 0.0
    for start in range(0, len(encoded), micro_batch):
        batch = {k: v.to(device) for k, v in pad_batch(encoded[start:start + micro_batch], pad_id, max_length).items()}
        total += micro_batch_backward(model, batch, n_targets).item()
    return total


def micro_batch_backward(model, batch: dict[str, torch.Tensor], n_targets: int) -> torch.Tensor:
    """Backpropagate one micro-batch's summed token cross-entropy ÷ `n_targets`; returns that loss."""
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1]  # the model's dtype (fp32; tests: fp64)
    target = batch["labels"][:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                             ignore_index=-100, reduction="sum") / n_targets
    loss.backward()
    return loss.detach()


def train_model(model, train: list[tuple[list[int], int]], val: list[tuple[list[int], int]], cfg, seed: int,
                device: str, pad_id: int, start_step: int, optimizer_state: dict | None,
                on_log: Callable[[int, dict], None], on_checkpoint: Callable[[int, torch.optim.Optimizer], None],
                advance: Callable[[float], None]) -> None:
    """Train from `start_step` to cfg.steps. The batch of a step depends on (seed, step) alone, so a
    resumed run sees the batches an uninterrupted one would."""
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    running = []
    for step in range(start_step, cfg.steps):
        rng = random.Random(f"{seed}/batch/{step}")
        batch = [train[rng.randrange(len(train))] for _ in range(cfg.batch_size)]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        optimizer.zero_grad(set_to_none=True)
        loss = accumulate_batch_gradient(model, batch, pad_id, cfg.max_length, cfg.train_micro_batch, device)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running.append(loss)
        done = step + 1
        if done % cfg.train_log_every == 0 or done == cfg.steps:
            on_log(done, {"train_loss": sum(running) / len(running)})
            running = []
        if done % cfg.val_every == 0 or done == cfg.steps:
            on_log(done, {"val_loss": validation_loss(model, val, cfg, pad_id, device)})
            on_checkpoint(done, optimizer)
        advance(1)
    model.eval()
