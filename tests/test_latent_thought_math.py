"""PonderLM-2's identities on a tiny float64 Llama: K = 0 is the plain model, thought slots share
their token's position id and are causal in slot order, J = K(T−1) Jacobi iterations equal cached
sequential decoding (and j iterations make exactly the first 1+⌊j/K⌋ positions exact), decoding
makes K+1 decoder calls per token, gradients flow through every pass, and the spec's init.

Float64 with sdpa attention: transformers' eager attention runs its softmax in float32 by design
(~1e-7 relative), which would hide the algorithm's float64 exactness behind the kernel's rounding;
the arms train with eager attention, as the spec's config says.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from icml.methods.latent_thought.config import TinyLlamaConfig
from icml.methods.latent_thought.model import (ThoughtLM, arm_spec, build_arm, flops_per_token, init_weights,
                                               interleave, load_arm, pass_flops, save_arm, slot_causal_mask,
                                               slot_positions, tiny_llama_config)

EPS = torch.finfo(torch.float64).eps
TINY = TinyLlamaConfig(hidden=32, layers=2, heads=2, intermediate=48)
T = 7


@pytest.fixture(autouse=True)
def float64_rms_norm(monkeypatch):
    """LlamaRMSNorm normalises in float32 whatever the input dtype; the same formula in the input's
    dtype makes the float64 checks below float64 throughout."""
    from transformers.models.llama import modeling_llama

    def forward(self, hidden):
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)


def tolerance(reference: torch.Tensor) -> float:
    """Two decoder layers, up to K(T−1)+K+1 passes, each a few dozen rounded ops per entry: 256 ulps of
    the largest logit bounds the reordering between one full pass and the single-slot cached calls."""
    return 256 * EPS * float(reference.abs().max())


def arm(name: str, seed: int = 0, **kw) -> ThoughtLM:
    model = build_arm(arm_spec(name, **kw), TINY, seed).double().eval()
    model.lm.set_attn_implementation("sdpa")
    return model


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(1))


def test_k0_unscaled_is_the_plain_llama(ids):
    model = arm("vanilla_1x", scale=False)
    with torch.no_grad():
        ours = model(ids)
        plain = model.lm(input_ids=ids).logits
        cached, _ = model.sequential(ids)
    assert torch.allclose(ours, plain, rtol=0, atol=tolerance(plain))
    assert torch.allclose(cached, plain, rtol=0, atol=tolerance(plain))


def test_slots_share_position_ids_and_the_mask_follows_slot_order():
    assert slot_positions(3, 2).tolist() == [[0, 0, 1, 1, 2, 2]]
    assert slot_positions(2, 3, offset=4).tolist() == [[4, 4, 4, 5, 5, 5]]
    mask = slot_causal_mask(3, 2, torch.float64, "cpu")[0, 0]
    assert mask.shape == (3, 5)
    assert (mask == 0).tolist() == [[True, True, True, False, False], [True] * 4 + [False], [True] * 5]
    e, z = torch.zeros(1, 2, 1), torch.ones(1, 2, 1)
    assert interleave(e, [z]).flatten().tolist() == [0, 1, 0, 1]  # a new slot, not added to the token


def test_decoder_sees_repeated_position_ids(ids):
    model = arm("ponderlm2_k2")
    seen = []
    model.lm.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["position_ids"][0].tolist()),
                                             with_kwargs=True)
    with torch.no_grad():
        model.jacobi(ids, 1)
    expected = [[t for t in range(T) for _ in range(k)] for k in (1, 2, 3, 3)]  # init k=1,2; Jacobi; final
    assert seen == expected


def test_thought_slot_is_invisible_to_its_own_token_slot(ids):
    """Perturbing slot (t,1) must not change h at (t,0) (same position id, earlier slot) but must change (t+1,0)."""
    model = arm("ponderlm2_k1")
    with torch.no_grad():
        e = model.embed(ids)
        z = torch.randn(e.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        pos = slot_positions(T, 2)
        base = model.decode(interleave(e, [z]), pos).view(2, T, 2, -1)
        z2 = z.clone()
        z2[:, 3] += 1.0
        moved = model.decode(interleave(e, [z2]), pos).view(2, T, 2, -1)
    assert torch.equal(base[:, :4, 0], moved[:, :4, 0]) and torch.equal(base[:, :3], moved[:, :3])
    assert (base[:, 4, 0] - moved[:, 4, 0]).abs().max() > 1e-3


@pytest.mark.parametrize("K", [1, 2])
def test_enough_jacobi_iterations_equal_sequential_decoding(ids, K):
    model = arm(f"ponderlm2_k{K}")
    with torch.no_grad():
        cached, z_star = model.sequential(ids)
        solve = model.jacobi(ids, K * (T - 1))
        trace = model.jacobi(ids, 4, all_iterations=True)
    assert torch.allclose(solve.logits[-1], cached, rtol=0, atol=tolerance(cached))
    # the fixed point: the final thoughts are the exact ones
    assert torch.allclose(solve.thoughts[-1], z_star, rtol=0, atol=256 * EPS * float(z_star.abs().max()))
    for j, logits in enumerate(trace.logits):
        exact = 1 + j // K  # positions t ≤ 1+⌊j/K⌋ are exact after j iterations
        diff = (logits - cached).abs().amax(dim=(0, 2))
        assert diff[:exact].max() <= tolerance(cached), (j, diff)
        assert diff[exact] > 1e3 * tolerance(cached), (j, diff)  # the next one is not yet (random weights)


def test_thoughts_are_the_raw_final_norm_state(ids):
    """z_t⁽¹⁾ = h[slot(t,0)]: the last_hidden_state itself (× thought_scale), no projection, no pre-norm state."""
    model = arm("ponderlm2_k1")
    model.thought_scale = 0.5
    with torch.no_grad():
        solve = model.jacobi(ids, 2, all_iterations=True)
        h = model.lm.model(inputs_embeds=model.embed(ids)).last_hidden_state  # the plain causal pass
    assert torch.allclose(solve.thoughts[0][:, :, 0], 0.5 * h, rtol=0, atol=tolerance(h))


def test_decoding_makes_k_plus_1_decoder_calls_per_token():
    for K in (0, 1, 2):
        model = arm("vanilla_1x" if K == 0 else f"ponderlm2_k{K}")
        calls = []
        model.lm.model.register_forward_hook(lambda m, a, out: calls.append(1))
        prompt = torch.tensor([[1, 2, 3]])
        new, info = model.generate(prompt, 5, prefill="exact")
        assert new.shape == (1, 5)
        assert len(calls) == (K + 1) * (3 + 4)  # exact prefill of 3 tokens + 4 decoded (the 5th needs no step)
        assert info["decoder_calls_per_token"] == K + 1
        assert info["cache_length"] == (K + 1) * 7  # the cache counts slots


def test_jacobi_prefill_and_exact_prefill_generate_alike(ids):
    model = arm("ponderlm2_k1")
    prompt = ids[:1, :4]
    with torch.no_grad():
        exact, _ = model.generate(prompt, 6, prefill="exact")
        jacobi, _ = model.generate(prompt, 6, prefill="jacobi", J=3)  # J = 3 ≥ K(T−1) = 3 for a 4-token prompt
    assert torch.equal(exact, jacobi)


def test_gradients_flow_through_every_pass(ids):
    """d loss / d embeddings matches a central difference only if no pass is detached; the detach
    ablation's gradient differs."""
    def loss_of(model, weight):
        model.lm.model.embed_tokens.weight.data.copy_(weight)
        return torch.nn.functional.cross_entropy(model(ids[:, :-1], 2).flatten(0, 1), ids[:, 1:].flatten())

    full, detached = arm("ponderlm2_k1"), arm("ponderlm2_k1_detach")
    weight = full.lm.model.embed_tokens.weight.detach().clone()
    direction = torch.randn(weight.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grads = []
    for model in (full, detached):
        model.lm.model.embed_tokens.weight.grad = None
        loss_of(model, weight).backward()
        grads.append(float((model.lm.model.embed_tokens.weight.grad * direction).sum()))
    # central difference along a direction of norm ~90 (an effective step ~1e-3): O(step^2) truncation
    # ~1e-7 dominates float64 rounding (eps*|loss|/step ~1e-10)
    step = 1e-5
    with torch.no_grad():
        numeric = float(loss_of(full, weight + step * direction) - loss_of(full, weight - step * direction)) / (2 * step)
    assert grads[0] == pytest.approx(numeric, abs=1e-6)
    assert abs(grads[1] - numeric) > 30 * abs(grads[0] - numeric)


def test_init_and_embedding_scale():
    lm = LlamaForCausalLM(tiny_llama_config(TinyLlamaConfig(), 4))
    init_weights(lm)
    d, sigma = 128, math.sqrt(2 / (5 * 128))
    embed = lm.model.embed_tokens.weight
    assert embed.abs().max() <= 3 * sigma
    # truncation at ±3σ keeps 97.3% of the variance: var = σ²(1 − 6φ(3)/(2Φ(3)−1))
    phi3, cdf = math.exp(-4.5) / math.sqrt(2 * math.pi), math.erf(3 / math.sqrt(2))
    expected_sd = sigma * math.sqrt(1 - 6 * phi3 / cdf)
    assert float(embed.detach().std()) == pytest.approx(expected_sd, rel=0.02)  # 32768 draws: sd of the sd ≈ 0.4%
    o_proj = lm.model.layers[0].self_attn.o_proj.weight
    assert float(o_proj.detach().std()) == pytest.approx(expected_sd / math.sqrt(8), rel=0.02)
    rms = (math.sqrt(2.5 * d) * embed.detach()).square().mean(dim=1).sqrt()
    assert float(rms.mean()) == pytest.approx(math.sqrt(1 - 6 * phi3 / cdf), rel=0.01)  # ≈ unit RMS like h


def test_flops_model_and_equal_inference_flops_of_2x():
    one, two, ponder = (build_arm(arm_spec(n), TinyLlamaConfig(), 0) for n in ("vanilla_1x", "vanilla_2x", "ponderlm2_k1"))
    f1, f2, fp = (flops_per_token(m, 128, [2, 3]) for m in (one, two, ponder))
    P = sum(p.numel() for p in one.lm.model.layers.parameters())
    assert f1["params_nonembed"] == P + 128 and f2["params_nonembed"] == 2 * P + 128
    assert f1["infer_flops_per_token"] == pass_flops(P, 4, 128, 128) / 128 + 2 * 128 * 256
    # K = 1 over 2T slots vs the 2x model over T: equal weight FLOPs, attention differs by 2LdT²/T
    assert fp["infer_flops_per_token"] - f2["infer_flops_per_token"] == pytest.approx(2 * 4 * 128 * (2 * 128 * 257 - 2 * 128 * 129) / 128)
    # training: passes T, then E[J]+1 = 3.5 over 2T; ≈ 8 vanilla forwards at this T
    ratio = (fp["train_flops_per_token"] - 6 * 128 * 256) / (f1["train_flops_per_token"] - 6 * 128 * 256)
    assert ratio == pytest.approx(1 + 3.5 * pass_flops(P, 4, 128, 256) / pass_flops(P, 4, 128, 128))
    assert 7 < ratio < 9


def test_save_load_roundtrip_keeps_the_thought_settings(tmp_path, ids):
    import json

    model = arm("ponderlm2_k2")
    save_arm(model, tmp_path / "a", [2, 3])
    settings = json.loads((tmp_path / "a" / "config.json").read_text())["latent_thought"]
    assert settings["K"] == 2 and settings["train_J"] == [2, 3] and settings["scale"] == math.sqrt(2.5 * 32)
    loaded = load_arm(tmp_path / "a").double()
    loaded.lm.set_attn_implementation("sdpa")
    with torch.no_grad():
        assert torch.equal(loaded(ids, 3), model(ids, 3))


def test_local_checkpoint_continues_with_thoughts(tmp_path, ids):
    """--model: a local LlamaForCausalLM loads through from_pretrained; K = 0 unscaled reproduces it."""
    lm = LlamaForCausalLM(tiny_llama_config(TINY, 2))
    lm.save_pretrained(tmp_path / "ckpt")
    wrapped = build_arm(arm_spec("vanilla_1x", scale=False), TINY, 0, model_path=str(tmp_path / "ckpt"))
    with torch.no_grad():
        assert torch.allclose(wrapped(ids), lm(input_ids=ids).logits, rtol=0, atol=1e-5)
    thinking = build_arm(arm_spec("ponderlm2_k1", scale=False), TINY, 0, model_path=str(tmp_path / "ckpt"))
    assert thinking(ids, 2).shape == (2, T, 256)


def test_loop_arm_is_the_shared_stack_applied_twice(ids):
    """loop_k1: the layer stack applied k+1 = 2 times, the final norm once — the same as a plain
    4-layer Llama whose layers 2, 3 are copies of layers 0, 1."""
    model = arm("loop_k1", scale=False)
    unrolled = LlamaForCausalLM(tiny_llama_config(TINY, 2 * TINY.layers)).double().eval()
    unrolled.set_attn_implementation("sdpa")
    state = model.lm.state_dict()
    for key, value in list(state.items()):
        if key.startswith("model.layers."):
            index, rest = key.split(".", 3)[2:]
            state[f"model.layers.{int(index) + TINY.layers}.{rest}"] = value
    unrolled.load_state_dict(state)
    with torch.no_grad():
        plain = unrolled(input_ids=ids).logits
        assert torch.allclose(model(ids), plain, rtol=0, atol=tolerance(plain))


@pytest.mark.parametrize("name", ["pause_k1", "ponderlm1_k1", "ponderlm2_k1_noscale"])
def test_baseline_arms_train(ids, name):
    model = arm(name)
    loss = torch.nn.functional.cross_entropy(model(ids[:, :-1], 2).flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    assert math.isfinite(float(loss))
    if name == "pause_k1":
        assert model.pause.grad is not None and float(model.pause.grad.abs().sum()) > 0
    assert model.scale == (1.0 if name.endswith("noscale") else math.sqrt(2.5 * TINY.hidden))


def sentencepiece_style_tokenizer():
    """A Llama-style tokenizer: '▁' marks a leading space (stripped at the start of a decode), and byte
    fallback tokens <0xXX> spell characters outside the vocabulary one UTF-8 byte at a time."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ("▁the", "▁cat", "▁sat", "▁ok"):
        vocab[piece] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    core.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>"), vocab


def test_nats_per_byte_counts_the_bytes_of_the_decoded_sequence():
    """'the cat sat€ ok' with € = E2 82 AC in three byte-fallback tokens, windows of T = 3: the targets are
    tokens 1…6, the text ' cat sat€ ok' of 14 bytes. Decoding each token alone gives 'cat', 'sat', three
    U+FFFD (3 bytes each) and 'ok': 17 bytes, the leading spaces lost and the euro sign counted 9 bytes."""
    from icml.methods.latent_thought.data import target_bytes, val_windows
    from icml.methods.latent_thought.pipeline import nats_per_byte

    tokenizer, vocab = sentencepiece_style_tokenizer()
    ids = np.array([vocab["▁the"], vocab["▁cat"], vocab["▁sat"], 1 + 0xE2, 1 + 0x82, 1 + 0xAC, vocab["▁ok"]])
    assert tokenizer.decode(ids.tolist()) == "the cat sat€ ok"
    windows = val_windows(ids, 3, 10)
    assert windows.tolist() == [ids[0:4].tolist(), ids[3:7].tolist()]
    assert target_bytes(windows, tokenizer) == len(" cat sat€ ok".encode("utf-8")) == 14
    assert sum(len(tokenizer.decode([int(i)]).encode("utf-8")) for i in ids[1:]) == 17  # the old count
    assert target_bytes(windows) == 6  # byte tokens: one byte per target
    # a uniform model: log V nats per target token, over the bytes of the decoded text
    V = len(tokenizer)
    uniform = lambda x, J: torch.zeros(*x.shape, V, dtype=torch.float64)  # noqa: E731
    value = nats_per_byte(uniform, torch.from_numpy(windows), 0, tokenizer)
    assert value == pytest.approx(6 * math.log(V) / 14, rel=1e-14)
    with pytest.raises(ValueError, match="consecutive windows"):
        target_bytes(windows[::-1], tokenizer)
