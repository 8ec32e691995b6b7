"""Attributed graphs for graph methods: a degree-corrected SBM, a PyGOD-style anomaly injector
and loaders for user files, all returning a torch-geometric `Data`.

Every graph comes back undirected, without self-loops or duplicate edges, as
`Data(x: float32 [N, F], edge_index: int64 [2, E] (both directions), y: int64 {0,1} [N],
group: int64 [N])` plus `group_names` (code 0 is "normal"). Generated graphs also carry
`community` (the SBM block of each node).

Loaders (no downloads), chosen by the file's suffix:
- `.mat`: `Attributes`/`Network`/`Label` or `X`/`A`/`gnd` (scipy.io.loadmat, sparse aware; MATLAB
  v7.3 files through h5py);
- `.pt`: a saved torch-geometric `Data` with `x`, `edge_index`, `y`;
- `.npz`: `x`, `y` and `edge_index` [2, E] or a CSR adjacency `indptr`/`indices`;
- `.csv`: an edge list (`src,dst`) with a features CSV (`node_id, f0, f1, …, y` and optionally
  `atype`, `strength`), or a folder holding `edges.csv` and `features.csv`.
A malformed file raises `GraphFormatError` with one line naming the file and what is wrong.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

GROUPS = ("str_strong", "str_weak", "ctx_strong", "ctx_weak")


class GraphFormatError(ValueError):
    """A graph file that cannot be used; the message names the file and the problem."""


# assembling a Data ------------------------------------------------------------------------------
def undirected_edges(src: np.ndarray, dst: np.ndarray, n: int) -> np.ndarray:
    """[2, E] int64 with both directions, no self-loops, no duplicates, sorted."""
    src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    keep = src != dst
    lo, hi = np.minimum(src[keep], dst[keep]), np.maximum(src[keep], dst[keep])
    pairs = np.unique(lo * n + hi)
    lo, hi = pairs // n, pairs % n
    edges = np.stack([np.concatenate([lo, hi]), np.concatenate([hi, lo])])
    order = np.lexsort((edges[1], edges[0]))
    return edges[:, order]


def make_data(x: np.ndarray, edge_index: np.ndarray, y: np.ndarray, group: np.ndarray | None = None,
              group_names: tuple[str, ...] = ("normal",), **extra):
    import torch
    from torch_geometric.data import Data

    n = x.shape[0]
    if group is None:  # organic labels only: one anomaly group
        group, group_names = np.where(np.asarray(y) > 0, 1, 0), ("normal", "anomaly")
    data = Data(x=torch.as_tensor(np.asarray(x, dtype=np.float32)),
                edge_index=torch.as_tensor(np.asarray(edge_index, dtype=np.int64)),
                y=torch.as_tensor(np.asarray(y, dtype=np.int64)), group=torch.as_tensor(group, dtype=torch.long),
                num_nodes=n)
    data.group_names = list(group_names)
    for key, value in extra.items():
        data[key] = torch.as_tensor(value)
    return data


# degree-corrected SBM -----------------------------------------------------------------------------
def dc_sbm(n: int, blocks: int, deg_in: float, deg_out: float, n_features: int, feature_noise: float,
           theta_sigma: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x [N, F], edge_index [2, E], community [N]) of a degree-corrected SBM with equal blocks.

    p_in = deg_in/(N/C − 1), p_out = deg_out/(N − N/C); θ ~ LogNormal(0, σ) normalised to mean 1
    per block; P(edge ij) = min(1, θ_i θ_j p); x_i = μ_{c(i)} + noise·ε with μ_c ~ N(0, I).
    """
    community = np.repeat(np.arange(blocks), int(np.ceil(n / blocks)))[:n]
    size = n / blocks
    p_in, p_out = deg_in / (size - 1), deg_out / (n - size)
    theta = rng.lognormal(0.0, theta_sigma, n)
    for c in range(blocks):
        theta[community == c] /= theta[community == c].mean()
    same = community[:, None] == community[None, :]
    prob = np.minimum(1.0, np.outer(theta, theta) * np.where(same, p_in, p_out))
    upper = np.triu(rng.random((n, n)) < prob, k=1)
    src, dst = np.nonzero(upper)
    means = rng.standard_normal((blocks, n_features))
    x = means[community] + feature_noise * rng.standard_normal((n, n_features))
    return x.astype(np.float32), undirected_edges(src, dst, n), community


