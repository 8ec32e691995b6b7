"""Configuration of `icml kv-compress`: one dataclass tree, three presets.

Every field is settable with `--set key=value` at train time (eval and calibrate read the run's
config.json); `--data FILE.jsonl` sets `data`, `--model DIR` sets `model`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from icml.methods.kv_compress.real_tasks import REAL_TASKS

TASKS = ["kv_retrieval", "needle", "aggregation"]
# the spec's 13 variants (the default preset's arms), then EntroKV at α = 0.25 in each scope (the real preset's)
SPEC_VARIANTS = ["full", "snapkv", "h2o", "streamingllm", "pyramidkv", "adakv", "entrokv_snapkv", "entrokv_h2o",
                 "entrokv_streamingllm", "entrokv_alpha0", "entrokv_alpha1", "entrokv_perlayer", "entrokv_qagnostic"]
VARIANTS = SPEC_VARIANTS + ["entrokv_alpha0.25", "entrokv_perlayer_alpha0.25"]
REAL_VARIANTS = ["full", "snapkv", "h2o", "streamingllm", "pyramidkv", "adakv", "entrokv_snapkv", "entrokv_alpha0.25",
                 "entrokv_perlayer", "entrokv_perlayer_alpha0.25"]
TASK_SETS = ("generated", "real")
SCOPES = ("global", "per_layer")
POOLS = ("max", "avg")
GQA_AGGS = ("mean", "max")
ENTROPY_NORMS = ("history", "prompt")  # log(N−w) as the reproduction, or log N
SCORINGS = ("exact", "f1")
PLAN_MODELS = ("tiny", "llama-3.1-8b")
# the kinds of training rows (training.training_batch)
ROW_KINDS = ("copy", "cue_copy", "recall", "count", "context_recall", "context_count", "tasks")


# RoPE + GQA decoders our forward drives (Qwen3: q_norm/k_norm before RoPE); each pinned by a test
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

@dataclass
class TinyModelConfig:
    """The tiny Llama of the spec; ignored when `model` points to a checkpoint."""

    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 384
    max_position: int = 512
    init_std: float = 0.08  # weight init std (HF's initializer_range, default 0.02): see README, training


@dataclass
class RealTasksConfig:
    """The natural-text chat tasks of `--preset real` (real_tasks.py); lengths in the model's tokens."""

    tasks: list[str] = field(default_factory=lambda: list(REAL_TASKS))
    tokens: int = 1450  # context tokens of passkey, multikey, aggregation (the chat prompt adds ≈ 60)
    tokens_long: int = 3950  # context tokens of passkey_long
    needles: int = 4  # multikey: cities with a special magic number, one asked
    facts: int = 3  # aggregation: special magic numbers, all asked
    threads: int = 1  # intra-op threads of the real eval's prefill and decoding (2 on a quiet 2-core machine)


