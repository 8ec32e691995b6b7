"""Configuration of `icml explain-vit`: nested dataclasses with the spec's defaults, three presets and a
one-line validator. No torch here: help and listing import this module.

`--model DIR` sets `model` (a local ViTForImageClassification checkpoint, loaded with from_pretrained;
`check_model` reads its headers before a run exists); `--data DIR` sets `data` (a folder of images,
optional `<stem>_mask.png` masks and a `labels.csv`; with `data_cfg.dataset=fashion_mnist`, the `real` preset's,
a folder of Fashion-MNIST's IDX files, checked by `data/idx.py` before a run exists).
"""
from __future__ import annotations

from dataclasses import dataclass, field

LADDER = ["input_x_grad", "weff", "weff_eq", "weff_eq_lp", "dave_nopost", "dave"]
BASELINES = ["saliency", "integrated_gradients", "smoothgrad", "attn_rollout", "gae", "gradcam", "random"]
ARMS = LADDER + BASELINES
MONTAGE_MODES = ("interpolate", "downscale")
DATASETS = ("synthetic", "fashion_mnist")  # data_cfg.dataset
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist (make install), data/idx.py
FILLS = ("blur", "constant")
PATCH_INITS = ("trunc_normal", "conv_default")
# The model types `model.load` reads, as ViTForImageClassification. DeiT in ViT format (facebook/deit-*-patch16-224,
# no distillation token) is model_type vit; model_type deit (DeiTForImageClassification[WithTeacher]) keeps its
# weights under deit.* and has a distillation token, so ViTForImageClassification would load none of them (random).
FAMILIES = ("vit",)
CLASSIFIER = "ViTForImageClassification"
PROCESSOR_FILE = "preprocessor_config.json"  # optional: without it the loader uses ViTImageProcessor's 0.5 / 0.5


@dataclass
class DataConfig:
    n_train: int = 6000
    n_val: int = 600
    n_test: int = 600
    n_montages: int = 32  # spec 200: at 64×64 px every arm costs ~2 s per target on 2 cores (README)
    n_val_montages: int = 12  # validation montages for the α_max sweep (GridPG), never test
    image_size: int = 32
    montage_mode: str = "interpolate"  # interpolate: 64×64 grid, interpolate_pos_encoding; downscale: 16-px cells
    # synthetic: the six shapes (or, with --data DIR and --model, a user image folder); fashion_mnist: Fashion-MNIST
    # from `data` (the real preset: Debian's folder), grey replicated to RGB; test = the first n_test t10k images,
    # montage cells the other t10k images, validation (α_max) a stratified n_val of train; object mask = pixel > this
    dataset: str = "synthetic"  # synthetic | fashion_mnist (the real preset: Fashion-MNIST from `data`)
    foreground: float = 0.05  # fashion_mnist: object mask = pixel > this (the silhouette; no annotated masks)


@dataclass
class TrainConfig:
    epochs: int = 8
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.05
    warmup_steps: int = 20
    # issue 24: the spec's recipe is grad_clip=0 (no clipping) and patch_init=trunc_normal (transformers' init);
    # grad_clip > 0 clips the global gradient norm; conv_default re-initialises the patch-embedding conv as
    # PyTorch's Conv2d does (timm's ViT leaves it so)
    grad_clip: float = 0.0
    patch_init: str = "trunc_normal"
    # zoom-out augmentation (real preset): probability per image of shrinking it by U(zoom_min_scale, 1) onto black
    # at a random position, so that the cells of a downscaled montage are objects the model knows (issue 44)
    zoom_out: float = 0.0  # probability per training image of a zoom-out onto black (0: none)
    zoom_min_scale: float = 0.5  # smallest zoom-out scale


@dataclass
class ViTSize:
    patch_size: int = 4
    hidden_size: int = 96
    layers: int = 4
    heads: int = 4
    intermediate_size: int = 384


