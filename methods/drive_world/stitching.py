"""The streaming rollout's map (spec: Method 5 and 8): the seed lanes, the lanes of every outpainted tile, the
ego route stitched along them at lane endpoints within `rollout.stitch_m`, and the context (fixed nodes behind
the partition line x ≤ 0) each frontier tile is outpainted from.

Every outpainted tile is centred at the route end and oriented along it, so the route end is the tile origin
(0, 0) exactly. Stitching walks the tile's generated (non-fixed) lanes: the next lane is the one whose first
point is nearest the current end, within `stitch_m` and with a start heading within `stitch_heading_deg`; the
route continues on it and the distance is recorded (the measured endpoint gap). When no generated lane is
compatible, the route continues on a straight lane of tile_m / 2 along the route-end heading: the fallback
`straight`, counted per tile in `stitch_fallback_rate`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.spatial import cKDTree

from .world import DT, motion_code, resample, to_frame

SOURCES = ("seed", "generated", "fallback")
MIN_LANE_M = 1.0  # decoded lanes shorter than this have no usable direction
MAX_TURN_DEG = 45.0  # [S] a decoded lane turning more than this between consecutive segments is not drivable: the
# procedural roads (R ≥ 20 m, ≤ 5 m between the 10 resampled points) turn ≤ 15°; a decoder's hairpin reverses


def drivable(poly: np.ndarray) -> bool:
    """A decoded lane the route may continue on: ≥ MIN_LANE_M long and no turn above MAX_TURN_DEG between
    consecutive (non-degenerate) segments."""
    poly = np.asarray(poly, np.float64)
    d = np.diff(poly, axis=0)
    d = d[np.linalg.norm(d, axis=1) > 1e-6]
    if length(poly) < MIN_LANE_M or len(d) == 0:
        return False
    turn = np.abs(np.angle(np.exp(1j * np.diff(np.arctan2(d[:, 1], d[:, 0])))))
    return bool((turn <= np.radians(MAX_TURN_DEG)).all())


def from_frame(local: np.ndarray, origin: np.ndarray) -> np.ndarray:
    """The inverse of `world.to_frame`: tile-frame points → world."""
    c, s = np.cos(origin[2]), np.sin(origin[2])
    return origin[:2] + np.asarray(local, np.float64) @ np.array([[c, s], [-s, c]])


def length(poly: np.ndarray) -> float:
    return float(np.linalg.norm(np.diff(poly, axis=0), axis=1).sum())


def densify(poly: np.ndarray, spacing: float = 1.0) -> np.ndarray:
    """Every segment longer than `spacing` split evenly (pure pursuit looks ahead by index, at 1 m); every
    vertex is kept bit for bit, repeated vertices are dropped."""
    poly = np.asarray(poly, np.float64)
    seg = np.linalg.norm(np.diff(poly, axis=0), axis=1)
    out = [poly[:1]]
    for a, b, d in zip(poly[:-1], poly[1:], seg):
        if d > 0:
            n = int(np.ceil(d / spacing))
            out += [a + np.arange(1, n)[:, None] / n * (b - a), b[None]]
    return np.concatenate(out)


def headings(poly: np.ndarray) -> np.ndarray:
    """Per-point heading: the forward segment's (the last point: the backward one's)."""
    d = np.diff(poly, axis=0)
    h = np.arctan2(d[:, 1], d[:, 0])
    return np.concatenate([h, h[-1:]])


def start_heading(poly: np.ndarray) -> float:
    """The heading from the first point to the first one that differs from it (by > 1 µm)."""
    far = np.flatnonzero(np.linalg.norm(poly[1:] - poly[0], axis=1) > 1e-6)
    d = poly[far[0] + 1] - poly[0]
    return float(np.arctan2(d[1], d[0]))


def end_heading(poly: np.ndarray) -> float:
    return start_heading(poly[::-1]) + np.pi


def longest_run(mask: np.ndarray) -> slice | None:
    """The longest run (≥ 2 entries, else None) of consecutive True entries: a lane may leave and re-enter a
    window."""
    best, start, best_len = None, None, 1
    for i, m in enumerate(np.append(mask, False)):
        if m and start is None:
            start = i
        elif not m and start is not None:
            if i - start > best_len:
                best, best_len = slice(start, i), i - start
            start = None
    return best


class LaneMap:
    """All lanes of the rollout so far (world frame, ≤ 1 m spacing) with their source; `lanes` and `centroids`
    are what ΔSim's lane features read; `offroad` and `snap` query every lane point."""

    def __init__(self):
        self.lanes: list[np.ndarray] = []
        self.sources: list[str] = []
        self._cache = None

    def add(self, poly: np.ndarray, source: str) -> None:
        poly = densify(poly)
        if len(poly) < 2:
            return
        self.lanes.append(poly)
        self.sources.append(source)
        self._cache = None

    def _index(self):
        if self._cache is None:
            pts = np.concatenate(self.lanes)
            owner = np.concatenate([np.full(len(l), i) for i, l in enumerate(self.lanes)])
            heading = np.concatenate([headings(l) for l in self.lanes])
            starts = np.array([l[0] for l in self.lanes])
            start_h = np.array([start_heading(l) for l in self.lanes])
            offsets = np.concatenate([[0], np.cumsum([len(l) for l in self.lanes])])
            self._cache = (pts, owner, heading, cKDTree(pts), np.array([l.mean(0) for l in self.lanes]),
                           starts, start_h, offsets)
        return self._cache

    @property
    def centroids(self) -> np.ndarray:
        return self._index()[4]

    def offroad(self, xy: np.ndarray) -> np.ndarray:
        return self._index()[3].query(xy)[0] > 1.5

    def nearest(self, pose: np.ndarray) -> tuple[int, int]:
        """(lane, point) nearest the pose among points whose lane heading is within 90° of the pose's
        (any point if none is)."""
        pts, owner, heading, *_, offsets = self._index()
        d = np.linalg.norm(pts - pose[:2], axis=1)
        d = d + 1e6 * (np.cos(heading - pose[2]) < 0)
        k = int(np.argmin(d))
        lane = int(owner[k])
        return lane, k - int(offsets[lane])

    def snap(self, pose: np.ndarray) -> np.ndarray:
        """An agent's pose moved to the nearest lane point of compatible heading, with that lane's heading."""
        lane, i = self.nearest(pose)
        return np.array([*self.lanes[lane][i], headings(self.lanes[lane])[i]])

    def follow(self, pose: np.ndarray, ahead_m: float = 40.0) -> np.ndarray:
        """The polyline an IDM agent pursues: its lane from the nearest point on, continued on lanes whose
        start lies within 1 m of the current end with a compatible heading (stitched successors)."""
        *_, starts, start_h, _ = self._index()
        lane, i = self.nearest(pose)
        line = [self.lanes[lane][i:]]
        total, seen = length(line[0]), {lane}
        while total < ahead_m:
            end = self.lanes[lane][-1]
            ok = (np.linalg.norm(starts - end, axis=1) < 1.0) & (np.cos(start_h - end_heading(self.lanes[lane])) > 0.5)
            ok[list(seen)] = False
            if not ok.any():
                break
            lane = int(np.flatnonzero(ok)[0])
            seen.add(lane)
            line.append(self.lanes[lane])
            total += length(line[-1])
        return np.concatenate(line)


