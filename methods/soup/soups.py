"""Souping and the fine-tune back: weighted parameter averages, the shared folded probe h0, LP-FT,
greedy and label-free (self-seasoning) weights, ensembles, interpolation, and the evaluation
primitives (accuracy, loss, weighted kNN) they are judged by."""
from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from icml.cli import distributed
from icml.methods.soup.vit import Classifier, adamw, batches, cls_features, random_affine


# soups -------------------------------------------------------------------------------------------
def soup_state(states: list[dict], weights: list[float] | None = None) -> dict:
    """θ_soup = Σ wᵢθᵢ (Σw = 1) over every floating-point entry; other entries (integer buffers)
    are taken from the first state, where they must agree."""
    weights = [1.0 / len(states)] * len(states) if weights is None else list(weights)
    if len(weights) != len(states) or not math.isclose(sum(weights), 1.0, rel_tol=0, abs_tol=1e-6):
        raise ValueError(f"soup weights must be one per state and sum to 1, got {weights}")
    out = {}
    for key, first in states[0].items():
        if torch.is_floating_point(first):
            out[key] = sum(w * s[key].to(torch.float64) for w, s in zip(weights, states)).to(first.dtype)
        else:
            out[key] = first.clone()
    return out


def fingerprint(state: dict) -> str:
    """A short hash of every floating-point entry (names, shapes, dtypes, bytes): the identity of a stock θ₀
    (or of a probe h0), recorded with every unit so that soups of different stocks can be refused."""
    import hashlib

    digest = hashlib.sha256()
    for key in sorted(state):
        value = state[key]
        if torch.is_floating_point(value):
            value = value.detach().cpu().contiguous()
            digest.update(f"{key}|{tuple(value.shape)}|{value.dtype}|".encode())
            digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def check_one_stock(origins: dict[str, str | None], what: str = "stock") -> None:
    """Refuse a soup whose members (name → the fingerprint of the θ₀ they started from) do not all share
    one stock: averaging the weights of different stocks is meaningless (no shared basin)."""
    unknown = [name for name, origin in origins.items() if origin is None]
    if unknown:
        raise ValueError(f"{', '.join(unknown)} carry no {what} fingerprint (saved by an older icml), so "
                         f"they cannot be checked to share one {what}")
    groups: dict[str, list[str]] = {}
    for name, origin in origins.items():
        groups.setdefault(origin, []).append(name)
    if len(groups) > 1:
        parts = [f"{', '.join(names)} (from {what} {origin})" for origin, names in groups.items()]
        raise ValueError(f"the members come from different {what}s: {' vs '.join(parts)}")


def with_state(module: nn.Module, state: dict) -> nn.Module:
    model = copy.deepcopy(module)
    model.load_state_dict(state)
    return model.eval()


def flat(state: dict) -> torch.Tensor:
    return torch.cat([v.flatten().to(torch.float64) for v in state.values() if torch.is_floating_point(v)])


def task_vector_cos(a: dict, b: dict, origin: dict) -> float:
    """cos(θa − θ0, θb − θ0)."""
    da, db = flat(a) - flat(origin), flat(b) - flat(origin)
    return float(da @ db / (da.norm() * db.norm()).clamp_min(1e-30))


def dist_from_stock(state: dict, origin: dict) -> float:
    """‖θ − θ0‖ / ‖θ0‖."""
    return float((flat(state) - flat(origin)).norm() / flat(origin).norm())


# evaluation primitives -------------------------------------------------------------------------------
@torch.no_grad()
def logits_of(model: nn.Module, images: torch.Tensor, device: str, batch_size: int = 512) -> torch.Tensor:
    model.eval()
    return torch.cat([model(images[i:i + batch_size].to(device)).float().cpu()
                      for i in range(0, len(images), batch_size)])


@torch.no_grad()
def features_of(encoder: nn.Module, images: torch.Tensor, device: str, batch_size: int = 512) -> torch.Tensor:
    encoder.eval()
    return torch.cat([cls_features(encoder, images[i:i + batch_size].to(device)).float().cpu()
                      for i in range(0, len(images), batch_size)])


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return float((logits.argmax(dim=1) == labels).float().mean())


