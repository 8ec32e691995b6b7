"""The policy: the spec's tiny Llama or a local checkpoint, batched sampling with a KV cache, and
the log-probabilities of completions.

Prompts are left-padded so that every prompt ends at the same column and generation appends
columns; positions come from the attention mask, so padding never shifts a token's position.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from icml.methods.rl_sgd.config import SUPPORTED_FAMILIES


def tiny_llama(vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
               max_position: int, special_ids: dict[str, int], init_seed: int):
    """The spec's LlamaConfig model (untied head, fp32). Weights depend on `init_seed` only."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate,
                         max_position_embeddings=max_position, tie_word_embeddings=False, **special_ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed)
        model = LlamaForCausalLM(config)
    return model.float()


def load_policy(path: str | Path):
    """(model, tokenizer) of a --model checkpoint (directory, .gguf file or short name) of
    SUPPORTED_FAMILIES, fp32 master weights, through the shared checkpoint path; never the network."""
    from icml.cli import checkpoints

    checkpoints.check(str(path), SUPPORTED_FAMILIES, "rl-sgd")
    model, tokenizer = checkpoints.load_causal_lm(str(path))
    if tokenizer.eos_token_id is None:
        raise ValueError(f"model '{path}': its tokenizer has no eos token — completions could never end")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.float(), tokenizer


@dataclass
class Prompts:
    """A left-padded batch of prompts."""

    ids: torch.Tensor  # [B, L] int64
    mask: torch.Tensor  # [B, L] 1 for real tokens


def encode_prompts(tokenizer, texts: list[str], use_chat_template: bool = False) -> Prompts:
    if use_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("use_chat_template=true but the tokenizer has no chat template — "
                             "drop the option or use a chat model")
        encoded = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                 tokenize=True) for t in texts]
        encoded = [e["input_ids"] if isinstance(e, dict) or hasattr(e, "keys") else list(e) for e in encoded]
    else:
        encoded = tokenizer(texts)["input_ids"]
    width = max(len(e) for e in encoded)
    ids = torch.full((len(encoded), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, tokens in enumerate(encoded):
        ids[row, width - len(tokens):] = torch.tensor(tokens, dtype=torch.long)
        mask[row, width - len(tokens):] = 1
    return Prompts(ids, mask)


def _at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 logits in fp32 for the softmax; fp32 and fp64 stay as they are."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def generate(model, prompts: Prompts, max_new_tokens: int, eos_id: int, pad_id: int, *,
             temperature: float = 1.0, greedy: bool = False, generator: torch.Generator | None = None):
    """Sample (or take the argmax of) up to `max_new_tokens` per prompt with a KV cache.

    Returns (tokens [B, T], completion_mask [B, T]): the mask covers each completion up to and
    including its first <eos>; later columns hold <pad>. Sampling is pure (no top-k/top-p) at
    `temperature`, from `generator`, so a seeded generator reproduces the rollouts exactly.
    """
    device = next(model.parameters()).device
    ids, mask = prompts.ids.to(device), prompts.mask.to(device)
    batch = ids.shape[0]
    out = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=True, logits_to_keep=1)
    cache, logits = out.cache, out.logits[:, -1]
    tokens = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)
    live = torch.ones(batch, dtype=torch.bool, device=device)
    completion_mask = torch.zeros((batch, max_new_tokens), dtype=torch.long, device=device)
    position = _positions(mask)[:, -1]
    for t in range(max_new_tokens):
        if greedy:
            token = logits.argmax(-1)
        else:
            probs = torch.softmax(_at_least_fp32(logits) / temperature, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        token = torch.where(live, token, torch.full_like(token, pad_id))
        tokens[:, t] = token
        completion_mask[:, t] = live.long()
        live = live & (token != eos_id)
        if t == max_new_tokens - 1 or not live.any():
            break
        mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=device)], dim=1)
        position = position + 1
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=position[:, None],
                    cache=cache, use_cache=True)
        cache, logits = out.cache, out.logits[:, -1]
    return tokens, completion_mask


def completion_logprobs(model, prompts: Prompts, tokens: torch.Tensor, completion_mask: torch.Tensor,
                        temperature: float = 1.0) -> torch.Tensor:
    """log π(o_t | prompt, o_<t) of every completion token, [B, T] (zeros where the mask is 0).
    The logits are divided by `temperature`, the distribution the tokens were sampled from."""
    device = next(model.parameters()).device
    ids = torch.cat([prompts.ids.to(device), tokens], dim=1)
    mask = torch.cat([prompts.mask.to(device), completion_mask], dim=1)
    width = prompts.ids.shape[1]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits
    logits = _at_least_fp32(logits[:, width - 1:-1]) / temperature  # position t predicts completion token t
    logp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
    return logp * completion_mask


def decode_completions(tokenizer, tokens: torch.Tensor, completion_mask: torch.Tensor, eos_id: int) -> list[str]:
    """The text of each completion before its <eos>."""
    texts = []
    for row, keep in zip(tokens.tolist(), completion_mask.tolist()):
        ids = [t for t, k in zip(row, keep) if k and t != eos_id]
        texts.append(tokenizer.decode(ids, skip_special_tokens=True))
    return texts


def sft_batch(tokenizer, prompts: list[str], answers: list[str], use_chat_template: bool = False):
    """(Prompts, answer tokens [B, T], answer mask [B, T]): gold completions `answer <eos>`, right-padded."""
    encoded = encode_prompts(tokenizer, prompts, use_chat_template)
    answer_ids = [tokenizer(" " + a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                  for a in answers]
    width = max(len(a) for a in answer_ids)
    tokens = torch.full((len(answers), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(answers), width), dtype=torch.long)
    for row, ids in enumerate(answer_ids):
        tokens[row, :len(ids)] = torch.tensor(ids)
        mask[row, :len(ids)] = 1
    return encoded, tokens, mask
