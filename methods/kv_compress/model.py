"""The language model side: the tiny Llama, loading a real checkpoint, and our own forward
passes over the decoder layers — a full prefill that exposes post-RoPE Q/K and attention, and
decoding steps through a genuinely compressed, ragged per-head KV cache.

Works for HF Llama, Mistral, Qwen2 and Qwen3 (RoPE + GQA; Qwen3's q_norm/k_norm before RoPE).
Batch 1 throughout: heads keep different numbers of entries.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from icml.methods.kv_compress.config import SUPPORTED_FAMILIES

PREFILL_BLOCK = 512  # queries per block of the prefill's attention: [heads, 512, ≤ N] scores at a time



def quiet_transformers() -> None:
    """No transformers progress bars: the CLI's own progress (and --quiet) governs what is shown."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def tiny_model(cfg, vocab_size: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    quiet_transformers()

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=cfg.tiny.hidden, num_hidden_layers=cfg.tiny.layers,
                         num_attention_heads=cfg.tiny.heads, num_key_value_heads=cfg.tiny.kv_heads,
                         intermediate_size=cfg.tiny.intermediate, max_position_embeddings=cfg.tiny.max_position,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                         initializer_range=cfg.tiny.init_std)
    config._attn_implementation = "sdpa"  # training speed; evaluation uses the forward below
    return LlamaForCausalLM(config)


def load_checkpoint(path: str | Path):
    """(model, tokenizer) of a causal LM of SUPPORTED_FAMILIES (a directory, a .gguf file or a short
    name), eager attention, eval mode."""
    from icml.cli import checkpoints

    checkpoints.check(str(path), SUPPORTED_FAMILIES, "kv-compress")
    return checkpoints.load_causal_lm(str(path), attn_implementation="eager")


def sliding_window(config) -> int | None:
    """W of a checkpoint whose layers (some or all) attend to their last W keys only, else None.

    Mistral slides in every layer once `sliding_window` is set; Qwen2/Qwen3 list the sliding
    layers in `layer_types` (from `use_sliding_window` and `max_window_layers`)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


# ---------------------------------------------------------------------------------------------
# The pieces of a decoder layer
# ---------------------------------------------------------------------------------------------
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(model, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, d] for explicit absolute positions (never derived from a cache length)."""
    cos, sin = model.model.rotary_emb(hidden[None], positions[None])
    return cos[0], sin[0]


