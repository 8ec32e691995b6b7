"""GRAM's training: data plans, per-micro-batch routing, per-group optimizers; MaxEnt; elicitation.

A plan is a list of optimizer steps, each a list of micro-batches carrying their own route: the
modules to run, the groups to update, and the groups that run frozen (as detached parameter
views). The same loop trains the dense baseline and the filtered models (every micro-batch
updates the core) and every GRAM variant, so they differ only in their plans.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from icml.cli import distributed
from icml.methods.gradient_route.model import CORE, forward, lm_loss, param_groups

UNLABELLED = "unlabelled"


@dataclass
class MicroBatch:
    windows: torch.Tensor  # (b, length) token ids: inputs [:, :-1], targets [:, 1:]
    label: str  # core | an aux domain | unlabelled
    route: dict[str, float] | None  # modules run (None: all present)
    update: frozenset[str]  # groups whose parameters receive gradient
    frozen: frozenset[str] = field(default_factory=frozenset)  # run, but as detached views


# --- plans -------------------------------------------------------------------------------------------
def domain_shares(cfg, corpus) -> dict[str, float]:
    """Each domain's share of the baseline's tokens: core_share and equal aux shares (synthetic), or
    the domains' sizes (user data, unlabelled included)."""
    if hasattr(corpus, "pool_size"):
        sizes = {d: corpus.pool_size(d) for d in corpus.domains + ([UNLABELLED] if corpus.has_unlabelled else [])}
        total = sum(sizes.values())
        return {d: n / total for d, n in sizes.items()}
    aux = (1 - cfg.core_share) / len(corpus.aux)
    return {"core": cfg.core_share, **{d: aux for d in corpus.aux}}


def baseline_counts(cfg, corpus) -> dict[str, int]:
    total = cfg.steps * cfg.batch
    return {d: int(round(s * total)) for d, s in domain_shares(cfg, corpus).items()}


def gram_flops_per_window(counts: dict[str, int], sizes: dict[str, int], p_cr: float) -> float:
    """Σ windows × active parameters of GRAM's forward sets: core (+ one module with prob. p_cr),
    core + the domain's module, or everything for unlabelled windows."""
    aux_sizes = {g: n for g, n in sizes.items() if g != CORE}
    mean_aux = sum(aux_sizes.values()) / max(1, len(aux_sizes))
    flops = 0.0
    for domain, n in counts.items():
        if domain == "core":
            flops += n * (sizes[CORE] + p_cr * mean_aux)
        elif domain == UNLABELLED:
            flops += n * sum(sizes.values())
        else:
            flops += n * (sizes[CORE] + aux_sizes[domain])
    return flops


def gram_windows(cfg, corpus, base: dict[str, int], dense_params: int, sizes: dict[str, int], *,
                 label_frac: float = 1.0, p_cr: float | None = None) -> tuple[dict[str, torch.Tensor], float]:
    """GRAM's training windows per label: aux oversampled p_af, the first label_frac of each aux
    domain's windows labelled and the rest `unlabelled`, every count × λ = F_base / F_GRAM (App. I)
    so that GRAM spends the baseline's compute."""
    p_cr = cfg.p_cr if p_cr is None else p_cr
    labelled = {d: base[d] * label_frac * cfg.p_af for d in corpus.aux}
    unlabelled = {d: base[d] * (1 - label_frac) for d in corpus.aux}
    if base.get(UNLABELLED):
        unlabelled[UNLABELLED] = base[UNLABELLED]
    counts = {"core": base["core"], **labelled}
    if sum(unlabelled.values()):
        counts[UNLABELLED] = sum(unlabelled.values())
    lam = 1.0
    if cfg.compute_match:
        lam = sum(base.values()) * dense_params / gram_flops_per_window(counts, sizes, p_cr)
    windows = {"core": corpus.train("core", int(round(lam * base["core"])))}
    spare = []
    for d in corpus.aux:
        n_lab, n_unl = int(round(lam * labelled[d])), int(round(lam * unlabelled[d]))
        pool = corpus.train(d, n_lab + n_unl)
        windows[d] = pool[:n_lab]
        spare.append(pool[n_lab:])
    if UNLABELLED in unlabelled:
        spare.append(corpus.train(UNLABELLED, int(round(lam * unlabelled[UNLABELLED]))))
    spare = torch.cat(spare) if spare else torch.empty(0, corpus.length, dtype=torch.long)
    if len(spare):
        windows[UNLABELLED] = spare
    return {d: w for d, w in windows.items() if len(w)}, lam


