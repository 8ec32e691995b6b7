"""The language models of `icml spectral-optim`: the spec's tiny GPT-2, or a local checkpoint.

A grid compares optimizers, so every run must start from the same weights: the model is built
(or loaded) once per grid and each run trains a deep copy of it.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from icml.methods.spectral_optim.config import SUPPORTED_FAMILIES


def tiny_gpt2(n_embd: int, n_layer: int, n_head: int, n_positions: int, vocab_size: int, init_seed: int):
    """The spec's GPT-2 (~0.8M parameters at 128/4/4/128 and a ~50-70 character vocabulary):
    tied embedding and LM head, no dropout, fp32. The weights depend on `init_seed` only; the
    global RNG is left as it was.

    The MLP uses the exact (erf) GELU rather than GPT-2's tanh approximation: the two differ by
    < 1e-3 anywhere, and on CPU torch's tanh-GELU kernel costs ~5x the erf one (~7% of a forward
    and backward pass; GPT-2's default unfused `gelu_new` costs ~25%)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                        n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        tie_word_embeddings=True, activation_function="gelu",
                        bos_token_id=None, eos_token_id=None)  # GPT-2's 50256 lies outside a char vocabulary
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed)
        model = GPT2LMHeadModel(config)
    return model.float()


def load_causal_lm(path: str | Path):
    """(model, tokenizer) of a --model checkpoint (directory, .gguf file or short name) of
    SUPPORTED_FAMILIES, through the shared checkpoint path; never touches the network."""
    from icml.cli import checkpoints

    checkpoints.check(str(path), SUPPORTED_FAMILIES, "spectral-optim")
    model, tokenizer = checkpoints.load_causal_lm(str(path))
    # transformers builds an empty tokenizer from the config alone when the directory holds no
    # tokenizer files: it loads, but encodes every text to nothing
    if not tokenizer("The quick brown fox.", add_special_tokens=False)["input_ids"]:
        raise ValueError(f"model '{path}' has no tokenizer files (its tokenizer encodes text to nothing) — "
                         "save one next to the weights with tokenizer.save_pretrained(DIR)")
    return model.float(), tokenizer


def context_length(model) -> int | None:
    """The longest input the model's position embeddings allow (None if the config does not say)."""
    config = model.config
    for key in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def initial_model(cfg, vocab_size: int, seed: int, pretrained=None):
    """The weights every run of a grid starts from: `pretrained` (a `--model`'s model, checked
    against block_size and the tokenizer) or the tiny GPT-2 built from `cfg.gpt` with `seed`."""
    if pretrained is None:
        return tiny_gpt2(cfg.gpt.n_embd, cfg.gpt.n_layer, cfg.gpt.n_head, cfg.gpt.n_positions, vocab_size, seed)
    limit = context_length(pretrained)
    if limit is not None and cfg.block_size > limit:
        raise ValueError(f"block_size {cfg.block_size} exceeds the model's context length {limit} — "
                         f"use --set block_size={limit} or less")
    embedding_rows = pretrained.get_input_embeddings().weight.shape[0]
    if vocab_size > embedding_rows:
        raise ValueError(f"the tokenizer has {vocab_size} tokens but the model embeds only {embedding_rows} — "
                         "save the matching tokenizer next to the model")
    return pretrained


def next_token_loss(model, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of windows (batch, block_size+1): inputs are all but
    the last token, targets all but the first."""
    logits = model(input_ids=windows[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), windows[:, 1:].reshape(-1))


def uniform_loss(vocab_size: int) -> float:
    """ln V: the loss of a model that has learnt nothing, and what a diverged run counts as."""
    return math.log(vocab_size)
