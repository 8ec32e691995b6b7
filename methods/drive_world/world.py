"""Procedural driving worlds (spec: Data [S]) and their ego-centric vector-graph tiles.

A world is one long route of straights and arcs with 1–2 lanes per direction (3.5 m apart) as
polylines at 1 m; lanes are split every ≤ 30 m, so successor/predecessor edges come from the
split topology and left/right edges from adjacency. Vehicles are kinematic bicycles driven by pure
pursuit + IDM at 10 Hz; 20% are parked. Junctions and merges are not generated (README).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DT = 0.1
LANE_W = 3.5
WHEELBASE = 2.8
EDGE_TYPES = ("none", "pred", "succ", "left", "right", "self")
NONE, PRED, SUCC, LEFT, RIGHT, SELF = range(6)
AGENT_TYPES = ("vehicle", "pedestrian", "cyclist")
SEG_M = 30.0


def centreline(length_m: float, rng: np.random.Generator) -> np.ndarray:
    """(N, 3) x, y, heading at 1 m spacing: alternating straights (30–120 m) and arcs (R 20–60 m)."""
    pts, x, y, h = [], 0.0, 0.0, 0.0
    straight = True
    while len(pts) < length_m:
        if straight:
            n, dh = int(rng.uniform(30, 120)), 0.0
        else:
            radius = rng.uniform(20, 60)
            turn = rng.uniform(0.3, 1.2) * rng.choice([-1, 1])
            n = max(int(abs(turn) * radius), 2)
            dh = turn / n
        for _ in range(n):
            pts.append((x, y, h))
            h += dh
            x += np.cos(h)
            y += np.sin(h)
        straight = not straight
    return np.asarray(pts[: int(length_m)])


@dataclass
class World:
    lanes: list[np.ndarray]  # each (n, 2), driving direction along the array
    lane_kind: list[tuple[int, int, int]]  # (direction ±1, lateral index, segment index)
    routes: dict[tuple[int, int], np.ndarray]  # (direction, lateral) -> full polyline (n, 3) in driving order
    agents: list[dict]  # current state + 3 s history


def build_world(length_m: float, rng: np.random.Generator, n_agents: int, parked_frac: float = 0.2,
                history_s: float = 3.0) -> World:
    c = centreline(length_m, rng)
    per_dir = int(rng.integers(1, 3))
    normal = np.stack([-np.sin(c[:, 2]), np.cos(c[:, 2])], 1)
    routes = {}
    for direction in (1, -1):
        for k in range(per_dir):
            offset = -direction * (k + 0.5) * LANE_W  # right-hand traffic
            xy = c[:, :2] + offset * normal
            heading = c[:, 2] if direction == 1 else c[:, 2] + np.pi
            line = np.concatenate([xy, heading[:, None]], 1)
            routes[(direction, k)] = line if direction == 1 else line[::-1].copy()
    lanes, kind = [], []
    n_seg = int(np.ceil((len(c) - 1) / SEG_M))
    for (direction, k), line in routes.items():
        for s in range(n_seg):
            a, b = int(s * SEG_M), min(int((s + 1) * SEG_M), len(c) - 1)
            seg = line[a:b + 1, :2] if direction == 1 else line[len(c) - 1 - b:len(c) - a, :2]
            lanes.append(seg.copy())
            kind.append((direction, k, s if direction == 1 else n_seg - 1 - s))
    agents = spawn_agents(routes, rng, n_agents, parked_frac, history_s)
    return World(lanes, kind, routes, agents)


def idm_accel(v: float, gap: float, dv: float, v0: float) -> float:
    s = 2.0 + v * 1.5 + v * dv / (2 * np.sqrt(2.0 * 3.0))
    return float(np.clip(2.0 * (1 - (v / v0) ** 4 - (max(s, 0) / max(gap, 0.5)) ** 2), -6, 3))


def pure_pursuit(pose: np.ndarray, v: float, line: np.ndarray) -> float:
    """Steering angle towards the route point one look-ahead (4 m + 0.8 s) ahead."""
    d = np.linalg.norm(line[:, :2] - pose[:2], axis=1)
    i = int(np.argmin(d))
    j = min(i + int(4 + 0.8 * v), len(line) - 1)
    dx, dy = line[j, :2] - pose[:2]
    alpha = np.arctan2(dy, dx) - pose[2]
    ld = max(np.hypot(dx, dy), 1.0)
    return float(np.clip(np.arctan2(2 * WHEELBASE * np.sin(alpha), ld), -0.6, 0.6))


def bicycle(pose: np.ndarray, v: float, steer: float, acc: float) -> tuple[np.ndarray, float]:
    v2 = max(v + acc * DT, 0.0)
    h = pose[2] + v2 / WHEELBASE * np.tan(steer) * DT
    return np.array([pose[0] + v2 * np.cos(h) * DT, pose[1] + v2 * np.sin(h) * DT, h]), v2


CURB_GAP_M = 0.3  # [S] a parked vehicle's side is this far beyond the edge of its direction's outermost lane


def curb_pose(lane_pose: np.ndarray, width: float) -> np.ndarray:
    """A parked vehicle beside a lane point (x, y, ψ): on the right of the driving direction, just off the lane,
    so that it is nobody's IDM leader (lateral > 2 m) and blocks no lane."""
    offset = LANE_W / 2 + width / 2 + CURB_GAP_M
    return lane_pose + offset * np.array([np.sin(lane_pose[2]), -np.cos(lane_pose[2]), 0.0])