def flops(windows: dict[str, torch.Tensor], sizes: dict[str, int], p_cr: float, routed: bool) -> float:
    """Σ tokens × active parameters of a training set (dense: every parameter, every token)."""
    counts = {d: len(w) for d, w in windows.items()}
    tokens = windows[next(iter(windows))].shape[1] - 1
    if not routed:
        return tokens * sum(counts.values()) * sum(sizes.values())
    return tokens * gram_flops_per_window(counts, sizes, p_cr)


def _chunks(windows: torch.Tensor, size: int, rng: np.random.Generator) -> list[torch.Tensor]:
    order = torch.from_numpy(rng.permutation(len(windows)))
    shuffled = windows[order]
    return [shuffled[i:i + size] for i in range(0, len(windows) - size + 1, size)]


def _exact_or_bernoulli(n: int, p: float, rng: np.random.Generator, routing: str) -> np.ndarray:
    """Which of n micro-batches take a draw: exactly round(p·n), shuffled (stratified) or i.i.d."""
    if routing == "bernoulli":
        return rng.random(n) < p
    hits = np.zeros(n, dtype=bool)
    hits[:int(round(p * n))] = True
    return rng.permutation(hits)


def _module_choices(n: int, names: list[str], shares: np.ndarray, rng: np.random.Generator,
                    routing: str) -> list[str]:
    """One module per drawn core micro-batch, ∝ data share: exact proportional counts or i.i.d."""
    if routing == "bernoulli":
        return [names[i] for i in rng.choice(len(names), size=n, p=shares)]
    counts = np.floor(shares * n).astype(int)
    for i in np.argsort(-(shares * n - counts))[: n - counts.sum()]:
        counts[i] += 1
    return list(rng.permutation(np.repeat(names, counts)))


