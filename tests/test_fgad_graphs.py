"""The graph side of fgad: the DC-SBM, the anomaly injector's invariants, the partition invariants
(Louvain capping/balancing, splits with anomalies, no cross-client edges) and the loaders on small
hand-made files, malformed ones included."""
from __future__ import annotations

import math
from itertools import combinations

from pathlib import Path

import numpy as np
import pytest
import torch

from icml.data.graphs import (GROUPS, GraphFormatError, InjectionParams, dc_sbm, inject_anomalies, load_graph,
                              synthetic_graph, undirected_edges)
from icml.methods.fgad.partition import (build_clients, ensure_anomaly_per_split, greedy_balance, louvain_chunks,
                                         louvain_partition, metis_partition, random_partition, split_nodes)


@pytest.fixture(scope="module")
def sbm():
    rng = np.random.default_rng(0)
    return dc_sbm(1600, 8, 9.0, 1.0, 16, 0.5, 0.5, rng)


def test_dc_sbm_degrees_and_blocks(sbm):
    x, edges, community = sbm
    assert x.shape == (1600, 16) and np.bincount(community).tolist() == [200] * 8
    same = community[edges[0]] == community[edges[1]]
    n = 1600
    intra, inter = same.sum() / n, (~same).sum() / n  # directed count / N = mean degree
    assert abs(intra - 9.0) < 0.5 and abs(inter - 1.0) < 0.15
    assert not (edges[0] == edges[1]).any()
    pairs = set(zip(*edges.tolist()))
    assert all((b, a) in pairs for a, b in pairs)  # undirected


def _pairs(edges):
    return {(int(a), int(b)) for a, b in zip(*edges) if a < b}


def test_injection_invariants(sbm):
    x, _, community = sbm
    n = len(x)
    params = InjectionParams(seed=3, k_strong=n - 1)  # every node a candidate: the farthest is the global one
    no_edges = np.zeros((2, 0), dtype=np.int64)
    x_new, edges, group, rows = inject_anomalies(x, no_edges, community, params)
    size = params.group_size(n)
    counts = np.bincount(group, minlength=5)
    assert counts[1] == params.n_cliques(n, 15) * 15 and counts[2] == params.n_cliques(n, 5) * 5
    assert counts[3] == counts[4] == size == round(0.0125 * n)
    assert sorted(r["node_id"] for r in rows) == sorted(np.flatnonzero(group).tolist())  # disjoint, all logged
    added = _pairs(edges)
    for name, m, p_drop in (("str_strong", 15, 0.0), ("str_weak", 5, 0.5)):
        for clique in {r["clique_id"] for r in rows if r["group"] == name}:
            members = sorted(r["node_id"] for r in rows if r["group"] == name and r["clique_id"] == clique)
            assert len(members) == m
            present = sum((a, b) in added for a, b in combinations(members, 2))
            assert present == math.comb(m, 2) - round(p_drop * math.comb(m, 2))
            if name == "str_weak":
                assert len(set(community[members])) == 1  # camouflaged in one community
    assert len(added) == sum(math.comb(m, 2) - round(p * math.comb(m, 2)) * 1
                             for m, p, c in ((15, 0.0, params.n_cliques(n, 15)), (5, 0.5, params.n_cliques(n, 5)))
                             for _ in range(c))
    for r in rows:
        node, source = r["node_id"], r["source_node"]
        if r["atype"] == "ctx":
            np.testing.assert_array_equal(x_new[node], x[source])
            if r["strength"] == "strong":
                assert source == np.argmax(np.linalg.norm(x - x[node], axis=1))
            else:
                assert community[source] != community[node]
    untouched = ~np.isin(np.arange(n), [r["node_id"] for r in rows if r["atype"] == "ctx"])
    np.testing.assert_array_equal(x_new[untouched], x[untouched])


