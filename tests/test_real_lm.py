"""A real pretrained LM in the tests: SmolLM2-135M-Instruct (Llama family, `--model smollm2-135m`), loaded
once per run by the `smollm2` fixture. Each method that drives a causal LM is checked on it where a real
checkpoint matters: its neutral setting equals transformers' own computation, and a real behaviour
(a greedy passkey retrieval) survives where the paper says it should."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import chat_ids

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")


def passkey_prompt(tokenizer, key: int, depth: float, repeats: int = 24):
    """The classic passkey task in the chat format: ~{repeats}×18 tokens of filler, the key at `depth`."""
    cut = int(repeats * depth)
    text = ("There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n"
            + FILLER * cut + f"The pass key is {key}. Remember it. {key} is the pass key. "
            + FILLER * (repeats - cut) + "\nWhat is the pass key?")
    return chat_ids(tokenizer, text)


def greedy(model, ids, max_new_tokens: int, cache=None) -> torch.Tensor:
    kwargs = {} if cache is None else {"past_key_values": cache}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, **kwargs)
    return out[0, ids.shape[1]:]


def test_smollm2_resolves_from_its_short_name_as_a_llama_gguf():
    from icml.cli import checkpoints

    ckpt = checkpoints.resolve("smollm2-135m")
    assert (ckpt.model_type, ckpt.gguf_file) == ("llama", "SmolLM2-135M-Instruct.Q4_1.gguf")


def test_kv_compress_full_budget_is_plain_generate_and_a_passkey_survives_snapkv_at_30_percent(smollm2):
    from icml.methods.kv_compress.hf_cache import ATTENTION, CompressedCache, register

    model, tokenizer = smollm2
    ids = passkey_prompt(tokenizer, 68231, depth=0.4)
    assert 450 < ids.shape[1] < 800
    plain = greedy(model, ids, 12)
    assert "68231" in tokenizer.decode(plain)  # the model itself retrieves it (its chat format)
    previous = model.config._attn_implementation
    register()
    model.set_attn_implementation(ATTENTION)
    try:
        full = greedy(model, ids, 12, CompressedCache(model, "full", ratio=1.0))
        snapkv = greedy(model, ids, 12, CompressedCache(model, "snapkv", ratio=0.3))
        streaming = greedy(model, ids, 12, CompressedCache(model, "streamingllm", ratio=0.1))
    finally:
        model.set_attn_implementation(previous)
    assert torch.equal(full, plain)  # r = 1 keeps every entry: exactly the plain cache's greedy tokens
    assert "68231" in tokenizer.decode(snapkv)
    # the control: a recency window that cannot see the key at 40 % depth does not answer it
    assert "68231" not in tokenizer.decode(streaming)


def test_kv_compress_a_mask_that_hides_chat_tokens_is_refused_with_the_fix(smollm2):
    """generate() infers `ids != pad_token_id` as the mask when pad differs from eos; a chat prompt holds
    SmolLM2's pad (<|im_end|>) between turns, so one unpadded prompt arrives with holes in its mask."""
    from icml.methods.kv_compress.hf_cache import ATTENTION, CompressedCache, register

    model, tokenizer = smollm2
    ids = passkey_prompt(tokenizer, 1234, depth=0.5, repeats=4)
    inferred = ids.ne(tokenizer.pad_token_id).long()
    assert not inferred[0, -1] == 0 and (inferred == 0).any()  # holes inside the prompt, none at its end
    previous = model.config._attn_implementation
    register()
    model.set_attn_implementation(ATTENTION)
    try:
        with pytest.raises(ValueError, match=r"attention_mask=torch.ones_like\(input_ids\)"), torch.no_grad():
            model.generate(ids, attention_mask=inferred, past_key_values=CompressedCache(model, "snapkv", ratio=0.3),
                           max_new_tokens=2)
    finally:
        model.set_attn_implementation(previous)


def test_latent_thought_vanilla_at_k0_is_smollm2_s_own_forward(smollm2):
    from icml.methods.latent_thought.model import ThoughtLM, arm_spec

    model, tokenizer = smollm2
    ids = chat_ids(tokenizer, "Name three colours of the rainbow.")
    vanilla = ThoughtLM(model, arm_spec("vanilla_1x", scale=False))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        got = vanilla(ids)
        thinking = ThoughtLM(model, arm_spec("ponderlm2_k1", scale=False))(ids, 1)
    # same float32 ops up to the mask's form; logits of SmolLM2 reach ~30, so a few ulps are ~1e-5
    assert torch.allclose(got, expected, rtol=0, atol=5e-5), (got - expected).abs().max()
    assert thinking.shape == expected.shape and not torch.allclose(thinking, expected, atol=1e-2)