def spawn_agents(routes, rng, n, parked_frac, history_s) -> list[dict]:
    """Moving vehicles on lane centrelines; parked ones at the curb of their direction's outermost lane. Parked
    on a centreline, a vehicle would block its lane for good (IDM agents never change lanes): every agent behind
    it queues at rest, and the logged behaviour ΔSim imitates would be 'slow down, stop, never move again'."""
    keys = list(routes)
    outermost = {d: max(k for dd, k in keys if dd == d) for d, _ in keys}
    agents = []
    for _ in range(n):
        key = keys[int(rng.integers(len(keys)))]
        line = routes[key]
        i = int(rng.integers(5, max(len(line) - 60, 6)))
        parked = rng.random() < parked_frac
        v0 = 0.0 if parked else rng.uniform(5, 14)
        length, width = rng.uniform(4, 5), rng.uniform(1.8, 2.1)
        if parked:
            key = (key[0], outermost[key[0]])
            pose = curb_pose(routes[key][i], width)  # every route has the centreline's length
        else:
            pose = line[i].copy()
        agents.append(dict(route=key, pose=pose, v=v0, v0=max(v0, 1.0), parked=parked, length=length, width=width,
                           type=0, history=[]))
    for _ in range(int(round(history_s / DT))):  # 3 s of history
        step_agents(agents, routes)
    return agents


def step_agents(agents: list[dict], routes) -> None:
    """One 10 Hz step of pure pursuit + IDM for every agent (records history before moving)."""
    poses = np.array([a["pose"] for a in agents]) if agents else np.zeros((0, 3))
    for a in agents:
        a["history"].append((*a["pose"], a["v"]))
        if a["parked"]:
            continue
        line = routes[a["route"]]
        fwd = np.array([np.cos(a["pose"][2]), np.sin(a["pose"][2])])
        rel = poses[:, :2] - a["pose"][:2]
        ahead = rel @ fwd
        lat = np.abs(rel @ np.array([-fwd[1], fwd[0]]))
        mask = (ahead > 0.5) & (lat < 2.0)
        gap = float(ahead[mask].min() - a["length"]) if mask.any() else 100.0
        acc = idm_accel(a["v"], gap, 0.0, a["v0"])
        a["pose"], a["v"] = bicycle(a["pose"], a["v"], pure_pursuit(a["pose"], a["v"], line), acc)


def motion_code(history: np.ndarray, pose: np.ndarray) -> tuple[np.ndarray, bool]:
    """The spec's 12-D code: the last 12 m of history, arc-length resampled to 6 body-frame points,
    x ∈ [−12, 0] → [−1, 1], y ∈ [−6, 6] → [−1, 1]; static if < 0.5 m over 8 frames or mean speed < 0.2."""
    xy = history[:, :2]
    moved = np.linalg.norm(xy[-1] - xy[-8]) if len(xy) >= 8 else 0.0
    static = moved < 0.5 or history[:, 3].mean() < 0.2
    c, s = np.cos(pose[2]), np.sin(pose[2])
    rel = (np.concatenate([xy, pose[None, :2]]) - pose[:2]) @ np.array([[c, -s], [s, c]])
    if static:
        body = np.zeros((6, 2))
    else:
        seg = np.linalg.norm(np.diff(rel, axis=0), axis=1)
        arc = np.concatenate([[0], np.cumsum(seg)])
        arc = arc[-1] - arc  # distance back from the current pose
        back = np.linspace(min(12.0, arc[0]), 0.0, 6)
        order = np.argsort(arc)
        body = np.stack([np.interp(back, arc[order], rel[order, 0]), np.interp(back, arc[order], rel[order, 1])], 1)
    code = np.stack([body[:, 0] / 6.0 + 1.0, body[:, 1] / 6.0], 1)
    return np.clip(code, -1, 1).reshape(-1), bool(static)


