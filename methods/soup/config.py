"""Configuration of `icml soup`: one dataclass tree, three presets.

Every field is settable with `--set key=value`; `--data DIR` sets `data`, `--model DIR` sets `model`,
and `--set shift_data=DIR` names the shifted images (the shared CLI has no --shift-data option).
`dataset` switches the clean source and its corruption suite: `digits` (digits_c + digits_lc, the
smoke/default/paper presets) or `fashion_mnist` (Fashion-MNIST-C, the `real` preset); the pipeline is the same.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from icml.cli.errors import UsageError

ALGOS = ("mae", "mocov3", "mmcr", "lejepa")
DATASETS = ("digits", "fashion_mnist")
ORDERS = ("soup_then_ft", "ft_then_soup")
GREEDY_ON = ("val_clean", "val_shift")
# each algorithm's hyperparameters, their defaults, and the short code of its ingredient name
HPARAMS = {
    "mae": {"mask": 0.75},
    "mocov3": {"tau": 0.2},
    "mmcr": {"local": 0.0},
    "lejepa": {"lambda": 0.05, "views": 2.0},
}
DEFAULT_INGREDIENTS = "mae:mask=0.5,mae:mask=0.75,mocov3:tau=0.2,mocov3:tau=1.0,mmcr,mmcr:local=1,lejepa"
FAMILIES = ("vit_mae", "vit")  # --model: the model types vit.load_stock reads (ViTMAEForPreTraining, ViTModel)
MAE_WITH_DECODER = "ViTMAEForPreTraining"  # the only architecture whose checkpoint holds the MAE decoder


@dataclass
class ViTConfig:
    """The toy stock of the spec (ignored when `model` points to a checkpoint)."""

    image_size: int = 16
    patch_size: int = 4
    hidden_size: int = 64
    layers: int = 4
    heads: int = 4
    intermediate_size: int = 256
    decoder_hidden_size: int = 32
    decoder_layers: int = 1
    decoder_heads: int = 4
    decoder_intermediate_size: int = 128


@dataclass
class StockConfig:
    steps: int = 1500  # MAE pre-training on clean train+val images
    batch_size: int = 128
    lr: float = 2e-3
    mask: float = 0.75


@dataclass
class SSLConfig:
    steps: int = 200  # per ingredient (the spec's 300, cut to the CPU budget: README)
    batch_size: int = 64  # the spec's 128, cut to the CPU budget
    lr: float = 3e-4
    weight_decay: float = 0.01
    warmup_frac: float = 0.1
    mae_augment: bool = True  # MAE ingredients see one augmented view, as released (false: raw images, the ablation)


@dataclass
class MocoConfig:
    momentum: float = 0.0  # 0: keys from the same encoder (as released); >0: an EMA key encoder
    symmetric: bool = False  # both directions, as in the original MoCo v3


@dataclass
class FTConfig:
    """LP-FT back on clean labelled train images: the shared probe h0, then full fine-tuning."""

    steps: int = 200  # the spec's 300, cut to the CPU budget (README)
    batch_size: int = 64
    lr: float = 3e-4
    weight_decay: float = 0.01
    warmup_frac: float = 0.1
    probe_lrs: list[float] = field(default_factory=lambda: [0.01, 0.03, 0.1])  # h0's lr, picked on val
    probe_steps: int = 300
    augment: bool = True  # random resized crop + rotation on every batch (false: clean images, the real preset)


@dataclass
class SupervisedConfig:
    """The Wortsman supervised soup: fine-tunes of the stock over (lr multiplier × seed)."""

    lr_multipliers: list[float] = field(default_factory=lambda: [1.0, 3.0])
    seeds: int = 2


@dataclass
class SeasonConfig:
    """Self-seasoning: label-free soup weights, softmax(β), by in-batch neighbour entropy on U."""

    epochs: int = 4
    steps_per_epoch: int = 10
    batch_size: int = 256
    top_k: int = 16
    temperature: float = 0.07
    lr: float = 0.1
    final_lr: float = 0.01


@dataclass
class GreedyConfig:
    on: str = "val_clean"  # val_clean | val_shift (corrupted val images of the seen types: knows the shift)


@dataclass
class SoupConfig:
    ingredients: str = DEFAULT_INGREDIENTS  # algo[:hp=value[;hp=value]], comma-separated
    order: str = "soup_then_ft"  # the main arm, chosen on validation data (README: validation sweep)
    heldout: list[str] = field(default_factory=lambda: ["speckle_noise", "fog", "elastic", "mosaic"])
    shift_severities: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])  # severities in U
    eval_severities: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])
    eval_test: int = 500  # test images evaluated (and corrupted into U)
    eval_val: int = 150  # val images corrupted (seen types) for val-shift scores and greedy.on=val_shift
    controls: bool = True  # soup_clean_ssl: one ingredient per algorithm cooked on clean train images
    interpolation: bool = True
    diff_init: bool = True  # with interpolation: the negative-control pair stock_ft | the same recipe from another init
    knn_k: int = 20
    knn_temperature: float = 0.07
    dataset: str = "digits"  # digits (digits_c + digits_lc) | fashion_mnist (Fashion-MNIST-C; --preset real)
    train_images: int = 0  # fashion_mnist: labelled train images, a seeded stratified subset of 55 000 (0: all)
    val_images: int = 1000  # fashion_mnist: validation images, drawn stratified from the 60 000 train images
    data: str | None = None  # digits: a class-subfolder image folder; fashion_mnist: its IDX files (None: Debian's)
    shift_data: str | None = None  # unlabelled images or <type>/<severity>/<class>/* (--set shift_data=DIR)
    model: str | None = None  # a local ViTMAE / ViT checkpoint (--model)
    vit: ViTConfig = field(default_factory=ViTConfig)
    stock: StockConfig = field(default_factory=StockConfig)
    ssl: SSLConfig = field(default_factory=SSLConfig)
    mocov3: MocoConfig = field(default_factory=MocoConfig)
    ft: FTConfig = field(default_factory=FTConfig)
    supervised: SupervisedConfig = field(default_factory=SupervisedConfig)
    season: SeasonConfig = field(default_factory=SeasonConfig)
    greedy: GreedyConfig = field(default_factory=GreedyConfig)


REAL_TRAIN_IMAGES = 5000


def preset(name: str) -> SoupConfig:
    cfg = SoupConfig()
    if name == "smoke":
        cfg.stock.steps = 150
        cfg.ingredients = "mae,mmcr"
        cfg.ssl.steps = 30
        cfg.ft.steps = 30
        cfg.ft.probe_steps = 60
        cfg.ft.probe_lrs = [0.03]
        cfg.eval_test = 100
        cfg.eval_val = 30
        cfg.controls = False
        cfg.interpolation = False  # the tests run it on their own tiny config
        cfg.eval_severities = [1, 5]
        cfg.shift_severities = [1, 5]
        cfg.supervised.lr_multipliers = [1.0]
        cfg.season.epochs = 2
        cfg.season.steps_per_epoch = 3
        cfg.season.batch_size = 128
    elif name == "real":  # Fashion-MNIST at 28 px, Fashion-MNIST-C; the default's recipe otherwise
        from icml.data.fashion_c import HELDOUT

        cfg.dataset = "fashion_mnist"
        cfg.heldout = list(HELDOUT)
        cfg.vit.image_size, cfg.vit.patch_size = 28, 7  # 16 patches + CLS: the default's 17 tokens
        cfg.train_images = REAL_TRAIN_IMAGES
        cfg.val_images = 1000
        cfg.ft.steps, cfg.ft.lr, cfg.ft.augment = 400, 2e-3, False  # NOTES: Fashion-MNIST needs more and cleaner FT
        cfg.diff_init = False  # its second MAE stock would not fit 15 min (--set diff_init=true: + ≈ 2 min)
    elif name == "paper":  # vit-mae-base at 224 px from --model; ImageNet-C / LAION-C from --shift-data
        cfg.stock.steps = 0
        cfg.ssl.steps = 10_000
        cfg.ssl.lr = 4e-5
        cfg.ft.lr = 2e-5
        cfg.ft.steps = 20_000
        cfg.ft.batch_size = 128
        cfg.vit = ViTConfig(image_size=224, patch_size=16, hidden_size=768, layers=12, heads=12,
                            intermediate_size=3072, decoder_hidden_size=512, decoder_layers=8, decoder_heads=16,
                            decoder_intermediate_size=2048)
    return cfg


@dataclass(frozen=True)
class Recipe:
    """One ingredient: an SSL algorithm and its hyperparameters."""

    algo: str
    hparams: tuple[tuple[str, float], ...]

    def hp(self, key: str) -> float:
        return dict(self.hparams)[key]

    @property
    def name(self) -> str:
        """ingredient_<algo>_<hp>: the spec's naming, e.g. mae_m75, mocov3_t0.2, mmcr_global, lejepa."""
        hp = dict(self.hparams)
        if self.algo == "mae":
            return f"mae_m{round(hp['mask'] * 100):d}"
        if self.algo == "mocov3":
            return f"mocov3_t{hp['tau']:g}"
        if self.algo == "mmcr":
            return "mmcr_local" if hp["local"] else "mmcr_global"
        extra = [] if hp["lambda"] == 0.05 else [f"l{hp['lambda']:g}"]
        extra += [] if hp["views"] == 2 else [f"v{int(hp['views'])}"]
        return "_".join(["lejepa"] + extra)


