"""flow-bounds' closed forms: the Markovian-projection drift of Gaussian couplings, exact Euler moments,
the Girsanov path KL (stationary OU in closed form, ε² separability), the Markov transition Φ, the step
grids, the bound factors' score moments, the mixture drift and exact-OT W₂."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from icml.methods.flow_bounds import gaussian as g
from icml.methods.flow_bounds import learned as lm
from icml.methods.flow_bounds import points

EPS = np.finfo(np.float64).eps


def _couplings(d: int = 3):
    return [g.coupling("ou", d, 1.0, 1.0), g.coupling("shifted", d, 1e-2, 1.0, c=0.05),
            g.coupling("shifted", d, 1e-4, 0.7), g.coupling("aniso", d, 1e-3, 1.3)]


def test_stationary_ou_drift_is_minus_x_and_marginal_is_standard():
    x = g.coupling("ou", 4, 1.0, 1.0)
    t = np.linspace(0.0, 1.0, 101)[:, None]
    a, b = g.drift_coefficients(x, t)
    m, v = g.marginal(x, t)
    # A_t = −[(1−t) − t + 2t]/V_t with V_t = 1: every term is exact to a few roundings of O(1) numbers
    np.testing.assert_allclose(a, -1.0, rtol=0, atol=4 * EPS)
    np.testing.assert_allclose(b, 0.0, rtol=0, atol=0)
    np.testing.assert_allclose(v, 1.0, rtol=0, atol=4 * EPS)
    assert np.all(m == 0) and np.all(x.sigma ** 2 == pytest.approx(2.0, abs=4 * EPS))


@pytest.mark.parametrize("x", _couplings(), ids=["ou", "shifted_c", "shifted_degenerate", "aniso"])
def test_drift_is_the_markovian_projection_of_the_bridge(x):
    """Law(Y_t) = Law(X_t) for dY = (A_t Y + b_t)dt + σdB iff the mean and variance ODEs hold:
    m' = A m + b and V' = 2AV + σ² with the interpolant's V_t — this pins the σ convention shared by
    the interpolant (bridge variance σ²t(1−t)) and the drift."""
    t = np.linspace(0.0, 0.999, 200)[:, None]
    a, b = g.drift_coefficients(x, t)
    m, v = g.marginal(x, t)
    dv = -2 * (1 - t) * x.v0 + 2 * t * x.v1 + 2 * (1 - 2 * t) * x.c + x.sigma ** 2 * (1 - 2 * t)
    # 2AV + σ² cancels O(σ²) terms; |A|·V ≤ a few units here, so 16 roundings of O(max(1, σ²)) values
    np.testing.assert_allclose(2 * a * v + x.sigma ** 2, dv, rtol=0, atol=16 * EPS * max(1.0, x.sigma.max() ** 2))
    np.testing.assert_allclose(a * m + b, np.broadcast_to(x.m1 - x.m0, m.shape), rtol=0,
                               atol=16 * EPS * (1 + np.abs(a * m).max()))


@pytest.mark.parametrize("x", _couplings(), ids=["ou", "shifted_c", "shifted_degenerate", "aniso"])
def test_stable_drift_equals_the_defining_formula(x):
    t = np.linspace(0.0, 0.99, 100)[:, None]
    a, b = g.drift_coefficients(x, t)
    a_ref, b_ref = g.drift_reference(x, t)
    # the defining form divides a difference (g_t − 1) of O(1) numbers by 1 − t ≥ 0.01: its error is
    # ≈ 4·eps·|A_t|... amplified by 1/(1 − t) ≤ 100, and by 1/V_t for the nearly degenerate targets
    scale = 64 * EPS / (1 - t) * (1 + np.abs(a_ref)) * (1 + np.abs(x.m1))
    assert np.all(np.abs(a - a_ref) <= scale) and np.all(np.abs(b - b_ref) <= scale * (1 + np.abs(x.m1)))


def test_euler_moments_of_stationary_ou_in_closed_form():
    """Euler for β = −x, σ² = 2: var ← (1−h)² var + 2h, fixed point v* = 1/(1 − h/2), so
    var_N = v* + (1−h)^{2N}(1 − v*) and the mean stays 0."""
    x = g.coupling("ou", 1, 1.0, 1.0)
    for n in (8, 64, 512):
        h = 1.0 / n
        moments = g.euler_moments(x, g.uniform_grid(n, 1.0))
        v_star = 1 / (1 - h / 2)
        expected = v_star + (1 - h) ** (2 * n) * (1 - v_star)
        # n steps of an O(1) contraction: the rounding error grows at most linearly in n
        np.testing.assert_allclose(moments.var, expected, rtol=8 * n * EPS)
        assert moments.mean0[0] == 0
    moments = g.euler_moments(x, g.uniform_grid(64, 1.0))
    kl = g.kl_gauss(0.0, 1.0, moments.mean0, moments.var)[0]
    w2 = math.sqrt(g.w2_sq_gauss(0.0, 1.0, moments.mean0, moments.var)[0])
    assert kl == pytest.approx(1.154e-5, rel=1e-3) and w2 == pytest.approx(3.407e-3, rel=1e-3)  # spec's values


def test_euler_gain_is_the_response_to_a_constant_bias():
    x = g.coupling("shifted", 2, 1e-2, 1.0)
    grid = g.uniform_grid(50, 0.99)
    base = g.euler_moments(x, grid)
    q = 0.3
    mean = np.array(x.m0, dtype=float)
    for t, h in zip(grid[:-1], np.diff(grid)):  # the plain recursion with the bias inside the drift
        a, b = g.drift_coefficients(x, t)
        mean = mean + h * (a * mean + b + q)
    # 50 steps, each rounding O(1 + |mean|) numbers
    assert np.all(np.abs(base.mean0 + q * base.gain - mean) <= 64 * 50 * EPS * (1 + np.abs(mean)))


def test_ou_path_kl_in_closed_form():
    """OU: Var D(u) = 2(1 − e^{−(u−s)}), so each step adds (1/4)·2(h − 1 + e^{−h}) per coordinate:
    kl_path = d·(N/2)(h − 1 + e^{−h})."""
    for n, d in ((8, 1), (64, 3), (512, 1)):
        h = 1.0 / n
        x = g.coupling("ou", d, 1.0, 1.0)
        terms = g.path_terms(x, g.uniform_grid(n, 1.0))
        kl = float(np.sum(terms.kl(0.0, x.sigma)))
        expected = d * n / 2 * (h + math.expm1(-h))
        # Var D = 2(1 − Φ) cancels O(1) terms down to O(h): relative error ≈ eps/h per node, summed
        # coherently over the steps at worst — allow 64·eps/h
        assert kl == pytest.approx(expected, rel=64 * EPS / h)


@pytest.mark.parametrize("x", _couplings(), ids=["ou", "shifted_c", "shifted_degenerate", "aniso"])
def test_drift_error_adds_eps_squared_over_two_sigma_squared(x):
    """β^θ = β + q with Σh_k‖q‖² = ε²: E D = 0 (A_t m_t + b_t is constant), so the Girsanov KL is
    kl_path(0) + ε²/(2σ²) exactly, whatever the coupling's mean."""
    d = len(x.m0)
    for grid in (g.uniform_grid(40, 1.0), g.nonuniform_grid(0.05, 1e-2)):
        terms = g.path_terms(x, grid)
        t_end = grid[-1]
        for eps in (0.02, 0.08):
            q = eps / math.sqrt(t_end * d)
            gap = float(np.sum(terms.kl(q, x.sigma) - terms.kl(0.0, x.sigma)))
            # p1 = Σ∫E D is a sum of roundings of m1 − m0 differences: ≤ N·16·eps·|A m| in size
            assert gap == pytest.approx(float(np.sum(eps ** 2 / d / (2 * x.sigma ** 2))), rel=1e-9)


