"""Attribution arms: the DAVE ladder (input×gradient → W_eff⊙x → Reynolds averaging over warps → noise
schedule → MAD aggregation → post-processing) and the baselines, all on a `Classifier`.

Every arm maps normalised inputs x (B, C, H, W) and targets (B,) to maps (B, H, W). Gradients are taken
with respect to the original, unaugmented x *through* the warp and the noise, and every contribution map
multiplies that gradient by the clean x. Patch-level arms (rollout, GAE, Grad-CAM) are upsampled bilinearly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from icml.methods.explain_vit.config import DaveConfig, EvalConfig
from icml.methods.explain_vit.effective import effective_mode
from icml.methods.explain_vit.model import Classifier

FAMILY = ("weff_eq_lp", "dave_nopost", "dave")  # one set of warped, noisy samples serves all three


@dataclass
class Maps:
    maps: torch.Tensor  # (B, H, W)
    n_backward: int  # backward passes per image


def _target_logit(classifier: Classifier, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return classifier.logits(x).gather(1, targets[:, None])[:, 0]


def input_gradient(classifier: Classifier, x: torch.Tensor, targets: torch.Tensor,
                   transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """∂z_y/∂x of z_y(transform(x)), per row; under `effective_mode` this is W_eff."""
    x = x.detach().clone().requires_grad_(True)
    z = _target_logit(classifier, x if transform is None else transform(x), targets)
    (grad,) = torch.autograd.grad(z.sum(), x)
    return grad


def effective_gradient(classifier: Classifier, x: torch.Tensor, targets: torch.Tensor, transform=None) -> torch.Tensor:
    with effective_mode(classifier.model):
        return input_gradient(classifier, x, targets, transform)


# warps and noise ----------------------------------------------------------------------------------
@dataclass
class Warp:
    """τ: an optional horizontal flip, then an affine warp (bilinear, zero padding) — differentiable."""

    flip: torch.Tensor  # (B,) bool
    theta: torch.Tensor  # (B, 2, 3) affine_grid matrices (output → input coordinates)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.where(self.flip.to(x.device)[:, None, None, None], x.flip(-1), x)  # drawn on the CPU stream
        grid = F.affine_grid(self.theta.to(x), list(x.shape), align_corners=False)
        return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def random_warp(n: int, cfg: DaveConfig, generator: torch.Generator) -> Warp:
    """Flip with p, rotation ±rotate_deg, translation ±translate of the side (any sub-patch offset), scale."""
    u = torch.rand(n, 5, generator=generator, dtype=torch.float64)
    flip = u[:, 0] < cfg.flip_p
    angle = torch.deg2rad((2 * u[:, 1] - 1) * cfg.rotate_deg)
    shift = (2 * u[:, 2:4] - 1) * cfg.translate * 2  # normalised coordinates span 2 per side
    scale = cfg.scale_min + u[:, 4] * (cfg.scale_max - cfg.scale_min)
    cos, sin = torch.cos(angle), torch.sin(angle)
    forward = torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin, cos], -1)], -2) * scale[:, None, None]
    inverse = torch.linalg.inv(forward)  # affine_grid maps output points back to input points
    theta = torch.cat([inverse, -(inverse @ shift[:, :, None])], dim=2)
    return Warp(flip, theta.float())


def noise_levels(n: int, alpha_max: float) -> torch.Tensor:
    """t_s = linspace(0, α_max, N)[s]."""
    return torch.linspace(0.0, alpha_max, n, dtype=torch.float64)


def add_noise(x: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """(1 − t)·x + √(1 − (1 − t)²)·ξ, per row."""
    t = t.to(x)[:, None, None, None]
    return (1 - t) * x + torch.sqrt(1 - (1 - t) ** 2) * noise


# aggregation and post-processing ------------------------------------------------------------------
def mad_mean(stack: torch.Tensor, k: float = 2.5, eps: float = 1e-8) -> torch.Tensor:
    """Element-wise robust mean over dim 0: keep |c − median| ≤ k·(1.4826·MAD + eps), average the kept."""
    median = stack.median(dim=0).values
    deviation = (stack - median).abs()
    mad = deviation.median(dim=0).values
    keep = deviation <= k * (1.4826 * mad + eps)
    return (stack * keep).sum(0) / keep.sum(0).clamp(min=1)


def scaled_kernel(size_224: int, side: int) -> int:
    """A kernel stated for 224 px scaled by side/224, rounded to the nearest odd number ≥ 3."""
    scaled = size_224 * side / 224
    odd = 2 * math.floor(scaled / 2) + 1  # the odd number at or below
    nearest = odd if scaled - odd <= odd + 2 - scaled else odd + 2
    return max(3, nearest)


def gaussian_kernel(size: int, sigma: float, dtype=torch.float32) -> torch.Tensor:
    coords = torch.arange(size, dtype=torch.float64) - size // 2
    g = torch.exp(-coords ** 2 / (2 * sigma ** 2))
    kernel = g[:, None] * g[None, :]
    return (kernel / kernel.sum()).to(dtype)


def gaussian_blur(images: torch.Tensor, size: int, sigma: float, padding: str = "zeros") -> torch.Tensor:
    """Per-channel Gaussian blur of (B, C, H, W); zero padding (the official post-processing) or reflect."""
    channels = images.shape[1]
    kernel = gaussian_kernel(size, sigma, images.dtype).to(images.device).expand(channels, 1, size, size)
    if padding == "reflect":
        return F.conv2d(F.pad(images, [size // 2] * 4, mode="reflect"), kernel, groups=channels)
    return F.conv2d(images, kernel, padding=size // 2, groups=channels)


def bilateral(m: torch.Tensor, size: int, sigma_space: float, sigma_range: float, eps: float = 1e-8) -> torch.Tensor:
    """Bilateral filter of (B, 1, H, W): spatial × range Gaussian weights over a size×size window."""
    b, _, h, w = m.shape
    patches = F.unfold(m, kernel_size=size, padding=size // 2)  # (B, size², H·W)
    centre = m.reshape(b, 1, h * w)
    coords = torch.arange(size, dtype=m.dtype, device=m.device) - size // 2
    spatial = torch.exp(-(coords[:, None] ** 2 + coords[None, :] ** 2) / (2 * sigma_space ** 2)).reshape(1, -1, 1)
    weights = torch.exp(-(patches - centre) ** 2 / (2 * sigma_range ** 2)) * spatial
    return ((weights * patches).sum(1) / (weights.sum(1) + eps)).reshape(b, 1, h, w)


def postprocess(c: torch.Tensor, cfg: DaveConfig) -> torch.Tensor:
    """(B, C, H, W) contributions → (B, H, W): channel sum, ReLU, ½m + ½Gauss(m), bilateral, ÷ max;
    kernels and σ stated for 224 px are scaled by H/224."""
    side = c.shape[-2]
    factor = side / 224
    m = F.relu(c.sum(1, keepdim=True))
    m = 0.5 * m + 0.5 * gaussian_blur(m, scaled_kernel(cfg.gauss_kernel, side), cfg.gauss_sigma * factor)
    m = bilateral(m, scaled_kernel(cfg.bilateral_kernel, side), cfg.bilateral_sigma_space * factor,
                  cfg.bilateral_sigma_range)
    peak = m.flatten(1).max(1).values.clamp(min=1e-12)
    return (m / peak[:, None, None, None])[:, 0]


# the DAVE ladder ----------------------------------------------------------------------------------
def sample_rows(n_images: int, n: int, side: tuple[int, int], chunk: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The rows of the sampled contributions: row r is image r % B, sample r // B; and the rows per
    forward/backward chunk (dave.chunk at 32×32 px, fewer for larger inputs)."""
    rows_image = torch.arange(n_images).repeat(n)
    rows_sample = torch.arange(n).repeat_interleave(n_images)
    return rows_image, rows_sample, max(1, chunk * 1024 // (side[0] * side[1]))


def contribution_chunk(classifier: Classifier, x: torch.Tensor, targets: torch.Tensor, cfg: DaveConfig,
                       alpha_max: float, generator: torch.Generator, levels: torch.Tensor, img: torch.Tensor,
                       smp: torch.Tensor, warps: list | None = None) -> torch.Tensor:
    """c for one chunk of rows (images `img`, samples `smp`): W_eff through a fresh warp and noise, times the
    clean x. Call under `effective_mode`."""
    if warps is None:
        warp = random_warp(len(img), cfg, generator)
    else:
        chosen = [warps[int(s)] for s in smp]
        warp = lambda v, chosen=chosen: torch.cat([w(v[i:i + 1]) for i, w in enumerate(chosen)])
    noise = torch.randn((len(img),) + tuple(x.shape[1:]), generator=generator, dtype=torch.float32)
    t = levels[smp]

    def transform(v, warp=warp, t=t, noise=noise.to(x)):
        warped = warp(v)
        return add_noise(warped, t, noise) if alpha_max > 0 else warped

    return input_gradient(classifier, x[img], targets[img], transform) * x[img]


def sampled_contributions(classifier: Classifier, x: torch.Tensor, targets: torch.Tensor, cfg: DaveConfig,
                          alpha_max: float, generator: torch.Generator, warps: list | None = None) -> torch.Tensor:
    """c_s = W_eff(x; τ_s, t_s) ⊙ x for s < N: (N, B, C, H, W). W_eff is the gradient with respect to the clean
    x through τ_s and the noise; alpha_max = 0 gives the noise-free Reynolds average. `warps` (callables) replaces
    the random warps, e.g. an explicit group for equivariance checks."""
    n = len(warps) if warps is not None else cfg.n_samples
    levels = noise_levels(n, alpha_max)
    rows_image, rows_sample, rows_per_chunk = sample_rows(len(x), n, tuple(x.shape[-2:]), cfg.chunk)
    out = torch.empty((n * len(x),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    with effective_mode(classifier.model):
        for start in range(0, len(rows_image), rows_per_chunk):
            stop = min(len(rows_image), start + rows_per_chunk)
            out[start:stop] = contribution_chunk(classifier, x, targets, cfg, alpha_max, generator, levels,
                                                 rows_image[start:stop], rows_sample[start:stop], warps)
    return out.reshape(n, len(x), *x.shape[1:])


def ladder(classifier: Classifier, x: torch.Tensor, targets: torch.Tensor, arms: list[str], cfg: DaveConfig,
           alpha_max: float, generator: torch.Generator) -> dict[str, Maps]:
    """The requested rungs of the ladder, sharing samples where the spec's rungs share them."""
    out: dict[str, Maps] = {}
    if "input_x_grad" in arms:
        out["input_x_grad"] = Maps((input_gradient(classifier, x, targets) * x).sum(1), 1)
    if "weff" in arms:
        out["weff"] = Maps((effective_gradient(classifier, x, targets) * x).sum(1), 1)
    if "weff_eq" in arms:
        c = sampled_contributions(classifier, x, targets, cfg, 0.0, generator)
        out["weff_eq"] = Maps(c.mean(0).sum(1), cfg.n_samples)
    if any(a in arms for a in FAMILY):
        c = sampled_contributions(classifier, x, targets, cfg, alpha_max, generator)
        if "weff_eq_lp" in arms:
            out["weff_eq_lp"] = Maps(c.mean(0).sum(1), cfg.n_samples)
        robust = mad_mean(c, cfg.mad_k)
        if "dave_nopost" in arms:
            out["dave_nopost"] = Maps(robust.sum(1), cfg.n_samples)
        if "dave" in arms:
            out["dave"] = Maps(postprocess(robust, cfg), cfg.n_samples)
    return out


def dave(classifier: Classifier, x: torch.Tensor, targets: torch.Tensor, cfg: DaveConfig, alpha_max: float,
         generator: torch.Generator) -> torch.Tensor:
    return ladder(classifier, x, targets, ["dave"], cfg, alpha_max, generator)["dave"].maps


# baselines ----------------------------------------------------------------------------------------
def saliency(classifier, x, targets) -> Maps:
    return Maps(input_gradient(classifier, x, targets).abs().sum(1), 1)


def integrated_gradients(classifier, x, targets, steps: int) -> Maps:
    """(x − 0) ⊙ mean_k ∇z_y(α_k x), α_k = (k + ½)/steps (midpoint rule), zero baseline in input space."""
    total = torch.zeros_like(x)
    for k in range(steps):
        total += input_gradient(classifier, x * ((k + 0.5) / steps), targets)
    return Maps((x * total / steps).sum(1), steps)


def smoothgrad(classifier, x, targets, n: int, sigma: float, generator: torch.Generator) -> Maps:
    """|E_ε ∇z_y(x + ε)| summed over channels, ε ~ N(0, (σ·(max − min))²) per image."""
    spread = (x.flatten(1).max(1).values - x.flatten(1).min(1).values)[:, None, None, None] * sigma
    total = torch.zeros_like(x)
    for _ in range(n):
        noise = torch.randn(x.shape, generator=generator, dtype=torch.float32).to(x)
        total += input_gradient(classifier, x, targets, lambda v: v + spread * noise)
    return Maps((total / n).abs().sum(1), n)


def _grid(tokens: torch.Tensor, x: torch.Tensor, patch: int) -> torch.Tensor:
    """Patch scores (B, L) → pixel map (B, H, W) by bilinear upsampling (these arms are patch-level)."""
    h, w = x.shape[-2] // patch, x.shape[-1] // patch
    grid = tokens.reshape(len(tokens), 1, h, w)
    return F.interpolate(grid, size=x.shape[-2:], mode="bilinear", align_corners=False)[:, 0]


def _attention_outputs(classifier: Classifier, x: torch.Tensor):
    interpolate = x.shape[-1] != classifier.size or x.shape[-2] != classifier.size
    return classifier.model(pixel_values=x, interpolate_pos_encoding=interpolate, output_attentions=True,
                            output_hidden_states=True)


def attn_rollout(classifier, x, targets) -> Maps:
    """Per layer: head mean, + I, row-normalise; multiply across layers; the CLS row over patches."""
    with torch.no_grad():
        attentions = _attention_outputs(classifier, x).attentions
    n = attentions[0].shape[-1]
    eye = torch.eye(n, dtype=x.dtype, device=x.device)
    rollout = eye.expand(len(x), n, n)
    for a in attentions:
        a = a.mean(1) + eye
        a = a / a.sum(-1, keepdim=True)
        rollout = a @ rollout
    return Maps(_grid(rollout[:, 0, 1:], x, classifier.patch), 0)


def gae(classifier, x, targets) -> Maps:
    """Chefer et al. 2021: Ā = E_h[(∇A ⊙ A)⁺], R ← R + Ā·R from R = I; the CLS row over patches."""
    x = x.detach()
    outputs = _attention_outputs(classifier, x)
    z = outputs.logits.gather(1, targets[:, None]).sum()
    grads = torch.autograd.grad(z, list(outputs.attentions))
    n = outputs.attentions[0].shape[-1]
    relevance = torch.eye(n, dtype=x.dtype, device=x.device).expand(len(x), n, n)
    for a, g in zip(outputs.attentions, grads):
        a_bar = (g * a).clamp(min=0).mean(1).detach()
        relevance = relevance + a_bar @ relevance
    return Maps(_grid(relevance[:, 0, 1:], x, classifier.patch), 1)


def gradcam(classifier, x, targets) -> Maps:
    """On the last block's token outputs h: w_c = mean over patch tokens of ∂z_y/∂h_c; ReLU(Σ_c w_c h_c)."""
    outputs = _attention_outputs(classifier, x.detach())
    hidden = outputs.hidden_states[-1]
    z = outputs.logits.gather(1, targets[:, None]).sum()
    (grad,) = torch.autograd.grad(z, hidden)
    tokens, grad = hidden[:, 1:].detach(), grad[:, 1:]
    weights = grad.mean(1, keepdim=True)
    return Maps(_grid(F.relu((weights * tokens).sum(-1)), x, classifier.patch), 1)


def random_map(x, generator) -> Maps:
    return Maps(torch.rand((len(x),) + tuple(x.shape[-2:]), generator=generator).to(x), 0)


def explain(classifier: Classifier, x: torch.Tensor, targets: torch.Tensor, arms: list[str], dave_cfg: DaveConfig,
            eval_cfg: EvalConfig, alpha_max: float, generator: torch.Generator) -> dict[str, Maps]:
    """Every requested arm on a batch of normalised inputs."""
    out = ladder(classifier, x, targets, arms, dave_cfg, alpha_max, generator)
    baselines = {
        "saliency": lambda: saliency(classifier, x, targets),
        "integrated_gradients": lambda: integrated_gradients(classifier, x, targets, eval_cfg.ig_steps),
        "smoothgrad": lambda: smoothgrad(classifier, x, targets, eval_cfg.smoothgrad_n, eval_cfg.smoothgrad_sigma,
                                         generator),
        "attn_rollout": lambda: attn_rollout(classifier, x, targets),
        "gae": lambda: gae(classifier, x, targets),
        "gradcam": lambda: gradcam(classifier, x, targets),
        "random": lambda: random_map(x, generator),
    }
    for arm in arms:
        if arm in baselines:
            out[arm] = baselines[arm]()
    return {arm: out[arm] for arm in arms}
