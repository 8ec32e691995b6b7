"""The tiny video flow-matching generator: a diffusers UNet2DModel with the T frames stacked in
channels (3T), class-conditioned on a prompt id (the null prompt is the last class).

Flow matching (rectified flow): x_t = (1 − t)·x₀ + t·ε, the network predicts v = ε − x₀.
Generation integrates dx/dt = v from t = 1 (noise) to t = 0 with Euler steps and
classifier-free guidance v = v_null + w·(v_prompt − v_null).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from icml.cli.errors import IcmlError
from icml.data.videos import NULL_PROMPT

TIME_SCALE = 1000.0  # the UNet's sinusoidal time embedding expects diffusion-step-sized inputs


def build_unet(frames: int, size: int, block_out_channels: list[int], layers_per_block: int, seed: int):
    from diffusers import UNet2DModel

    torch.manual_seed(seed)
    return UNet2DModel(sample_size=size, in_channels=3 * frames, out_channels=3 * frames,
                       block_out_channels=tuple(block_out_channels), layers_per_block=layers_per_block,
                       down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
                       up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
                       num_class_embeds=NULL_PROMPT + 1, norm_num_groups=min(32, block_out_channels[0]))


def load_unet(path: str | Path, frames: int, size: int):
    from diffusers import UNet2DModel
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()  # no advice about optional packages on every load
    try:
        model = UNet2DModel.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise IcmlError(f"model '{path}' cannot be loaded as a UNet2DModel ({type(exc).__name__})",
                        "pass a directory written by UNet2DModel.save_pretrained") from None
    config = model.config
    if config.in_channels != 3 * frames or config.out_channels != 3 * frames:
        raise IcmlError(f"model '{path}' has {config.in_channels} input channels; this run stacks {frames} frames "
                        f"(needs {3 * frames})", f"use --set clips.frames={config.in_channels // 3}")
    if (config.num_class_embeds or 0) < NULL_PROMPT + 1:
        raise IcmlError(f"model '{path}' has {config.num_class_embeds} class embeddings; needs {NULL_PROMPT + 1}",
                        "save a class-conditional UNet2DModel with num_class_embeds=22")
    return model


def to_channels(videos: torch.Tensor) -> torch.Tensor:
    """(N, T, H, W, 3) → (N, 3T, H, W), channel index 3·f + c."""
    n, t, h, w, c = videos.shape
    return videos.permute(0, 1, 4, 2, 3).reshape(n, t * c, h, w)


def to_frames(stacked: torch.Tensor) -> torch.Tensor:
    """(N, 3T, H, W) → (N, T, H, W, 3)."""
    n, tc, h, w = stacked.shape
    return stacked.reshape(n, tc // 3, 3, h, w).permute(0, 1, 3, 4, 2)


def frame_weights(valid: torch.Tensor) -> torch.Tensor:
    """(N, T) validity → (N, 3T, 1, 1): padded frames carry zero loss."""
    return valid.float().repeat_interleave(3, dim=1)[..., None, None]


def velocity(model, x_t: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return model(x_t, t * TIME_SCALE, class_labels=labels).sample


def fm_loss(model, x0, valid, labels, t, eps) -> torch.Tensor:
    """Unmasked flow-matching loss per clip: mean squared velocity error over the valid frames."""
    x_t = (1 - t)[:, None, None, None] * x0 + t[:, None, None, None] * eps
    error = (velocity(model, x_t, t, labels) - (eps - x0)) ** 2
    weight = frame_weights(valid)
    return (error * weight).sum((1, 2, 3)) / (weight.sum((1, 2, 3)) * x0.shape[2] * x0.shape[3])


def train_fm(model, videos: torch.Tensor, valid: torch.Tensor, labels: torch.Tensor, *, steps: int, batch_size: int,
             lr: float, label_dropout: float, seed: int, on_step=None) -> list[float]:
    """AdamW on the unmasked FM loss. The batch order, t and ε come from `seed` alone, so every
    fine-tuning arm sees the same random stream and differs only in its clips."""
    x_all = to_channels(videos)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for step in range(steps):
        idx = torch.randint(len(x_all), (batch_size,), generator=gen)
        x0, v, y = x_all[idx], valid[idx], labels[idx].clone()
        drop = torch.rand(batch_size, generator=gen) < label_dropout
        y[drop] = NULL_PROMPT
        t = torch.rand(batch_size, generator=gen)
        eps = torch.randn(x0.shape, generator=gen)
        loss = fm_loss(model, x0, v, y, t, eps).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    return losses


@torch.no_grad()
def heldout_loss(model, videos: torch.Tensor, valid: torch.Tensor, labels: torch.Tensor, seed: int,
                 batch: int = 64) -> float:
    """Unmasked FM loss on held-out clips at fixed (t, ε) draws from `seed` (same for every arm)."""
    model.eval()
    x0 = to_channels(videos)
    gen = torch.Generator().manual_seed(seed)
    t = torch.rand(len(x0), generator=gen)
    eps = torch.randn(x0.shape, generator=gen)
    total = 0.0
    for start in range(0, len(x0), batch):
        part = slice(start, start + batch)
        total += float(fm_loss(model, x0[part], valid[part], labels[part], t[part], eps[part]).sum())
    return total / len(x0)


@torch.no_grad()
def generate(model, labels: torch.Tensor, frames: int, size: int, *, steps: int, cfg_scale: float, seed: int,
             batch: int = 64) -> torch.Tensor:
    """Euler sampling with CFG from shared noise (seed) → videos (N, T, H, W, 3) in [−1, 1]."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn((len(labels), 3 * frames, size, size), generator=gen)
    out = []
    for start in range(0, len(labels), batch):
        x = noise[start:start + batch].clone()
        y = labels[start:start + batch]
        null = torch.full_like(y, NULL_PROMPT)
        dt = 1.0 / steps
        for i in range(steps):
            t = torch.full((len(x),), 1.0 - i * dt)
            v = velocity(model, torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, null]))
            v_prompt, v_null = v.chunk(2)
            x = x - dt * (v_null + cfg_scale * (v_prompt - v_null))
        out.append(x.clamp(-1, 1))
    return to_frames(torch.cat(out))


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def seed_of(*parts: int) -> int:
    """A 63-bit seed from integers (stable across runs and platforms)."""
    value = 1469598103934665603
    for part in parts:
        value = (value ^ (int(part) & 0xFFFFFFFF)) * 1099511628211 % (2**63)
    return value


def as_tensor(array: np.ndarray, dtype=torch.float32) -> torch.Tensor:
    return torch.as_tensor(np.ascontiguousarray(array), dtype=dtype)

