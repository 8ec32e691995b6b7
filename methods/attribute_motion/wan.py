"""The Wan path of `--preset paper`: Motive on a local diffusers WanPipeline directory (Wan2.1-T2V-1.3B-Diffusers,
Wan2.2-TI2V-5B-Diffusers, or any `WanPipeline.save_pretrained` folder).

`WanSpace` is the loss space of `model.StackedFrames` for a WanPipeline, so the masked flow-matching loss,
the per-clip gradients, the projection, influence, vote and the fine-tuning loop are the toy path's own
functions (attribution.py, model.py):
- x₀ is a clip's VAE latent: `AutoencoderKLWan.encode(video).latent_dist.mode()`, normalised with the VAE's
  latents_mean / latents_std exactly as `WanPipeline.__call__` un-normalises before decoding;
- the motion mask (pixels) is pooled to the latent grid, `flow.latent_grid_mask` (the VAE's temporal and
  spatial factors, 4 and 8 for Wan2.1), and weighs every latent channel of its cell;
- the condition is the clip's caption encoded by the pipeline's UMT5 (`WanPipeline.encode_prompt`); the
  null prompt is the empty caption, the pipeline's default negative prompt;
- the denoiser is `WanTransformer3DModel(x_σ, 1000σ, text)`, the velocity ε − x₀ at noise level σ (what
  `WanPipeline.__call__` integrates with its scheduler), and the gradient is over every transformer
  parameter; text encoder and VAE stay frozen.
Generation is `WanPipeline.__call__` with the pipeline's own scheduler, from shared latent noise.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from icml.cli.errors import IcmlError
from icml.data.videos import MOTIONS, NULL_PROMPT, SHAPES

TEXT_TOKENS = 512  # WanPipeline.__call__'s max_sequence_length (Wan's text_len): captions are zero-padded to it, and
# the transformer's cross-attention sees the padding, so attribution, fine-tuning and generation must all use it
MOTION_PHRASES = {"static": "standing still", "right": "moving right", "down": "moving down",
                  "diagonal": "moving diagonally", "orbit": "moving in a circle", "bounce": "bouncing off the walls",
                  "jitter": "jittering in place"}


def caption(prompt_id: int) -> str:
    """The caption of a prompt id (motion × shape); the null prompt is the empty caption."""
    if prompt_id >= NULL_PROMPT:
        return ""
    return f"a {SHAPES[prompt_id % len(SHAPES)]} {MOTION_PHRASES[MOTIONS[prompt_id // len(SHAPES)]]}"


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load(path: str | Path) -> "WanSpace":
    """WanPipeline.from_pretrained(path) (local files only), after the layout check of config.check_wan_dir."""
    from diffusers import WanPipeline
    from diffusers.utils import logging as diffusers_logging

    from icml.methods.attribute_motion.config import check_wan_dir

    try:
        check_wan_dir(path)
    except ValueError as exc:  # the directory changed since the run was validated
        raise IcmlError(str(exc)) from None
    diffusers_logging.set_verbosity_error()
    try:
        pipe = WanPipeline.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # a corrupt or partial component: name the folder, not a library traceback
        raise IcmlError(f"model '{path}' cannot be loaded as a WanPipeline ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:300] if str(exc) else ''})",
                        "re-save it with WanPipeline.save_pretrained or download Wan2.1-T2V-1.3B-Diffusers again") from None
    pipe.set_progress_bar_config(disable=True)
    pipe.to(device())
    # at 81 frames × 480 px a clip is 18 900 tokens: the 30 blocks' saved activations would need ~90 GB for one
    # gradient in float32; checkpointing keeps each block's input and recomputes it in backward (same values)
    pipe.transformer.enable_gradient_checkpointing()
    for part in (pipe.vae, pipe.text_encoder):
        part.requires_grad_(False)
        part.eval()
    return WanSpace(pipe, pipe.transformer)


class WanSpace:
    """The loss space of a WanPipeline: VAE latents (N, C, T', h, w), captions through UMT5, the transformer."""

    eval_batch = 1  # clips per forward of `model.heldout_loss`: 18 900 tokens each at the paper's 81 × 480

    def __init__(self, pipe, model, caches: tuple[dict, dict] | None = None):
        self.pipe = pipe
        self.model = model
        # prompt id → (1, L, d) caption embeddings; clip digest → latent (the VAE is frozen and `encode` takes
        # its mean, so a clip's latent never changes): shared by the fine-tuned copies (`with_model`)
        self._text, self._latents = caches if caches is not None else ({}, {})
        vae = pipe.vae.config
        self.temporal, self.spatial, self.channels = vae.scale_factor_temporal, vae.scale_factor_spatial, vae.z_dim
        self.latents_mean = torch.tensor(vae.latents_mean).view(1, -1, 1, 1, 1)
        self.latents_std = torch.tensor(vae.latents_std).view(1, -1, 1, 1, 1)

    def with_model(self, model) -> "WanSpace":
        return WanSpace(self.pipe, model, (self._text, self._latents))

    def parameters(self) -> list:
        return list(self.model.named_parameters())

    @torch.no_grad()
    def encode(self, videos: torch.Tensor, batch: int = 4) -> torch.Tensor:
        """Clips (N, T, H, W, 3) in [−1, 1] → normalised latents (N, C, 1 + (T − 1)/4, H/8, W/8), the VAE's mean
        (cached by content: every selector, fine-tuning arm and held-out loss reuses a clip's latent)."""
        import hashlib

        from icml.cli.threads import threads_for

        vae = self.pipe.vae
        keys = [hashlib.blake2b(clip.numpy().tobytes(), digest_size=16).digest() for clip in videos.float().contiguous()]
        todo = [i for i, key in enumerate(keys) if key not in self._latents]
        for start in range(0, len(todo), batch):
            rows = todo[start:start + batch]
            x = videos[rows].permute(0, 4, 1, 2, 3).to(device(), vae.dtype)
            with threads_for(x[0].numel()):  # small clips: one thread (the VAE runs many small causal convs)
                z = vae.encode(x).latent_dist.mode().float()
            z = (z - self.latents_mean.to(z.device)) / self.latents_std.to(z.device)
            self._latents.update(zip((keys[i] for i in rows), z.cpu()))  # host memory: a pool's latents add up
        return torch.stack([self._latents[key] for key in keys]).to(device())

    def loss_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """Pixel mask (N, T, H, W) → (N, C, T', h, w) on the latent grid, the same weight on every channel."""
        from icml.methods.attribute_motion.flow import latent_grid_mask

        grid = latent_grid_mask(mask.float(), self.temporal, self.spatial)
        return grid[:, None].expand(-1, self.channels, -1, -1, -1)

    @torch.no_grad()
    def text(self, prompt_id: int) -> torch.Tensor:
        if prompt_id not in self._text:
            embeds, _ = self.pipe.encode_prompt(caption(prompt_id), do_classifier_free_guidance=False,
                                                max_sequence_length=TEXT_TOKENS, device=device())
            self._text[prompt_id] = embeds.float()
        return self._text[prompt_id]

    def condition(self, labels: torch.Tensor) -> torch.Tensor:
        """Prompt ids (N,) → UMT5 caption embeddings (N, L, d) in the transformer's dtype."""
        return torch.cat([self.text(int(i)) for i in labels]).to(self.model.dtype)

    def denoise(self, x_t: torch.Tensor, timesteps: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        where = next(self.model.parameters()).device  # the transformer's device (meta in `icml … plan`)
        out = self.model(hidden_states=x_t.to(where, self.model.dtype), timestep=timesteps.to(where),
                         encoder_hidden_states=condition.to(where), return_dict=False)[0]
        return out.float()

    @torch.no_grad()
    def generate(self, labels: torch.Tensor, frames: int, size: int, *, steps: int, cfg_scale: float, seed: int,
                 batch: int = 8) -> torch.Tensor:
        """`WanPipeline.__call__` with this space's transformer and the pipeline's scheduler (a fresh copy, since
        set_timesteps mutates it), CFG against the empty caption, from shared latent noise drawn from `seed`
        → videos (N, T, H, W, 3) in [−1, 1]."""
        from diffusers import WanPipeline

        from icml.cli.threads import threads_for

        self.model.eval()
        pipe = WanPipeline(**{**self.pipe.components, "transformer": self.model,
                              "scheduler": copy.deepcopy(self.pipe.scheduler)},
                           boundary_ratio=self.pipe.config.boundary_ratio, expand_timesteps=self.pipe.config.expand_timesteps)
        pipe.set_progress_bar_config(disable=True)
        gen = torch.Generator().manual_seed(seed)
        shape = (len(labels), self.channels, 1 + (frames - 1) // self.temporal, size // self.spatial, size // self.spatial)
        noise = torch.randn(shape, generator=gen)
        out = []
        for start in range(0, len(labels), batch):
            part = labels[start:start + batch]
            with threads_for(frames * size * size * 3):
                video = pipe(prompt_embeds=self.condition(part),
                             negative_prompt_embeds=self.condition(torch.full_like(part, NULL_PROMPT)), height=size,
                             width=size, num_frames=frames, num_inference_steps=steps, guidance_scale=cfg_scale,
                             latents=noise[start:start + batch].to(device()), output_type="pt").frames
            out.append(video.float().cpu())  # (n, T, 3, H, W) in [0, 1]
        return (torch.cat(out).permute(0, 1, 3, 4, 2) * 2 - 1).clamp(-1, 1)