# anomaly injection --------------------------------------------------------------------------------
@dataclass
class InjectionParams:
    """Every knob of the injector; its hash is the run's `inject_id`."""

    fraction: float = 0.0125  # share of N per group
    m_strong: int = 15  # clique size of str_strong
    m_weak: int = 5  # clique size of str_weak
    p_drop_strong: float = 0.0
    p_drop_weak: float = 0.5
    k_strong: int = 50  # candidates for ctx_strong (the farthest is copied)
    k_weak: int = 1  # ctx_weak: one random node of another community
    seed: int = 0

    def group_size(self, n: int) -> int:
        return max(1, round(self.fraction * n))

    def n_cliques(self, n: int, m: int) -> int:
        return max(1, round(self.fraction * n / m))

    def inject_id(self) -> str:
        return hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]


def inject_anomalies(x: np.ndarray, edge_index: np.ndarray, community: np.ndarray, params: InjectionParams,
                     eligible: np.ndarray | None = None):
    """Four disjoint anomaly groups (structural/contextual × strong/weak) drawn from `eligible` nodes.

    Returns (x′, edge_index′, group codes [N] with 0 = normal and i+1 = GROUPS[i], rows) where rows
    are dicts for `injection.parquet`, one per anomalous node.
    """
    rng = np.random.default_rng(params.seed)
    n = x.shape[0]
    free = np.ones(n, dtype=bool) if eligible is None else eligible.copy()
    group = np.zeros(n, dtype=np.int64)
    rows: list[dict] = []
    new_src, new_dst = [], []

    def row(node, name, **kw):
        atype, strength = name.split("_")
        rows.append({"node_id": int(node), "group": name, "atype": atype, "strength": strength,
                     "clique_id": -1, "source_node": -1, "m": 0, "p_drop": 0.0, "k": 0, "group_size": 0, **kw})

    def add_cliques(name, m, p_drop, one_community):
        n_cliques = params.n_cliques(n, m)
        for clique in range(n_cliques):
            if one_community:  # camouflage: all members from one community with room for them
                counts = np.bincount(community[free], minlength=community.max() + 1)
                options = np.flatnonzero(counts >= m)
                if options.size == 0:
                    raise ValueError(f"no community has {m} free nodes for a {name} clique")
                pool = np.flatnonzero(free & (community == rng.choice(options)))
            else:
                pool = np.flatnonzero(free)
            members = np.sort(rng.choice(pool, m, replace=False))
            free[members] = False
            group[members] = GROUPS.index(name) + 1
            pairs = np.array([(a, b) for i, a in enumerate(members) for b in members[i + 1:]])
            n_drop = int(round(p_drop * len(pairs)))
            kept = pairs[np.sort(rng.permutation(len(pairs))[n_drop:])]
            new_src.append(kept[:, 0])
            new_dst.append(kept[:, 1])
            for node in members:
                row(node, name, clique_id=clique, m=m, p_drop=p_drop, group_size=n_cliques * m)

    add_cliques("str_strong", params.m_strong, params.p_drop_strong, one_community=False)
    add_cliques("str_weak", params.m_weak, params.p_drop_weak, one_community=True)

    x_new = x.copy()
    size = params.group_size(n)
    for name, k in (("ctx_strong", params.k_strong), ("ctx_weak", params.k_weak)):
        nodes = np.sort(rng.choice(np.flatnonzero(free), size, replace=False))
        free[nodes] = False
        group[nodes] = GROUPS.index(name) + 1
        for node in nodes:
            if name == "ctx_strong":  # PyGOD: the farthest of k candidates, in the original features
                others = np.delete(np.arange(n), node)
                candidates = rng.choice(others, k, replace=False)
                source = candidates[np.argmax(np.linalg.norm(x[candidates] - x[node], axis=1))]
            else:  # in-distribution globally, inconsistent with its neighbourhood
                source = rng.choice(np.flatnonzero(community != community[node]))
            x_new[node] = x[source]
            row(node, name, source_node=int(source), k=k, group_size=size)

    src = np.concatenate([edge_index[0], *new_src])
    dst = np.concatenate([edge_index[1], *new_dst])
    return x_new, undirected_edges(src, dst, n), group, rows


