"""DivIn and what it is compared with: the guidance potential on Tweedie x̂₀ at the sampler's first
timestep, the unadjusted Langevin update of the initial noise, the SAIL-like deterministic baseline,
and the untouched CFG sampler with the trajectory options CADS, interval guidance and particle guidance.

Every random draw of sample i comes from generators seeded by (sample seed, stream), never from a
batch-wide generator, so a sample is the same alone or in any batch (PG alone couples samples: that
is its point). Streams: 0 initial noise, 1 Langevin ξ, 2 CADS condition noise, 10+r SAIL restart r.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

NOISE, XI, CADS_NOISE, SAIL_RESTART = 0, 1, 2, 10


# per-sample randomness -------------------------------------------------------------------------------
def sample_seed(*keys: int) -> int:
    """One integer seed from a tuple of non-negative integers (run seed, eval seed, class, index…)."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(1)[0])


def generators(seeds, stream: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(sample_seed(s, stream)) for s in seeds]


def per_sample_randn(gens: list[torch.Generator], shape, dtype=torch.float32) -> torch.Tensor:
    """Row i drawn from gens[i] only."""
    return torch.stack([torch.randn(tuple(shape), generator=g, dtype=dtype) for g in gens])


def initial_noise(seeds, shape, dtype=torch.float32) -> torch.Tensor:
    """z ~ N(0, I): the starting noise every arm shares for a given sample seed."""
    return per_sample_randn(generators(seeds, NOISE), shape, dtype)


# the sampler's schedule ----------------------------------------------------------------------------------
class Schedule:
    """A diffusers scheduler at a fixed number of steps, plus the quantities DivIn and the trajectory
    options read from it: Tweedie x̂₀, normalised time t_n (1 = noise) and the noise-to-signal σ_t."""

    def __init__(self, scheduler, param: str, steps: int):
        self.scheduler, self.param, self.steps = scheduler, param, steps
        scheduler.set_timesteps(steps)
        self.timesteps = scheduler.timesteps.clone()
        self.train_timesteps = scheduler.config.num_train_timesteps
        if param == "eps":
            self.alphas = scheduler.alphas_cumprod.to(torch.float64)
        else:
            self.sigmas = scheduler.sigmas.to(torch.float64).clone()

    def alpha_bar(self, i: int) -> float:
        return float(self.alphas[int(self.timesteps[i])])

    def t_norm(self, i: int) -> float:
        return float(self.timesteps[i]) / self.train_timesteps if self.param == "eps" else float(self.sigmas[i])

    def tweedie(self, z: torch.Tensor, out: torch.Tensor, i: int = 0) -> torch.Tensor:
        """x̂₀: (z − √(1−ᾱ_t)·ε)/√ᾱ_t for ε-prediction; z − σ_t·v for rectified flow."""
        if self.param == "eps":
            a = self.alpha_bar(i)
            return (z - math.sqrt(1 - a) * out) / math.sqrt(a)
        return z - float(self.sigmas[i]) * out

    def snr_sigma(self, i: int) -> float:
        """σ_t = √((1−ᾱ_t)/ᾱ_t) (eps) or t/(1−t) (flow; infinite at t = 1)."""
        if self.param == "eps":
            a = self.alpha_bar(i)
            return math.sqrt((1 - a) / a)
        t = float(self.sigmas[i])
        return math.inf if t >= 1 else t / (1 - t)

    def step(self, out: torch.Tensor, i: int, x: torch.Tensor) -> torch.Tensor:
        if i == 0:  # FlowMatchEuler keeps a step index: restart it for every trajectory
            self.scheduler.set_timesteps(self.steps)
        return self.scheduler.step(out, self.timesteps[i], x).prev_sample


# the denoiser --------------------------------------------------------------------------------------
class Denoiser:
    """A class-conditional model called as (x, t, labels); `pair` runs the conditional and null passes as
    one batch (one NFE, as in the official code). An unconditional model gives cond = uncond, so U ≡ 0."""

    def __init__(self, model, null: int | None, conditional: bool = True):
        self.model, self.null, self.conditional = model, null, conditional

    @property
    def class_embedding(self):
        return getattr(self.model, "class_embedding", None) if self.conditional else None

    def __call__(self, x, t, labels):
        t = torch.as_tensor(t, device=x.device)
        out = self.model(x, t, class_labels=labels) if self.conditional else self.model(x, t)
        return getattr(out, "sample", out)

    def pair(self, x, t, labels):
        if not self.conditional:
            out = self(x, t, None)
            return out, out
        null = torch.full_like(labels, self.null)
        out = self(torch.cat([x, x]), t, torch.cat([labels, null]))
        return out.chunk(2)


