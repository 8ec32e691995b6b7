"""drive-world lane stitching: a generated lane that starts at the fixed lane's end gives gap 0 exactly and a
continuous route; gaps are measured, incompatible lanes take the named `straight` fallback; a streaming rollout
whose outpainter returns the procedural world's own continuation drives exactly on that road; agents snap to
lanes of compatible heading; the outpainting context is the map behind the partition line."""
from __future__ import annotations

import numpy as np

from icml.methods.drive_world import config, evaluation, rollout, stitching
from icml.methods.drive_world.world import build_world, resample, to_frame

EPS = np.finfo(np.float64).eps


def rc(**kw):
    r = config.RolloutConfig()
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def tile(lanes, fixed):
    L = len(lanes)
    return dict(lanes=np.stack([resample(np.asarray(l, float), 10) for l in lanes]), lane_mask=np.ones(L, bool),
                fixed_lanes=np.asarray(fixed, bool), agents=np.zeros((0, 7)), motion=np.zeros((0, 12)),
                agent_mask=np.zeros(0, bool), fixed_agents=np.zeros(0, bool))


ORIGIN = np.array([100.0, 50.0, 0.7])


def route_to(origin, n=30):
    back = np.stack([np.arange(-n, 1.0), np.zeros(n + 1)], 1)
    return stitching.from_frame(back, origin)


def test_lane_starting_at_the_fixed_lane_end_stitches_with_gap_exactly_zero():
    t = tile([[[-20, 0], [0, 0]], [[0, 0], [20, 0.5]], [[0, 0], [0, 0]], [[0.2, 0], [-15, 0]], [[0, 3.5], [20, 3.5]]],
             [True, False, False, False, False])
    t["lanes"][1, 0] = t["lanes"][0, -1]  # the generated lane begins at the fixed lane's endpoint node
    t["lanes"][2] = resample(np.array([t["lanes"][1, -1], [30.0, 2.0]]), 10)  # and its successor at that lane's end
    used, gaps = stitching.chain(t, 1.0, 30.0)
    assert used == [1, 2] and gaps == [0.0, 0.0]  # the reversed lane (gap 0.2) and the neighbour (3.5 m) are not taken
    route = route_to(ORIGIN)
    st = stitching.stitch(route, t, ORIGIN, rc(), 64.0)
    assert not st.fallback and st.gaps == [0.0, 0.0] and len(st.lanes) == 4
    full = np.vstack([route, st.route])
    step = np.linalg.norm(np.diff(full, axis=0), axis=1)
    assert step.min() > 0.1 and step.max() <= 1.0 + 64 * EPS * 200  # continuous: no repeated point, no jump
    assert np.abs(st.route[-1] - stitching.from_frame(t["lanes"][2, -1:], ORIGIN)[0]).max() <= 64 * EPS * 200


def test_gap_is_measured_and_incompatible_lanes_take_the_straight_fallback():
    t = tile([[[0.3, 0.4], [20, 0.4]]], [False])
    st = stitching.stitch(route_to(ORIGIN), t, ORIGIN, rc(), 64.0)
    assert not st.fallback and abs(st.gaps[0] - 0.5) <= 4 * EPS
    hairpin = [[[0, 0], [10, 0], [4, 1]]]  # starts at the route end, along it, then turns back on itself
    for lanes in ([[[1.2, 0], [20, 0]]], [[[0, 0], [0, 20]]], [[[0, 0], [0.5, 0]]], hairpin):  # too far, 90°, < 1 m
        st = stitching.stitch(route_to(ORIGIN), tile(lanes, [False]), ORIGIN, rc(), 64.0)
        assert st.fallback and st.gaps == []
        local = to_frame(st.route, ORIGIN)  # a straight lane of tile_m / 2 along the route-end heading
        assert np.abs(local[:, 1]).max() <= 64 * EPS * 200 and abs(local[-1, 0] - 32) <= 64 * EPS * 200
        assert np.linalg.norm(np.diff(np.vstack([ORIGIN[None, :2], st.route]), axis=0), axis=1).max() <= 1 + 1e-12