def synthetic_graph(n: int, blocks: int, deg_in: float, deg_out: float, n_features: int, feature_noise: float,
                    theta_sigma: float, params: InjectionParams | None):
    """A DC-SBM graph (seeded by params.seed, or 0), with the four injected groups unless params is None."""
    rng = np.random.default_rng(params.seed if params else 0)
    x, edges, community = dc_sbm(n, blocks, deg_in, deg_out, n_features, feature_noise, theta_sigma, rng)
    if params is None:
        return make_data(x, edges, np.zeros(n), np.zeros(n, dtype=np.int64), ("normal",), community=community), []
    x, edges, group, rows = inject_anomalies(x, edges, community, params)
    return make_data(x, edges, (group > 0).astype(np.int64), group, ("normal", *GROUPS), community=community), rows


def inject_into(data, params: InjectionParams, community: np.ndarray):
    """Inject the four groups into a loaded graph (organic anomalies keep their own group)."""
    organic = data.y.numpy() > 0
    x_new, edges, group, rows = inject_anomalies(data.x.numpy(), data.edge_index.numpy(), community, params,
                                                 eligible=~organic)
    names = ("normal", *GROUPS, "organic")
    group = np.where(organic, len(names) - 1, group)
    return make_data(x_new, edges, (group > 0).astype(np.int64), group, names), rows


# loaders ---------------------------------------------------------------------------------------------
def _fail(path: Path, problem: str) -> GraphFormatError:
    return GraphFormatError(f"graph file '{path}': {problem}")


def _dense(value) -> np.ndarray:
    import scipy.sparse as sp

    return value.toarray() if sp.issparse(value) else np.asarray(value)


def _adjacency_edges(adj, n: int, path: Path) -> np.ndarray:
    import scipy.sparse as sp

    adj = sp.coo_matrix(adj) if not sp.issparse(adj) else adj.tocoo()
    if adj.shape != (n, n):
        raise _fail(path, f"adjacency is {adj.shape[0]}×{adj.shape[1]} but there are {n} nodes")
    return undirected_edges(adj.row, adj.col, n)


def _labels(y, n: int, path: Path, name: str) -> np.ndarray:
    y = _dense(y).reshape(-1)
    if y.size != n:
        raise _fail(path, f"'{name}' has {y.size} entries but there are {n} nodes")
    try:
        values = set(np.unique(y.astype(float)).tolist())
    except (TypeError, ValueError):
        raise _fail(path, f"'{name}' is not numeric") from None
    if not values <= {0.0, 1.0}:
        raise _fail(path, f"'{name}' must be 0/1 anomaly labels, found values {sorted(values)[:5]}")
    if 1.0 not in values:
        raise _fail(path, f"'{name}' has no anomalous node (label 1)")
    return y.astype(np.int64)


def _features(x, path: Path, name: str) -> np.ndarray:
    x = _dense(x)
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise _fail(path, f"'{name}' must be a 2-D node × feature matrix, got shape {x.shape}")
    try:
        x = x.astype(np.float32)
    except (TypeError, ValueError):
        raise _fail(path, f"'{name}' is not numeric") from None
    if not np.isfinite(x).all():
        raise _fail(path, f"'{name}' contains NaN or infinite values")
    return x


