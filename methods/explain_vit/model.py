"""The model side: the toy transformers ViT, one loading path for toy and external checkpoints
(`from_pretrained`, eager attention), the processor's normalisation, and training (AdamW, cosine)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from icml.methods.explain_vit.config import FAMILIES, PROCESSOR_FILE, ExplainVitConfig
from icml.methods.explain_vit.data import CLASSES


@dataclass
class Classifier:
    """A ViTForImageClassification with the processor's normalisation and its input size."""

    model: nn.Module
    mean: torch.Tensor  # (1, C, 1, 1)
    std: torch.Tensor
    size: int
    patch: int
    classes: list[str]

    def normalise(self, pixels: torch.Tensor) -> torch.Tensor:
        """[0, 1] pixels → the model input x (the x of c = w ⊙ x)."""
        return (pixels - self.mean.to(pixels)) / self.std.to(pixels)

    def denormalise(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.std.to(x) + self.mean.to(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of normalised inputs of any multiple of the patch size (montages interpolate positions)."""
        interpolate = x.shape[-1] != self.size or x.shape[-2] != self.size
        return self.model(pixel_values=x, interpolate_pos_encoding=interpolate).logits

    @torch.no_grad()
    def predict(self, x: torch.Tensor, batch: int = 128) -> torch.Tensor:
        return torch.cat([self.logits(x[i:i + batch]).softmax(-1) for i in range(0, len(x), batch)])


def build_toy(cfg: ExplainVitConfig, seed: int, classes: list[str] | None = None) -> nn.Module:
    """The toy ViTForImageClassification (eager attention) for `classes` (default: the synthetic shapes)."""
    from transformers import ViTConfig, ViTForImageClassification

    classes = list(CLASSES if classes is None else classes)
    torch.manual_seed(seed)
    config = ViTConfig(image_size=cfg.data_cfg.image_size, patch_size=cfg.vit.patch_size, num_channels=3,
                       hidden_size=cfg.vit.hidden_size, num_hidden_layers=cfg.vit.layers,
                       num_attention_heads=cfg.vit.heads, intermediate_size=cfg.vit.intermediate_size,
                       hidden_act="gelu", num_labels=len(classes), attn_implementation="eager",
                       id2label=dict(enumerate(classes)), label2id={c: i for i, c in enumerate(classes)})
    model = ViTForImageClassification(config)
    if cfg.train.patch_init == "conv_default":
        # PyTorch's Conv2d init (kaiming-uniform, bound 1/√fan_in) instead of transformers' N(0, 0.02): ≈ 4× larger
        # patch embeddings at fan_in 48, so the tokens are not swamped by the position code at the start; drawn
        # after the rest, so every other parameter equals the trunc_normal build of the same seed
        model.vit.embeddings.patch_embeddings.projection.reset_parameters()
    return model


def save(model: nn.Module, path: Path) -> None:
    """save_pretrained with a ViTImageProcessor beside it (mean = std = 0.5), so toy and external
    checkpoints load through the same `load`."""
    from transformers import ViTImageProcessor

    size = model.config.image_size
    model.save_pretrained(path)
    ViTImageProcessor(size={"height": size, "width": size}, image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(path)


def load(path: str | Path, device: str = "cpu") -> Classifier:
    """ViTForImageClassification.from_pretrained(path, local_files_only, eager) + ViTImageProcessor."""
    from transformers import AutoConfig, ViTForImageClassification, ViTImageProcessor

    path = Path(path)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"model '{path}' cannot be read as a transformers checkpoint ({exc.__class__.__name__}); "
                         "pass a folder saved with save_pretrained") from None
    if config.model_type not in FAMILIES:  # config.check_model refuses these up front; kept for direct callers
        raise ValueError(f"model '{path}' is a {config.model_type}, not a ViT/DeiT checkpoint in ViT format")
    model = ViTForImageClassification.from_pretrained(path, local_files_only=True, attn_implementation="eager")
    model.to(device).eval()
    if (path / PROCESSOR_FILE).is_file():  # a malformed one is an error, never a silent fallback to 0.5
        try:
            processor = ViTImageProcessor.from_pretrained(path, local_files_only=True)
        except OSError:
            raise ValueError(f"model '{path}': {PROCESSOR_FILE} cannot be read") from None
        mean, std = processor.image_mean, processor.image_std
    else:  # ViTImageProcessor's default
        mean, std = [0.5] * 3, [0.5] * 3
    size = config.image_size if isinstance(config.image_size, int) else config.image_size[0]
    patch = config.patch_size if isinstance(config.patch_size, int) else config.patch_size[0]
    labels = config.id2label or {}
    classes = [str(labels.get(i, labels.get(str(i), i))) for i in range(config.num_labels)]
    shape = (1, -1, 1, 1)
    return Classifier(model, torch.tensor(mean, dtype=torch.float32).view(shape),
                      torch.tensor(std, dtype=torch.float32).view(shape), size, patch, classes)


def lr_at(step: int, total: int, base: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to zero."""
    warmup = min(warmup, max(1, total // 10))  # short runs still reach the peak rate
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups as in the DeiT/timm ViT recipe: weight decay on weight matrices and conv kernels
    only; LayerNorm weights, biases, position embeddings and the CLS token are not decayed (decay would pull the
    normalisation gains and the position code toward zero, which is not the regulariser the recipe means)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        exempt = param.ndim < 2 or "position_embeddings" in name or "cls_token" in name
        (no_decay if exempt else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def zoom_out(pixels: torch.Tensor, p: float, min_scale: float, generator: torch.Generator) -> torch.Tensor:
    """Each image, with probability p, shrunk by a scale s ~ U(min_scale, 1) and placed at a uniform position that
    keeps it inside, on black (zero pixels): torchvision's RandomZoomOut for a black background, so the model
    also knows objects of half size in any quadrant — what a downscaled 2×2 montage shows it. Bilinear
    (`affine_grid` / `grid_sample`, zero padding); the draws come from the CPU stream."""
    u = torch.rand(len(pixels), 4, generator=generator, dtype=torch.float64)
    scale = torch.where(u[:, 0] < p, min_scale + u[:, 1] * (1 - min_scale), torch.ones_like(u[:, 1]))
    offset = (2 * u[:, 2:] - 1) * (1 - scale)[:, None]  # normalised centre of the shrunk image, inside the frame
    theta = torch.zeros(len(pixels), 2, 3, dtype=torch.float64)  # output → input: (out − offset) / scale
    theta[:, 0, 0] = theta[:, 1, 1] = 1 / scale
    theta[:, :, 2] = -offset / scale[:, None]
    grid = F.affine_grid(theta.float().to(pixels.device), list(pixels.shape), align_corners=False)
    shrunk = F.grid_sample(pixels, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return torch.where((u[:, 0] < p).to(pixels.device)[:, None, None, None], shrunk, pixels)  # the others untouched


def train_step(classifier: Classifier, opt, pixels: torch.Tensor, y: torch.Tensor, lr: float, grad_clip: float,
               generator: torch.Generator, zoom: tuple[float, float] = (0.0, 1.0)) -> tuple[torch.Tensor, torch.Tensor]:
    """One AdamW step on a batch of [0, 1] pixels (on the model's device): a horizontal flip with p ½ (drawn on
    the CPU stream), with zoom = (p, min_scale) and p > 0 a zoom-out (`zoom_out`), normalisation, cross-entropy,
    optional global-norm clipping. Returns (loss, logits)."""
    flip = torch.rand(len(pixels), generator=generator) < 0.5
    pixels = torch.where(flip.to(pixels.device)[:, None, None, None], pixels.flip(-1), pixels)
    if zoom[0] > 0:  # nothing drawn otherwise: runs without it keep their random stream
        pixels = zoom_out(pixels, zoom[0], zoom[1], generator)
    x = classifier.normalise(pixels)
    for group in opt.param_groups:
        group["lr"] = lr
    logits = classifier.logits(x)
    loss = F.cross_entropy(logits, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(classifier.model.parameters(), grad_clip)
    opt.step()
    return loss, logits


def train_classifier(classifier: Classifier, images: np.ndarray, labels: np.ndarray, cfg: ExplainVitConfig,
                     seed: int, device: str, on_epoch=None, advance=None) -> None:
    """AdamW (lr 1e-3, wd 0.05 on weight matrices only), linear warm-up inside the cosine schedule, batch 128,
    flip augmentation, optional global-norm gradient clipping (train.grad_clip > 0); on_epoch(epoch, loss, acc)."""
    model = classifier.model
    model.train()
    opt = torch.optim.AdamW(decay_groups(model, cfg.train.weight_decay), lr=cfg.train.lr)
    generator = torch.Generator().manual_seed(seed)
    x_all = images if isinstance(images, torch.Tensor) else torch.from_numpy(images)  # a tensor: Fashion-MNIST's view
    y_all = torch.from_numpy(labels)
    steps_per_epoch = math.ceil(len(x_all) / cfg.train.batch_size)
    total = steps_per_epoch * cfg.train.epochs
    step = 0
    for epoch in range(cfg.train.epochs):
        order = torch.randperm(len(x_all), generator=generator)
        loss_sum, correct = 0.0, 0
        for i in range(0, len(order), cfg.train.batch_size):
            idx = order[i:i + cfg.train.batch_size]
            y = y_all[idx].to(device)
            loss, logits = train_step(classifier, opt, x_all[idx].to(device), y,
                                      lr_at(step, total, cfg.train.lr, cfg.train.warmup_steps), cfg.train.grad_clip,
                                      generator, (cfg.train.zoom_out, cfg.train.zoom_min_scale))
            loss_sum += loss.item() * len(idx)
            correct += int((logits.argmax(-1) == y).sum())
            step += 1
            if advance is not None:
                advance(1)
        if on_epoch is not None:
            on_epoch(epoch, loss_sum / len(x_all), correct / len(x_all))
    model.eval()
