"""Configuration of `icml fgad`: one dataclass, three presets, a one-line validator.

`--data PATH` sets `data` (a graph file); `data=sbm` (the default) is the seeded synthetic graph;
`check_inputs` loads a user graph before a run exists.
The `seeds` / `ablation_seeds` keys are the grid seeds of run seed 0; run seed s shifts them by
SEED_STRIDE·s (`job_seeds`), so `--seeds 0,1,2` trains three different grids.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from icml.cli.errors import UsageError

MAIN = ["mvfgad", "local_only", "fedavg_gcn", "fedavg_dominant", "central_mvfgad", "central_dominant"]
ABLATIONS = ["view_attr", "view_smooth", "view_signed", "euclidean", "partition_random", "partition_metis"]
VARIANTS = MAIN + ABLATIONS
SIGNED_NORMS = ("code", "symmetric")
GRAPH_SUFFIXES = (".mat", ".pt", ".npz", ".csv")
SEED_STRIDE = 1000  # run seed s → grid seeds `seeds` + 1000·s: disjoint grids for any seeds below 1000


@dataclass
class FgadConfig:
    data: str = "sbm"  # sbm | a graph file (.mat, .pt, .npz, edges .csv) or a folder with edges.csv+features.csv
    features: str | None = None  # the features CSV of an edge-list CSV (default: features.csv beside it)
    inject: bool | None = None  # inject the four anomaly groups; none: yes for sbm, no for files
    # synthetic graph (degree-corrected SBM)
    n_nodes: int = 2000
    blocks: int = 8
    deg_in: float = 9.0
    deg_out: float = 1.0
    n_features: int = 32
    feature_noise: float = 0.5
    theta_sigma: float = 0.5
    # injection
    anomaly_fraction: float = 0.0125
    m_strong: int = 15
    m_weak: int = 5
    p_drop_strong: float = 0.0
    p_drop_weak: float = 0.5
    k_strong: int = 50
    k_weak: int = 1
    # experiment grid
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    K: list[int] = field(default_factory=lambda: [1, 3, 10])
    seeds: list[int] = field(default_factory=lambda: [123, 124, 125])  # at run seed 0; see job_seeds
    ablation_K: int = 10
    ablation_seeds: list[int] = field(default_factory=lambda: [123])  # at run seed 0; see job_seeds
    split: list[float] = field(default_factory=lambda: [0.2, 0.4, 0.4])  # train/val/test per client
    # models
    hidden: int = 64
    out_dim: int = 32
    dropout: float = 0.5
    lr: float = 1e-3
    weight_decay: float = 5e-4
    rounds: int = 50  # stage 1 FedAvg rounds
    local_epochs: int = 3  # Adam epochs per client per round
    epochs: int = 200  # stage 2 local epochs
    tau: float = 0.9  # cosine threshold of U
    alpha: float = 0.5  # A′ = αA + (1−α)U
    beta: float = 0.5  # R = βU + (1−β)cos(E)
    signed_norm: str = "code"  # code | symmetric
    workers: int = 2  # independent jobs in parallel, one single-threaded process each
    max_client_nodes: int = 20000  # warn above: dense N_k×N_k matrices


def preset(name: str) -> FgadConfig:
    cfg = FgadConfig()
    if name == "smoke":
        cfg.n_nodes = 600
        cfg.K = [3]
        cfg.ablation_K = 3
        cfg.seeds = [123]
        cfg.rounds = 5
        cfg.local_epochs = 1
        cfg.epochs = 20
        cfg.workers = 1
    elif name == "paper":  # user .mat files (reddit, Tolokers, …) through --data; lr 5e-3 for Tolokers/Elliptic
        cfg.K = [10]
        cfg.rounds = 100
        cfg.workers = 1
    return cfg


def job_seeds(seeds: list[int], run_seed: int) -> list[int]:
    """The grid seeds one run trains: graph, injection, partition, splits and torch init follow them."""
    return [s + SEED_STRIDE * run_seed for s in seeds]


def edge_list_csv(data: str) -> Path | None:
    """The edge-list CSV a `data` value names (a .csv file or a folder's edges.csv), else None."""
    path = Path(data)
    if path.is_dir():
        return path / "edges.csv"
    return path if path.suffix.lower() == ".csv" else None


def check_integer_node_ids(edges_csv: Path) -> None:
    """Refuse src/dst values that are not integers before a run exists: pandas reads 1.5 as a float and
    the loader's int64 cast would silently truncate it to node 1."""
    import numpy as np
    import pandas as pd

    try:
        ids = pd.read_csv(edges_csv, usecols=lambda c: c in ("src", "dst"))
    except Exception:  # noqa: BLE001 - an unreadable file is the loader's one-line error, later
        return
    for column in ids.columns:
        values = ids[column]
        if pd.api.types.is_float_dtype(values):
            bad = values[~(np.isfinite(values) & (values == np.round(values)))]
            if len(bad):
                raise UsageError(f"'{edges_csv}' column {column} holds a non-integer node id {bad.iloc[0]} "
                                 f"(data row {bad.index[0] + 1})", "write node ids as integers 0…N−1")


def check_inputs(cfg: FgadConfig) -> None:
    """Before a run exists: a user graph loads as train will load it (a malformed file is one line, exit 2,
    and leaves no failed run), and an edge CSV holds integer node ids."""
    if cfg.data == "sbm":
        return
    from icml.data.graphs import GraphFormatError, load_graph

    edges_csv = edge_list_csv(cfg.data)
    if edges_csv is not None and edges_csv.is_file():
        check_integer_node_ids(edges_csv)
    try:
        load_graph(cfg.data, cfg.features)
    except GraphFormatError as exc:
        raise UsageError(str(exc), "see `icml fgad train --help` and the fgad README for the graph formats") from None


def validate(cfg: FgadConfig) -> None:
    unknown = [v for v in cfg.variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; valid: {', '.join(VARIANTS)}")
    if cfg.data != "sbm":
        path = Path(cfg.data)
        if not path.exists():
            raise ValueError(f"data '{cfg.data}' does not exist (use data=sbm or a graph file)")
        if path.is_file() and path.suffix.lower() not in GRAPH_SUFFIXES:
            raise ValueError(f"data '{cfg.data}' has an unknown format; use one of {', '.join(GRAPH_SUFFIXES)}")
    if cfg.signed_norm not in SIGNED_NORMS:
        raise ValueError(f"signed_norm must be one of {', '.join(SIGNED_NORMS)}, not '{cfg.signed_norm}'")
    if not cfg.K or any(k < 1 for k in cfg.K) or cfg.ablation_K < 1:
        raise ValueError(f"K must be a non-empty list of client counts >= 1, not {cfg.K}")
    if not cfg.seeds:
        raise ValueError("seeds must be a non-empty list of integers")
    if len(cfg.split) != 3 or any(s <= 0 for s in cfg.split) or abs(sum(cfg.split) - 1) > 1e-6:
        raise ValueError(f"split must be three positive fractions summing to 1, not {cfg.split}")
    for key in ("n_nodes", "blocks", "n_features", "m_strong", "m_weak", "k_strong", "k_weak", "hidden", "out_dim",
                "rounds", "local_epochs", "epochs", "workers"):
        if getattr(cfg, key) < 1:
            raise ValueError(f"{key} must be positive, not {getattr(cfg, key)}")
    for key in ("alpha", "beta", "dropout", "p_drop_strong", "p_drop_weak"):
        if not 0 <= getattr(cfg, key) <= 1:
            raise ValueError(f"{key} must be in [0, 1], not {getattr(cfg, key)}")
    if not 0 < cfg.anomaly_fraction < 0.25:
        raise ValueError(f"anomaly_fraction must be in (0, 0.25), not {cfg.anomaly_fraction}")
    if cfg.tau < -1:  # τ ≥ 1 leaves U empty: the documented way to switch the similarity graph off
        raise ValueError(f"tau is a cosine threshold (>= -1; above 1 switches U off), not {cfg.tau}")
    if cfg.data == "sbm" and cfg.n_nodes < 8 * cfg.blocks:
        raise ValueError(f"n_nodes ({cfg.n_nodes}) is too small for {cfg.blocks} blocks")
