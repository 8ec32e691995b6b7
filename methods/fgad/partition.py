"""Splitting one graph across K clients: Louvain with size capping and greedy balancing (the
official scheme), random and METIS partitions as ablations, per-client train/val/test splits with
an anomaly in every split, and the clients' own subgraphs (cross-client edges dropped)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SPLITS = ("train", "val", "test")


def louvain_chunks(edge_index: np.ndarray, n: int, k: int, seed: int) -> list[np.ndarray]:
    """Louvain communities cut into chunks of at most ⌈N/K⌉ nodes (sorted node ids)."""
    import networkx as nx

    graph = nx.Graph()
    graph.add_nodes_from(range(n))
    graph.add_edges_from(edge_index.T.tolist())
    cap = math.ceil(n / k)
    chunks = []
    for community in nx.community.louvain_communities(graph, seed=seed):
        members = np.sort(np.fromiter(community, dtype=np.int64))
        chunks += [members[i:i + cap] for i in range(0, len(members), cap)]
    return chunks


def greedy_balance(chunks: list[np.ndarray], n: int, k: int) -> np.ndarray:
    """Largest chunk first, each to the client with the fewest nodes so far (ties: lowest id)."""
    client = np.full(n, -1, dtype=np.int64)
    load = np.zeros(k, dtype=np.int64)
    for chunk in sorted(chunks, key=len, reverse=True):  # stable: equal sizes keep Louvain's order
        target = int(np.argmin(load))
        client[chunk] = target
        load[target] += len(chunk)
    return client


def louvain_partition(edge_index: np.ndarray, n: int, k: int, seed: int) -> np.ndarray:
    return greedy_balance(louvain_chunks(edge_index, n, k, seed), n, k)


def random_partition(n: int, k: int, seed: int) -> np.ndarray:
    client = np.empty(n, dtype=np.int64)
    for c, part in enumerate(np.array_split(np.random.default_rng(seed).permutation(n), k)):
        client[part] = c
    return client


def metis_partition(edge_index: np.ndarray, n: int, k: int, seed: int) -> np.ndarray:
    """METIS k-way parts (pymetis), seeded."""
    import pymetis

    adjacency = [[] for _ in range(n)]
    for a, b in edge_index.T.tolist():
        adjacency[a].append(b)
    _, parts = pymetis.part_graph(k, adjacency=adjacency, options=pymetis.Options(seed=int(seed)))
    return np.asarray(parts, dtype=np.int64)


def partition(kind: str, edge_index: np.ndarray, n: int, k: int, seed: int) -> np.ndarray:
    if k == 1:
        return np.zeros(n, dtype=np.int64)
    if kind == "louvain":
        return louvain_partition(edge_index, n, k, seed)
    if kind == "random":
        return random_partition(n, k, seed)
    return metis_partition(edge_index, n, k, seed)


def split_nodes(client: np.ndarray, fractions: list[float], seed: int) -> np.ndarray:
    """Per client, a random 20/40/40 (by default) split: codes 0 train, 1 val, 2 test."""
    rng = np.random.default_rng(seed)
    split = np.empty(len(client), dtype=np.int64)
    for c in np.unique(client):
        nodes = rng.permutation(np.flatnonzero(client == c))
        n_train = int(math.floor(fractions[0] * len(nodes)))
        n_val = int(math.floor(fractions[1] * len(nodes)))
        split[nodes[:n_train]] = 0
        split[nodes[n_train:n_train + n_val]] = 1
        split[nodes[n_train + n_val:]] = 2
    return split


def ensure_anomaly_per_split(client: np.ndarray, split: np.ndarray, y: np.ndarray, k: int,
                             rng: np.random.Generator) -> tuple[np.ndarray, list[dict]]:
    """Move anomalies so every (client, split) holds one: the node keeps its split and changes owner,
    taken from a client holding more than one anomaly in that split. Returns (client′, moves)."""
    client = client.copy()
    moves = []
    for c in range(k):
        for s in range(3):
            if ((client == c) & (split == s) & (y > 0)).any():
                continue
            counts = np.bincount(client[(split == s) & (y > 0)], minlength=k)
            donors = np.flatnonzero(counts > 1)
            if donors.size == 0:
                continue  # not enough anomalies anywhere; the caller warns
            donor = int(donors[np.argmax(counts[donors])])
            node = int(rng.choice(np.flatnonzero((client == donor) & (split == s) & (y > 0))))
            client[node] = c
            moves.append({"node_id": node, "from_client": donor, "to_client": c, "split": SPLITS[s]})
    return client, moves


@dataclass
class Client:
    """One client's subgraph: its global node ids and dense adjacency with self-loops."""

    nodes: np.ndarray  # global ids, sorted
    x: "torch.Tensor"  # noqa: F821
    adj: "torch.Tensor"  # noqa: F821 - dense, symmetric, ones on the diagonal
    y: np.ndarray
    split: np.ndarray  # 0 train, 1 val, 2 test
    group: np.ndarray

    @property
    def n(self) -> int:
        return len(self.nodes)


def build_clients(data, client: np.ndarray, split: np.ndarray) -> tuple[list[Client], float]:
    """The clients' subgraphs (edges between clients dropped, self-loops added) and the share of
    edges lost to the partition."""
    import torch
    from torch_geometric.utils import add_self_loops, subgraph, to_dense_adj

    edge_index = data.edge_index
    client_t = torch.as_tensor(client)
    cut = (client_t[edge_index[0]] != client_t[edge_index[1]]).float().mean().item() if edge_index.numel() else 0.0
    out = []
    for c in range(int(client.max()) + 1):
        nodes = np.flatnonzero(client == c)
        local, _ = subgraph(torch.as_tensor(nodes), edge_index, relabel_nodes=True, num_nodes=data.num_nodes)
        local, _ = add_self_loops(local, num_nodes=len(nodes))
        adj = to_dense_adj(local, max_num_nodes=len(nodes))[0].clamp(max=1.0)
        out.append(Client(nodes, data.x[nodes], adj, data.y.numpy()[nodes], split[nodes], data.group.numpy()[nodes]))
    return out, cut