def test_injection_is_logged_and_hashed():
    data, rows = synthetic_graph(400, 4, 9.0, 1.0, 8, 0.5, 0.5, InjectionParams(seed=1))
    assert int(data.y.sum()) == len(rows) and data.group_names == ["normal", *GROUPS]
    assert {"node_id", "group", "atype", "strength", "clique_id", "source_node", "m", "p_drop", "k"} <= set(rows[0])
    assert InjectionParams(seed=1).inject_id() == InjectionParams(seed=1).inject_id()
    assert InjectionParams(seed=1).inject_id() != InjectionParams(seed=1, p_drop_weak=0.4).inject_id()


def test_louvain_partition_invariants(sbm):
    _, edges, _ = sbm
    n, k = 1600, 6
    cap = math.ceil(n / k)
    chunks = louvain_chunks(edges, n, k, seed=0)
    assert all(len(c) <= cap for c in chunks)
    assert sorted(np.concatenate(chunks).tolist()) == list(range(n))  # every node exactly once
    client = greedy_balance(chunks, n, k)
    np.testing.assert_array_equal(client, louvain_partition(edges, n, k, seed=0))
    sizes = np.bincount(client, minlength=k)
    assert set(np.unique(client)) == set(range(k)) and sizes.sum() == n
    assert sizes.max() - sizes.min() <= cap  # greedy to the lightest client
    # replaying the greedy rule: each chunk went to a client with the fewest nodes at that moment
    load = np.zeros(k, dtype=int)
    for chunk in sorted(chunks, key=len, reverse=True):
        assert load[client[chunk[0]]] == load.min() and len(set(client[chunk])) == 1
        load[client[chunk[0]]] += len(chunk)


def test_clients_drop_cross_edges_and_split_with_anomalies():
    data, _ = synthetic_graph(600, 6, 9.0, 1.0, 8, 0.5, 0.5, InjectionParams(seed=2))
    n, k = data.num_nodes, 4
    edges = data.edge_index.numpy()
    y = data.y.numpy()
    client = louvain_partition(edges, n, k, seed=2)
    split = split_nodes(client, [0.2, 0.4, 0.4], seed=2)
    for c in range(k):
        size = (client == c).sum()
        assert (split[client == c] == 0).sum() == math.floor(0.2 * size)
        assert (split[client == c] == 1).sum() == math.floor(0.4 * size)
    starved = client.copy()
    starved[(client == 0) & (split == 2) & (y > 0)] = 1  # client 0 loses its test anomalies
    missing = {(c, ("train", "val", "test")[s]) for c in range(k) for s in range(3)
               if not ((starved == c) & (split == s) & (y > 0)).any()}
    assert (0, "test") in missing
    fixed, moves = ensure_anomaly_per_split(starved, split, y, k, np.random.default_rng(0))
    assert {(m["to_client"], m["split"]) for m in moves} == missing and len(moves) == len(missing)
    assert all(split[m["node_id"]] == ("train", "val", "test").index(m["split"]) for m in moves)
    for c in range(k):
        for s in range(3):
            assert ((fixed == c) & (split == s) & (y > 0)).any()
    assert (fixed != starved).sum() == len(moves)
    clients, cut = build_clients(data, fixed, split)
    kept = sum(int(c.adj.sum() - c.n) for c in clients)  # directed edges without self-loops
    same = fixed[edges[0]] == fixed[edges[1]]
    assert kept == same.sum() and cut == pytest.approx(1 - same.mean())
    assert all(torch.all(c.adj.diagonal() == 1) for c in clients)
    assert sorted(np.concatenate([c.nodes for c in clients]).tolist()) == list(range(n))


def test_random_and_metis_partitions():
    client = random_partition(103, 10, seed=0)
    sizes = np.bincount(client)
    assert len(sizes) == 10 and sizes.max() - sizes.min() <= 1