# DivIn ---------------------------------------------------------------------------------------------------
def potential(den: Denoiser, sched: Schedule, z, labels, kind: str = "sq") -> torch.Tensor:
    """U(z, c) = ‖x̂₀(z, c) − x̂₀(z, ∅)‖² (sq, official code) or its square root (l2, the paper), per sample,
    at the sampler's first timestep t₀, from separate conditional and null passes (not the CFG output)."""
    out_c, out_u = den.pair(z, sched.timesteps[0], labels)
    diff = sched.tweedie(z, out_c, 0) - sched.tweedie(z, out_u, 0)
    u = diff.pow(2).flatten(1).sum(1)
    return u if kind == "sq" else u.clamp_min(torch.finfo(u.dtype).tiny).sqrt()


def potential_grad(den, sched, z, labels, kind: str = "sq"):
    """(U, ∇_z U) by autograd through the denoiser; U is summed over the batch, so each sample's gradient
    is its own (no interaction between samples)."""
    with torch.enable_grad():
        z = z.detach().requires_grad_(True)
        u = potential(den, sched, z, labels, kind)
        (grad,) = torch.autograd.grad(u.sum(), z)
    return u.detach(), grad


@dataclass
class Init:
    z: torch.Tensor
    u_before: torch.Tensor | None = None  # per sample
    force_ratio: torch.Tensor | None = None  # ‖τ∇U‖/‖z‖ at the initial z
    pull_noise: torch.Tensor | None = None  # ‖ητ∇U‖/‖√(2η)ξ‖ of the first step: the potential's pull against the noise
    nfe: torch.Tensor | None = None  # denoiser calls per sample spent on the initialisation


def divin_init(den, sched, z, labels, seeds, *, tau: float, eta: float, k_steps: int, prior: bool = True,
               noise: bool = True, kind: str = "sq") -> Init:
    """K unadjusted Langevin steps on p(z|c) ∝ N(z; 0, I)·exp(−τU(z, c)):
    z ← z − η(τ∇U(z) + z) + √(2η)ξ, ξ from each sample's own generator.
    Ablations: prior=False drops the −ηz anchor, noise=False drops √(2η)ξ."""
    xi = generators(seeds, XI)
    out = Init(z)
    for k in range(k_steps):
        u, grad = potential_grad(den, sched, z, labels, kind)
        if k == 0:
            out.u_before = u
            out.force_ratio = (tau * grad).flatten(1).norm(dim=1) / z.flatten(1).norm(dim=1)
        drift = tau * grad + z if prior else tau * grad
        z = z - eta * drift
        if noise:
            kick = math.sqrt(2 * eta) * per_sample_randn(xi, z.shape[1:], z.dtype).to(z.device)
            if k == 0:
                out.pull_noise = (eta * tau * grad).flatten(1).norm(dim=1) / kick.flatten(1).norm(dim=1)
            z = z + kick
    out.z = z.detach()
    out.nfe = torch.full((len(z),), float(k_steps))
    return out


def calibrate_tau(den, sched, z, labels, kind: str = "sq") -> float:
    """τ* with median ‖τ*∇U‖ = median ‖z‖ on the given noises (U scales with d and (1−ᾱ)/ᾱ, so SD's τ does
    not transfer): the force that balances the prior's pull."""
    _, grad = potential_grad(den, sched, z, labels, kind)
    g = grad.flatten(1).norm(dim=1).median()
    return float(z.flatten(1).norm(dim=1).median() / g) if g > 0 else 0.0