def resample(poly: np.ndarray, n: int) -> np.ndarray:
    seg = np.linalg.norm(np.diff(poly, axis=0), axis=1)
    arc = np.concatenate([[0], np.cumsum(seg)])
    if arc[-1] <= 1e-9:
        return np.repeat(poly[:1], n, 0)
    s = np.linspace(0, arc[-1], n)
    return np.stack([np.interp(s, arc, poly[:, 0]), np.interp(s, arc, poly[:, 1])], 1)


def to_frame(xy: np.ndarray, origin: np.ndarray) -> np.ndarray:
    c, s = np.cos(origin[2]), np.sin(origin[2])
    return (xy - origin[:2]) @ np.array([[c, -s], [s, c]])


def cut_tile(world: World, origin: np.ndarray, cfg, rng: np.random.Generator | None = None,
             partition: bool = False) -> dict:
    """An ego-centric tile: lanes clipped to the 64 m window and resampled to `lane_points`, typed
    ordered lane-pair edges, agents as [x, y, speed, cosθ, sinθ, length, width] + motion codes."""
    half = cfg.tile_m / 2
    pieces, kinds = [], []
    for lane, kind in zip(world.lanes, world.lane_kind):
        local = to_frame(lane, origin)
        inside = (np.abs(local) <= half).all(1)
        if inside.sum() < 2:
            continue
        idx = np.flatnonzero(inside)
        pieces.append(resample(local[idx[0]:idx[-1] + 1], cfg.lane_points))
        kinds.append(kind)
        if len(pieces) == cfg.max_lanes:
            break
    L = len(pieces)
    edges = np.zeros((cfg.max_lanes, cfg.max_lanes), np.int64)
    for i in range(L):
        for j in range(L):
            (di, ki, si), (dj, kj, sj) = kinds[i], kinds[j]
            step = si - sj  # segment indices are in driving order: −1 means j follows i
            if i == j:
                edges[i, j] = SELF
            elif di == dj and ki == kj and step == -1:
                edges[i, j] = SUCC
            elif di == dj and ki == kj and step == 1:
                edges[i, j] = PRED
            elif di == dj and si == sj and abs(ki - kj) == 1:
                edges[i, j] = LEFT if kj > ki else RIGHT  # higher lateral index = further left
    lanes = np.zeros((cfg.max_lanes, cfg.lane_points, 2), np.float32)
    if L:
        lanes[:L] = np.stack(pieces)
    states, codes, static, types = [], [], [], []
    for a in world.agents:
        p = to_frame(a["pose"][None, :2], origin)[0]
        if (np.abs(p) > half).any() or len(states) == cfg.max_agents:
            continue
        h = a["pose"][2] - origin[2]
        states.append([p[0], p[1], a["v"], np.cos(h), np.sin(h), a["length"], a["width"]])
        code, st = motion_code(np.asarray(a["history"]), a["pose"])
        codes.append(code)
        static.append(st)
        types.append(a["type"])
    A = len(states)
    agent = np.zeros((cfg.max_agents, 7), np.float32)
    motion = np.zeros((cfg.max_agents, 12), np.float32)
    if A:
        agent[:A], motion[:A] = states, codes
    fixed_l = np.zeros(cfg.max_lanes, bool)
    fixed_a = np.zeros(cfg.max_agents, bool)
    if partition:  # nodes behind the partition line x ≤ 0 are given (outpainting)
        fixed_l[:L] = lanes[:L, :, 0].mean(1) <= 0
        fixed_a[:A] = agent[:A, 0] <= 0
    return dict(lanes=lanes, lane_mask=np.arange(cfg.max_lanes) < L, edges=edges, agents=agent, motion=motion,
                agent_mask=np.arange(cfg.max_agents) < A, static=np.pad(np.array(static, bool), (0, cfg.max_agents - A)),
                agent_type=np.pad(np.array(types, np.int64), (0, cfg.max_agents - A)),
                fixed_lanes=fixed_l, fixed_agents=fixed_a, label=int(len(world.routes) > 2))


def make_tiles(cfg, n: int, seed: int, partition_frac: float) -> dict:
    """n tiles (stacked arrays) from worlds seeded seed, seed+1, …; splits differ by seed range."""
    tiles, w = [], 0
    while len(tiles) < n:
        rng = np.random.default_rng([seed, w])
        world = build_world(cfg.tiles_per_world * 25 + 80, rng, n_agents=cfg.tiles_per_world * 2,
                            parked_frac=cfg.parked_frac, history_s=cfg.history_s)
        line = world.routes[(1, 0)]
        for k in range(cfg.tiles_per_world):
            if len(tiles) == n:
                break
            i = int(rng.integers(0, len(line)))
            tiles.append(cut_tile(world, line[i], cfg, rng, partition=rng.random() < partition_frac))
        w += 1
    return {k: np.stack([t[k] for t in tiles]) for k in tiles[0]}
