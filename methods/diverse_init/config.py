"""Configuration of `icml diverse-init`: one dataclass tree, three presets.

Every field is settable with `--set key=value` (e.g. `--set divin.eta=0.1 --set traj=cads,ig`);
`--model DIR` sets `model` (a class-conditional UNet2DModel or pipeline directory), `--data FILE`
sets `data` (an .npz of `images` [N,H,W] or [N,1,H,W] and integer `labels`, replacing sklearn digits).
"""
from __future__ import annotations

from dataclasses import dataclass, field

TIERS = ("gmm", "digits")
PARAMS = ("eps", "flow")
INIT_ARMS = ("base", "divin", "divin_no_noise", "divin_no_prior", "sail")
TRAJ_ARMS = ("cads", "divin_cads", "ig", "divin_ig", "pg", "divin_pg")
VARIANTS = INIT_ARMS + TRAJ_ARMS
TRAJECTORIES = ("cads", "ig", "pg")
POTENTIALS = ("sq", "l2")
BETA_SCHEDULES = ("scaled_linear", "linear")


@dataclass
class GmmConfig:
    n_train: int = 20_000
    n_ref: int = 5_000
    sigma: float = 0.05
    hidden: int = 128
    steps: int = 4_000
    batch_size: int = 512
    lr: float = 1e-3
    n_per_class: int = 500
    seeds: int = 5  # sampling seeds per arm (metrics: mean ± sd)
    sample_steps: int = 25
    cfg_scales: list[float] = field(default_factory=lambda: [1.0, 2.0, 4.0, 7.5])
    k_steps: list[int] = field(default_factory=lambda: [1, 3])
    oracle: bool = True  # eps: the divin_exact control (DivIn on the exact mixture's potential) and grad_cos_exact


@dataclass
class DigitsConfig:
    block_out_channels: list[int] = field(default_factory=lambda: [32, 64, 64])
    steps: int = 1_500
    batch_size: int = 128
    lr: float = 1e-3
    n_per_class: int = 32
    sample_steps: int = 25
    cfg_scales: list[float] = field(default_factory=lambda: [2.0, 4.0])  # all arms at the main scale; base/divin at the rest
    k_steps: list[int] = field(default_factory=lambda: [1])
    clf_steps: int = 600
    tau_sweep: bool = True


@dataclass
class DivinConfig:
    eta: float = 0.05
    tau: float | None = None  # None: tau_frac · τ* (the auto calibration below)
    tau_frac: float = 1.0
    k_steps: int = 1
    potential: str = "sq"  # sq (official code) | l2 (the paper's plain norm)
    tau_grid: list[float] | None = None  # absolute τ values; None = auto: τ*·tau_fracs
    tau_fracs: list[float] = field(default_factory=lambda: [0.0, 0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0])
    calib_noises: int = 64


@dataclass
class CadsConfig:
    tau1: float = 0.6
    tau2: float = 1.0
    s: float = 0.002


@dataclass
class IgConfig:
    lo: float = 0.1
    hi: float = 0.9


@dataclass
class PgConfig:
    coeff: float = 32.0  # the official code's value, for SD1 latents (d = 4·64·64) and 4 particles
    ref_dim: int | None = 16_384  # coeff applies at this d: coeff·d/ref_dim keeps SD's repulsion-to-ε ratio (none: as is)
    particles: int = 4  # samples coupled per group: consecutive same-class samples, as PG's 4 images per prompt
    sigma_max: float = 14.6  # caps σ_t (flow's t/(1−t) is infinite at t = 1); ≈ SD1's σ at t = 999


@dataclass
class SailConfig:
    lr: float = 0.05
    steps: int = 3  # Adam steps per restart
    restarts: int = 4  # at most; the last attempt is kept
    threshold: float | None = None  # None: median initial L of the batch
    rise: float = 0.1  # threshold increase after every three failed restarts
    z_weight: float = 0.05


@dataclass
class PaperConfig:
    enabled: bool = False  # the paper preset: DivIn latents for a local Stable Diffusion pipeline (--model)
    pipeline: str = "sd1"  # sd1 (StableDiffusionPipeline) | sd3 (StableDiffusion3Pipeline)
    images_per_class: int = 10
    seeds: int = 5
    features: str | None = None  # a user-supplied .npz of DINOv2/Inception features of the real set


