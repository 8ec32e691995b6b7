"""The toy ViT's training recipe: AdamW parameter groups (no decay on LayerNorm, biases, position embeddings,
CLS token), the warm-up-inside-cosine learning-rate schedule, and the issue-24 keys (gradient clipping, the
patch-embedding init) with the spec's recipe as their neutral values."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from icml.methods.explain_vit.config import ExplainVitConfig, preset, validate
from icml.methods.explain_vit.model import Classifier, build_toy, decay_groups, lr_at, train_classifier


def _tiny(hidden: int = 32):
    cfg = preset("smoke")
    cfg.data_cfg.image_size = 16
    cfg.vit.hidden_size, cfg.vit.layers, cfg.vit.heads, cfg.vit.intermediate_size = hidden, 2, 2, 64
    return cfg


def test_decay_groups_exempt_norms_biases_positions_cls():
    cfg = _tiny()
    model = build_toy(cfg, 0)
    decay, no_decay = decay_groups(model, 0.05)
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    ids = {id(p) for p in decay["params"]}
    names = dict(model.named_parameters())
    decayed = {n for n, p in names.items() if id(p) in ids}
    # every parameter lands in exactly one group
    assert len(decay["params"]) + len(no_decay["params"]) == len(names)
    assert all(names[n].ndim >= 2 for n in decayed)
    assert not any("layernorm" in n or n.endswith("bias") or "position_embeddings" in n or "cls_token" in n
                   for n in decayed)
    # the weight matrices and the patch kernel are decayed
    assert "vit.embeddings.patch_embeddings.projection.weight" in decayed
    assert "classifier.weight" in decayed
    assert "vit.layers.0.attention.q_proj.weight" in decayed
    assert "vit.layers.1.mlp.fc2.weight" in decayed
    assert "vit.embeddings.position_embeddings" not in decayed and "vit.embeddings.cls_token" not in decayed
    # a decoupled AdamW step with zero gradient shrinks only the decayed group
    opt = torch.optim.AdamW(decay_groups(model, 0.05), lr=0.1)
    before = {n: p.detach().clone() for n, p in names.items()}
    for p in names.values():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in names.items():
        expected = before[n] * (1 - 0.1 * 0.05) if n in decayed else before[n]
        assert torch.equal(p.detach(), expected), n


def test_lr_schedule_warmup_then_cosine():
    total, base, warmup = 376, 1e-3, 20
    lrs = [lr_at(s, total, base, warmup) for s in range(total)]
    assert lrs[0] == base / warmup and lrs[warmup - 1] == base  # linear ramp reaches the peak
    assert all(b > a for a, b in zip(lrs[:warmup - 1], lrs[1:warmup]))
    assert all(b <= a for a, b in zip(lrs[warmup:], lrs[warmup + 1:]))  # then monotone decay
    mid = warmup + (total - warmup) // 2
    assert math.isclose(lrs[mid], base * 0.5 * (1 + math.cos(math.pi * (mid - warmup) / (total - warmup))),
                        rel_tol=1e-15)
    assert lrs[-1] < base * 1e-3


def test_spec_recipe_is_the_dataclass_default_and_default_preset_uses_issue24_recipe():
    spec = ExplainVitConfig().train
    assert (spec.epochs, spec.grad_clip, spec.patch_init, spec.warmup_steps) == (8, 0.0, "trunc_normal", 20)
    assert (spec.lr, spec.batch_size, spec.weight_decay) == (1e-3, 128, 0.05)
    default = preset("default").train
    assert (default.epochs, default.grad_clip, default.patch_init) == (12, 1.0, "conv_default")
    assert (default.lr, default.batch_size, default.weight_decay, default.warmup_steps) == (1e-3, 128, 0.05, 20)


@pytest.mark.parametrize("key, value, words", [("grad_clip", -1.0, "train.grad_clip"),
                                               ("grad_clip", float("nan"), "train.grad_clip"),
                                               ("patch_init", "xavier", "train.patch_init"),
                                               ("warmup_steps", -1, "train.warmup_steps")])
def test_bad_training_keys_are_one_line_errors(key, value, words):
    cfg = preset("default")
    setattr(cfg.train, key, value)
    with pytest.raises(ValueError) as err:
        validate(cfg)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_conv_default_patch_init_is_pytorch_conv2d_init_and_leaves_the_rest_alone():
    cfg = _tiny(hidden=96)
    cfg.train.patch_init = "trunc_normal"  # transformers' init, the spec's
    spec = build_toy(cfg, 3)
    # the RNG state after building equals the one conv_default's reset_parameters starts from, so a fresh Conv2d of
    # the same shape, drawn now, is exactly what conv_default must produce
    reference = torch.nn.Conv2d(3, 96, kernel_size=4, stride=4)
    cfg.train.patch_init = "conv_default"
    ours = build_toy(cfg, 3)
    projection = ours.vit.embeddings.patch_embeddings.projection
    assert torch.equal(projection.weight, reference.weight) and torch.equal(projection.bias, reference.bias)
    spec_params = dict(spec.named_parameters())
    for name, param in ours.named_parameters():
        if "patch_embeddings.projection" not in name:
            assert torch.equal(param, spec_params[name]), name
    # PyTorch's Conv2d init: weight and bias uniform on ±1/√fan_in (fan_in = 3·4·4), std bound/√3; transformers'
    # is N(0, 0.02), about 4× narrower
    bound = 1 / math.sqrt(48)
    weight = projection.weight.detach().double()
    assert weight.abs().max() <= bound and projection.bias.abs().max() <= bound
    assert abs(weight.std().item() / (bound / math.sqrt(3)) - 1) < 0.03  # 4608 draws: sd of the ratio ≈ 0.007
    spec_weight = spec_params["vit.embeddings.patch_embeddings.projection.weight"].detach().double()
    assert abs(spec_weight.std().item() / 0.02 - 1) < 0.05


def _train_tiny(cfg, monkeypatch):
    calls = []
    original = torch.nn.utils.clip_grad_norm_

    def recording(parameters, max_norm, *args, **kwargs):
        parameters = list(parameters)
        before = original(parameters, float("inf"))  # the norm as it arrives
        total = original(parameters, max_norm, *args, **kwargs)
        after = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in parameters]))
        calls.append((max_norm, float(before), float(total), float(after), len(parameters)))
        return total

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording)
    model = build_toy(cfg, 0)
    classifier = Classifier(model, torch.full((1, 3, 1, 1), 0.5), torch.full((1, 3, 1, 1), 0.5), 16, 4, [])
    rng = np.random.default_rng(0)
    images = rng.random((8, 3, 16, 16), dtype=np.float32)
    labels = rng.integers(0, 6, 8)
    cfg.train.epochs, cfg.train.batch_size = 1, 4
    train_classifier(classifier, images, labels, cfg, 0, "cpu")
    return calls, model


def test_grad_clip_clips_the_global_norm_before_every_step(monkeypatch):
    cfg = _tiny()
    cfg.train.grad_clip = 1e-3  # far below any gradient norm of a fresh model, so clipping is active
    calls, model = _train_tiny(cfg, monkeypatch)
    n_params = sum(1 for p in model.parameters() if p.requires_grad)
    assert len(calls) == 2  # one per optimiser step (8 images, batch 4)
    for max_norm, before, total, after, count in calls:
        assert max_norm == 1e-3 and count == n_params  # every parameter, one global norm
        assert before > 1e-3 and math.isclose(total, before, rel_tol=1e-6)  # returns the unclipped norm
        assert math.isclose(after, 1e-3, rel_tol=1e-4)  # the optimiser sees the clipped norm


def test_grad_clip_zero_is_the_spec_recipe_without_clipping(monkeypatch):
    cfg = _tiny()
    cfg.train.grad_clip = 0.0
    calls, _ = _train_tiny(cfg, monkeypatch)
    assert calls == []
