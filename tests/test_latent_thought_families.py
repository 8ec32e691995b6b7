"""latent-thought `--model` families: each checkpoint family the arms drive loads through the shared
checkpoint path (transformers' Auto classes, so a Qwen2 keeps its QKV biases), and the vanilla arm at
K = 0 is transformers' own forward of that checkpoint; other families are refused before a run exists."""
from __future__ import annotations

import pytest
import torch
from conftest import family_checkpoint
from transformers import (AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, MistralConfig,
                          Qwen2Config, Qwen3Config)

from icml.cli.errors import UsageError
from icml.methods.latent_thought.config import SUPPORTED_FAMILIES, LatentThoughtConfig, check_inputs
from icml.methods.latent_thought.model import arm_spec, build_arm

SIZES = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
CONFIGS = {"llama": LlamaConfig(**SIZES), "mistral": MistralConfig(**SIZES), "qwen2": Qwen2Config(**SIZES),
           "qwen3": Qwen3Config(head_dim=8, **SIZES)}


def checkpoint(tmp_path, family: str) -> str:
    return family_checkpoint(tmp_path / family, CONFIGS[family])


def test_every_supported_family_is_pinned_here():
    assert set(CONFIGS) == set(SUPPORTED_FAMILIES)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_vanilla_at_k0_is_transformers_forward_of_the_family(tmp_path, family):
    path = checkpoint(tmp_path, family)
    check_inputs(LatentThoughtConfig(model=path))  # accepted before a run exists
    reference = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    if family == "qwen2":
        assert reference.model.layers[0].self_attn.q_proj.bias.abs().sum() > 1  # the biases are there
    wrapped = build_arm(arm_spec("vanilla_1x", scale=False), None, 0, model_path=path).eval()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        got = wrapped(ids)
    # the same float32 ops in the same order but for the mask's form (a 4-D slot mask vs the causal
    # one): differences are a few float32 ulps of logits of size ~1
    assert torch.allclose(got, expected, rtol=0, atol=1e-5), (got - expected).abs().max()


def test_other_families_are_refused_in_one_line_before_a_run(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32)).save_pretrained(
        tmp_path / "gpt2")
    with pytest.raises(UsageError, match="is a gpt2 checkpoint; latent-thought supports llama, mistral"):
        check_inputs(LatentThoughtConfig(model=str(tmp_path / "gpt2")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no config.json"):
        check_inputs(LatentThoughtConfig(model=str(tmp_path / "empty")))