def _check_edge_index(edge_index: np.ndarray, n: int, path: Path) -> np.ndarray:
    edge_index = np.asarray(edge_index)
    if edge_index.ndim != 2 or edge_index.shape[0] != 2:
        raise _fail(path, f"edge_index must have shape [2, E], got {edge_index.shape}")
    if not np.issubdtype(edge_index.dtype, np.integer):  # floats are accepted only when integral
        if not np.issubdtype(edge_index.dtype, np.floating):
            raise _fail(path, f"edge_index must hold integer node ids, not {edge_index.dtype}")
        fractional = edge_index[~(np.isfinite(edge_index) & (edge_index == np.round(edge_index)))]
        if fractional.size:
            raise _fail(path, f"edge_index must hold integer node ids, found {fractional[0]}")
        edge_index = edge_index.astype(np.int64)
    if edge_index.size and (edge_index.min() < 0 or edge_index.max() >= n):
        raise _fail(path, f"edge_index refers to node {int(edge_index.max())} but there are {n} nodes")
    return undirected_edges(edge_index[0], edge_index[1], n)


MAT_KEYS = (("Attributes", "Network", "Label"), ("X", "A", "gnd"))


def _mat_v73(path: Path) -> dict:
    import h5py
    import scipy.sparse as sp

    out = {}
    with h5py.File(path, "r") as handle:
        for key, item in handle.items():
            if isinstance(item, h5py.Group) and {"data", "ir", "jc"} <= set(item.keys()):
                rows = int(item.attrs.get("MATLAB_sparse", item["ir"][()].max() + 1))
                jc = item["jc"][()]
                out[key] = sp.csc_matrix((item["data"][()], item["ir"][()], jc), shape=(rows, len(jc) - 1))
            elif isinstance(item, h5py.Dataset):
                out[key] = np.asarray(item[()]).T  # MATLAB stores column-major
    return out


def load_mat(path: Path):
    import h5py
    import scipy.io

    try:
        content = _mat_v73(path) if h5py.is_hdf5(path) else scipy.io.loadmat(path)  # v7.3 is HDF5
    except Exception as exc:  # noqa: BLE001 - any parse failure is a malformed file
        raise _fail(path, f"not a readable MATLAB file ({type(exc).__name__}: {exc})") from None
    for xk, ak, yk in MAT_KEYS:
        if xk in content and ak in content and yk in content:
            x = _features(content[xk], path, xk)
            return make_data(x, _adjacency_edges(content[ak], x.shape[0], path), _labels(content[yk], len(x), path, yk))
    keys = sorted(k for k in content if not k.startswith("__"))
    raise _fail(path, f"needs keys Attributes/Network/Label or X/A/gnd, found {keys}")


def _pyg_data_classes() -> list:
    """The classes a pickled `torch_geometric.data.Data` refers to (torch ≥ 2.6 `weights_only`)."""
    from torch_geometric.data import Data
    from torch_geometric.data.data import DataEdgeAttr, DataTensorAttr
    from torch_geometric.data.storage import BaseStorage, EdgeStorage, GlobalStorage, NodeStorage

    return [Data, DataEdgeAttr, DataTensorAttr, BaseStorage, EdgeStorage, GlobalStorage, NodeStorage]


def load_pt(path: Path):
    import torch
    from torch_geometric.data import Data

    # weights_only: unpickling anything else could run code from the file. A PyG Data object needs
    # its own classes allow-listed; anything else is refused.
    try:
        with torch.serialization.safe_globals(_pyg_data_classes()):
            obj = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001
        reason = "it holds objects other than tensors and a torch_geometric Data" \
            if "Weights only load failed" in str(exc) else f"{type(exc).__name__}"
        raise _fail(path, f"not a loadable torch file ({reason}); save a torch_geometric Data with x, edge_index, y") \
            from None
    if not isinstance(obj, Data):
        raise _fail(path, f"holds a {type(obj).__name__}, expected a torch_geometric Data")
    for key in ("x", "edge_index", "y"):
        if getattr(obj, key, None) is None:
            raise _fail(path, f"the Data object has no '{key}'")
    x = _features(obj.x.numpy(), path, "x")
    edges = _check_edge_index(obj.edge_index.numpy(), len(x), path)
    return make_data(x, edges, _labels(obj.y.numpy(), len(x), path, "y"))


