"""Exact Gaussian mode: closed-form drift, exact Euler moments, terminal KL/W₂ and the Girsanov path KL.

Every coupling here is diagonal, so a coupling in R^d is d independent scalar couplings ("coordinates"),
each given by (m0, m1, V0, V1, c, σ): X0 ~ N(m0, V0), X1 ~ N(m1, V1), Cov(X0, X1) = c, and the
interpolant X_t = (1−t)X0 + tX1 + σ(W_t − tW_1). All functions broadcast over coordinate arrays.
Divergences of a coupling are sums over its coordinates.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GL_NODES, GL_WEIGHTS = np.polynomial.legendre.leggauss(16)  # on [−1, 1]
OU_SIGMA = 2.0 ** 0.5  # σ² = 2 makes N(0, I) ⊗ N(0, I) stationary: β_t(x) = −x


@dataclass(frozen=True)
class Coordinates:
    """Scalar Gaussian couplings, one per entry of each array (all the same shape)."""

    m0: np.ndarray
    m1: np.ndarray
    v0: np.ndarray
    v1: np.ndarray
    c: np.ndarray
    sigma: np.ndarray

    def at(self, index) -> "Coordinates":
        return Coordinates(*(np.asarray(getattr(self, k))[index] for k in self.__dataclass_fields__))

    def expand(self, axes: int) -> "Coordinates":
        """Append `axes` trailing singleton axes, to broadcast against time arrays."""
        shape = (Ellipsis,) + (None,) * axes
        return Coordinates(*(np.asarray(getattr(self, k))[shape] for k in self.__dataclass_fields__))


def coupling(name: str, d: int, v1: float, sigma: float, c: float = 0.0) -> Coordinates:
    """The spec's couplings in R^d: `ou` (stationary, σ² = 2), `shifted` (N(0,I) → N(2·𝟙, v1·I),
    cross-covariance c·I) and `aniso` (N(0,I) → N(0, diag λ), λ log-spaced on [v1, 1])."""
    one = np.ones(d)
    if name == "ou":
        return Coordinates(0 * one, 0 * one, one, one.copy(), 0 * one, OU_SIGMA * one)
    if name == "shifted":
        return Coordinates(0 * one, 2 * one, one, v1 * one, c * one, sigma * one)
    if name == "aniso":
        return Coordinates(0 * one, 0 * one, one, np.geomspace(v1, 1.0, d), 0 * one, sigma * one)
    raise ValueError(f"unknown coupling '{name}'")


# marginals and drift ---------------------------------------------------------------------------------------
def marginal(x: Coordinates, t):
    """Mean and variance of X_t (the interpolant's, hence the generative SDE's, one-time law)."""
    m = (1 - t) * x.m0 + t * x.m1
    v = (1 - t) ** 2 * x.v0 + t ** 2 * x.v1 + 2 * t * (1 - t) * x.c + x.sigma ** 2 * t * (1 - t)
    return m, v


def drift_coefficients(x: Coordinates, t):
    """β_t(x) = A_t x + b_t with A_t = (g_t − 1)/(1 − t), g_t = ((1−t)c + tV1)/V_t, b_t = (m1 − g_t m_t)/(1 − t).

    Written without the 0/0 at t → 1: V_t − (1−t)c − tV1 = (1−t)[(1−t)V0 − tV1 + (2t−1)c + σ²t], so
    A_t = −[(1−t)V0 − tV1 + (2t−1)c + σ²t]/V_t, and m1 − g_t m_t = (1−t)(m1 − m0) − (1 − g_t)m_t gives
    b_t = (m1 − m0) − A_t m_t (along the mean the drift is the mean's velocity).
    """
    m, v = marginal(x, t)
    a = -((1 - t) * x.v0 - t * x.v1 + (2 * t - 1) * x.c + x.sigma ** 2 * t) / v
    return a, (x.m1 - x.m0) - a * m


def drift_reference(x: Coordinates, t):
    """A_t and b_t straight from the defining formulas (division by 1 − t), for t < 1: the tests' reference."""
    m, v = marginal(x, t)
    g = ((1 - t) * x.c + t * x.v1) / v
    return (g - 1) / (1 - t), (x.m1 - g * m) / (1 - t)


def log_transition(x: Coordinates, s, t):
    """log Φ(t, s) = ∫_s^t A_u du by 16-point Gauss–Legendre (s, t broadcast against the coordinates)."""
    half = (t - s) / 2
    u = (s + half)[..., None] + half[..., None] * GL_NODES
    a, _ = drift_coefficients(x.expand(1), u)
    return half * np.einsum("...j,j->...", a, GL_WEIGHTS)


# Euler scheme, propagated exactly ---------------------------------------------------------------------------
@dataclass(frozen=True)
class EulerMoments:
    """Law(Y_N) = N(mean0 + q·gain, var) for a constant drift bias q per coordinate (linear in q)."""

    mean0: np.ndarray
    gain: np.ndarray
    var: np.ndarray


def euler_moments(x: Coordinates, grid: np.ndarray) -> EulerMoments:
    """Y_{k+1} = Y_k + h_k(A_k Y_k + b_k + q) + σ√h_k ξ_k from Y_0 ~ N(m0, V0), as exact moment recursions:
    mean ← (1 + h_k A_k) mean + h_k(b_k + q), var ← (1 + h_k A_k)² var + σ² h_k."""
    mean, gain, var = np.array(x.m0, dtype=float), np.zeros_like(x.m0, dtype=float), np.array(x.v0, dtype=float)
    for t, h in zip(grid[:-1], np.diff(grid)):
        a, b = drift_coefficients(x, t)
        factor = 1 + h * a
        mean = factor * mean + h * b
        gain = factor * gain + h
        var = factor ** 2 * var + x.sigma ** 2 * h
    return EulerMoments(mean, gain, var)


def kl_gauss(m_p, v_p, m_q, v_q):
    """KL(N(m_p, v_p) ‖ N(m_q, v_q)), scalar Gaussians, elementwise."""
    ratio = v_p / v_q
    return 0.5 * (ratio - 1 - np.log(ratio) + (m_p - m_q) ** 2 / v_q)


def w2_sq_gauss(m_p, v_p, m_q, v_q):
    """W₂² between scalar Gaussians, elementwise."""
    return (m_p - m_q) ** 2 + (np.sqrt(v_p) - np.sqrt(v_q)) ** 2


# path-space KL ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PathTerms:
    """Per coordinate, Σ_k ∫_{t_k}^{t_{k+1}} E|β_t(X_t) − β_{t_k}(X_{t_k}) − q|² dt = p0 − 2q·p1 + q²·T.

    p0 = Σ∫ (Var D + (E D)²) and p1 = Σ∫ E D for the exact-drift difference D; E D vanishes analytically
    (A_t m_t + b_t = m1 − m0), so p1 is kept only to make the ε-dependence exact as computed."""

    p0: np.ndarray
    p1: np.ndarray
    t_end: float

    def kl(self, q, sigma, index=slice(None)):
        """(1/2σ²) Σ_k ∫ E|β − β^θ|² per coordinate, for the drift β^θ = β + q."""
        return (self.p0[index] - 2 * q * self.p1[index] + q ** 2 * self.t_end) / (2 * sigma ** 2)


def path_terms(x: Coordinates, grid: np.ndarray, chunk_entries: int = 2_000_000) -> PathTerms:
    """Girsanov integrand of the Euler scheme against the SDE, integrated exactly per step.

    On [s, s+h], s = t_k: D(u) = A_u X_u − A_s X_s + (b_u − b_s) under the Markov SDE, whose two-time
    covariance is Cov(X_u, X_s) = Φ(u, s) V_s with Φ(u, s) = exp ∫_s^u A (not the interpolant's two-time
    covariance, which differs). So Var D = A_u² V_u + A_s² V_s − 2 A_u A_s Φ(u, s) V_s. Outer integral:
    16-point Gauss–Legendre per step; Φ at each node: 16-point Gauss–Legendre again (nested).
    """
    s, h = grid[:-1], np.diff(grid)
    n_coords = np.asarray(x.m0).size
    per_coord = len(s) * 16 * 16
    step = max(1, chunk_entries // per_coord)
    p0, p1 = np.empty(n_coords), np.empty(n_coords)
    for lo in range(0, n_coords, step):
        part = x.at(slice(lo, lo + step)).expand(2)  # (coords, 1, 1) against (steps, nodes)
        u = s[:, None] + h[:, None] * (1 + GL_NODES) / 2
        a_u, b_u = drift_coefficients(part, u)
        m_u, v_u = marginal(part, u)
        a_s, b_s = drift_coefficients(part, s[:, None])
        m_s, v_s = marginal(part, s[:, None])
        phi = np.exp(log_transition(part.expand(0), np.broadcast_to(s[:, None], u.shape), u))
        var_d = a_u ** 2 * v_u + a_s ** 2 * v_s - 2 * a_u * a_s * phi * v_s
        mean_d = (a_u * m_u + b_u) - (a_s * m_s + b_s)
        weights = h[:, None] * GL_WEIGHTS / 2
        p0[lo:lo + step] = np.sum((var_d + mean_d ** 2) * weights, axis=(-2, -1))
        p1[lo:lo + step] = np.sum(mean_d * weights, axis=(-2, -1))
    return PathTerms(p0, p1, float(grid[-1]))


# step schedules ---------------------------------------------------------------------------------------------
def uniform_grid(n_steps: int, t_end: float) -> np.ndarray:
    return np.linspace(0.0, t_end, n_steps + 1)


def nonuniform_grid(h: float, delta: float) -> np.ndarray:
    """Thm 3's schedule: constant step h up to t = ½ (the last of these truncated to land on ½), then
    h_k = h·min(t_k, 1 − t_k) = h(1 − t_k), so 1 − t shrinks geometrically by (1 − h), the last step
    truncated to end exactly at 1 − δ. Steps: ⌈1/(2h)⌉ + ⌈log(1/(2δ)) / −log(1 − h)⌉."""
    n_half = int(np.ceil(0.5 / h - 1e-9))  # the 1e-9 absorbs 0.5/h rounding just above an integer
    head = np.minimum(np.arange(n_half + 1) * h, 0.5)
    head[-1] = 0.5
    n_tail = int(np.ceil(np.log(2 * delta) / np.log1p(-h) - 1e-9))
    tail = 1 - 0.5 * (1 - h) ** np.arange(1, n_tail + 1)
    tail[-1] = 1 - delta
    return np.concatenate([head, tail])


# bound factors ----------------------------------------------------------------------------------------------
def score_moment8(precision_eigs: np.ndarray) -> np.ndarray:
    """E‖∇log p‖⁸ for a Gaussian p whose precision has the given eigenvalues (last axis).

    ‖∇log p(Z)‖² = (Z−m)ᵀΣ⁻²(Z−m) ~ Q = Σ λ_i χ²_1 with λ the precision's eigenvalues; its cumulants are
    κ_n = 2^{n−1}(n−1)! Σλ_iⁿ, and E Q⁴ = κ4 + 4κ3κ1 + 3κ2² + 6κ2κ1² + κ1⁴."""
    lam = np.asarray(precision_eigs, dtype=float)
    k1, k2, k3, k4 = (2.0 ** (n - 1) * np.prod(range(1, n)) * np.sum(lam ** n, axis=-1) for n in (1, 2, 3, 4))
    return k4 + 4 * k3 * k1 + 3 * k2 ** 2 + 6 * k2 * k1 ** 2 + k1 ** 4


def joint_precision_eigs(x: Coordinates) -> np.ndarray:
    """The 2d precision eigenvalues of π = Law(X0, X1): per coordinate, of the inverse of [[V0, c], [c, V1]]."""
    mid, rad = (x.v0 + x.v1) / 2, np.sqrt(((x.v0 - x.v1) / 2) ** 2 + x.c ** 2)
    return np.concatenate([1 / (mid + rad), 1 / (mid - rad)], axis=-1)


def conditional_precision_eigs(x: Coordinates) -> np.ndarray:
    """The d precision eigenvalues of π_{0|1} = Law(X0 | X1): 1/(V0 − c²/V1) per coordinate."""
    return 1 / (x.v0 - x.c ** 2 / x.v1)


def bound_factors(d, h, eps_sq, eps_l2, delta, s_pi, s_01, prior_a: float, prior_b: float) -> dict:
    """The bracketed bound factors (constants C omitted), elementwise; δ = 0 means no early stop (Thm 2/3
    factors are then NaN)."""
    d = np.asarray(d, dtype=float)
    lead = h * (h ** 0.125 + 1) * d
    with np.errstate(divide="ignore", invalid="ignore"):
        stopped = np.asarray(delta) > 0
        thm2 = np.where(stopped, eps_sq + lead * (d ** 2 / np.where(stopped, delta, 1.0) ** 4 + s_01), np.nan)
        thm3 = np.where(stopped, eps_sq + h * d ** 3 * np.log(1 / np.where(stopped, delta, 1.0))
                        + lead * (d ** 2 + s_01), np.nan)
    return {
        "bound_thm1": eps_sq + lead * (d ** 2 + s_pi),
        "bound_thm2": thm2,
        "bound_thm3": thm3,
        "bound_thm4_w2": eps_l2 + np.sqrt(h) * (h ** 0.0625 + 1) * np.sqrt(d * (d ** 2 + s_pi)),
        "bound_prior": eps_sq + h * (prior_a * d ** 4 + prior_b * d * (d + 2) * (d + 4) * (d + 6)),
    }


def slope(h: np.ndarray, value: np.ndarray) -> float:
    """Least-squares slope of log(value) against log(h); NaN with < 2 positive points."""
    keep = (np.asarray(value) > 0) & np.isfinite(value)
    if keep.sum() < 2:
        return float("nan")
    return float(np.polyfit(np.log(np.asarray(h)[keep]), np.log(np.asarray(value)[keep]), 1)[0])
