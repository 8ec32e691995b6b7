"""rl-sgd `--model` families: each family the policy code drives loads through the shared checkpoint
path, and the GRPO log-probabilities of a left-padded batch (explicit position ids) equal transformers'
own forward of each row alone, unpadded; other families are refused before a run exists."""
from __future__ import annotations

import pytest
import torch
from conftest import family_checkpoint
from transformers import (AutoModelForCausalLM, BertConfig, BertModel, GPT2Config, LlamaConfig, MistralConfig,
                          Qwen2Config, Qwen3Config)

from icml.cli.errors import UsageError
from icml.methods.rl_sgd.config import SUPPORTED_FAMILIES, RlSgdConfig, check_inputs
from icml.methods.rl_sgd.model import Prompts, completion_logprobs, load_policy

SIZES = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
CONFIGS = {"llama": LlamaConfig(**SIZES), "mistral": MistralConfig(**SIZES), "qwen2": Qwen2Config(**SIZES),
           "qwen3": Qwen3Config(head_dim=8, **SIZES),
           "gpt2": GPT2Config(vocab_size=40, n_embd=32, n_layer=2, n_head=4, n_positions=64)}


def checkpoint(tmp_path, family: str) -> str:
    return family_checkpoint(tmp_path / family, CONFIGS[family])


def test_every_supported_family_is_pinned_here():
    assert set(CONFIGS) == set(SUPPORTED_FAMILIES)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_left_padded_logprobs_equal_each_row_alone(tmp_path, family):
    path = checkpoint(tmp_path, family)
    check_inputs(RlSgdConfig(model=path))
    policy, tokenizer = load_policy(path)
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    g = torch.Generator().manual_seed(2)
    short, long = torch.randint(2, 40, (3,), generator=g), torch.randint(2, 40, (7,), generator=g)
    ids = torch.zeros(2, 7, dtype=torch.long)
    mask = torch.zeros(2, 7, dtype=torch.long)
    ids[0, 4:], mask[0, 4:] = short, 1
    ids[1], mask[1] = long, 1
    tokens = torch.randint(2, 40, (2, 5), generator=g)
    with torch.no_grad():
        got = completion_logprobs(policy, Prompts(ids, mask), tokens, torch.ones_like(tokens))
        for row, prompt in enumerate((short, long)):
            full = torch.cat([prompt, tokens[row]])[None]
            logits = reference(input_ids=full).logits[0, len(prompt) - 1:-1]
            expected = logits.log_softmax(-1).gather(-1, tokens[row][:, None])[:, 0]
            # float32, the same ops but for padding columns masked out: a few ulps of log-probs ~ 4
            assert torch.allclose(got[row], expected, rtol=0, atol=2e-5), (family, (got[row] - expected).abs().max())


def test_other_families_are_refused_in_one_line(tmp_path):
    BertModel(BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32)).save_pretrained(tmp_path / "bert")
    with pytest.raises(UsageError, match="is a bert checkpoint; rl-sgd supports llama"):
        check_inputs(RlSgdConfig(model=str(tmp_path / "bert")))