def parse_ingredients(text: str) -> list[Recipe]:
    """`mae:mask=0.5,mocov3:tau=0.2;…,mmcr:local=1,lejepa` → recipes (defaults fill the rest)."""
    recipes = []
    for item in [part.strip() for part in text.split(",") if part.strip()]:
        algo, _, settings = item.partition(":")
        if algo not in HPARAMS:
            raise ValueError(f"unknown SSL algorithm '{algo}' in ingredients; valid: {', '.join(ALGOS)}")
        hp = dict(HPARAMS[algo])
        for setting in [s for s in settings.split(";") if s]:
            key, sep, value = setting.partition("=")
            if key not in hp or not sep:
                raise ValueError(f"bad ingredient setting '{setting}' for {algo}; "
                                 f"write {algo}:KEY=VALUE with KEY in {', '.join(hp)}")
            try:
                hp[key] = float(value)
            except ValueError:
                raise ValueError(f"ingredient setting '{setting}' needs a number") from None
        recipe = Recipe(algo, tuple(sorted(hp.items())))
        if recipe in recipes:
            raise ValueError(f"ingredient '{item}' is listed twice")
        recipes.append(recipe)
    if not recipes:
        raise ValueError("ingredients is empty; list at least one, e.g. ingredients=mae,mmcr")
    return recipes