@dataclass
class KvCompressConfig:
    # evaluation grid
    variants: list[str] = field(default_factory=lambda: list(SPEC_VARIANTS))
    ratios: list[float] = field(default_factory=lambda: [0.1, 0.2, 0.3, 0.5, 1.0])
    window: int = 16
    alpha: float = 0.5
    h_bar: float | None = None  # none: from calibration.json of the run (calibrate)
    scope: str = "global"  # EntroKV conservation scope: global | per_layer
    pool: str = "max"  # SnapKV 1-D pooling: max | avg
    kernel: int = 7
    question_aware: bool = True  # mode of every variant but entrokv_qagnostic
    n_per_task: int = 200
    gqa_agg: str = "mean"  # query heads -> KV head entropy: mean | max
    entropy_norm: str = "history"
    sinks: int = 4  # StreamingLLM sink tokens
    pyramid_beta: float = 20.0
    adakv_floor: float = 0.2  # Ada-KV safeguard φ
    bootstrap: int = 1000
    # data
    task_set: str = "generated"  # generated (the tiny vocabulary's three tasks) | real (natural-text chat tasks)
    real: RealTasksConfig = field(default_factory=RealTasksConfig)
    context_min: int = 160
    context_max: int = 320
    train_context_min: int = 32  # training contexts start at train_context_min..train_context_short
    train_context_short: int = 64  # words (a length curriculum, training.context_range)
    curriculum_hold: float = 0.5  # fraction of the steps on short contexts
    curriculum_grow: float = 0.25  # then the lengths grow to context_min..context_max over this fraction
    data: str | None = None  # a JSONL file (--data): context/question/answer or context/input/answers
    scoring: str = "exact"  # exact | f1 (token F1, best over a line's answers: metric token_f1)
    calibration_split: int = 16  # the first lines of a --data file, held apart for H̄; eval scores the rest
    max_new_tokens: int = 16  # greedy answer length cap for --data files
    # training of the tiny model
    steps: int = 3000
    batch_size: int = 32  # rows at short lengths; fewer as they grow (about constant tokens)
    min_batch_size: int = 16  # rows at long lengths
    rows_short: str = "copy:1,cue_copy:1,recall:1,count:1"  # row kind:weight while contexts are short
    rows_long: str = "copy:1,cue_copy:1,context_recall:2,count:1,context_count:1,tasks:2"  # … once they grow
    recall_pairs: list[int] = field(default_factory=lambda: [2, 8])  # pairs of a dense recall row: min, max
    lr: float = 3e-3  # the spec says 1e-3 (README)
    weight_decay: float = 0.01
    warmup_steps: int = 100
    train_questions: int = 1  # questions per training context of the tasks (eval prompts carry one)
    train_threads: int = 2  # intra-op threads of the training loop: 2 cores make a step 1.2-2x faster
    # on a quiet machine (README); 1 when other jobs share the cores (cli/threads.py)
    train_log_every: int = 50
    val_every: int = 200
    val_per_task: int = 64
    # calibration
    n_calibration: int = 64
    calibrate_on_train: bool = True
    model: str | None = None  # a causal LM of SUPPORTED_FAMILIES (--model: checkpoint dir, .gguf file or smollm2-135m): no training
    # what `icml kv-compress plan` sizes when no --model is given: the tiny model, or llama-3.1-8b (the published
    # sizes, no download); and the prompt length it sizes (0: context_max words + the question, generated tasks)
    plan_model: str = "tiny"
    plan_tokens: int = 0
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


def preset(name: str) -> KvCompressConfig:
    cfg = KvCompressConfig()
    if name == "smoke":
        cfg.steps = 40  # the spec says 200; one step takes 0.3–1 s on the shared CPU (README)
        cfg.val_every = 20
        cfg.val_per_task = 16
        cfg.n_per_task = 20
        cfg.ratios = [0.3, 1.0]
        cfg.variants = ["full", "snapkv", "entrokv_snapkv"]
        cfg.n_calibration = 16
        cfg.train_threads = 1  # 40 cheap steps; smoke runs beside other jobs (tests, CI)
    elif name == "paper":  # a real checkpoint via --model and LongBench files via --data, on a GPU;
        # without --model it trains the tiny model at the spec's lr 1e-3
        cfg.lr = 1e-3
        cfg.val_every = 500
        cfg.window = 32
        cfg.kernel = 7
        cfg.alpha = 0.5
        cfg.ratios = [0.3]
        cfg.n_per_task = 50
        cfg.scoring = "f1"
        cfg.max_new_tokens = 64
        cfg.plan_model = "llama-3.1-8b"  # Llama-3.1-8B-Instruct on LongBench prompts up to 32k tokens (plan.py)
        cfg.plan_tokens = 32768
    elif name == "real":  # SmolLM2-135M-Instruct on natural-text chat tasks through generate() (README, real)
        cfg.model = "smollm2-135m"
        cfg.task_set = "real"
        cfg.variants = list(REAL_VARIANTS)
        cfg.ratios = [0.1, 0.2, 0.3, 0.5]
        cfg.window = 32
        cfg.kernel = 7
        cfg.alpha = 0.5
        cfg.n_per_task = 40
        cfg.n_calibration = 8  # held-apart prompts (their own stream), 2 per task
        cfg.scoring = "f1"  # retention and the paired CIs on LongBench's token F1; exact_match is recorded too
        cfg.max_new_tokens = 24
        cfg.plan_tokens = 4096  # `plan` sizes the longest prompt (passkey_long ≈ 4040 tokens)
    return cfg