@dataclass
class DaveConfig:
    n_samples: int = 50  # N: warps × noise levels per map
    alpha_max: float | None = None  # none: chosen on validation from alpha_grid (the toy model)
    alpha_grid: list[float] = field(default_factory=lambda: [0.1, 0.3, 0.5])
    flip_p: float = 0.5
    rotate_deg: float = 20.0
    translate: float = 0.1  # share of the side
    scale_min: float = 0.9
    scale_max: float = 1.1
    mad_k: float = 2.5
    gauss_kernel: int = 11  # at 224 px; scaled by H/224
    gauss_sigma: float = 7.0
    bilateral_kernel: int = 5
    bilateral_sigma_space: float = 0.5
    bilateral_sigma_range: float = 0.05
    chunk: int = 32  # rows (image × sample) per forward/backward batch at 32×32 px; fewer for larger inputs


@dataclass
class EvalConfig:
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    n_test_images: int = 300
    deletion_images: int = 48  # images with deletion/insertion curves (64 forwards per curve and arm)
    deletion_steps: int = 64
    deletion_max_frac: float = 0.9
    fills: list[str] = field(default_factory=lambda: ["blur"])  # blur | constant (0 = the processor's grey)
    blur_kernel: int = 31  # deletion fill at 224 px; scaled by H/224
    blur_sigma: float = 7.0
    stability_images: int = 32
    stability_noise_sd: float = 0.05  # in [0, 1] pixel units
    shifts: list[int] = field(default_factory=lambda: [1, 2, 3])
    min_confidence: float = 0.9
    require_correct: bool = True  # explain correct predictions only (the official benchmark's filter)
    ig_steps: int = 32
    smoothgrad_n: int = 50
    smoothgrad_sigma: float = 0.15  # × (max − min) of the input
    gallery: int = 4  # images and montages shown per arm in the report