def plan(windows: dict[str, torch.Tensor], cfg, seed: int, *, routed: bool, modules: list[str],
         window_level: bool = False, p_as: float | None = None, p_cr: float | None = None) -> list[list[MicroBatch]]:
    """Optimizer steps of accum micro-batches, each from one domain (heterogeneous windows), in a seeded
    order. routed=False: dense training, every micro-batch updates the core whatever its label.
    window_level: every micro-batch of a step comes from the same domain (the uniform-accum ablation)."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 11]))
    micro = cfg.batch // cfg.accum
    size = micro * cfg.accum if window_level else micro
    units = [(label, chunk) for label, pool in windows.items() for chunk in _chunks(pool, size, rng)]
    order = rng.permutation(len(units))
    units = [units[i] for i in order]
    if window_level:
        units = [(label, sub) for label, chunk in units for sub in chunk.split(micro)]
    p_as = cfg.p_as if p_as is None else p_as
    p_cr = cfg.p_cr if p_cr is None else p_cr
    sizes = np.array([len(windows.get(m, ())) for m in modules], dtype=float)
    shares = sizes / sizes.sum() if sizes.sum() else np.full(len(modules), 1 / max(1, len(modules)))
    routes = _routes([label for label, _ in units], cfg, rng, routed, modules, shares, p_as, p_cr, window_level)
    batches = [MicroBatch(chunk, label, *route) for (label, chunk), route in zip(units, routes)]
    n_steps = len(batches) // cfg.accum
    return [batches[i * cfg.accum:(i + 1) * cfg.accum] for i in range(n_steps)]


def _routes(labels: list[str], cfg, rng, routed: bool, modules: list[str], shares: np.ndarray, p_as: float,
            p_cr: float, window_level: bool) -> list[tuple]:
    everything = frozenset([CORE, *modules])
    if not routed:
        return [({}, frozenset([CORE]), frozenset())] * len(labels)
    group = cfg.accum if window_level else 1  # window-level masks: one draw per step, shared by its micro-batches
    heads = labels[::group]
    routes: list[tuple | None] = [None] * len(heads)
    core_at = [i for i, label in enumerate(heads) if label == "core"]
    drawn = [i for i, hit in zip(core_at, _exact_or_bernoulli(len(core_at), p_cr, rng, cfg.routing)) if hit]
    for i, name in zip(drawn, _module_choices(len(drawn), modules, shares, rng, cfg.routing)):
        routes[i] = ({name: 1.0}, frozenset([CORE, name]), frozenset())
    for i in core_at:
        routes[i] = routes[i] or ({}, frozenset([CORE]), frozenset())
    for domain in modules:
        at = [i for i, label in enumerate(heads) if label == domain]
        for i, hit in zip(at, _exact_or_bernoulli(len(at), p_as / cfg.p_af, rng, cfg.routing)):
            routes[i] = ({domain: 1.0}, frozenset([CORE, domain]), frozenset()) if hit else \
                ({domain: 1.0}, frozenset([domain]), frozenset([CORE]))
    for i, label in enumerate(heads):
        if label == UNLABELLED:
            routes[i] = (None, everything, frozenset())
    return [route for route in routes for _ in range(group)][:len(labels)]


def routing_frequencies(steps: list[list[MicroBatch]]) -> dict[str, float]:
    """Observed p_cr (core micro-batches that also ran a module) and p_as per module."""
    batches = [mb for step in steps for mb in step]
    core = [mb for mb in batches if mb.label == "core"]
    out = {"core": float(np.mean([bool(mb.route) for mb in core])) if core else float("nan")}
    for label in sorted({mb.label for mb in batches} - {"core", UNLABELLED}):
        own = [mb for mb in batches if mb.label == label]
        out[label] = float(np.mean([CORE in mb.update for mb in own]))
    return out


# --- the training loop -------------------------------------------------------------------------------
def wsd_lr(step: int, total: int, peak: float, fractions) -> float:
    """Warmup-stable-decay: linear warmup, constant, linear decay to 0 over the last fraction."""
    warm = max(1, int(round(fractions[0] * total)))
    decay = int(round(fractions[2] * total))
    if step < warm:
        return peak * (step + 1) / warm
    if step >= total - decay:
        return peak * max(0.0, total - step) / max(1, decay)
    return peak


def adamw(params, cfg, lr: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)


class GroupOptimizers:
    """One AdamW per group (core, each module). After a window only groups with some .grad are
    stepped, clipped to cfg.clip over their union; then every grad is set to None, so an unstepped
    group gets no decay, moment update or step count. single=True is the ablation: one AdamW over all
    and grads zeroed in place, so decay and momentum also move parameters that got no gradient.
    Under torchrun the gradients are first averaged over the ranks, a parameter keeping None only where
    no rank gave it one: "received" is decided on the global batch, alike on every rank."""

    def __init__(self, model, cfg, single: bool = False):
        self.cfg = cfg
        self.single = single
        self.groups = param_groups(model)
        if single:
            self.optimizers = {"all": adamw([p for ps in self.groups.values() for p in ps], cfg, cfg.lr)}
        else:
            self.optimizers = {g: adamw(ps, cfg, cfg.lr) for g, ps in self.groups.items()}

    def step(self, lr: float) -> list[str]:
        distributed.average_gradients(p for ps in self.groups.values() for p in ps)
        received = [g for g, ps in self.groups.items() if any(p.grad is not None for p in ps)]
        params = [p for g in received for p in self.groups[g] if p.grad is not None]
        if params:
            torch.nn.utils.clip_grad_norm_(params, self.cfg.clip)
        stepped = ["all"] if self.single else received
        for name in stepped:
            for group in self.optimizers[name].param_groups:
                group["lr"] = lr
            self.optimizers[name].step()
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=not self.single)
        return received


def train_steps(model, steps: list[list[MicroBatch]], cfg, pad_id: int, *, single_optimizer: bool = False,
                on_step=None) -> list[float]:
    """Run the plan; returns the train loss of every step. on_step(step_done) runs after each step."""
    optimizers = GroupOptimizers(model, cfg, single=single_optimizer)
    losses = []
    for t, step in enumerate(steps):
        parts = train_step(model, optimizers, step, pad_id, wsd_lr(t, len(steps), cfg.lr, cfg.wsd))
        total = 0.0
        for part in parts:
            total += float(part)
        losses.append(distributed.mean(total))
        if on_step is not None:
            on_step(t + 1)
    return losses


def train_step(model, optimizers: GroupOptimizers, step: list[MicroBatch], pad_id: int, lr: float
               ) -> list[torch.Tensor]:
    """One optimizer step: forward and backward of every micro-batch with its own route (per micro-batch
    masks), then the group optimizers. Returns each micro-batch's share of the step's loss, detached."""
    parts = []
    for mb in step:  # torchrun: every rank runs the same route on its slice of the micro-batch
        loss = rank_loss(model, mb.windows, pad_id, mb.route, mb.frozen) / len(step)
        loss.backward()
        parts.append(loss.detach())
    optimizers.step(lr)
    return parts


def rank_loss(model, windows: torch.Tensor, pad_id: int, route=None, frozen=()) -> torch.Tensor:
    """The mean next-token loss of `windows` (a global batch), or under torchrun this rank's part of it:
    the summed loss of its `shard` ÷ the global batch's target count over the ranks (windows may hold
    padding, so the ranks' token means would be weighed wrongly), whose mean over the ranks is the
    global batch's loss."""
    if not distributed.launched():
        return lm_loss(forward(model, windows[:, :-1], route, frozen), windows[:, 1:], pad_id)
    part = distributed.shard(windows)
    logits = forward(model, part[:, :-1], route, frozen)
    summed = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), part[:, 1:].reshape(-1), ignore_index=pad_id,
                             reduction="sum")
    return summed / distributed.sum_divisor((windows[:, 1:] != pad_id).sum().clamp_min(1))


