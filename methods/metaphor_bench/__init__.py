"""`icml metaphor-bench`: MetaphorVU-Bench harness + MetaphorBoost KG-augmented inference (ICML 2026, arXiv 2605.25461).

The official protocol (frame sampling, prompts, answer parsing with retries, judge prompt, aggregation
with correct per-type scores), MetaphorBoost retrieval over a KG in the official schema, and a
procedural metaphor-video benchmark with held-out element→idea mappings, a synthetic KG and a tiny
MLLM trained from scratch; local HF image-text models, encoders and judges plug in by path.
"""
from icml.cli.method import HIGHER, LOWER, Method

TYPE_METRICS = ["score_bl", "score_al", "score_cs", "score_ns", "score_cm", "score_am", "score_pn", "score_sn"]

METHOD = Method(
    name="metaphor-bench",
    package=__name__,
    title="MetaphorVU: Towards Metaphorical Video Understanding",
    arxiv="2605.25461",
    status="complete",  # diagnosed negative at this scale (README)
    result="not at this scale",
    summary="Metaphorical-video benchmark harness + MetaphorBoost KG retrieval, procedural benchmark with held-out mappings.",
    config="MetaphorBenchConfig",
    tags={"judge": "string", "model": "string", "kg": "string", "hops": "int64", "top_k": "int64",
          "query_mode": "string", "reference_mode": "string"},
    metrics={"overall": HIGHER, "overall_all": HIGHER, "strict_pct": HIGHER, **{m: HIGHER for m in TYPE_METRICS},
             "parse_fail_rate": LOWER, "judge_fail_rate": LOWER, "n_scored": None, "keyword_recall": HIGHER,
             "retrieval_node_acc": HIGHER, "reference_hit_rate": HIGHER, "ref_chars_mean": None,
             "ref_truncated_frac": None, "error_perception_frac": None, "error_mapping_frac": None,
             "mapping_acc_given_elements": HIGHER, "train_loss": LOWER, "val_loss": LOWER},
    variants="VARIANTS",
    extra_verbs=True,
    preset_times={"default": "≈ 6.6 min train+eval", "paper": "GPU-sized; not timed"},
)
