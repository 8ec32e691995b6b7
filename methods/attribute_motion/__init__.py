"""`icml attribute-motion`: Motive — motion-centric data attribution for video generation
(arXiv 2601.08828): motion-masked flow-matching gradients at one shared (t*, ε*), a Fastfood
projection, cosine influence, majority-vote selection and equal-budget fine-tuning."""
from icml.cli.method import HIGHER, LOWER, Method

METHOD = Method(
    name="attribute-motion",
    package=__name__,
    title="Motion Attribution for Video Generation",
    arxiv="2601.08828",
    status="complete",
    result="partly",
    summary="Motive: motion-masked gradient attribution (Fastfood JL) selects clips that teach a video model a motion.",
    config="AttributeMotionConfig",
    tags={"target_motion": "string", "budget_frac": "float64", "k": "int64", "proj": "string", "dim": "int64",
          "length_norm": "string", "agg": "string", "attr_seed": "int64", "mask": "string"},
    metrics={"p_at_k": HIGHER, "ap": HIGHER, "appearance_outrank_rate": LOWER, "pan_outrank_rate": LOWER,
             "decoy_rate": LOWER,
             "length_spearman": None, "seed_spearman": HIGHER, "proj_cos_err": LOWER, "dynamic_degree": HIGHER,
             "top_flow_px": HIGHER,
             "motion_smoothness": HIGHER, "subject_consistency": HIGHER, "target_motion_acc": HIGHER,
             "win_rate_vs_base": HIGHER, "fm_loss_heldout": LOWER, "featurize_s_per_clip": LOWER,
             "finetune_s": LOWER, "loss": LOWER, "evaluator_acc": HIGHER},
    variants=lambda config: (*config.SELECTORS, "base"),
    extra_verbs=True,
    preset_times={"smoke": "47 s train+eval+report", "default": "≈ 2.4 min train + ≈ 7 min eval"},
)