@dataclass
class DiverseInitConfig:
    tiers: list[str] = field(default_factory=lambda: list(TIERS))
    params: list[str] = field(default_factory=lambda: list(PARAMS))
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    main_cfg: float = 4.0  # the guidance scale of the arms × metrics tables
    beta_schedule: str = "scaled_linear"
    train_timesteps: int = 1000
    label_dropout: float = 0.15
    null_class: int | None = None  # None: the last class-embedding index
    model: str | None = None  # --model DIR: replaces the digits tier's trained models
    data: str | None = None  # --data FILE: replaces sklearn digits
    workers: int = 2  # processes for the independent tier × param jobs of train and eval (cli/workers.py)
    gmm: GmmConfig = field(default_factory=GmmConfig)
    digits: DigitsConfig = field(default_factory=DigitsConfig)
    divin: DivinConfig = field(default_factory=DivinConfig)
    cads: CadsConfig = field(default_factory=CadsConfig)
    ig: IgConfig = field(default_factory=IgConfig)
    pg: PgConfig = field(default_factory=PgConfig)
    sail: SailConfig = field(default_factory=SailConfig)
    paper: PaperConfig = field(default_factory=PaperConfig)


def preset(name: str) -> DiverseInitConfig:
    cfg = DiverseInitConfig()
    if name == "smoke":
        cfg.variants = ["base", "divin"]
        cfg.gmm.steps = 1_000
        cfg.gmm.n_per_class = 200
        cfg.gmm.seeds = 1
        cfg.gmm.sample_steps = 10
        cfg.gmm.cfg_scales = [4.0]
        cfg.gmm.k_steps = [1]
        cfg.gmm.n_ref = 2_000
        cfg.digits.steps = 40  # the spec's 100: the UNet costs ~0.3 s a step on one core even at batch 16
        cfg.digits.batch_size = 16
        cfg.digits.n_per_class = 8
        cfg.digits.sample_steps = 10
        cfg.digits.cfg_scales = [4.0]
        cfg.digits.clf_steps = 150
        cfg.digits.tau_sweep = False
        cfg.divin.calib_noises = 32
    elif name == "default":  # the spec's digits budget (1.5k steps × 128, 32/class, 25 steps) is ~4× the 15 min on 2 cores
        cfg.digits.steps = 600  # ~0.5 CPU-s a step at batch 64 (1.0 at 128): 1.5k × 128 alone is 25 CPU-min per param
        cfg.digits.batch_size = 64
        cfg.digits.n_per_class = 12  # ~5 ms per sample and step: 17 arms × 20 steps × 120 samples ≈ 4 CPU-min per param
        cfg.digits.sample_steps = 20
    elif name == "paper":  # documented only: a local Stable Diffusion directory, user-supplied features
        cfg.paper.enabled = True
        cfg.tiers = ["digits"]
        cfg.params = ["eps"]
        cfg.main_cfg = 7.5
        cfg.digits.cfg_scales = [7.5]
        cfg.digits.sample_steps = 50
        cfg.divin.eta = 0.05
        cfg.divin.tau = 0.6
        cfg.divin.k_steps = 1
    return cfg


