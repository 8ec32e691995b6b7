"""Configuration of `icml diverse-init`: one dataclass tree, three presets.

Every field is settable with `--set key=value` (e.g. `--set divin.eta=0.1 --set traj=cads,ig`);
`--model DIR` sets `model` (a class-conditional UNet2DModel or pipeline directory; with `--preset paper` a
Stable Diffusion pipeline), `--data FILE` sets `data` (an .npz of `images` [N,H,W] or [N,1,H,W] and integer
`labels`, replacing sklearn digits). `check_checkpoint` / `check_sd_pipeline` read such a directory from its
headers only (JSON and safetensors headers, no torch), so `check_inputs` refuses it before a run exists.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from icml.cli import checkpoints

TIERS = ("gmm", "digits")
PARAMS = ("eps", "flow")
INIT_ARMS = ("base", "divin", "divin_no_noise", "divin_no_prior", "sail")
TRAJ_ARMS = ("cads", "divin_cads", "ig", "divin_ig", "pg", "divin_pg")
VARIANTS = INIT_ARMS + TRAJ_ARMS
TRAJECTORIES = ("cads", "ig", "pg")
POTENTIALS = ("sq", "l2")
BETA_SCHEDULES = ("scaled_linear", "linear")
MODEL_CLASSES = ("UNet2DModel", "GmmDenoiser")  # what `model.load_checkpoint` builds from a config.json
EPS_SCHEDULERS = ("DDIMScheduler", "DDPMScheduler", "PNDMScheduler", "EulerDiscreteScheduler",
                  "DPMSolverMultistepScheduler")  # ε-prediction: their β table is read into a DDIMScheduler
FLOW_SCHEDULERS = ("FlowMatchEulerDiscreteScheduler",)
# paper.pipeline -> (the pipeline class, its denoiser's folder, the denoiser's class)
PAPER_PIPELINES = {"sd1": ("StableDiffusionPipeline", "unet", "UNet2DConditionModel"),
                   "sd3": ("StableDiffusion3Pipeline", "transformer", "SD3Transformer2DModel")}


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
        # a plumbing check within the 60 s smoke budget (train + eval + report on 2 cores, `make bench`)
        cfg.gmm.steps = 500
        cfg.gmm.n_per_class = 200
        cfg.gmm.seeds = 1
        cfg.gmm.sample_steps = 10
        cfg.gmm.cfg_scales = [4.0]
        cfg.gmm.k_steps = [1]
        cfg.gmm.n_ref = 1_000
        cfg.digits.steps = 25  # the spec's 100: the UNet costs ~0.3 s a step on one core even at batch 16
        cfg.digits.batch_size = 16
        cfg.digits.n_per_class = 8
        cfg.digits.sample_steps = 10
        cfg.digits.cfg_scales = [4.0]
        cfg.digits.clf_steps = 100
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


@dataclass(frozen=True)
class CheckpointDir:
    """What `check_checkpoint` read of a denoiser directory; `model.load_checkpoint` builds from it."""

    model_dir: Path  # the folder of config.json and the weights (DIR, or DIR/unet of a pipeline)
    model_class: str  # one of MODEL_CLASSES
    config: dict  # the model's config.json
    scheduler: dict  # its scheduler_config.json
    param: str  # eps | flow, named by the scheduler class
    null: int | None  # the null class embedding (None: an unconditional model)


def check_checkpoint(path, null_class: int | None = None) -> CheckpointDir:
    """A denoiser directory, from its headers only: a model directory (config.json of a UNet2DModel or GmmDenoiser
    with scheduler_config.json and the weights beside it, as `model.save_checkpoint` writes) or a pipeline
    directory (unet/ and scheduler/, as DDPMPipeline.save_pretrained writes); an ε-prediction scheduler
    (DDIM/DDPM/PNDM/Euler/DPM-Solver) or FlowMatchEuler; the weights present and whole. Raises IcmlError in one
    line naming the file and the fix."""
    from icml.cli.errors import IcmlError

    root = Path(path)
    model_dir, scheduler_dir = (root / "unet", root / "scheduler") if (root / "unet" / "config.json").is_file() \
        else (root, root)
    if not (model_dir / "config.json").is_file():
        raise IcmlError(f"model '{path}' is neither a model directory nor a pipeline with unet/ (no config.json)",
                        "save the model and its scheduler with save_pretrained into that directory")
    config = _read_json(model_dir / "config.json", path)
    model_class = config.get("_class_name")
    if model_class not in MODEL_CLASSES:
        if model_class in ("UNet2DConditionModel", "SD3Transformer2DModel"):
            fix = "a text-conditional Stable Diffusion pipeline goes with --preset paper"
        else:
            fix = "give a class-conditional UNet2DModel directory with its scheduler (save_pretrained of both)"
        # a transformers config.json has no _class_name but a model_type: name that, it is what the user will know
        found = model_class or (f"a {config['model_type']} transformers model" if config.get("model_type")
                                else "no diffusers model class")
        raise IcmlError(f"model '{path}': {(model_dir / 'config.json').relative_to(root)} describes {found}, not a "
                        f"{' or '.join(MODEL_CLASSES)}", fix)
    scheduler_file = scheduler_dir / "scheduler_config.json"
    if not scheduler_file.is_file():
        raise IcmlError(f"model '{path}' has no scheduler_config.json beside it",
                        "save its scheduler there (scheduler.save_pretrained(DIR)); DDIM/DDPM → eps, FlowMatchEuler → flow")
    scheduler = _read_json(scheduler_file, path)
    name = scheduler.get("_class_name", "")
    if name in EPS_SCHEDULERS:
        param = "eps"
        if scheduler.get("prediction_type", "epsilon") != "epsilon":
            raise IcmlError(f"scheduler of '{path}' predicts {scheduler['prediction_type']}",
                            "diverse-init supports ε-prediction (DDIM/DDPM) and rectified flow (FlowMatchEuler)")
    elif name in FLOW_SCHEDULERS:
        param = "flow"
    else:
        raise IcmlError(f"scheduler '{name}' of '{path}' is not supported",
                        "use a DDIM/DDPM (eps) or FlowMatchEulerDiscrete (flow) scheduler config")
    n_embeds = config.get("num_class_embeds")
    null = (null_class if null_class is not None else n_embeds - 1) if n_embeds else None
    if null is not None and not 0 <= null < n_embeds:
        raise IcmlError(f"null_class {null} is outside the model's {n_embeds} class embeddings",
                        "set --set null_class=<index of the unconditional embedding>")
    checkpoints.check_weights(model_dir, str(path))
    return CheckpointDir(model_dir, model_class, config, scheduler, param, null)


def check_sd_pipeline(path, pipeline: str) -> None:
    """The paper preset's --model, from its headers only: model_index.json naming the pipeline class of
    `paper.pipeline` (sd1: StableDiffusionPipeline with a UNet2DConditionModel under unet/; sd3:
    StableDiffusion3Pipeline with an SD3Transformer2DModel under transformer/), scheduler/, every component
    folder it lists present and every model's weights whole. Raises IcmlError in one line."""
    from icml.cli.errors import IcmlError

    root = Path(path)
    pipeline_class, denoiser, denoiser_class = PAPER_PIPELINES[pipeline]
    save = f"save a {pipeline_class} with save_pretrained or download one into it"
    if not (root / "model_index.json").is_file():
        raise IcmlError(f"model '{path}' is not a diffusers pipeline directory (no model_index.json)", save)
    components = _read_json(root / "model_index.json", path)
    found = components.get("_class_name")
    if found != pipeline_class:
        other = [key for key, (name, _, _) in PAPER_PIPELINES.items() if name == found]
        raise IcmlError(f"model '{path}' is a {found}, not the {pipeline_class} of paper.pipeline={pipeline}",
                        f"use --set paper.pipeline={other[0]}" if other else save)
    config = _read_json(root / denoiser / "config.json", path)
    if config.get("_class_name") != denoiser_class:
        raise IcmlError(f"model '{path}': {denoiser}/config.json describes {config.get('_class_name')}, "
                        f"not a {denoiser_class}", save)
    _read_json(root / "scheduler" / "scheduler_config.json", path)
    for name, entry in components.items():
        if name.startswith("_") or not isinstance(entry, list) or entry[-1] is None:
            continue  # the pipeline's own options, and absent parts (safety_checker [null, null])
        if not (root / name).is_dir():
            raise IcmlError(f"model '{path}': {name}/ is missing (model_index.json lists it)", save)
        if (root / name / "config.json").is_file():  # a model (tokenizers and schedulers have no config.json)
            checkpoints.check_weights(root / name, str(path))