def test_drivable_lanes_turn_at_most_45_degrees_between_segments():
    arc = np.stack([20 * np.sin(np.linspace(0, 1.2, 10)), 20 * (1 - np.cos(np.linspace(0, 1.2, 10)))], 1)  # R 20 m
    assert stitching.drivable(arc) and stitching.drivable(np.array([[0.0, 0], [0, 0], [5, 0]]))  # repeated point
    step = np.radians(stitching.MAX_TURN_DEG)
    for turn, ok in ((step - 1e-6, True), (step + 1e-6, False)):
        poly = np.array([[0.0, 0.0], [5.0, 0.0], [5 + 5 * np.cos(turn), 5 * np.sin(turn)]])
        assert stitching.drivable(poly) is ok


def test_densify_keeps_every_vertex_and_spaces_at_most_1m():
    poly = np.array([[0.0, 0.0], [0.3, 0.1], [0.3, 0.1], [5.7, -2.2], [9.1, 4.0]])
    out = stitching.densify(poly)
    kept = [int(np.flatnonzero((out == p).all(1))[0]) for p in poly[[0, 1, 3, 4]]]
    assert kept == sorted(kept) and len(out) == 1 + 1 + 6 + 8
    assert np.linalg.norm(np.diff(out, axis=0), axis=1).max() <= 1.0


def test_rollout_on_the_ground_truth_continuation_drives_exactly_on_the_procedural_road():
    cfg = config.preset("smoke")
    cfg.rollout.km, cfg.rollout.max_steps = 0.3, 600
    seed = 3
    world = build_world(cfg.rollout.km * 1000 + 150, np.random.default_rng([seed, 99]), n_agents=0)  # the rollout's
    half = cfg.data.tile_m / 2

    def ground_truth(k, origin, pieces, rows):
        """The procedural world itself, clipped to the tile's new half (x ≥ 0 up to rounding)."""
        assert len(pieces) >= 1 and len(rows) == 1  # the map behind the partition line; the ego
        out = []
        for lane in world.lanes:
            local = to_frame(lane, origin)
            run = stitching.longest_run((np.abs(local) <= half).all(1) & (local[:, 0] >= -1e-9))
            if run is not None:
                out.append(resample(local[run], 64))  # ≥ the lane's 1 m vertices: stays on the polyline
        return dict(tile([[[0, 0], [1, 1]]] * len(out), [False] * len(out)), lanes=np.stack(out))

    res = rollout.run_rollout(seed, "idm", None, None, "warm", cfg, ground_truth)
    tol = 64 * EPS * np.abs(res["route"]).max()
    assert res["end_reason"] == "distance" and res["stitch_fallback_rate"] == 0 and res["n_tiles"] >= 8
    assert res["gaps"].max() <= tol and (res["gaps"] == 0).mean() > 0.5  # within a tile the joints are exact
    line = world.routes[(1, 0)][:, :2]
    a, b = line[:-1], line[1:]
    p = res["route"][:, None]
    f = np.clip(((p - a) * (b - a)).sum(-1) / ((b - a) ** 2).sum(-1), 0, 1)
    assert np.linalg.norm(p - (a + f[..., None] * (b - a)), axis=-1).min(1).max() <= tol  # on the road
    step = np.linalg.norm(np.diff(res["route"], axis=0), axis=1)
    assert step.min() > 0 and step.max() <= 1.0 + tol


