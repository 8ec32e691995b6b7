"""CompressedCache + the registered attention function: EntroKV and the baselines inside
`model.generate()`. The hand-written decode path of model.py (itself pinned against transformers'
forward) is the reference: the same kept positions, the same next-token logits, the same greedy
tokens; the memory held is that of the kept entries only."""
from __future__ import annotations

import pytest
import torch

from icml.methods.kv_compress.config import preset
from icml.methods.kv_compress.evaluation import analyse, compress, variant_spec
from icml.methods.kv_compress.hf_cache import ATTENTION, CompressedCache, column_sums
from icml.methods.kv_compress.model import RaggedCache, extend, prefill

VARIANTS = ["entrokv_snapkv", "snapkv", "h2o", "streamingllm", "pyramidkv", "adakv", "entrokv_h2o"]
H_BAR, RATIO, N = 0.4, 0.3, 80


def sharpened(model):
    """Sharper attention than at init, so that heads' entropies and budgets differ; no EOS, so
    generate() runs its full length like the reference loop."""
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    return model.eval()


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return sharpened(LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2,
                                                  intermediate_size=64, max_position_embeddings=256)))


def qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return sharpened(Qwen3ForCausalLM(Qwen3Config(vocab_size=50, hidden_size=32, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                                  intermediate_size=64, max_position_embeddings=256)))


def qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return sharpened(Qwen2ForCausalLM(Qwen2Config(vocab_size=50, hidden_size=32, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2,
                                                  intermediate_size=64, max_position_embeddings=256)))


def prompt(seed=1, batch=1):
    return torch.randint(3, 50, (batch, N), generator=torch.Generator().manual_seed(seed))


def reference_selection(model, ids, variant, ratio=RATIO):
    cfg = preset("default")
    state = prefill(model, ids, cfg.window, with_logits=True)
    return state, compress(state, analyse(state, cfg), variant_spec(variant, cfg), ratio, cfg, H_BAR)


@pytest.mark.parametrize("build", [llama, qwen2, qwen3])
@pytest.mark.parametrize("variant", VARIANTS)
def test_kept_positions_logits_and_memory_equal_the_reference_path(build, variant):
    model = build()
    ids = prompt()
    cache = CompressedCache(model, variant, ratio=RATIO, h_bar=H_BAR)
    with torch.no_grad():
        first = model(ids, past_key_values=cache).logits[0, -1]
        token = first.argmax()[None]
        step = model(token[None], past_key_values=cache).logits[0, -1]
    state, selection = reference_selection(model, ids[0], variant)
    torch.testing.assert_close(first, state.logits[-1], atol=1e-5, rtol=1e-5)  # SDPA prefill = reference
    for ours, theirs in zip(cache.selection[0].kept, selection.kept):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    logits, _ = extend(model, RaggedCache.from_prefill(state, selection.kept), token)
    torch.testing.assert_close(step, logits[0], atol=1e-5, rtol=1e-5)
    kept = sum(len(idx) for layer in selection.kept for idx in layer) + 2 * 2  # + the decoded token per head
    assert cache.memory_bytes() == 2 * kept * 8 * 4  # K and V, head_dim 8, float32: kept entries only
    assert cache.get_seq_length() == N + 1


def test_generate_is_the_reference_greedy_decode_and_full_budget_is_plain_generate():
    model = llama()
    ids = prompt()
    ones = torch.ones_like(ids)
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=ones, past_key_values=CompressedCache(
            model, "entrokv_snapkv", ratio=RATIO, h_bar=H_BAR), max_new_tokens=8, do_sample=False)[0, N:]
    state, selection = reference_selection(model, ids[0], "entrokv_snapkv")
    tokens = [int(state.logits[-1].argmax())]
    cache = RaggedCache.from_prefill(state, selection.kept)
    for _ in range(7):
        logits, cache = extend(model, cache, torch.tensor(tokens[-1:]))
        tokens.append(int(logits[-1].argmax()))
    assert generated.tolist() == tokens

    with torch.no_grad():
        full = model.generate(ids, attention_mask=ones, past_key_values=CompressedCache(model, "full", ratio=1.0),
                              max_new_tokens=8, do_sample=False)[0, N:]
        model.set_attn_implementation("sdpa")
        plain = model.generate(ids, attention_mask=ones, max_new_tokens=8, do_sample=False)[0, N:]
    assert full.tolist() == plain.tolist()