def load_npz(path: Path):
    import scipy.sparse as sp

    try:
        content = dict(np.load(path, allow_pickle=False))
    except Exception as exc:  # noqa: BLE001
        raise _fail(path, f"not a readable .npz archive ({type(exc).__name__})") from None
    for key in ("x", "y"):
        if key not in content:
            raise _fail(path, f"missing array '{key}' (needs x, y and edge_index or indptr/indices)")
    x = _features(content["x"], path, "x")
    n = len(x)
    if "edge_index" in content:
        edges = _check_edge_index(content["edge_index"], n, path)
    elif "indptr" in content and "indices" in content:
        indptr, indices = content["indptr"], content["indices"]
        if len(indptr) != n + 1 or indptr[-1] != len(indices):
            raise _fail(path, f"CSR indptr has {len(indptr)} entries for {n} nodes (needs N+1 ending at len(indices))")
        if len(indices) and (indices.min() < 0 or indices.max() >= n):
            raise _fail(path, f"CSR indices refer to node {int(indices.max())} but there are {n} nodes")
        edges = _adjacency_edges(sp.csr_matrix((np.ones(len(indices)), indices, indptr), shape=(n, n)), n, path)
    else:
        raise _fail(path, "missing 'edge_index' or CSR 'indptr'/'indices'")
    return make_data(x, edges, _labels(content["y"], n, path, "y"))


def load_csv(edges_path: Path, features_path: Path):
    import pandas as pd

    for p in (edges_path, features_path):
        if not p.is_file():
            raise _fail(p, "does not exist (an edge-list CSV needs a features CSV: --set features=FILE.csv)")
    try:
        edges = pd.read_csv(edges_path)
        nodes = pd.read_csv(features_path)
    except Exception as exc:  # noqa: BLE001
        raise _fail(edges_path, f"CSV cannot be parsed ({type(exc).__name__}: {exc})") from None
    if not {"src", "dst"} <= set(edges.columns):
        raise _fail(edges_path, f"needs columns src,dst, found {list(edges.columns)}")
    if "node_id" not in nodes.columns or "y" not in nodes.columns:
        raise _fail(features_path, f"needs columns node_id, f0…, y, found {list(nodes.columns)}")
    nodes = nodes.sort_values("node_id").reset_index(drop=True)
    n = len(nodes)
    if not np.array_equal(nodes["node_id"].to_numpy(), np.arange(n)):
        raise _fail(features_path, "node_id must be 0…N−1, each once")
    feature_cols = [c for c in nodes.columns if c not in ("node_id", "y", "atype", "strength")]
    if not feature_cols:
        raise _fail(features_path, "has no feature columns (f0, f1, …)")
    x = _features(nodes[feature_cols].to_numpy(), features_path, "features")
    y = _labels(nodes["y"].to_numpy(), n, features_path, "y")
    try:  # as numbers, not yet integers: _check_edge_index refuses 2.5 where astype(int64) made it 2
        edge_index = edges[["src", "dst"]].to_numpy().astype(np.float64).T
    except (TypeError, ValueError):
        raise _fail(edges_path, "src/dst must be integer node ids") from None
    edge_index = _check_edge_index(edge_index, n, edges_path)
    if {"atype", "strength"} <= set(nodes.columns):
        names = nodes["atype"].astype(str) + "_" + nodes["strength"].astype(str)
        labels = sorted(set(names[y > 0]))
        group = np.array([labels.index(g) + 1 if yy else 0 for g, yy in zip(names, y)])
        return make_data(x, edge_index, y, group, ("normal", *labels))
    return make_data(x, edge_index, y)


def load_graph(path: str | Path, features: str | Path | None = None):
    """A user graph file as `Data`; raises GraphFormatError (one line) on anything unusable."""
    path = Path(path)
    if path.is_dir():
        return load_csv(path / "edges.csv", path / "features.csv")
    if not path.is_file():
        raise _fail(path, "does not exist")
    suffix = path.suffix.lower()
    if suffix == ".mat":
        return load_mat(path)
    if suffix == ".pt":
        return load_pt(path)
    if suffix == ".npz":
        return load_npz(path)
    if suffix == ".csv":
        return load_csv(path, Path(features) if features else path.with_name("features.csv"))
    raise _fail(path, f"unknown format '{suffix}' (use .mat, .pt, .npz, or .csv with a features CSV)")
