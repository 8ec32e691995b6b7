"""The four SSL objectives that cook ingredients (MAE, MoCo v3, MMCR, LeJEPA with SIGReg) and the
inter-training loop that runs one recipe from the stock on an unlabelled pool.

The losses are pure functions of embeddings (tested at known inputs); `cook` wires them to the ViT.
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from icml.cli import distributed
from icml.cli.errors import IcmlError
from icml.methods.soup.config import Recipe
from icml.methods.soup.vit import (adamw, batches, cls_features, encoder_of, mask_ratio, projector, random_affine,
                                  ssl_view)


# losses ----------------------------------------------------------------------------------------
def masked_patch_mse(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """MAE: per-patch pixel MSE averaged over the masked patches only (mask 1 = removed)."""
    per_patch = ((pred - target) ** 2).mean(dim=-1)
    return (per_patch * mask).sum() / mask.sum()


def mocov3_loss(q: torch.Tensor, k: torch.Tensor, tau: float) -> torch.Tensor:
    """2τ · CE(q̂ k̂ᵀ / τ, diagonal): row i's positive is key i, the other keys are negatives."""
    logits = F.normalize(q, dim=1) @ F.normalize(k, dim=1).T / tau
    return 2 * tau * F.cross_entropy(logits, torch.arange(len(q), device=q.device))


def mmcr_loss(u: torch.Tensor, w: torch.Tensor, local: bool) -> torch.Tensor:
    """−‖C‖_*/B with C's rows the centroids (uᵢ+wᵢ)/2 of L2-normalised embeddings; `local` adds
    (1/B)Σᵢ‖[uᵢ wᵢ]‖_* (each a d×2 matrix)."""
    u, w = F.normalize(u, dim=1), F.normalize(w, dim=1)
    batch = len(u)
    loss = -torch.linalg.matrix_norm((u + w) / 2, ord="nuc") / batch
    if local:
        pairs = torch.stack([u, w], dim=2)  # B × d × 2
        loss = loss + torch.linalg.matrix_norm(pairs, ord="nuc").sum() / batch
    return loss


