"""drive-world identities: the MeanFlow JVP target against finite differences, zero-initialised gates equal
plain attention, fixed nodes bit-identical after sampling, the exact projection zeroes every kinematic cost,
the pseudo-history ends at the current pose, the (t, r) sampler, motion codes, tiles and metrics."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from icml.methods.drive_world import config, deltasim, evaluation, meanflow, models, world

EPS64 = torch.finfo(torch.float64).eps


def tiny_dit(rel_gate=True, seed=0):
    torch.manual_seed(seed)
    dit = models.EGRDiT(4, 3, 16, 8, 2, 1, 8, 6, 5, rel_gate=rel_gate).double()
    with torch.no_grad():  # leave the zero init so that every path (gates, adaLN, outputs) is exercised
        for p in dit.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return dit


def scene(seed=0, B=3):
    g = torch.Generator().manual_seed(seed)
    lm = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0], [1] * 6])[:B].bool()
    am = torch.tensor([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1] * 5])[:B].bool()
    cond = dict(lane_mask=lm, agent_mask=am, label=torch.tensor([0, 1, 2])[:B])
    return cond, torch.randn(B, 6, 4, generator=g, dtype=torch.float64), torch.randn(B, 5, 3, generator=g,
                                                                                     dtype=torch.float64)


def test_meanflow_jvp_equals_finite_differences_along_v_theta_1_0():
    dit = tiny_dit()
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
        e5, e6, e7 = error(1e-5), error(1e-6), error(1e-7)
    # the sinusoidal embeddings (frequencies up to 1000) make the third derivative large, so the O(h²)
    # truncation error dominates down to h = 1e-7, where rounding (eps/h ≈ 2e-9 relative) is still far below:
    # the JVP matches to 1e-7 and the error falls 100× per decade of h, as it must for the exact derivative
    assert e7 < 1e-7
    assert 50 < e5 / e6 < 200 and 50 < e6 / e7 < 200
    assert dl.abs().max() > 1e-3  # a non-trivial derivative
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