@torch.no_grad()
def window_losses(model, windows: torch.Tensor, pad_id: int, route=None, chunk: int = 32) -> torch.Tensor:
    """Mean per-token cross-entropy of every window (nats per token)."""
    out = []
    for part in windows.split(chunk):
        logits = forward(model, part[:, :-1], route)
        ce = F.cross_entropy(logits.transpose(1, 2), part[:, 1:], ignore_index=pad_id, reduction="none")
        mask = (part[:, 1:] != pad_id).float()
        out.append((ce * mask).sum(1) / mask.sum(1).clamp_min(1))
    return torch.cat(out)


def mean_loss(model, windows: torch.Tensor, pad_id: int, route=None) -> float:
    return float(window_losses(model, windows, pad_id, route).mean())


# --- post-hoc unlearning and the relearning attack ------------------------------------------------
def maxent_loss(model, x_f: torch.Tensor, x_r: torch.Tensor, lam: float, pad_id: int) -> torch.Tensor:
    """Mean-token KL(p_θ(·|x_F) ‖ Uniform) + λ·CE(x_R); under torchrun this rank's slice of x_F."""
    log_p = F.log_softmax(forward(model, distributed.shard(x_f)[:, :-1]), dim=-1)
    kl_uniform = (log_p.exp() * log_p).sum(-1).mean() + math.log(log_p.shape[-1])  # KL(p‖U) = log V − H(p)
    return kl_uniform + lam * rank_loss(model, x_r, pad_id)


