"""`icml single-index`: the Hermite calculus, the closed-form risk and its symmetry, the population
gradient, the ODE flows against closed forms and the trap, and the finite-sample estimator's parts
against reference implementations (numpy Hermite-E, exact Gauss–Hermite quadrature, torch.autograd,
sklearn KernelRidge)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from numpy.polynomial import hermite_e

from icml.methods.single_index.config import preset
from icml.methods.single_index.estimator import (fit_joint, initial_direction,
                                                 ridge_coefficients, ridge_gradient_steps, save_direction,
                                                 sir_direction, sir_matrix, sphere_step, synthetic_sample, w_gradient)
from icml.methods.single_index.hermite import (coef_error, hermite_derivative_features, hermite_features, link,
                                               risk, target_coefficients)
from icml.methods.single_index.population import (Flow, argmin_velocity, escape_slope, integrate, m_velocity,
                                                  planted_fixed_points, planted_velocity)

EPS = np.finfo(np.float64).eps
K = 6


def gauss(n: int = 40):
    """Nodes and weights of E_{z~N(0,1)}[f(z)]: exact for polynomials of degree < 2n."""
    nodes, weights = hermite_e.hermegauss(n)
    return nodes, weights / math.sqrt(2 * math.pi)


def correlated_pairs(m: float, n: int = 40):
    """(z, z*, weight) with (z, z*) jointly Gaussian, unit variances, correlation m: z = u,
    z* = m u + √(1−m²) v. Tensor-product quadrature, exact for polynomials of degree < 2n in each of u, v."""
    nodes, weights = gauss(n)
    u, v = np.meshgrid(nodes, nodes, indexing="ij")
    return u.ravel(), (m * u + math.sqrt(1 - m * m) * v).ravel(), np.outer(weights, weights).ravel()


# Hermite calculus ----------------------------------------------------------------------------------
def test_features_match_numpy_hermite_e():
    z = np.linspace(-4, 4, 81)
    ours = hermite_features(z, K)
    for k in range(K + 1):
        reference = hermite_e.hermeval(z, np.eye(K + 1)[k]) / math.sqrt(math.factorial(k))
        # the three-term recurrence vs numpy's Clenshaw sum: rounding of O(k) operations on values ≤ |h_k(4)|
        np.testing.assert_allclose(ours[:, k], reference, rtol=0, atol=16 * (k + 1) * EPS * np.abs(reference).max())
    torch_features = hermite_features(torch.as_tensor(z), K).numpy()
    np.testing.assert_array_equal(torch_features, ours)  # the same recurrence on either array type


def test_orthonormal_under_the_gaussian_by_quadrature():
    z, w = gauss()
    gram = (hermite_features(z, K) * w[:, None]).T @ hermite_features(z, K)
    # exact quadrature; rounding of a 40-term weighted sum of products of size ≤ max|h_j h_k| w ≈ O(1)
    np.testing.assert_allclose(gram, np.eye(K + 1), rtol=0, atol=40 * 64 * EPS)


def test_orthonormal_by_monte_carlo():
    z = np.random.default_rng(0).standard_normal(400_000)
    h = hermite_features(z, 4)
    products = h[:, :, None] * h[:, None, :]
    mean, se = products.mean(0), products.std(0) / math.sqrt(len(z))
    # 5 standard errors per entry (h_0² ≡ 1 has none: rounding of the mean only)
    assert np.all(np.abs(mean - np.eye(5)) <= 5 * se + 16 * EPS)


def test_derivative_is_sqrt_k_times_previous():
    z = np.linspace(-3, 3, 61)
    ours = hermite_derivative_features(z, K)
    for k in range(K + 1):
        reference = hermite_e.hermeval(z, hermite_e.hermeder(np.eye(K + 1)[k])) / math.sqrt(math.factorial(k))
        scale = max(1, np.abs(reference).max())
        np.testing.assert_allclose(ours[:, k], reference, rtol=0, atol=16 * (k + 1) * EPS * scale)


@pytest.mark.parametrize("m", [-0.9, -0.3, 0.0, 0.45, 0.99])
def test_mehler_overlap_identity_by_quadrature(m):
    z, z_star, w = correlated_pairs(m)
    cross = (hermite_features(z, K) * w[:, None]).T @ hermite_features(z_star, K)
    # E[h_j(z) h_k(z*)] = δ_jk m^k; quadrature exact, rounding of a 1600-term sum of O(1) terms
    np.testing.assert_allclose(cross, np.diag(m ** np.arange(K + 1)), rtol=0, atol=1600 * 8 * EPS)


def test_overlap_identity_by_monte_carlo_in_d_dimensions():
    rng = np.random.default_rng(1)
    d, n, m = 6, 400_000, -0.6
    w_star = np.eye(d)[0]
    w = m * w_star + math.sqrt(1 - m * m) * np.eye(d)[1]
    x = rng.standard_normal((n, d))
    products = hermite_features(x @ w, 3)[:, :, None] * hermite_features(x @ w_star, 3)[:, None, :]
    mean, se = products.mean(0), products.std(0) / math.sqrt(n)
    assert np.all(np.abs(mean - np.diag(m ** np.arange(4))) <= 5 * se + 16 * EPS)  # h_0(z) h_0(z*) ≡ 1: exact


# the risk -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m", [-0.7, 0.2, 0.95])
def test_closed_form_risk_equals_the_gaussian_expectation(m):
    rng = np.random.default_rng(2)
    a, a_star = rng.standard_normal(K + 1), rng.standard_normal(5)
    z, z_star, w = correlated_pairs(m)
    expectation = 0.5 * np.sum(w * (link(z, a) - link(z_star, a_star)) ** 2)
    # exact quadrature of a degree-12 polynomial; rounding relative to E[φ² + φ*²]
    scale = np.sum(a ** 2) + np.sum(a_star ** 2)
    assert risk(m, a, a_star) == pytest.approx(expectation, rel=0, abs=1600 * 16 * EPS * scale)
    assert risk(m, a, a_star, noise_var=0.3) == pytest.approx(risk(m, a, a_star) + 0.15, abs=4 * EPS * scale)


def test_risk_sign_symmetry_and_mirror_solution():
    rng = np.random.default_rng(3)
    a, a_star = rng.standard_normal(K + 1), rng.standard_normal(K + 1)
    flip = (-1.0) ** np.arange(K + 1)
    for m in (-0.8, -0.1, 0.3, 0.77):
        # negation and multiplication by ±1 are exact, so only the summation order could differ
        assert risk(-m, flip * a, a_star) == pytest.approx(risk(m, a, a_star), rel=8 * EPS)
    # the mirror solution (−w*, φ*(−·)): m = −1 with a_k = (−1)^k a*_k has zero risk and zero coef_error
    assert risk(-1.0, flip * a_star, a_star) == pytest.approx(0, abs=8 * EPS * np.sum(a_star ** 2))
    assert coef_error(flip * a_star, a_star, -1.0) == 0.0
    assert coef_error(a_star, a_star, -1.0) == pytest.approx(2 * np.linalg.norm(a_star[1::2]), rel=4 * EPS)


@pytest.mark.parametrize("m", [-0.6, 0.05, 0.8])
def test_population_gradient_formula(m):
    """ṁ = η(1−m²) Σ k a_k a*_k m^{k−1} is −⟨(I − wwᵀ)∇_w R, w*⟩ with ∇_w R = E[(φ(z) − φ*(z*)) φ′(z) x];
    in the plane of (w, w*): ⟨∇R, w*⟩ = E[… φ′(z) z*], ⟨∇R, w⟩ = E[… φ′(z) z]."""
    rng = np.random.default_rng(4)
    a, a_star = rng.standard_normal(K + 1), rng.standard_normal(K + 1)
    z, z_star, w = correlated_pairs(m)
    residual = (link(z, a) - link(z_star, a_star)) * (hermite_derivative_features(z, K) @ a)
    along_star, along_w = np.sum(w * residual * z_star), np.sum(w * residual * z)
    expected = -(along_star - m * along_w)
    scale = np.sum(np.abs(a)) * (np.sum(np.abs(a)) + np.sum(np.abs(a_star))) * K
    assert m_velocity(m, a, a_star) == pytest.approx(expected, rel=0, abs=1600 * 64 * EPS * scale)


# population flows -----------------------------------------------------------------------------------
# LSODA at rtol 1e-10: the global error of a few hundred steps plus the event's root finding stays below
# 1e-7 relative; a looser agreement would mean a wrong flow, a tighter one would test the solver.
ODE_RTOL = 1e-7


@pytest.mark.parametrize("m0", [0.01, -0.05, 0.2])
def test_planted_he2_escape_time_closed_form(m0):
    # ṁ = 2m(1 − m²)  ⇒  m²/(1 − m²) = e^{4t} m₀²/(1 − m₀²)  ⇒  T½ = ¼ log((1 − m₀²) / (3 m₀²))
    result = integrate(Flow("planted", tuple(target_coefficients("he2", 4)), m0), 1e3)
    assert result.escape_time == pytest.approx(0.25 * math.log((1 - m0 ** 2) / (3 * m0 ** 2)), rel=ODE_RTOL)
    assert abs(result.final_m) == pytest.approx(1.0, abs=1e-9)


def test_planted_he3_escape_time_closed_form():
    # ṁ = 3m²(1 − m²): ∫ dm / (m²(1 − m²)) = G(m) = −1/m + atanh(m), so T½ = [G(½) − G(m₀)]/3 ~ d^{1/2}/3
    m0 = 1 / math.sqrt(1600)
    result = integrate(Flow("planted", tuple(target_coefficients("he3", 4)), m0), 1e4)
    G = lambda m: -1 / m + math.atanh(m)  # noqa: E731
    assert result.escape_time == pytest.approx((G(0.5) - G(m0)) / 3, rel=ODE_RTOL)


@pytest.mark.parametrize("d", [100, 6400])
def test_argmin_he2_escape_time_closed_form(d):
    # ṁ = 2m³(1 − m²): ∫ dm / (m³(1 − m²)) = F(m) = −1/(2m²) + log|m| − ½ log(1 − m²), so T½ = [F(½) − F(m₀)]/2
    m0 = -1 / math.sqrt(d)

    def F(m):
        return -1 / (2 * m * m) + math.log(abs(m)) - 0.5 * math.log(1 - m * m)

    result = integrate(Flow("argmin_phi", tuple(target_coefficients("he2", 4)), m0), 1e6)
    assert result.escape_time == pytest.approx((F(0.5) - F(m0)) / 2, rel=ODE_RTOL)
    assert result.final_m == pytest.approx(-1.0, abs=1e-9)


@pytest.mark.parametrize("variant, m", [("joint", -0.37), ("joint", 0.0), ("planted", 0.6), ("argmin_phi", -0.8)])
def test_analytic_jacobian_matches_central_differences(variant, m):
    from icml.methods.single_index.population import _system

    rhs, jac, y0, _ = _system(Flow(variant, tuple(target_coefficients("he2_he3", K)), m))
    y = y0 + np.concatenate([[0.0], np.random.default_rng(6).standard_normal(len(y0) - 1)])
    h = 1e-6
    numeric = np.column_stack([(rhs(0, y + h * e) - rhs(0, y - h * e)) / (2 * h) for e in np.eye(len(y))])
    # central differences: truncation O(h² ‖f‴‖) ≈ 1e-12·(K³ scale) plus rounding O(eps ‖f‖ / h) ≈ 1e-10
    np.testing.assert_allclose(jac(0, y), numeric, rtol=0, atol=1e-8)


def test_one_dimensional_velocities_closed_forms():
    """he2_he3: planted ṁ = (1 − m²)(2m + 3m²); instantaneous φ ṁ = (1 − m²)(2m³ + 3m⁵)."""
    a_star = target_coefficients("he2_he3", K)
    for m in (-0.5, 0.3, 0.9):
        assert planted_velocity(m, a_star) == pytest.approx((1 - m * m) * (2 * m + 3 * m * m), rel=8 * EPS)
        assert argmin_velocity(m, a_star) == pytest.approx((1 - m * m) * (2 * m ** 3 + 3 * m ** 5), rel=8 * EPS)


def test_trap_planted_stuck_joint_takes_the_mirror():
    a_star = tuple(target_coefficients("he2_he3", K))
    assert planted_fixed_points(np.array(a_star)) == [(pytest.approx(-2 / 3, abs=8 * EPS), True), (0.0, False)]
    planted = integrate(Flow("planted", a_star, -0.1), 1e6)
    assert planted.final_m == pytest.approx(-2 / 3, abs=1e-8)
    assert planted.risk[-1] == pytest.approx(50 / 27, abs=1e-8)
    for variant in ("joint", "l2_flow", "argmin_phi"):
        joint = integrate(Flow(variant, a_star, -0.1), 1e6)
        assert joint.final_m == pytest.approx(-1.0, abs=1e-8)
        assert joint.final_a[3] == pytest.approx(-1.0, abs=1e-6) and joint.final_a[2] == pytest.approx(1.0, abs=1e-6)
        assert joint.risk[-1] == pytest.approx(0.0, abs=1e-10)


def test_joint_flow_is_mirror_symmetric_and_planted_is_not():
    """(m, a_k) ↦ (−m, (−1)^k a_k) leaves L invariant, so from a(0) = 0 the joint flow from −m₀ is the mirror
    of the flow from +m₀ for any target; the planted flow (a ≡ a*) is not, for a target with an odd part."""
    a_star = tuple(target_coefficients("he2_he3", K))
    plus, minus = (integrate(Flow("joint", a_star, s * 0.05), 1e4) for s in (1, -1))
    flip = (-1.0) ** np.arange(K + 1)
    # same steps (the solver sees the same magnitudes): agreement to the solver tolerance at worst
    np.testing.assert_allclose(minus.m, -plus.m, rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(minus.a, plus.a * flip, rtol=1e-8, atol=1e-12)
    assert minus.escape_time == pytest.approx(plus.escape_time, rel=1e-8)
    assert integrate(Flow("planted", a_star, -0.05), 1e4).final_m == pytest.approx(-2 / 3, abs=1e-8)


def test_he3_negative_start_joint_escapes_planted_never():
    a_star = tuple(target_coefficients("he3", K))
    m0 = -1 / math.sqrt(100)
    planted = integrate(Flow("planted", a_star, m0), 1e6)
    assert planted.escape_time == math.inf and -0.001 < planted.final_m < 0  # ṁ = 3m²(1−m²) > 0: m → 0⁻
    joint = integrate(Flow("joint", a_star, m0), 1e6)
    assert math.isfinite(joint.escape_time) and joint.final_m == pytest.approx(-1.0, abs=1e-8)


def test_escape_slope_least_squares():
    d = np.array([100, 400, 1600, 6400])
    assert escape_slope(d, 3.0 * d ** 1.5, 400) == pytest.approx(1.5, rel=16 * EPS)
    assert math.isnan(escape_slope(d, np.array([1, 2, np.inf, np.inf]), 400))  # one finite point ≥ 400


# the finite-sample estimator ------------------------------------------------------------------------
def _sample(n=3000, d=8, target="he2_he3", seed=0, noise=0.1):
    cfg = preset("default").rkhs
    cfg.n, cfg.d, cfg.target, cfg.noise, cfg.n_test = n, d, target, noise, 100
    return cfg, synthetic_sample(cfg, seed)


def test_w_gradient_matches_autograd():
    cfg, s = _sample()
    a = torch.as_tensor(np.random.default_rng(5).standard_normal(K + 1))
    w = initial_direction(s.w_star, -0.3, 0).requires_grad_(True)
    loss = 0.5 * ((hermite_features(s.x @ w, K) @ a - s.y) ** 2).mean()
    (reference,) = torch.autograd.grad(loss, w)
    ours = w_gradient(w.detach(), s.x, s.y, a)
    # two orderings of the same n-term sums: rounding ∝ √n eps times the gradient's scale
    atol = float(64 * math.sqrt(len(s.y)) * EPS * reference.abs().max())
    torch.testing.assert_close(ours, reference, rtol=0, atol=atol)


def test_sphere_step_stays_unit_and_moves_along_the_tangent():
    cfg, s = _sample()
    a = torch.as_tensor(target_coefficients("he2_he3", K, unit_norm=True))
    w = initial_direction(s.w_star, -0.3, 0)
    for _ in range(200):
        w = sphere_step(w, s.x, s.y, a, 0.5)
        assert abs(float(w.norm()) - 1) <= 4 * EPS * math.sqrt(len(w))  # one renormalisation per step
    g = w_gradient(w, s.x, s.y, a)
    tangent = g - (g @ w) * w
    for eta in (1e-3, 1e-4):  # (w_new − w)/η = −(I − wwᵀ)g + O(η)
        move = (sphere_step(w, s.x, s.y, a, eta) - w) / eta
        assert float((move + tangent).norm()) <= 2 * eta * float(tangent.norm()) ** 2 + 1e-9


def test_phi_step_is_kernel_ridge_with_the_mehler_kernel():
    from sklearn.kernel_ridge import KernelRidge

    cfg, s = _sample(n=500)
    w = initial_direction(s.w_star, 0.5, 0)
    features = hermite_features(s.x @ w, K)
    lam = 0.8 ** torch.arange(K + 1, dtype=torch.float64)
    a = ridge_coefficients(features, s.y, lam, 1e-3)
    kernel = (features * lam) @ features.T  # K(z, z′) = Σ λ_k h_k(z) h_k(z′)
    ridge = KernelRidge(alpha=len(s.y) * 1e-3, kernel="precomputed").fit(kernel.numpy(), s.y.numpy())
    reference = ridge.predict(kernel.numpy())
    gram = features.T @ features / len(s.y) + torch.diag(1e-3 / lam)
    condition = float(torch.linalg.cond(gram))
    np.testing.assert_allclose((features @ a).numpy(), reference, rtol=0,
                               atol=64 * condition * EPS * np.abs(reference).max())
    # the φ gradient steps contract to the same solution (rate 1 − lr·λ_min(ΛG) per step)
    stepped = ridge_gradient_steps(torch.zeros(K + 1, dtype=torch.float64), features, s.y, lam, 1e-3, 4000, 0.5)
    torch.testing.assert_close(stepped, a, rtol=0, atol=1e-9)


def test_phi_step_reaches_partial_equilibrium_at_large_n():
    """At the population limit (μ → 0) the φ-step gives a_k = a*_k m^k (Mehler): the finite-sample estimator
    is the ODE's `argmin_phi` coefficient map. Statistical tolerance: 6 standard errors of E[h_k(z) y]."""
    cfg, s = _sample(n=200_000, d=4, noise=0.0)
    m = -0.6
    w = initial_direction(s.w_star, m, 1)
    features = hermite_features(s.x @ w, K)
    a = ridge_coefficients(features, s.y, torch.ones(K + 1, dtype=torch.float64), 1e-9).numpy()
    se = float((((features * s.y[:, None]) ** 2).mean(0).max() / len(s.y)).sqrt())
    np.testing.assert_allclose(a, s.a_star * m ** np.arange(K + 1), rtol=0, atol=6 * se * K)


