"""The toy ViT's training recipe: AdamW parameter groups (no decay on LayerNorm, biases, position embeddings,
CLS token) and the warm-up-inside-cosine learning-rate schedule."""
from __future__ import annotations

import math

import torch

from icml.methods.explain_vit.config import preset
from icml.methods.explain_vit.model import build_toy, decay_groups, lr_at


def test_decay_groups_exempt_norms_biases_positions_cls():
    cfg = preset("smoke")
    cfg.data_cfg.image_size = 16
    cfg.vit.hidden_size, cfg.vit.layers, cfg.vit.heads, cfg.vit.intermediate_size = 32, 2, 2, 64
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