def test_agents_snap_to_stitched_lanes_of_compatible_heading():
    lanes = stitching.LaneMap()
    lanes.add(np.array([[0.0, 0.0], [20.0, 0.0]]), "generated")
    lanes.add(np.array([[20.0, 1.0], [0.0, 1.0]]), "generated")  # the opposite direction, 1 m to the left
    lanes.add(np.array([[20.0, 0.0], [40.0, 3.0]]), "generated")  # the first lane's stitched successor
    tol = 64 * EPS * 40
    assert np.abs(lanes.snap(np.array([5.0, 0.9, 0.1])) - [5.0, 0.0, 0.0]).max() <= tol  # nearer lane B is reversed
    assert np.abs(lanes.snap(np.array([5.0, 0.1, np.pi - 0.1])) - [5.0, 1.0, np.pi]).max() <= tol
    line = lanes.follow(np.array([5.2, 0.2, 0.0]))  # lane A from its nearest point on, then its successor
    assert np.abs(line[0] - [5.0, 0.0]).max() <= tol and np.array_equal(line[-1], [40.0, 3.0])
    assert len(line) == 16 + 22 and np.abs(line[:16, 1]).max() == 0
    assert bool(lanes.offroad(np.array([[10.0, 2.6]]))[0]) and not bool(lanes.offroad(np.array([[10.0, 2.4]]))[0])


def test_outpainting_context_is_the_map_behind_the_partition_line():
    data = config.DataConfig()
    lanes = stitching.LaneMap()
    lanes.add(route_to(ORIGIN, 40), "seed")
    lanes.add(stitching.from_frame(np.array([[5.0, 0.0], [30.0, 0.0]]), ORIGIN), "generated")  # ahead: not given
    hist = np.array([[*stitching.from_frame(np.array([[x, 3.5]]), ORIGIN)[0], ORIGIN[2], 10.0] for x in range(-25, -4)])
    ahead = hist.copy()
    ahead[:, :2] = stitching.from_frame(np.array([[x + 30.0, 3.5] for x in range(-25, -4)]), ORIGIN)
    pieces, rows = stitching.context(lanes, [(hist, 4.5, 1.9), (ahead, 4.5, 1.9)], ORIGIN, data)
    assert len(pieces) == 1 and np.abs(pieces[0][-1]).max() <= 64 * EPS * 200 and pieces[0][:, 0].max() <= 0
    assert -data.tile_m / 2 <= pieces[0][0, 0] <= -data.tile_m / 2 + 1  # clipped to the window
    assert len(rows) == 1 and abs(rows[0][0][0] + 5) < 1e-9 and not rows[0][2]  # the moving agent behind the line
    t = stitching.context_tile(pieces, rows, 3, 2, 1, data)
    assert t["lane_mask"].sum() == 4 and t["fixed_lanes"].sum() == 1 and t["fixed_lanes"][0]
    assert t["agent_mask"].sum() == 3 and t["fixed_agents"].sum() == 1 and t["label"] == 1
    assert np.array_equal(t["lanes"][0], pieces[0].astype(np.float32)) and not t["lanes"][1:].any()


def test_a_spawn_overlapping_a_present_vehicle_is_rejected_but_not_one_in_the_next_lane():
    ego = np.array([[10.0, 5.0, 0.3, 4.5, 1.9]])
    fwd, left = np.array([np.cos(0.3), np.sin(0.3)]), np.array([-np.sin(0.3), np.cos(0.3)])

    def at(along, lateral, heading=0.3):
        return np.array([*(ego[0, :2] + along * fwd + lateral * left), heading, 4.5, 1.9])
    assert rollout.overlaps(at(0, 0), ego) and rollout.overlaps(at(0, 0, 0.3 + np.pi), ego)  # on the ego
    # the same lane: body circles 0.4·4.5 m from each centre, the test's distance 1.9·2/√3.8, 1 m clearance
    reach = 2 * 0.4 * 4.5 + 2 * 1.9 / np.sqrt(3.8) + rollout.SPAWN_CLEARANCE_M
    assert rollout.overlaps(at(reach - 1e-6, 0), ego) and not rollout.overlaps(at(reach + 1e-6, 0), ego)
    assert not rollout.overlaps(at(0, 3.5), ego)  # side by side in the next lane
    assert rollout.overlaps(at(0, 3.5), np.vstack([ego, at(0.5, 3.0)]))  # … unless another vehicle is there


