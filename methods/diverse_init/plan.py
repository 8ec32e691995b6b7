"""`icml diverse-init plan` (cli/plan.py). The GMM and digits tiers train and sample on the CPU (the pipeline never
moves them to --device): no GPU part. The paper preset's GPU path is `paper.divin_latents` on a local Stable
Diffusion pipeline: planned here on SD1.4's published sizes (UNet2DConditionModel 860 M, CLIP ViT-L/14 text
encoder, the SD VAE) at 512 px, for `paper.images_per_class` latents of one prompt: DivIn's K Langevin steps (the
potential's gradient through the UNet, conditional and empty prompt as one batch), then one classifier-free
sampler step and the VAE decode. SD3.5-M (`paper.pipeline=sd3`) is not sized yet."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from icml.cli.plan import Hardware, Step, cuda_attention
from icml.methods.diverse_init import divin
from icml.methods.diverse_init.model import make_scheduler
from icml.methods.diverse_init.paper import PromptDenoiser

LAYOUT = "one process, one GPU (the pipeline's device)"
OVERSIZE = ["paper.images_per_class=2000"]
STEPS, TAU, ETA, GUIDANCE = 50, 0.6, 0.05, 7.5  # SD1.4 in the paper (README: paper preset)
TOKENS, LATENT = 77, 64  # CLIP's context; 512 px / 8


def no_gpu(cfg) -> str:
    if not cfg.paper.enabled:
        return "the GMM and digits tiers train and sample on the CPU (the pipeline never moves them to --device)"
    if cfg.paper.pipeline != "sd1":
        return f"paper.pipeline={cfg.paper.pipeline}: only SD1.4's path is sized so far"
    return ""


def hardware(preset: str) -> Hardware:
    return Hardware(1, 80e9)


def _sd14(device):
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    with torch.device(device):
        unet = UNet2DConditionModel(sample_size=LATENT, in_channels=4, out_channels=4, cross_attention_dim=768,
                                    block_out_channels=(320, 640, 1280, 1280), layers_per_block=2,
                                    attention_head_dim=8)
        text = CLIPTextModel(CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                            num_attention_heads=12, max_position_embeddings=TOKENS, vocab_size=49408))
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512),
                            layers_per_block=2, down_block_types=("DownEncoderBlock2D",) * 4,
                            up_block_types=("UpDecoderBlock2D",) * 4, sample_size=512)
    return unet.eval(), text.eval(), vae.eval()


def _paper(cfg):
    n = cfg.paper.images_per_class

    def run(tracker):
        unet, text, vae = _sd14(tracker.device)
        tracker.watch(unet, text, vae)
        with torch.no_grad():  # encode_prompt's work: the prompt and the empty prompt, once per image
            ids = torch.zeros(2 * n, TOKENS, dtype=torch.long, device=tracker.device)
            embeds, empty = text(ids).last_hidden_state.chunk(2)
        den = PromptDenoiser(SimpleNamespace(unet=unet), {"encoder_hidden_states": embeds},
                             {"encoder_hidden_states": empty})
        sched = divin.Schedule(make_scheduler("eps"), "eps", STEPS)
        seeds = [divin.sample_seed(0, i) for i in range(n)]
        with cuda_attention(tracker.device == "meta"):
            z = divin.initial_noise(seeds, (4, LATENT, LATENT)).to(tracker.device)
            z = divin.divin_init(den, sched, z, None, seeds, tau=TAU, eta=ETA, k_steps=1).z
            with torch.no_grad():  # one step of the pipeline's own sampler, then the decode
                cond, uncond = den.pair(z, sched.timesteps[0])
                z = sched.step(uncond + GUIDANCE * (cond - uncond), 0, z)
                vae.decode(z / vae.config.scaling_factor)
    return run


def steps(cfg, processes: int) -> list[Step]:
    return [Step("divin", f"SD1.4 at 512 px, {cfg.paper.images_per_class} latents of one prompt: DivIn (K = 1, the "
                          "potential's gradient through the UNet), one guided sampler step, the VAE decode",
                 _paper(cfg))]