def test_transition_matches_its_closed_form_and_differs_from_the_interpolant():
    """Φ(t, s) = exp∫_s^t A by nested Gauss–Legendre; from V' = 2AV + σ²: ∫A = ½log(V_t/V_s) − (σ²/2)∫du/V_u,
    and V_u = α(u − r1)(u − r2) (real roots outside [0, 1] here) has ∫du/V = log|(u − r1)/(u − r2)| / (α(r1 − r2))."""
    x = g.coupling("shifted", 1, 1e-2, 1.0, c=0.05).at(0)
    alpha, beta, gamma = x.v0 + x.v1 - 2 * x.c - x.sigma ** 2, -2 * x.v0 + 2 * x.c + x.sigma ** 2, x.v0
    r1, r2 = np.roots([alpha, beta, gamma]).real  # discriminant β² − 4αγ > 0 for this coupling
    assert not (0 <= r1 <= 1 or 0 <= r2 <= 1)

    def antiderivative(u):
        return math.log(abs((u - r1) / (u - r2))) / (alpha * (r1 - r2))

    for s, t in ((0.0, 0.3), (0.5, 0.52), (0.9, 0.97)):
        got = float(g.log_transition(x, np.array(s), np.array(t)))
        inv_v = antiderivative(t) - antiderivative(s)
        expected = 0.5 * math.log(g.marginal(x, t)[1] / g.marginal(x, s)[1]) - 0.5 * x.sigma ** 2 * inv_v
        # 16-point GL is exact to degree 31; for this smooth rational integrand its error is far below the
        # rounding of the O(1) closed form, so allow a few hundred eps
        assert got == pytest.approx(expected, rel=256 * EPS, abs=256 * EPS)
    ou = g.coupling("ou", 1, 1.0, 1.0).at(0)
    s, t = 0.2, 0.45
    assert float(g.log_transition(ou, np.array(s), np.array(t))) == pytest.approx(-(t - s), abs=8 * EPS)
    # the interpolant's two-time covariance is 1 − (t − s) for ou, not the Markov SDE's e^{−(t−s)}
    interpolant_cov = (1 - t) * (1 - s) + t * s + ou.sigma ** 2 * s * (1 - t)
    assert interpolant_cov == pytest.approx(1 - (t - s), abs=8 * EPS)
    assert abs(interpolant_cov - math.exp(-(t - s))) > 1e-2