def validate(cfg: DiverseInitConfig) -> None:
    """Reject values the run cannot use, in one line each."""
    from pathlib import Path

    for key, values, valid in (("tiers", cfg.tiers, TIERS), ("params", cfg.params, PARAMS),
                               ("variants", cfg.variants, VARIANTS)):
        unknown = [v for v in values if v not in valid]
        if unknown or not values:
            raise ValueError(f"{key} {values} must be a non-empty list from {', '.join(valid)}")
    if "base" not in cfg.variants:
        raise ValueError("variants must include base (every comparison is against it)")
    if cfg.divin.potential not in POTENTIALS:
        raise ValueError(f"divin.potential must be sq or l2, not '{cfg.divin.potential}'")
    if cfg.beta_schedule not in BETA_SCHEDULES:
        raise ValueError(f"beta_schedule must be scaled_linear or linear, not '{cfg.beta_schedule}'")
    if not 0 < cfg.label_dropout < 1:
        raise ValueError(f"label_dropout must be in (0, 1) (CFG needs a trained null class), not {cfg.label_dropout}")
    if not 0 <= cfg.divin.eta < 1:
        raise ValueError(f"divin.eta must be in [0, 1), not {cfg.divin.eta}")
    if cfg.divin.tau is not None and cfg.divin.tau < 0:
        raise ValueError(f"divin.tau must be ≥ 0 (or none for auto), not {cfg.divin.tau}")
    if cfg.divin.tau_grid is not None and (not cfg.divin.tau_grid or min(cfg.divin.tau_grid) < 0):
        raise ValueError(f"divin.tau_grid must be non-negative values (or none for auto), not {cfg.divin.tau_grid}")
    if not cfg.divin.tau_fracs or min(cfg.divin.tau_fracs) < 0:
        raise ValueError(f"divin.tau_fracs must be non-negative multiples of τ*, not {cfg.divin.tau_fracs}")
    if not 0 <= cfg.cads.tau1 < cfg.cads.tau2 <= 1:
        raise ValueError(f"cads needs 0 ≤ tau1 < tau2 ≤ 1, not tau1={cfg.cads.tau1}, tau2={cfg.cads.tau2}")
    if not 0 <= cfg.ig.lo < cfg.ig.hi <= 1:
        raise ValueError(f"ig needs 0 ≤ lo < hi ≤ 1, not lo={cfg.ig.lo}, hi={cfg.ig.hi}")
    if min(cfg.gmm.cfg_scales + cfg.digits.cfg_scales, default=0) < 0:
        raise ValueError("cfg_scales must be non-negative")
    for tier in ("gmm", "digits"):
        scales = getattr(cfg, tier).cfg_scales
        if tier in cfg.tiers and cfg.main_cfg not in scales:
            raise ValueError(f"main_cfg {cfg.main_cfg} is not in {tier}.cfg_scales {scales}")
        if min(getattr(cfg, tier).k_steps, default=0) < 1:
            raise ValueError(f"{tier}.k_steps must be positive integers, not {getattr(cfg, tier).k_steps}")
    for key in ("gmm.n_train", "gmm.n_ref", "gmm.hidden", "gmm.steps", "gmm.batch_size", "gmm.n_per_class",
                "gmm.seeds", "gmm.sample_steps", "digits.steps", "digits.batch_size", "digits.n_per_class",
                "digits.sample_steps", "digits.clf_steps", "divin.k_steps", "divin.calib_noises", "sail.steps",
                "sail.restarts", "train_timesteps", "workers"):
        section, name = key.split(".") if "." in key else (None, key)
        value = getattr(getattr(cfg, section), name) if section else getattr(cfg, name)
        if value <= 0:
            raise ValueError(f"{key} must be positive, not {value}")
    for key in ("gmm.sigma", "gmm.lr", "digits.lr", "sail.lr"):
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) <= 0:
            raise ValueError(f"{key} must be positive, not {getattr(getattr(cfg, section), name)}")
    if cfg.model and not (Path(cfg.model) / "config.json").is_file() and not (Path(cfg.model) / "unet" / "config.json").is_file():
        raise ValueError(f"model '{cfg.model}' is neither a UNet2DModel directory nor a pipeline with unet/ "
                         "(no config.json; save one with save_pretrained)")
    if cfg.data and not (Path(cfg.data).is_file() and str(cfg.data).endswith(".npz")):
        raise ValueError(f"data '{cfg.data}' is not an .npz file (expected arrays `images` and `labels`)")
    if cfg.paper.enabled and not cfg.model:
        raise ValueError("the paper preset needs --model DIR, a local StableDiffusionPipeline or "
                         "StableDiffusion3Pipeline directory (it is documented for GPUs, not run offline)")
    if cfg.pg.particles < 3:
        raise ValueError(f"pg.particles must be ≥ 3 (the bandwidth divides by log(n−1)), not {cfg.pg.particles}")
    if cfg.pg.ref_dim is not None and cfg.pg.ref_dim <= 0:
        raise ValueError(f"pg.ref_dim must be positive (or none for the coefficient as is), not {cfg.pg.ref_dim}")
    if cfg.paper.pipeline not in ("sd1", "sd3"):
        raise ValueError(f"paper.pipeline must be sd1 or sd3, not '{cfg.paper.pipeline}'")
