"""`icml kv-compress`: EntroKV — entropy-guided per-head KV-cache budgets (ICML 2026,
OpenReview xhAMjsnWUe), with SnapKV / H2O / StreamingLLM eviction into a ragged compressed cache
and the PyramidKV / Ada-KV allocation baselines."""
from icml.cli.method import HIGHER, LOWER, Method

METHOD = Method(
    name="kv-compress",
    package=__name__,
    title="EntroKV: Entropy-Guided Dynamic Budget Allocation for KV-Cache Compression",
    arxiv="OpenReview xhAMjsnWUe (no arXiv id)",
    status="complete",
    result="not at this scale",
    summary="Per-head KV-cache budgets from normalised attention entropy; SnapKV/H2O/StreamingLLM eviction.",
    config="KvCompressConfig",
    tags={"task": "string", "ratio": "float64", "window": "int64", "alpha": "float64", "scope": "string",
          "operator": "string", "question_aware": "int64"},
    metrics={"exact_match": HIGHER, "retention": HIGHER, "answer_nll": LOWER, "kl_to_full": LOWER,
             "kept_entries": None, "kept_fraction": None, "memory_bytes": LOWER, "overhead_ms": LOWER,
             "budget_cv": None, "mean_entropy": None, "em_diff_ci_low": None, "em_diff_ci_high": None,
             "token_f1": HIGHER, "token_f1_diff_ci_low": None, "token_f1_diff_ci_high": None,
             "alloc_corr_retrieval_aggregation": None, "alloc_corr_retrieval_needle": None,
             "alloc_corr_needle_aggregation": None, "train_loss": LOWER, "val_loss": LOWER,
             "val_exact_match": HIGHER, "item_recall": HIGHER, "decode_ms": LOWER, "new_tokens": None,
             "prefill_ms": LOWER},
    variants="VARIANTS",
    extra_verbs=True,
    presets=("real",),
    preset_times={"smoke": "≈ 29 s train+eval+report", "default": "≈ 11.5 min train+eval",
                  "paper": "GPU-sized; not timed",
                  "real": "≈ 3 min train (H̄) + ≈ 3.6 h eval on one thread, resumable: re-run eval"},
)
