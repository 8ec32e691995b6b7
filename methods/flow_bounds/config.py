"""Configuration of `icml flow-bounds`: one dataclass tree, three presets, a one-line validator.

`--data FILE` (= `--set data=FILE`) replaces the 8-Gaussian mixture of learned mode with a user 2-D
point cloud (.csv, .npy or .parquet); `data=gmm` (the default) is the built-in mixture.
"""
from __future__ import annotations

from dataclasses import dataclass, field

COUPLINGS = ("ou", "shifted", "aniso")
DRIFT_LOSSES = ("bridge", "endpoint")  # endpoint: the ablation drift_loss=endpoint
DATA_SUFFIXES = (".csv", ".npy", ".parquet")


def _powers_of_two(lo: int, hi: int) -> list[int]:
    return [2 ** k for k in range(lo.bit_length() - 1, hi.bit_length())]


@dataclass
class ExactConfig:
    couplings: list[str] = field(default_factory=lambda: list(COUPLINGS))
    N_grid: list[int] = field(default_factory=lambda: _powers_of_two(8, 512))  # uniform-grid step counts
    d_grid: list[int] = field(default_factory=lambda: _powers_of_two(1, 256))
    eps_grid: list[float] = field(default_factory=lambda: [0.0, 0.02, 0.04, 0.08])  # injected drift error
    delta_grid: list[float] = field(default_factory=lambda: [1e-2, 1e-3])  # early stop at 1 − δ
    v1_grid: list[float] = field(default_factory=lambda: [1e-2, 1e-4, 1e-6])  # target variance (shifted, aniso)
    h_grid: list[float] = field(default_factory=lambda: [0.04, 0.02, 0.01, 0.005])  # Thm 3 schedule parameter
    schedule_d: list[int] = field(default_factory=lambda: [1, 16])  # dimensions of the schedule comparison
    c: float = 0.0  # shifted coupling's cross-covariance Cov(X0_i, X1_i); |c| < √v1
    prior_a: float = 1.0  # prior-work factor h·(a·d⁴ + b·d(d+2)(d+4)(d+6)): our reconstruction
    prior_b: float = 5.0
    slope_min_n: int = 32  # fit log-log slopes over N ≥ this


@dataclass
class LearnedConfig:
    enabled: bool = True
    steps: int = 20_000
    batch: int = 512
    lr: float = 1e-3
    hidden: int = 64
    layers: int = 2
    frequencies: int = 16  # sinusoidal time embedding
    delta: float = 0.01  # train on t ~ U[0, 1−δ] and sample up to 1−δ
    drift_losses: list[str] = field(default_factory=lambda: list(DRIFT_LOSSES))
    N_grid: list[int] = field(default_factory=lambda: _powers_of_two(8, 256))
    n_samples: int = 2000  # generated = reference = noise-floor sample size (exact OT)
    eps_samples: int = 2000  # Monte Carlo samples per grid time for ε̂²
    log_every: int = 100
    components: int = 8  # mixture: means at radius 4, angles 2πj/components
    radius: float = 4.0
    component_std: float = 0.3
    holdout: float = 0.2  # user data: held-out fraction W₂ is measured against


@dataclass
class FlowBoundsConfig:
    data: str = "gmm"  # gmm | a user 2-D point cloud (.csv, .npy, .parquet)
    sigma: float = 1.0  # bridge/sampler noise for shifted, aniso and learned mode (ou has σ² = 2 by definition)
    seeds: int = 3  # learned-mode seeds: run seed + 0, 1, …
    workers: int = 2  # learned-mode seeds in parallel, one single-threaded process each
    exact: ExactConfig = field(default_factory=ExactConfig)
    learned: LearnedConfig = field(default_factory=LearnedConfig)


def preset(name: str) -> FlowBoundsConfig:
    cfg = FlowBoundsConfig()
    if name == "smoke":
        cfg.exact.d_grid = [1, 4, 16]
        cfg.exact.N_grid = [8, 32, 128]
        cfg.exact.eps_grid = [0.0, 0.04]
        cfg.exact.delta_grid = [1e-2]
        cfg.exact.v1_grid = [1e-2, 1e-4]
        cfg.exact.h_grid = [0.04, 0.02]
        cfg.exact.schedule_d = [1]
        cfg.learned.steps = 2000
        cfg.learned.N_grid = [16, 64]
        cfg.learned.n_samples = 500
        cfg.learned.eps_samples = 500
        cfg.seeds = 1
        cfg.workers = 1
    elif name == "paper":  # our scaled-up setting: the paper reports no experiments
        cfg.exact.d_grid = _powers_of_two(1, 4096)
        cfg.learned.hidden = 256
        cfg.learned.layers = 3
        cfg.learned.steps = 100_000
        cfg.learned.n_samples = 10_000
        cfg.learned.eps_samples = 10_000
        cfg.seeds = 5
        cfg.workers = 1
    return cfg


