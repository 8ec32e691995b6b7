"""`make bench` hook of kv-compress: memory held and selection overhead of EntroKV+SnapKV at a
30% budget on the tiny Llama (random weights: cost does not depend on training), against the
full cache and a plain full prefill of the same prompts; and `model.generate()` through
`CompressedCache` against transformers' own DynamicCache (tokens/s and bytes held)."""
from __future__ import annotations

import random
import statistics
import time

RATIO = 0.3


def bench(out_rows: list[dict], n_prompts: int = 6, repeats: int = 3) -> list[dict]:
    """Append two rows (bench, seconds, baseline, baseline_seconds, ratio) to `out_rows`:
    kv_compress/memory@r=0.3 (ratio = compressed / full cache bytes) and
    kv_compress/overhead@r=0.3 (entropy + allocation + selection + gather / full prefill time)."""
    import torch

    from icml.cli.threads import single_thread
    from icml.methods.kv_compress.config import TASKS, preset
    from icml.methods.kv_compress.data import build_tokenizer, generate
    from icml.methods.kv_compress.evaluation import analyse, compress, split, variant_spec
    from icml.methods.kv_compress.model import RaggedCache, prefill, tiny_model

    cfg = preset("default")
    tokenizer = build_tokenizer()
    model = tiny_model(cfg, len(tokenizer), 0).eval()
    spec = variant_spec("entrokv_snapkv", cfg)
    rng = random.Random(0)
    prompts = [split(tokenizer, generate(TASKS[i % 3], i, rng, cfg.context_max, cfg.context_max), True, "cpu").prefix
               for i in range(n_prompts)]
    prefill_s, overhead_s, compressed, full = [], [], 0, 0
    with single_thread():
        for ids in prompts:
            for _ in range(repeats):
                start = time.perf_counter()
                state = prefill(model, ids, cfg.window)
                prefill_s.append(time.perf_counter() - start)
                start = time.perf_counter()
                selection = compress(state, analyse(state, cfg), spec, RATIO, cfg, 0.3)
                cache = RaggedCache.from_prefill(state, selection.kept)
                overhead_s.append(time.perf_counter() - start)
            L, n_kv, _ = state.shape
            compressed += cache.memory_bytes()
            full += RaggedCache.from_prefill(state, [[torch.arange(state.n)] * n_kv] * L).memory_bytes()
    overhead, base = statistics.median(overhead_s), statistics.median(prefill_s)
    out_rows.append({"bench": f"kv_compress/memory@r={RATIO}", "seconds": float("nan"),
                     "baseline": "full KV cache (bytes)", "baseline_seconds": float("nan"), "ratio": compressed / full})
    out_rows.append({"bench": f"kv_compress/overhead@r={RATIO}", "seconds": overhead,
                     "baseline": f"full prefill (tiny Llama, N={len(prompts[0])})", "baseline_seconds": base, "ratio": overhead / base})
    generate_rows(out_rows, model, prompts[0][None], repeats)
    return out_rows


def generate_rows(out_rows: list[dict], model, ids, repeats: int, new_tokens: int = 64) -> None:
    """kv_compress/generate_time@r=0.3 (seconds per generate call, ratio to DynamicCache: 1/tokens-per-s
    ratio) and kv_compress/generate_memory@r=0.3 (bytes held after generation, ratio to DynamicCache)."""
    import torch
    from transformers import DynamicCache

    from icml.cli.threads import single_thread
    from icml.methods.kv_compress.hf_cache import CompressedCache

    model.generation_config.eos_token_id = None  # always the full `new_tokens`
    mask = torch.ones_like(ids)

    def run(make_cache):
        times, cache = [], None
        for _ in range(repeats):
            cache = make_cache()
            start = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens,
                               do_sample=False)
            times.append(time.perf_counter() - start)
        return statistics.median(times), cache

    with single_thread():
        compressed_s, compressed = run(lambda: CompressedCache(model, "entrokv_snapkv", ratio=RATIO, h_bar=0.3))
        model.set_attn_implementation("sdpa")
        dynamic_s, dynamic = run(DynamicCache)
    dynamic_bytes = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in dynamic.layers)
    out_rows.append({"bench": f"kv_compress/generate_time@r={RATIO}", "seconds": compressed_s,
                     "baseline": f"generate() with DynamicCache (N={ids.shape[1]}, {new_tokens} new tokens)",
                     "baseline_seconds": dynamic_s, "ratio": compressed_s / dynamic_s})
    out_rows.append({"bench": f"kv_compress/generate_memory@r={RATIO}", "seconds": float("nan"),
                     "baseline": "DynamicCache K/V bytes after generate()", "baseline_seconds": float("nan"),
                     "ratio": compressed.memory_bytes() / dynamic_bytes})