def test_a_batch_compresses_each_sequence_on_its_own():
    model = llama()
    ids = torch.cat([prompt(1), prompt(2)])
    with torch.no_grad():
        batched = CompressedCache(model, "entrokv_snapkv", ratio=RATIO, h_bar=H_BAR)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=batched,
                             max_new_tokens=5, do_sample=False)[:, N:]
        for row in range(2):
            single = CompressedCache(model, "entrokv_snapkv", ratio=RATIO, h_bar=H_BAR)
            alone = model.generate(ids[row:row + 1], attention_mask=torch.ones_like(ids[row:row + 1]),
                                   past_key_values=single, max_new_tokens=5, do_sample=False)[0, N:]
            assert out[row].tolist() == alone.tolist()
            for a, b in zip(batched.selection[row].kept, single.selection[0].kept):
                assert all(torch.equal(x, y) for x, y in zip(a, b))
    first, second = batched.selection[0].kept[0][0], batched.selection[1].kept[0][0]
    assert not torch.equal(first, second)  # each sequence kept its own positions


def test_blockwise_column_sums_equal_the_dense_prefill():
    model = llama()
    ids = prompt()[0]
    state = prefill(model, ids, 16)
    attn = model.model.layers[0].self_attn
    from icml.methods.kv_compress.model import project, rope

    hidden = model.model.embed_tokens(ids)
    cos, sin = rope(model, hidden, torch.arange(N))
    with torch.no_grad():
        q, k, _ = project(attn, model.model.layers[0].input_layernorm(hidden), cos, sin)
    sums = column_sums(q[None], k[None], attn.scaling, block=7)[0]  # 7 does not divide 80
    torch.testing.assert_close(sums, state.column_sums[0], atol=1e-5, rtol=1e-5)


def test_bad_uses_are_refused_in_one_line():
    model = llama()
    with pytest.raises(ValueError, match="needs h_bar"):
        CompressedCache(model, "entrokv_snapkv")
    with pytest.raises(ValueError, match="unknown kv-compress setting 'windw'"):
        CompressedCache(model, "snapkv", windw=8)
    with pytest.raises(ValueError, match="ratio must be"):
        CompressedCache(model, "snapkv", ratio=0.0)
    ids = prompt(batch=2)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    with pytest.raises(ValueError, match="hides prompt tokens"), torch.no_grad():
        model.generate(ids, attention_mask=mask, past_key_values=CompressedCache(model, "snapkv"), max_new_tokens=2)
    with pytest.raises(ValueError, match="not longer than the observation window"), torch.no_grad():
        model(prompt()[:, :10], past_key_values=CompressedCache(model, "snapkv"))
    assert model.config._attn_implementation == ATTENTION
    with torch.no_grad():  # with any other cache the registered function is plain SDPA
        ours = model(prompt()).logits
        model.set_attn_implementation("sdpa")
        torch.testing.assert_close(ours, model(prompt()).logits, atol=1e-6, rtol=1e-6)


def test_past_a_sliding_window_is_refused():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                             sliding_window=84)).eval()
    cache = CompressedCache(model, "snapkv")
    with torch.no_grad():
        out = model.generate(prompt(), attention_mask=torch.ones(1, N, dtype=torch.long), past_key_values=cache,
                             max_new_tokens=4, do_sample=False)  # 84 positions: inside the window
        assert out.shape[1] == N + 4
        with pytest.raises(ValueError, match="past this checkpoint's sliding window"):
            model.generate(prompt(), attention_mask=torch.ones(1, N, dtype=torch.long),
                           past_key_values=CompressedCache(model, "snapkv"), max_new_tokens=6, do_sample=False)