@dataclass
class Stitch:
    """What one outpainted tile adds: route points (world), the gaps at its joints, whether the fallback was
    taken, and the generated lanes (world) that join the map."""
    route: np.ndarray
    gaps: list[float] = field(default_factory=list)
    fallback: bool = False
    lanes: list[np.ndarray] = field(default_factory=list)


def chain(tile: dict, stitch_m: float, heading_deg: float) -> tuple[list[int], list[float]]:
    """The generated lanes the route continues on, from the tile origin (the route end, heading 0): each next
    lane starts within stitch_m of the current end with a start heading within heading_deg of the end heading;
    the nearest such start is taken. Returns lane indices and the endpoint gaps of the joints (tile frame)."""
    lanes = np.asarray(tile["lanes"], np.float64)
    free = [j for j in np.flatnonzero(tile["lane_mask"] & ~tile["fixed_lanes"]) if drivable(lanes[j])]
    end, h = np.zeros(2), 0.0
    used, gaps = [], []
    while True:
        best, best_gap = None, np.inf
        for j in free:
            if j in used:
                continue
            gap = float(np.linalg.norm(lanes[j, 0] - end))
            if gap <= stitch_m and np.cos(start_heading(lanes[j]) - h) >= np.cos(np.radians(heading_deg)) \
                    and gap < best_gap:
                best, best_gap = j, gap
        if best is None:
            return used, gaps
        used.append(best)
        gaps.append(best_gap)
        end, h = lanes[best, -1], end_heading(lanes[best])