def test_idm_follows_only_agents_driving_the_same_way():
    me = np.array([0.0, 0.0, 0.0, 10.0])
    ahead = np.array([[12.0, 0.5, 0.2, 5.0]])  # same direction, 12 m ahead
    assert abs(rollout._gap(me, ahead) - (12.0 - 4.5)) <= 8 * EPS
    for heading in (np.pi, -np.pi / 2, 1.1):  # oncoming, crossing, circling past 60°
        assert rollout._gap(me, np.array([[12.0, 0.5, heading, 5.0]])) == 100.0
    assert rollout._gap(me, np.array([[-6.0, 0.0, 0.0, 5.0], [12.0, 2.5, 0.0, 5.0]])) == 100.0  # behind; next lane


def test_a_fallback_tile_adds_only_the_fallback_lane_and_agents_off_every_lane_are_not_spawned():
    cfg = config.preset("smoke")
    cfg.rollout.km, cfg.rollout.max_steps = 0.15, 400
    moving = np.stack([np.linspace(-1, 1, 6), np.zeros(6)], 1).reshape(-1)  # a straight 12 m of history

    def crossing_road(k, origin, pieces, rows):
        """A generated road at 90° to the route (no lane to stitch onto), an agent 20 m beside the route on that
        road (off every lane the map keeps) and one 6 m ahead on the route's continuation."""
        t = tile([[[10, -30], [10, 30]], [[12, 30], [12, -30]]], [False, False])
        agents = np.array([[10, 20, 8, 0, 1, 4.5, 1.9], [6, 0, 8, 1, 0, 4.5, 1.9]], float)
        return dict(t, agents=agents, motion=np.stack([moving, moving]), agent_mask=np.ones(2, bool),
                    fixed_agents=np.zeros(2, bool))

    res = rollout.run_rollout(5, "idm", None, None, "warm", cfg, crossing_road)
    sources = [stitching.SOURCES[i] for i in res["lane_source"]]
    assert res["end_reason"] == "distance" and res["stitch_fallback_rate"] == 1 and res["n_tiles"] >= 4
    assert "generated" not in sources and sources.count("fallback") == res["n_tiles"]
    assert 1 <= res["spawned"] <= res["n_tiles"]  # at most the on-route agent of each tile
    assert res["offroad_rate"] == 0.0  # NPCs ahead of the route end (no road outpainted there yet) are not counted
    boxes = res["spawned_boxes"]
    lanes = stitching.LaneMap()
    for poly in res["lanes"]:
        lanes.add(poly, "seed")
    assert not lanes.offroad(boxes[:, :2]).any()  # every spawned agent on a lane the map keeps
    local = np.array([to_frame(b[None, :2], o)[0] for b, o in zip(boxes, res["tiles"])])
    assert np.abs(local[:, 1]).max() <= 1e-9 and np.allclose(local[:, 0], 6.0, atol=1e-9)


def test_parked_vehicles_stand_at_the_curb_and_nobody_queues_behind_them():
    from icml.methods.drive_world.world import CURB_GAP_M, LANE_W, step_agents
    at_rest = moving = 0
    for w in range(4):
        world = build_world(300, np.random.default_rng([0, 7, w]), n_agents=16)
        pts = np.concatenate(world.lanes)
        for a in world.agents:
            if a["parked"]:  # beside its direction's outermost lane, on the right: every lane farther than that
                d = np.linalg.norm(pts - a["pose"][:2], axis=1).min()
                assert abs(d - (LANE_W / 2 + a["width"] / 2 + CURB_GAP_M)) <= 64 * EPS * 300
                assert a["route"][1] == max(k for dd, k in world.routes if dd == a["route"][0])
        for _ in range(40):
            step_agents(world.agents, world.routes)
        v = np.array([[h[3] for h in a["history"][10:]] for a in world.agents if not a["parked"]])
        at_rest, moving = at_rest + int((v < 0.5).sum()), moving + v.size
    assert at_rest / moving < 0.01  # in-lane parking left 9 % of the moving agents' steps at rest (queued for good)