def validate(cfg: FlowBoundsConfig) -> None:
    from pathlib import Path

    ex, le = cfg.exact, cfg.learned
    unknown = [c for c in ex.couplings if c not in COUPLINGS]
    if unknown:
        raise ValueError(f"unknown coupling(s) {unknown}; valid: {', '.join(COUPLINGS)}")
    bad_loss = [v for v in le.drift_losses if v not in DRIFT_LOSSES]
    if bad_loss or not le.drift_losses:
        raise ValueError(f"learned.drift_losses must be a non-empty subset of {', '.join(DRIFT_LOSSES)}, "
                         f"not {le.drift_losses}")
    for key, grid in (("exact.N_grid", ex.N_grid), ("exact.d_grid", ex.d_grid), ("exact.schedule_d", ex.schedule_d),
                      ("learned.N_grid", le.N_grid)):
        if not grid or any(v < 1 for v in grid):
            raise ValueError(f"{key} must be a non-empty list of positive integers, not {grid}")
    if not ex.eps_grid or any(e < 0 for e in ex.eps_grid):
        raise ValueError(f"exact.eps_grid must be a non-empty list of numbers >= 0, not {ex.eps_grid}")
    if any(not 0 < d < 0.5 for d in ex.delta_grid):
        raise ValueError(f"exact.delta_grid values must lie in (0, 0.5) (early stop at 1 − δ), not {ex.delta_grid}")
    if not ex.v1_grid or any(not 0 < v <= 1e6 for v in ex.v1_grid):
        raise ValueError(f"exact.v1_grid must be a non-empty list of target variances > 0, not {ex.v1_grid}")
    if any(not 0 < h < 0.5 for h in ex.h_grid):
        raise ValueError(f"exact.h_grid values must lie in (0, 0.5), not {ex.h_grid}")
    if abs(ex.c) >= min(ex.v1_grid) ** 0.5:
        raise ValueError(f"exact.c = {ex.c} must satisfy |c| < √v1 = {min(ex.v1_grid) ** 0.5:.3g} for every v1 "
                         "(a degenerate coupling has no density, so its score bounds are infinite)")
    if not cfg.sigma > 0:
        raise ValueError(f"sigma must be > 0, not {cfg.sigma}")
    if ex.slope_min_n < 1:
        raise ValueError(f"exact.slope_min_n must be positive, not {ex.slope_min_n}")
    if not 0 < le.delta < 0.5:
        raise ValueError(f"learned.delta must lie in (0, 0.5), not {le.delta}")
    for key in ("steps", "batch", "hidden", "layers", "frequencies", "n_samples", "eps_samples", "log_every",
                "components"):
        if getattr(le, key) < 1:
            raise ValueError(f"learned.{key} must be positive, not {getattr(le, key)}")
    if not le.lr > 0 or not le.radius >= 0 or not le.component_std > 0:
        raise ValueError("learned.lr and learned.component_std must be > 0 and learned.radius >= 0")
    if not 0 < le.holdout < 1:
        raise ValueError(f"learned.holdout must lie in (0, 1), not {le.holdout}")
    if cfg.seeds < 1 or cfg.workers < 1:
        raise ValueError(f"seeds and workers must be positive, not {cfg.seeds} and {cfg.workers}")
    if cfg.data != "gmm":
        path = Path(cfg.data)
        if not path.is_file():
            raise ValueError(f"data '{cfg.data}' is not a file (use data=gmm or a 2-D point cloud file)")
        if path.suffix.lower() not in DATA_SUFFIXES:
            raise ValueError(f"data '{cfg.data}' has an unknown format; use one of {', '.join(DATA_SUFFIXES)}")
        from icml.methods.flow_bounds.points import load_point_cloud

        load_point_cloud(cfg.data, le.holdout, 0)  # a corrupt or unusable file fails before a run exists
