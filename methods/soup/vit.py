"""The model side: the ViT stock (transformers ViTMAE, or a plain ViT from --model), its encoder's CLS
feature z, the projector g, the classifier (encoder + linear head), augmentations and the schedule."""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from icml.methods.soup.config import ViTConfig


def build_stock(vit: ViTConfig, channels: int, seed: int) -> nn.Module:
    """The spec's toy stock: ViTMAEForPreTraining, small, eager attention, seeded init."""
    from transformers import ViTMAEConfig, ViTMAEForPreTraining

    torch.manual_seed(seed)
    config = ViTMAEConfig(image_size=vit.image_size, patch_size=vit.patch_size, num_channels=channels,
                          hidden_size=vit.hidden_size, num_hidden_layers=vit.layers,
                          num_attention_heads=vit.heads, intermediate_size=vit.intermediate_size,
                          decoder_hidden_size=vit.decoder_hidden_size,
                          decoder_num_hidden_layers=vit.decoder_layers,
                          decoder_num_attention_heads=vit.decoder_heads,
                          decoder_intermediate_size=vit.decoder_intermediate_size, mask_ratio=0.75,
                          norm_pix_loss=False, attn_implementation="eager")
    return ViTMAEForPreTraining(config)


def load_stock(path: str) -> nn.Module:
    """A local checkpoint: ViTMAEForPreTraining if it is a ViTMAE, else a plain ViTModel (no MAE)."""
    from transformers import AutoConfig, ViTMAEForPreTraining, ViTModel

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if config.model_type == "vit_mae":
        model = ViTMAEForPreTraining.from_pretrained(path, local_files_only=True, attn_implementation="eager")
        model.config.norm_pix_loss = False  # the spec's MAE loss: unnormalised pixel targets
        return model
    if config.model_type == "vit":
        return ViTModel.from_pretrained(path, local_files_only=True, attn_implementation="eager",
                                        add_pooling_layer=False)
    raise ValueError(f"model '{path}' is a {config.model_type}, not a ViT or ViTMAE checkpoint")


def has_decoder(stock: nn.Module) -> bool:
    return hasattr(stock, "decoder")


def encoder_of(stock: nn.Module) -> nn.Module:
    """The part that is souped: ViTMAEModel of a ViTMAEForPreTraining, or the ViTModel itself."""
    return stock.vit if has_decoder(stock) else stock


def image_spec(encoder: nn.Module) -> tuple[int, int]:
    """(image size, channels) the encoder expects."""
    config = encoder.config
    size = config.image_size if isinstance(config.image_size, int) else config.image_size[0]
    return size, config.num_channels


@contextmanager
def mask_ratio(encoder: nn.Module, ratio: float):
    """ViTMAE masks `config.mask_ratio` of the patches in every forward; set it for one pass."""
    config = encoder.config
    previous = getattr(config, "mask_ratio", None)
    config.mask_ratio = ratio
    try:
        yield
    finally:
        if previous is not None:
            config.mask_ratio = previous


def cls_features(encoder: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """z: the CLS token after the final LayerNorm, with every patch kept (ViTMAE: mask ratio 0 and
    noise = arange(L), so patches are neither dropped nor shuffled)."""
    if hasattr(encoder.embeddings, "random_masking"):
        patches = encoder.embeddings.patch_embeddings.num_patches
        noise = torch.arange(patches, device=images.device, dtype=torch.float32).expand(len(images), -1)
        with mask_ratio(encoder, 0.0):
            return encoder(pixel_values=images, noise=noise).last_hidden_state[:, 0]
    return encoder(pixel_values=images).last_hidden_state[:, 0]


def projector(dim: int, seed: int) -> nn.Module:
    """g: d → 4d → d with GELU (fresh, seeded per recipe)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))


class Classifier(nn.Module):
    """encoder + linear head on z; the unit that is fine-tuned and souped (encoder and head)."""

    def __init__(self, encoder: nn.Module, head: nn.Linear):
        super().__init__()
        self.encoder = encoder
        self.head = head

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(cls_features(self.encoder, images))


def adamw(params, lr: float, weight_decay: float, total: int, warmup_frac: float):
    """AdamW with transformers' linear warm-up over `warmup_frac` of the steps, then cosine to 0."""
    from transformers import get_cosine_schedule_with_warmup

    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    return optimizer, get_cosine_schedule_with_warmup(optimizer, int(round(warmup_frac * total)), total)


# augmentations ----------------------------------------------------------------------------------
def random_affine(images: torch.Tensor, generator: torch.Generator, scale=(0.6, 1.0), degrees: float = 10.0):
    """Random resized crop (area scale, aspect 3/4–4/3) and a ±`degrees` rotation, one affine_grid."""
    n = len(images)

    def draw(low, high):
        return low + (high - low) * torch.rand(n, generator=generator)

    area = draw(*scale)
    log_ratio = draw(math.log(3 / 4), math.log(4 / 3))
    sx = (area * torch.exp(log_ratio)).sqrt().clamp(max=1.0)
    sy = (area / torch.exp(log_ratio)).sqrt().clamp(max=1.0)
    tx = (1 - sx) * draw(-1, 1)
    ty = (1 - sy) * draw(-1, 1)
    angle = draw(-degrees, degrees) * math.pi / 180
    cos, sin = torch.cos(angle), torch.sin(angle)
    theta = torch.stack([torch.stack([sx * cos, -sx * sin, tx], 1), torch.stack([sy * sin, sy * cos, ty], 1)], 1)
    grid = F.affine_grid(theta.to(images), list(images.shape), align_corners=False)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def ssl_view(images: torch.Tensor, generator: torch.Generator, jitter: float = 0.3) -> torch.Tensor:
    """An SSL view: crop+rotation, then blur | solarise | none, then brightness/contrast jitter.
    None of these is a held-out corruption type."""
    views = random_affine(images, generator)
    n = len(views)
    choice = torch.randint(0, 3, (n,), generator=generator).view(-1, 1, 1, 1).to(views.device)  # the CPU stream
    kernel = torch.tensor([1.0, 2.0, 1.0])
    kernel = (kernel[:, None] * kernel[None, :] / 16).to(views)
    channels = views.shape[1]
    blurred = F.conv2d(F.pad(views, (1, 1, 1, 1), mode="replicate"), kernel.expand(channels, 1, 3, 3),
                       groups=channels)
    solarised = torch.where(views > 0.5, 1 - views, views)
    views = torch.where(choice == 0, blurred, torch.where(choice == 1, solarised, views))
    brightness = 1 + jitter * (2 * torch.rand(n, 1, 1, 1, generator=generator) - 1)
    contrast = 1 + jitter * (2 * torch.rand(n, 1, 1, 1, generator=generator) - 1)
    mean = views.mean(dim=(1, 2, 3), keepdim=True)
    return (((views - mean) * contrast.to(views) + mean) * brightness.to(views)).clamp(0, 1)


def batches(n: int, batch_size: int, generator: torch.Generator):
    """Endless shuffled index batches (epoch after epoch)."""
    while True:
        order = torch.randperm(n, generator=generator)
        for start in range(0, n - batch_size + 1 if n >= batch_size else 1, batch_size):
            yield order[start:start + batch_size]
