"""The paper preset's path (documented, not run offline): DivIn latents for a local Stable Diffusion
pipeline, passed to the pipeline as `latents=`; the pipeline's own sampler is untouched.

    from diffusers import StableDiffusionPipeline
    pipe = StableDiffusionPipeline.from_pretrained(PATH, local_files_only=True).to("cuda")
    latents = divin_latents(pipe, "a photo of a goldfish", n=10, seed=0)          # SD1.4: η 0.05, τ 0.6, K 1
    images = pipe("a photo of a goldfish", latents=latents, guidance_scale=7.5, num_inference_steps=50).images

SD3.5-M (`StableDiffusion3Pipeline`): the same call with eta=0.01, tau=0.1, steps=28, guidance 7.0; the
transformer predicts v, so x̂₀ = z − σ₀·v at the first sigma.
"""
from __future__ import annotations

import torch

from icml.methods.diverse_init import divin


class PromptDenoiser(divin.Denoiser):
    """A text-conditional UNet2DConditionModel / SD3 transformer as a Denoiser: `pair` runs the prompt and
    the empty prompt as one batch."""

    def __init__(self, pipe, cond: dict, uncond: dict):
        super().__init__(getattr(pipe, "unet", None) or pipe.transformer, null=None, conditional=True)
        self.cond, self.uncond, self.sd3 = cond, uncond, not hasattr(pipe, "unet")

    def pair(self, x, t, labels=None):
        kwargs = {k: torch.cat([self.cond[k], self.uncond[k]]) for k in self.cond}
        t = torch.as_tensor(t, device=x.device).expand(2 * len(x))
        if self.sd3:
            out = self.model(hidden_states=torch.cat([x, x]), timestep=t, **kwargs).sample
        else:
            out = self.model(torch.cat([x, x]), t, **kwargs).sample
        return out.chunk(2)


def divin_latents(pipe, prompt: str, *, n: int, seed: int, eta: float = 0.05, tau: float = 0.6, k_steps: int = 1,
                  steps: int = 50, kind: str = "sq") -> torch.Tensor:
    """n DivIn initial latents for one prompt, each from its own seed stream (as in the workbench)."""
    device = pipe.device
    sd3 = not hasattr(pipe, "unet")
    if sd3:
        embeds, neg, pooled, neg_pooled = pipe.encode_prompt(prompt, prompt, prompt, device=device,
                                                             num_images_per_prompt=n, do_classifier_free_guidance=True)
        cond = {"encoder_hidden_states": embeds, "pooled_projections": pooled}
        uncond = {"encoder_hidden_states": neg, "pooled_projections": neg_pooled}
        channels, param = pipe.transformer.config.in_channels, "flow"
    else:
        embeds, neg = pipe.encode_prompt(prompt, device, n, True)
        cond, uncond = {"encoder_hidden_states": embeds}, {"encoder_hidden_states": neg}
        channels, param = pipe.unet.config.in_channels, "eps"
    size = pipe.default_sample_size if sd3 else pipe.unet.config.sample_size
    den = PromptDenoiser(pipe, cond, uncond)
    sched = divin.Schedule(pipe.scheduler, param, steps)
    seeds = [divin.sample_seed(seed, i) for i in range(n)]
    z = divin.initial_noise(seeds, (channels, size, size)).to(device, den.model.dtype)
    z = z * getattr(pipe.scheduler, "init_noise_sigma", 1.0)
    return divin.divin_init(den, sched, z, None, seeds, tau=tau, eta=eta, k_steps=k_steps, kind=kind).z
