"""Configuration of `icml latent-thought`: one dataclass tree, three presets.

Every field is settable with `--set key=value` at train time (eval, report and generate read the
run's config.json); `--data FILE.txt` sets `data`, `--model DIR` sets `model`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

MAIN_ARMS = ["vanilla_1x", "vanilla_2x", "ponderlm2_k1", "ponderlm2_k2"]
BASELINE_ARMS = ["pause_k1", "loop_k1", "ponderlm1_k1"]
ABLATION_ARMS = ["ponderlm2_k1_noscale", "ponderlm2_k1_detach"]
ARMS = MAIN_ARMS + BASELINE_ARMS + ABLATION_ARMS
SCALE_MODES = ("auto", "true", "false")
# ponderlm2_k<K>[_noscale|_detach] for any K >= 1; `ponderlm2` alone takes K from the `K` key
ARM_PATTERN = re.compile(r"^(vanilla_1x|vanilla_2x|pause_k1|loop_k1|ponderlm1_k1|ponderlm2(_k[1-9]\d*)?"
                         r"(_noscale|_detach)?)$")


# Decoders whose layers take (inputs_embeds, a 4-D slot mask, position ids) as Llama's do, with no
# embedding scale of their own; each pinned at K = 0 against transformers' forward (tests)
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

@dataclass
class TinyLlamaConfig:
    """The spec's LlamaConfig of every arm; ignored when `model` points to a checkpoint."""

    hidden: int = 128
    layers: int = 4  # vanilla_2x doubles it
    heads: int = 4
    intermediate: int = 344
    rms_norm_eps: float = 1e-5  # the first official release (a later commit uses 1e-1; README)


@dataclass
class LatentThoughtConfig:
    arms: list[str] = field(default_factory=lambda: ["vanilla_1x", "vanilla_2x", "ponderlm2_k1"])
    K: int = 1  # thoughts per token of a bare `ponderlm2` arm and of --model runs
    train_J: list[int] = field(default_factory=lambda: [2, 3])  # Jacobi iterations drawn uniformly per step
    eval_J: int = 3  # the Jacobi solve of eval, prefill and the headline nats/byte
    eval_Js: list[int] = field(default_factory=lambda: [1, 2, 3, 5])  # nats/byte vs J
    seq_len: int = 128
    steps: int = 200
    batch: int = 16
    lr: float = 3e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.1
    warmup_frac: float = 0.05
    min_lr_frac: float = 0.1  # cosine to 10% of the peak
    clip: float = 1.0
    scale_embeds: str = "auto"  # auto (on from scratch, off with --model) | true | false
    thought_scale: float = 1.0  # multiplier on fed-back thoughts
    baseline_k: int = 1  # extra steps of pause / loop / ponderlm1
    n_val: int = 64  # validation windows, identical for every arm
    n_exact: int = 2  # windows of the exact-vs-cached check (Jacobi with J = K(T-1))
    val_every: int = 50  # validation nats/byte during training (curves vs tokens and FLOPs)
    val_windows_train: int = 16  # windows of those curves
    train_log_every: int = 10
    gen_bytes: int = 32  # generated tokens of the throughput measurement in eval
    gen_prompt: str = "def main():\n    "
    data: str | None = None  # a UTF-8 text file (--data); the last 5% (at a line boundary) validates
    model: str | None = None  # a causal LM of SUPPORTED_FAMILIES (--model: checkpoint dir, .gguf file or smollm2-135m)
    train_threads: int = 2
    tiny: TinyLlamaConfig = field(default_factory=TinyLlamaConfig)


def preset(name: str) -> LatentThoughtConfig:
    cfg = LatentThoughtConfig()
    if name == "smoke":
        cfg.arms = ["vanilla_1x", "ponderlm2_k1"]
        cfg.seq_len, cfg.steps, cfg.batch = 64, 20, 8
        cfg.n_val, cfg.n_exact, cfg.val_every, cfg.val_windows_train = 8, 2, 10, 8
        cfg.gen_bytes, cfg.train_log_every = 16, 5
        cfg.train_threads = 1  # arrays this small only pay the fork/join of a second thread (cli/threads.py)
    elif name == "paper":
        # Llama-1.4B on a pre-tokenised Pile shard (--data); documented, not run here (GPUs)
        cfg.tiny = TinyLlamaConfig(hidden=2048, layers=24, heads=32, intermediate=5504)
        cfg.arms = ["vanilla_1x", "vanilla_2x", "ponderlm2_k1", "ponderlm2_k2", "pause_k1", "loop_k1",
                    "ponderlm1_k1"]
        cfg.seq_len, cfg.steps, cfg.batch, cfg.lr = 2048, 50_000, 256, 2e-4
        cfg.warmup_frac, cfg.n_val, cfg.val_every, cfg.val_windows_train = 0.02, 256, 1000, 64
    elif name != "default":
        raise ValueError(f"unknown preset '{name}'")
    return cfg