def test_metis_partition(sbm):
    """pymetis is a dependency (no skip path): METIS's K parts cover every node once, cut far fewer edges
    than a random partition of the same sizes, and follow the seed."""
    x, edges, _ = sbm
    n = len(x)
    client = metis_partition(edges, n, 5, seed=0)
    assert client.shape == (n,) and set(np.unique(client)) == set(range(5))
    cut = lambda c: float((c[edges[0]] != c[edges[1]]).mean())  # noqa: E731
    assert cut(client) < 0.5 * cut(random_partition(n, 5, seed=0))
    np.testing.assert_array_equal(metis_partition(edges, n, 5, seed=0), client)
    # seeds 0 and 1 give the same parts here (observed; METIS seeds a C RNG); grid seeds are ≥ 123
    assert not np.array_equal(metis_partition(edges, n, 5, seed=123), client)


def test_the_metis_ablation_is_in_the_grid():
    from icml.methods.fgad.config import FgadConfig
    from icml.methods.fgad.partition import partition
    from icml.methods.fgad.pipeline import JobSpec, job_grid

    cfg = FgadConfig(K=[3], seeds=[5], ablation_K=4, ablation_seeds=[5])
    assert JobSpec("mvfgad", 4, 5, "metis") in job_grid(cfg)
    client = partition("metis", undirected_edges(np.arange(40), (np.arange(40) + 1) % 40, 40), 40, 4, seed=5)
    assert np.bincount(client, minlength=4).tolist() == [10, 10, 10, 10]  # a 40-cycle: four arcs of 10


# loaders -------------------------------------------------------------------------------------------------
N = 6
X = np.arange(N * 3, dtype=np.float32).reshape(N, 3)
EDGES = np.array([[0, 1], [1, 2], [2, 3], [3, 4], [4, 5], [5, 0], [0, 3]])
Y = np.array([0, 1, 0, 0, 1, 0])


def _adjacency():
    import scipy.sparse as sp

    a = sp.coo_matrix((np.ones(len(EDGES)), (EDGES[:, 0], EDGES[:, 1])), shape=(N, N))
    return (a + a.T).tocsc()


def _check(data):
    assert data.x.shape == (N, 3) and data.y.tolist() == Y.tolist()
    np.testing.assert_array_equal(data.edge_index.numpy(), undirected_edges(EDGES[:, 0], EDGES[:, 1], N))
    np.testing.assert_allclose(data.x.numpy(), X)


def test_mat_loaders(tmp_path):
    import h5py
    import scipy.io

    scipy.io.savemat(tmp_path / "a.mat", {"Attributes": X, "Network": _adjacency(), "Label": Y[:, None]})
    _check(load_graph(tmp_path / "a.mat"))
    scipy.io.savemat(tmp_path / "b.mat", {"X": X, "A": _adjacency().toarray(), "gnd": Y})
    _check(load_graph(tmp_path / "b.mat"))
    adj = _adjacency()
    with h5py.File(tmp_path / "c.mat", "w") as f:  # MATLAB v7.3 layout: column-major, sparse as ir/jc
        f["X"] = X.T
        f["gnd"] = Y[None, :].astype(float)
        group = f.create_group("A")
        group["data"], group["ir"], group["jc"] = adj.data, adj.indices, adj.indptr
        group.attrs["MATLAB_sparse"] = N
    _check(load_graph(tmp_path / "c.mat"))
    scipy.io.savemat(tmp_path / "d.mat", {"feat": X, "A": _adjacency(), "gnd": Y})
    with pytest.raises(GraphFormatError, match="needs keys Attributes/Network/Label or X/A/gnd"):
        load_graph(tmp_path / "d.mat")
    scipy.io.savemat(tmp_path / "e.mat", {"X": X, "A": _adjacency(), "gnd": np.array([0, 1, 2, 0, 1, 0])})
    with pytest.raises(GraphFormatError, match="must be 0/1 anomaly labels"):
        load_graph(tmp_path / "e.mat")
    (tmp_path / "f.mat").write_bytes(b"not a matlab file at all" * 10)
    with pytest.raises(GraphFormatError, match="not a readable MATLAB file"):
        load_graph(tmp_path / "f.mat")


