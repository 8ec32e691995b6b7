"""The spec's generator metrics on decoded tiles (arrays in metres, tile frame)."""
from __future__ import annotations

import numpy as np
from scipy.spatial.distance import jensenshannon

from .world import SUCC, PRED, LEFT, RIGHT

STATIC_CODE = np.tile([1.0, 0.0], 6)
JSD_BINS = {"nearest_dist_jsd": (0, 50, 1, 10), "lat_dev_jsd": (0, 1.5, 0.1, 10), "ang_dev_jsd": (-200, 200, 5, 100),
            "length_jsd": (0, 25, 0.1, 100), "width_jsd": (0, 5, 0.1, 100), "speed_jsd": (0, 50, 1, 100)}


def lane_graph(tile: dict):
    L = int(tile["lane_mask"].sum())
    e = tile["edges"][:L, :L]
    succ = [np.flatnonzero(e[i] == SUCC) for i in range(L)]
    length = np.linalg.norm(np.diff(tile["lanes"][:L], axis=1), axis=-1).sum(1) if L else np.zeros(0)
    return L, e, succ, length


def endpoint_gaps(tile: dict) -> list[float]:
    L, e, succ, _ = lane_graph(tile)
    return [float(np.linalg.norm(tile["lanes"][i, -1] - tile["lanes"][j, 0])) for i in range(L) for j in succ[i]]


def longest_route(tile: dict, start: int | None = None) -> float:
    L, e, succ, length = lane_graph(tile)
    if L == 0:
        return 0.0
    if start is None:
        start = int(np.argmin(np.linalg.norm(tile["lanes"][:L], axis=-1).min(1)))
    best, stack = 0.0, [(start, length[start], {start})]
    while stack:  # depth-first over successor paths without revisits
        node, dist, seen = stack.pop()
        best = max(best, dist)
        for nxt in succ[node]:
            if nxt not in seen and len(stack) < 10_000:
                stack.append((nxt, dist + length[nxt], seen | {nxt}))
    return best


def graph_stats(tile: dict) -> dict[str, list[float]]:
    """Per-lane degree (typed edges) ×10, #lanes, #reachable lanes, shortest successor-path lengths ×10 (km→m/100)."""
    import networkx as nx

    L, e, succ, length = lane_graph(tile)
    g = nx.DiGraph()
    g.add_nodes_from(range(L))
    for i in range(L):
        for j in succ[i]:
            g.add_edge(i, j, weight=float(length[j]))
    deg = [(np.isin(e[i], [SUCC, PRED, LEFT, RIGHT])).sum() * 10.0 for i in range(L)]
    reach = [len(nx.descendants(g, i)) for i in range(L)]
    paths = [d / 10.0 for i in range(L) for d in nx.single_source_dijkstra_path_length(g, i).values() if d > 0]
    return {"fd_connectivity": deg, "fd_density": [float(L)], "fd_reach": reach, "fd_convenience": paths}


def frechet_1d(a: list[float], b: list[float]) -> float:
    """√ of the Fréchet distance between 1-D Gaussians fitted to a and b."""
    if not len(a) or not len(b):
        return float("nan")
    return float(np.sqrt((np.mean(a) - np.mean(b)) ** 2 + (np.std(a) - np.std(b)) ** 2))


