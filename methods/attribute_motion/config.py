"""Configuration of `icml attribute-motion`: one dataclass tree, three presets.

Every field is settable with `--set key=value` (e.g. `--set attr.length_norm=mask_sum`);
`--data DIR` sets `data` (a folder of clips + captions.csv), `--model DIR` sets `model`
(a stacked-frame UNet2DModel saved with save_pretrained).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from icml.data.videos import MOTIONS

SELECTORS = ["motive", "motive_dense", "no_mask", "indep_noise", "no_length_norm", "mean_agg",
             "random", "full", "flow_magnitude", "appearance_match"]
ARMS = ["motive", "no_mask", "random", "full", "flow_magnitude", "appearance_match"]
LENGTH_NORMS = ("frames", "mask_sum", "none")
FLOWS = ("analytic", "lk", "hs", "farneback")


@dataclass
class DataConfig:
    frames: int = 8
    size: int = 16
    n_pretrain: int = 2000
    pretrain_target_share: float = 0.02  # each target motion's share of pretraining: base is weak on it
    n_pool: int = 300
    n_queries: int = 8  # per target motion
    n_heldout: int = 64
    targets: list[str] = field(default_factory=lambda: ["orbit", "diagonal"])


@dataclass
class ModelConfig:
    block_out_channels: list[int] = field(default_factory=lambda: [32, 64, 64])
    layers_per_block: int = 1
    steps: int = 2000  # pretraining steps
    batch_size: int = 32
    lr: float = 3e-4  # pretraining (README: 2e-3 gives cleaner samples but a base that already knows the target)
    label_dropout: float = 0.1
    sample_steps: int = 20  # Euler steps of generation
    cfg_scale: float = 2.0


@dataclass
class AttrConfig:
    t_star: float = 0.75
    patch: int = 4
    length_norm: str = "frames"  # frames (per-frame weights) | mask_sum | none (README: the frame-length correction)
    draws: int = 1  # shared (t, ε) draws each gradient is averaged over (the spec: one shared pair)
    camera: str = "median"  # subtract each frame's median flow (camera motion) before the mask: median | none
    flow_floor: float = 0.25  # px: compensated flow below this is not motion
    prompt: str = "null"  # null | own
    dim: int = 512
    proj_seed: int = 0
    attr_seeds: list[int] = field(default_factory=lambda: [0, 1])
    frac: float = 0.1
    flow: str = "analytic"  # flow of the pool and queries: analytic | lk | hs | farneback
    cos_subset: int = 64  # clips whose exact gradient cosines check the projection
    chunk: int = 160  # clips whose full gradients are held at once (the dense projection regenerates R per chunk)


@dataclass
class FinetuneConfig:
    steps: int = 200
    batch_size: int = 16
    lr: float = 1e-4


@dataclass
class EvalConfig:
    n_videos: int = 64  # per arm
    flow: str = "hs"  # estimator for generated videos: hs | lk | farneback (hs: robust to sampling noise, README)
    interp: str = "flow"  # motion_smoothness midpoint: flow | linear
    evaluator_clips: int = 2000
    evaluator_steps: int = 300


@dataclass
class AttributeMotionConfig:
    selectors: list[str] = field(default_factory=lambda: list(SELECTORS))
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    primary_target: str = "orbit"
    backend: str = "unet"  # unet: the stacked-frame UNet2DModel pipeline | wan: a local WanPipeline (--preset paper)
    data: str | None = None  # a user folder of clips + captions.csv (--data)
    model: str | None = None  # a local stacked-frame UNet2DModel directory (--model)
    clips: DataConfig = field(default_factory=DataConfig)
    unet: ModelConfig = field(default_factory=ModelConfig)
    attr: AttrConfig = field(default_factory=AttrConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def preset(name: str) -> AttributeMotionConfig:
    cfg = AttributeMotionConfig()
    if name == "smoke":
        cfg.selectors = ["motive", "no_mask", "random"]
        cfg.arms = ["motive", "no_mask", "random"]
        cfg.clips.n_pretrain = 400
        cfg.clips.n_pool = 60
        cfg.clips.n_queries = 4
        cfg.clips.n_heldout = 16
        cfg.clips.targets = ["orbit"]
        cfg.unet.steps = 150
        cfg.unet.batch_size = 8
        cfg.unet.block_out_channels = [16, 32, 32]
        cfg.attr.attr_seeds = [0]
        cfg.attr.cos_subset = 16
        cfg.attr.dim = 256
        cfg.attr.chunk = 32
        cfg.finetune.steps = 30
        cfg.finetune.batch_size = 4
        cfg.eval.n_videos = 16
        cfg.eval.evaluator_clips = 300
        cfg.eval.evaluator_steps = 30
        cfg.unet.sample_steps = 10
    elif name == "default":
        cfg.unet.steps = 700  # spec: ~2k; 700 keeps train+eval inside 15 min on 2 cores and the base weak on the target (README)
    elif name == "paper":  # a Wan pipeline from a local directory (--model), user clips
        cfg.backend = "wan"
        cfg.clips.frames = 81
        cfg.clips.size = 480
        cfg.attr.flow = "lk"
        cfg.finetune.steps = 1000
        cfg.finetune.batch_size = 1
        cfg.eval.n_videos = 256
    return cfg


def validate(cfg: AttributeMotionConfig) -> None:
    """Reject values the run cannot use, in one line each."""
    from pathlib import Path

    if cfg.backend not in ("unet", "wan"):
        raise ValueError(f"backend must be unet or wan, not '{cfg.backend}'")
    if cfg.backend == "wan" and not cfg.model:
        raise ValueError("--preset paper runs Motive on a Wan2.1/2.2 text-to-video pipeline: pass --model DIR, a local "
                         "WanPipeline directory (WanPipeline.save_pretrained or a downloaded Wan2.1-T2V-1.3B-Diffusers)")
    if cfg.backend == "wan":
        raise ValueError("backend wan (--preset paper) is not implemented in this build: the Wan path (VAE-latent "
                         "gradients over WanTransformer3DModel) is missing; use --preset default or smoke with the UNet")
    for key, values, valid in (("selectors", cfg.selectors, SELECTORS), ("arms", cfg.arms, ARMS)):
        unknown = [v for v in values if v not in valid]
        if unknown:
            raise ValueError(f"unknown {key} {unknown}; valid: {', '.join(valid)}")
    unknown = [t for t in cfg.clips.targets if t not in MOTIONS or t == "static"]
    if unknown or not cfg.clips.targets:
        raise ValueError(f"clips.targets {cfg.clips.targets} must be moving motions from {', '.join(MOTIONS[1:])}")
    if cfg.primary_target not in cfg.clips.targets:
        raise ValueError(f"primary_target '{cfg.primary_target}' is not in clips.targets {cfg.clips.targets}")
    if cfg.attr.length_norm not in LENGTH_NORMS:
        raise ValueError(f"attr.length_norm must be one of {', '.join(LENGTH_NORMS)}, not '{cfg.attr.length_norm}'")
    if cfg.attr.camera not in ("median", "none"):
        raise ValueError(f"attr.camera must be median or none, not '{cfg.attr.camera}'")
    if cfg.attr.flow_floor < 0:
        raise ValueError(f"attr.flow_floor must be ≥ 0 px, not {cfg.attr.flow_floor}")
    if cfg.attr.prompt not in ("null", "own"):
        raise ValueError(f"attr.prompt must be null or own, not '{cfg.attr.prompt}'")
    if cfg.attr.flow not in FLOWS:
        raise ValueError(f"attr.flow must be one of {', '.join(FLOWS)}, not '{cfg.attr.flow}'")
    if cfg.eval.flow not in FLOWS[1:]:
        raise ValueError(f"eval.flow must be one of {', '.join(FLOWS[1:])}, not '{cfg.eval.flow}'")
    if cfg.eval.interp not in ("flow", "linear"):
        raise ValueError(f"eval.interp must be flow or linear, not '{cfg.eval.interp}'")
    if not 0 < cfg.attr.t_star < 1:
        raise ValueError(f"attr.t_star must be in (0, 1), not {cfg.attr.t_star}")
    if not 0 < cfg.attr.frac < 1:
        raise ValueError(f"attr.frac must be in (0, 1), not {cfg.attr.frac}")
    if cfg.clips.size % cfg.attr.patch:
        raise ValueError(f"attr.patch ({cfg.attr.patch}) must divide clips.size ({cfg.clips.size})")
    if not cfg.attr.attr_seeds:
        raise ValueError("attr.attr_seeds needs at least one seed")
    for key in ("clips.n_pretrain", "clips.n_pool", "clips.n_queries", "clips.n_heldout", "unet.steps",
                "unet.batch_size", "unet.sample_steps", "attr.dim", "attr.draws", "attr.patch", "attr.chunk", "attr.cos_subset",
                "finetune.steps", "finetune.batch_size", "eval.n_videos", "eval.evaluator_clips",
                "eval.evaluator_steps", "clips.frames", "clips.size"):
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) <= 0:
            raise ValueError(f"{key} must be positive, not {getattr(getattr(cfg, section), name)}")
    if cfg.clips.frames < 2:
        raise ValueError(f"clips.frames must be at least 2, not {cfg.clips.frames}")
    if cfg.data and not Path(cfg.data).is_dir():
        raise ValueError(f"data '{cfg.data}' is not a folder (expected clips plus captions.csv)")
    if cfg.model and not any((Path(cfg.model) / name).is_file() for name in ("model_index.json", "config.json")):
        raise ValueError(f"model '{cfg.model}' is not a pipeline or UNet2DModel directory (no model_index.json or "
                         "config.json; save one with save_pretrained)")
    if abs(cfg.attr.t_star * 1000 - round(cfg.attr.t_star * 1000)) > 1e-9:
        raise ValueError(f"attr.t_star must be on the scheduler's table of 1000 levels (a multiple of 0.001), "
                         f"not {cfg.attr.t_star}")
