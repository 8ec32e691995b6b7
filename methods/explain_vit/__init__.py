"""`icml explain-vit`: DAVE — pixel-level attributions for Vision Transformers from the effective input–output
map (ICML 2026, arXiv 2602.06613): the effective-transformation pass (attention, GELU and LayerNorm linearised),
Reynolds averaging over local warps, a noise schedule, MAD aggregation and post-processing, against the
standard attribution baselines with localisation, faithfulness, stability and lattice-artefact metrics."""
from icml.cli.method import HIGHER, LOWER, Method

METHOD = Method(
    name="explain-vit",
    package=__name__,
    title="DAVE: Distribution-aware Attribution via ViT Gradient Decomposition",
    arxiv="2602.06613",
    status="complete",  # montage metrics unmeasured at default: the toy ViT is confident on one class (README)
    result="partly",
    summary="DAVE attribution for ViTs: effective-gradient decomposition, equivariance averaging, low-pass stabilisation.",
    config="ExplainVitConfig",
    tags={"model": "string", "n_samples": "int64", "alpha_max": "float64", "input": "string",
          "direction": "string", "fill": "string", "shift_px": "int64", "class_name": "string"},
    metrics={"grid_pg": HIGHER, "energy_pg": HIGHER, "pointing_game": HIGHER, "pixel_auroc": HIGHER,
             "deletion_lerf_auc": HIGHER, "deletion_morf_auc": LOWER, "insertion_auc": HIGHER,
             "stability_noise": HIGHER, "stability_shift": HIGHER, "lattice_energy": LOWER,
             "lattice_grad_ratio": LOWER, "class_sensitivity": LOWER, "completeness_gap": LOWER,
             "opvar_ratio": None, "wall_s_per_image": LOWER, "n_backward": LOWER, "loss": LOWER,
             "accuracy": HIGHER, "n_confident": HIGHER, "n_montages": HIGHER},
    variants="ARMS",
    extra_verbs=True,
    presets=("real",),
    preset_times={"smoke": "37 s train+eval+report", "default": "≈ 7 min train+eval (one core)",
                  "real": "≈ 7.7 min train + 4.5 min eval (one core's CPU time)"},
)