def validate(cfg: SoupConfig) -> None:
    """Reject values the run cannot use, in one line each."""
    from pathlib import Path

    recipes = parse_ingredients(cfg.ingredients)
    for recipe in recipes:
        if recipe.algo == "mae" and not 0 < recipe.hp("mask") < 1:
            raise ValueError(f"mae mask must be in (0, 1), not {recipe.hp('mask')}")
        if recipe.algo == "mocov3" and recipe.hp("tau") <= 0:
            raise ValueError(f"mocov3 tau must be positive, not {recipe.hp('tau')}")
        if recipe.algo == "lejepa" and (not 0 <= recipe.hp("lambda") <= 1 or recipe.hp("views") < 2):
            raise ValueError("lejepa needs lambda in [0, 1] and views >= 2")
    if cfg.order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, not '{cfg.order}'")
    if cfg.greedy.on not in GREEDY_ON:
        raise ValueError(f"greedy.on must be one of {', '.join(GREEDY_ON)}, not '{cfg.greedy.on}'")
    if cfg.dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {', '.join(DATASETS)}, not '{cfg.dataset}'")
    kinds = corruptions_of(cfg)
    unknown = [k for k in cfg.heldout if k not in kinds]
    if unknown and not cfg.shift_data:
        raise ValueError(f"unknown held-out corruption(s) {unknown} for dataset {cfg.dataset}; valid: "
                         f"{', '.join(kinds)}")
    for key in ("shift_severities", "eval_severities"):
        values = getattr(cfg, key)
        if not values or any(s not in (1, 2, 3, 4, 5) for s in values):
            raise ValueError(f"{key} must be a non-empty list of severities 1–5, not {values}")
    for key, value in (("stock.batch_size", cfg.stock.batch_size), ("ssl.steps", cfg.ssl.steps),
                       ("ssl.batch_size", cfg.ssl.batch_size), ("ft.batch_size", cfg.ft.batch_size),
                       ("ft.probe_steps", cfg.ft.probe_steps), ("eval_test", cfg.eval_test), ("eval_val", cfg.eval_val),
                       ("supervised.seeds", cfg.supervised.seeds), ("season.epochs", cfg.season.epochs),
                       ("season.steps_per_epoch", cfg.season.steps_per_epoch), ("knn_k", cfg.knn_k)):
        if value <= 0:
            raise ValueError(f"{key} must be positive, not {value}")
    if cfg.stock.steps < 0 or cfg.ft.steps < 0:
        raise ValueError("stock.steps and ft.steps must be >= 0")
    if not cfg.ft.probe_lrs or any(lr <= 0 for lr in cfg.ft.probe_lrs):
        raise ValueError("ft.probe_lrs must be a non-empty list of positive numbers")
    if not cfg.supervised.lr_multipliers or any(m <= 0 for m in cfg.supervised.lr_multipliers):
        raise ValueError("supervised.lr_multipliers must be a non-empty list of positive numbers")
    if not 0 <= cfg.mocov3.momentum < 1:
        raise ValueError(f"mocov3.momentum must be in [0, 1), not {cfg.mocov3.momentum}")
    if cfg.vit.hidden_size % cfg.vit.heads or cfg.vit.image_size % cfg.vit.patch_size:
        raise ValueError("vit.hidden_size must divide by vit.heads and vit.image_size by vit.patch_size")
    if cfg.train_images < 0 or cfg.val_images <= 0:
        raise ValueError("train_images must be >= 0 (0: all) and val_images positive")
    if cfg.dataset == "digits" and cfg.data and not Path(cfg.data).is_dir():  # fashion_mnist: check_inputs
        raise ValueError(f"data '{cfg.data}' is not a directory (expected <class>/<image> subfolders)")
    if cfg.shift_data and not Path(cfg.shift_data).is_dir():
        raise ValueError(f"shift_data '{cfg.shift_data}' is not a directory (expected images or "
                         "<type>/<severity>/<class>/<image>)")
    if cfg.model:
        read_model_config(cfg.model)
    elif cfg.stock.steps == 0:  # the paper preset: θ₀ must be a real pre-trained MAE, not a random init
        raise UsageError("stock.steps is 0 (the paper preset) and no --model is given, so every ingredient "
                         "would be cooked from a randomly initialised ViT",
                         "pass --model DIR, a local ViTMAE checkpoint such as vit-mae-base saved with "
                         "save_pretrained (or set stock.steps > 0 to MAE-pretrain the toy stock)")


