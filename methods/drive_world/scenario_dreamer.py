"""User tiles in the preprocessed Scenario-Dreamer pickle format (spec: `--data-dir`, set as
`--set data.data_dir=DIR`): one `*.pkl` per tile, read into the same arrays `world.cut_tile` produces, so user
tiles go through the identical VAE / DiT / eval code. `to_scenario_dreamer` writes a tile in that format.

Schema (as the official preprocessing writes it; our reading of it [S] where marked):
- `road_points` (num_lanes, P, 2) lane centrelines in tile metres (ego-centred); resampled to data.lane_points.
- `edge_index_lane_to_lane` (2, E) and `road_connection_types` (E, 6) one-hot in the Waymo order
  {none, pred, succ, left, right, self} (= world.EDGE_TYPES), or (E, 4) in the nuPlan order {none, pred, succ,
  self}, or (E,) integer types. Edge e (src, dst) fills the ordered pair [dst, src] [S: the official code reads a
  pair's type from adjacency[dst, src]].
- `agent_states` (num_agents, ≥ 7): [x, y, speed, cosθ, sinθ, length, width] (extra columns ignored).
- `agent_types` (num_agents, 3) one-hot {vehicle, pedestrian, cyclist} or (num_agents,) integers.
- `num_lanes`, `num_agents`; `lg_type` 0 regular / 1 partitioned (the scene label, as officially; partitioned
  tiles fix the nodes at x ≤ 0 for outpainting). Optional `scene_label` [S: our key] replaces lg_type as the
  label (the generated tiles' label is their road type, so they round-trip exactly).
- optional `agent_motion_raw` (num_agents, 12) or (num_agents, 6, 2): the normalised motion code. Without it
  [S]: a straight constant-speed history over the last min(12 m, 3 s·speed), static below 0.2 m/s."""
from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from icml.cli.errors import IcmlError

from .world import EDGE_TYPES, resample

REQUIRED = ("road_points", "edge_index_lane_to_lane", "road_connection_types", "agent_states", "agent_types",
            "num_lanes", "num_agents", "lg_type")
NUPLAN_TYPES = ("none", "pred", "succ", "self")
STATIC_CODE = np.tile([1.0, 0.0], 6).astype(np.float32)  # every body point at the current pose


def _types(raw: np.ndarray) -> np.ndarray:
    raw = np.asarray(raw)
    if raw.ndim == 1:
        return raw.astype(np.int64)
    index = raw.argmax(1)
    if raw.shape[1] == len(EDGE_TYPES):
        return index.astype(np.int64)
    if raw.shape[1] == len(NUPLAN_TYPES):
        return np.array([EDGE_TYPES.index(NUPLAN_TYPES[k]) for k in index], np.int64)
    raise IcmlError(f"road_connection_types has {raw.shape[1]} columns; expected 6 (Waymo) or 4 (nuPlan)")


def _motion(states: np.ndarray, raw) -> tuple[np.ndarray, np.ndarray]:
    speed = states[:, 2]
    if raw is not None:
        code = np.asarray(raw, np.float32).reshape(len(states), 12)
        return code, np.isclose(code, STATIC_CODE, atol=1e-6).all(1)
    back = np.minimum(12.0, 3.0 * speed)[:, None] * np.linspace(1, 0, 6)[None]  # metres behind, oldest first
    code = np.stack([-back / 6.0 + 1.0, np.zeros_like(back)], -1).reshape(len(states), 12).astype(np.float32)
    static = speed < 0.2
    code[static] = STATIC_CODE
    return code, static