def test_a_decoded_parked_agent_is_spawned_at_the_curb_and_the_ego_drives_past_it():
    from icml.methods.drive_world.world import CURB_GAP_M, LANE_W
    cfg = config.preset("smoke")
    cfg.rollout.km, cfg.rollout.max_steps = 0.15, 400

    def parked_on_the_route(k, origin, pieces, rows):
        t = tile([[[10, -30], [10, 30]]], [False])  # nothing to stitch onto: the straight fallback continues the route
        return dict(t, agents=np.array([[6, 0, 0, 1, 0, 4.5, 2.0]]), motion=evaluation.STATIC_CODE[None],
                    agent_mask=np.ones(1, bool), fixed_agents=np.zeros(1, bool))

    res = rollout.run_rollout(5, "idm", None, None, "warm", cfg, parked_on_the_route)
    assert res["end_reason"] == "distance" and res["spawned"] >= 3 and res["offroad_rate"] == 0.0
    for path, origin in zip(res["npc_paths"], res["tiles"]):
        local = to_frame(path[:, :2], origin)  # right of the route, just off its lane, and it never moves
        assert np.abs(local - [6.0, -(LANE_W / 2 + 1.0 + CURB_GAP_M)]).max() <= 1e-9


def test_spawn_pose_snaps_to_a_lane_of_compatible_heading_parks_static_agents_at_its_curb_or_rejects():
    from icml.methods.drive_world.world import CURB_GAP_M, LANE_W
    lanes = stitching.LaneMap()
    lanes.add(np.array([[0.0, 0.0], [20.0, 0.0]]), "fallback")
    tol = 64 * EPS * 20
    assert np.abs(rollout.spawn_pose(lanes, np.array([5.0, 1.0, 0.2]), 2.0, False) - [5, 0, 0]).max() <= tol
    curb = rollout.spawn_pose(lanes, np.array([5.0, -2.5, 0.2]), 2.0, True)
    assert np.abs(curb - [5, -(LANE_W / 2 + 1.0 + CURB_GAP_M), 0]).max() <= tol  # parked on the right, off the lane
    assert rollout.spawn_pose(lanes, np.array([5.0, 1.0, np.pi]), 2.0, False) is None  # oncoming: not turned round
    assert rollout.spawn_pose(lanes, np.array([5.0, rollout.SNAP_MAX_M + 0.01, 0.0]), 2.0, False) is None  # no road
    assert rollout.spawn_pose(lanes, np.array([5.0, rollout.SNAP_MAX_M - 0.01, 0.0]), 2.0, False) is not None


def test_context_latents_depend_only_on_the_fixed_nodes():
    import torch

    from icml.methods.drive_world import pipeline
    cfg = config.preset("smoke")
    torch.manual_seed(0)
    vae = pipeline.build_vae(cfg).eval()
    pieces = [resample(np.array([[-30.0, -1.75], [0.0, -1.75]]), 10),
              resample(np.array([[0.0, 1.75], [-30.0, 1.75]]), 10)]
    rows = [(np.array([-8.0, -1.75, 9.0, 1.0, 0.0, 4.5, 1.9]), np.linspace(-1, 1, 12), False)]

    def fixed_latents(n_new_lanes, n_new_agents, garbage):
        t = stitching.context_tile(pieces, rows, n_new_lanes, n_new_agents, 1, cfg.data)
        if garbage:  # what the free slots hold must not matter: the sampler overwrites them
            rng = np.random.default_rng(1)
            t["lanes"][2:] = rng.normal(0, 20, t["lanes"][2:].shape)
            t["agents"][1:] = rng.normal(0, 5, t["agents"][1:].shape)
        ml, ma = pipeline.context_latents(vae, {k: np.asarray(v)[None] for k, v in t.items()}, cfg.data.tile_m / 2)
        return ml[0, :2], ma[0, :1]
    ref_l, ref_a = fixed_latents(3, 2, False)
    for n_l, n_a, garbage in ((3, 2, True), (7, 5, False), (1, 0, True)):
        ml, ma = fixed_latents(n_l, n_a, garbage)
        assert torch.equal(ml, ref_l) and torch.equal(ma, ref_a)
