"""Configuration of `icml reason-stop`: one dataclass tree, three presets.

Every field is settable with `--set key=value` at train time (eval and generate read the run's
config.json); `--data FILE.jsonl` sets `data`, `--model DIR` sets `model`. The strings of the
controller (ATP words, probe, exit suffix, jump prompt, think markers) default to the synthetic
vocabulary; the paper preset sets the real-model (Qwen3-style) ones.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

VARIANTS = ["vanilla", "nothinking", "deer", "asag", "asag_exit", "asag_exit_inject", "asag_exit_jump",
            "oracle_first_correct"]
PROBE_POSITIONS = ("before", "after")
TRAP_STATS = ("mean", "mass")
PLAN_MODELS = ("tiny", "qwen3-8b")

# the real-model strings of the spec (Qwen3 / DeepSeek-R1-style thinking models)
REAL_ATP_WORDS = ["Wait", "Hmm", "Alternatively"]
REAL_PROBE = "\n\n**Final Answer**\n\n\\boxed{"
REAL_EXIT = "\n</think>\n\n"
REAL_JUMP = "Wait, my previous reasoning is not correct. I should adopt a more concise and different approach."


# --model families: decoders whose eager attention returns the weights the controller reads
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

@dataclass
class TinyModelConfig:
    """The tiny Llama of the spec (~0.6M parameters); ignored when `model` points to a checkpoint."""

    hidden: int = 96
    intermediate: int = 256
    layers: int = 6
    heads: int = 4
    kv_heads: int = 2
    max_position: int = 256


@dataclass
class ReasonStopConfig:
    # evaluation grid
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    n_eval: int = 300  # test problems (or the first n_eval lines of --data)
    max_new_tokens: int = 192  # thinking budget: tokens generated before the answer phase
    answer_max_tokens: int = 4  # final-answer budget after </think> (real models: 512)
    # the controller (spec defaults; λ, α and s to confirm against the paper)
    lam: float = 0.95  # λ: probe-confidence threshold (DEER's value)
    alpha: float = -0.1  # α: threshold on ΔH = (H_i − H_1)/H_1
    max_jumps: int = 2  # s: jump prompts per problem before a forced exit
    inject_weight: float = 0.05  # γ of p = (1−γ)·softmax(z) + γ·r
    inject_tokens: int | None = None  # injected steps after an ATP; none: until the next ATP
    window: int = 64  # rows of the attention-entropy window (the last `window` of the action)
    n_last_layers: int = 4
    probe_position: str = "before"  # probe before or after the ATP token is appended
    trap_stat: str = "mean"  # trap test on mean weight per key, or on total attention mass
    probe_max_tokens: int = 16
    # decoding of the model's own tokens (thinking and final answer); probes are always greedy
    temperature: float = 0.0  # 0: greedy, the spec's; > 0: sampled from softmax(z / T) (README: deviation)
    top_p: float = 1.0  # nucleus of the sampled distribution (1: the whole vocabulary); needs temperature > 0
    workers: int = 1  # variants evaluated in parallel processes (cli/workers.py)
    # controller strings (synthetic vocabulary; the paper preset sets the Qwen3 ones)
    atp_words: list[str] = field(default_factory=lambda: ["wait", "hmm"])
    probe_string: str = "</think> F"
    probe_terminator: str = "<eos>"  # the synthetic answer is one digit, then <eos>; real: "}"
    exit_suffix: str = "</think> F"
    jump_prompt: str = "wait no previous wrong restart"
    think_start: str = "<think>"  # appended to the prompt unless it already ends with it
    think_end: str = "</think>"
    empty_think: str = "<think> </think>"  # the NoThinking prompt's empty thinking block
    # data
    data: str | None = None  # JSONL with question/answer (--data): answers from \boxed{}, normalised
    n_train: int = 20000
    n_val: int = 500
    min_operands: int = 3
    max_operands: int = 6
    recheck_weights: list[float] = field(default_factory=lambda: [0.05, 0.1, 0.15, 0.3, 0.4])  # R = 0…4
    slip_rate: float = 0.15
    first_error_rate: float = 0.2
    loop_rate: float = 0.1
    # training of the tiny model
    steps: int = 2000
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 100
    max_length: int = 192
    train_threads: int = 1  # intra-op threads of the training loop (cli/threads.py; 2 spin on a shared machine: README)
    train_micro_batch: int = 4  # traces per length-sorted micro-batch of a step (same loss and gradient; README)
    train_log_every: int = 50
    val_every: int = 250
    model: str | None = None  # a causal LM of SUPPORTED_FAMILIES (--model: checkpoint dir, .gguf file or smollm2-135m): no training
    plan_model: str = "tiny"  # what `icml reason-stop plan` sizes without --model: tiny | qwen3-8b (published sizes)
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


def preset(name: str) -> ReasonStopConfig:
    cfg = ReasonStopConfig()
    if name == "smoke":
        cfg.steps = 150
        cfg.batch_size = 4  # a step at batch 32 costs ~0.9 s of one shared core (README, "Presets")
        cfg.n_eval = 16
        cfg.n_train = 2000
        cfg.n_val = 64
        cfg.val_every = 75
        cfg.train_threads = 1  # smoke runs beside other jobs (tests, CI)
        cfg.max_new_tokens = 48  # an undertrained model rambles to the cap: eval costs ∝ this (README)
        cfg.probe_max_tokens = 2  # the synthetic answer is one digit and <eos>; 16 lets a rambling model run on
    elif name == "default":
        # the spec's 2000 steps cost ~0.89 CPU-s each (measured, one thread): ~30 min, not the 15-min
        # budget; 700 steps + eval on 2 workers fit it (README, "Presets")
        cfg.steps = 700
        cfg.workers = 2
    elif name == "paper":  # a Qwen3-style directory via --model, benchmark JSONL via --data, on a GPU
        cfg.n_eval = 500
        cfg.max_new_tokens = 16384
        cfg.answer_max_tokens = 512
        cfg.atp_words = list(REAL_ATP_WORDS)
        cfg.probe_string = REAL_PROBE
        cfg.probe_terminator = "}"
        cfg.exit_suffix = REAL_EXIT
        cfg.jump_prompt = REAL_JUMP
        cfg.think_start = "<think>\n"
        cfg.empty_think = "<think>\n\n</think>\n\n"
        cfg.plan_model = "qwen3-8b"  # a Qwen3-8B-class reasoner (plan.py)
    return cfg


def validate(cfg: ReasonStopConfig) -> None:
    """Reject values the runs cannot use, in one line each."""
    unknown = [v for v in cfg.variants if v not in VARIANTS]
    if unknown or not cfg.variants:
        raise ValueError(f"unknown or no variant(s) {unknown}; valid: {', '.join(VARIANTS)}")
    for key, allowed in (("probe_position", PROBE_POSITIONS), ("trap_stat", TRAP_STATS)):
        if getattr(cfg, key) not in allowed:
            raise ValueError(f"{key} must be one of {', '.join(allowed)}, not '{getattr(cfg, key)}'")
    for key in ("n_eval", "max_new_tokens", "answer_max_tokens", "window", "n_last_layers", "probe_max_tokens",
                "n_train", "n_val", "steps", "batch_size", "max_length", "train_threads", "train_micro_batch",
                "train_log_every", "val_every", "workers"):
        if getattr(cfg, key) <= 0:
            raise ValueError(f"{key} must be positive, not {getattr(cfg, key)}")
    if cfg.plan_model not in PLAN_MODELS:
        raise ValueError(f"plan_model must be one of {', '.join(PLAN_MODELS)}, not '{cfg.plan_model}'")
    if cfg.max_jumps < 0 or cfg.warmup_steps < 0:
        raise ValueError("max_jumps and warmup_steps must be >= 0")
    if cfg.inject_tokens is not None and cfg.inject_tokens <= 0:
        raise ValueError(f"inject_tokens must be positive or none (until the next ATP), not {cfg.inject_tokens}")
    if not 0 <= cfg.inject_weight <= 1:
        raise ValueError(f"inject_weight (γ) must be in [0, 1], not {cfg.inject_weight}")
    if not (math.isfinite(cfg.temperature) and cfg.temperature >= 0):
        raise ValueError(f"temperature must be >= 0 (0: greedy), not {cfg.temperature}")
    if not 0 < cfg.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], not {cfg.top_p}")
    if cfg.top_p < 1 and cfg.temperature == 0:
        raise ValueError("top_p < 1 needs temperature > 0 (greedy decoding has no nucleus)")
    if math.isnan(cfg.lam) or math.isnan(cfg.alpha):
        raise ValueError("lam and alpha must be numbers, not nan")
    if cfg.lr <= 0 or cfg.weight_decay < 0:
        raise ValueError("lr must be positive and weight_decay >= 0")
    words = [w.strip() for w in cfg.atp_words]
    if not words or any(not w for w in words):
        raise ValueError(f"atp_words must be non-empty words, not {cfg.atp_words}")
    for key in ("probe_string", "probe_terminator", "exit_suffix", "jump_prompt", "think_start", "think_end",
                "empty_think"):
        if not getattr(cfg, key).strip():
            raise ValueError(f"{key} must be a non-empty string")
    if not 2 <= cfg.min_operands <= cfg.max_operands <= 6:
        raise ValueError(f"need 2 <= min_operands <= max_operands <= 6, not {cfg.min_operands}, {cfg.max_operands}")
    if len(cfg.recheck_weights) != 5 or any(w < 0 for w in cfg.recheck_weights) or sum(cfg.recheck_weights) <= 0:
        raise ValueError(f"recheck_weights must be 5 non-negative weights over R = 0…4, not {cfg.recheck_weights}")
    for key in ("slip_rate", "first_error_rate", "loop_rate"):
        if not 0 <= getattr(cfg, key) <= 1:
            raise ValueError(f"{key} must be a probability in [0, 1], not {getattr(cfg, key)}")
    if cfg.first_error_rate + cfg.loop_rate > 1:
        raise ValueError("first_error_rate + loop_rate must be <= 1 (a trace has at most one of them)")
    if cfg.tiny.hidden % cfg.tiny.heads or cfg.tiny.heads % cfg.tiny.kv_heads:
        raise ValueError("tiny.hidden must be divisible by tiny.heads, and tiny.heads by tiny.kv_heads")
    if not cfg.model and cfg.tiny.layers < cfg.n_last_layers:
        raise ValueError(f"tiny.layers ({cfg.tiny.layers}) must be >= n_last_layers ({cfg.n_last_layers})")
    if not cfg.model and cfg.max_length > cfg.tiny.max_position:
        raise ValueError(f"max_length ({cfg.max_length}) exceeds tiny.max_position ({cfg.tiny.max_position})")
    if cfg.data and not Path(cfg.data).is_file():
        raise ValueError(f"data '{cfg.data}' is not a file (expected JSONL with question/answer per line)")
    if cfg.data:
        from icml.methods.reason_stop.data import load_jsonl

        load_jsonl(cfg.data)  # a malformed line is its own one-line error, before any run exists
    if cfg.model and not (Path(cfg.model) / "config.json").is_file():
        raise ValueError(f"model '{cfg.model}' is not a checkpoint directory (no config.json; "
                         "save one with save_pretrained)")


def check_inputs(cfg: ReasonStopConfig) -> None:
    """Before a run exists: every ATP word can be written by the tokenizer the run will use (the
    --model checkpoint's, or the synthetic word vocabulary); one it cannot spell would never trigger."""
    from icml.methods.reason_stop.controller import spells

    if cfg.model:
        from icml.cli import checkpoints
        from icml.methods.reason_stop.model import load_tokenizer

        checkpoints.check(cfg.model, SUPPORTED_FAMILIES, "reason-stop")
        tokenizer = load_tokenizer(cfg.model)
    else:
        from icml.methods.reason_stop.data import build_tokenizer

        tokenizer = build_tokenizer()
    for word in (w.strip() for w in cfg.atp_words):
        if not spells(tokenizer, word):
            written = tokenizer.decode(tokenizer(word, add_special_tokens=False)["input_ids"])
            source = f"the tokenizer of '{cfg.model}'" if cfg.model else "the synthetic word tokenizer"
            raise ValueError(f"ATP word '{word}' cannot be written by {source} (it comes back as '{written}'), "
                             "so it would never trigger — set atp_words to words of that vocabulary "
                             "(--set atp_words=...)")