def test_rl_sgd_one_grpo_step_on_smollm2_raises_the_advantaged_completions(smollm2):
    """A GRPO step (SGD, the paper's RLVR optimizer) on real completions: the surrogate objective
    Σ adv·log π over the batch's tokens rises, to first order in the step (lr small)."""
    import copy

    from icml.methods.rl_sgd.grpo import Rollout, build_optimizer, grpo_update
    from icml.methods.rl_sgd.model import Prompts, completion_logprobs, encode_prompts, generate

    model, tokenizer = smollm2
    policy = copy.deepcopy(model).train()
    prompts = encode_prompts(tokenizer, ["What is 2 + 3?", "What is 7 + 1?"], use_chat_template=True)
    grouped = Prompts(prompts.ids.repeat_interleave(2, 0), prompts.mask.repeat_interleave(2, 0))
    tokens, mask = generate(policy, grouped, 6, tokenizer.eos_token_id, tokenizer.pad_token_id,
                            generator=torch.Generator().manual_seed(0))
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    advantage = torch.tensor([1.0, -1.0, -1.0, 1.0])

    def objective() -> float:
        with torch.no_grad():
            logp = completion_logprobs(policy, grouped, tokens, mask)
        return float((advantage[:, None] * logp).sum())

    before = objective()
    stats = grpo_update(policy, build_optimizer("sgd", policy, 1e-3), Rollout(grouped, tokens, mask, rewards),
                        clip_eps=0.2, ppo_epochs=1, std_eps=1e-4, skip_uniform_groups=True, grad_clip=1.0)
    assert stats["grad_norm"] > 0 and objective() > before


def test_spectral_optim_muon_update_of_smollm2_matrices_is_orthogonalised(smollm2):
    """mSGDZ (Muon) on the real model's shapes (576×576 Q, 192×576 GQA K/V, 1536×576 MLP): each matrix's
    update direction has the singular values Newton–Schulz gives, not the gradient's spread."""
    import copy

    from icml.methods.spectral_optim.optim import SpectralOptimizer

    model, tokenizer = smollm2
    lm = copy.deepcopy(model).train()
    checked = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
               "model.layers.0.mlp.up_proj.weight")
    for name, p in lm.named_parameters():  # three matrices: Newton–Schulz in bf16 is slow on CPUs
        p.requires_grad_(name in checked)
    optimizer = SpectralOptimizer(lm, "mSGDZ", lr_matrix=1.0, lr_vector=0.0, weight_decay=0.0)
    ids = chat_ids(tokenizer, "Say something about the sea.")
    lm(input_ids=ids, labels=ids).loss.backward()
    layer = lm.model.layers[0]
    weights = {"q": layer.self_attn.q_proj.weight, "k": layer.self_attn.k_proj.weight,
               "up": layer.mlp.up_proj.weight}
    before = {key: w.detach().clone() for key, w in weights.items()}
    grads = {key: w.grad.clone() for key, w in weights.items()}
    optimizer.step()
    for key, w in weights.items():
        # the gradient of one short prompt has rank ≤ its tokens: compare on its k significant directions
        spread = torch.linalg.svdvals(grads[key].double())
        k = int((spread > 1e-3 * spread[0]).sum())
        step = torch.linalg.svdvals((before[key] - w.detach()).double())[:k]
        assert 5 <= k < min(w.shape) and spread[0] / spread[k - 1] > 10  # a real, ill-conditioned gradient
        assert step.max() / step.min() < 3, (key, k, step.max(), step.min())  # flattened by Newton–Schulz


def test_reason_stop_controller_on_smollm2_is_greedy_decoding_when_it_never_exits(smollm2):
    """The controller's own decoding loop on a real model: vanilla is transformers' greedy generate() of
    the same prompt, and DEER with a threshold it cannot reach (λ > 1) probes without changing the trace."""
    import dataclasses

    from icml.methods.reason_stop.config import preset
    from icml.methods.reason_stop.controller import AttentionRecorder, Codec, generate

    model, tokenizer = smollm2
    cfg = dataclasses.replace(preset("smoke"), max_new_tokens=24, atp_words=["So", "Wait"])
    question = "A shop sells pens at 3 dollars each. How much do 4 pens cost?"
    codec = Codec(tokenizer, model, cfg)
    recorder = AttentionRecorder(model, cfg.n_last_layers)
    try:
        vanilla = generate(model, codec, recorder, question, "12", "vanilla", cfg, "cpu")
        deer = generate(model, codec, recorder, question, "12", "deer", dataclasses.replace(cfg, lam=1.1), "cpu")
    finally:
        recorder.remove()
    prompt = codec.prompt_ids(question, False)
    with torch.no_grad():
        reference = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                   max_new_tokens=cfg.max_new_tokens, do_sample=False)[0, len(prompt):].tolist()
    assert vanilla.output_ids == reference[:len(vanilla.output_ids)] and len(vanilla.output_ids) >= 8
    assert deer.output_ids == vanilla.output_ids
    assert deer.n_atp == vanilla.n_atp and deer.probe_tokens > 0 or deer.n_atp == 0
