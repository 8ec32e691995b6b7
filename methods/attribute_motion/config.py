"""Configuration of `icml attribute-motion`: one dataclass tree, three presets.

Every field is settable with `--set key=value` (e.g. `--set attr.length_norm=mask_sum`);
`--data DIR` sets `data` (a folder of clips + captions.csv), `--model DIR` sets `model`
(a stacked-frame UNet2DModel pipeline saved with save_pretrained, or with `--preset paper` a local
WanPipeline directory); `check_unet_dir` / `check_wan_dir` read such a directory from its headers only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from icml.cli import checkpoints, distributed

SELECTORS = ["motive", "motive_dense", "no_mask", "indep_noise", "no_length_norm", "mean_agg", "motive_frames",
             "multi_draw", "random", "full", "flow_magnitude", "appearance_match"]
ARMS = ["motive", "no_mask", "random", "full", "flow_magnitude", "appearance_match"]
LENGTH_NORMS = ("grad_norm", "frames", "mask_sum", "none")
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
    length_norm: str = "grad_norm"  # a pool clip's Z(x): ‖Pg(x)‖ (the cosine) | frames | mask_sum (ΣM) | none (README)
    draws: int = 1  # shared (t, ε) draws each gradient is averaged over (the spec: one shared pair)
    multi_draws: int = 4  # the draws of the `multi_draw` selector: motive's gradients averaged over this many
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
    grid_frames: int = 0  # the evaluators' clip grid (0: clips.frames); generated videos are resampled to it
    grid_size: int = 0  # (0: clips.size)


@dataclass
class AttributeMotionConfig:
    selectors: list[str] = field(default_factory=lambda: list(SELECTORS))
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    primary_target: str = "orbit"
    backend: str = "unet"  # unet: the stacked-frame UNet2DModel pipeline | wan: a local WanPipeline (--preset paper)
    data: str | None = None  # a user folder of clips + captions.csv (--data)
    model: str | None = None  # a local UNet pipeline / UNet2DModel directory, or (backend wan) a WanPipeline directory
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
    elif name == "paper":  # a Wan pipeline from a local directory (--model), user clips (--data)
        cfg.backend = "wan"
        cfg.clips.frames = 81  # Wan2.1's 81 frames = 1 + 4·20: 21 latent frames
        cfg.clips.size = 480  # square 480 px: 60×60 latents
        cfg.attr.flow = "lk"
        cfg.attr.patch = 8  # the Wan VAE's spatial factor: the mask's patches are the latent cells
        cfg.attr.prompt = "own"  # the paper conditions attribution on each clip's caption
        cfg.unet.sample_steps = 50  # WanPipeline's defaults
        cfg.unet.cfg_scale = 5.0
        cfg.finetune.steps = 1000
        cfg.finetune.batch_size = 1
        cfg.eval.n_videos = 256
        cfg.eval.grid_frames = 8  # the synthetic evaluators' grid (README: they are the toy world's)
        cfg.eval.grid_size = 16
        # sized by `icml attribute-motion plan` (README): one clip per Fastfood block (a 2^31 × 1 float32 input)
        # and 8 clips' exact cosines (one 5.7 GB float32 gradient each, kept in host memory)
        cfg.attr.chunk = 1
        cfg.attr.cos_subset = 8
    return cfg


def check_wan_dir(path, frames: int | None = None, size: int | None = None) -> None:
    """A local WanPipeline directory, read from headers only (JSON and safetensors headers, no torch):
    model_index.json naming a WanPipeline with transformer/ (a WanTransformer3DModel), vae/ (an AutoencoderKLWan),
    text_encoder/, tokenizer/ and scheduler/, one transformer (not Wan2.2's two experts), the weights of the three
    models present and whole, and clips on the VAE's grid. Raises ValueError (UsageError for weights) in one line
    naming the file and the fix."""
    import json
    from pathlib import Path

    root = Path(path)
    save = "save one with WanPipeline.save_pretrained or download Wan-AI/Wan2.1-T2V-1.3B-Diffusers into it"
    index = root / "model_index.json"
    if not index.is_file():
        raise ValueError(f"model '{path}' is not a WanPipeline directory: {index} is missing; {save}")

    def read(file: Path) -> dict:
        try:
            return json.loads(file.read_text())
        except OSError:
            raise ValueError(f"'{file}' is missing: the WanPipeline directory '{path}' is incomplete; {save}") from None
        except ValueError as exc:
            raise ValueError(f"'{file}' is not valid JSON ({exc}); {save}") from None

    components = read(index)
    if components.get("_class_name") != "WanPipeline":
        raise ValueError(f"'{index}' describes a {components.get('_class_name')}, not a WanPipeline: --preset paper "
                         "runs a Wan text-to-video pipeline; for a stacked-frame UNet use --preset default or smoke")
    if (components.get("transformer_2") or [None])[0] is not None or components.get("boundary_ratio") is not None:
        raise ValueError(f"'{index}' is a two-expert Wan2.2 pipeline (transformer_2, boundary_ratio): attribution "
                         "takes one transformer; use Wan2.1-T2V-1.3B or Wan2.2-TI2V-5B")
    for name, config in (("transformer", "config.json"), ("vae", "config.json"), ("text_encoder", "config.json"),
                         ("tokenizer", None), ("scheduler", "scheduler_config.json")):
        if (components.get(name) or [None])[0] is None:
            raise ValueError(f"'{index}' has no {name}: a WanPipeline needs transformer, vae, text_encoder, tokenizer "
                             f"and scheduler; {save}")
        if not (root / name).is_dir():
            raise ValueError(f"'{root / name}' is missing: the WanPipeline directory '{path}' is incomplete; {save}")
        if config is not None:
            read(root / name / config)
    for name, expected in (("transformer", "WanTransformer3DModel"), ("vae", "AutoencoderKLWan")):
        found = read(root / name / "config.json").get("_class_name")
        if found != expected:
            raise ValueError(f"'{root / name / 'config.json'}' describes a {found}, not the {expected} a WanPipeline "
                             f"drives; {save}")
    for name in ("transformer", "vae", "text_encoder"):
        checkpoints.check_weights(root / name, str(path))
    if frames is None or size is None:
        return
    vae, transformer = read(root / "vae" / "config.json"), read(root / "transformer" / "config.json")
    temporal, spatial = vae.get("scale_factor_temporal", 4), vae.get("scale_factor_spatial", 8)
    side = spatial * transformer.get("patch_size", [1, 2, 2])[1]
    if (frames - 1) % temporal:
        raise ValueError(f"clips.frames={frames} is not 1 + {temporal}k, the grid of '{root / 'vae' / 'config.json'}'; "
                         f"use --set clips.frames={1 + temporal * max(1, round((frames - 1) / temporal))}")
    if size % side:
        raise ValueError(f"clips.size={size} is not a multiple of {side} (the VAE's {spatial}× times the transformer's "
                         f"patch); use --set clips.size={side * max(1, round(size / side))}")


def validate(cfg: AttributeMotionConfig) -> None:
    """Reject values the run cannot use, in one line each."""
    from pathlib import Path

    if cfg.backend not in ("unet", "wan"):
        raise ValueError(f"backend must be unet or wan, not '{cfg.backend}'")
    if cfg.backend == "wan" and not cfg.model:
        raise ValueError("--preset paper runs Motive on a Wan2.1/2.2 text-to-video pipeline: pass --model DIR, a local "
                         "WanPipeline directory (WanPipeline.save_pretrained or a downloaded Wan2.1-T2V-1.3B-Diffusers)")
    if cfg.backend == "wan":
        check_wan_dir(cfg.model, cfg.clips.frames, cfg.clips.size)
        if spatial_factor(cfg.model) % cfg.attr.patch:
            raise ValueError(f"attr.patch={cfg.attr.patch} does not divide the Wan VAE's {spatial_factor(cfg.model)}-px "
                             f"latent cells; use --set attr.patch={spatial_factor(cfg.model)}")
        if not cfg.data:
            c = cfg.clips
            clips = c.n_pool + c.n_queries * len(c.targets) + c.n_heldout
            gib = clips * c.frames * c.size ** 2 * (3 + 2) * 4 / 2 ** 30  # float32 frames and flow, held in memory
            if gib > 32:
                raise ValueError(f"{clips} synthetic clips of {c.frames} frames at {c.size} px need {gib:.0f} GiB of "
                                 "memory; pass --data DIR with your clips (the paper's setting) or smaller "
                                 "--set clips.frames=… clips.size=…")
    for key, values, valid in (("selectors", cfg.selectors, SELECTORS), ("arms", cfg.arms, ARMS)):
        unknown = [v for v in values if v not in valid]
        if unknown:
            raise ValueError(f"unknown {key} {unknown}; valid: {', '.join(valid)}")
    from icml.data.videos import MOTIONS  # here, not at the top: data.videos needs numpy, help does not

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
    ranks = distributed.world_size()  # under torchrun each rank pretrains on an equal slice of every batch
    if cfg.backend == "unet" and not cfg.model and cfg.unet.batch_size % ranks:
        raise ValueError(f"unet.batch_size ({cfg.unet.batch_size}) does not split evenly over {ranks} torchrun ranks; "
                         f"use a multiple of {ranks}")
    for key in ("clips.n_pretrain", "clips.n_pool", "clips.n_queries", "clips.n_heldout", "unet.steps",
                "unet.batch_size", "unet.sample_steps", "attr.dim", "attr.draws", "attr.multi_draws", "attr.patch",
                "attr.chunk", "attr.cos_subset",
                "finetune.steps", "finetune.batch_size", "eval.n_videos", "eval.evaluator_clips",
                "eval.evaluator_steps", "clips.frames", "clips.size"):
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) <= 0:
            raise ValueError(f"{key} must be positive, not {getattr(getattr(cfg, section), name)}")
    if cfg.eval.grid_frames < 0 or cfg.eval.grid_size < 0 or 0 < cfg.eval.grid_frames < 2:
        raise ValueError(f"eval.grid_frames / eval.grid_size must be 0 (the clips' grid) or positive (frames ≥ 2), not "
                         f"{cfg.eval.grid_frames} / {cfg.eval.grid_size}")
    if cfg.clips.frames < 2:
        raise ValueError(f"clips.frames must be at least 2, not {cfg.clips.frames}")
    if cfg.data and not Path(cfg.data).is_dir():
        raise ValueError(f"data '{cfg.data}' is not a folder (expected clips plus captions.csv)")
    if abs(cfg.attr.t_star * 1000 - round(cfg.attr.t_star * 1000)) > 1e-9:
        raise ValueError(f"attr.t_star must be on the scheduler's table of 1000 levels (a multiple of 0.001), "
                         f"not {cfg.attr.t_star}")


def spatial_factor(model: str) -> int:
    import json
    from pathlib import Path

    return json.loads((Path(model) / "vae" / "config.json").read_text()).get("scale_factor_spatial", 8)


def check_unet_dir(path, frames: int) -> None:
    """--model of the UNet presets, read from headers only (JSON and safetensors headers, no torch): a pipeline
    directory (model_index.json naming a UNet2DModel under unet/ and a FlowMatchEulerDiscreteScheduler with shift 1
    under scheduler/, as `model.save_pipeline` writes the base) or a bare UNet2DModel.save_pretrained directory,
    3·frames channels in and out, ≥ 22 class embeddings, weights present and whole. Raises IcmlError in one line."""
    import json
    from pathlib import Path

    from icml.cli.errors import IcmlError
    from icml.data.videos import NULL_PROMPT

    root = Path(path)
    save = "re-save it with save_pretrained"

    def read(file: Path) -> dict:
        try:
            value = json.loads(file.read_text())
        except OSError:
            raise IcmlError(f"model '{path}': {file.relative_to(root)} is missing", save) from None
        except ValueError:
            raise IcmlError(f"model '{path}': {file.relative_to(root)} is not valid JSON", save) from None
        if not isinstance(value, dict):
            raise IcmlError(f"model '{path}': {file.relative_to(root)} is not a JSON object", save)
        return value

    def class_of(components: dict, name: str):
        entry = components.get(name)  # save_pretrained writes [library, class], [null, null] for an absent part
        return entry[1] if isinstance(entry, list) and len(entry) == 2 else None

    unet_dir = root
    if (root / "model_index.json").is_file():
        components = read(root / "model_index.json")
        if components.get("_class_name") == "WanPipeline":
            raise IcmlError(f"model '{path}' is a WanPipeline; this preset uses the stacked-frame UNet",
                            "run it with --preset paper")
        unet, scheduler = class_of(components, "unet"), class_of(components, "scheduler")
        if unet != "UNet2DModel" or scheduler != "FlowMatchEulerDiscreteScheduler":
            raise IcmlError(f"model '{path}' is a {components.get('_class_name')} with unet {unet} and scheduler "
                            f"{scheduler}; needs a UNet2DModel with a FlowMatchEulerDiscreteScheduler",
                            "save a velocity-trained UNet2DModel with a FlowMatchEulerDiscreteScheduler beside it")
        scheduler_file = root / "scheduler" / "scheduler_config.json"
        scheduler_config = read(scheduler_file)
        if scheduler_config.get("shift", 1.0) != 1.0 or scheduler_config.get("use_dynamic_shifting"):
            raise IcmlError(f"'{scheduler_file}' shifts the σ schedule (shift {scheduler_config.get('shift')}); "
                            "this method trains and attributes on the unshifted table", "save the scheduler with shift=1.0")
        unet_dir = root / "unet"
    elif not (root / "config.json").is_file():
        raise IcmlError(f"model '{path}' is not a pipeline or UNet2DModel directory (no model_index.json or "
                        "config.json)", "give a UNet2DModel.save_pretrained directory or its pipeline "
                        "(model_index.json, unet/, scheduler/)")
    config = read(unet_dir / "config.json")
    if config.get("_class_name") != "UNet2DModel":
        # a transformers config.json has no _class_name but a model_type: name that, it is what the user will know
        found = config.get("_class_name") or (f"a {config['model_type']} transformers model" if config.get("model_type")
                                              else "no diffusers model class")
        raise IcmlError(f"model '{path}': {(unet_dir / 'config.json').relative_to(root)} describes {found}, not a "
                        "UNet2DModel",
                        "give a UNet2DModel.save_pretrained directory or its pipeline (model_index.json, unet/, "
                        "scheduler/)")
    channels = (config.get("in_channels", 3), config.get("out_channels", 3))  # UNet2DModel's defaults
    if channels != (3 * frames, 3 * frames):
        raise IcmlError(f"model '{path}' has {channels[0]} input and {channels[1]} output channels; this run stacks "
                        f"{frames} frames (needs {3 * frames})", f"use --set clips.frames={channels[0] // 3}")
    if (config.get("num_class_embeds") or 0) < NULL_PROMPT + 1:
        raise IcmlError(f"model '{path}' has {config.get('num_class_embeds')} class embeddings; needs {NULL_PROMPT + 1}",
                        f"save a class-conditional UNet2DModel with num_class_embeds={NULL_PROMPT + 1}")
    checkpoints.check_weights(unet_dir, str(path))


def check_inputs(cfg: AttributeMotionConfig) -> None:
    """Before a run exists: --model of the UNet presets is a UNet2DModel (pipeline) directory this run can drive
    (`check_unet_dir`; the Wan directory of --preset paper is checked by `validate`), and the --data folder is
    read as the run reads it (captions.csv, every clip; video files decoded into a temporary staging folder,
    which the run then decodes again into its own)."""
    if cfg.model and cfg.backend == "unet":
        check_unet_dir(cfg.model, cfg.clips.frames)
    if cfg.data:
        import tempfile
        from pathlib import Path

        from icml.methods.attribute_motion.clips import from_folder

        with tempfile.TemporaryDirectory() as staging:
            from_folder(cfg, 0, Path(staging))