def sigreg_knots(knots: int = 17, limit: float = 5.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Trapezoid knots t on [−limit, limit] and their weights."""
    t = torch.linspace(-limit, limit, knots)
    weights = torch.full((knots,), 2 * limit / (knots - 1))
    weights[0] = weights[-1] = limit / (knots - 1)
    return t, weights


def epps_pulley(projections: torch.Tensor, knots: int = 17, limit: float = 5.0) -> torch.Tensor:
    """Per column s (N samples): T = N ∫ |φ̂(t) − e^{−t²/2}|² e^{−t²/2} dt, φ̂(t) = mean_n e^{i t s_n},
    by the trapezoid rule; real and imaginary parts both count."""
    n = projections.shape[0]
    t, weights = sigreg_knots(knots, limit)
    t, weights = t.to(projections), weights.to(projections)
    angles = projections.unsqueeze(-1) * t  # N × M × knots
    real = torch.cos(angles).mean(dim=0) - torch.exp(-t ** 2 / 2)
    imaginary = torch.sin(angles).mean(dim=0)
    integrand = (real ** 2 + imaginary ** 2) * torch.exp(-t ** 2 / 2)
    return n * (integrand * weights).sum(dim=-1)


def sigreg(embeddings: torch.Tensor, step: int, directions: int = 256, knots: int = 17) -> torch.Tensor:
    """SIGReg: the Epps–Pulley statistic of the embeddings projected on `directions` random unit
    directions (drawn afresh at every step, seeded by it), averaged over the directions."""
    generator = torch.Generator().manual_seed(int(step))
    a = torch.randn(embeddings.shape[1], directions, generator=generator).to(embeddings)
    a = a / a.norm(dim=0, keepdim=True)
    return epps_pulley(embeddings @ a, knots).mean()


def lejepa_loss(views: torch.Tensor, lam: float, step: int, directions: int = 256) -> torch.Tensor:
    """views: V × N × d embeddings. (1−λ)·mean_v‖e_v − ē‖² + λ·mean_v SIGReg(e_v)."""
    centre = views.mean(dim=0, keepdim=True)
    invariance = ((views - centre) ** 2).sum(dim=-1).mean()
    regulariser = torch.stack([sigreg(view, step, directions) for view in views]).mean()
    return (1 - lam) * invariance + lam * regulariser


# inter-training ----------------------------------------------------------------------------------
def ssl_loss(recipe: Recipe, model, head, images: torch.Tensor, generator: torch.Generator, step: int,
             key_encoder=None, moco_symmetric: bool = False, mae_augment: bool = True) -> torch.Tensor:
    """The recipe's SSL loss on one unlabelled batch. `model` is the stock being cooked (ViTMAE with its
    decoder for mae), `head` the projector g (None for mae). Every algorithm sees augmented views (the
    released code's 3aug for all of them; `mae_augment=False` feeds MAE the raw images, the ablation)."""
    encoder = encoder_of(model)
    # Under torchrun every rank draws the global batch's views (one random stream), encodes its `shard`
    # and, where the loss couples rows (MoCo's negatives, MMCR's nuclear norm, SIGReg's statistics),
    # `gather`s the embeddings, so that every rank computes the global batch's loss. MAE's is a mean
    # over equal numbers of masked patches per image: each rank's is its share.
    shard, gather = distributed.shard, distributed.gather
    if recipe.algo == "mae":
        views = ssl_view(images, generator) if mae_augment else images
        patches = encoder.embeddings.patch_embeddings.num_patches
        noise = torch.rand(len(views), patches, generator=generator).to(views.device)
        views, noise = shard(views), shard(noise)
        with mask_ratio(encoder, recipe.hp("mask")):
            out = model(pixel_values=views, noise=noise)
        return masked_patch_mse(out.logits, model.patchify(views), out.mask)
    if recipe.algo == "lejepa":
        views = [shard(ssl_view(images, generator)) for _ in range(int(recipe.hp("views")))]
        embeddings = head(cls_features(encoder, torch.cat(views))).view(len(views), len(views[0]), -1)
        return lejepa_loss(gather(embeddings, dim=1), recipe.hp("lambda"), step)
    v1, v2 = shard(ssl_view(images, generator)), shard(ssl_view(images, generator))
    if recipe.algo == "mocov3":
        keys = key_encoder if key_encoder is not None else encoder
        with torch.no_grad():  # k = sg(z(v₂)): the keys carry no gradient
            k2 = gather(cls_features(keys, v2))
            k1 = gather(cls_features(keys, v1)) if moco_symmetric else None
        loss = mocov3_loss(gather(head(cls_features(encoder, v1))), k2, recipe.hp("tau"))
        if moco_symmetric:
            loss = loss + mocov3_loss(gather(head(cls_features(encoder, v2))), k1, recipe.hp("tau"))
        return loss
    u = gather(head(cls_features(encoder, v1)))  # mmcr
    with torch.no_grad():
        w = gather(head(cls_features(encoder, v2)))
    return mmcr_loss(u, w, local=bool(recipe.hp("local")))


def ssl_setup(recipe: Recipe, stock, steps: int, lr: float, weight_decay: float, warmup_frac: float, seed: int,
              device: str, moco_momentum: float = 0.0):
    """What one ingredient trains: a copy of the stock θ₀ on `device`, the projector g (None for mae), their
    parameters, AdamW with its schedule, and MoCo's EMA key encoder (None unless momentum > 0)."""
    model = copy.deepcopy(stock).to(device).train().requires_grad_(True)  # position embeddings too (README)
    encoder = encoder_of(model)
    dim = encoder.config.hidden_size
    head = projector(dim, seed).to(device) if recipe.algo != "mae" else None
    params = list(model.parameters()) + (list(head.parameters()) if head is not None else [])
    optimizer, schedule = adamw(params, lr, weight_decay, steps, warmup_frac)
    key_encoder = None
    if recipe.algo == "mocov3" and moco_momentum > 0:
        key_encoder = copy.deepcopy(encoder).requires_grad_(False)
    return model, head, params, optimizer, schedule, key_encoder


def ssl_step(recipe: Recipe, model, head, params, optimizer, schedule, images: torch.Tensor,
             generator: torch.Generator, step: int, key_encoder=None, moco_momentum: float = 0.0,
             moco_symmetric: bool = False, mae_augment: bool = True) -> torch.Tensor:
    """One inter-training step on a batch of unlabelled `images` (on the model's device): the recipe's loss,
    backward, the ranks' gradient average, AdamW and the schedule, MoCo's key EMA. Returns the loss."""
    loss = ssl_loss(recipe, model, head, images, generator, step, key_encoder, moco_symmetric, mae_augment)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    distributed.average_gradients(params)  # torchrun: the global batch's gradient (see ssl_loss)
    optimizer.step()
    schedule.step()
    if key_encoder is not None:
        with torch.no_grad():
            for k, q in zip(key_encoder.parameters(), encoder_of(model).parameters()):
                k.mul_(moco_momentum).add_(q.detach(), alpha=1 - moco_momentum)
    return loss


def cook(recipe: Recipe, stock, pool: torch.Tensor, steps: int, batch_size: int, lr: float,
         weight_decay: float, warmup_frac: float, seed: int, device: str, moco_momentum: float = 0.0,
         moco_symmetric: bool = False, mae_augment: bool = True, log_every: int = 10):
    """Start from a copy of the stock θ₀ and minimise the recipe's SSL loss on `pool` (unlabelled).
    Returns (encoder θ_r, [(step, loss)]). MAE reuses (and trains) the stock's decoder; only the
    encoder is kept."""
    model, head, params, optimizer, schedule, key_encoder = ssl_setup(recipe, stock, steps, lr, weight_decay,
                                                                      warmup_frac, seed, device, moco_momentum)
    encoder = encoder_of(model)
    generator = torch.Generator().manual_seed(seed)
    order = batches(len(pool), min(batch_size, len(pool)), generator)
    curve = []
    for step in range(steps):
        images = pool[next(order)].to(device)
        loss = ssl_step(recipe, model, head, params, optimizer, schedule, images, generator, step, key_encoder,
                        moco_momentum, moco_symmetric, mae_augment)
        if step % log_every == 0 or step == steps - 1:
            value = distributed.mean(float(loss.detach()))  # the global batch's: every rank stops alike
            if not math.isfinite(value):
                raise IcmlError(f"ingredient {recipe.name}: the SSL loss is {value} at step {step}",
                                "lower the SSL learning rate, e.g. --set ssl.lr=1e-4")
            curve.append((step, value))
    return encoder.eval(), curve


def pretrain_mae(stock, images: torch.Tensor, steps: int, batch_size: int, lr: float, mask: float, seed: int,
                 device: str, log_every: int = 50):
    """θ₀: MAE pre-training of the whole stock (encoder + decoder) on clean images."""
    model = stock.to(device).train()
    optimizer, schedule = adamw(model.parameters(), lr, 0.05, steps, 0.1)
    generator = torch.Generator().manual_seed(seed)
    order = batches(len(images), min(batch_size, len(images)), generator)
    encoder = encoder_of(model)
    patches = encoder.embeddings.patch_embeddings.num_patches
    curve = []
    for step in range(steps):
        batch = random_affine(images[next(order)].to(device), generator)
        noise = torch.rand(len(batch), patches, generator=generator).to(device)
        batch, noise = distributed.shard(batch), distributed.shard(noise)  # torchrun: this rank's images
        with mask_ratio(encoder, mask):
            out = model(pixel_values=batch, noise=noise)
        loss = masked_patch_mse(out.logits, model.patchify(batch), out.mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        distributed.average_gradients(model.parameters())  # as DDP's; without torchrun nothing
        optimizer.step()
        schedule.step()
        if step % log_every == 0 or step == steps - 1:
            curve.append((step, distributed.mean(float(loss.detach()))))
    return model.eval(), curve
