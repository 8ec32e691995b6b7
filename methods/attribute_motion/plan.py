"""`icml attribute-motion plan`: at the paper preset, one clip's attribution (its masked flow-matching gradient
streamed into the Fastfood projection and the exact-cosine Gram matrix), one fine-tuning step and one generation
step (both CFG passes and the VAE decode of a batch), on the meta device (cli/plan.py). The WanPipeline is built
from diffusers / transformers configs of Wan2.1-T2V-1.3B's published sizes (transformer, UMT5-XXL encoder,
Wan VAE), float32 as `WanPipeline.from_pretrained` loads it, all on the GPU as `wan.load` puts it. At the
UNet presets the same steps run on the stacked-frame UNet."""
from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace

import torch

from icml.cli.plan import Hardware, Step, cuda_attention
from icml.data.videos import NULL_PROMPT
from icml.methods.attribute_motion.attribution import ExactCosines, clip_gradient
from icml.methods.attribute_motion.model import (StackedFrames, TRAIN_TIMESTEPS, build_unet, fm_loss, fm_step,
                                                 masked_fm_loss)
from icml.methods.attribute_motion.projection import Fastfood
from icml.methods.attribute_motion.wan import TEXT_TOKENS, WanSpace

LAYOUT = "one process, one GPU (the UNet presets' pretraining: torchrun, one process per GPU, data-parallel)"
# Planned: the attribution step peaks at ~151 GB (of it ~103 GB the transformer's saved activations for one clip's
# backward at 18 900 tokens in float32) and the fine-tuning step at ~210 GB; the gradient checkpointing that
# `wan.load` turns on does not lower the planned peak (not diagnosed yet: README, NOTES 7 Dec 2026).
DOES_NOT_FIT = ("one clip's float32 backward through Wan-1.3B at 81 × 480 (18 900 tokens) holds ~100 GB of "
                "activations, fine-tuning ~160 GB: see the README's paper preset")
OVERSIZE = ["clips.frames=161", "clips.size=960"]  # 41 latent frames at 960 px: 4× the tokens of the paper's clips
GEN_BATCH = 8  # WanSpace.generate's batch

# Wan2.1-T2V-1.3B (Diffusers): its transformer/config.json, text_encoder (UMT5-XXL encoder) and vae sizes
WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
                dense_act_fn="gelu_new", is_gated_act=True)


@contextlib.contextmanager
def _sigma_by_arithmetic():
    """The scheduler's `scale_noise` finds σ by looking the timestep up in its table (`nonzero`: data-dependent,
    not on meta); inside, `model.add_noise` forms the same x_σ = (1 − σ)·x₀ + σ·ε with σ = timestep / 1000."""
    from icml.methods.attribute_motion import model

    def add_noise(x0, eps, timesteps):
        sigma = (timesteps / TRAIN_TIMESTEPS).reshape(-1, *[1] * (x0.dim() - 1)).to(x0.dtype)
        return sigma * eps + (1.0 - sigma) * x0

    previous, model.add_noise = model.add_noise, add_noise
    try:
        yield
    finally:
        model.add_noise = previous


def hardware(preset: str) -> Hardware:
    return Hardware(1, 80e9)


class _PlannedSpace(WanSpace):
    """WanSpace whose condition is the caption embedding computed in the step: its per-prompt cache lookup
    (`int(prompt id)`) is data-dependent and cannot run on meta."""

    def __init__(self, pipe, model, embedding):
        super().__init__(pipe, model)
        self._embedding = embedding

    def with_model(self, model):
        return _PlannedSpace(self.pipe, model, self._embedding)

    def condition(self, labels):
        return self._embedding.expand(len(labels), -1, -1).to(self.model.dtype)


def _wan(tracker):
    """The pipeline's three models on the tracker's device, watched; the transformer checkpointed as `wan.load`
    sets it."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    with torch.device(tracker.device):
        transformer = WanTransformer3DModel(**WAN_1_3B)
        text_encoder = UMT5EncoderModel(UMT5Config(**UMT5_XXL))
        vae = AutoencoderKLWan()  # its defaults are Wan2.1's VAE (base_dim 96, z_dim 16, 4×8×8)
    transformer.enable_gradient_checkpointing()
    for part in (vae, text_encoder):
        part.requires_grad_(False)
        part.eval()
    tracker.watch(transformer, text_encoder, vae)
    return transformer, text_encoder, vae


def _caption(text_encoder, device, n: int = 1):
    """UMT5 over captions padded to the pipeline's 512 tokens (`WanSpace.text`, once per prompt id)."""
    ids = torch.zeros(n, TEXT_TOKENS, dtype=torch.long, device=device)
    with torch.no_grad():
        return text_encoder(ids).last_hidden_state  # no mask: the all-ones check of transformers reads values


def _latent_shape(cfg, space) -> tuple:
    frames, side = 1 + (cfg.clips.frames - 1) // space.temporal, cfg.clips.size // space.spatial
    return (space.channels, frames, side, side)


def _space(cfg, tracker):
    if cfg.backend == "wan":
        transformer, text_encoder, vae = _wan(tracker)
        space = _PlannedSpace(SimpleNamespace(vae=vae), transformer, None)
        space._embedding = _caption(text_encoder, tracker.device)
        return space, _latent_shape(cfg, space), (vae, text_encoder)
    with torch.device(tracker.device):
        unet = build_unet(cfg.clips.frames, cfg.clips.size, cfg.unet.block_out_channels, cfg.unet.layers_per_block, 0)
    tracker.watch(unet)
    return StackedFrames(unet), (3 * cfg.clips.frames, cfg.clips.size, cfg.clips.size), ()


