"""EntroKV and its baselines where users run models: a transformers `Cache` whose layers hold only
the kept K/V of each KV head (ragged budgets, the memory saving kept), and an attention function
registered with transformers' `AttentionInterface`.

    cache = CompressedCache(model, "entrokv_snapkv", ratio=0.3, h_bar=0.42)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=32)

Works on any local Llama / Mistral / Qwen2 / Qwen3 checkpoint (RoPE + GQA). The prompt is prefilled
by the model's own code with SDPA; the attention function records what the compressors need —
the post-RoPE queries of the last `window` prompt tokens and, for H2O, the column sums of the
causal attention, computed in blocks of queries so that no [heads, N, N] tensor exists. The first
decoding step compresses every layer at once (EntroKV's budgets are global over layers) through the
same allocation and selection code as `icml kv-compress eval` (`evaluation.compress`), and from then
on each (sequence, KV head) keeps its own number of entries. As with kvpress, the first generated
token comes from the full prefill; every later one sees only the kept entries.

Batches of equal-length prompts are compressed per sequence (each its own budgets); left-padded
batches are refused, since padding would enter the selection. Beam search is not supported.
`model.set_attn_implementation` is switched to this function when a cache is built: for any other
cache (or none) it is plain SDPA.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from contextvars import ContextVar

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from icml.methods.kv_compress.config import KvCompressConfig, preset, validate
from icml.methods.kv_compress.evaluation import analyse, compress, variant_spec
from icml.methods.kv_compress.model import Prefill, _appended, _padded, sliding_window

ATTENTION = "icml_kv_compress"
QUERY_BLOCK = 256  # queries per block of the H2O column sums: [heads, 256, N] at a time

# The layer whose `update` ran last: the attention call that follows in the same module belongs to
# it (transformers does not hand the cache to the attention function).
_ACTIVE_LAYER: ContextVar["CompressedLayer | None"] = ContextVar("icml_kv_compress_layer", default=None)


def column_sums(query: torch.Tensor, key: torch.Tensor, scaling: float, block: int = QUERY_BLOCK) -> torch.Tensor:
    """Σ_i A[i, j] [B, Hq, N] of the causal softmax attention, a block of queries at a time."""
    B, Hq, N, _ = query.shape
    keys = key.repeat_interleave(Hq // key.shape[1], 1).transpose(-1, -2)
    sums = torch.zeros(B, Hq, N, dtype=torch.float32, device=query.device)
    positions = torch.arange(N, device=query.device)
    for start in range(0, N, block):
        end = min(N, start + block)  # a block's queries see the keys up to its last row (causal): half the work
        rows = positions[start:end]
        scores = (query[:, :, start:end] @ keys[..., :end]).float() * scaling
        scores = scores.masked_fill(positions[None, :end] > rows[:, None], float("-inf"))
        sums[..., :end] += scores.softmax(-1).sum(-2)
    return sums


class CompressedLayer(CacheLayerMixin):
    """One decoder layer's cache: the full prompt K/V until compression, then per (sequence, KV head)
    its kept entries flattened one after another (`_padded` / `_appended` of model.py)."""

    is_sliding = False
    is_croppable = False

    def __init__(self, window: int, needs_column_sums: bool, sliding: int | None = None):
        super().__init__()
        self.window, self.needs_column_sums, self.sliding = window, needs_column_sums, sliding
        self.seen = 0  # absolute positions so far: RoPE and generate's cache_position follow it
        self.full_keys = self.full_values = None  # [B, Hkv, N, d] between prefill and compression
        self.window_queries = self.sums = None
        self.scaling: float | None = None
        self.lengths: list[int] | None = None  # entries per (sequence, KV head), once compressed
        self.shape: tuple[int, int] | None = None  # (B, Hkv)

    @property
    def compressed(self) -> bool:
        return self.lengths is not None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        _ACTIVE_LAYER.set(self)
        B, H, T, d = key_states.shape
        if self.sliding is not None and self.seen + T > self.sliding:
            raise ValueError(f"position {self.seen + T} is past this checkpoint's sliding window ({self.sliding}), "
                             "which CompressedCache does not model: keep prompt + generation within it")
        self.seen += T
        if not self.compressed:
            if self.full_keys is not None:
                raise NotImplementedError("a second prefill chunk before compression: pass the whole prompt at once")
            self.full_keys, self.full_values, self.shape = key_states, value_states, (B, H)
            return key_states, value_states
        new_keys, new_values = key_states.reshape(B * H, T, d), value_states.reshape(B * H, T, d)
        keys = _padded(self.keys, self.lengths, new_keys)
        values = _padded(self.values, self.lengths, new_values)
        self.keys = _appended(self.keys, self.lengths, new_keys)
        self.values = _appended(self.values, self.lengths, new_values)
        self.step_lengths, self.lengths = self.lengths, [n + T for n in self.lengths]
        return keys, values  # [B·Hkv, longest + T, d], read by `compressed_attention`

    def record_prefill(self, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        if query.shape[2] <= self.window:
            raise ValueError(f"a {query.shape[2]}-token prompt is not longer than the observation window "
                             f"({self.window}): give a longer prompt or a smaller window")
        self.scaling = scaling
        self.window_queries = query[:, :, -self.window:].detach().clone()
        self.sums = column_sums(query, key, scaling) if self.needs_column_sums else None

    def keep(self, kept: list[list[torch.Tensor]]) -> None:
        """kept[b][h]: sorted prompt positions (sequence b, KV head h) keeps; frees the full K/V."""
        B, H = self.shape
        self.keys = torch.cat([self.full_keys[b, h, idx] for b in range(B) for h, idx in enumerate(kept[b])])
        self.values = torch.cat([self.full_values[b, h, idx] for b in range(B) for h, idx in enumerate(kept[b])])
        self.lengths = [len(idx) for b in range(B) for idx in kept[b]]
        self.full_keys = self.full_values = self.window_queries = self.sums = None

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def memory_bytes(self) -> int:
        """Bytes of the K/V tensors held (the kept entries once compressed)."""
        held = (self.keys, self.values) if self.compressed else (self.full_keys, self.full_values)
        return sum(t.numel() * t.element_size() for t in held if t is not None)


def compressed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """SDPA at prefill (recording the compressors' statistics), ragged masked attention over the
    kept entries once compressed; plain SDPA for any other cache."""
    layer = _ACTIVE_LAYER.get()
    _ACTIVE_LAYER.set(None)
    scaling = module.scaling if scaling is None else scaling
    if layer is None or (not layer.compressed and layer.full_keys is not key):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if not layer.compressed:
        N = query.shape[2]
        if attention_mask is not None and not bool(attention_mask[..., -N:].to(torch.bool).equal(
                torch.ones(N, N, dtype=torch.bool, device=query.device).tril().expand_as(attention_mask[..., -N:]))):
            # generate() infers a mask from pad_token_id when the prompt holds that token, and chat templates
            # do (SmolLM2: pad = <|im_end|>), so a single prompt can arrive "padded" in its middle
            raise ValueError("CompressedCache: the attention mask hides prompt tokens (generate() masks every "
                             "pad_token_id it finds, and chat templates contain it) — pass "
                             "attention_mask=torch.ones_like(input_ids) for unpadded prompts, and batch prompts "
                             "of equal length only")
        layer.record_prefill(query, key, scaling)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    B, Hq, T, d = query.shape
    flat_heads, slots = key.shape[0], key.shape[1]
    group = Hq * B // flat_heads
    lengths = torch.tensor(layer.step_lengths, device=query.device)
    longest = slots - T
    slot = torch.arange(slots, device=query.device)
    new_row = torch.arange(T, device=query.device)
    valid = (slot[None, None, :] < lengths[:, None, None]) | \
        ((slot[None, None, :] >= longest) & (slot[None, None, :] - longest <= new_row[None, :, None]))
    q = query.reshape(flat_heads, group, T, d)
    scores = torch.einsum("xgtd,xld->xgtl", q, key).float() * scaling
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    out = torch.einsum("xgtl,xld->xgtd", scores.softmax(-1).to(value.dtype), value)
    return out.reshape(B, Hq, T, d).transpose(1, 2).contiguous(), None


def register() -> None:
    """Make `ATTENTION` a valid `attn_implementation` (idempotent)."""
    AttentionInterface.register(ATTENTION, compressed_attention)
    AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


class CompressedCache(Cache):
    """A KV cache that compresses the prompt with one of kv-compress's variants (`icml kv-compress
    --set variants=…` names: entrokv_snapkv, snapkv, h2o, streamingllm, pyramidkv, adakv, …) at
    budget `ratio`; `h_bar` is required by the EntroKV variants (`icml kv-compress calibrate`).
    Other settings (window, kernel, pool, alpha, scope, sinks, …) as `KvCompressConfig` keys."""

    def __init__(self, model, variant: str = "entrokv_snapkv", ratio: float = 0.3, h_bar: float | None = None,
                 config: KvCompressConfig | None = None, column_sums: bool | None = None, **settings):
        cfg = copy.deepcopy(config) if config is not None else preset("default")
        for key, value in settings.items():
            if not hasattr(cfg, key):
                raise ValueError(f"unknown kv-compress setting '{key}'")
            setattr(cfg, key, value)
        cfg.variants = [variant]
        validate(dataclasses.replace(cfg, task_set="generated"))  # the settings; a real run's arm list is eval's
        if not 0 < ratio <= 1:
            raise ValueError(f"ratio must be a budget fraction in (0, 1], not {ratio}")
        self.spec = variant_spec(variant, cfg)
        if self.spec.allocation == "entropy" and h_bar is None:
            raise ValueError(f"{variant} needs h_bar, the calibrated mean entropy: icml kv-compress calibrate")
        self.cfg, self.ratio, self.h_bar = cfg, ratio, h_bar
        self.selection = None
        self.analyses = None  # one `Analysis` per sequence, when shared with other caches of one prefill (`sharing`)
        self.compress_ms = self.compressed_bytes = None  # set by `compress`
        needs_sums = self.spec.operator == "h2o" if column_sums is None else column_sums
        super().__init__(layers=[CompressedLayer(cfg.window, needs_sums, sliding_window(model.config))
                                 for _ in range(model.config.num_hidden_layers)])
        register()
        model.set_attn_implementation(ATTENTION)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx == 0 and self.layers[0].full_keys is not None and not self.layers[0].compressed:
            self.compress()
        return self.layers[layer_idx].update(key_states, value_states)

    def prefill_state(self, b: int = 0) -> Prefill:
        """What the prefill recorded for sequence b, as the compressors read it (no copy)."""
        if self.layers[0].full_keys is None:
            raise ValueError("CompressedCache: no recorded prefill (not prefilled yet, or already compressed)")
        return Prefill(keys=[layer.full_keys[b] for layer in self.layers],
                       values=[layer.full_values[b] for layer in self.layers],
                       window_queries=[layer.window_queries[b] for layer in self.layers],
                       column_sums=[layer.sums[b] if layer.sums is not None else None for layer in self.layers],
                       scaling=self.layers[0].scaling)

    def prefill_analyses(self) -> list:
        """Window attention and entropy of each sequence's recorded prefill (`evaluation.analyse`), computed once
        and shared with every cache made from this one by `sharing`."""
        if self.analyses is None:
            self.analyses = [analyse(self.prefill_state(b), self.cfg) for b in range(self.layers[0].shape[0])]
        return self.analyses

    @classmethod
    def sharing(cls, source: "CompressedCache", model, variant: str, ratio: float, h_bar: float | None = None,
                config: KvCompressConfig | None = None) -> "CompressedCache":
        """A cache holding `source`'s recorded prefill (not yet compressed; the tensors are shared, not copied)
        that `variant` compresses at `ratio` on its first decoding step, from the same statistics (window queries,
        column sums, and the window attention and entropy of `prefill_analyses`): one prefill, many arms.
        Compression copies the kept entries, so `source` and every other cache made from it stay intact."""
        cfg = config if config is not None else source.cfg
        if source.layers[0].full_keys is None or source.layers[0].compressed:
            raise ValueError("CompressedCache.sharing: the source holds no uncompressed prefill")
        if cfg.window != source.cfg.window:
            raise ValueError(f"CompressedCache.sharing: window {cfg.window} differs from the recorded {source.cfg.window}")
        cache = cls(model, variant, ratio=ratio, h_bar=h_bar, config=cfg)
        if cache.spec.operator == "h2o" and source.layers[0].sums is None:
            raise ValueError(f"CompressedCache.sharing: {variant} needs column sums; record with column_sums=True")
        for mine, theirs in zip(cache.layers, source.layers):
            for name in ("seen", "full_keys", "full_values", "window_queries", "sums", "scaling", "shape",
                         "is_initialized"):
                setattr(mine, name, getattr(theirs, name))
            mine.device = theirs.device
        cache.analyses = source.prefill_analyses()
        return cache

    @torch.no_grad()
    def compress(self) -> None:
        """Budgets and selection per sequence over all layers, then only the kept entries stay."""
        start = time.perf_counter()
        B, _ = self.layers[0].shape
        kept_per_layer = [[None] * B for _ in self.layers]
        self.selection = []
        for b in range(B):
            state = self.prefill_state(b)
            analysis = self.analyses[b] if self.analyses is not None else analyse(state, self.cfg)
            selection = compress(state, analysis, self.spec, self.ratio, self.cfg, self.h_bar)
            self.selection.append(selection)
            for index, kept in enumerate(selection.kept):
                kept_per_layer[index][b] = kept
        for layer, kept in zip(self.layers, kept_per_layer):
            layer.keep(kept)
        self.compress_ms = 1000 * (time.perf_counter() - start)
        self.compressed_bytes = self.memory_bytes()

    def memory_bytes(self) -> int:
        return sum(layer.memory_bytes() for layer in self.layers)

    def kept_lengths(self, layer_idx: int) -> list[int]:
        return list(self.layers[layer_idx].lengths)
