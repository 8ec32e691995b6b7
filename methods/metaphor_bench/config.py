"""Configuration of `icml metaphor-bench`: one dataclass, three presets, a one-line validator.

`bench=None` generates the procedural benchmark into the run; `bench=DIR` reads the official layout
(datas.jsonl + videos/, or the raw test.jsonl + videos_deface/). No torch here: help imports it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

VARIANTS = ["no_kg", "kg_h1", "kg_h2", "random_kg", "oracle_kg", "kg_k0"]
JUDGES = ("rule", "llm")
QUERY_MODES = ("keywords", "descriptions")
REFERENCE_MODES = ("simple", "examples")
# config.json model_types model= takes: hf.py drives them through AutoModelForImageTextToText and their
# processor's chat template (the text, then one image per frame); each is tested on a tiny random checkpoint
SUPPORTED_FAMILIES = ("llava", "qwen2_vl", "qwen2_5_vl")
TYPES = {"bl": "Body_Language", "al": "Atmosphere_Language", "cs": "Cultural_Symbol",
         "ns": "Naturalistic_Symbol", "cm": "Causal_Montage", "am": "Analogical_Montage",
         "pn": "Performative_Narrative", "sn": "Surreal_Narrative"}


@dataclass
class MetaphorBenchConfig:
    bench: str | None = None  # official-layout folder; none: the procedural benchmark, generated per run
    kg_json: str | None = None  # metaphor_graph.json (official schema); none: the synthetic KG
    kg_emb: str | None = None  # metaphor_graph_embedding_word.pt, row i = node "i"
    embed_model: str | None = None  # local HF encoder (mean-pooled); none: char-3-gram hashing
    model: str | None = None  # local image-text checkpoint (llava, qwen2_vl, qwen2_5_vl); none: the tiny MLLM
    judge_model: str | None = None  # local HF causal LM for judge=llm
    judge: str = "rule"
    prompts: str | None = None  # a checkout of the official MetaphorVU repo (or a JSON file); none: ours (README)
    # procedural benchmark
    n_train: int = 2000
    n_test_heldout: int = 200
    n_test_seen: int = 200
    heldout_frac: float = 0.3  # share of (element, idea) pairs held out of training
    n_frames: int = 8
    frame_size: int = 96
    embed_dim: int = 4096  # char-3-gram hashing dimension
    # tiny MLLM
    d_model: int = 128
    n_layer: int = 2
    n_head: int = 4
    steps: int = 1500
    batch_size: int = 32
    lr: float = 2e-3
    random_kg_frac: float = 0.2  # share of reference-conditioned training examples with random-KG references
    val_frac: float = 0.1
    # protocol (official defaults)
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    top_k: int = 10
    query_mode: str = "keywords"
    reference_mode: str = "simple"
    max_images: int = 50
    qa_attempts: int = 8
    final_attempts: int = 5
    judge_attempts: int = 5
    max_new_tokens: int = 1024  # HF models; the tiny MLLM stops at its end token
    eval_items: int | None = None  # cap per split (none: all)


def preset(name: str) -> MetaphorBenchConfig:
    cfg = MetaphorBenchConfig()
    if name == "smoke":
        cfg.n_train, cfg.n_test_heldout, cfg.n_test_seen = 48, 8, 8
        cfg.steps, cfg.batch_size = 100, 16
        cfg.embed_dim = 1024
    elif name == "paper":  # GPU: official benchmark, KG, a local MLLM, embedder and judge through --set
        cfg.judge = "llm"
    return cfg


def validate(cfg: MetaphorBenchConfig) -> None:
    from pathlib import Path

    unknown = [v for v in cfg.variants if v not in VARIANTS]
    if unknown or not cfg.variants:
        raise ValueError(f"unknown or no variant(s) {unknown}; valid: {', '.join(VARIANTS)}")
    if cfg.judge not in JUDGES:
        raise ValueError(f"judge must be one of {', '.join(JUDGES)}, not '{cfg.judge}'")
    if cfg.judge == "llm" and not cfg.judge_model:
        raise ValueError("judge=llm needs judge_model=PATH (a local HF causal LM)")
    if cfg.query_mode not in QUERY_MODES:
        raise ValueError(f"query_mode must be one of {', '.join(QUERY_MODES)}, not '{cfg.query_mode}'")
    if cfg.query_mode == "descriptions" and not cfg.model:
        raise ValueError("query_mode=descriptions needs model=PATH: the tiny MLLM is trained on keyword extraction only")
    if cfg.reference_mode not in REFERENCE_MODES:
        raise ValueError(f"reference_mode must be one of {', '.join(REFERENCE_MODES)}, not '{cfg.reference_mode}'")
    for key in ("bench", "kg_json", "kg_emb", "embed_model", "model", "judge_model", "prompts"):
        value = getattr(cfg, key)
        if value and not Path(value).exists():
            raise ValueError(f"{key} '{value}' does not exist; pass an existing path or leave it unset")
    if cfg.prompts:  # read and check the slots now: one line before anything runs
        from icml.methods.metaphor_bench import protocol

        protocol.prompts(cfg.prompts)
    if bool(cfg.kg_json) != bool(cfg.kg_emb):
        raise ValueError("kg_json and kg_emb go together (the graph and its node-embedding matrix)")
    if cfg.bench:
        generated = (Path(cfg.bench) / "train" / "datas.jsonl").exists()  # the layout `generate` writes
        test_root = Path(cfg.bench) / "test" if generated else Path(cfg.bench)
        if not generated and not cfg.model:
            raise ValueError("bench= (the official benchmark) needs model=PATH: the tiny MLLM knows only the "
                             "procedural vocabulary (or pass a folder written by `icml metaphor-bench generate`)")
        kg_arms = [v for v in cfg.variants if v in ("kg_h1", "kg_h2", "random_kg")]
        if kg_arms and not cfg.kg_json and not (Path(cfg.bench) / "kg" / "metaphor_graph.json").exists():
            raise ValueError(f"the arms {kg_arms} need a KG: pass kg_json=… kg_emb=… (the official KG files)")
        if "oracle_kg" in cfg.variants and not generated:
            raise ValueError("oracle_kg needs the procedural gold ids; drop it from variants for the official benchmark")
        if cfg.judge == "rule" and not (test_root / "gold_ids.jsonl").exists():
            raise ValueError(f"judge=rule needs {test_root / 'gold_ids.jsonl'} (procedural benchmarks only); "
                             "use judge=llm judge_model=PATH")
    for key in ("n_train", "n_test_heldout", "n_test_seen", "n_frames", "frame_size", "embed_dim", "d_model",
                "n_layer", "n_head", "steps", "batch_size", "max_images", "qa_attempts", "final_attempts",
                "judge_attempts", "max_new_tokens"):
        if getattr(cfg, key) < 1:
            raise ValueError(f"{key} must be positive, not {getattr(cfg, key)}")
    if cfg.top_k < 0:
        raise ValueError(f"top_k must be >= 0, not {cfg.top_k}")
    if cfg.d_model % cfg.n_head:
        raise ValueError(f"d_model ({cfg.d_model}) must be divisible by n_head ({cfg.n_head})")
    for key in ("heldout_frac", "random_kg_frac", "val_frac"):
        if not 0 <= getattr(cfg, key) < 1:
            raise ValueError(f"{key} must be in [0, 1), not {getattr(cfg, key)}")
    if cfg.frame_size < 32:
        raise ValueError(f"frame_size must be >= 32 (the CNN downsamples 8x), not {cfg.frame_size}")
    if cfg.lr <= 0:
        raise ValueError(f"lr must be positive, not {cfg.lr}")
    if cfg.eval_items is not None and cfg.eval_items < 1:
        raise ValueError(f"eval_items must be positive or none, not {cfg.eval_items}")


def check_inputs(cfg: MetaphorBenchConfig) -> None:
    """Before a run exists (train does nothing with model=, so a bad one used to pass it and fail in eval):
    model= is a checkpoint of a family hf.py drives, with whole weights, a tokenizer and an image
    processor; headers only."""
    if cfg.model:
        from icml.cli import checkpoints
        from icml.cli.errors import UsageError

        ckpt = checkpoints.check(cfg.model, SUPPORTED_FAMILIES, "metaphor-bench")
        if not _has_image_processor(ckpt.directory):
            raise UsageError(f"--model '{cfg.model}' has no image processor (preprocessor_config.json, or "
                             "image_processor in processor_config.json)",
                             "save the processor into the same directory (processor.save_pretrained(dir))")


def _has_image_processor(folder) -> bool:
    import json

    if (folder / "preprocessor_config.json").is_file():
        return True
    try:  # transformers 5 writes the image processor's settings into processor_config.json
        return "image_processor" in json.loads((folder / "processor_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return False
