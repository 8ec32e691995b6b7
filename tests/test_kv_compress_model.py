"""kv-compress model side: our prefill and ragged-cache decoding reproduce HF's own forward
(Llama and Qwen3 with GQA), positions after eviction are absolute, memory follows the budget,
and the word-level tokenizer round-trips."""
from __future__ import annotations

import pytest
import torch

from icml.methods.kv_compress import compress as kv
from icml.methods.kv_compress.data import VOCAB, build_tokenizer
from icml.methods.kv_compress.model import RaggedCache, extend, prefill


def _llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
                         attn_implementation="eager")
    return LlamaForCausalLM(config).eval()


def _qwen3(seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=128,
                         attn_implementation="eager")
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial q_norm / k_norm weights, so skipping them would show
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return model


def _keep_all(state):
    L, n_kv, _ = state.shape
    return [[torch.arange(state.n) for _ in range(n_kv)] for _ in range(L)]


@pytest.mark.parametrize("build", [_llama, _qwen3])
def test_prefill_and_keep_all_decoding_match_hf(build):
    model = build()
    ids = torch.randint(0, 50, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(ids[None]).logits[0]
    state = prefill(model, ids[:30], window=8, with_logits=True)
    torch.testing.assert_close(state.logits, reference[:30], atol=1e-5, rtol=1e-5)
    cache = RaggedCache.from_prefill(state, _keep_all(state))
    logits, cache = extend(model, cache, ids[30:33])  # a chunk, then single decoding steps
    pieces = [logits]
    for t in range(33, 40):
        logits, cache = extend(model, cache, ids[t:t + 1])
        pieces.append(logits)
    torch.testing.assert_close(torch.cat(pieces), reference[30:], atol=1e-5, rtol=1e-5)
    assert cache.next_position == 40 and cache.lengths(0) == [40, 40]


def test_keep_all_greedy_generation_matches_hf_generate():
    model = _llama(3)
    ids = torch.randint(0, 50, (25,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        generated = model.generate(ids[None], max_new_tokens=6, do_sample=False, pad_token_id=0)[0, 25:]
    state = prefill(model, ids[:-1], window=4)
    logits, cache = extend(model, RaggedCache.from_prefill(state, _keep_all(state)), ids[-1:])
    ours = []
    for _ in range(6):
        ours.append(int(logits[-1].argmax()))
        logits, cache = extend(model, cache, torch.tensor(ours[-1:]))
    assert ours == generated.tolist()


def test_evicted_cache_equals_hf_attention_restricted_to_kept_keys():
    """Decoding through a ragged cache = HF's forward where the new token may only see the kept
    keys (an explicit 4-D mask) at unchanged absolute positions: eviction does not shift RoPE."""
    model = _llama(4)
    ids = torch.randint(0, 50, (31,), generator=torch.Generator().manual_seed(5))
    kept_positions = sorted(set(range(0, 24, 3)) | set(range(24, 30)))
    mask = torch.full((31, 31), float("-inf")).triu(1)
    mask[30] = float("-inf")
    mask[30, kept_positions + [30]] = 0
    with torch.no_grad():
        reference = model(ids[None], attention_mask=mask[None, None]).logits[0, 30]
    state = prefill(model, ids[:30], window=6)
    cache = RaggedCache.from_prefill(state, [[torch.tensor(kept_positions)] * 2] * 2)
    logits, _ = extend(model, cache, ids[30:])
    torch.testing.assert_close(logits[0], reference, atol=1e-5, rtol=1e-5)
    full_logits, _ = extend(model, RaggedCache.from_prefill(state, _keep_all(state)), ids[30:])
    assert (logits - full_logits).abs().max() > 1e-3  # eviction does change the output


def test_memory_shrinks_with_budget_and_counts_only_kept_entries():
    model = _llama()
    ids = torch.randint(0, 50, (60,), generator=torch.Generator().manual_seed(0))
    state = prefill(model, ids, window=8)
    L, n_kv, _ = state.shape
    sizes = []
    for ratio in (0.2, 0.5, 1.0):
        budgets = kv.uniform_budgets((L, n_kv), 60, 8, ratio)
        kept = kv.select("streamingllm", None, budgets, 60, 8, 4)
        cache = RaggedCache.from_prefill(state, kept)
        entries = int((budgets + 8).sum())
        assert cache.entries() == entries
        d = state.keys[0].shape[-1]
        assert cache.memory_bytes() == 2 * entries * d * 4 + L * (n_kv + 1) * 8  # K+V float32 + offsets
        sizes.append(cache.memory_bytes())
    assert sizes[0] < sizes[1] < sizes[2]


def test_tokenizer_round_trip():
    tokenizer = build_tokenizer()
    assert len(tokenizer) == len(VOCAB) <= 100
    text = "k3 v7 ; f12 magic v0 ; count v7 ? ="
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == len(text.split()) + 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def _mistral(window):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
                           sliding_window=window, attn_implementation="eager")
    return MistralForCausalLM(config).eval()


def _qwen2_sliding(window):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
                         use_sliding_window=True, sliding_window=window, max_window_layers=1,
                         attn_implementation="eager")
    return Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("build", [_mistral, _qwen2_sliding])
def test_sliding_window_checkpoints_are_exact_within_the_window_and_refused_beyond(build):
    """Within W positions the window never binds and our forward is HF's own; past W it would
    differ (the defect: 0.13 on Mistral at 150 tokens), so such examples are refused in one line."""
    from icml.cli.errors import UsageError
    from icml.methods.kv_compress.config import preset
    from icml.methods.kv_compress.data import Example
    from icml.methods.kv_compress.evaluation import check_lengths
    from icml.methods.kv_compress.model import sliding_window

    window = 64
    model = build(window)
    assert sliding_window(model.config) == window
    ids = torch.randint(0, 50, (150,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        inside = model(ids[None, :window]).logits[0]
        beyond = model(ids[None]).logits[0]
    state = prefill(model, ids[:40], window=8, with_logits=True)
    cache = RaggedCache.from_prefill(state, _keep_all(state))
    logits, _ = extend(model, cache, ids[40:window])
    torch.testing.assert_close(torch.cat([state.logits, logits]), inside, atol=1e-5, rtol=1e-5)
    ours = prefill(model, ids, window=8, with_logits=True).logits
    assert float((ours[window:] - beyond[window:]).abs().max()) > 1e-3  # why longer ones are refused

    tokenizer = build_tokenizer()
    cfg = preset("smoke")
    short = Example("qa", 0, " ".join(["k1"] * 40), "? k1 =", "v1", line=3)
    long = Example("qa", 1, " ".join(["k1"] * 140), "? k1 =", "v1", line=4)  # <bos> + 140 + 3, teacher-forced
    check_lengths(tokenizer, [short], cfg, model, "--data 'qa.jsonl'", agnostic=False)
    with pytest.raises(UsageError, match="line 4 needs 144 positions.*last 64 keys"):
        check_lengths(tokenizer, [short, long], cfg, model, "--data 'qa.jsonl'", agnostic=False)
    assert sliding_window(_llama().config) is None


def test_a_prompt_within_the_observation_window_is_refused_by_line():
    from icml.cli.errors import UsageError
    from icml.methods.kv_compress.config import preset
    from icml.methods.kv_compress.data import Example
    from icml.methods.kv_compress.evaluation import check_lengths

    cfg = preset("smoke")  # window 16
    tokenizer = build_tokenizer()
    # <bos> + 13 words + "? k1 =" minus its last token: a 16-token prefill, none left to select
    tight = Example("qa", 0, " ".join(["k1"] * 13), "? k1 =", "v1", line=7)
    with pytest.raises(UsageError, match=r"line 7 has a 16-token prefill .* observation window \(16\)") as error:
        check_lengths(tokenizer, [tight], cfg, _llama(), "--data 'qa.jsonl'", agnostic=False)
    assert "at least 17" in error.value.fix
    roomy = Example("qa", 0, " ".join(["k1"] * 14), "? k1 =", "v1", line=7)
    check_lengths(tokenizer, [roomy], cfg, _llama(), "--data 'qa.jsonl'", agnostic=False)


def test_blockwise_prefill_equals_one_block():
    """The prefill attends a block of queries at a time (no [heads, N, N] tensor at LongBench lengths): blocks of
    7 queries give the K/V, window queries, column sums and logits of one block over all 30 tokens."""
    model = _llama()
    ids = torch.randint(0, 50, (30,))
    whole, blocks = prefill(model, ids, 8, with_logits=True), prefill(model, ids, 8, with_logits=True, block=7)
    for a, b in ((whole.keys, blocks.keys), (whole.values, blocks.values), (whole.column_sums, blocks.column_sums),
                 (whole.window_queries, blocks.window_queries), ([whole.logits], [blocks.logits])):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