def _labels(space, n, device):
    # the UNet's condition is the prompt-id tensor on the model's device; the Wan plan's is the caption embedding
    return torch.full((n,), NULL_PROMPT, device=device)


def _planned(step, cfg):
    """A step as the plan runs it: the scheduler's σ by arithmetic, attention as CUDA runs it on meta."""
    def run(tracker):
        with _sigma_by_arithmetic(), cuda_attention(tracker.device == "meta"):
            step(cfg, tracker)
    return run


def _attribute_step(cfg, tracker):
    space, shape, _ = _space(cfg, tracker)
    params = space.parameters()
    weights = [p for _, p in params]
    for p in space.model.parameters():
        p.requires_grad_(False)
    for p in weights:
        p.requires_grad_(True)
    space.model.eval()
    n = sum(p.numel() for p in weights)
    with tracker.buffers():  # the projector's B, Π, G and kept rows of S, on the GPU for the whole featurize
        fastfood = Fastfood.on(n, cfg.attr.dim, tracker.device)
    k, dev = cfg.attr.draws, tracker.device
    x0 = torch.randn(k, *shape, device=dev)
    mask = torch.rand(k, *shape, device=dev)
    eps = torch.randn(k, *shape, device=dev)
    timesteps = torch.full((k,), TRAIN_TIMESTEPS * cfg.attr.t_star, device=dev)
    grads = clip_gradient(space, weights, x0, eps, timesteps, space.condition(_labels(space, k, dev)), mask)
    block = fastfood.block(min(Fastfood.BATCH, cfg.attr.chunk), dev)
    block.put(grads)
    if cfg.attr.cos_subset > 1:  # a later subset clip: its products with one kept host copy, streamed in
        ExactCosines(cfg.attr.cos_subset).add(grads, kept=[torch.zeros(1).expand(n)])
    del grads
    block.finish()


def _finetune_step(cfg, tracker):
    base, shape, _ = _space(cfg, tracker)
    space = base.with_model(copy.deepcopy(base.model))  # finetune_and_generate: the arm's copy of the denoiser
    params = [p for _, p in space.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=cfg.finetune.lr, weight_decay=0.0)
    tracker.watch(space.model, opt)
    space.model.train()
    b, dev = cfg.finetune.batch_size, tracker.device
    # train_fm's batch draw (host generator, label dropout by index) stays out; its step runs
    for _ in range(2):
        x0, w = torch.randn(b, *shape, device=dev), torch.ones(b, *shape, device=dev)
        t = torch.full((b,), 500.0, device=dev)
        fm_step(space, params, opt, x0, w, _labels(space, b, dev), t, torch.randn(b, *shape, device=dev))


def _generate_step(cfg, tracker):
    space, shape, frozen = _space(cfg, tracker)
    space.model.eval()
    dev = tracker.device
    b = min(GEN_BATCH if cfg.backend == "wan" else 64, cfg.eval.n_videos)
    x = torch.randn(b, *shape, device=dev)
    with torch.no_grad():
        t = torch.full((b,), 999.0, device=dev)
        if cfg.backend == "wan":  # WanPipeline.__call__'s step: a conditional and an unconditional pass, CFG,
            cond = space.condition(_labels(space, b, dev))  # then the VAE decode of the batch
            v = space.denoise(x, t, cond)
            v = v + cfg.unet.cfg_scale * (space.denoise(x, t, cond) - v)
            vae = frozen[0]
            z = x / space.latents_std.to(dev) + space.latents_mean.to(dev)
            vae.decode(z, return_dict=False)
        else:  # MotionPipeline's step: both halves in one batch
            v = space.model(torch.cat([x, x]), t.repeat(2), class_labels=_labels(space, 2 * b, dev)).sample
        # held-out FM loss (heldout_loss) of one batch
        hb = min(space.eval_batch if hasattr(space, "eval_batch") else 64, cfg.clips.n_heldout)
        x0 = torch.randn(hb, *shape, device=dev)
        fm_loss(space, x0, torch.ones_like(x0), _labels(space, hb, dev), torch.full((hb,), 500.0, device=dev),
                torch.randn_like(x0))


def steps(cfg, processes: int) -> list[Step]:
    where = (f"{cfg.clips.frames} frames × {cfg.clips.size} px" +
             (" (Wan2.1-T2V-1.3B, float32)" if cfg.backend == "wan" else " (stacked-frame UNet)"))
    return [Step("attribute", f"one clip's masked FM gradient ({cfg.attr.draws} draw) → Fastfood D = {cfg.attr.dim} "
                              f"+ exact-cosine Gram, {where}", _planned(_attribute_step, cfg)),
            Step("train", f"one fine-tuning AdamW step, batch {cfg.finetune.batch_size}, {where}",
                 _planned(_finetune_step, cfg),
                 repeats=2),
            Step("eval", f"one CFG generation step of {min(GEN_BATCH if cfg.backend == 'wan' else 64, cfg.eval.n_videos)}"
                         f" videos (+ VAE decode on Wan) and a held-out loss batch, {where}", _planned(_generate_step, cfg))]
