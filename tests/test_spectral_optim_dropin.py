"""SpectralOptimizer as a drop-in `torch.optim.Optimizer`, and fused QKV weights split by the row
layout of the model that owns them (GPT-NeoX/Pythia and Bloom interleave rows per head).

The row → (role, head) map is read off the models' own forward code: a forward hook replaces the
fused projection's output by the row numbers, and the model's attention code splits it into q, k
and v. So these tests do not restate the optimizer's index arithmetic.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from icml.methods.spectral_optim.optim import SpectralOptimizer
from icml.methods.spectral_optim.psi import psi

transformers = pytest.importorskip("transformers")

HIDDEN, HEADS, VOCAB = 16, 4, 32


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, idx):
        return self.head(torch.tanh(self.body(self.embed(idx))))


def loss_of(model, seed):
    idx = torch.randint(0, VOCAB, (4, 5), generator=torch.Generator().manual_seed(seed))
    return nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())


def train(model, opt, steps, scheduler=None, first=0):
    for step in range(first, first + steps):
        opt.zero_grad()
        loss_of(model, step).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


@pytest.mark.parametrize("variant", ["AdamS", "mSGDZ"])
def test_plain_tensors_named_pairs_and_the_module_give_the_same_steps(variant):
    models = [Small() for _ in range(3)]
    opts = [SpectralOptimizer(models[0].parameters(), variant, 0.05, 0.01, model=models[0]),
            SpectralOptimizer(models[1].named_parameters(), variant, 0.05, 0.01, model=models[1]),
            SpectralOptimizer(models[2], variant, 0.05, 0.01)]
    for model, opt in zip(models, opts):
        assert [g["kind"] for g in opt.param_groups] == ["matrix", "vector"]
        train(model, opt, 3)
    for other in models[1:]:
        for a, b in zip(models[0].parameters(), other.parameters()):
            assert torch.equal(a, b)
    # A tensor without a name takes it from model=.
    own = Small()
    assert SpectralOptimizer(own.parameters(), variant, model=own).param_groups[0]["param_names"] == \
        ["embed.weight", "body.weight", "head.weight"]


def test_matrices_without_their_model_are_refused_in_one_line():
    model = Small()
    for params in (model.parameters(), model.named_parameters(), [{"params": model.body.parameters()}]):
        with pytest.raises(ValueError, match=r"without model=.*pass the model itself") as error:
            SpectralOptimizer(params, "mSGDZ")
        assert "\n" not in str(error.value)
    opt = SpectralOptimizer(model, "mSGDZ")
    with pytest.raises(ValueError, match=r"of shape \(8, 8\) is not a parameter of model="):
        opt.add_param_group({"params": [nn.Linear(8, 8).weight]})
    # A layer the model gains after the optimizer was built is found at add_param_group.
    model.extra = nn.Linear(8, 8)
    opt.add_param_group({"params": model.extra.parameters()})
    assert opt.param_groups[2]["param_names"] == ["extra.weight"]
    # Vectors alone need no model.
    assert [len(g["params"]) for g in SpectralOptimizer([model.body.bias], "mSGDZ").param_groups] == [0, 1]


def test_defaults_are_the_papers_learning_rates():
    opt = SpectralOptimizer(Small(), "AdamZ")
    assert [g["lr"] for g in opt.param_groups] == [7e-3, 3e-4]


def test_param_group_dicts_carry_their_own_options():
    model = Small()
    opt = SpectralOptimizer([{"params": [model.embed.weight, model.head.weight, model.head.bias], "lr": 1e-3},
                             {"params": model.body.parameters(), "lr_matrix": 0.2, "weight_decay": 0.1}],
                            "mSGDZ", lr_matrix=0.05, lr_vector=0.01, model=model)
    summary = [(g["kind"], len(g["params"]), g["lr"], g["weight_decay"]) for g in opt.param_groups]
    assert summary == [("matrix", 2, 1e-3, 0.0), ("vector", 1, 1e-3, 0.0),
                       ("matrix", 1, 0.2, 0.1), ("vector", 1, 0.01, 0.0)]  # vectors never decay
    # One step: the body's matrix moves by lr·Ψ₀(M) after its decay, the head's by 1e-3·Ψ₀(M).
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    loss_of(model, 0).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    opt.step()
    expected_body = before["body.weight"] * (1 - 0.2 * 0.1) - 0.2 * psi(grads["body.weight"], 0.0)
    torch.testing.assert_close(model.body.weight.detach(), expected_body, rtol=0, atol=1e-6)
    expected_head = before["head.weight"] - 1e-3 * psi(grads["head.weight"], 0.0)
    torch.testing.assert_close(model.head.weight.detach(), expected_head, rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [model.body.weight]})


def test_add_param_group_unfreezes_a_layer():
    model = Small()
    model.body.requires_grad_(False)
    opt = SpectralOptimizer(model.named_parameters(), "AdamS", 0.05, 0.01, model=model)
    assert len(opt.param_groups) == 2 and len(opt.param_groups[0]["params"]) == 2
    model.body.requires_grad_(True)
    opt.add_param_group({"params": list(model.body.named_parameters()), "lr": 0.02})
    assert [(g["kind"], g["param_names"], g["lr"]) for g in opt.param_groups[2:]] == \
        [("matrix", ["weight"], 0.02), ("vector", ["bias"], 0.02)]
    before = model.body.weight.detach().clone()
    train(model, opt, 1)
    assert not torch.equal(model.body.weight, before)


@pytest.mark.parametrize("variant", ["AdamQ", "mSGDS"])
def test_state_dict_round_trip_with_groups_and_a_scheduler(variant):
    def build(model):
        opt = SpectralOptimizer([{"params": [model.embed.weight], "lr": 0.01},
                                 {"params": list(model.body.parameters()) + list(model.head.parameters())}],
                                variant, 0.05, 0.01, model=model)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return opt, scheduler

    straight = Small()
    opt, scheduler = build(straight)
    train(straight, opt, 4, scheduler)

    first = Small()
    opt, scheduler = build(first)
    train(first, opt, 2, scheduler)
    saved = copy.deepcopy((first.state_dict(), opt.state_dict(), scheduler.state_dict()))
    resumed = Small()
    resumed.load_state_dict(saved[0])
    opt, scheduler = build(resumed)
    opt.load_state_dict(saved[1])
    scheduler.load_state_dict(saved[2])
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.01 / 3, 0.01 / 3, 0.05 / 3, 0.01 / 3])
    train(resumed, opt, 2, scheduler, first=2)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# Fused QKV row layouts
# ---------------------------------------------------------------------------------------------

def capture_qkv_neox(model):
    """(q, k, v) rows of query_key_value per head, from GPT-NeoX's own split (position 0: the
    rotary embedding is the identity there)."""
    captured = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        captured["qkv"] = (query[0, :, 0], key[0, :, 0], value[0, :, 0])  # (heads, head_dim) each
        return torch.zeros_like(query).transpose(1, 2), None

    transformers.AttentionInterface.register("icml_capture_qkv", capture)
    model.config._attn_implementation = "icml_capture_qkv"
    projection = model.gpt_neox.layers[0].attention.query_key_value
    return run_with_row_ids(model, projection, captured)


def capture_qkv_bloom(model):
    """(q, k, v) rows of query_key_value per head, from Bloom's own `_reshape`."""
    captured = {}
    attention = model.transformer.h[0].self_attention
    reshape = attention._reshape

    def capture(fused):
        q, k, v = reshape(fused)
        captured["qkv"] = (q[0, :, 0], k[0, :, 0], v[0, :, 0])
        return q, k, v

    attention._reshape = capture
    return run_with_row_ids(model, attention.query_key_value, captured)