# SAIL-like baseline ------------------------------------------------------------------------------------
def sail_init(den, sched, z, labels, seeds, *, lr: float, steps: int, restarts: int, threshold: float | None,
              rise: float, z_weight: float) -> Init:
    """Deterministic Adam on z minimising L(z) = ‖Δ(z + Δ(z)/‖Δ(z)‖)‖ + z_weight·‖z‖ with Δ = ε_c − ε_∅
    (x̂₀ difference for flow). A latent is kept once L ≤ threshold; a failed one restarts from fresh noise
    and its threshold rises by `rise` after every three failures; the last attempt is kept regardless.
    Restart 0 starts from the shared initial noise. Default threshold: the batch's median initial L."""

    def delta(x):
        out_c, out_u = den.pair(x, sched.timesteps[0], labels_now)
        if sched.param == "flow":
            return sched.tweedie(x, out_c, 0) - sched.tweedie(x, out_u, 0)
        return out_c - out_u

    def loss(x):
        d = delta(x)
        norm = d.flatten(1).norm(dim=1).clamp_min(1e-12).view((-1,) + (1,) * (x.dim() - 1))
        return delta(x + d / norm).flatten(1).norm(dim=1) + z_weight * x.flatten(1).norm(dim=1)

    n = len(z)
    nfe = torch.zeros(n)
    result = z.clone()
    pending = torch.arange(n)
    fails = torch.zeros(n, dtype=torch.long)
    labels_now = labels
    with torch.no_grad():
        initial = loss(z)
    nfe += 2
    thresholds = torch.full((n,), float(initial.median()) if threshold is None else threshold, dtype=initial.dtype)
    for r in range(restarts + 1):
        labels_now = labels[pending]
        start = z[pending] if r == 0 else per_sample_randn(
            generators([seeds[int(i)] for i in pending], SAIL_RESTART + r), z.shape[1:], z.dtype)
        x = start.clone().requires_grad_(True)
        optimizer = torch.optim.Adam([x], lr=lr)
        with torch.enable_grad():
            for _ in range(steps):
                optimizer.zero_grad(set_to_none=True)
                loss(x).sum().backward()  # a sum: each latent's Adam state and step are its own
                optimizer.step()
        with torch.no_grad():
            final = loss(x)
        nfe[pending] += 2 * (steps + 1)
        accept = (final <= thresholds[pending]) | (r == restarts)
        result[pending[accept]] = x.detach()[accept]
        pending = pending[~accept]
        if len(pending) == 0:
            break
        fails[pending] += 1
        thresholds[pending] += rise * (fails[pending] % 3 == 0)
    return Init(result, nfe=nfe)


# the sampler and its trajectory options -------------------------------------------------------------------
@dataclass
class Trajectory:
    """Which trajectory options are on and their settings (spec defaults)."""

    cads: bool = False
    ig: bool = False
    pg: bool = False
    cads_tau1: float = 0.6
    cads_tau2: float = 1.0
    cads_s: float = 0.002
    ig_lo: float = 0.1
    ig_hi: float = 0.9
    pg_coeff: float = 32.0
    pg_ref_dim: int | None = 16_384
    pg_particles: int = 4
    pg_sigma_max: float = 14.6

    def pg_strength(self, dim: int) -> float:
        """The PG coefficient at sample dimension d: coeff·d/ref_dim. The kernel repulsion per coordinate
        scales as log(n−1)/d (h ∝ d), while ε has unit scale per coordinate, so the official coefficient
        (set for SD1's d = 16 384) applied as is to d = 2 is ~8 000× stronger relative to ε and blows the
        samples away; scaling it by d/ref_dim keeps SD's ratio. ref_dim None: the coefficient as is."""
        return self.pg_coeff if self.pg_ref_dim is None else self.pg_coeff * dim / self.pg_ref_dim

    def cads_gamma(self, t_n: float) -> float:
        """γ = 1 for t_n ≤ τ₁, 0 for t_n ≥ τ₂, linear between (t_n = 1 is noise)."""
        if t_n <= self.cads_tau1:
            return 1.0
        if t_n >= self.cads_tau2:
            return 0.0
        return (self.cads_tau2 - t_n) / (self.cads_tau2 - self.cads_tau1)

    def guidance(self, w: float, t_n: float) -> float:
        """Interval guidance: w only while the progress 1 − t_n lies in [lo, hi]; 1 (conditional) outside."""
        if self.ig and not self.ig_lo <= 1 - t_n <= self.ig_hi:
            return 1.0
        return w


class _CadsState:
    gamma: float = 1.0
    noise: torch.Tensor | None = None