def validate(cfg: LatentThoughtConfig) -> None:
    """Reject values the runs cannot use, in one line each."""
    from pathlib import Path

    if not cfg.arms:
        raise ValueError("arms is empty: name at least one of " + ", ".join(ARMS))
    bad = [a for a in cfg.arms if not ARM_PATTERN.match(a)]
    if bad:
        raise ValueError(f"unknown arm(s) {bad}; valid: {', '.join(ARMS)} (or ponderlm2_k<K>)")
    if len(set(cfg.arms)) != len(cfg.arms):
        raise ValueError(f"arms lists an arm twice: {cfg.arms}")
    if cfg.K < 1:
        raise ValueError(f"K must be at least 1, not {cfg.K}")
    if not cfg.train_J or any(j < 0 for j in cfg.train_J):
        raise ValueError(f"train_J must be a non-empty list of iteration counts >= 0, not {cfg.train_J}")
    if cfg.eval_J < 0 or any(j < 0 for j in cfg.eval_Js):
        raise ValueError("eval_J and eval_Js must be >= 0")
    for key in ("seq_len", "steps", "batch", "n_val", "val_every", "val_windows_train", "train_log_every",
                "train_threads"):
        if getattr(cfg, key) <= 0:
            raise ValueError(f"{key} must be positive, not {getattr(cfg, key)}")
    if cfg.seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, not {cfg.seq_len}")
    for key in ("n_exact", "gen_bytes"):
        if getattr(cfg, key) < 0:
            raise ValueError(f"{key} must be >= 0, not {getattr(cfg, key)}")
    if cfg.baseline_k < 1:
        raise ValueError(f"baseline_k must be at least 1, not {cfg.baseline_k}")
    if cfg.lr <= 0 or cfg.clip <= 0 or cfg.weight_decay < 0:
        raise ValueError("lr and clip must be positive and weight_decay >= 0")
    if len(cfg.betas) != 2 or not all(0 <= b < 1 for b in cfg.betas):
        raise ValueError(f"betas must be two numbers in [0, 1), not {cfg.betas}")
    if not 0 <= cfg.warmup_frac < 1 or not 0 <= cfg.min_lr_frac <= 1:
        raise ValueError("warmup_frac must be in [0, 1) and min_lr_frac in [0, 1]")
    if cfg.scale_embeds not in SCALE_MODES:
        raise ValueError(f"scale_embeds must be one of {', '.join(SCALE_MODES)}, not '{cfg.scale_embeds}'")
    if cfg.thought_scale <= 0:
        raise ValueError(f"thought_scale must be positive, not {cfg.thought_scale}")
    t = cfg.tiny
    if min(t.hidden, t.layers, t.heads, t.intermediate) <= 0 or t.hidden % t.heads or (t.hidden // t.heads) % 2:
        raise ValueError(f"tiny: hidden {t.hidden} must split into {t.heads} heads of even size; "
                         "layers and intermediate must be positive")
    if t.rms_norm_eps <= 0:
        raise ValueError(f"tiny.rms_norm_eps must be positive, not {t.rms_norm_eps}")
    if cfg.data and not Path(cfg.data).is_file():
        raise ValueError(f"data '{cfg.data}' is not a file (expected a UTF-8 text file)")
    if cfg.model and any(a == "vanilla_2x" for a in cfg.arms):
        raise ValueError("vanilla_2x has no meaning with --model (the checkpoint fixes the depth): drop it from arms")


def check_inputs(cfg: LatentThoughtConfig) -> None:
    """Before a run exists: the --model checkpoint is of a family whose decoder the arms drive (headers
    only), and the --data text is read and split as the run reads it (UTF-8)."""
    if cfg.model:
        from icml.cli import checkpoints

        checkpoints.check(cfg.model, SUPPORTED_FAMILIES, "latent-thought")
    if cfg.data:
        from icml.methods.latent_thought.data import file_corpus

        file_corpus(cfg.data)
