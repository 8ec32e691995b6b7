"""`icml spectral-optim`: the BeyondMuon spectral family Ψ_p on momentum-SGD and Adam updates
(arXiv 2602.04669). Other methods import the optimizer from here:

    from icml.methods.spectral_optim.optim import SpectralOptimizer
    from icml.methods.spectral_optim.psi import psi
"""
from icml.cli.method import HIGHER, LOWER, Method

METHOD = Method(
    name="spectral-optim",
    package=__name__,
    title="Delving into Muon and Beyond: Deep Analysis and Extensions",
    arxiv="2602.04669",
    status="complete",
    result="reproduced",
    summary="Spectral transforms Ψ_p (Muon at p=0) on momentum-SGD and Adam updates, SVD-free.",
    config="SpectralOptimConfig",
    tags={"family": "string", "p": "float64", "lr": "float64", "lr_multiplier": "float64",
          "lr_vector": "float64", "kappa": "float64", "rows": "int64", "cols": "int64", "dtype": "string",
          "psi_method": "string", "damping": "string"},  # `method` is the core column naming the method
    metrics={"train_loss": LOWER, "val_loss": LOWER, "best_val_loss": LOWER, "lr_spread": LOWER,
             "diverged": LOWER, "family_best_spread": None, "psi_rel_error": LOWER,
             "psi_cond_exponent": None, "psi_sv_min": None, "psi_sv_max": None, "psi_ms": LOWER,
             "svd_ms": LOWER, "psi_speedup": HIGHER, "step_ms": LOWER, "optimizer_state_bytes": LOWER},
    variants="VARIANTS",
    preset_times={"smoke": "32 s train+eval+report", "default": "≈ 12 min train+eval",
                  "paper": "GPU-sized; not timed"},
)
