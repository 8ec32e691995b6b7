"""`icml single-index`: joint learning of direction and link in the Gaussian single-index model
(Pillaud-Vivien & Schertzer, arXiv 2505.21336).

The population flow in (Hermite coefficients, overlap) coordinates — joint vs planted, escape times
against d for several information exponents, the planted trap and the passive mode — and the
finite-sample RKHS alternating estimator (Mehler-kernel ridge φ-step, spherical w-step) against
planted-φ, SAVE, SIR and fixed-w baselines.
"""
from icml.cli.method import HIGHER, LOWER, Method

METHOD = Method(
    name="single-index",
    package=__name__,
    title="Joint Learning in the Gaussian Single Index Model",
    arxiv="2505.21336",
    status="complete",
    result="reproduced",
    summary="Hermite-coordinate ODE (joint vs planted, escape ~ d^(s−1), the trap) and the RKHS alternating estimator.",
    config="SingleIndexConfig",
    tags={"solver": "string", "experiment": "string", "target": "string", "info_exp": "int64", "d": "int64",
          "m0": "float64", "sign": "int64", "n": "int64", "K": "int64", "rho": "float64", "eta": "float64"},
    metrics={"overlap": None, "overlap_abs": HIGHER, "risk": LOWER, "escape_time": LOWER, "escape_slope": None,
             "final_overlap": None, "final_risk": LOWER, "train_mse": LOWER, "test_mse": LOWER,
             "coef_error": LOWER},
    variants="VARIANTS",
    preset_times={"paper": "≈ 25 CPU-min (estimate; not run)"},
)
