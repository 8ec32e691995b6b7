"""The tiny video flow-matching generator: a diffusers UNet2DModel with the T frames stacked in
channels (3T), class-conditioned on a prompt id (the null prompt is the last class), and diffusers'
`FlowMatchEulerDiscreteScheduler` (shift 1) for both the forward process and sampling.

Flow matching (rectified flow): x_σ = (1 − σ)·x₀ + σ·ε (`scheduler.scale_noise`), the network sees the
scheduler's timestep 1000·σ and predicts v = ε − x₀. Generation is the scheduler's Euler steps from
σ = 1 to 0 with classifier-free guidance v = v_null + w·(v_prompt − v_null) (`MotionPipeline`). A run's
base is saved as a pipeline directory: model_index.json, unet/ and scheduler/.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from icml.cli import distributed
from icml.cli.errors import IcmlError
from icml.data.videos import NULL_PROMPT

TRAIN_TIMESTEPS = 1000  # the scheduler's table: timesteps 1000, 999, …, 1 = 1000·σ


def make_scheduler(config: dict | None = None):
    """The training-table scheduler (no set_timesteps): its `scale_noise` is the forward process."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if config is not None:
        return FlowMatchEulerDiscreteScheduler.from_config(config)
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=TRAIN_TIMESTEPS, shift=1.0)


_TRAINING_SCHEDULER = None


def training_scheduler():
    global _TRAINING_SCHEDULER
    if _TRAINING_SCHEDULER is None:
        _TRAINING_SCHEDULER = make_scheduler()
    return _TRAINING_SCHEDULER


def timesteps_of(sigma: torch.Tensor) -> torch.Tensor:
    """σ ∈ (0, 1] → the nearest entry of the scheduler's table (≈ 1000·σ; the table holds σ·1000 in float32,
    e.g. 522.99994 for σ = 0.523, and `scale_noise` looks timesteps up by equality)."""
    table = training_scheduler().timesteps
    wanted = torch.as_tensor(sigma, dtype=torch.float32) * TRAIN_TIMESTEPS
    return table[(table[None, :] - wanted.reshape(-1, 1)).abs().argmin(1)].reshape(wanted.shape)