def run_with_row_ids(model, projection, captured):
    out_features = projection.weight.shape[0]
    hook = projection.register_forward_hook(
        lambda module, args, output: torch.arange(out_features, dtype=output.dtype).expand_as(output))
    try:
        with torch.no_grad():
            model(torch.zeros(1, 1, dtype=torch.long))
    finally:
        hook.remove()
    return [role.round().long() for role in captured["qkv"]]  # each (heads, head_dim)


def tiny_neox():
    config = transformers.GPTNeoXConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=1,
                                        intermediate_size=32, vocab_size=VOCAB, max_position_embeddings=8,
                                        rotary_pct=1.0)
    torch.manual_seed(0)
    return transformers.GPTNeoXForCausalLM(config), capture_qkv_neox, "gpt_neox.layers.0.attention.query_key_value.weight"


def tiny_bloom():
    config = transformers.BloomConfig(hidden_size=HIDDEN, n_head=HEADS, n_layer=1, vocab_size=VOCAB)
    torch.manual_seed(0)
    return transformers.BloomForCausalLM(config), capture_qkv_bloom, "transformer.h.0.self_attention.query_key_value.weight"


@pytest.mark.parametrize("build", [tiny_neox, tiny_bloom])
@pytest.mark.parametrize("blocks", ["matrix", "head"])
def test_each_orthogonalised_block_is_one_query_key_or_value(build, blocks):
    model, capture, name = build()
    roles = capture(copy.deepcopy(model))  # q, k, v: (heads, head_dim) row ids each
    assert sorted(torch.cat([r.flatten() for r in roles]).tolist()) == list(range(3 * HIDDEN))
    assert not torch.equal(roles[0].flatten(), torch.arange(HIDDEN))  # interleaved, not contiguous

    weight = dict(model.named_parameters())[name]
    # Ψ_½ (float32 Newton) rather than Ψ₀ (bf16 Newton–Schulz), whose batched and single results
    # differ by a bf16 ulp: the comparison below is then to float32 round-off.
    opt = SpectralOptimizer(model, "mSGDS", 1.0, 1e-2, qkv_blocks=blocks)
    matrix = opt.param_groups[0]
    assert matrix["qkv_layouts"][matrix["param_names"].index(name)] == "per_head"
    with torch.no_grad():
        weight.zero_()
    grad = torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    weight.grad = grad.clone()
    opt.step()
    update = -weight.detach()
    expected_blocks = [role.flatten() for role in roles] if blocks == "matrix" else \
        [role[head] for role in roles for head in range(HEADS)]
    for rows in expected_blocks:
        torch.testing.assert_close(update[rows], psi(grad[rows], 0.5), rtol=0, atol=1e-6)
    # The contiguous split that the optimizer used before would give other blocks.
    contiguous = torch.cat([psi(block, 0.5) for block in grad.chunk(3, dim=0)])
    assert float((update - contiguous).norm() / contiguous.norm()) > 0.1


def test_unknown_fused_layout_is_not_split_silently():
    class Fused(nn.Module):
        def __init__(self):
            super().__init__()
            self.query_key_value = nn.Linear(8, 24)

    model = Fused()
    with pytest.warns(UserWarning, match="row layout is unknown"):
        opt = SpectralOptimizer(model, "mSGDZ", 1.0, 1e-2)
    assert opt.param_groups[0]["qkv_layouts"] == ["none"]
    declared = SpectralOptimizer(model, "mSGDZ", 1.0, 1e-2, qkv_layout="per_head", num_heads=2)
    assert declared.param_groups[0]["qkv_layouts"] == ["per_head"]
    with pytest.raises(ValueError, match="qkv_layout"):
        SpectralOptimizer(model, "mSGDZ", qkv_layout="interleaved")
    headless = SpectralOptimizer(model, "mSGDZ", 1.0, 1e-2, qkv_layout="per_head")
    model.query_key_value.weight.grad = torch.randn(24, 8)
    with pytest.raises(ValueError, match="number of heads"):
        headless.step()