class RunsCode:
    """Unpickling this touches a file: what a malicious .pt could do instead."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_pt_npz_loaders(tmp_path):
    from torch_geometric.data import Data

    torch.save(Data(x=torch.as_tensor(X), edge_index=torch.as_tensor(EDGES.T), y=torch.as_tensor(Y)), tmp_path / "g.pt")
    _check(load_graph(tmp_path / "g.pt"))
    torch.save({"x": X}, tmp_path / "h.pt")  # a numpy array inside: refused by weights_only
    with pytest.raises(GraphFormatError, match="objects other than tensors and a torch_geometric Data"):
        load_graph(tmp_path / "h.pt")
    torch.save({"x": torch.as_tensor(X)}, tmp_path / "h2.pt")
    with pytest.raises(GraphFormatError, match="holds a dict, expected a torch_geometric Data"):
        load_graph(tmp_path / "h2.pt")
    # A pickle that would run code when loaded without weights_only is refused, and runs nothing.
    marker = tmp_path / "ran"
    torch.save({"payload": RunsCode(marker)}, tmp_path / "evil.pt")
    with pytest.raises(GraphFormatError, match="not a loadable torch file"):
        load_graph(tmp_path / "evil.pt")
    assert not marker.exists()
    np.savez(tmp_path / "float.npz", x=X, y=Y, edge_index=EDGES.T.astype(np.float64))
    _check(load_graph(tmp_path / "float.npz"))  # integral floats are node ids
    np.savez(tmp_path / "fraction.npz", x=X, y=Y, edge_index=EDGES.T + 0.5)
    with pytest.raises(GraphFormatError, match="must hold integer node ids, found 0.5"):
        load_graph(tmp_path / "fraction.npz")
    np.savez(tmp_path / "i.npz", x=X, y=Y, edge_index=EDGES.T)
    _check(load_graph(tmp_path / "i.npz"))
    adj = _adjacency().tocsr()
    np.savez(tmp_path / "j.npz", x=X, y=Y, indptr=adj.indptr, indices=adj.indices)
    _check(load_graph(tmp_path / "j.npz"))
    np.savez(tmp_path / "k.npz", x=X, edge_index=EDGES.T)
    with pytest.raises(GraphFormatError, match="missing array 'y'"):
        load_graph(tmp_path / "k.npz")
    np.savez(tmp_path / "l.npz", x=X, y=Y, edge_index=EDGES.T + 3)
    with pytest.raises(GraphFormatError, match="refers to node 8 but there are 6 nodes"):
        load_graph(tmp_path / "l.npz")
    np.savez(tmp_path / "m.npz", x=X, y=Y[:4], edge_index=EDGES.T)
    with pytest.raises(GraphFormatError, match="'y' has 4 entries but there are 6 nodes"):
        load_graph(tmp_path / "m.npz")


def test_csv_loader(tmp_path):
    import pandas as pd

    pd.DataFrame(EDGES, columns=["src", "dst"]).to_csv(tmp_path / "edges.csv", index=False)
    nodes = pd.DataFrame(X, columns=["f0", "f1", "f2"]).assign(node_id=np.arange(N), y=Y)
    nodes.to_csv(tmp_path / "features.csv", index=False)
    _check(load_graph(tmp_path / "edges.csv"))
    _check(load_graph(tmp_path))  # a folder with edges.csv + features.csv
    nodes.assign(atype=["", "str", "", "", "ctx", ""], strength=["", "weak", "", "", "strong", ""]).to_csv(
        tmp_path / "typed.csv", index=False)
    typed = load_graph(tmp_path / "edges.csv", tmp_path / "typed.csv")
    assert typed.group_names == ["normal", "ctx_strong", "str_weak"] and typed.group.tolist() == [0, 2, 0, 0, 1, 0]
    nodes.drop(columns="y").to_csv(tmp_path / "nolabel.csv", index=False)
    with pytest.raises(GraphFormatError, match="needs columns node_id, f0…, y"):
        load_graph(tmp_path / "edges.csv", tmp_path / "nolabel.csv")
    pd.DataFrame(EDGES, columns=["a", "b"]).to_csv(tmp_path / "bad_edges.csv", index=False)
    with pytest.raises(GraphFormatError, match="needs columns src,dst"):
        load_graph(tmp_path / "bad_edges.csv", tmp_path / "features.csv")
    with pytest.raises(GraphFormatError, match="unknown format '.txt'"):
        (tmp_path / "g.txt").write_text("x")
        load_graph(tmp_path / "g.txt")
    fractional = pd.DataFrame(EDGES, columns=["src", "dst"]).astype(float)
    fractional.loc[0, "src"] = 2.5  # the loader itself refuses it (it used to read node 2)
    fractional.to_csv(tmp_path / "float_edges.csv", index=False)
    with pytest.raises(GraphFormatError, match="integer node ids, found 2.5"):
        load_graph(tmp_path / "float_edges.csv", tmp_path / "features.csv")
    pd.DataFrame(EDGES, columns=["src", "dst"]).astype(float).to_csv(tmp_path / "integral.csv", index=False)
    _check(load_graph(tmp_path / "integral.csv", tmp_path / "features.csv"))  # 2.0 is node 2


def test_injection_into_a_user_graph_keeps_organic_anomalies(tmp_path):
    from icml.methods.fgad.config import preset
    from icml.methods.fgad.pipeline import build_graph

    data, _ = synthetic_graph(800, 4, 9.0, 1.0, 8, 0.5, 0.5, None)
    y = np.zeros(800, dtype=np.int64)
    y[:6] = 1  # organic anomalies
    np.savez(tmp_path / "g.npz", x=data.x.numpy(), y=y, edge_index=data.edge_index.numpy())
    cfg = preset("smoke")
    cfg.data, cfg.inject = str(tmp_path / "g.npz"), True
    graph, rows, inject_id = build_graph(cfg, seed=5)
    assert graph.group_names == ["normal", *GROUPS, "organic"]
    assert graph.group[:6].tolist() == [5] * 6 and not any(r["node_id"] < 6 for r in rows)
    assert int(graph.y.sum()) == 6 + len(rows) and inject_id == InjectionParams(seed=5).inject_id()
    cfg.inject = None  # files: no injection unless asked
    graph, rows, inject_id = build_graph(cfg, seed=5)
    assert rows == [] and inject_id == "none" and graph.group_names == ["normal", "anomaly"]


def test_intact_clique_members_on_a_hand_made_graph():
    """A 5-clique split 3 | 2 across two clients: each member of the 3 keeps 2 of its 4 clique edges (half:
    intact), each of the 2 keeps 1 of 4 (stranded); a 3-member clique kept whole is intact; a clique member
    whose clique edges were all dropped is no structural anomaly at all; contextual anomalies never count."""
    from icml.methods.fgad.pipeline import intact_members

    pairs = [(a, b) for i, a in enumerate(range(5)) for b in range(i + 1, 5)]  # clique 0: nodes 0-4
    pairs += [(5, 6), (5, 7), (6, 7)]  # clique 1 (str_weak): nodes 5-7; node 8 is in it with no edge left
    pairs += [(0, 9), (3, 9), (5, 9)]  # ordinary edges to node 9
    edges = np.array(pairs + [(b, a) for a, b in pairs]).T
    injection = [{"node_id": v, "group": "str_strong", "atype": "str", "clique_id": 0} for v in range(5)]
    injection += [{"node_id": v, "group": "str_weak", "atype": "str", "clique_id": 0} for v in (5, 6, 7, 8)]
    injection += [{"node_id": 9, "group": "ctx_strong", "atype": "ctx", "clique_id": -1}]
    client = np.array([0, 0, 0, 1, 1, 1, 1, 1, 1, 0])
    intact = intact_members(edges, injection, client)
    assert set(intact) == {"str_strong_intact", "str_weak_intact"}
    assert np.flatnonzero(intact["str_strong_intact"]).tolist() == [0, 1, 2]
    assert np.flatnonzero(intact["str_weak_intact"]).tolist() == [5, 6, 7]
    whole = intact_members(edges, injection, np.zeros(10, dtype=int))  # one client: every clique intact
    assert np.flatnonzero(whole["str_strong_intact"]).tolist() == [0, 1, 2, 3, 4]