def read_model_config(model: str) -> dict:
    """The config.json of a --model directory, or a one-line error naming the file and the fix."""
    import json
    from pathlib import Path

    path = Path(model) / "config.json"
    if not path.is_file():
        raise UsageError(f"model '{model}' is not a checkpoint directory (no config.json)",
                         "pass a directory saved with save_pretrained")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})",
                         "restore the file or re-save the model with save_pretrained") from None
    except (UnicodeDecodeError, OSError) as exc:
        raise UsageError(f"{path} cannot be read ({exc})",
                         "restore the file or re-save the model with save_pretrained") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise UsageError(f"{path} is not a transformers model config (no model_type)",
                         "pass a ViTMAE or ViT directory saved with save_pretrained")
    return config


def check_model(cfg: SoupConfig) -> None:
    """--model is a stock vit.load_stock reads (ViTMAE or plain ViT), its weights present and whole, with an
    MAE decoder if mae ingredients are asked for. Headers only (json, the safetensors header)."""
    from icml.cli import checkpoints

    ckpt = checkpoints.check(cfg.model, FAMILIES, "soup", tokenizer=False)
    architectures = read_model_config(cfg.model).get("architectures") or []
    # a ViTMAEModel (encoder only) loads as ViTMAEForPreTraining with a randomly drawn decoder, so only a
    # ViTMAEForPreTraining checkpoint (or one that does not say) can cook mae ingredients
    has_decoder = ckpt.model_type == "vit_mae" and (not architectures or MAE_WITH_DECODER in architectures)
    if not has_decoder and any(recipe.algo == "mae" for recipe in parse_ingredients(cfg.ingredients)):
        what = "a plain ViT" if ckpt.model_type == "vit" else f"a {architectures[0]} (the encoder alone)"
        others = ",".join(a for a in ALGOS if a != "mae")
        raise UsageError(f"model '{cfg.model}' is {what} with no MAE decoder, so mae ingredients cannot be cooked",
                         f"drop mae from ingredients (--set ingredients={others}) or pass a "
                         f"{MAE_WITH_DECODER} checkpoint such as vit-mae-base")


def corruptions_of(cfg: SoupConfig) -> tuple[str, ...]:
    """The corruption types of the dataset's suite (a --set shift_data folder brings its own)."""
    if cfg.dataset == "fashion_mnist":
        from icml.data.fashion_c import FASHION_C

        return FASHION_C
    from icml.data.images import CORRUPTIONS

    return CORRUPTIONS


def channels_of(cfg: SoupConfig) -> int:
    """Channels of the toy stock's input: RGB for a user image folder, else grey (digits, Fashion-MNIST)."""
    return 3 if cfg.data and cfg.dataset == "digits" else 1


def check_inputs(cfg: SoupConfig) -> None:
    """Before a run exists: --model's headers (check_model), and the --data folder's layout and one image
    per class, read as the run reads them (fashion_mnist: every IDX header, size and label, not the images)."""
    if cfg.model:
        check_model(cfg)
    if cfg.dataset == "fashion_mnist":
        from icml.data.idx import ImageDataError, check_fashion_mnist

        try:
            check_fashion_mnist(cfg.data)
        except ImageDataError as exc:
            raise ValueError(str(exc)) from None
    elif cfg.data:
        from icml.data.images import ImageDataError, check_image_folder

        try:
            check_image_folder(cfg.data)
        except ImageDataError as exc:
            raise ValueError(str(exc)) from None