def row_mixture(text: str, key: str = "rows") -> list[tuple[str, float]]:
    """`kind:weight,…` → [(kind, weight)], e.g. "copy:1,recall:2"; a bad entry is a one-line ValueError."""
    mixture = []
    for part in text.split(","):
        kind, _, weight = part.strip().partition(":")
        if kind not in ROW_KINDS:
            raise ValueError(f"{key}: unknown row kind '{kind}'; valid: {', '.join(ROW_KINDS)}")
        try:
            value = float(weight or 1)
        except ValueError:
            raise ValueError(f"{key}: weight of '{kind}' must be a number, not '{weight}'") from None
        if value <= 0:
            raise ValueError(f"{key}: weight of '{kind}' must be positive, not {weight}")
        mixture.append((kind, value))
    return mixture


def validate(cfg: KvCompressConfig) -> None:
    """Reject values the runs cannot use, in one line each."""
    unknown = [v for v in cfg.variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; valid: {', '.join(VARIANTS)}")
    if not cfg.ratios or any(not 0 < r <= 1 for r in cfg.ratios):
        raise ValueError(f"ratios must be budget fractions in (0, 1], not {cfg.ratios}")
    for key, allowed in (("scope", SCOPES), ("pool", POOLS), ("gqa_agg", GQA_AGGS),
                         ("entropy_norm", ENTROPY_NORMS), ("scoring", SCORINGS)):
        if getattr(cfg, key) not in allowed:
            raise ValueError(f"{key} must be one of {', '.join(allowed)}, not '{getattr(cfg, key)}'")
    if not 0 <= cfg.alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], not {cfg.alpha}")
    if cfg.h_bar is not None and not 0 < cfg.h_bar <= 1:
        raise ValueError(f"h_bar must be a normalised entropy in (0, 1], not {cfg.h_bar}")
    if cfg.kernel < 1 or cfg.kernel % 2 == 0:
        raise ValueError(f"kernel must be a positive odd integer (same padding), not {cfg.kernel}")
    if not 0 <= cfg.adakv_floor <= 1 or cfg.pyramid_beta < 1:
        raise ValueError("adakv_floor must be in [0, 1] and pyramid_beta >= 1")
    for key in ("window", "n_per_task", "train_questions", "steps", "batch_size", "min_batch_size", "train_threads",
                "train_log_every", "val_every", "val_per_task", "n_calibration", "bootstrap", "max_new_tokens"):
        if getattr(cfg, key) <= 0:
            raise ValueError(f"{key} must be positive, not {getattr(cfg, key)}")
    if cfg.plan_model not in PLAN_MODELS or cfg.plan_tokens < 0:
        raise ValueError(f"plan_model must be one of {', '.join(PLAN_MODELS)} and plan_tokens >= 0")
    if cfg.calibration_split < 0:
        raise ValueError(f"calibration_split must be >= 0 (lines of --data held apart for H̄), not {cfg.calibration_split}")
    if cfg.sinks < 0:
        raise ValueError(f"sinks must be >= 0, not {cfg.sinks}")
    if not cfg.window + 8 <= cfg.context_min <= cfg.context_max:
        raise ValueError(f"need window + 8 <= context_min <= context_max, not {cfg.window}, "
                         f"{cfg.context_min}, {cfg.context_max}")
    if not 8 <= cfg.train_context_min <= cfg.train_context_short <= cfg.context_max:
        raise ValueError(f"need 8 <= train_context_min <= train_context_short <= context_max, not "
                         f"{cfg.train_context_min}, {cfg.train_context_short}, {cfg.context_max}")
    for key in ("rows_short", "rows_long"):
        row_mixture(getattr(cfg, key), key)
    if len(cfg.recall_pairs) != 2 or not 1 <= cfg.recall_pairs[0] <= cfg.recall_pairs[1] <= 40:
        raise ValueError(f"recall_pairs must be min,max with 1 <= min <= max <= 40 (the keys), not {cfg.recall_pairs}")
    for key in ("curriculum_hold", "curriculum_grow"):
        if not 0 <= getattr(cfg, key) <= 1:
            raise ValueError(f"{key} must be in [0, 1], not {getattr(cfg, key)}")
    if cfg.curriculum_hold + cfg.curriculum_grow > 1:
        raise ValueError("curriculum_hold + curriculum_grow must be <= 1")
    if cfg.min_batch_size > cfg.batch_size or cfg.tiny.init_std <= 0:
        raise ValueError("need min_batch_size <= batch_size and tiny.init_std > 0")
    if cfg.context_max + 8 > cfg.tiny.max_position and not cfg.model:
        raise ValueError(f"context_max ({cfg.context_max}) + the question exceeds tiny.max_position "
                         f"({cfg.tiny.max_position})")
    if cfg.tiny.hidden % cfg.tiny.heads or cfg.tiny.heads % cfg.tiny.kv_heads:
        raise ValueError("tiny.hidden must be divisible by tiny.heads, and tiny.heads by tiny.kv_heads")
    if cfg.task_set not in TASK_SETS:
        raise ValueError(f"task_set must be one of {', '.join(TASK_SETS)}, not '{cfg.task_set}'")
    if cfg.task_set == "real":
        validate_real(cfg)
    if cfg.data and not Path(cfg.data).is_file():
        raise ValueError(f"data '{cfg.data}' is not a file (expected JSONL with context/question/answer)")


