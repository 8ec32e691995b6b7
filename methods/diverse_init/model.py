"""The class-conditional denoisers, their schedulers, training, loading, and the feature classifier.

Both tiers are diffusers models (`ModelMixin` + `ConfigMixin`), so a trained checkpoint directory
holds `config.json`, the weights and `scheduler_config.json` and reloads like an external model.
The scheduler names the parameterisation: DDIM/DDPM → `eps` (ε-prediction), FlowMatchEuler → `flow`
(x_t = (1−t)x₀ + tε, v = ε − x₀, the model sees the timestep 1000·t as diffusers' flow pipelines do).
"""
from __future__ import annotations

import math
from pathlib import Path

import diffusers
import torch
from diffusers import ModelMixin
from diffusers.configuration_utils import ConfigMixin, register_to_config
from torch import nn

from icml.cli.errors import IcmlError

GMM_CLASSES, DIGIT_CLASSES = 4, 10


def sinusoidal(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The transformer/DDPM sinusoidal embedding of (possibly fractional) timesteps in [0, 1000]."""
    half = dim // 2
    freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, dtype=t.dtype, device=t.device) / half)
    angles = t.reshape(-1, 1) * freqs
    return torch.cat([angles.sin(), angles.cos()], dim=1)


class GmmDenoiser(ModelMixin, ConfigMixin):
    """x (2-d) ⊕ 32-d sinusoidal time ⊕ 32-d class embedding (the last of the 5 entries is null) →
    3 × (128, SiLU) → ε or v."""

    @register_to_config
    def __init__(self, dim: int = 2, hidden: int = 128, time_dim: int = 32, class_dim: int = 32,
                 num_class_embeds: int = GMM_CLASSES + 1):
        super().__init__()
        self.class_embedding = nn.Embedding(num_class_embeds, class_dim)
        self.net = nn.Sequential(nn.Linear(dim + time_dim + class_dim, hidden), nn.SiLU(),
                                 nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(),
                                 nn.Linear(hidden, dim))

    def forward(self, sample, timestep, class_labels):
        t = torch.as_tensor(timestep, dtype=sample.dtype, device=sample.device).expand(sample.shape[0])
        h = torch.cat([sample, sinusoidal(t, self.config.time_dim), self.class_embedding(class_labels)], dim=1)
        return self.net(h)


class ExactGmmDenoiser(nn.Module):
    """The exact ε- (eps) or v-predictor (flow) of the spec's conditional GMM: E[ε | x_t, c] or E[ε − x₀ | x_t, c]
    from the closed-form Gaussian-mixture posterior; the null class (index 4) is the class-balanced marginal,
    which label dropout teaches the learned null. Called like `GmmDenoiser` (x, timestep, class_labels), so
    DivIn's potential can be evaluated on the true data law (the oracle control of the GMM tier)."""

    def __init__(self, scheduler, param: str, sigma: float, dtype=torch.float64):
        super().__init__()
        from icml.methods.diverse_init import data

        self.param, self.sigma, self.scheduler = param, sigma, scheduler
        self.alphas = scheduler.alphas_cumprod.to(dtype) if param == "eps" else None
        weights = torch.zeros(GMM_CLASSES + 1, data.N_COMPONENTS, dtype=dtype)
        for c in range(GMM_CLASSES):
            weights[c, data.class_components(c)] = torch.tensor([data.DOMINANT] + [data.MINORITY] * 3, dtype=dtype)
        weights[GMM_CLASSES] = weights[:GMM_CLASSES].mean(0)  # class-balanced training data
        self.register_buffer("log_weights", weights.log())
        self.register_buffer("means", torch.tensor(data.gmm_means(), dtype=dtype))

    def forward(self, sample, timestep, class_labels):
        """x_t = a·x₀ + b·ε with (a, b) = (√ᾱ_t, √(1−ᾱ_t)) (eps) or (1−σ, σ) (flow, σ of the sampler's step whose
        timestep this is: timesteps are σ·1000 rounded to float32, so dividing by 1000 misses σ by ~1e-8)."""
        t = float(timestep)
        if self.param == "eps":
            alpha = self.alphas[int(round(t))]
            a, b = alpha.sqrt(), (1 - alpha).sqrt()
        else:
            step = int((self.scheduler.timesteps.double() - t).abs().argmin())
            s = self.scheduler.sigmas[step].to(self.means.dtype)
            a, b = 1 - s, s
        var = a ** 2 * self.sigma ** 2 + b ** 2  # of x_t given a component
        x = sample.to(self.means.dtype)
        logits = self.log_weights[class_labels] - (x[:, None, :] - a * self.means).pow(2).sum(-1) / (2 * var)
        resp = torch.softmax(logits, dim=1)  # posterior over components
        x0 = resp @ self.means + (a * self.sigma ** 2 / var) * (x - a * (resp @ self.means))
        eps = (x - a * x0) / b
        return (eps if self.param == "eps" else eps - x0).to(sample.dtype)


def build_gmm(hidden: int, seed: int):
    torch.manual_seed(seed)
    return GmmDenoiser(hidden=hidden)


def build_unet(block_out_channels, seed: int, sample_size: int = 16):
    torch.manual_seed(seed)
    return diffusers.UNet2DModel(sample_size=sample_size, in_channels=1, out_channels=1,
                       block_out_channels=tuple(block_out_channels), layers_per_block=1,
                       down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
                       up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
                       num_class_embeds=DIGIT_CLASSES + 1)


def make_scheduler(param: str, beta_schedule: str = "scaled_linear", train_timesteps: int = 1000):
    """eps: SD1's DDIM (scaled-linear β 0.00085→0.012, leading spacing, offset 1: 50 steps start at 981);
    flow: FlowMatchEuler with uniform sigmas from 1."""
    if param == "eps":
        return diffusers.DDIMScheduler(num_train_timesteps=train_timesteps, beta_schedule=beta_schedule, beta_start=0.00085,
                             beta_end=0.012, clip_sample=False, set_alpha_to_one=False, steps_offset=1,
                             timestep_spacing="leading", prediction_type="epsilon")
    return diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=train_timesteps, shift=1.0)


