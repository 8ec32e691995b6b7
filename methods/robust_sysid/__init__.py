"""`icml robust-sysid`: input-output learning of a nonlinear system with memory under sparse adversarial
attacks — the non-squared ℓ₂-norm estimator against least squares, error vs memory length
(Kim, Fang & Lavaei, arXiv 2505.11688)."""
from icml.cli.method import LOWER, Method

METHOD = Method(
    name="robust-sysid",
    package=__name__,
    title="On the Sharp Input-Output Analysis of Nonlinear Systems under Adversarial Attacks",
    arxiv="2505.11688",
    status="complete",
    result="reproduced",
    summary="Non-squared ℓ₂ (sum of row norms) vs least squares for input-output maps under sparse attacks.",
    config="RobustSysidConfig",
    tags={"experiment": "string", "p": "int64", "q": "float64", "T": "int64", "attack": "string",
          "attack_on": "string", "input": "string", "noise": "float64", "system_seed": "int64"},
    metrics={"param_error": LOWER, "param_error_rel": LOWER, "objective": LOWER, "objective_gap_truth": LOWER,
             "objective_gap_ls": LOWER, "subgrad_norm": LOWER, "optimality_residual_rel": LOWER, "truncation_norm": None, "decay_rate": None,
             "attack_rate": None, "pred_error": LOWER, "irls_iters": LOWER, "fit_seconds": LOWER},
    variants="VARIANTS",
    preset_times={},  # every timing in its README was taken at load 18–25
)
