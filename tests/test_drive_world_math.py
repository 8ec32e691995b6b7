"""drive-world identities: the MeanFlow JVP target against finite differences, zero-initialised gates equal
plain attention, fixed nodes bit-identical after sampling, the exact projection zeroes every kinematic cost,
the pseudo-history ends at the current pose, the (t, r) sampler, motion codes, tiles and metrics."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from icml.methods.drive_world import config, deltasim, evaluation, meanflow, models, world

EPS64 = torch.finfo(torch.float64).eps


def tiny_dit(rel_gate=True, seed=0, scale=0.3):
    torch.manual_seed(seed)
    dit = models.EGRDiT(4, 3, 16, 8, 2, 1, 8, 6, 5, rel_gate=rel_gate).double()
    with torch.no_grad():  # leave the zero init so that every path (gates, adaLN, outputs) is exercised
        for p in dit.parameters():
            p.add_(scale * torch.randn_like(p))
    return dit


def scene(seed=0, B=3):
    g = torch.Generator().manual_seed(seed)
    lm = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0], [1] * 6])[:B].bool()
    am = torch.tensor([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1] * 5])[:B].bool()
    cond = dict(lane_mask=lm, agent_mask=am, label=torch.tensor([0, 1, 2])[:B])
    return cond, torch.randn(B, 6, 4, generator=g, dtype=torch.float64), torch.randn(B, 5, 3, generator=g,
                                                                                     dtype=torch.float64)


def test_meanflow_jvp_equals_finite_differences_along_v_theta_1_0():
    dit = tiny_dit(scale=0.1)  # a smooth network: at 0.3 the perturbed attention has kinks within 1e-5 of t
    cond, zl, za = scene()
    t = torch.tensor([0.9, 0.6, 0.35], dtype=torch.float64)
    r = torch.tensor([0.2, 0.6, 0.1], dtype=torch.float64)
    free_l, free_a = cond["lane_mask"].double(), cond["agent_mask"].double()
    (vl, va), (dl, da) = meanflow.mean_velocity_target(dit, zl, za, r, t, cond, free_l, free_a)
    with torch.no_grad():
        vl_ref, va_ref = dit(zl, za, t, t, cond)  # v_θ = u_θ(z, t, t)
        assert torch.equal(vl, vl_ref * free_l[..., None]) and torch.equal(va, va_ref * free_a[..., None])

        def error(h):  # central differences along the tangent (v_θ, dt = 1, dr = 0)
            up = dit(zl + h * vl, za + h * va, r, t + h, cond)
            dn = dit(zl - h * vl, za - h * va, r, t - h, cond)
            fd = torch.cat([((up[0] - dn[0]) / (2 * h)).flatten(), ((up[1] - dn[1]) / (2 * h)).flatten()])
            exact = torch.cat([dl.flatten(), da.flatten()])
            return ((fd - exact).norm() / exact.norm()).item()
        e3, e4 = error(1e-3), error(1e-4)
    # the O(h²) truncation error of central differences falls 100× per decade of h, as it must for the exact
    # derivative; at h = 1e-4 it is ≈ 1e-9 relative, rounding (≈ eps·|u|/(h·|∂u|) ≈ 1e-11) far below
    assert e4 < 1e-8
    assert 50 < e3 / e4 < 200
    assert dl.abs().max() > 1e-2  # a non-trivial derivative
    assert not dl.requires_grad and not da.requires_grad


def test_meanflow_at_r_equals_t_is_flow_matching():
    """With r = t the correction (t − r)·sg(∂_t u) vanishes: the MeanFlow loss is the adaptive-weighted
    flow-matching loss ‖u_θ(z_t, t, t) − (ε − x)‖² on the same draws."""
    dit = tiny_dit().float()
    cond, xl, xa = scene()
    xl, xa = xl.float(), xa.float()
    fixed_l, fixed_a = torch.zeros(3, 6, dtype=torch.bool), torch.zeros(3, 5, dtype=torch.bool)
    cfg = config.DiTConfig(r_equals_t=1.0, forced_frac=0.0)
    loss, _ = meanflow.scene_loss(dit, xl, xa, cond, fixed_l, fixed_a, cfg, "meanflow", torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)  # the same draws in the same order: ε_lanes, ε_agents, (t, r)
    el, ea = torch.randn(xl.shape, generator=g), torch.randn(xa.shape, generator=g)
    t, r = meanflow.sample_t_r(3, cfg, g)
    assert torch.equal(t, r)
    tt = t[:, None, None]
    with torch.no_grad():
        ul, ua = dit((1 - tt) * xl + tt * el, (1 - tt) * xa + tt * ea, t, t, cond)
    lm, am = cond["lane_mask"].float(), cond["agent_mask"].float()
    per = ((((ul - (el - xl)) ** 2).sum(-1) * lm).sum(1) + (((ua - (ea - xa)) ** 2).sum(-1) * am).sum(1)) / (lm.sum(1) + am.sum(1))
    expected = ((per + 1e-3) ** (-0.8) * per).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)  # float32 sums of ~40 terms


def test_t_r_sampler():
    cfg = config.DiTConfig()
    t, r = meanflow.sample_t_r(20_000, cfg, torch.Generator().manual_seed(0))
    forced = int(round(0.15 * 20_000))
    assert (t >= r).all()
    assert (t[-forced:] == 1).all() and (r[-forced:] == 0).all()
    same = (t[:-forced] == r[:-forced]).float().mean()
    assert abs(same - 0.75) < 0.02  # binomial sd ≈ 0.0033 at n = 17 000
    assert (t[:-forced] < 1).all() and (r[:-forced] > 0).all()


def test_zero_initialised_gates_are_plain_attention():
    torch.manual_seed(0)
    gated = models.EdgeGatedAttention(16, 12, 4, 8, rel_gate=True)
    plain = models.EdgeGatedAttention(16, 12, 4, 8, rel_gate=False)
    plain.load_state_dict({k: v for k, v in gated.state_dict().items() if k in plain.state_dict()})
    xq, xk = torch.randn(2, 5, 16), torch.randn(2, 7, 12)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0, 0], [1] * 7]).bool()
    assert torch.equal(gated(xq, xk, mask), plain(xq, xk, mask))  # bias + 0 and weights · 1 are exact
    with torch.no_grad():
        gated.gate.weight.normal_()
        gated.edge[-1].weight.normal_()
    assert not torch.allclose(gated(xq, xk, mask), plain(xq, xk, mask))
    # a fresh DiT block (adaLN-Zero) is the identity on its input
    block = models.Block(16, 12, 4, 8, True, cond_d=10)
    assert torch.equal(block(xq, xk, mask, torch.randn(2, 10)), xq)


@pytest.mark.parametrize("solver,steps", [("meanflow", 1), ("meanflow", 3), ("heun", 4), ("euler", 1)])
def test_fixed_nodes_bit_identical_after_sampling(solver, steps):
    dit = tiny_dit().float()
    cond, xl, xa = scene()
    xl, xa = xl.float(), xa.float()
    fl = torch.rand(3, 6, generator=torch.Generator().manual_seed(1)) < 0.5
    fa = torch.rand(3, 5, generator=torch.Generator().manual_seed(2)) < 0.5
    zl, za = meanflow.sample(dit, cond, 4, 3, steps, solver, 4.0, 5.0, fixed=(xl, xa, fl, fa),
                             generator=torch.Generator().manual_seed(0))
    assert torch.equal(zl[fl], xl[fl]) and torch.equal(za[fa], xa[fa])
    assert not torch.equal(zl[~fl], xl[~fl])


def test_projection_zeroes_every_cost_term_and_executes_within_limits():
    cfg = config.SimConfig()
    g = torch.Generator().manual_seed(0)
    action = torch.randn(20_000, 3, generator=g, dtype=torch.float64) * torch.tensor([3.0, 1.0, 1.0], dtype=torch.float64)
    v = torch.rand(20_000, generator=g, dtype=torch.float64) * 30
    assert (deltasim.token_cost(action, v) > 0).float().mean() > 0.9
    p = deltasim.project(action, v, cfg)
    assert (deltasim.token_cost(p, v) == 0).all()
    d = torch.hypot(p[:, 0], p[:, 1])
    assert ((d / 0.1 - v).abs() <= cfg.a_max * 0.1 + 1e-9).all() and (p[:, 2].abs() <= cfg.omega_max * 0.1).all()


def test_token_costs_closed_forms():
    v = torch.tensor([10.0], dtype=torch.float64)
    straight = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)  # exactly v·Δt ahead
    assert deltasim.token_cost(straight, v).item() == 0
    reverse = torch.tensor([[-0.15, 0.0, 0.0]], dtype=torch.float64)
    # reverse: ((0.1 − 0.05)/0.05)² = 1; arc residual: |atan2(0, −0.15) − 0| = π → 0.8·((π − 0.35)/0.35)²;
    # longitudinal: |1.5 − 10|/0.1 = 85 → 0.3·((85 − 6)/6)²; yaw, curvature and lateral terms are 0
    expected = 1.0 + 0.8 * ((np.pi - 0.35) / 0.35) ** 2 + 0.3 * ((85 - 6) / 6) ** 2
    assert deltasim.token_cost(reverse, v).item() == pytest.approx(expected, rel=1e-12)


def test_pseudo_history_ends_at_current_pose():
    rng = np.random.default_rng(0)
    pose = np.array([12.0, -3.0, 0.7])
    for _ in range(20):
        code = rng.uniform(-1, 1, 12)
        h = deltasim.pseudo_history(code, False, pose, 9.0, 10)
        assert h.shape == (10, 4)
        assert np.array_equal(h[-1, :3], pose) and h[-1, 3] == 9.0
    static = deltasim.pseudo_history(code, True, pose, 3.0, 10)
    assert np.array_equal(static[:, :3], np.tile(pose, (10, 1))) and (static[:, 3] == 0).all()


def test_motion_code_of_static_and_straight_agents():
    pose = np.array([5.0, 2.0, 0.3])
    parked = np.tile([*pose, 0.0], (30, 1))
    code, static = world.motion_code(parked, pose)
    assert static and np.array_equal(code, evaluation.STATIC_CODE)
    s = np.arange(-30, 0) * 1.0  # 10 m/s, 30 frames behind the pose along its heading
    hist = np.stack([pose[0] + s * np.cos(0.3), pose[1] + s * np.sin(0.3), np.full(30, 0.3), np.full(30, 10.0)], 1)
    code, static = world.motion_code(hist, pose)
    body = code.reshape(6, 2)
    assert not static
    # 12 m back to the pose in 6 arc-length samples: x = −12 … 0 → (x/6 + 1), y = 0
    assert np.allclose(body[:, 0], np.linspace(-12, 0, 6) / 6 + 1, atol=1e-9) and np.allclose(body[:, 1], 0, atol=1e-9)


def test_tiles_have_typed_edges_that_join():
    cfg = config.preset("smoke").data
    tiles = world.make_tiles(cfg, 12, 0, 0.5)
    one = [{k: v[i] for k, v in tiles.items()} for i in range(12)]
    gaps = sum((evaluation.endpoint_gaps(t) for t in one), [])
    assert gaps and max(gaps) < 1e-4  # successive segments share their split point (float32 coordinates)
    e = tiles["edges"]
    assert ((e == world.SUCC) == (e.transpose(0, 2, 1) == world.PRED)).all()
    assert ((e == world.LEFT) == (e.transpose(0, 2, 1) == world.RIGHT)).all()
    assert tiles["fixed_lanes"].any() and (tiles["fixed_lanes"] <= tiles["lane_mask"]).all()


def test_vocabulary_is_a_k_disk_cover():
    vocab = deltasim.build_vocabulary(64, np.random.default_rng(0))
    err = deltasim.corner_error(vocab, vocab) + np.eye(64) * 1e9
    assert vocab.shape == (64, 3) and err.min() > 0.035


def test_metric_zero_cases():
    assert evaluation.jsd([1.0, 2, 3], [1.0, 2, 3], 0, 5, 1) == 0
    assert evaluation.frechet_1d([1.0, 2, 4], [1.0, 2, 4]) == 0
    assert evaluation.jsd([0.5], [4.5], 0, 5, 1) == pytest.approx(np.log(2), rel=1e-12)  # disjoint: ln 2


def _policy_batch(seed=0, n=24, vocab_size=16):
    rng = np.random.default_rng(seed)
    vocab = torch.as_tensor(deltasim.build_vocabulary(vocab_size, rng))
    g = torch.Generator().manual_seed(seed)
    feats = dict(self=torch.randn(n, 10 * 5, generator=g), nb=torch.randn(n, 8, 7, generator=g),
                 nb_mask=torch.rand(n, 8, generator=g) < 0.5, lanes=torch.randn(n, 4, 20, generator=g),
                 lane_mask=torch.ones(n, 4, dtype=torch.bool))
    target = torch.stack([torch.rand(n, generator=g) * 2, 0.1 * torch.randn(n, generator=g),
                          0.02 * torch.randn(n, generator=g)], 1)
    speed = torch.rand(n, generator=g) * 20
    torch.manual_seed(seed)
    policy = deltasim.NPCPolicy(10, 8, 16, 1, 2, vocab_size)
    return policy, feats, target, speed, vocab


def test_dkal_adds_exactly_coef_times_the_capped_alignment_term():
    """loss(coef) = loss(0) + coef·DKAL(ℓ, min(C, cap)): at zero weight ΔSim with DKAL is plain ΔSim, and the
    term is the centred squared misalignment of the logits with −βC."""
    policy, feats, target, speed, vocab = _policy_batch()
    plain, _ = deltasim.policy_loss(policy, feats, target, speed, vocab, 0.0, 1.0, 10.0)
    with_zero, _ = deltasim.policy_loss(policy, feats, target, speed, vocab, 0.0, 1.0, float("inf"))
    assert torch.equal(plain, with_zero)  # the cap is inert without DKAL
    k_gt = torch.as_tensor(deltasim.corner_error(target.numpy(), vocab.numpy()).argmin(1))
    logits, _ = policy(feats, k_gt)
    cost = deltasim.token_cost(vocab[None], speed[:, None])
    for coef, cap in ((0.05, 10.0), (0.3, 3.0), (0.05, float("inf"))):
        loss, _ = deltasim.policy_loss(policy, feats, target, speed, vocab, coef, 2.0, cap)
        term = deltasim.dkal_term(logits, cost.clamp(max=cap), 2.0)
        torch.testing.assert_close(loss - plain, coef * term, rtol=1e-5, atol=0)


def test_dkal_term_invariances_minimiser_and_capped_scale():
    g = torch.Generator().manual_seed(3)
    vocab = torch.as_tensor(deltasim.build_vocabulary(64, np.random.default_rng(3))).double()
    speed = torch.linspace(0, 25, 40, dtype=torch.float64)
    cost = deltasim.token_cost(vocab[None], speed[:, None])
    assert cost.max() > 300  # the official normalised costs reach ~10³ at speed: why DKAL needs the cap
    capped = cost.clamp(max=10.0)
    logits = torch.randn(40, 64, generator=g, dtype=torch.float64)
    base = deltasim.dkal_term(logits, capped, 1.5)
    shift = torch.randn(40, 1, generator=g, dtype=torch.float64)  # per-row constants in logits and costs
    torch.testing.assert_close(deltasim.dkal_term(logits + shift, capped + 3 * shift, 1.5), base,
                               rtol=64 * EPS64, atol=0)
    # zero exactly at the aligned logits ℓ = −βC + c (up to rounding of the centring)
    assert deltasim.dkal_term(-1.5 * capped + shift, capped, 1.5) < 1e3 * EPS64
    # with zero logits it is β²·Var_k(C̃), bounded by β²·cap²/4 (Popoviciu): the cost term's scale
    zero = deltasim.dkal_term(torch.zeros_like(capped), capped, 1.5)
    torch.testing.assert_close(zero, 1.5 ** 2 * capped.var(-1, unbiased=False).mean(), rtol=64 * EPS64, atol=0)
    assert zero <= 1.5 ** 2 * 10.0 ** 2 / 4
    assert deltasim.dkal_term(torch.zeros_like(cost), cost, 1.5) > 1e3 * zero  # uncapped: swamps a CE of ~5


def test_generated_tiles_take_their_counts_from_the_training_tiles():
    """Issue 47: the generators are conditioned on lane / agent counts and labels of training tiles drawn at
    random (seeded), not on those of the held-out tiles they are scored against."""
    from icml.methods.drive_world import pipeline

    cfg = config.preset("smoke").data
    train = world.make_tiles(cfg, 40, 3, 0.3)
    cond = pipeline.generation_cond(train, 300, seed=7)
    idx = np.random.default_rng(7).integers(0, 40, 300)
    for key in ("lane_mask", "agent_mask", "label"):
        assert np.array_equal(cond[key].numpy(), train[key][idx]), key
    lanes = cond["lane_mask"].sum(1).numpy()
    assert len(np.unique(lanes)) > 1 and set(lanes) <= set(train["lane_mask"].sum(1))
    again = pipeline.generation_cond(train, 300, seed=8)["lane_mask"]
    assert not torch.equal(again, cond["lane_mask"])  # another seed, another draw


def test_energy_distance_closed_forms_and_toy_mixture():
    from icml.methods.drive_world import toy

    # two point masses a, b: E‖X−Y‖ = ‖a−b‖ and the within terms vanish, so ED = 2‖a−b‖
    a, b = torch.zeros(50, 2), torch.full((40, 2), 3.0)
    assert abs(toy.energy_distance(a, b) - 2 * 18 ** 0.5) < 1e-12
    x = toy.mixture(4000, torch.Generator().manual_seed(0))
    # against itself: 2·S/n² − 2·S/(n(n−1)) = −2·m/n, m the mean distance over distinct pairs (S their sum)
    n, pairs = len(x), torch.cdist(x.double(), x.double())
    m = pairs.sum() / (n * (n - 1))
    assert abs(toy.energy_distance(x, x) + 2 * m / n) < 1e3 * EPS64
    y = toy.mixture(4000, torch.Generator().manual_seed(1))
    assert abs(toy.energy_distance(x, y)) < 5e-3 < toy.energy_distance(torch.zeros(100, 2), y)
    radii = x.double().norm(dim=1)
    assert abs(radii.mean() - toy.RADIUS) < 0.01 and abs(radii.std() - toy.STD) < 0.01
    spokes = torch.atan2(x[:, 1], x[:, 0]).double() * 8 / (2 * np.pi)  # angle in units of 2π/8
    off = (spokes - spokes.round()).abs() * 2 * np.pi / 8  # radians from the nearest centre's direction
    assert off.max() < 6 * toy.STD / (toy.RADIUS - 6 * toy.STD)  # every draw within 6σ of one of 8 centres
    assert len(torch.unique(spokes.round() % 8)) == 8


def test_toy_uses_the_scene_meanflow_loss_and_sampler():
    """At r = t the toy MeanFlow loss is the flow-matching loss (the scene identity on a 2-D node), and
    one MeanFlow step is z − u(z, 0, 1)."""
    from icml.methods.drive_world import toy

    torch.manual_seed(0)
    net = toy.ToyNet(32, 8).double()
    cfg = config.preset("smoke").dit
    cfg.r_equals_t, cfg.forced_frac = 1.0, 0.0
    x = toy.mixture(64, torch.Generator().manual_seed(0)).double()
    _, raw_mf = toy.toy_loss(net, x, cfg, "meanflow", torch.Generator().manual_seed(5))
    # against a hand-built flow-matching loss on the same draws (ε, then the (t, r) pair with r = t)
    g = torch.Generator().manual_seed(5)
    eps = torch.randn((64, 1, 2), generator=g).double()
    t, _ = meanflow.sample_t_r(64, cfg, g)
    z = (1 - t[:, None]) * x + t[:, None] * eps[:, 0]
    _, u = net(torch.zeros(64, 0, 1, dtype=torch.float64), z[:, None], t, t, None)
    per = ((u[:, 0] - (eps[:, 0] - x)) ** 2).sum(-1)
    torch.testing.assert_close(raw_mf, per.mean(), rtol=1e-12, atol=0)
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    one = toy.toy_sample(net.float(), 16, "meanflow", 1, 5.0, g1)
    z1 = torch.randn((16, 1, 2), generator=g2)[:, 0]
    _, u = net.float()(torch.zeros(16, 0, 1), z1[:, None], torch.zeros(16), torch.ones(16), None)
    torch.testing.assert_close(one, (z1 - u[:, 0]).clamp(-5, 5), rtol=0, atol=0)


def test_scenario_dreamer_format_round_trips_generated_tiles_bit_for_bit(tmp_path):
    from icml.methods.drive_world import scenario_dreamer

    cfg = config.preset("smoke").data
    tiles = world.make_tiles(cfg, 6, 11, 0.5)
    for key in ("agents", "motion", "agent_mask", "static", "agent_type", "fixed_agents"):
        tiles[key][0] = 0  # an empty tile edge case: no agents at all
    scenario_dreamer.write_dir(tiles, tmp_path)
    back = scenario_dreamer.load_dir(tmp_path, cfg)
    assert set(back) == set(tiles)
    for key in tiles:
        assert back[key].dtype == tiles[key].dtype and np.array_equal(back[key], tiles[key]), key
    assert tiles["fixed_lanes"].any()  # partitioned tiles were among them


def test_scenario_dreamer_nuplan_types_resampling_and_default_motion():
    from icml.methods.drive_world import scenario_dreamer

    cfg = config.preset("smoke").data
    line = np.stack([np.linspace(0, 20, 41), np.zeros(41)], 1)
    d = dict(road_points=np.stack([line, line + [0, 3.5]]), edge_index_lane_to_lane=np.array([[0, 1, 0], [1, 0, 0]]),
             road_connection_types=np.eye(4)[[2, 1, 3]],  # nuPlan: succ, pred, self
             agent_states=np.array([[5, 0, 10, 1, 0, 4.5, 2], [8, 3.5, 0.1, 1, 0, 4.5, 2]]),
             agent_types=np.eye(3)[[0, 0]], num_lanes=2, num_agents=2, lg_type=0)
    tile = scenario_dreamer.from_scenario_dreamer(d, cfg)
    # edge (src 0, dst 1) of type succ fills the ordered pair [1, 0]; nuPlan self → world's SELF
    assert tile["edges"][1, 0] == world.EDGE_TYPES.index("succ") and tile["edges"][0, 1] == world.EDGE_TYPES.index("pred")
    assert tile["edges"][0, 0] == world.EDGE_TYPES.index("self") and tile["edges"][1, 1] == 0
    # 41 points at 0.5 m → lane_points at equal arc length along the same straight line
    np.testing.assert_allclose(tile["lanes"][0, :, 0], np.linspace(0, 20, cfg.lane_points), rtol=0, atol=1e-5)
    # no motion given: 10 m/s → a straight 12 m history; 0.1 m/s → static (all points at the pose)
    body = (tile["motion"][0].reshape(6, 2) - [1, 0]) * 6
    np.testing.assert_allclose(body, np.stack([-np.linspace(12, 0, 6), np.zeros(6)], 1), atol=1e-5)
    assert tile["static"][:2].tolist() == [False, True]
    assert tile["label"] == 0 and not tile["fixed_lanes"].any()
    with pytest.raises(Exception, match="missing key"):
        scenario_dreamer.from_scenario_dreamer({k: v for k, v in d.items() if k != "agent_states"}, cfg)


def test_a_tile_file_that_names_code_is_refused_and_runs_nothing(tmp_path):
    """Tiles are pickles (the Scenario-Dreamer format); they are read as arrays only, so a planted file
    that would call a function when unpickled is one error line, and the function never runs."""
    import pickle
    from pathlib import Path

    from icml.cli.errors import IcmlError
    from icml.methods.drive_world import config, scenario_dreamer

    marker = tmp_path / "ran"

    class Planted:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (tmp_path / "tiles").mkdir()
    (tmp_path / "tiles" / "tile_00000.pkl").write_bytes(pickle.dumps({"road_points": Planted()}))
    with pytest.raises(IcmlError, match="not a Scenario-Dreamer tile of arrays"):
        scenario_dreamer.load_dir(tmp_path / "tiles", config.preset("smoke").data)
    assert not marker.exists()
