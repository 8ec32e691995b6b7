"""The 2-D 8-Gaussian toy (spec: Data, Toy): the scene MeanFlow and flow-matching code of `meanflow.py`, run on
one 2-D "agent" node per sample and no lanes, and scored by the energy distance to the mixture."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn

from . import meanflow
from .models import mlp, sinusoidal

RADIUS, STD = 2.0, 0.1  # [S] centres on a circle of radius 2, component std 0.1
TOY_VARIANTS = {"meanflow_1": ("meanflow", "meanflow", 1), "meanflow_3": ("meanflow", "meanflow", 3),
                "flow_heun24": ("flow", "heun", 24), "flow_euler1": ("flow", "euler", 1)}


def mixture(n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """n draws from the equal-weight mixture of 8 isotropic Gaussians at angles 2πk/8."""
    k = torch.randint(0, 8, (n,), generator=generator)
    angle = 2 * math.pi * k.double() / 8
    centres = RADIUS * torch.stack([angle.cos(), angle.sin()], 1)
    return (centres + STD * torch.randn(n, 2, generator=generator, dtype=torch.float64)).float()


def energy_distance(x: torch.Tensor, y: torch.Tensor) -> float:
    """Energy distance 2E‖X−Y‖ − E‖X−X'‖ − E‖Y−Y'‖ with the within-sample means over distinct pairs (the
    U-statistic: unbiased, 0 in expectation for equal laws)."""
    x, y = x.double(), y.double()
    n, m = len(x), len(y)
    xy = torch.cdist(x, y).mean()
    xx = torch.cdist(x, x).sum() / (n * (n - 1))
    yy = torch.cdist(y, y).sum() / (m * (m - 1))
    return float(2 * xy - xx - yy)


class ToyNet(nn.Module):
    """u_θ(z, r, t) on 2-D points, with the scene models' call signature (lanes: none; one agent node)."""

    n_labels = 0

    def __init__(self, hidden: int = 128, emb: int = 32):
        super().__init__()
        self.emb = emb
        self.net = mlp([2 + 2 * emb, hidden, hidden, hidden, 2])

    def forward(self, zl, za, r, t, cond):
        c = torch.cat([sinusoidal(t, self.emb), sinusoidal(t - r, self.emb)], -1).to(za.dtype)
        return torch.zeros_like(zl), self.net(torch.cat([za[:, 0], c], -1))[:, None]


def _cond(n: int) -> dict:
    return dict(lane_mask=torch.zeros(n, 0, dtype=torch.bool), agent_mask=torch.ones(n, 1, dtype=torch.bool),
                label=torch.zeros(n, dtype=torch.long))


def toy_loss(model, x, cfg, mode, generator):
    n = len(x)
    no_lanes = torch.zeros(n, 0, 1)
    return meanflow.scene_loss(model, no_lanes, x[:, None], _cond(n), torch.zeros(n, 0, dtype=torch.bool),
                               torch.zeros(n, 1, dtype=torch.bool), cfg, mode, generator)


def toy_sample(model, n: int, solver: str, steps: int, clamp: float, generator=None) -> torch.Tensor:
    """The scene sampler without guidance (the toy has no labels)."""
    _, za = meanflow.sample(model, _cond(n), 1, 2, steps, solver, 1.0, clamp, generator=generator)
    return za[:, 0]


def toy_scores(models: dict, n: int, clamp: float, seed: int) -> tuple[dict, dict]:
    """Energy distance of n samples per variant to n fresh mixture draws; the samples for the report."""
    gen = torch.Generator().manual_seed(seed)
    reference = mixture(n, gen)
    samples, scores = {}, {}
    for variant, (name, solver, steps) in TOY_VARIANTS.items():
        samples[variant] = toy_sample(models[name], n, solver, steps, clamp, gen)
        scores[variant] = energy_distance(samples[variant], reference)
    samples["mixture"] = reference
    return scores, {k: np.asarray(v) for k, v in samples.items()}
