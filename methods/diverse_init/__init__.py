"""`icml diverse-init`: DivIn (arXiv 2606.02453) — a few unadjusted Langevin steps move the initial
noise towards the guidance-potential posterior N(z; 0, I)·exp(−τ‖x̂₀(z,c) − x̂₀(z,∅)‖²) before an
untouched CFG sampler; composable with CADS, interval guidance and particle guidance."""
from icml.cli.method import HIGHER, LOWER, Method

METHOD = Method(
    name="diverse-init",
    package=__name__,
    title="Initialization is Half the Battle: Generating Diverse Images from a Guidance Potential Posterior",
    arxiv="2606.02453",
    status="complete",  # both tiers over 3 pipeline seeds (README): digits gain shown, GMM not shown
    result="partly",
    summary="DivIn: Langevin-sample the initial noise from the guidance-potential posterior for diverse CFG samples.",
    config="DiverseInitConfig",
    tags={"tier": "string", "param": "string", "cfg_scale": "float64", "tau": "float64", "tau_frac": "float64", "eta": "float64",
          "k_steps": "int64", "traj": "string", "feature_space": "string", "n_per_class": "int64"},
    metrics={"vendi": HIGHER, "precision": HIGHER, "recall": HIGHER, "density": HIGHER, "coverage": HIGHER,
             "fid": LOWER, "inbatch_sim": LOWER, "cond_acc": HIGHER, "mode_coverage": HIGHER,
             "minority_mass": HIGHER, "gmm_precision": HIGHER, "u_before": LOWER, "u_after": LOWER,
             "z_norm_ratio": None, "force_ratio": None, "pull_noise_ratio": None,
             "grad_cos_exact": None, "nfe": None, "wall_s": LOWER, "loss": LOWER,
             "clf_acc": HIGHER, "tau_star": None},
    variants="VARIANTS",
    extra_verbs=True,
    preset_times={"smoke": "45 s train+eval+report", "default": "≈ 9 min train+eval"},
)