def add_noise(x0: torch.Tensor, eps: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    """x_σ = (1 − σ)·x₀ + σ·ε by the scheduler (σ = timestep / 1000)."""
    return training_scheduler().scale_noise(x0, timesteps, eps)


def pipeline_class():
    """`MotionPipeline(unet, scheduler)`: a DiffusionPipeline, so save_pretrained / from_pretrained write and
    read model_index.json with unet/ and scheduler/ beside it (built lazily: diffusers is heavy to import)."""
    global _PIPELINE
    if _PIPELINE is not None:
        return _PIPELINE
    from diffusers import DiffusionPipeline

    class MotionPipeline(DiffusionPipeline):
        """Class-conditional stacked-frame video flow model; `__call__` is Euler + CFG by the scheduler."""

        def __init__(self, unet, scheduler):
            super().__init__()
            self.register_modules(unet=unet, scheduler=scheduler)

        @torch.no_grad()
        def __call__(self, labels: torch.Tensor, *, steps: int, cfg_scale: float, noise: torch.Tensor) -> torch.Tensor:
            self.unet.eval()
            self.scheduler.set_timesteps(steps)
            x = noise.clone()
            null = torch.full_like(labels, NULL_PROMPT)
            for t in self.scheduler.timesteps:
                v = self.unet(torch.cat([x, x]), t.expand(2 * len(x)), class_labels=torch.cat([labels, null])).sample
                v_prompt, v_null = v.chunk(2)
                x = self.scheduler.step(v_null + cfg_scale * (v_prompt - v_null), t, x).prev_sample
            return x

    MotionPipeline.__module__ = __name__
    _PIPELINE = MotionPipeline
    return _PIPELINE


_PIPELINE = None


def save_pipeline(model, path: str | Path, scheduler=None) -> None:
    pipeline_class()(unet=model, scheduler=scheduler or make_scheduler()).save_pretrained(str(path))


def build_unet(frames: int, size: int, block_out_channels: list[int], layers_per_block: int, seed: int):
    from diffusers import UNet2DModel

    torch.manual_seed(seed)
    return UNet2DModel(sample_size=size, in_channels=3 * frames, out_channels=3 * frames,
                       block_out_channels=tuple(block_out_channels), layers_per_block=layers_per_block,
                       down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
                       up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
                       num_class_embeds=NULL_PROMPT + 1, norm_num_groups=min(32, block_out_channels[0]))


def load_unet(path: str | Path, frames: int, size: int):
    """The stacked-frame UNet of a pipeline directory (model_index.json with unet/ and a flow-matching
    scheduler/, as `save_pipeline` writes) or of a bare UNet2DModel directory (config.json), after the
    header checks of `config.check_unet_dir` (which `check_inputs` ran before the run existed)."""
    from diffusers import UNet2DModel
    from diffusers.utils import logging as diffusers_logging

    from icml.methods.attribute_motion.config import check_unet_dir

    check_unet_dir(path, frames)  # again: the directory may have changed since, and the run's own base passes here
    diffusers_logging.set_verbosity_error()  # no advice about optional packages on every load
    subfolder = "unet" if (Path(path) / "model_index.json").is_file() else None
    try:
        return UNet2DModel.from_pretrained(str(path), subfolder=subfolder, local_files_only=True)
    except Exception as exc:  # headers pass but the tensors do not fit the config: name the folder, not a traceback
        raise IcmlError(f"model '{path}' cannot be loaded as a UNet2DModel ({type(exc).__name__})",
                        "pass a pipeline directory (model_index.json, unet/, scheduler/) or a UNet2DModel.save_pretrained "
                        "directory") from None


def to_channels(videos: torch.Tensor) -> torch.Tensor:
    """(N, T, H, W, 3) → (N, 3T, H, W), channel index 3·f + c."""
    n, t, h, w, c = videos.shape
    return videos.permute(0, 1, 4, 2, 3).reshape(n, t * c, h, w)


def to_frames(stacked: torch.Tensor) -> torch.Tensor:
    """(N, 3T, H, W) → (N, T, H, W, 3)."""
    n, tc, h, w = stacked.shape
    return stacked.reshape(n, tc // 3, 3, h, w).permute(0, 1, 3, 4, 2)


def velocity(model, x_t: torch.Tensor, timesteps: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return model(x_t, timesteps, class_labels=labels).sample


class StackedFrames:
    """The loss space of the stacked-frame UNet: a clip is x₀ = its frames stacked in channels (N, 3T, H, W),
    a pixel mask (N, T, H, W) weighs the three channels of its frame, the condition is the prompt id.

    The Wan path (`wan.WanSpace`) offers the same methods in the VAE latent space of a WanPipeline, so the
    loss, the gradients and the fine-tuning loop below are one code path for both."""

    def __init__(self, model):
        self.model = model

    def with_model(self, model) -> "StackedFrames":
        return StackedFrames(model)

    def parameters(self) -> list:
        """Every denoiser parameter except the class-embedding table (its rows would leak the label)."""
        return [(name, p) for name, p in self.model.named_parameters() if not name.startswith("class_embedding")]

    def encode(self, videos: torch.Tensor) -> torch.Tensor:
        return to_channels(videos)

    @staticmethod
    def loss_mask(mask: torch.Tensor) -> torch.Tensor:
        """(N, T, H, W) → (N, 3T, H, W): the same weight on the three colour channels of a frame."""
        return mask.repeat_interleave(3, dim=1)

    def condition(self, labels: torch.Tensor) -> torch.Tensor:
        return labels

    def denoise(self, x_t: torch.Tensor, timesteps: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        return velocity(self.model, x_t, timesteps, condition)

    def generate(self, labels: torch.Tensor, frames: int, size: int, *, steps: int, cfg_scale: float,
                 seed: int) -> torch.Tensor:
        return generate(self.model, labels, frames, size, steps=steps, cfg_scale=cfg_scale, seed=seed)


def as_space(model):
    """A loss space (StackedFrames, wan.WanSpace) as it is, a bare stacked-frame UNet wrapped."""
    return model if hasattr(model, "denoise") else StackedFrames(model)


def masked_fm_loss(denoiser, x0: torch.Tensor, eps: torch.Tensor, timesteps: torch.Tensor, labels: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
    """L_mot per clip = Σ M ⊙ (v_θ(x_t, t, c) − (ε − x₀))² over every non-batch axis (stacked clips (N, 3T, H, W)
    or Wan latents (N, C, T', h, w)), x_t the scheduler's forward process at `timesteps` (1000·t); the per-clip
    1/Z(x) is applied to the projected gradient (`attribution.influence`).

    The mask weights the loss; the network always sees the whole, unmasked x_t."""
    x_t = add_noise(x0, eps, timesteps)
    error = (denoiser(x_t, timesteps, labels) - (eps - x0)) ** 2
    return (mask * error).flatten(1).sum(1)


def validity_weights(space, valid: torch.Tensor, videos: torch.Tensor) -> torch.Tensor:
    """The loss-space weights of the valid frames of clips (N, T, H, W, 3): padded frames carry zero loss."""
    n, t, h, w = videos.shape[:4]
    return space.loss_mask(valid.float()[..., None, None].expand(n, t, h, w))


def fm_loss(space, x0, weight, labels, timesteps, eps) -> torch.Tensor:
    """Unmasked flow-matching loss per clip: the mean squared velocity error over the valid frames
    (`weight` = `validity_weights`): the masked loss with the validity weights, per unit of weight."""
    return masked_fm_loss(space.denoise, x0, eps, timesteps, space.condition(labels), weight) / weight.flatten(1).sum(1)


def train_fm(model, videos: torch.Tensor, valid: torch.Tensor, labels: torch.Tensor, *, steps: int, batch_size: int,
             lr: float, label_dropout: float, seed: int, data_parallel: bool = False, on_step=None) -> list[float]:
    """AdamW on the unmasked FM loss, in the space of `model` (a stacked-frame UNet or a `wan.WanSpace`,
    whose clips are VAE-encoded once). The batch order, t and ε come from `seed` alone, so every
    fine-tuning arm sees the same random stream and differs only in its clips.

    `data_parallel` (train's pretraining; eval's fine-tunes run in one process): under torchrun every
    rank draws the same global batch from that stream and computes the loss of its equal slice
    (`distributed.shard`); the mean of the ranks' gradients (`distributed.average_gradients`, not a DDP
    wrapper: the loss goes through `space`, which for Wan is not one module) is the global batch's, and
    clipping and AdamW then act as in one process. Without torchrun those calls are the identity."""
    space = as_space(model)
    x_all = space.encode(videos)
    w_all = validity_weights(space, valid, videos)
    gen = torch.Generator().manual_seed(seed)
    params = [p for _, p in space.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    space.model.train()
    losses = []
    for step in range(steps):
        idx = torch.randint(len(x_all), (batch_size,), generator=gen)
        x0, w, y = x_all[idx], w_all[idx].to(x_all.device), labels[idx].clone()
        drop = torch.rand(batch_size, generator=gen) < label_dropout
        y[drop] = NULL_PROMPT
        t = training_scheduler().timesteps[torch.randint(TRAIN_TIMESTEPS, (batch_size,), generator=gen)]
        eps = torch.randn(x0.shape, generator=gen).to(x0.device)
        t = t.to(x0.device)
        if data_parallel:  # this rank's rows of the global batch
            x0, w, y, t, eps = (distributed.shard(part) for part in (x0, w, y, t, eps))
        loss = fm_step(space, params, opt, x0, w, y, t, eps, data_parallel)
        value = float(loss.detach())
        losses.append(distributed.mean(value) if data_parallel else value)  # the global batch's, on every rank
        if on_step is not None:
            on_step(step, losses[-1])
    space.model.eval()
    return losses


def fm_step(space, params, opt, x0, w, y, t, eps, data_parallel: bool = False) -> torch.Tensor:
    """One AdamW step of `train_fm` on a batch (x0, validity weights w, prompt ids y, timesteps t, noise eps);
    returns the batch's loss (a tensor: reading it is the caller's)."""
    loss = fm_loss(space, x0, w, y, t, eps).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if data_parallel:
        distributed.average_gradients(params)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return loss


@torch.no_grad()
def heldout_loss(model, videos: torch.Tensor, valid: torch.Tensor, labels: torch.Tensor, seed: int,
                 batch: int = 64) -> float:
    """Unmasked FM loss on held-out clips at fixed (t, ε) draws from `seed` (same for every arm)."""
    space = as_space(model)
    batch = getattr(space, "eval_batch", batch)
    space.model.eval()
    x0 = space.encode(videos)
    weight = validity_weights(space, valid, videos).to(x0.device)
    gen = torch.Generator().manual_seed(seed)
    t = training_scheduler().timesteps[torch.randint(TRAIN_TIMESTEPS, (len(x0),), generator=gen)].to(x0.device)
    eps = torch.randn(x0.shape, generator=gen).to(x0.device)
    total = 0.0
    for start in range(0, len(x0), batch):
        part = slice(start, start + batch)
        total += float(fm_loss(space, x0[part], weight[part], labels[part], t[part], eps[part]).sum())
    return total / len(x0)


def generate(model, labels: torch.Tensor, frames: int, size: int, *, steps: int, cfg_scale: float, seed: int,
             batch: int = 64, scheduler=None) -> torch.Tensor:
    """Euler sampling with CFG (`MotionPipeline`) from shared noise (seed) → videos (N, T, H, W, 3) in [−1, 1]."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn((len(labels), 3 * frames, size, size), generator=gen)
    pipe = pipeline_class()(unet=model, scheduler=make_scheduler(scheduler.config if scheduler is not None else None))
    out = [pipe(labels[start:start + batch], steps=steps, cfg_scale=cfg_scale, noise=noise[start:start + batch])
           for start in range(0, len(labels), batch)]
    return to_frames(torch.cat(out).clamp(-1, 1))


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