def validate_real(cfg: KvCompressConfig) -> None:
    real = cfg.real
    if not cfg.model:
        raise ValueError("task_set=real asks a chat model: give --model (e.g. smollm2-135m)")
    if cfg.data:
        raise ValueError("task_set=real builds its own prompts: --data is for the generated and paper presets")
    unknown = [t for t in real.tasks if t not in REAL_TASKS]
    if unknown or not real.tasks:
        raise ValueError(f"real.tasks must name some of {', '.join(REAL_TASKS)}, not {real.tasks}")
    if "full" not in cfg.variants:
        raise ValueError("task_set=real needs the variant full (retention and kl_to_full divide by it)")
    agnostic = [v for v in cfg.variants if v == "entrokv_qagnostic"]
    if agnostic:
        raise ValueError("task_set=real decodes question-aware only: drop entrokv_qagnostic")
    if min(real.tokens, real.tokens_long) < cfg.window + 16:
        raise ValueError(f"real.tokens and real.tokens_long must be >= window + 16 ({cfg.window + 16})")
    if real.needles < 1 or not 1 <= real.facts <= 5 or real.threads < 1:
        raise ValueError("need real.needles >= 1, 1 <= real.facts <= 5 and real.threads >= 1")


def check_inputs(cfg: KvCompressConfig) -> None:
    """Before a run exists: the --model checkpoint is of a supported family (headers only), and the
    --data JSONL is read and split as the run reads it."""
    if cfg.model:
        from icml.cli import checkpoints

        checkpoints.check(cfg.model, SUPPORTED_FAMILIES, "kv-compress")
    if cfg.data:
        from icml.methods.kv_compress.pipeline import user_split

        user_split(cfg)