def test_nonuniform_grid_construction():
    grid = g.nonuniform_grid(0.01, 1e-3)
    assert len(grid) - 1 == 669  # 50 + ⌈log 500 / −log 0.99⌉ = 50 + 619
    for h, delta in ((0.01, 1e-3), (0.04, 1e-2), (0.005, 1e-3), (0.02, 0.3)):
        grid = g.nonuniform_grid(h, delta)
        steps = np.diff(grid)
        assert grid[0] == 0.0 and grid[-1] == 1 - delta and 0.5 in grid and np.all(steps > 0)
        k_half = int(np.flatnonzero(grid == 0.5)[0])
        assert k_half == math.ceil(0.5 / h - 1e-9)
        np.testing.assert_allclose(steps[:k_half - 1], h, rtol=0, atol=4 * EPS)  # constant h up to ½ …
        assert 0 < steps[k_half - 1] <= h + 4 * EPS  # … the last one truncated to land on ½
        tail_t, tail_h = grid[k_half:-2], steps[k_half:-1]
        # h_k = t_{k+1} − t_k of grid points in [½, 1), each within half an ulp of 1: absolute error ≤ 2·eps
        np.testing.assert_allclose(tail_h, h * np.minimum(tail_t, 1 - tail_t), rtol=0, atol=4 * EPS)
        assert 0 < steps[-1] <= h * (1 - grid[-2]) * (1 + 1e-9)  # truncated to end exactly at 1 − δ
        n_expected = math.ceil(0.5 / h - 1e-9) + math.ceil(math.log(1 / (2 * delta)) / -math.log(1 - h) - 1e-9)
        assert len(grid) - 1 == n_expected
    uniform = g.uniform_grid(669, 1 - 1e-3)
    assert uniform[0] == 0 and uniform[-1] == 1 - 1e-3 and np.ptp(np.diff(uniform)) < 16 * EPS


def test_score_moment_matches_a_direct_expansion():
    """E Q⁴ for Q = Σλ_i Z_i²: expand Q⁴ into Σ_{ijkl} λ_iλ_jλ_kλ_l E[Z_i²Z_j²Z_k²Z_l²], where an index
    repeated m times contributes E Z^{2m} = (2m − 1)!! — independent of the cumulant route in the code."""
    lam = np.array([1 / 3, 2.0, 5 / 7])
    double_factorial = {1: 1, 2: 3, 3: 15, 4: 105}
    direct = 0.0
    for idx in itertools.product(range(3), repeat=4):
        moment = math.prod(double_factorial[idx.count(i)] for i in set(idx))
        direct += math.prod(lam[list(idx)]) * moment
    assert g.score_moment8(lam) == pytest.approx(direct, rel=16 * EPS)  # 81 positive terms vs 4 cumulants
    for d in (1, 4, 64):  # standard π on R^{2d}: ‖∇log π‖² ~ χ²_{2d}
        n = 2 * d
        s_pi = math.sqrt(g.score_moment8(g.joint_precision_eigs(g.coupling("ou", d, 1.0, 1.0))))
        assert s_pi == pytest.approx(math.sqrt(n * (n + 2) * (n + 4) * (n + 6)), rel=16 * EPS)


