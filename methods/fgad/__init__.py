"""`icml fgad`: MV-FGAD federated graph anomaly detection (ICML 2026, OpenReview yBcY0bY45t).

Stage 1 trains a small GCN with FedAvg (the only thing communicated); stage 2 lets every client
repair its topology with the global embeddings and train a private three-view detector scored by
fused pseudo-inverse Mahalanobis distances. Graph loaders and the SBM injector live in icml.data.graphs.
"""
from icml.cli.method import HIGHER, LOWER, Method

METHOD = Method(
    name="fgad",
    package=__name__,
    title="MV-FGAD: Towards Efficient and Effective Federated Graph Anomaly Detection via Multi-view Learning",
    arxiv="none (OpenReview yBcY0bY45t)",
    status="complete",
    result="partly",
    summary="Federated graph anomaly detection: FedAvg GCN + private three-view Mahalanobis detectors.",
    config="FgadConfig",
    tags={"K": "int64", "group": "string", "agg": "string", "partition": "string", "dataset": "string",
          "inject_id": "string", "stage": "string"},
    metrics={"auroc": HIGHER, "ap": HIGHER, "recall_at_k": HIGHER, "val_auroc": HIGHER,
             "comm_bytes_per_round": LOWER, "comm_bytes_total": LOWER, "params_shared": None,
             "params_private": None, "wall_s": LOWER, "cut_edge_frac": None, "u_density": None, "loss": LOWER,
             "moved_nodes": None},
    variants="VARIANTS",
    preset_times={"smoke": "≈ 20 s train", "default": "≈ 7 min train+eval", "paper": "GPU-sized; not timed"},
)
