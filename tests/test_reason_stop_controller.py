"""The ASAG controller's identities: normalised attention entropy (uniform → 1, one-hot → 0, closed
forms), the hook-recorded rows against HF's own `output_attentions`, the probe leaving no trace in
the cache, token identity with HF greedy decoding when exits and injection are disabled, the
injected mixture, the decision table with its jump cap, and exits that generate an answer; under
sampling (temperature > 0): vanilla = HF `generate(do_sample=True)` on the same seed, one stream
shared by every variant up to its first action, probes that draw nothing, T → 0 = greedy."""
from __future__ import annotations

import math

import pytest
import torch

from icml.methods.reason_stop.config import preset
from icml.methods.reason_stop.controller import (CONTINUE, EXIT, FORCED_EXIT, INJECT, JUMP, POLICIES,
                                                 AttentionRecorder, Codec, Session, answer_distribution, decide,
                                                 generate, injected, normalised_entropy, probe, relative_change,
                                                 stream_seed)
from icml.methods.reason_stop.data import build_tokenizer

EPS = torch.finfo(torch.float64).eps
QUESTION = "Q 3 + 5 - 9 ="


@pytest.fixture(scope="module")
def setup():
    """A random float64 Llama over the synthetic vocabulary. Seed 2 at init std 1.0 decodes 40 varied
    tokens greedily; '8' and 'wrong' are frequent among them, so they serve as ATP words (8 ATPs)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    torch.manual_seed(2)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=1.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).double().eval()
    cfg = preset("smoke")
    cfg.max_new_tokens, cfg.atp_words = 40, ["8", "wrong"]
    cfg.probe_max_tokens = 3  # a random model never reaches the terminator: keep probes short
    return model, tokenizer, cfg


def run(setup, variant: str, problem_id: int = 0, seed: int = 0, **overrides):
    model, tokenizer, cfg = setup
    cfg = type(cfg)(**{**cfg.__dict__, **overrides})
    codec = Codec(tokenizer, model, cfg)
    recorder = AttentionRecorder(model, cfg.n_last_layers)
    try:
        return generate(model, codec, recorder, QUESTION, "9", variant, cfg, "cpu", problem_id, seed), codec
    finally:
        recorder.remove()


# ---------------------------------------------------------------------------------------------
# Entropy
# ---------------------------------------------------------------------------------------------
def test_entropy_of_uniform_one_hot_and_two_point_rows():
    counts = torch.tensor([1, 2, 5, 64, 1000])
    uniform = torch.zeros(len(counts), 1000, dtype=torch.float64)
    for row, k in enumerate(counts.tolist()):
        uniform[row, :k] = 1 / k  # causal rows: keys beyond k_r carry weight 0
    h = normalised_entropy(uniform, counts)
    # k terms of relative error ~eps each, summed: |error| ≲ k·eps; the k=1 row is 0 by definition
    assert h[0] == 0
    assert torch.allclose(h[1:], torch.ones(4, dtype=torch.float64), rtol=0, atol=2 * 1000 * EPS)
    one_hot = torch.zeros(3, 50, dtype=torch.float64)
    one_hot[0, 0] = one_hot[1, 7] = one_hot[2, 49] = 1
    assert torch.equal(normalised_entropy(one_hot, torch.tensor([10, 20, 50])), torch.zeros(3, dtype=torch.float64))
    p = torch.tensor([[0.3, 0.7]], dtype=torch.float64)  # binary entropy in bits: H(p)/log 2
    expected = -(0.3 * math.log(0.3) + 0.7 * math.log(0.7)) / math.log(2)
    assert normalised_entropy(p, torch.tensor([2])).item() == pytest.approx(expected, rel=4 * EPS)
    # invariant to the order of the keys (a sum over them)
    row = torch.rand(1, 30, dtype=torch.float64).softmax(-1)
    permuted = row[:, torch.randperm(30)]
    assert normalised_entropy(permuted, torch.tensor([30])).item() == pytest.approx(
        normalised_entropy(row, torch.tensor([30])).item(), rel=30 * EPS)


def test_recorded_rows_match_hf_attentions(setup):
    """The hooks see each decode step's row through the KV cache; HF's full forward with
    output_attentions gives the same rows: entropy per (layer, head) and the trap statistics."""
    model, tokenizer, cfg = setup
    ids = tokenizer("Q 3 + 5 - 9 = <think> 4 ; 1 wait 7 + 2 = 9")["input_ids"]
    recorder = AttentionRecorder(model, 4)
    session = Session(model, recorder, "cpu")
    prev_start, cur_start = 9, 12  # after <think>: action 1 is "4 ; 1", action 2 "wait 7 + 2 = 9"
    session.feed(ids[:prev_start])
    for position in range(prev_start, len(ids)):
        recorder.bounds = (None, prev_start) if position < cur_start else (prev_start, cur_start)
        session.feed([ids[position]])
    recorder.remove()
    with torch.no_grad():
        attentions = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions[-4:]
    weights = torch.stack([a[0] for a in attentions])  # [layers, heads, rows, keys]
    counts = torch.arange(1, len(ids) + 1)
    reference = normalised_entropy(weights, counts).permute(2, 0, 1)  # [rows, layers, heads]
    # HF's eager attention takes its softmax in float32 whatever the model dtype, over the visible keys
    # in a cached step but over all keys (masked ones included) in the full forward: the rows agree to
    # float32 rounding, amplified by the log terms of the entropy (observed ≤ 11 eps32)
    tol = 32 * torch.finfo(torch.float32).eps
    assert torch.allclose(torch.stack(recorder.entropy), reference, rtol=0, atol=tol)
    a_bar = weights.mean((0, 1))  # Ā [rows, keys]
    window = recorder.window_entropy(cur_start, len(ids), 3)
    assert window == pytest.approx(float(reference[len(ids) - 3:].mean(0).sum()), abs=16 * tol)  # 16 heads summed
    a_prev, a_self = recorder.trap_stats(cur_start, len(ids), "mean")
    expected_prev = torch.stack([a_bar[r, prev_start:cur_start].mean() for r in range(cur_start, len(ids))]).mean()
    expected_self = torch.stack([a_bar[r, cur_start:r + 1].mean() for r in range(cur_start, len(ids))]).mean()
    assert a_prev == pytest.approx(float(expected_prev), abs=tol)
    assert a_self == pytest.approx(float(expected_self), abs=tol)
    mass_prev, mass_self = recorder.trap_stats(cur_start, len(ids), "mass")
    assert mass_prev == pytest.approx(float(expected_prev) * (cur_start - prev_start), abs=tol)


def test_sdpa_attention_is_refused(setup):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=29, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    recorder = AttentionRecorder(model, 4)
    from icml.cli.errors import UsageError

    with pytest.raises(UsageError, match="no attention weights"):
        Session(model, recorder, "cpu").feed([1, 5, 6])


# ---------------------------------------------------------------------------------------------
# Probe and identities with vanilla greedy decoding
# ---------------------------------------------------------------------------------------------
def test_probe_leaves_no_trace_in_the_cache(setup):
    model, tokenizer, cfg = setup
    codec = Codec(tokenizer, model, cfg)
    recorder = AttentionRecorder(model, 4)
    probed, plain = Session(model, recorder, "cpu"), None
    probed.feed(codec.prompt_ids(QUESTION, False) + [7, 8])
    keys = [layer.keys.clone() for layer in probed.cache.layers]
    values = [layer.values.clone() for layer in probed.cache.layers]
    rows, ids = [r.clone() for r in recorder.entropy], list(probed.ids)
    for position in ("before", "after"):
        cfg.probe_position = position
        found = probe(probed, codec, cfg, atp_ids=[9])
        assert found.tokens >= len(codec.probe_ids) + 1
        assert probed.cache.get_seq_length() == len(ids) and probed.ids == ids
        assert all(torch.equal(layer.keys, k) and torch.equal(layer.values, v)
                   for layer, k, v in zip(probed.cache.layers, keys, values))
        assert len(recorder.entropy) == len(rows) and all(torch.equal(a, b) for a, b in zip(recorder.entropy, rows))
    cfg.probe_position = "before"
    after_probe = probed.feed([10])
    recorder.remove()
    fresh = AttentionRecorder(model, 4)
    plain = Session(model, fresh, "cpu")
    plain.feed(ids)
    assert torch.equal(after_probe, plain.feed([10]))  # bitwise: the crop restored the very same state
    fresh.remove()


def test_vanilla_is_hf_greedy_and_disabled_controllers_are_token_identical(setup):
    model, tokenizer, cfg = setup
    vanilla, codec = run(setup, "vanilla")
    prompt = codec.prompt_ids(QUESTION, False)
    with torch.no_grad():
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=cfg.max_new_tokens + cfg.answer_max_tokens,
                                   do_sample=False, eos_token_id=2, pad_token_id=0)[0, len(prompt):].tolist()
    assert vanilla.output_ids == reference[:len(vanilla.output_ids)]
    assert vanilla.n_atp >= 5 and vanilla.probe_tokens == 0
    disabled = [("deer", {"lam": 1.1}), ("asag_exit", {"lam": 1.1}), ("oracle_first_correct", {}),
                ("deer", {"lam": 1.1, "probe_position": "after"}),
                # ΔH < α everywhere: injection at every ATP i > 1, with γ = 0 it changes nothing
                ("asag", {"lam": 1.1, "alpha": math.inf, "inject_weight": 0.0})]
    for variant, overrides in disabled:
        generation, _ = run(setup, variant, **overrides)
        assert generation.output_ids == vanilla.output_ids, (variant, overrides)
        assert generation.n_atp == vanilla.n_atp and generation.probe_tokens > 0  # probes: never in the output
    asag, _ = run(setup, "asag", lam=1.1, alpha=math.inf, inject_weight=0.0)
    assert asag.counts[INJECT] == vanilla.n_atp - 1 and asag.counts[CONTINUE] == 1


def test_full_injection_emits_the_probe_answer(setup):
    """γ = 1 for one step: the token after each injected ATP is the (one-token) probe answer."""
    model, tokenizer, cfg = setup
    generation, codec = run(setup, "asag", lam=1.1, alpha=math.inf, inject_weight=1.0, inject_tokens=1,
                            probe_max_tokens=1)
    injected_events = [e for e in generation.events if e["action"] == INJECT and e["probe_answer"]]
    assert injected_events
    for event in injected_events:
        position = event["position"]
        assert generation.output_ids[position + 1] == tokenizer.convert_tokens_to_ids(event["probe_answer"])


def test_jumps_are_capped_then_exit_generates_an_answer(setup):
    model, tokenizer, cfg = setup
    # α = −∞: ΔH ≥ α at every ATP i > 1, so a trapped ATP jumps; λ > 1: no confident exit
    generation, codec = run(setup, "asag", lam=1.1, alpha=-math.inf, max_jumps=1, trap_stat="mass")
    actions = [e["action"] for e in generation.events]
    assert actions.count(JUMP) == 1 and actions[-1] == FORCED_EXIT
    for event in generation.events:
        if event["action"] == JUMP:
            start = event["position"]
            assert generation.output_ids[start:start + len(codec.jump_ids)] == codec.jump_ids
    exit_at = generation.events[-1]["position"]
    tail = generation.output_ids[exit_at:]
    assert tail[:len(codec.exit_ids)] == codec.exit_ids  # an exit suffix, then the generated answer
    assert 1 <= len(tail) - len(codec.exit_ids) <= cfg.answer_max_tokens


# ---------------------------------------------------------------------------------------------
# Small closed forms
# ---------------------------------------------------------------------------------------------
def test_injected_mixture_sums_to_one_and_interpolates():
    probs = torch.rand(29, dtype=torch.float64).softmax(-1)
    r = answer_distribution([5, 7, 5], [0.5, 0.2, 0.3], 29)
    assert r.sum().item() == pytest.approx(1, abs=4 * EPS)
    assert r[5].item() == pytest.approx(0.8, abs=4 * EPS) and r[7].item() == pytest.approx(0.2, abs=4 * EPS)
    mixed = injected(probs, r, 0.05)
    assert mixed.sum().item() == pytest.approx(1, abs=32 * EPS)  # 29 terms
    assert torch.equal(injected(probs, r, 0.0), probs) and torch.equal(injected(probs, r, 1.0), r)
    assert answer_distribution([], [], 29) is None
    assert relative_change(0.9, 1.2) == pytest.approx(-0.25, abs=4 * EPS)


def test_decision_table():
    asag = POLICIES["asag"]
    kw = dict(lam=0.95, alpha=-0.1, max_jumps=2)
    assert decide(1, 0.99, math.nan, True, 0, asag, **kw) == EXIT  # first ATP: no entropy gate
    assert decide(1, 0.90, math.nan, True, 0, asag, **kw) == CONTINUE
    assert decide(2, 0.99, -0.2, False, 0, asag, **kw) == EXIT
    assert decide(2, 0.90, -0.2, False, 0, asag, **kw) == INJECT
    assert decide(2, 0.99, 0.0, True, 0, asag, **kw) == JUMP
    assert decide(2, 0.99, 0.0, True, 2, asag, **kw) == FORCED_EXIT  # the jump cap s
    assert decide(2, 0.99, 0.0, False, 0, asag, **kw) == CONTINUE
    assert decide(2, 0.90, -0.2, False, 0, POLICIES["asag_exit"], **kw) == CONTINUE
    assert decide(2, 0.99, 0.0, True, 0, POLICIES["asag_exit_inject"], **kw) == CONTINUE
    assert decide(2, 0.99, 0.0, True, 0, POLICIES["asag_exit_jump"], **kw) == JUMP
    assert decide(2, 0.90, -0.2, False, 0, POLICIES["asag_exit_jump"], **kw) == CONTINUE
    assert decide(3, 0.99, 0.5, True, 0, POLICIES["deer"], **kw) == EXIT  # DEER: confidence alone
    assert decide(3, 0.10, -0.5, False, 0, POLICIES["oracle_first_correct"], correct=True, **kw) == EXIT
    assert decide(3, 0.99, -0.5, True, 0, POLICIES["vanilla"], **kw) == CONTINUE


# ---------------------------------------------------------------------------------------------
# Sampled thinking (temperature > 0, a deviation experiment; the spec decodes greedily)
# ---------------------------------------------------------------------------------------------
SAMPLED = {"temperature": 1.3, "top_p": 0.9}  # both HF warpers active


def test_sampled_vanilla_is_hf_sampling_on_the_same_seed(setup):
    model, tokenizer, cfg = setup
    vanilla, codec = run(setup, "vanilla", problem_id=0, seed=3, **SAMPLED)
    prompt = codec.prompt_ids(QUESTION, False)
    torch.manual_seed(stream_seed(3, 0))  # generate() draws from the global generator
    with torch.no_grad():
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=cfg.max_new_tokens + cfg.answer_max_tokens,
                                   do_sample=True, top_k=0, eos_token_id=2, pad_token_id=0,
                                   **SAMPLED)[0, len(prompt):].tolist()
    assert vanilla.output_ids == reference[:len(vanilla.output_ids)] and len(vanilla.output_ids) >= 20
    greedy, _ = run(setup, "vanilla")
    assert vanilla.output_ids != greedy.output_ids  # it does sample
    again, _ = run(setup, "vanilla", problem_id=0, seed=3, **SAMPLED)
    other, _ = run(setup, "vanilla", problem_id=7, seed=3, **SAMPLED)
    assert again.output_ids == vanilla.output_ids and other.output_ids != vanilla.output_ids
    assert len({stream_seed(0, 1), stream_seed(1, 0), stream_seed(0, 0)}) == 3


def test_sampled_stream_is_shared_and_probes_draw_nothing(setup):
    vanilla, codec = run(setup, "vanilla", problem_id=0, seed=3, **SAMPLED)
    assert vanilla.n_atp >= 5
    # controllers that only continue probe at every ATP (greedy probes, rolled back) and must still
    # consume vanilla's stream token for token
    for variant, overrides in [("deer", {"lam": 1.1}), ("oracle_first_correct", {}),
                               ("deer", {"lam": 1.1, "probe_position": "after"}),
                               ("asag", {"lam": 1.1, "alpha": math.inf, "inject_weight": 0.0})]:
        generation, _ = run(setup, variant, problem_id=0, seed=3, **SAMPLED, **overrides)
        assert generation.output_ids == vanilla.output_ids, (variant, overrides)
        assert generation.n_atp == vanilla.n_atp and generation.probe_tokens > 0
    # an exit at the first ATP: vanilla's sampled prefix, then the exit suffix and a sampled answer
    early, _ = run(setup, "deer", problem_id=0, seed=3, lam=-1.0, **SAMPLED)
    first = vanilla.events[0]["position"]
    assert early.events[0]["action"] == EXIT and early.events[0]["position"] == first
    assert early.output_ids[:first] == vanilla.output_ids[:first]
    assert early.output_ids[first:first + len(codec.exit_ids)] == codec.exit_ids


def test_vanishing_temperature_is_greedy(setup):
    greedy, _ = run(setup, "asag", lam=1.1, alpha=-math.inf, max_jumps=1, trap_stat="mass")
    cold, _ = run(setup, "asag", lam=1.1, alpha=-math.inf, max_jumps=1, trap_stat="mass", temperature=1e-4)
    assert cold.output_ids == greedy.output_ids and cold.counts == greedy.counts