def agent_stats(tile: dict) -> dict[str, list[float]]:
    A = int(tile["agent_mask"].sum())
    L = int(tile["lane_mask"].sum())
    a = tile["agents"][:A]
    out = {k: [] for k in JSD_BINS}
    if A == 0:
        return out
    xy = a[:, :2]
    if A > 1:
        d = np.linalg.norm(xy[:, None] - xy[None], axis=-1) + np.eye(A) * 1e9
        out["nearest_dist_jsd"] = list(d.min(1))
    if L:
        pts = tile["lanes"][:L]
        dirs = np.diff(pts, axis=1)
        mids = (pts[:, 1:] + pts[:, :-1]) / 2
        flat, fdir = mids.reshape(-1, 2), dirs.reshape(-1, 2)
        dist = np.linalg.norm(xy[:, None] - flat[None], axis=-1)
        k = dist.argmin(1)
        near = dist[np.arange(A), k] <= 1.5
        out["lat_dev_jsd"] = list(dist[np.arange(A), k][near])
        lane_h = np.arctan2(fdir[k, 1], fdir[k, 0])
        ang = np.degrees(np.angle(np.exp(1j * (np.arctan2(a[:, 4], a[:, 3]) - lane_h))))
        out["ang_dev_jsd"] = list(ang[near])
    out["length_jsd"], out["width_jsd"], out["speed_jsd"] = list(a[:, 5]), list(a[:, 6]), list(a[:, 2])
    return out


def jsd(a, b, lo, hi, step) -> float:
    bins = np.arange(lo, hi + step / 2, step)
    p, _ = np.histogram(np.clip(a, lo, hi), bins)
    q, _ = np.histogram(np.clip(b, lo, hi), bins)
    if p.sum() == 0 or q.sum() == 0:
        return float("nan")
    return float(jensenshannon(p, q) ** 2)  # natural log: JSD itself (scipy returns its square root)


def box_circles(a: np.ndarray) -> np.ndarray:
    """Five circle centres along each vehicle's length."""
    f = np.linspace(-0.4, 0.4, 5)
    h = np.stack([a[:, 3], a[:, 4]], 1)
    return a[:, None, :2] + f[None, :, None] * a[:, 5, None, None] * h[:, None]


def colliding(a: np.ndarray) -> np.ndarray:
    """Per vehicle: do its 5 body circles come within (w_j + w_k)/√3.8 of another's?"""
    A = len(a)
    if A < 2:
        return np.zeros(A, bool)
    c = box_circles(a)
    d = np.linalg.norm(c[:, None, :, None] - c[None, :, None, :], axis=-1).min((-1, -2))
    thresh = (a[:, None, 6] + a[None, :, 6]) / np.sqrt(3.8)
    return ((d < thresh) & ~np.eye(A, dtype=bool)).any(1)


def collision_pct(tile: dict) -> tuple[int, int]:
    A = int(tile["agent_mask"].sum())
    return int(colliding(tile["agents"][:A]).sum()), A


def is_static(code: np.ndarray) -> np.ndarray:
    return np.abs(code - STATIC_CODE).max(-1) < 0.1


def score_tiles(generated: list[dict], reference: list[dict]) -> dict[str, float]:
    """Every generator metric of the spec, generated tiles vs held-out tiles."""
    out = {"endpoint_gap_m": float(np.mean(sum((endpoint_gaps(t) for t in generated), []) or [np.nan])),
           "route_length_m": float(np.mean([longest_route(t) for t in generated]))}
    gs = [graph_stats(t) for t in generated]
    rs = [graph_stats(t) for t in reference]
    for key in ("fd_connectivity", "fd_density", "fd_reach", "fd_convenience"):
        out[key] = frechet_1d(sum((g[key] for g in gs), []), sum((r[key] for r in rs), []))
    ga = [agent_stats(t) for t in generated]
    ra = [agent_stats(t) for t in reference]
    for key, (lo, hi, step, scale) in JSD_BINS.items():
        out[key] = scale * jsd(sum((g[key] for g in ga), []), sum((r[key] for r in ra), []), lo, hi, step)
    hits = np.array([collision_pct(t) for t in generated])
    out["collision_rate_pct"] = float(100 * hits[:, 0].sum() / max(hits[:, 1].sum(), 1))

    def static_frac(tiles):
        codes = [t["motion"][: int(t["agent_mask"].sum())] for t in tiles]
        flat = np.concatenate(codes) if codes else np.zeros((0, 12))
        return float(is_static(flat).mean()) if len(flat) else 0.0
    out["static_frac_err"] = abs(static_frac(generated) - static_frac(reference))
    return out