def project(attn, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Post-RoPE q [Hq, T, d], k [Hkv, T, d] and v [Hkv, T, d] of one attention module."""
    T = hidden.shape[0]
    d = attn.head_dim
    q = attn.q_proj(hidden).view(T, -1, d)
    k = attn.k_proj(hidden).view(T, -1, d)
    v = attn.v_proj(hidden).view(T, -1, d).transpose(0, 1)
    if hasattr(attn, "q_norm"):  # Qwen3 normalises q and k per head before the rotation
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(0, 1), k.transpose(0, 1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v


def _mlp_block(layer, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    hidden = hidden + layer.self_attn.o_proj(attn_out)
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def _logits(model, hidden: torch.Tensor) -> torch.Tensor:
    return model.lm_head(model.model.norm(hidden)).float()


# ---------------------------------------------------------------------------------------------
# Full prefill
# ---------------------------------------------------------------------------------------------
@dataclass
class Prefill:
    """What a full prefill of N prompt tokens leaves for the compressors, per layer."""

    keys: list[torch.Tensor]  # [Hkv, N, d], post-RoPE
    values: list[torch.Tensor]  # [Hkv, N, d]
    window_queries: list[torch.Tensor]  # [Hq, w, d], post-RoPE queries of the last w tokens
    column_sums: list[torch.Tensor]  # [Hq, N]: Σ_i A[i, j] of the causal prefill attention (H2O)
    scaling: float
    logits: torch.Tensor | None = None  # [N, V] when asked for

    @property
    def n(self) -> int:
        return self.keys[0].shape[1]

    @property
    def shape(self) -> tuple[int, int, int]:
        """(layers, KV heads, query heads)."""
        return len(self.keys), self.keys[0].shape[0], self.window_queries[0].shape[0]


@torch.no_grad()
def prefill(model, ids: torch.Tensor, window: int, with_logits: bool = False, block: int = PREFILL_BLOCK) -> Prefill:
    """Causal attention a block of `block` queries at a time (each against the keys up to its last row):
    the statistics the compressors need (window queries, column sums) without any [heads, N, N] tensor,
    so that LongBench-length prompts fit (README, paper preset)."""
    N = ids.shape[0]
    positions = torch.arange(N, device=ids.device)
    hidden = model.model.embed_tokens(ids)
    cos, sin = rope(model, hidden, positions)
    keys, values, queries, sums = [], [], [], []
    for layer in model.model.layers:
        attn = layer.self_attn
        q, k, v = project(attn, layer.input_layernorm(hidden), cos, sin)
        group = q.shape[0] // k.shape[0]
        k_all, v_all = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        out = q.new_empty(N, q.shape[0] * q.shape[2])
        column_sums = torch.zeros(q.shape[0], N, dtype=torch.float32, device=ids.device)
        for start in range(0, N, block):
            end = min(N, start + block)
            scores = (q[:, start:end] @ k_all[:, :end].transpose(1, 2)).float() * attn.scaling
            scores = scores.masked_fill(positions[None, :end] > positions[start:end, None], float("-inf"))
            probs = scores.softmax(-1)
            out[start:end] = (probs.to(v.dtype) @ v_all[:, :end]).transpose(0, 1).reshape(end - start, -1)
            column_sums[:, :end] += probs.sum(1)
            del scores, probs
        del k_all, v_all
        hidden = _mlp_block(layer, hidden, out)
        keys.append(k)
        values.append(v)
        queries.append(q[:, N - window:].clone())  # a copy: a view would keep all N queries alive
        sums.append(column_sums)
    logits = _logits(model, hidden) if with_logits else None
    return Prefill(keys, values, queries, sums, float(model.model.layers[0].self_attn.scaling), logits)


# ---------------------------------------------------------------------------------------------
# The compressed cache
# ---------------------------------------------------------------------------------------------
@dataclass
class RaggedCache:
    """Per layer, the kept K/V of all KV heads flattened head after head, with offsets:
    head h of layer l holds keys[l][offsets[l][h]:offsets[l][h+1]]. Only kept entries exist."""

    keys: list[torch.Tensor]  # [Σ_h n_h, d]
    values: list[torch.Tensor]
    offsets: list[torch.Tensor]  # int64 [Hkv + 1]
    next_position: int  # absolute position of the next token: N + t
    sizes: list[list[int]]  # sizes[l][h] = entries of head h of layer l (the offsets' differences, on the host:
    # reading them off the device would cost a sync per layer and decoding step)

    @classmethod
    def from_prefill(cls, state: Prefill, kept: list[list[torch.Tensor]]) -> "RaggedCache":
        """kept[l][h]: sorted positions that KV head h of layer l keeps. Gathering copies them into
        fresh tensors, so the prefill's full K/V can be freed."""
        keys, values, offsets = [], [], []
        for k, v, heads in zip(state.keys, state.values, kept):
            keys.append(torch.cat([k[h, idx] for h, idx in enumerate(heads)]))
            values.append(torch.cat([v[h, idx] for h, idx in enumerate(heads)]))
            lengths = torch.tensor([0] + [len(idx) for idx in heads], device=k.device)
            offsets.append(lengths.cumsum(0))
        return cls(keys, values, offsets, state.n, [[len(idx) for idx in heads] for heads in kept])

    def lengths(self, layer: int) -> list[int]:
        return list(self.sizes[layer])

    def entries(self) -> int:
        return sum(sum(sizes) for sizes in self.sizes)

    def memory_bytes(self) -> int:
        tensors = self.keys + self.values + self.offsets
        return sum(t.numel() * t.element_size() for t in tensors)


def _padded(flat: torch.Tensor, lengths: list[int], new: torch.Tensor) -> torch.Tensor:
    """[Hkv, max_len + T, d]: each head's entries, zero padding, then the T new entries."""
    H, T, d = new.shape
    longest = max(lengths)
    out = flat.new_zeros(H, longest + T, d)
    for h, seg in enumerate(flat.split(lengths)):
        out[h, :len(seg)] = seg
    out[:, longest:] = new
    return out


def _appended(flat: torch.Tensor, lengths: list[int], new: torch.Tensor) -> torch.Tensor:
    return torch.cat([part for h, seg in enumerate(flat.split(lengths)) for part in (seg, new[h])])


@torch.no_grad()
def extend(model, cache: RaggedCache, ids: torch.Tensor) -> tuple[torch.Tensor, RaggedCache]:
    """Run T tokens at absolute positions next_position … +T−1 through the compressed cache.
    Returns their logits [T, V] and the cache with their K/V appended to every head."""
    T = ids.shape[0]
    positions = torch.arange(cache.next_position, cache.next_position + T, device=ids.device)
    hidden = model.model.embed_tokens(ids)
    cos, sin = rope(model, hidden, positions)
    new_keys, new_values, new_offsets = [], [], []
    for layer_index, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        q, k, v = project(attn, layer.input_layernorm(hidden), cos, sin)
        lengths = cache.lengths(layer_index)
        group = q.shape[0] // k.shape[0]
        K = _padded(cache.keys[layer_index], lengths, k)
        V = _padded(cache.values[layer_index], lengths, v)
        longest = max(lengths)
        slot = torch.arange(longest + T, device=ids.device)
        # a transient key mask: padding is invalid, new tokens see themselves and earlier new tokens
        valid = slot[None, None, :] < torch.tensor(lengths, device=ids.device)[:, None, None]
        valid = valid | ((slot[None, :] >= longest) & (slot[None, :] - longest <= torch.arange(T, device=ids.device)[:, None]))[None]
        scores = (q @ K.repeat_interleave(group, 0).transpose(1, 2)).float() * attn.scaling
        scores = scores.masked_fill(~valid.repeat_interleave(group, 0), float("-inf"))
        out = (scores.softmax(-1).to(V.dtype) @ V.repeat_interleave(group, 0)).transpose(0, 1).reshape(T, -1)
        hidden = _mlp_block(layer, hidden, out)
        new_keys.append(_appended(cache.keys[layer_index], lengths, k))
        new_values.append(_appended(cache.values[layer_index], lengths, v))
        new_offsets.append(cache.offsets[layer_index] + torch.arange(k.shape[0] + 1, device=ids.device) * T)
    return _logits(model, hidden), RaggedCache(new_keys, new_values, new_offsets, cache.next_position + T,
                                               [[n + T for n in sizes] for sizes in cache.sizes])
