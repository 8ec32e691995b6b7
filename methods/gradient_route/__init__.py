"""`icml gradient-route`: GRAM modular pretraining for access control (ICML 2026, no arXiv id).

Every block's MLP gets one small auxiliary module per labelled domain; gradient routing sends each
domain's updates into its module during pretraining, and a capability profile is served by deleting
the other modules. Compared with data filtering (one model per profile), MaxEnt unlearning and a
relearning attack, in compute ratios fit to the dense baseline's curves.
"""
from icml.cli.method import HIGHER, LOWER, Method

METHOD = Method(
    name="gradient-route",
    package=__name__,
    title="Modular Pretraining Enables Access Control",
    arxiv="none (ICML 2026 poster 60631)",
    status="complete",
    result="reproduced",
    summary="GRAM: route each domain's gradients into a removable MLP module; serve profiles by deleting modules.",
    config="GradientRouteConfig",
    tags={"profile": "string", "dataset": "string", "role": "string", "weight": "float64"},
    metrics={"val_loss": None, "cr": None, "core_cr": HIGHER, "retain_cr": HIGHER, "forget_cr": LOWER,
             "elicited_cr": LOWER, "elicited_loss": HIGHER, "elicit_gain_cr": LOWER, "titration_cr": None,
             "train_flops_ratio": LOWER, "serve_params_ratio": LOWER, "routing_freq": None, "compute_lambda": None,
             "fit_alpha": None, "fit_a": None, "fit_s0": None, "fit_rmse": LOWER, "train_loss": LOWER,
             "wall_s": LOWER, "maxent_lambda": None, "maxent_select_cr": None, "maxent_select_score": LOWER},
    variants="VARIANTS",
    extra_verbs=True,
    preset_times={"default": "≈ 9.6 min train+eval", "paper": "GPU-sized; not timed"},
)