def test_save_finds_an_even_link_sir_sees_only_noise():
    """For an even link E[z | y] = 0: SIR's matrix is sampling noise (top eigenvalue ~ Σ_h Var(z*|h)/n), while
    it is O(1) for an odd link; SAVE sees the even link's variance contrast."""
    _, even = _sample(n=6000, d=10, target="he2", noise=0.0)
    _, odd = _sample(n=6000, d=10, target="he3", noise=0.0)
    assert abs(float(save_direction(even.x, even.y, 10) @ even.w_star)) > 0.95
    top = {name: float(torch.linalg.eigvalsh(sir_matrix(s.x, s.y, 10)[0])[-1])
           for name, s in (("even", even), ("odd", odd))}
    assert top["even"] < 0.02 < 0.2 < top["odd"]
    assert abs(float(sir_direction(odd.x, odd.y, 10) @ odd.w_star)) > 0.95


def test_joint_estimator_recovers_the_mirror_from_a_negative_start():
    cfg, s = _sample(n=4000, d=16)
    cfg.iters, cfg.m0 = 150, -0.3
    fit = fit_joint(s, initial_direction(s.w_star, cfg.m0, 0), cfg)
    assert fit.overlap[-1] < -0.97 and abs(float(fit.w.norm()) - 1) <= 4 * EPS * 4
    assert coef_error(fit.a.numpy(), s.a_star, fit.overlap[-1]) < 0.15