def test_precision_eigenvalues_and_bound_limits():
    x = g.coupling("shifted", 3, 0.2, 1.0, c=0.3)
    eigs = np.sort(g.joint_precision_eigs(x))
    blocks = [np.linalg.eigvalsh(np.linalg.inv([[x.v0[i], x.c[i]], [x.c[i], x.v1[i]]])) for i in range(3)]
    np.testing.assert_allclose(eigs, np.sort(np.concatenate(blocks)), rtol=64 * EPS / (1 - 0.3 ** 2 / 0.2) ** 2)
    np.testing.assert_allclose(g.conditional_precision_eigs(x), 1 / (1 - 0.3 ** 2 / 0.2), rtol=4 * EPS)
    # standard π: Thm 1's factor → h·d(d² + 4d²) = 5d³h and the prior's → 6d⁴h as h → 0, d → ∞
    d, h = 4096.0, 1e-40
    s_pi = math.sqrt(g.score_moment8(np.ones(int(2 * d))))
    bounds = g.bound_factors(d, h, 0.0, 0.0, 0.0, s_pi, 0.0, 1.0, 5.0)
    assert bounds["bound_thm1"] / (5 * d ** 3 * h) == pytest.approx(1.0, rel=2e-3)  # O(1/d) corrections
    assert bounds["bound_prior"] / (6 * d ** 4 * h) == pytest.approx(1.0, rel=3e-3)
    assert np.isnan(bounds["bound_thm2"]) and np.isnan(bounds["bound_thm3"])  # no early stop
    assert g.slope(np.array([0.1, 0.01, 0.001]), 3 * np.array([0.1, 0.01, 0.001]) ** 2) == pytest.approx(2.0, rel=1e-12)


@pytest.mark.parametrize("fine_steps", [None, 64])
def test_sampler_shares_sigma_with_the_exact_moments(fine_steps):
    """The torch Euler–Maruyama sampler on the linear drift of a 2-D coupling with Y0 ~ N(0, I) reproduces the
    exact Euler moments (within 5 Monte Carlo standard errors): a σ-vs-σ² or √h slip is an O(1) miss."""
    x = g.coupling("shifted", 2, 1e-2, 0.8)
    grid = g.uniform_grid(16, 0.95)

    def drift(y, t):
        a, b = g.drift_coefficients(x, float(t[0]))
        return y * torch.as_tensor(a) + torch.as_tensor(b)

    n = 100_000
    y = lm.euler_maruyama(drift, n, grid, 0.8, seed=0, fine_steps=fine_steps)  # fresh or coarsened fine path
    moments = g.euler_moments(x, grid)
    se_mean, se_var = np.sqrt(moments.var / n), moments.var * np.sqrt(2 / n)
    assert np.all(np.abs(y.mean(0) - moments.mean0) < 5 * se_mean)
    assert np.all(np.abs(y.var(0) - moments.var) < 5 * se_var)


def test_mixture_drift_closed_forms():
    """One component is the Gaussian `shifted`-type drift exactly; the 8-ring's drift is equivariant under
    the rotation by 2π/8 (a check of the posterior weights)."""
    one = points.Mixture(np.array([[2.0, -1.0]]), 0.3)
    gauss = g.Coordinates(np.zeros(2), np.array([2.0, -1.0]), np.ones(2), np.full(2, 0.09), np.zeros(2), np.full(2, 0.9))
    y = torch.as_tensor(np.random.default_rng(0).normal(size=(64, 2)) * 3)
    for t in (0.0, 0.37, 0.99):
        a, b = g.drift_coefficients(gauss, t)
        got = lm.mixture_drift(one, y, torch.full((64,), t, dtype=torch.float64), 0.9).numpy()
        expected = y.numpy() * a + b
        assert np.all(np.abs(got - expected) <= 64 * EPS * (1 + np.abs(expected)))
    ring = points.ring_mixture(8, 4.0, 0.3)
    angle = 2 * np.pi / 8
    rot = torch.tensor([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]], dtype=torch.float64)
    t = torch.full((64,), 0.8, dtype=torch.float64)
    lhs = lm.mixture_drift(ring, y @ rot.T, t, 1.0).numpy()
    rhs = (lm.mixture_drift(ring, y, t, 1.0) @ rot.T).numpy()
    # the drift is O(|x|/(1−t)) ≈ 60 here; softmax and the rotation each round at O(eps) relative
    assert np.abs(lhs - rhs).max() <= 1e3 * EPS * np.abs(rhs).max()


def test_exact_w2_of_empirical_measures():
    rng = np.random.default_rng(1)
    a = rng.normal(size=(7, 2))
    shift = np.array([0.3, -1.2])
    # a translate: Σ‖x_i − x_σ(i) − c‖² = Σ‖x_i − x_σ(i)‖² + n‖c‖², minimised by the identity
    assert lm.w2_exact(a, a + shift) == pytest.approx(np.linalg.norm(shift), rel=64 * EPS)
    assert lm.w2_exact(a, a[rng.permutation(7)]) == pytest.approx(0.0, abs=64 * EPS)
    b = rng.normal(size=(7, 2))
    cost = ((a[:, None] - b[None]) ** 2).sum(-1)
    brute = min(cost[np.arange(7), list(p)].mean() for p in itertools.permutations(range(7)))
    assert lm.w2_exact(a, b) == pytest.approx(math.sqrt(brute), rel=64 * EPS)
