"""`icml reason-stop`: ASAG — stop a reasoning model when attention says further thinking won't help
(ICML 2026, arXiv 2606.15070): probe confidence and the change of windowed attention entropy at
action-transition points choose exit, logit injection, jump prompt or continue."""
from icml.cli.method import HIGHER, LOWER, Method

METHOD = Method(
    name="reason-stop",
    package=__name__,
    title="Stop When Further Reasoning Won't Help: Attention-State Adaptive Generation in Reasoning Models",
    arxiv="2606.15070",
    status="complete",  # diagnosed negative: the default shows no accuracy effect over 3 seeds (README)
    result="partly",
    summary="Early exit, logit injection and jump prompts from probe confidence and attention entropy (ASAG).",
    config="ReasonStopConfig",
    tags={"lam": "float64", "alpha": "float64", "max_jumps": "int64", "inject_weight": "float64", "window": "int64"},
    metrics={"train_loss": LOWER, "val_loss": LOWER, "accuracy": HIGHER, "mean_tokens": LOWER,
             "compression_rate": LOWER, "probe_overhead_tokens": LOWER, "total_tokens": LOWER,
             "mean_atp_count": None, "n_exit": None, "n_forced_exit": None, "n_inject": None, "n_jump": None,
             "n_continue": None, "delta_h_correct": None, "delta_h_wrong": None, "jump_repeat_fraction": None,
             "wall_time_s": LOWER},
    variants="VARIANTS",
    extra_verbs=True,
    preset_times={"default": "≈ 12 min train+eval, load 3–4", "paper": "GPU-sized; not timed"},
)
