"""Configuration of `icml spectral-optim`: one dataclass tree, three presets.

Every field is settable with `--set key=value`; `--data FILE.txt` sets `data`, `--model DIR` sets
`model`. A run's config.json reproduces it through `--config`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

ADAM_VARIANTS = ["Adam", "AdamS", "AdamQ", "AdamZ"]
MSGD_VARIANTS = ["mSGD", "mSGDS", "mSGDQ", "mSGDZ"]
VARIANTS = ADAM_VARIANTS + MSGD_VARIANTS
ABLATIONS = ["AdamS_svd", "mSGDZ_nosplit", "mSGDZ_embvec"]
CORPORA = ("generated", "stdlib", "file")


# --model families whose matrices the optimizer lays out right: GPT-2 (Conv1D, contiguous fused QKV),
# GPT-NeoX / Bloom (per-head fused QKV), and decoders with separate Q/K/V nn.Linear projections
SUPPORTED_FAMILIES = ("gpt2", "gpt_neox", "bloom", "llama", "mistral", "qwen2", "qwen3")

@dataclass
class ModelConfig:
    """The tiny GPT-2 of the spec (~0.8M parameters); ignored when `model` points to a checkpoint."""

    n_embd: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_positions: int = 128


@dataclass
class SpectralOptimConfig:
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    lr_multipliers: list[float] = field(default_factory=lambda: [0.1, 0.3, 1.0, 3.0])  # × the paper's matrix LR
    steps: int = 250
    batch_size: int = 8  # the spec says 16: its grid is estimated at 16-17 min on 2 cores even with psi_many (README)
    block_size: int = 128
    # windows per forward/backward: a step accumulates the gradients of batch_size / micro_batch parts (the same
    # mean loss and gradient); none: the whole batch at once. The paper's 480 windows need parts (README)
    micro_batch: int | None = None
    lr_vector: float | None = 3e-3  # vector (AdamW) LR of every run; none: the paper's per-variant value
    warmup_frac: float = 0.1
    min_lr_frac: float | None = 0.01  # cosine floor as a fraction of each group's peak; none: the paper's min LR
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    momentum: float = 0.9  # mSGD buffer-sum momentum μ
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    ns_iters: int = 15
    split_qkv: bool = True
    embeddings_as_vectors: bool = False
    corpus: str = "generated"  # generated | stdlib | file (`--data FILE.txt` sets file)
    corpus_chars: int = 2_000_000  # size of the generated corpus
    data: str | None = None  # a user text file (--data)
    model: str | None = None  # a causal LM of SUPPORTED_FAMILIES (--model: checkpoint dir, .gguf file or smollm2-135m)
    train_log_every: int = 10
    val_every: int = 50
    val_batches: int = 8  # batches per val_loss during training
    eval_val_batches: int = 32  # batches for the final val_loss in eval
    psi_sizes: list[str] = field(default_factory=lambda: ["64x64", "128x32", "32x128", "256x256"])
    psi_kappas: list[float] = field(default_factory=lambda: [2.0, 10.0, 30.0, 100.0])
    psi_repeats: int = 5
    workers: int = 2  # grid runs in parallel, one single-threaded process each (2 cores here)
    gpt: ModelConfig = field(default_factory=ModelConfig)


def preset(name: str) -> SpectralOptimConfig:
    cfg = SpectralOptimConfig()
    if name == "smoke":
        cfg.variants = ["AdamS", "mSGDZ"]
        cfg.lr_multipliers = [1.0]
        cfg.steps = 30
        cfg.corpus_chars = 200_000
        cfg.val_every = 30
        cfg.val_batches = 2
        cfg.eval_val_batches = 4
        cfg.psi_sizes = ["64x64", "128x32"]
        cfg.psi_kappas = [2.0, 100.0]
        cfg.psi_repeats = 2
        cfg.workers = 1
    elif name == "paper":  # GPT-2 124M scale; the LM itself comes from --model or a larger gpt config
        cfg.lr_multipliers = [1.0]
        cfg.lr_vector = None
        cfg.min_lr_frac = None
        cfg.steps = 200_000
        cfg.batch_size = 480
        cfg.block_size = 1024
        cfg.warmup_frac = 0.01
        cfg.micro_batch = 32  # 480 windows of GPT-2 124M at once hold ~880 GB of activations (`icml spectral-optim plan`)
        cfg.gpt = ModelConfig(n_embd=768, n_layer=12, n_head=12, n_positions=1024)
    return cfg


def parse_size(text: str) -> tuple[int, int]:
    rows, sep, cols = text.lower().partition("x")
    if not sep or not rows.isdigit() or not cols.isdigit() or int(rows) < 1 or int(cols) < 1:
        raise ValueError(f"psi_sizes entry '{text}' is not ROWSxCOLS (e.g. 64x64)")
    return int(rows), int(cols)


def validate(cfg: SpectralOptimConfig) -> None:
    """Reject values the runs cannot use, in one line each."""
    unknown = [v for v in cfg.variants if v not in VARIANTS + ABLATIONS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; valid: {', '.join(VARIANTS + ABLATIONS)}")
    if cfg.corpus not in CORPORA:
        raise ValueError(f"corpus must be one of {', '.join(CORPORA)}, not '{cfg.corpus}'")
    if cfg.corpus == "file" and not cfg.data:
        raise ValueError("corpus=file needs a text file: pass --data FILE.txt")
    if cfg.data:
        from pathlib import Path

        if not Path(cfg.data).is_file():
            raise ValueError(f"data '{cfg.data}' is not a file (expected a UTF-8 text file)")
        cfg.corpus = "file"
    if len(cfg.betas) != 2 or not all(0 <= b < 1 for b in cfg.betas):
        raise ValueError(f"betas must be two numbers in [0, 1), not {cfg.betas}")
    if not cfg.lr_multipliers or any(m <= 0 for m in cfg.lr_multipliers):
        raise ValueError("lr_multipliers must be a non-empty list of positive numbers")
    for key in ("steps", "batch_size", "block_size", "ns_iters", "val_every", "train_log_every",
                "val_batches", "eval_val_batches", "psi_repeats", "corpus_chars", "workers"):
        if getattr(cfg, key) <= 0:
            raise ValueError(f"{key} must be positive, not {getattr(cfg, key)}")
    if cfg.micro_batch is not None and cfg.micro_batch <= 0:
        raise ValueError(f"micro_batch must be positive (or none: the whole batch), not {cfg.micro_batch}")
    if not 0 <= cfg.warmup_frac < 1 or (cfg.min_lr_frac is not None and not 0 <= cfg.min_lr_frac <= 1):
        raise ValueError("warmup_frac must be in [0, 1) and min_lr_frac in [0, 1]")
    if cfg.gpt.n_embd % cfg.gpt.n_head:
        raise ValueError(f"gpt.n_embd ({cfg.gpt.n_embd}) must be divisible by gpt.n_head ({cfg.gpt.n_head})")
    if cfg.block_size > cfg.gpt.n_positions and not cfg.model:
        raise ValueError(f"block_size ({cfg.block_size}) exceeds gpt.n_positions ({cfg.gpt.n_positions})")
    for size in cfg.psi_sizes:
        parse_size(size)
    if any(k < 1 for k in cfg.psi_kappas):
        raise ValueError("psi_kappas must be condition numbers >= 1")


def check_inputs(cfg: SpectralOptimConfig) -> None:
    """Before a run exists: the --model checkpoint's headers (family, weights, tokenizer), and the --data
    corpus is read (UTF-8, not empty) as the run reads it."""
    if cfg.model:
        from icml.cli import checkpoints

        checkpoints.check(cfg.model, SUPPORTED_FAMILIES, "spectral-optim")
    if cfg.data:
        from icml.methods.spectral_optim.data import read_text_file

        read_text_file(cfg.data)
