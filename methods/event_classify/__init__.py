"""`icml event-classify`: SECNet — event clouds (t, x, y, p) grouped by learnable-axis FPS and kNN in
feature space, aggregated with learnable Fourier filters (arXiv 2412.20803). The event loaders and the
saccade simulator live in `icml.data.events`."""
from icml.cli.method import HIGHER, LOWER, Method

METHOD = Method(
    name="event-classify",
    package=__name__,
    title="Scalable Event Cloud Network for Event-based Classification",
    arxiv="2412.20803",
    status="complete",
    result="reproduced",
    summary="SECNet: event-cloud classification with D-FPS, EF-KNN and Fourier-domain aggregation.",
    config="EventClassifyConfig",
    tags={"dataset": "string", "n_points": "int64", "s1": "int64", "k": "int64", "d0": "int64",
          "windows": "int64", "sweep": "string", "stage": "int64", "axis": "string", "part": "string",
          "true_class": "string", "pred_class": "string", "budget": "string"},
    metrics={"window_acc": HIGHER, "sample_acc": HIGHER, "params": LOWER, "macs_total": LOWER,
             "macs_embed": LOWER, "macs_spatial_fa": LOWER, "macs_temporal_fa": LOWER, "macs_pool": LOWER,
             "macs_residual": LOWER, "macs_head": LOWER, "macs_temporal_scores": LOWER, "grouping_ops": LOWER, "params_temporal_fa": None,
             "latency_ms_b1": LOWER, "latency_ms_part": LOWER, "throughput_sps": HIGHER,
             "events_per_sample": None, "loss": LOWER, "train_acc": HIGHER, "val_window_acc": HIGHER,
             "learned_w": None, "confusion": None},
    variants="VARIANTS",
    preset_times={"smoke": "≈ 37 s train+eval+report", "default": "≈ 9.8 min train+eval"},
)
