"""ΔSim features, its training data, and streaming closed-loop rollouts (spec: Method 7–8)."""
from __future__ import annotations


import numpy as np
import torch
from scipy.spatial import cKDTree

from . import deltasim, evaluation, stitching
from .stitching import LaneMap, from_frame
from .world import DT, World, bicycle, build_world, curb_pose, idm_accel, pure_pursuit, resample, to_frame

N_LANES_FEAT = 4


class LaneIndex:
    def __init__(self, world: World):
        self.lanes = world.lanes
        self.centroids = np.array([l.mean(0) for l in world.lanes])
        self.tree = cKDTree(np.concatenate(world.lanes))

    def offroad(self, xy: np.ndarray) -> np.ndarray:
        return self.tree.query(xy)[0] > 1.5


def features(hist: np.ndarray, idx: int, others: np.ndarray, dims: np.ndarray, lanes: LaneIndex, cfg) -> dict:
    """hist (T, 4) [x, y, ψ, v] of agent idx ending now; others (N, 4) current states of all agents;
    dims (N, 2) length, width. Everything in the agent's body frame."""
    pose = hist[-1, :3]
    H = cfg.history
    h = hist[-H:]
    if len(h) < H:
        h = np.concatenate([np.repeat(h[:1], H - len(h), 0), h])
    rel = to_frame(h[:, :2], pose)
    dpsi = h[:, 2] - pose[2]
    own = np.concatenate([rel / 20.0, np.cos(dpsi)[:, None], np.sin(dpsi)[:, None], h[:, 3:4] / 15.0], 1).reshape(-1)
    d = np.linalg.norm(others[:, :2] - pose[:2], axis=1)
    d[idx] = np.inf
    order = [j for j in np.argsort(d)[: cfg.neighbours] if np.isfinite(d[j]) and d[j] < 60]
    nb = np.zeros((cfg.neighbours, 7), np.float32)
    for k, j in enumerate(order):
        p = to_frame(others[j:j + 1, :2], pose)[0]
        a = others[j, 2] - pose[2]
        nb[k] = [p[0] / 30, p[1] / 30, others[j, 3] / 15, np.cos(a), np.sin(a), dims[j, 0] / 5, dims[j, 1] / 2.5]
    near = np.argsort(np.linalg.norm(lanes.centroids - pose[:2], axis=1))[:N_LANES_FEAT]
    lane_feat = np.zeros((N_LANES_FEAT, 20), np.float32)
    for k, j in enumerate(near):
        lane_feat[k] = (resample(to_frame(lanes.lanes[j], pose), 10) / 30.0).reshape(-1)
    return dict(self=own.astype(np.float32), nb=nb, nb_mask=np.arange(cfg.neighbours) < len(order),
                lanes=lane_feat, lane_mask=np.arange(N_LANES_FEAT) < len(near))


