"""Configuration of `icml gradient-route` (GRAM): nested dataclasses, three presets, a validator.

`--data DIR` sets `data` (one subfolder per domain: `core`, the auxiliary domains, optional
`unlabelled`); `data=synthetic` (the default) is the seeded topic-story corpus. `--model DIR` sets
`model` (a GPT-2 checkpoint whose MLPs become the core); its own tokenizer then tokenises the data
unless `tokenizer=` names another.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MAIN = ["baseline", "gram", "filter", "maxent"]
ABLATIONS = ["gram_pcr0", "gram_pas0", "gram_uniform_accum", "gram_single_optimizer", "gram_partial",
             "filter_partial"]
OPTIONAL = ["ft_lora"]  # core-only base + one LoRA per domain (the spec's optional baseline)
VARIANTS = MAIN + OPTIONAL + ABLATIONS
ROUTINGS = ("stratified", "bernoulli")
AUX_TOPICS = ["a0", "a1", "a2", "a3"]
CORE_TOPICS = [f"t{i}" for i in range(8)]
# config.json model_types --model takes: model.py puts RoutedMLPs in place of the GPT2MLPs (Conv1D c_fc/c_proj)
# of a GPT2LMHeadModel; other families' blocks have other MLPs, so they are refused, not half-converted
SUPPORTED_FAMILIES = ("gpt2",)


@dataclass
class GPTConfig:
    n_embd: int = 128
    n_layer: int = 4
    n_head: int = 4
    context: int = 128


@dataclass
class CRConfig:
    eval_every: int = 50  # baseline validation every this many steps (the curve the power law is fit to)


@dataclass
class ElicitConfig:
    rounds: int = 20  # full-batch fine-tuning steps on the attack windows (paper: ≤ 200)
    patience: int = 10  # stop after this many rounds without a new minimum
    lr_divisor: float = 4.0  # attack lr = peak lr / this (the spec's)
    # further attacks at peak lr / each; the attacker keeps the minimum over every lr and round. lr/4's
    # first Adam step moves every parameter by ≈ lr (sign-like), which at 8 windows mostly perturbs (README)
    extra_lr_divisors: list[float] = field(default_factory=lambda: [64.0])
    attack_windows: int = 8  # the attacker's fixed forget sample (paper: 512 sequences)
    chunk: int = 64  # attack windows per forward and backward: a round is still one full-batch step (README)
    variants: list[str] = field(default_factory=lambda: [v for v in VARIANTS if v != "baseline"])  # attacked


@dataclass
class MaxEntConfig:
    steps: int = 100
    lr: float = 1e-3
    # weight of the retain cross-entropy (`maxent.lambda`); several values = a sweep: one MaxEnt per λ,
    # the one closest to the profile's filtered model on held-apart windows is kept (README, "λ sweep")
    lambda_: float | list[float] = 15.0
    batch: int = 16  # forget windows per step (and as many retain windows, 3:1 core:aux)


@dataclass
class TitrationConfig:
    module: str = "a0"
    weights: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])


@dataclass
class GradientRouteConfig:
    data: str = "synthetic"  # synthetic | a folder with one subfolder per domain
    tokenizer: str | None = None  # a local tokenizer dir (default: --model's own; without --model, characters)
    model: str | None = None  # a GPT-2 checkpoint dir (save_pretrained, with its tokenizer): its MLPs become the core
    variants: list[str] = field(default_factory=lambda: MAIN + OPTIONAL)  # + ABLATIONS: a second run (README)
    profiles: list[str] = field(default_factory=lambda: ["core", "core+a0", "core+a1"])  # or `all`: every subset
    seeds: int = 1  # models per variant at seeds seed, seed+1, …; the report gives 90% t-intervals over them
    gpt: GPTConfig = field(default_factory=GPTConfig)
    d_dense: int = 512  # MLP width of baseline and filtered models
    d_core: int = 448
    d_aux: int = 64
    # optimisation (the baseline's; GRAM and filters use the same schedule over their own steps)
    steps: int = 800  # 400 (the spec's first default) leaves the topics' facts unlearned: README, calibration
    batch: int = 16  # sequences per optimizer step
    accum: int = 4  # micro-batches per step; routing masks are per micro-batch
    lr: float = 3e-3
    wsd: list[float] = field(default_factory=lambda: [0.1, 0.8, 0.1])  # warmup / stable / decay fractions
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.1
    clip: float = 1.0
    # routing
    p_as: float = 0.3  # aux batch also updates the core
    p_cr: float = 0.5  # core batch also runs and updates one aux module
    p_af: float = 1.0  # oversampling of aux data (p_as is divided by it)
    routing: str = "stratified"  # stratified: exact counts round(p·n), shuffled | bernoulli
    label_frac: float = 0.5  # labelled share of aux data in gram_partial / filter_partial
    compute_match: bool = True
    lora_rank: int | None = None  # ft_lora: None = one aux module's parameter count (rank 13 at the default)
    # data
    core_share: float = 0.8
    val_windows: int = 32  # validation windows per dataset (core: spread over its topics)
    cr: CRConfig = field(default_factory=CRConfig)
    elicit: ElicitConfig = field(default_factory=ElicitConfig)
    maxent: MaxEntConfig = field(default_factory=MaxEntConfig)
    titration: TitrationConfig = field(default_factory=TitrationConfig)
    workers: int = 2  # independent trainings / attacks in parallel, one single-threaded process each


def preset(name: str) -> GradientRouteConfig:
    cfg = GradientRouteConfig()
    if name == "smoke":
        cfg.profiles = ["core"]
        cfg.gpt = GPTConfig(n_embd=64, n_layer=2, n_head=2, context=64)
        cfg.d_dense, cfg.d_core, cfg.d_aux = 256, 224, 32
        cfg.steps, cfg.batch, cfg.accum = 30, 8, 2
        cfg.cr.eval_every = 5
        cfg.val_windows = 8
        cfg.maxent.steps, cfg.maxent.batch = 10, 8
        cfg.elicit.rounds = 3
        cfg.titration.weights = [0.0, 0.5, 1.0]
        cfg.workers = 1
    elif name == "paper":  # Stories: 26M, 8 layers, vocab 4096 via tokenizer=…, context 256, 3 seeds
        cfg.gpt = GPTConfig(n_embd=512, n_layer=8, n_head=8, context=256)
        cfg.d_dense, cfg.d_core, cfg.d_aux = 2048, 1856, 192
        cfg.batch, cfg.accum, cfg.lr = 128, 1, 5e-3
        cfg.steps = 20000
        cfg.cr.eval_every = 500
        cfg.seeds = 3
        cfg.profiles = ["all"]
        cfg.variants = list(VARIANTS)
        cfg.val_windows = 512
        cfg.maxent.steps = 2000
        cfg.elicit = ElicitConfig(rounds=200, patience=10, attack_windows=512)  # 8 chunks of 64 (`plan`)
        cfg.workers = 1
    return cfg


def maxent_lambdas(cfg: GradientRouteConfig) -> list[float]:
    """MaxEnt's λ grid (one value: no sweep)."""
    value = cfg.maxent.lambda_
    return list(dict.fromkeys(value)) if isinstance(value, list) else [value]