# training --------------------------------------------------------------------------------------------
def train_denoiser(model, scheduler, param: str, data: torch.Tensor, labels: torch.Tensor, *, null: int,
                   steps: int, batch_size: int, lr: float, label_dropout: float, seed: int, on_step=None):
    """ε-prediction (‖ε_θ(x_t, t, c) − ε‖²) or rectified flow (‖v_θ(x_t, 1000t, c) − (ε − x₀)‖², t ~ U(0,1)),
    with the label replaced by the null class with probability `label_dropout` (what CFG needs)."""
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 100))  # short warm-up
    alphas = scheduler.alphas_cumprod.to(data.dtype) if param == "eps" else None
    model.train()
    for step in range(steps):
        idx = torch.randint(0, len(data), (batch_size,), generator=gen)
        x0, c = data[idx], labels[idx].clone()
        c[torch.rand(batch_size, generator=gen) < label_dropout] = null
        noise = torch.randn(x0.shape, generator=gen, dtype=x0.dtype)
        shape = (-1,) + (1,) * (x0.dim() - 1)
        if param == "eps":
            t = torch.randint(0, len(alphas), (batch_size,), generator=gen)
            a = alphas[t].view(shape)
            x_t, target, model_t = a.sqrt() * x0 + (1 - a).sqrt() * noise, noise, t
        else:
            t = torch.rand(batch_size, generator=gen, dtype=x0.dtype)
            s = t.view(shape)
            x_t, target, model_t = (1 - s) * x0 + s * noise, noise - x0, t * scheduler.config.num_train_timesteps
        out = model(x_t, model_t, class_labels=c)
        out = getattr(out, "sample", out)
        loss = (out - target).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if on_step is not None:
            on_step(step, float(loss.detach()))
    model.eval()
    return model


def save_checkpoint(model, scheduler, path: Path) -> None:
    model.save_pretrained(path)
    scheduler.save_pretrained(path)


# loading a checkpoint or a user's directory ------------------------------------------------------------
def load_checkpoint(path, null_class: int | None = None):
    """(model, scheduler, param, null, conditional) from a model dir (config.json + scheduler_config.json)
    or a pipeline dir (unet/ + scheduler/), after the header checks of `config.check_checkpoint` (which
    `check_inputs` ran on a user's --model before the run existed). Raises IcmlError with one line."""
    from icml.methods.diverse_init.config import check_checkpoint

    ckpt = check_checkpoint(path, null_class)
    if ckpt.param == "eps":  # the β table of any ε scheduler, sampled with DDIM (η = 0, no clipping)
        scheduler = diffusers.DDIMScheduler.from_config({**ckpt.scheduler, "clip_sample": False})
    else:
        scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_config(ckpt.scheduler)
    model_class = diffusers.UNet2DModel if ckpt.model_class == "UNet2DModel" else GmmDenoiser
    try:
        model = model_class.from_pretrained(ckpt.model_dir, local_files_only=True, low_cpu_mem_usage=False)
    except (OSError, ValueError, RuntimeError) as exc:  # headers pass but the tensors do not fit the config
        raise IcmlError(f"cannot load '{ckpt.model_dir}': {str(exc).splitlines()[0]}",
                        "re-save it with save_pretrained") from None
    model.eval().requires_grad_(False)
    return model, scheduler, ckpt.param, ckpt.null, ckpt.null is not None


# the feature classifier ----------------------------------------------------------------------------------
class FeatureCNN(nn.Module):
    """Two conv blocks (32, 64 channels) → a 64-d penultimate layer (the metric feature space) → 10 classes."""

    def __init__(self, classes: int = DIGIT_CLASSES):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Flatten(), nn.Linear(64 * 4 * 4, 64), nn.ReLU())
        self.head = nn.Linear(64, classes)

    def features(self, x):
        return self.body(x)

    def forward(self, x):
        return self.head(self.body(x))


def train_classifier(images, labels, steps: int, seed: int, batch_size: int = 64, lr: float = 2e-3):
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    net = FeatureCNN()
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    for _ in range(steps):
        idx = torch.randint(0, len(images), (batch_size,), generator=gen)
        x = images[idx]
        shift = torch.randint(-1, 2, (2,), generator=gen)  # ±1 px jitter: generated digits are not centred exactly
        x = torch.roll(x, shifts=(int(shift[0]), int(shift[1])), dims=(2, 3))
        loss = nn.functional.cross_entropy(net(x), labels[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return net.eval().requires_grad_(False)