def _read_json(file: Path, given) -> dict:
    from icml.cli.errors import IcmlError

    name = file.relative_to(Path(given))  # the user knows the directory they gave
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except OSError:
        raise IcmlError(f"model '{given}': {name} is missing", "re-save it with save_pretrained") from None
    except (ValueError, UnicodeDecodeError):
        raise IcmlError(f"model '{given}': {name} is not valid JSON", "re-save it with save_pretrained") from None
    if not isinstance(value, dict):
        raise IcmlError(f"model '{given}': {name} is not a JSON object", "re-save it with save_pretrained")
    return value


def check_inputs(cfg: DiverseInitConfig) -> None:
    """Before a run exists: --model is a checkpoint this run drives, read from its headers only. The paper
    preset takes a Stable Diffusion pipeline; the other presets a denoiser directory, which replaces the digits
    tier's trained models and so must make 1×16² samples (`generate --model` takes any size)."""
    from icml.cli.errors import IcmlError

    if not cfg.model:
        return
    if cfg.paper.enabled:
        check_sd_pipeline(cfg.model, cfg.paper.pipeline)
        return
    ckpt = check_checkpoint(cfg.model, cfg.null_class)
    if "digits" in cfg.tiers:
        if ckpt.model_class != "UNet2DModel":
            raise IcmlError(f"model '{cfg.model}' is a {ckpt.model_class}; the digits tier replaces its UNet2DModel",
                            "give a UNet2DModel directory (1 channel, sample_size 16)")
        shape = (ckpt.config.get("in_channels"), ckpt.config.get("sample_size"))
        if shape != (1, 16):
            raise IcmlError(f"model '{cfg.model}' makes {shape[0]}×{shape[1]}² samples; eval measures 1×16² digits",
                            "use `icml diverse-init generate --model DIR` for other models")