def maxent_unlearn(model, forget: torch.Tensor, retain_core: torch.Tensor, retain_aux: torch.Tensor | None,
                   cfg, pad_id: int, seed: int, lam: float) -> list[float]:
    """MaxEnt: minimise `maxent_loss` at retain weight λ in place, retain batches 3:1 core:aux (all core
    when the profile retains no module). Every λ of a sweep draws the same batches (same seed)."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 13]))
    m = cfg.maxent
    optimizer = torch.optim.AdamW(model.parameters(), lr=m.lr, betas=(cfg.beta1, cfg.beta2),
                                  weight_decay=cfg.weight_decay)
    n_aux = m.batch // 4 if retain_aux is not None and len(retain_aux) else 0
    losses = []
    for _ in range(m.steps):
        x_f = forget[torch.from_numpy(rng.integers(len(forget), size=m.batch))]
        parts = [retain_core[torch.from_numpy(rng.integers(len(retain_core), size=m.batch - n_aux))]]
        if n_aux:
            parts.append(retain_aux[torch.from_numpy(rng.integers(len(retain_aux), size=n_aux))])
        # under torchrun: every rank draws the same batches and trains on its equal slice of x_f
        loss = maxent_step(model, optimizer, x_f, torch.cat(parts), lam, pad_id, cfg.clip)
        losses.append(distributed.mean(float(loss)))
    return losses


def maxent_step(model, optimizer, x_f: torch.Tensor, x_r: torch.Tensor, lam: float, pad_id: int, clip: float
                ) -> torch.Tensor:
    """One MaxEnt update on forget windows x_f and retain windows x_r; returns the loss, detached."""
    loss = maxent_loss(model, x_f, x_r, lam, pad_id)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    distributed.average_gradients(model.parameters())
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return loss.detach()


def elicit(deployed, attack: torch.Tensor, heldout: torch.Tensor, cfg, pad_id: int,
           lr_divisor: float | None = None) -> list[float]:
    """Relearning attack on a copy of the deployed model (ablated modules absent): all parameters,
    AdamW at peak lr / lr_divisor (default elicit.lr_divisor), one full-batch step per round on the fixed
    attack windows.
    Returns the held-out loss before the attack and after each round, stopping after `patience` rounds
    without a new minimum."""
    model = copy.deepcopy(deployed)
    divisor = cfg.elicit.lr_divisor if lr_divisor is None else lr_divisor
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr / divisor,
                                  betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
    losses = [mean_loss(model, heldout, pad_id)]
    best, since = math.inf, 0
    for _ in range(cfg.elicit.rounds):
        attack_round(model, optimizer, attack, pad_id, cfg.clip, cfg.elicit.chunk)
        losses.append(mean_loss(model, heldout, pad_id))
        if losses[-1] < best:
            best, since = losses[-1], 0
        else:
            since += 1
            if since >= cfg.elicit.patience:
                break
    return losses


def attack_round(model, optimizer, attack: torch.Tensor, pad_id: int, clip: float, chunk: int | None = None
                 ) -> torch.Tensor:
    """One round of the relearning attack: a full-batch AdamW step on the attack windows, their gradient
    accumulated over parts of `chunk` windows (each part's summed token loss over the batch's target count: the
    full batch's mean loss and gradient); returns the loss."""
    optimizer.zero_grad(set_to_none=True)
    if not chunk or chunk >= len(attack):
        loss = lm_loss(forward(model, attack[:, :-1]), attack[:, 1:], pad_id)
        loss.backward()
    else:
        count = (attack[:, 1:] != pad_id).sum().clamp_min(1)
        loss = 0.0
        for part in attack.split(chunk):
            logits = forward(model, part[:, :-1])
            summed = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), part[:, 1:].reshape(-1),
                                     ignore_index=pad_id, reduction="sum") / count
            summed.backward()
            loss = loss + summed.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return loss.detach()
