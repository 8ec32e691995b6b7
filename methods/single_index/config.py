"""Configuration of `icml single-index`: one dataclass tree, three presets, a one-line validator.

Three sections: `ode` (the population dynamics in Hermite-coefficient / overlap coordinates),
`rkhs` (the finite-sample alternating estimator and its baselines) and `data` (a user file for
the estimator). Every field is settable with `--set section.key=value`. Nothing here imports numpy
or torch: help and listing read this module.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

# Hermite coefficients {k: a*_k} of the population targets φ* = Σ a*_k h_k (h_k = He_k/√k!).
TARGETS: dict[str, dict[int, float]] = {
    "he2": {2: 1.0},
    "he3": {3: 1.0},
    "he2_he3": {2: 1.0, 3: 1.0},  # the trap: planted flow stops at m = −2/3
    "he2_he4": {2: 1 / math.sqrt(2), 4: 1 / math.sqrt(2)},  # the passive a₄ mode
}
ODE_VARIANTS = ["joint", "planted", "l2_flow", "argmin_phi"]
RKHS_VARIANTS = ["joint", "planted", "save", "sir", "fixed_w"]
VARIANTS = list(dict.fromkeys(ODE_VARIANTS + RKHS_VARIANTS))
PHI_UPDATES = ("gradient", "argmin")
INIT_A = ("zero", "target")
DATA_SUFFIXES = (".csv", ".parquet", ".pq", ".npz")


def info_exponent(target: str) -> int:
    """s = min{k ≥ 1 : a*_k ≠ 0}."""
    return min(k for k, a in TARGETS[target].items() if k >= 1 and a != 0)


def degree(target: str) -> int:
    return max(TARGETS[target])


@dataclass
class OdeConfig:
    targets: list[str] = field(default_factory=lambda: list(TARGETS))
    d_grid: list[int] = field(default_factory=lambda: [100, 400, 1600, 6400])  # m₀ = ±d^(−1/2)
    K: int = 6  # φ = Σ_{k≤K} a_k h_k
    lam: float = 0.8  # λ_k = lam^k, the RKHS (Mehler) eigenvalues of the φ-flow; 1 is the L² flow
    phi_update: str = "gradient"  # gradient | argmin (a_k = a*_k m^k instantly) for the `joint` variant
    init_a: str = "zero"  # zero | target: a(0) of the escape sweeps
    t_max: float = 1e8  # ODE time horizon for the final values (escape of he3 at d=6400 ≈ 3·10⁶)
    variants: list[str] = field(default_factory=lambda: list(ODE_VARIANTS))
    trap_m0: float = -0.1  # the trap demo (he2_he3) starts here
    slope_min_d: int = 400  # escape_slope fits log T½ vs log d over d ≥ this (past the d-free transient)
    rtol: float = 1e-10
    atol: float = 1e-14
    n_grid: int = 160  # log-spaced trajectory points per ODE run


@dataclass
class RkhsConfig:
    target: str = "he2_he3"  # φ*, scaled to unit L² norm: y = (h₂ + h₃)(⟨w*,x⟩)/√2 + noise
    d: int = 64
    n: int = 8000
    K: int = 6
    rho: float = 0.8  # λ_k = ρ^k: the truncated Mehler kernel K(z,z′) = Σ λ_k h_k(z) h_k(z′)
    mu: float = 1e-3  # ridge: a = (ΦᵀΦ/n + μΛ⁻¹)⁻¹ Φᵀy/n
    eta: float = 0.5  # w-step size on the sphere
    iters: int = 300
    m0: float = -0.3  # w₀ = m₀ w* + √(1−m₀²) u, u ⊥ w*
    noise: float = 0.1
    n_test: int = 10_000
    phi_steps: int = 0  # 0: exact kernel-ridge φ-step; j > 0: j gradient steps on the ridge objective
    phi_lr: float = 0.5  # step size of those φ gradient steps (in the λ-preconditioned metric)
    slices: int = 10  # quantile slices of y for SAVE / SIR
    variants: list[str] = field(default_factory=lambda: list(RKHS_VARIANTS))


@dataclass
class DataConfig:
    path: str | None = None  # CSV / Parquet / npz with columns x0…x{d−1}, y (npz may add w_star)
    test_fraction: float = 0.2  # held out for test_mse on user data


@dataclass
class SingleIndexConfig:
    ode: OdeConfig = field(default_factory=OdeConfig)
    rkhs: RkhsConfig = field(default_factory=RkhsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    seeds: int = 5  # estimator seeds: run seed, run seed + 1, …


def preset(name: str) -> SingleIndexConfig:
    cfg = SingleIndexConfig()
    if name == "smoke":
        cfg.ode.targets = ["he2", "he2_he3"]
        cfg.ode.d_grid = [100, 400]
        cfg.ode.slope_min_d = 100  # two d's: the slope is a two-point one
        cfg.ode.n_grid = 60
        cfg.rkhs.d = 32
        cfg.rkhs.n = 2000
        cfg.rkhs.iters = 100
        cfg.seeds = 2
    elif name == "paper":  # the paper's experiments were not retrieved: documented, not confirmed
        cfg.rkhs.d = 256
        cfg.rkhs.n = 100_000
        cfg.rkhs.K = 10
        cfg.rkhs.iters = 1000
        cfg.seeds = 10
    return cfg


def validate(cfg: SingleIndexConfig) -> None:
    """Reject values the experiments cannot run with, in one line each."""
    ode, rkhs = cfg.ode, cfg.rkhs
    for key, values, valid in (("ode.targets", ode.targets, TARGETS), ("ode.variants", ode.variants, ODE_VARIANTS),
                               ("rkhs.variants", rkhs.variants, RKHS_VARIANTS)):
        unknown = [v for v in values if v not in valid]
        if unknown:
            raise ValueError(f"unknown value(s) {unknown} in '{key}'; valid: {', '.join(valid)}")
    if not ode.targets:
        raise ValueError("ode.targets must name at least one target")
    if rkhs.target not in TARGETS:
        raise ValueError(f"rkhs.target must be one of {', '.join(TARGETS)}, not '{rkhs.target}'")
    if ode.phi_update not in PHI_UPDATES:
        raise ValueError(f"ode.phi_update must be one of {', '.join(PHI_UPDATES)}, not '{ode.phi_update}'")
    if ode.init_a not in INIT_A:
        raise ValueError(f"ode.init_a must be one of {', '.join(INIT_A)}, not '{ode.init_a}'")
    if not ode.d_grid or any(d < 2 for d in ode.d_grid):
        raise ValueError(f"ode.d_grid must be a non-empty list of dimensions ≥ 2, not {ode.d_grid}")
    highest = max(degree(t) for t in ode.targets)
    if ode.K < highest:
        raise ValueError(f"ode.K ({ode.K}) is below the degree {highest} of a chosen target; use ode.K ≥ {highest}")
    if rkhs.K < degree(rkhs.target):
        raise ValueError(f"rkhs.K ({rkhs.K}) is below the degree {degree(rkhs.target)} of rkhs.target")
    if ode.K > 30 or rkhs.K > 30:
        raise ValueError("ode.K and rkhs.K must be ≤ 30 (higher Hermite features overflow float64 tails)")
    for key, value in (("ode.lam", ode.lam), ("rkhs.rho", rkhs.rho)):
        if not 0 < value <= 1:
            raise ValueError(f"{key} must be in (0, 1] (λ_k = {key.split('.')[1]}^k), not {value}")
    positive = {"ode.t_max": ode.t_max, "ode.rtol": ode.rtol, "ode.atol": ode.atol, "ode.n_grid": ode.n_grid,
                "rkhs.d": rkhs.d, "rkhs.n": rkhs.n, "rkhs.mu": rkhs.mu, "rkhs.eta": rkhs.eta,
                "rkhs.iters": rkhs.iters, "rkhs.n_test": rkhs.n_test, "rkhs.phi_lr": rkhs.phi_lr, "seeds": cfg.seeds}
    for key, value in positive.items():
        if not value > 0:
            raise ValueError(f"{key} must be positive, not {value}")
    if rkhs.d < 2:
        raise ValueError(f"rkhs.d must be ≥ 2 (w lives on the sphere S^(d−1)), not {rkhs.d}")
    if rkhs.slices < 2 or rkhs.slices > rkhs.n // 2:
        raise ValueError(f"rkhs.slices must be in [2, n/2], not {rkhs.slices}")
    if rkhs.phi_steps < 0 or rkhs.noise < 0:
        raise ValueError("rkhs.phi_steps and rkhs.noise must be ≥ 0")
    if not -1 < rkhs.m0 < 1 or not -1 < ode.trap_m0 < 1:
        raise ValueError(f"rkhs.m0 and ode.trap_m0 must be overlaps in (−1, 1), not {rkhs.m0}, {ode.trap_m0}")
    if not 0 < cfg.data.test_fraction < 1:
        raise ValueError(f"data.test_fraction must be in (0, 1), not {cfg.data.test_fraction}")
    if cfg.data.path is not None:
        from pathlib import Path

        path = Path(cfg.data.path)
        if not path.is_file():
            raise ValueError(f"data.path '{cfg.data.path}' is not a file (CSV, Parquet or npz with x0…x{{d−1}}, y)")
        if path.suffix.lower() not in DATA_SUFFIXES:
            raise ValueError(f"data.path '{cfg.data.path}' has an unknown format; use {', '.join(DATA_SUFFIXES)}")


def check_inputs(cfg: SingleIndexConfig) -> None:
    """Before a run exists: the user's sample is read and checked by the loader the run uses."""
    if cfg.data.path:
        from icml.methods.single_index.estimator import load_user_sample

        load_user_sample(cfg.data.path, cfg.data.test_fraction, seed=0)