def body_delta(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The body-frame transition (dx, dy, dψ) from pose a to pose b."""
    p = to_frame(b[None, :2], a)[0]
    return np.array([p[0], p[1], np.angle(np.exp(1j * (b[2] - a[2])))])


def stack(feats: list[dict]) -> dict:
    return {k: torch.as_tensor(np.stack([f[k] for f in feats])) for k in feats[0]}


def sim_dataset(cfg, n_worlds: int, seed: int, steps: int = 40) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(features, Δ_gt, speed) of pure-pursuit + IDM traffic (the logged behaviour ΔSim imitates)."""
    feats, targets, speeds = [], [], []
    for w in range(n_worlds):
        rng = np.random.default_rng([seed, 7, w])
        world = build_world(300, rng, n_agents=16)
        from .world import step_agents
        for _ in range(steps):
            step_agents(world.agents, world.routes)
        lanes = LaneIndex(world)
        hist = np.array([a["history"] + [(*a["pose"], a["v"])] for a in world.agents])  # (N, T, 4)
        dims = np.array([[a["length"], a["width"]] for a in world.agents])
        for tau in range(cfg.history, hist.shape[1] - 1, 4):
            for i in range(len(world.agents)):
                feats.append(features(hist[i, :tau + 1], i, hist[:, tau], dims, lanes, cfg))
                targets.append(body_delta(hist[i, tau, :3], hist[i, tau + 1, :3]))
                speeds.append(hist[i, tau, 3])
    return stack(feats), torch.tensor(np.array(targets), dtype=torch.float32), torch.tensor(speeds, dtype=torch.float32)


def npc_action(policy_name, policy, vocab, feat_list, speeds, others_rel, cfg) -> np.ndarray:
    """The executed body-frame actions of one step for the NPCs (collision-avoidance shaping on)."""
    with torch.no_grad():
        feats = stack(feat_list)
        logits, _ = policy(feats)
        # collision-avoidance shaping: tokens that land within the margin of a neighbour's current box
        nb = feats["nb"][..., :2] * 30
        pts = vocab[None, :, None, :2] - nb[:, None]
        radius = (feats["nb"][..., 6] * 2.5)[:, None] / 2 + 1.0 + cfg.avoid_margin
        close = ((pts.norm(dim=-1) < radius) & feats["nb_mask"][:, None]).any(-1)
        logits = logits - cfg.avoid_beta * close.float() * 10.0
        k = logits.argmax(-1)
        _, delta = policy(feats, k)
        action = vocab[k].double()
        if delta is not None:
            action = action + delta.double()
        if policy_name == "deltasim_proj":
            action = deltasim.project(action, torch.as_tensor(speeds, dtype=torch.float64), cfg)
    return action.numpy()


def seed_map(world: World, start: np.ndarray, rc, data_cfg) -> tuple[LaneMap, np.ndarray]:
    """The seed scene: the procedural world's lanes in the tile window around the ego start, up to seed_m
    ahead of it, and the ego route (lane (1, 0)) clipped the same way; the rest of the road is outpainted."""
    half = data_cfg.tile_m / 2
    lanes = LaneMap()

    def clip(poly):
        local = to_frame(poly[:, :2], start)
        run = stitching.longest_run((np.abs(local) <= half).all(1) & (local[:, 0] <= rc.seed_m))
        return None if run is None else poly[run, :2]
    for lane in world.lanes:
        piece = clip(lane)
        if piece is not None:
            lanes.add(piece, "seed")
    return lanes, clip(world.routes[(1, 0)]).copy()


def run_rollout(world_seed: int, policy_name: str, policy, vocab, start_mode: str, cfg, outpaint) -> dict:
    """One streaming rollout. Whenever the ego is within frontier_m of the route end, the next tile is outpainted
    there: `outpaint(tile_index, origin, fixed_lanes, fixed_agents)` gets the tile pose and the context of
    `stitching.context` (tile frame) and returns the decoded tile (tile frame); the route is stitched onto its
    lanes (`stitching.stitch`) and its generated agents are snapped to the map and warm- or cold-started from
    their decoded motion codes."""
    rc = cfg.rollout
    rng = np.random.default_rng([world_seed, 99])
    world = build_world(rc.km * 1000 + 150, rng, n_agents=0)  # only its start is used: the seed scene
    start = world.routes[(1, 0)][5].copy()
    lanes, route = seed_map(world, start, rc, cfg.data)
    ego = dict(pose=start, v=8.0, length=4.5, width=1.9, hist=[np.array([*start, 8.0])])
    ego_i = 0  # the route point nearest the ego (searched forward: a stitched route may come back near itself)
    npcs: list[dict] = []
    ever: list[dict] = []  # every NPC spawned, for the trajectory trace
    origins, spawned_boxes, gaps, n_fallback = [], [], [], 0
    ego_path = [ego["pose"].copy()]
    travelled, n_tiles = 0.0, 0
    steps = dict(kin=[], off=[], ttc=[], jerk_first=[], jerk=[], jerk_age=[])
    collided: set[int] = set()
    serial = 0
    end = "max_steps"
    for step in range(rc.max_steps):
        for _ in range(4):  # the ego is within frontier_m of the route end: outpaint the next tile there
            seg = np.linalg.norm(np.diff(route[ego_i:], axis=0), axis=1)
            if seg.sum() >= rc.frontier_m:
                break
            d = route[-1] - route[-2]
            origin = np.array([*route[-1], np.arctan2(d[1], d[0])])
            others = [(n["hist"], n["length"], n["width"]) for n in npcs] + [(ego["hist"], ego["length"], ego["width"])]
            pieces, rows = stitching.context(lanes, others, origin, cfg.data)
            tile = outpaint(n_tiles, origin, pieces, rows)
            st = stitching.stitch(route, tile, origin, rc, cfg.data.tile_m)
            if st.fallback:  # the generated lanes do not join the route: they would be a second, unconnected
                # road across it (agents snapped onto it meet the ego's traffic head-on), so only the fallback joins
                lanes.add(np.vstack([route[-1:], st.route]), "fallback")
                n_fallback += 1
            else:
                for poly in st.lanes:
                    lanes.add(poly, "generated")
            gaps += st.gaps
            route = np.vstack([route, st.route])
            origins.append(origin)
            n_tiles += 1
            free = np.flatnonzero(tile["agent_mask"] & ~tile["fixed_agents"])
            for a, code in zip(tile["agents"][free], tile["motion"][free]):
                if len(npcs) >= rc.agents:
                    break
                pose = np.array([*from_frame(a[:2], origin), origin[2] + np.arctan2(a[4], a[3])])
                speed, static = float(max(a[2], 0.0)), bool(evaluation.is_static(code[None])[0])
                length, width = float(np.clip(a[5], 3.5, 6)), float(np.clip(a[6], 1.6, 2.3))
                pose = spawn_pose(lanes, pose, width, static)
                if pose is None:
                    continue
                present = [[*ego["pose"], ego["length"], ego["width"]]] + [[*n["hist"][-1][:3], n["length"], n["width"]]
                                                                          for n in npcs]
                if overlaps(np.array([*pose, length, width]), np.array(present)):
                    continue  # snapping can put agents on the ego or on top of each other: such a spawn is dropped
                if start_mode == "warm":
                    hist = deltasim.pseudo_history(code, static, pose, speed, cfg.sim.history)
                else:
                    hist = np.array([[*pose, 0.0 if static else speed]])
                # the history's last acceleration is where the jerk of the first executed step starts from
                acc = [(hist[-1, 3] - hist[-2, 3]) / DT] if len(hist) > 1 else []
                npcs.append(dict(hist=list(hist), length=length, width=width, id=serial, age=0, acc=acc,
                                 start=len(hist) - 1, parked=static))
                ever.append(npcs[-1])
                spawned_boxes.append([*pose, length, width])
                serial += 1
        states = np.array([n["hist"][-1] for n in npcs] + [[*ego["pose"], ego["v"]]])
        dims = np.array([[n["length"], n["width"]] for n in npcs] + [[ego["length"], ego["width"]]])
        if npcs:
            speeds = states[:-1, 3]
            if policy_name == "idm":
                actions = []
                for n in npcs:
                    s = np.asarray(n["hist"][-1])
                    if n["parked"]:  # as in the logged traffic: a parked vehicle stays
                        actions.append(np.zeros(3))
                        continue
                    pose, v = bicycle(s[:3], s[3], pure_pursuit(s[:3], s[3], lanes.follow(s[:3])),
                                      idm_accel(s[3], _gap(s, states), 0, 10.0))
                    actions.append(body_delta(s[:3], pose))
                actions = np.array(actions)
            else:
                feats = [features(np.asarray(n["hist"]), i, states, dims, lanes, cfg.sim) for i, n in enumerate(npcs)]
                actions = npc_action(policy_name, policy, vocab, feats, speeds, None, cfg.sim)
            cost = deltasim.token_cost(torch.as_tensor(actions, dtype=torch.float64),
                                       torch.as_tensor(speeds, dtype=torch.float64)).numpy()
            steps["kin"] += list(cost)
            for n, a, c in zip(npcs, actions, cost):
                s = np.asarray(n["hist"][-1])
                pose = deltasim.apply_action(s[:3], a)
                v = np.hypot(a[0], a[1]) / DT
                n["acc"].append((v - s[3]) / DT)
                if len(n["acc"]) > 1:
                    jerk = abs(n["acc"][-1] - n["acc"][-2]) / DT
                    steps["jerk"].append(jerk)
                    steps["jerk_age"].append((n["age"], jerk))
                    if n["age"] < 10:
                        steps["jerk_first"].append(jerk)
                n["hist"].append(np.array([*pose, v]))
                n["age"] += 1
            new = np.array([n["hist"][-1] for n in npcs])
            # off-road counts the moving NPCs behind the frontier: parked ones stand beside the lane by construction,
            # and past the route end (where the next tile's new half begins) no road has been outpainted yet
            d = route[-1] - route[-2]
            mapped = to_frame(new[:, :2], np.array([*route[-1], np.arctan2(d[1], d[0])]))[:, 0] <= 0
            steps["off"] += [off for n, off, m in zip(npcs, lanes.offroad(new[:, :2]), mapped) if m and not n["parked"]]
            steps["ttc"] += [_ttc(s, np.vstack([new, states[-1:]])) < 1.5 for s in new]
            boxes = np.array([[*h[:2], h[3], np.cos(h[2]), np.sin(h[2]), n["length"], n["width"]]
                              for h, n in zip(new, npcs)])
            hit = evaluation.colliding(boxes)  # the 5-circle test of the generator metric
            collided.update(n["id"] for n, h in zip(npcs, hit) if h)
        # ego: pure pursuit + IDM along the stitched route, seeing the NPCs
        gap = _gap(np.array([*ego["pose"], ego["v"]]), states[:-1]) if npcs else 100.0
        ahead = route[ego_i:ego_i + 80]
        pose, v = bicycle(ego["pose"], ego["v"], pure_pursuit(ego["pose"], ego["v"], ahead), idm_accel(ego["v"], gap, 0, 12.0))
        ego_i += int(np.argmin(np.linalg.norm(ahead[:60] - pose[:2], axis=1)))
        travelled += np.linalg.norm(pose[:2] - ego["pose"][:2])
        ego["pose"], ego["v"] = pose, v
        ego["hist"].append(np.array([*pose, v]))
        ego_path.append(pose.copy())
        npcs = [n for n in npcs if np.linalg.norm(n["hist"][-1][:2] - pose[:2]) < 80]
        if lanes.offroad(pose[None, :2])[0]:
            end = "offroad"
            break
        if travelled >= rc.km * 1000:
            end = "distance"
            break
        if np.linalg.norm(pose[:2] - route[-1]) < 5:
            end = "route_end"
            break
    kin = np.asarray(steps["kin"])
    # a violation is C > 1e-12: the exact arc of a bicycle step leaves float64 rounding (≈1e-29) in the arc term
    return dict(km=travelled / 1000, end_reason=end, n_tiles=n_tiles, spawned=serial,
                kin_violation_rate=float((kin > 1e-12).mean()) if len(kin) else 0.0,
                kin_cost_mean=float(kin.mean()) if len(kin) else 0.0,
                offroad_rate=float(np.mean(steps["off"])) if steps["off"] else 0.0,
                sim_collision_rate=len(collided) / max(serial, 1),
                ttc_violation_rate=float(np.mean(steps["ttc"])) if steps["ttc"] else 0.0,
                jerk_first_1s=float(np.mean(steps["jerk_first"])) if steps["jerk_first"] else float("nan"),
                jerk_mean=float(np.mean(steps["jerk"])) if steps["jerk"] else float("nan"),
                stitch_gap_m=float(np.mean(gaps)) if gaps else float("nan"),
                stitch_fallback_rate=n_fallback / max(n_tiles, 1),
                kin_costs=kin, jerk_age=np.asarray(steps["jerk_age"]).reshape(-1, 2), gaps=np.asarray(gaps),
                # the trace: ego poses per step, each NPC's executed poses (its pseudo-history excluded), the
                # stitched map (lanes by source), route, tile origins and every spawned agent's first box
                ego_path=np.asarray(ego_path), npc_paths=[np.asarray(n["hist"])[n["start"]:, :3] for n in ever],
                lanes=lanes.lanes, lane_source=[stitching.SOURCES.index(s) for s in lanes.sources], route=route,
                tiles=np.asarray(origins).reshape(-1, 3), spawned_boxes=np.asarray(spawned_boxes).reshape(-1, 5))


SNAP_MAX_M = 3.5  # [S] one lane width: an agent is spawned only on a lane of compatible heading this near


def spawn_pose(lanes: LaneMap, pose: np.ndarray, width: float, static: bool) -> np.ndarray | None:
    """Where a generated agent decoded at `pose` (world) is spawned: on the nearest lane point of compatible heading
    (within 90°), with the lane's heading, parked at that lane's curb when static (as in the data); None when that
    point is > SNAP_MAX_M away or no lane has a compatible heading (the agent has no road to drive on: it is not
    turned round onto a lane of the other direction)."""
    snapped = lanes.snap(pose)
    if np.linalg.norm(snapped[:2] - pose[:2]) > SNAP_MAX_M or np.cos(snapped[2] - pose[2]) < 0:
        return None
    return curb_pose(snapped, width) if static else snapped


SPAWN_CLEARANCE_M = 1.0  # [S] a spawned vehicle keeps this much beyond the collision test's distance


def overlaps(box: np.ndarray, present: np.ndarray) -> bool:
    """Would a vehicle spawned as box [x, y, ψ, length, width] come within SPAWN_CLEARANCE_M of the collision
    test's distance ((w_j + w_k)/√3.8 between the 5 body circles, `evaluation.colliding`) of any `present`
    vehicle (n, 5)? The margin is added to the distance, not to the widths: a vehicle in the next lane (3.5 m
    beside it) does not overlap."""
    rows = np.vstack([box, present])
    a = np.column_stack([rows[:, :2], np.zeros(len(rows)), np.cos(rows[:, 2]), np.sin(rows[:, 2]), rows[:, 3:5]])
    circles = evaluation.box_circles(a)
    d = np.linalg.norm(circles[0, :, None, None] - circles[None, 1:], axis=-1).min((0, 2))  # (n,)
    return bool((d < (a[0, 6] + a[1:, 6]) / np.sqrt(3.8) + SPAWN_CLEARANCE_M).any())


def _ahead(s, states):
    fwd = np.array([np.cos(s[2]), np.sin(s[2])])
    rel = states[:, :2] - s[:2]
    along = rel @ fwd
    lat = np.abs(rel @ np.array([-fwd[1], fwd[0]]))
    return along, lat


def _gap(s, states) -> float:
    """IDM's gap to the nearest leader: an agent ahead in the lane (lateral < 2 m) driving the same way (heading
    within 60°); an oncoming or crossing agent is not followed (a collision with it is counted, not avoided by
    stopping: stopping for it would end the rollout there)."""
    along, lat = _ahead(s, states)
    mask = (along > 0.5) & (lat < 2.0) & (np.cos(states[:, 2] - s[2]) > 0.5)
    return float(along[mask].min() - 4.5) if mask.any() else 100.0


def _ttc(s, states) -> float:
    along, lat = _ahead(s, states)
    mask = (along > 0.5) & (lat < 2.0)
    if not mask.any():
        return np.inf
    j = np.flatnonzero(mask)[np.argmin(along[mask])]
    closing = s[3] - states[j, 3] * np.cos(states[j, 2] - s[2])
    return float((along[j] - 4.5) / closing) if closing > 1e-6 else np.inf