def knn_predict(bank: torch.Tensor, bank_labels: torch.Tensor, queries: torch.Tensor, classes: int, k: int = 20,
                temperature: float = 0.07) -> torch.Tensor:
    """Weighted kNN on cosine similarity: the k nearest bank features vote exp(cos / T) for their class."""
    similarity = F.normalize(queries, dim=1) @ F.normalize(bank, dim=1).T
    top, index = similarity.topk(min(k, len(bank)), dim=1)
    votes = torch.zeros(len(queries), classes)
    votes.scatter_add_(1, bank_labels[index], torch.exp(top / temperature))
    return votes.argmax(dim=1)


# the shared probe h0 and the fine-tune back ------------------------------------------------------
def fit_probe(train_x, train_y, val_x, val_y, classes: int, lrs: list[float], steps: int, seed: int):
    """h0: a linear probe on standardised features, its lr chosen on validation accuracy; the
    standardisation is folded in (W/σ, b − (W/σ)μ) so h0 acts on raw features. Returns (head, lr)."""
    mean, std = train_x.mean(0), train_x.std(0).clamp_min(1e-6)
    zs_train, zs_val = (train_x - mean) / std, (val_x - mean) / std
    best = None
    for lr in lrs:
        torch.manual_seed(seed)
        probe = nn.Linear(train_x.shape[1], classes)
        optimizer = torch.optim.Adam(probe.parameters(), lr=lr)
        for _ in range(steps):  # full batch: the features are small
            loss = F.cross_entropy(probe(zs_train), train_y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            score = accuracy(probe(zs_val), val_y)
        if best is None or score > best[0]:
            best = (score, lr, probe)
    _, lr, probe = best
    return fold_standardisation(probe, mean, std), lr


def fold_standardisation(probe: nn.Linear, mean: torch.Tensor, std: torch.Tensor) -> nn.Linear:
    """A probe on (x − μ)/σ as one on x: W' = W/σ, b' = b − W'μ."""
    folded = nn.Linear(probe.in_features, probe.out_features)
    with torch.no_grad():
        folded.weight.copy_(probe.weight / std)
        folded.bias.copy_(probe.bias - folded.weight @ mean)
    return folded


def fine_tune(encoder: nn.Module, head: nn.Linear, images: torch.Tensor, labels: torch.Tensor, steps: int,
              batch_size: int, lr: float, weight_decay: float, warmup_frac: float, seed: int, device: str,
              log_every: int = 10, augment: bool = True):
    """The FT of LP-FT: every fine-tune starts from (θ, h0) — copies, never the caller's modules. `augment`:
    each batch through random_affine (crop + rotation); False: the clean images as they are."""
    model = Classifier(copy.deepcopy(encoder), copy.deepcopy(head)).to(device).train().requires_grad_(True)
    curve = []
    if steps == 0:
        return model.eval(), curve
    optimizer, schedule = adamw(model.parameters(), lr, weight_decay, steps, warmup_frac)
    generator = torch.Generator().manual_seed(seed)
    order = batches(len(images), min(batch_size, len(images)), generator)
    for step in range(steps):
        index = next(order)
        loss = ft_step(model, optimizer, schedule, images[index].to(device), labels[index].to(device), generator,
                       augment)
        if step % log_every == 0 or step == steps - 1:
            curve.append((step, distributed.mean(float(loss.detach()))))
    return model.eval(), curve


def ft_step(model: nn.Module, optimizer, schedule, images: torch.Tensor, labels: torch.Tensor,
            generator: torch.Generator, augment: bool = True) -> torch.Tensor:
    """One fine-tune step on a global batch (images and labels on the model's device): augment, this rank's
    slice under torchrun, cross-entropy, backward, the ranks' gradient average, AdamW and the schedule."""
    batch = random_affine(images, generator) if augment else images  # torchrun: the global batch, then this rank's equal slice of it
    loss = F.cross_entropy(model(distributed.shard(batch)), distributed.shard(labels))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    distributed.average_gradients(model.parameters())  # as DDP's; without torchrun nothing
    optimizer.step()
    schedule.step()
    return loss


# greedy soup ------------------------------------------------------------------------------------
def greedy_soup(scores: list[float], evaluate_soup) -> tuple[list[int], float]:
    """Wortsman et al.: visit ingredients by decreasing score; keep one if the uniform soup of the
    kept ones plus it does not lower the held-out score. evaluate_soup(indices) -> score."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    kept, best = [order[0]], scores[order[0]]
    for i in order[1:]:
        score = evaluate_soup(kept + [i])
        if score >= best:
            kept, best = kept + [i], score
    return kept, best


# self-seasoning ------------------------------------------------------------------------------------
class FeatureNet(nn.Module):
    """z of an encoder as a module, so torch.func.functional_call can run it on souped parameters
    (its state keys are `encoder.…`, as in a Classifier)."""

    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.encoder = encoder

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return cls_features(self.encoder, images)


def neighbour_entropy(features: torch.Tensor, top_k: int, temperature: float) -> torch.Tensor:
    """Mean entropy of softmax(top-k in-batch cosine similarities / T), self excluded."""
    normalised = F.normalize(features, dim=1)
    similarity = normalised @ normalised.T
    similarity = similarity.masked_fill(torch.eye(len(features), dtype=torch.bool, device=features.device), -2.0)
    top = similarity.topk(min(top_k, len(features) - 1), dim=1).values / temperature
    probabilities = top.softmax(dim=1)
    return -(probabilities * top.log_softmax(dim=1)).sum(dim=1).mean()


def season_weights(module: nn.Module, states: list[dict], pool: torch.Tensor, epochs: int,
                   steps_per_epoch: int, batch_size: int, top_k: int, temperature: float, lr: float,
                   final_lr: float, seed: int, device: str):
    """Label-free soup weights w = softmax(β): only β is trained (Adam, cosine lr → final_lr), through
    torch.func.functional_call of `module` (images → features) with the souped parameters, to minimise the neighbour
    entropy on unlabelled `pool`; returns the weights of the lowest-loss epoch and the epoch losses."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    stacked = stack_states(states, device)
    beta = torch.zeros(len(states), device=device, requires_grad=True)
    optimizer = torch.optim.Adam([beta], lr=lr)
    total = epochs * steps_per_epoch
    schedule = get_cosine_with_min_lr_schedule_with_warmup(optimizer, 0, total, min_lr=final_lr)
    generator = torch.Generator().manual_seed(seed)
    order = batches(len(pool), min(batch_size, len(pool)), generator)
    module = module.to(device).eval()
    best, losses = None, []
    for _ in range(epochs):
        epoch_loss = 0.0
        for _ in range(steps_per_epoch):
            loss = season_step(module, stacked, beta, optimizer, schedule, pool[next(order)].to(device), top_k,
                               temperature)
            epoch_loss += float(loss.detach()) / steps_per_epoch
        losses.append(epoch_loss)
        if best is None or epoch_loss < best[0]:
            best = (epoch_loss, beta.detach().softmax(dim=0).cpu().tolist())
    return best[1], losses


def stack_states(states: list[dict], device: str) -> dict:
    """Every floating-point entry of the members' states stacked: {key: [members, *shape]} on `device`."""
    keys = [k for k, v in states[0].items() if torch.is_floating_point(v)]
    return {k: torch.stack([s[k] for s in states]).to(device) for k in keys}


def season_step(module: nn.Module, stacked: dict, beta: torch.Tensor, optimizer, schedule, images: torch.Tensor,
                top_k: int, temperature: float) -> torch.Tensor:
    """One step of β: the softmax(β)-weighted soup of `stacked`, the neighbour entropy of its features on
    `images` through torch.func.functional_call, backward into β alone, Adam and the schedule."""
    from torch.func import functional_call

    weights = beta.softmax(dim=0)
    params = {k: torch.tensordot(weights, v, dims=1) for k, v in stacked.items()}
    features = functional_call(module, params, (images,))
    loss = neighbour_entropy(features, top_k, temperature)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    schedule.step()
    return loss


# interpolation ------------------------------------------------------------------------------------------
def interpolation_barrier(losses: list[float], alphas: list[float]) -> float:
    """max_α [L(θ_α) − ((1−α)L_a + αL_b)], L_a = L(α=0), L_b = L(α=1)."""
    first, last = losses[0], losses[-1]
    return max(loss - ((1 - a) * first + a * last) for a, loss in zip(alphas, losses))


def interpolate(state_a: dict, state_b: dict, alpha: float) -> dict:
    return soup_state([state_a, state_b], [1 - alpha, alpha])