def stitch(route: np.ndarray, tile: dict, origin: np.ndarray, rc, tile_m: float) -> Stitch:
    """Continue `route` (n, 2, world) on the tile outpainted at `origin` (its end pose)."""
    lanes = np.asarray(tile["lanes"], np.float64)
    generated = [from_frame(lanes[j], origin) for j in np.flatnonzero(tile["lane_mask"] & ~tile["fixed_lanes"])
                 if drivable(lanes[j])]
    used, gaps = chain(tile, rc.stitch_m, rc.stitch_heading_deg)
    if not used:
        straight = densify(np.array([[0.0, 0.0], [tile_m / 2, 0.0]]))
        return Stitch(from_frame(straight, origin)[1:], fallback=True, lanes=generated)
    pieces, end = [], route[-1]
    for j in used:
        pts = densify(from_frame(lanes[j], origin))
        if np.linalg.norm(pts[0] - end) < 1e-6:  # a zero gap (to rounding): the joint is already on the route
            pts = pts[1:]
        pieces.append(pts)
        end = pts[-1]
    return Stitch(np.concatenate(pieces), gaps=gaps, lanes=generated)


def context(lane_map: LaneMap, agents: list[tuple], origin: np.ndarray, data_cfg) -> tuple[list, list]:
    """The fixed nodes of the tile outpainted at `origin`: every map lane clipped to the window and to the
    partition x ≤ 0 (resampled to lane_points), nearest first, and the agents there as (state, motion code,
    static) — `agents` are (history (T, 4) [x, y, ψ, v], length, width) and are coded by `world.motion_code`."""
    half = data_cfg.tile_m / 2
    pieces = []
    for lane in lane_map.lanes:
        local = to_frame(lane, origin)
        run = longest_run((np.abs(local) <= half).all(1) & (local[:, 0] <= 0))
        if run is not None:
            pieces.append(resample(local[run], data_cfg.lane_points))
    pieces.sort(key=lambda p: float(np.linalg.norm(p, axis=1).min()))
    rows = []
    for hist, length_m, width in agents:
        hist = np.asarray(hist)
        p = to_frame(hist[-1:, :2], origin)[0]
        if (np.abs(p) > half).any() or p[0] > 0:
            continue
        past = hist[-int(round(data_cfg.history_s / DT)) - 1:-1] if len(hist) > 1 else hist  # as in cut_tile: 3 s
        code, static = motion_code(past, hist[-1, :3])
        dh = hist[-1, 2] - origin[2]
        rows.append((np.array([p[0], p[1], hist[-1, 3], np.cos(dh), np.sin(dh), length_m, width]), code, static))
    rows.sort(key=lambda r: float(np.hypot(r[0][0], r[0][1])))
    return pieces[: data_cfg.max_lanes - 1], rows[: data_cfg.max_agents - 1]


def context_tile(pieces: list, rows: list, n_new_lanes: int, n_new_agents: int, label: int, data_cfg) -> dict:
    """The padded tile arrays of `world.cut_tile` for the outpainting step: fixed nodes first, then
    n_new_lanes / n_new_agents free slots (zeros: the sampler draws them), at most max_lanes / max_agents."""
    Lmax, Amax, P = data_cfg.max_lanes, data_cfg.max_agents, data_cfg.lane_points
    Lf, Af = len(pieces), len(rows)
    L, A = min(Lmax, Lf + max(n_new_lanes, 1)), min(Amax, Af + n_new_agents)
    lanes = np.zeros((Lmax, P, 2), np.float32)
    agents = np.zeros((Amax, 7), np.float32)
    motion = np.zeros((Amax, 12), np.float32)
    static = np.zeros(Amax, bool)
    if Lf:
        lanes[:Lf] = np.stack(pieces)
    for k, (state, code, st) in enumerate(rows):
        agents[k], motion[k], static[k] = state, code, st
    return dict(lanes=lanes, lane_mask=np.arange(Lmax) < L, edges=np.zeros((Lmax, Lmax), np.int64), agents=agents,
                motion=motion, agent_mask=np.arange(Amax) < A, static=static, agent_type=np.zeros(Amax, np.int64),
                fixed_lanes=np.arange(Lmax) < Lf, fixed_agents=np.arange(Amax) < Af, label=int(label))