def validate(cfg: GradientRouteConfig) -> None:
    from pathlib import Path

    unknown = [v for v in cfg.variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; valid: {', '.join(VARIANTS)}")
    unknown = [v for v in cfg.elicit.variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown elicit.variants {unknown}; valid: {', '.join(VARIANTS)}")
    if "baseline" not in cfg.variants:
        raise ValueError("variants must include baseline: it is the compute-ratio reference (and maxent's start)")
    if cfg.data != "synthetic":
        path = Path(cfg.data)
        if not path.is_dir():
            raise ValueError(f"data '{cfg.data}' is not a folder (use data=synthetic or a folder of domain subfolders)")
        if not (path / "core").is_dir():
            raise ValueError(f"data '{cfg.data}' has no 'core' subfolder (one subfolder per domain, core = D1)")
    if cfg.tokenizer is not None and not Path(cfg.tokenizer).is_dir():  # --model: check_inputs, from its headers
        raise ValueError(f"tokenizer '{cfg.tokenizer}' is not a local tokenizer directory")
    if cfg.routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, not '{cfg.routing}'")
    for key in ("p_as", "p_cr", "label_frac", "core_share"):
        if not 0 <= getattr(cfg, key) <= 1:
            raise ValueError(f"{key} must be in [0, 1], not {getattr(cfg, key)}")
    if cfg.p_af < 1:
        raise ValueError(f"p_af oversamples aux data: it must be >= 1, not {cfg.p_af}")
    for key, value in (("steps", cfg.steps), ("batch", cfg.batch), ("accum", cfg.accum), ("seeds", cfg.seeds),
                       ("d_dense", cfg.d_dense), ("d_core", cfg.d_core), ("d_aux", cfg.d_aux),
                       ("val_windows", cfg.val_windows), ("workers", cfg.workers),
                       ("gpt.n_embd", cfg.gpt.n_embd), ("gpt.n_layer", cfg.gpt.n_layer),
                       ("gpt.n_head", cfg.gpt.n_head), ("gpt.context", cfg.gpt.context),
                       ("cr.eval_every", cfg.cr.eval_every), ("elicit.rounds", cfg.elicit.rounds),
                       ("elicit.patience", cfg.elicit.patience), ("elicit.attack_windows", cfg.elicit.attack_windows), ("elicit.chunk", cfg.elicit.chunk),
                       ("maxent.steps", cfg.maxent.steps), ("maxent.batch", cfg.maxent.batch)):
        if value < 1:
            raise ValueError(f"{key} must be positive, not {value}")
    if cfg.lora_rank is not None and cfg.lora_rank < 1:
        raise ValueError(f"lora_rank must be positive (or none: one aux module's parameter count), not {cfg.lora_rank}")
    if cfg.batch % cfg.accum:
        raise ValueError(f"batch ({cfg.batch}) must be a multiple of accum ({cfg.accum}): equal micro-batches")
    if cfg.gpt.n_embd % cfg.gpt.n_head:
        raise ValueError(f"gpt.n_embd ({cfg.gpt.n_embd}) must be a multiple of gpt.n_head ({cfg.gpt.n_head})")
    if len(cfg.wsd) != 3 or any(f < 0 for f in cfg.wsd) or abs(sum(cfg.wsd) - 1) > 1e-6:
        raise ValueError(f"wsd must be three fractions (warmup, stable, decay) summing to 1, not {cfg.wsd}")
    if cfg.steps < 2 * cfg.cr.eval_every:
        raise ValueError(f"steps ({cfg.steps}) must give at least 2 baseline evaluations "
                         f"(cr.eval_every={cfg.cr.eval_every}) for the power-law fit")
    if cfg.lr <= 0 or cfg.maxent.lr <= 0 or cfg.clip <= 0 or min([cfg.elicit.lr_divisor, *cfg.elicit.extra_lr_divisors]) <= 0:
        raise ValueError("lr, maxent.lr, elicit.lr_divisor, elicit.extra_lr_divisors and clip must be positive")
    lambdas = maxent_lambdas(cfg)
    if not lambdas or min(lambdas) < 0:
        raise ValueError(f"maxent.lambda must be one or more weights >= 0, not {cfg.maxent.lambda_}")
    if len(lambdas) > 1 and "maxent" in cfg.variants:
        if "filter" not in cfg.variants:
            raise ValueError("a maxent.lambda sweep selects the λ closest to the filtered model: add filter to "
                             "variants, or give one maxent.lambda")
        if cfg.data != "synthetic":
            raise ValueError("a maxent.lambda sweep selects on the synthetic corpus's held-apart stream; "
                             "give one maxent.lambda with --data")
    if not cfg.profiles:
        raise ValueError("profiles must list at least one profile, e.g. core,core+a0 or all")
    for profile in cfg.profiles:
        if profile != "all" and profile.split("+")[0] != "core":
            raise ValueError(f"profile '{profile}' must start with core (core, core+a0, …) or be 'all'")
    if any(not 0 <= w <= 1 for w in cfg.titration.weights) or not cfg.titration.weights:
        raise ValueError(f"titration.weights must be in [0, 1], not {cfg.titration.weights}")
    if cfg.data == "synthetic":
        domains = set(AUX_TOPICS)
        bad = [m for p in cfg.profiles if p != "all" for m in p.split("+")[1:] if m not in domains]
        if bad:
            raise ValueError(f"unknown module(s) {bad} in profiles; the synthetic aux domains are {', '.join(AUX_TOPICS)}")
        if cfg.titration.module not in domains:
            raise ValueError(f"titration.module '{cfg.titration.module}' is not one of {', '.join(AUX_TOPICS)}")


def tokenizer_dir(cfg: GradientRouteConfig) -> str | None:
    """Where the data's tokenizer is: `tokenizer=`, else the --model checkpoint's own (its embedding rows are
    that tokenizer's ids: character ids would index unrelated rows), else None (characters)."""
    return cfg.tokenizer if cfg.tokenizer is not None else cfg.model


def check_inputs(cfg: GradientRouteConfig) -> None:
    """Before a run exists: the --model checkpoint (headers, and the tokenizer the data will use) and every
    document of a --data folder, read as the run reads it (UTF-8, JSON lines, Parquet with a text column)."""
    if cfg.model is not None:
        check_model(cfg)
    if cfg.data != "synthetic":
        from icml.methods.gradient_route.data import read_domains

        read_domains(cfg.data)


def check_model(cfg: GradientRouteConfig) -> None:
    """--model is a GPT-2 checkpoint directory with whole weights, its positions cover gpt.context, and the
    data's tokenizer (its own unless tokenizer= is set) loads and has no id past its embedding."""
    import json

    from icml.cli import checkpoints
    from icml.cli.errors import UsageError
    from icml.methods.gradient_route.data import HFTokenizer

    ckpt = checkpoints.check(cfg.model, SUPPORTED_FAMILIES, "gradient-route", tokenizer=False)
    if cfg.tokenizer is None and not any((ckpt.directory / f).is_file() for f in checkpoints.TOKENIZER_FILES):
        raise UsageError(f"--model '{cfg.model}' has no tokenizer to write the data in its vocabulary "
                         f"({' / '.join(checkpoints.TOKENIZER_FILES)})",
                         "save its tokenizer beside it (tokenizer.save_pretrained(dir)) or --set tokenizer=DIR")
    if ckpt.gguf_file is not None:  # quantised weights: training continues a float32 GPT2LMHeadModel
        raise UsageError(f"--model '{cfg.model}' is a .gguf file; gradient-route trains a GPT-2 checkpoint directory",
                         "give the directory save_pretrained wrote (config.json, model.safetensors, tokenizer)")
    config = json.loads((ckpt.directory / "config.json").read_text(encoding="utf-8"))
    positions = config.get("n_positions", 1024)  # GPT2Config's default when a config.json leaves it out
    if cfg.gpt.context > positions:
        raise UsageError(f"gpt.context ({cfg.gpt.context}) is more than the {positions} positions of --model "
                         f"'{cfg.model}'",
                         f"--set gpt.context={positions} or less")
    tokenizer = HFTokenizer(tokenizer_dir(cfg))
    if len(tokenizer) > config.get("vocab_size", 0):
        raise UsageError(f"tokenizer '{tokenizer_dir(cfg)}' has {len(tokenizer)} tokens, more than the "
                         f"{config.get('vocab_size', 0)} embedding rows of --model '{cfg.model}'",
                         "leave tokenizer unset (the checkpoint's own) or give the tokenizer it was trained with")