@dataclass
class ExplainVitConfig:
    model: str = ""  # "": train the toy ViT; else a local HF ViTForImageClassification directory
    data: str = "synthetic"  # synthetic | a folder of images (+ _mask.png, labels.csv)
    vit: ViTSize = field(default_factory=ViTSize)
    data_cfg: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dave: DaveConfig = field(default_factory=DaveConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def preset(name: str) -> ExplainVitConfig:
    """The dataclass defaults are the spec's recipe; smoke and default train the toy ViT with the issue-24 recipe."""
    cfg = ExplainVitConfig()
    if name in ("smoke", "default", "real"):
        # issue 24: under the spec's recipe (8 epochs, no clipping, transformers' patch init) the toy ViT sits on the
        # ln 6 loss plateau for 3 to all 8 epochs depending on the seed and ends with no test image correct and
        # ≥ 0.9 confident; clipping + PyTorch's conv init leave it at epoch 3 on every seed measured, and 12 epochs
        # (≈ 4.5 min of one core) give confident images (README). --set train.epochs=8 --set train.grad_clip=0
        # --set train.patch_init=trunc_normal is the spec's recipe.
        cfg.train.epochs = 12
        cfg.train.grad_clip = 1.0
        cfg.train.patch_init = "conv_default"
    if name == "smoke":
        cfg.data_cfg.n_train, cfg.data_cfg.n_val, cfg.data_cfg.n_test = 1000, 100, 100
        cfg.data_cfg.n_montages, cfg.data_cfg.n_val_montages = 4, 2  # 16 and 4 were 39 of its 149 s (64 px)
        cfg.train.epochs = 1
        cfg.dave.n_samples = 8
        cfg.dave.alpha_grid = [0.1, 0.3]
        cfg.eval.arms = ["dave", "input_x_grad", "weff"]
        cfg.eval.n_test_images = 32
        cfg.eval.deletion_images = 8
        cfg.eval.deletion_steps = 16
        cfg.eval.stability_images = 4
        cfg.eval.shifts = [1, 2]
        cfg.train.batch_size = 32  # 32 steps instead of 8: the one epoch learns something
        cfg.eval.min_confidence = 0.0  # a 1-epoch model is neither confident nor often right: smoke checks plumbing
        cfg.eval.require_correct = False
    elif name == "real":
        real(cfg)
    elif name == "paper":  # ViT-B/16 or DeiT-B in transformers format from --model, ImageNet-val folder via --data
        cfg.data_cfg.image_size = 224
        cfg.vit = ViTSize(patch_size=16, hidden_size=768, layers=12, heads=12, intermediate_size=3072)
        cfg.dave.alpha_max = 0.3  # ViT-B; DeiT-B 0.7 (set dave.alpha_max per model)
        cfg.data_cfg.n_montages, cfg.data_cfg.n_val_montages = 200, 24
        cfg.eval.n_test_images = 2000
        cfg.eval.deletion_images = 2000
        cfg.eval.stability_images = 500
        cfg.data_cfg.montage_mode = "downscale"  # 224-px grids of four 112-px cells, as ViT GridPG benchmarks do
    return cfg


def real(cfg: ExplainVitConfig) -> None:
    """Fashion-MNIST (issue 44): a toy ViT that is confident on most test images, so montages of four distinct
    confident classes exist and grid_pg / class_sensitivity are measured; the default's eval otherwise."""
    cfg.data, cfg.data_cfg.dataset, cfg.data_cfg.image_size = FASHION_MNIST_DIR, "fashion_mnist", 28
    cfg.data_cfg.n_train, cfg.data_cfg.n_val, cfg.data_cfg.n_test = 55_000, 5000, 5000
    # measured (NOTES, 7 Dec): 10 epochs of 215 steps give 0.884 test accuracy, 70 % of t10k ≥ 0.9 confident and
    # right, in ≈ 7.7 min of one quiet core; 6 epochs at batch 128, lr 1e-3 gave 0.873
    cfg.vit = ViTSize(patch_size=7, hidden_size=96, layers=4, heads=4, intermediate_size=192)
    cfg.train.epochs, cfg.train.batch_size, cfg.train.lr, cfg.train.warmup_steps = 10, 256, 2e-3, 100


def validate(cfg: ExplainVitConfig) -> None:
    from pathlib import Path

    unknown = [a for a in cfg.eval.arms if a not in ARMS]
    if unknown or not cfg.eval.arms:
        raise ValueError(f"unknown or no arm(s) {unknown}; valid: {', '.join(ARMS)}")
    if cfg.model and not (Path(cfg.model) / "config.json").is_file():
        raise ValueError(f"model '{cfg.model}' is not a transformers checkpoint directory (no config.json); "
                         "pass a ViTForImageClassification folder saved with save_pretrained")
    if cfg.data_cfg.dataset not in DATASETS:
        raise ValueError(f"data_cfg.dataset must be one of {', '.join(DATASETS)}, not '{cfg.data_cfg.dataset}'")
    fashion = cfg.data_cfg.dataset == "fashion_mnist"
    if fashion and cfg.model:
        raise ValueError("data_cfg.dataset=fashion_mnist trains the toy ViT on Fashion-MNIST; drop --model "
                         "(or explain your own model on a folder of images with the default preset)")
    if fashion and cfg.data_cfg.image_size != 28:
        raise ValueError(f"Fashion-MNIST images are 28 px: data_cfg.image_size must be 28, not {cfg.data_cfg.image_size}")
    if fashion and not 0 <= cfg.data_cfg.foreground < 1:
        raise ValueError(f"data_cfg.foreground must be in [0, 1), not {cfg.data_cfg.foreground}")
    if fashion and (cfg.data_cfg.n_val > 30_000 or cfg.data_cfg.n_train > 60_000 - cfg.data_cfg.n_val
                    or cfg.data_cfg.n_test >= 10_000):
        raise ValueError(f"Fashion-MNIST has 60,000 train and 10,000 test images: need n_val <= 30000, n_train <= "
                         f"60000 - n_val and n_test < 10000 (the rest of t10k are montage cells), not "
                         f"{cfg.data_cfg.n_train}, {cfg.data_cfg.n_val}, {cfg.data_cfg.n_test}")
    if not fashion and cfg.data != "synthetic" and not Path(cfg.data).is_dir():
        raise ValueError(f"data '{cfg.data}' is not a folder; use data=synthetic or a folder of images")
    if not fashion and cfg.data != "synthetic" and not cfg.model:
        raise ValueError("a user image folder needs a model trained on its classes; pass --model DIR as well")
    if not fashion and cfg.data != "synthetic" and cfg.dave.alpha_max is None:
        raise ValueError("a user image folder has no validation split to choose α_max on; set dave.alpha_max "
                         "(ViT-S 0.1, ViT-B 0.3, DeiT-S 0.5, DeiT-B 0.7, DeiT-III-S 0.5, DeiT-III-B 0.9)")
    if cfg.data_cfg.montage_mode not in MONTAGE_MODES:
        raise ValueError(f"data_cfg.montage_mode must be one of {', '.join(MONTAGE_MODES)}, "
                         f"not '{cfg.data_cfg.montage_mode}'")
    if not cfg.model and cfg.data_cfg.image_size % cfg.vit.patch_size:
        raise ValueError(f"data_cfg.image_size ({cfg.data_cfg.image_size}) must be a multiple of vit.patch_size "
                         f"({cfg.vit.patch_size})")
    if not cfg.model and not fashion and cfg.data_cfg.image_size < 24:
        raise ValueError(f"data_cfg.image_size must be >= 24 to hold an 8-14 px object, not {cfg.data_cfg.image_size}")
    if cfg.vit.hidden_size % cfg.vit.heads:
        raise ValueError(f"vit.hidden_size ({cfg.vit.hidden_size}) must be divisible by vit.heads ({cfg.vit.heads})")
    positive = {"data_cfg.n_train": cfg.data_cfg.n_train, "data_cfg.n_val": cfg.data_cfg.n_val,
                "data_cfg.n_test": cfg.data_cfg.n_test, "data_cfg.n_montages": cfg.data_cfg.n_montages,
                "data_cfg.n_val_montages": cfg.data_cfg.n_val_montages, "train.epochs": cfg.train.epochs,
                "train.batch_size": cfg.train.batch_size, "dave.n_samples": cfg.dave.n_samples,
                "dave.chunk": cfg.dave.chunk, "eval.n_test_images": cfg.eval.n_test_images,
                "eval.deletion_steps": cfg.eval.deletion_steps, "eval.ig_steps": cfg.eval.ig_steps,
                "eval.smoothgrad_n": cfg.eval.smoothgrad_n, "vit.layers": cfg.vit.layers, "vit.heads": cfg.vit.heads,
                "vit.patch_size": cfg.vit.patch_size}
    for key, value in positive.items():
        if value < 1:
            raise ValueError(f"{key} must be positive, not {value}")
    for key in ("deletion_images", "stability_images", "gallery"):
        if getattr(cfg.eval, key) < 0:
            raise ValueError(f"eval.{key} must be >= 0, not {getattr(cfg.eval, key)}")
    if cfg.dave.n_samples < 2 and cfg.dave.alpha_max is None:
        raise ValueError("dave.n_samples must be >= 2 for the noise schedule")
    alphas = cfg.dave.alpha_grid + ([cfg.dave.alpha_max] if cfg.dave.alpha_max is not None else [])
    if not cfg.dave.alpha_grid or any(not 0 <= a < 1 for a in alphas):
        raise ValueError(f"noise levels α must lie in [0, 1), got alpha_grid={cfg.dave.alpha_grid}, "
                         f"alpha_max={cfg.dave.alpha_max}")
    if not 0 <= cfg.dave.flip_p <= 1:
        raise ValueError(f"dave.flip_p must be in [0, 1], not {cfg.dave.flip_p}")
    if not 0 < cfg.dave.scale_min <= cfg.dave.scale_max:
        raise ValueError(f"need 0 < dave.scale_min <= dave.scale_max, not {cfg.dave.scale_min}, {cfg.dave.scale_max}")
    if cfg.dave.translate < 0 or cfg.dave.translate >= 0.5 or cfg.dave.rotate_deg < 0:
        raise ValueError("dave.translate must be in [0, 0.5) and dave.rotate_deg >= 0")
    if cfg.dave.mad_k <= 0:
        raise ValueError(f"dave.mad_k must be positive, not {cfg.dave.mad_k}")
    if not cfg.eval.fills or any(f not in FILLS for f in cfg.eval.fills):
        raise ValueError(f"eval.fills must be a non-empty list of {', '.join(FILLS)}, not {cfg.eval.fills}")
    if not 0 < cfg.eval.deletion_max_frac <= 1:
        raise ValueError(f"eval.deletion_max_frac must be in (0, 1], not {cfg.eval.deletion_max_frac}")
    if not 0 <= cfg.eval.min_confidence < 1:
        raise ValueError(f"eval.min_confidence must be in [0, 1), not {cfg.eval.min_confidence}")
    if any(s < 1 for s in cfg.eval.shifts) or not cfg.eval.shifts:
        raise ValueError(f"eval.shifts must be positive pixel shifts, not {cfg.eval.shifts}")
    if cfg.train.lr <= 0 or cfg.train.weight_decay < 0:
        raise ValueError("train.lr must be positive and train.weight_decay >= 0")
    if not cfg.train.grad_clip >= 0:  # also rejects NaN
        raise ValueError(f"train.grad_clip must be >= 0 (0: no clipping), not {cfg.train.grad_clip}")
    if cfg.train.warmup_steps < 0:
        raise ValueError(f"train.warmup_steps must be >= 0, not {cfg.train.warmup_steps}")
    if not 0 <= cfg.train.zoom_out <= 1 or not 0 < cfg.train.zoom_min_scale <= 1:
        raise ValueError(f"train.zoom_out must be in [0, 1] and train.zoom_min_scale in (0, 1], not "
                         f"{cfg.train.zoom_out}, {cfg.train.zoom_min_scale}")
    if cfg.train.patch_init not in PATCH_INITS:
        raise ValueError(f"train.patch_init must be one of {', '.join(PATCH_INITS)}, not '{cfg.train.patch_init}'")


def check_model(given: str, option: str = "--model") -> None:
    """`given` is a ViT classifier `model.load` reads faithfully: config.json of model_type vit naming a
    ViTForImageClassification, RGB input, weights present and whole, and a readable preprocessor_config.json
    if there is one. Headers only (json, the safetensors header): no weight is loaded."""
    import json

    from icml.cli import checkpoints
    from icml.cli.errors import UsageError

    ckpt = checkpoints.resolve(given, option)
    if ckpt.model_type == "deit":
        raise UsageError(f"{option} '{given}' is a DeiT checkpoint in DeiT format (model_type deit, distillation "
                         "token), which explain-vit's ViTForImageClassification cannot load",
                         "give a DeiT in ViT format (model_type vit, e.g. facebook/deit-base-patch16-224) "
                         "or another ViT classifier")
    if ckpt.model_type not in FAMILIES:
        raise UsageError(f"{option} '{given}' is a {ckpt.model_type} checkpoint; explain-vit supports "
                         f"{', '.join(FAMILIES)} (ViT, and DeiT in ViT format)",
                         f"give a {CLASSIFIER} directory saved with save_pretrained")
    config = json.loads((ckpt.directory / "config.json").read_text(encoding="utf-8"))  # resolve parsed it
    architectures = config.get("architectures") or []
    if architectures and CLASSIFIER not in architectures:
        # a ViTModel / ViTForMaskedImageModeling has no classifier: from_pretrained would draw a random head
        raise UsageError(f"{option} '{given}' is a {architectures[0]}, which has no image-classification head "
                         "(explain-vit explains a classifier's logits)",
                         f"give a {CLASSIFIER} checkpoint (fine-tune a head on the backbone first)")
    if config.get("num_channels", 3) != 3:
        raise UsageError(f"{option} '{given}' takes {config['num_channels']}-channel images; explain-vit feeds RGB",
                         "give a 3-channel ViT classifier")
    processor = ckpt.directory / PROCESSOR_FILE
    if processor.is_file():
        try:
            settings = json.loads(processor.read_text(encoding="utf-8"))
            stats = [settings.get(key, [0.5] * 3) for key in ("image_mean", "image_std")]
            usable = all(len(v) == 3 and all(isinstance(x, (int, float)) for x in v) for v in stats)
            usable = usable and all(x > 0 for x in stats[1])
        except (ValueError, UnicodeDecodeError, AttributeError, TypeError):
            usable = False
        if not usable:
            raise UsageError(f"{option} '{given}': {PROCESSOR_FILE} is not JSON with 3 image_mean and 3 "
                             "positive image_std values",
                             f"save the image processor again (processor.save_pretrained(dir)), or delete "
                             f"{PROCESSOR_FILE} to use ViT's mean = std = 0.5")


def check_inputs(cfg: ExplainVitConfig) -> None:
    """Before a run exists: --model is a checkpoint explain-vit can load (the toy model needs no check), and
    Fashion-MNIST's four IDX files are whole (headers, sizes, labels; data/idx.py's one-line errors)."""
    if cfg.model:
        check_model(cfg.model)
    if cfg.data_cfg.dataset == "fashion_mnist":
        from icml.data.idx import check_fashion_mnist

        check_fashion_mnist(None if cfg.data == FASHION_MNIST_DIR else cfg.data)  # None: the install hint