@contextmanager
def cads_hook(den: Denoiser, traj: Trajectory, state: _CadsState):
    """CADS by a forward hook on the class-embedding output (our adaptation): the conditional rows become
    √γ·y + s·√(1−γ)·n; the null rows stay as they are."""
    module = den.class_embedding if traj.cads else None
    if module is None:
        yield
        return

    def hook(_, inputs, output):
        if state.gamma >= 1 or state.noise is None:
            return output
        cond = inputs[0] != den.null
        out = output.clone()
        out[cond] = math.sqrt(state.gamma) * output[cond] + \
            traj.cads_s * math.sqrt(1 - state.gamma) * state.noise.to(output.device, output.dtype)
        return out

    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def pg_groups(labels: torch.Tensor | None, n: int, particles: int) -> torch.Tensor:
    """PG's particle sets: consecutive chunks of `particles` samples of the same class (as PG's 4 images
    generated together for one prompt), not a whole class; a class's last chunk may be smaller."""
    labels = torch.zeros(n, dtype=torch.long) if labels is None else labels.cpu()
    groups = torch.empty(n, dtype=torch.long)
    start = 0
    for c in torch.unique(labels):
        idx = torch.nonzero(labels == c).flatten()
        groups[idx] = start + torch.arange(len(idx)) // particles
        start += -(-len(idx) // particles)
    return groups


def particle_force(x: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Σ_j 2·exp(−‖x_i−x_j‖²/h)·(x_i−x_j)/h within each group, h = the group's median pairwise
    distance²/log(n−1); groups of fewer than 3 particles get no force. Groups of equal size are batched."""
    flat = x.flatten(1)
    force = torch.zeros_like(flat)
    _, inverse, counts = torch.unique(groups.cpu(), return_inverse=True, return_counts=True)
    order = torch.argsort(inverse, stable=True)  # members of a group contiguous, in batch order
    starts = torch.cumsum(counts, 0) - counts
    for size in torch.unique(counts).tolist():
        if size < 3:
            continue
        idx = order[starts[counts == size][:, None] + torch.arange(size)].to(x.device)  # [groups, size]
        f = flat[idx]  # [G, n, D]
        d2 = (f[:, :, None, :] - f[:, None, :, :]).pow(2).sum(-1)  # [G, n, n]
        off = d2[:, ~torch.eye(size, dtype=torch.bool, device=x.device)]
        h = (off.median(dim=1).values / math.log(size - 1))[:, None, None]
        k = torch.exp(-d2 / h.clamp_min(torch.finfo(d2.dtype).tiny))
        group_force = 2 / h * (f * k.sum(2, keepdim=True) - k @ f)
        force[idx] = torch.where(h > 0, group_force, torch.zeros_like(group_force))
    return force.view_as(x)


def sample(den: Denoiser, sched: Schedule, z, labels, w: float, traj: Trajectory | None = None, seeds=None,
           groups: torch.Tensor | None = None) -> torch.Tensor:
    """The unchanged CFG sampler (DDIM η=0 or Euler) from z: ε̃ = ε_∅ + w(ε_c − ε_∅) per step, with the
    trajectory options switched on in `traj`. DivIn only changes z. PG couples the samples of each of
    `groups` (default: `pg_groups` of the labels)."""
    traj = traj or Trajectory()
    if traj.pg:
        groups = pg_groups(labels, len(z), traj.pg_particles) if groups is None else groups
        coeff = traj.pg_strength(z[0].numel())
    state = _CadsState()
    cads_gens = generators(seeds, CADS_NOISE) if traj.cads and den.class_embedding is not None else None
    x = z
    with torch.no_grad(), cads_hook(den, traj, state):
        for i, t in enumerate(sched.timesteps):
            t_n = sched.t_norm(i)
            if cads_gens is not None:
                state.gamma = traj.cads_gamma(t_n)
                state.noise = per_sample_randn(cads_gens, (den.class_embedding.embedding_dim,), torch.float32) \
                    if state.gamma < 1 else None
            out_c, out_u = den.pair(x, t, labels)
            out = out_u + traj.guidance(w, t_n) * (out_c - out_u)
            if traj.pg:
                sigma = sched.snr_sigma(i)
                if sigma >= 1:
                    sigma = min(sigma, traj.pg_sigma_max)
                    delta = coeff * sigma * particle_force(x, groups)
                    # flow: subtracting δ from the equivalent ε (= x + (1−t)v) is v − δ/(1−t), and 1/(1−t) = 1 + σ_t
                    out = out - (delta if sched.param == "eps" else delta * (1 + sigma))
            x = sched.step(out, i, x)
    return x