def from_scenario_dreamer(d: dict, cfg, name: str = "tile") -> dict:
    """One pickle's dict → the tile arrays of `world.cut_tile` (data.max_lanes / max_agents / lane_points)."""
    missing = [k for k in REQUIRED if k not in d]
    if missing:
        raise IcmlError(f"{name}: missing key(s) {', '.join(missing)} (Scenario-Dreamer format: {', '.join(REQUIRED)})")
    L, A = int(d["num_lanes"]), int(d["num_agents"])
    if L > cfg.max_lanes or A > cfg.max_agents:
        raise IcmlError(f"{name}: {L} lanes / {A} agents exceed data.max_lanes={cfg.max_lanes} / "
                         f"data.max_agents={cfg.max_agents}; raise them with --set data.max_lanes=… data.max_agents=…")
    points = np.asarray(d["road_points"], np.float64)[:L, :, :2]
    lanes = np.zeros((cfg.max_lanes, cfg.lane_points, 2), np.float32)
    for i, lane in enumerate(points):
        lanes[i] = lane if len(lane) == cfg.lane_points else resample(lane, cfg.lane_points)
    edges = np.zeros((cfg.max_lanes, cfg.max_lanes), np.int64)
    index = np.asarray(d["edge_index_lane_to_lane"], np.int64).reshape(2, -1)
    types = _types(d["road_connection_types"])
    if len(types) != index.shape[1]:
        raise IcmlError(f"{name}: {index.shape[1]} lane edges but {len(types)} road_connection_types")
    keep = (index < L).all(0)
    edges[index[1, keep], index[0, keep]] = types[keep]
    states = np.asarray(d["agent_states"], np.float32)
    states = states.reshape(A, -1) if A else np.zeros((0, 7), np.float32)
    if states.shape[1] < 7:
        raise IcmlError(f"{name}: agent_states has {states.shape[1]} columns; expected [x, y, speed, cosθ, sinθ, "
                         "length, width]")
    agents = np.zeros((cfg.max_agents, 7), np.float32)
    agents[:A] = states[:, :7]
    code, static = _motion(states, d.get("agent_motion_raw"))
    motion = np.zeros((cfg.max_agents, 12), np.float32)
    motion[:A] = code
    kinds = np.asarray(d["agent_types"])
    kinds = (kinds.argmax(1) if kinds.ndim == 2 else kinds).astype(np.int64)[:A]
    partitioned = int(d["lg_type"]) == 1
    fixed_l, fixed_a = np.zeros(cfg.max_lanes, bool), np.zeros(cfg.max_agents, bool)
    if partitioned:
        fixed_l[:L] = lanes[:L, :, 0].mean(1) <= 0
        fixed_a[:A] = agents[:A, 0] <= 0
    return dict(lanes=lanes, lane_mask=np.arange(cfg.max_lanes) < L, edges=edges, agents=agents, motion=motion,
                agent_mask=np.arange(cfg.max_agents) < A, static=np.pad(static, (0, cfg.max_agents - A)),
                agent_type=np.pad(kinds, (0, cfg.max_agents - A)), fixed_lanes=fixed_l, fixed_agents=fixed_a,
                label=int(d.get("scene_label", d["lg_type"])))


def to_scenario_dreamer(tile: dict) -> dict:
    """A tile (one of `cut_tile`'s) → the pickle's dict: every ordered lane pair as an edge, one-hot types."""
    L, A = int(tile["lane_mask"].sum()), int(tile["agent_mask"].sum())
    src, dst = np.meshgrid(np.arange(L), np.arange(L), indexing="ij")
    src, dst = src.reshape(-1), dst.reshape(-1)
    return dict(road_points=tile["lanes"][:L].copy(), edge_index_lane_to_lane=np.stack([src, dst]),
                road_connection_types=np.eye(len(EDGE_TYPES))[tile["edges"][dst, src]],
                agent_states=tile["agents"][:A].copy(), agent_types=np.eye(3)[tile["agent_type"][:A]],
                num_lanes=L, num_agents=A, lg_type=int(bool(tile["fixed_lanes"].any() or tile["fixed_agents"].any())),
                agent_motion_raw=tile["motion"][:A].copy(), scene_label=int(tile["label"]))


class _ArraysOnly(pickle.Unpickler):
    """Unpickles plain containers, numbers, strings and numpy arrays, and nothing else: a tile file is data,
    and a full unpickle would run whatever code the file names."""

    ALLOWED = {("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
               ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
               ("numpy._core.multiarray", "scalar"), ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED or (module.startswith("numpy") and name.endswith("DType")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is not numpy array data")


def load_dir(path: str, cfg) -> dict:
    """Every `*.pkl` under `path` (sorted by name) → stacked tile arrays."""
    files = sorted(Path(path).glob("*.pkl"))
    if not files:
        raise IcmlError(f"data.data_dir {path}: no *.pkl tiles (Scenario-Dreamer format)")
    tiles = []
    for f in files:
        with open(f, "rb") as fh:
            try:
                tile = _ArraysOnly(fh).load()
            except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as exc:
                raise IcmlError(f"tile '{f}' is not a Scenario-Dreamer tile of arrays ({exc})",
                                "pass tiles written by the Scenario-Dreamer preprocessing (dicts of numpy arrays)") from None
        tiles.append(from_scenario_dreamer(tile, cfg, f.name))
    return {k: np.stack([t[k] for t in tiles]) for k in tiles[0]}


def write_dir(tiles: dict, path: str) -> None:
    """Stacked tile arrays → one pickle per tile (for tests and to export generated data)."""
    Path(path).mkdir(parents=True, exist_ok=True)
    for i in range(len(tiles["label"])):
        with open(Path(path) / f"tile_{i:05d}.pkl", "wb") as fh:
            pickle.dump(to_scenario_dreamer({k: v[i] for k, v in tiles.items()}), fh)
