"""The estimators of `icml robust-sysid`, batched over problems of one shape (B, T, d) → Θ̂ (B, m, d).

- `least_squares`: argmin Σ_t ‖y_t − Θφ_t‖₂², by QR of Φ (never the normal equations).
- `l2_irls`: the paper's ℓ₂-norm estimator argmin Σ_t ‖y_t − Θφ_t‖₂ (non-squared, row-wise) by
  iteratively reweighted least squares from Θ̂_LS, weights w_t = 1/max(‖r_t‖, η), each step a
  least-squares solve on √w-scaled rows, until the optimality residual is below grad_tol·‖Φ‖_rms. It is a
  majorize–minimize scheme: ‖r‖ ≤ ‖r‖²/(2c) + c/2 with equality at c = ‖r‖, so the objective never
  increases while every ‖r_t‖ ≥ η.
- `l2_cvx`: the same problem as the SOCP min Σ s_t s.t. ‖y_t − Θφ_t‖ ≤ s_t, through cvxpy (Clarabel).
- `lad_coordwise`: the ablation Σ_t ‖r_t‖₁, separable per output: the ℓ₂ estimator of each output alone.
- `huber`: per-output scikit-learn HuberRegressor (ε = 1.35, no penalty, no intercept).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

# a pivot of R below this fraction of the largest one marks a rank-deficient design: use SVD lstsq
RANK_TOL = 1e-10
# a residual below this fraction of the d-th smallest residual norm (d regressors) is taken to sit at a kink
# of the ℓ₂ objective (a zero residual). A generic optimum has fewer than d zero residuals (each takes m of
# the m·d parameters), so the d-th smallest is an ordinary one; IRLS takes a kink's residual 1e-3 below it
# within ≈ 30–120 iterations in the sweeps' problems (README 2026-12-07)
KINK = 1e-3


def predict(Phi: np.ndarray, Theta: np.ndarray) -> np.ndarray:
    return np.einsum("btd,bmd->btm", Phi, Theta)


def residual_norms(Phi: np.ndarray, Y: np.ndarray, Theta: np.ndarray) -> np.ndarray:
    """‖y_t − Θφ_t‖₂, (B, T)."""
    return np.linalg.norm(Y - predict(Phi, Theta), axis=-1)


def objective(Phi: np.ndarray, Y: np.ndarray, Theta: np.ndarray) -> np.ndarray:
    """(1/T) Σ_t ‖y_t − Θφ_t‖₂, (B,)."""
    return residual_norms(Phi, Y, Theta).mean(axis=-1)


def subgrad_norm(Phi: np.ndarray, Y: np.ndarray, Theta: np.ndarray, eta: float) -> np.ndarray:
    """‖(1/T) Σ_{t: ‖r_t‖>η} (r_t/‖r_t‖) φ_tᵀ‖_F: zero at an optimum where no residual vanishes."""
    r = Y - predict(Phi, Theta)
    norm = np.linalg.norm(r, axis=-1)
    return np.linalg.norm(_gradient(Phi, r, norm, norm <= eta), axis=(1, 2))


def optimality_residual(Phi: np.ndarray, Y: np.ndarray, Theta: np.ndarray, eta: float) -> np.ndarray:
    """dist(0, ∂f(Θ)) of f = (1/T) Σ_t ‖y_t − Θφ_t‖₂, (B,), with the residuals at kinks treated as zero."""
    r = Y - predict(Phi, Theta)
    return _optimality_residual(Phi, r, np.linalg.norm(r, axis=-1), eta)


def _gradient(Phi: np.ndarray, r: np.ndarray, norm: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """(1/T) Σ_{t not zero} (r_t/‖r_t‖) φ_tᵀ, (B, m, d)."""
    unit = np.where(zero[..., None], 0.0, r / np.where(zero, 1.0, norm)[..., None])
    return np.einsum("btm,btd->bmd", unit, Phi) / Phi.shape[1]


def _optimality_residual(Phi: np.ndarray, r: np.ndarray, norm: np.ndarray, eta: float) -> np.ndarray:
    """The ℓ₂ objective has a kink wherever a residual vanishes; there its subdifferential holds every
    (1/T) G_t φ_tᵀ with ‖G_t‖ ≤ 1, and IRLS only drives such a residual to 0 slowly (≈ 1/k), so the plain
    gradient over the other terms (`subgrad_norm`) keeps a part of size up to ‖φ_t‖/T that no step removes.
    Residuals ≤ max(η, KINK · (the d-th smallest ‖r_t‖)) count as zero; their G_t are the least-squares choice that
    cancels the rest of the gradient, each pulled back into its unit ball. The result is the smaller of
    that and `subgrad_norm` (G_t = r_t/‖r_t‖, exact where every residual exceeds η): an upper bound on the
    distance from 0 to the subdifferential, of Θ itself or with the near-zero residuals set to zero."""
    T, d = Phi.shape[1], Phi.shape[2]
    plain = np.linalg.norm(_gradient(Phi, r, norm, norm <= eta), axis=(1, 2))
    ordinary = np.partition(norm, d - 1, axis=1)[:, d - 1:d]  # the d-th smallest residual norm
    zero = norm <= np.maximum(eta, KINK * ordinary)
    gradient = _gradient(Phi, r, norm, zero)
    out = np.linalg.norm(gradient, axis=(1, 2))
    for b in np.flatnonzero(zero.any(axis=1)):
        at_kinks = Phi[b][zero[b]]  # (k, d)
        G = np.linalg.lstsq(at_kinks.T, -T * gradient[b].T, rcond=None)[0]  # (k, m): G_t of each kink
        G /= np.maximum(np.linalg.norm(G, axis=1, keepdims=True), 1.0)
        out[b] = np.linalg.norm(gradient[b] + G.T @ at_kinks / T)
    return np.minimum(out, plain)


def phi_rms(Phi: np.ndarray) -> np.ndarray:
    """‖Φ‖_rms = √((1/T) Σ_t ‖φ_t‖²), (B,): each term of the gradient has norm ‖φ_t‖, so `subgrad_norm`
    and `optimality_residual` are ≤ mean_t ‖φ_t‖ ≤ ‖Φ‖_rms: divided by it, a relative residual in [0, 1]."""
    return np.sqrt((Phi ** 2).sum(axis=2).mean(axis=1))


def least_squares(Phi: np.ndarray, Y: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """argmin Σ_t w_t ‖y_t − Θφ_t‖² for each batch member: QR of the √w-scaled rows (batched),
    falling back to SVD `lstsq` (minimum norm) for a rank-deficient design."""
    if weights is not None:
        root = np.sqrt(weights)[..., None]
        Phi, Y = Phi * root, Y * root
    Q, R = np.linalg.qr(Phi)
    pivots = np.abs(np.diagonal(R, axis1=1, axis2=2))
    full_rank = pivots.min(axis=1) > RANK_TOL * pivots.max(axis=1)
    Theta = np.empty((Phi.shape[0], Y.shape[2], Phi.shape[2]))
    if full_rank.any():
        rhs = np.einsum("btd,btm->bdm", Q[full_rank], Y[full_rank])
        Theta[full_rank] = np.linalg.solve(R[full_rank], rhs).transpose(0, 2, 1)
    for b in np.flatnonzero(~full_rank):
        Theta[b] = np.linalg.lstsq(Phi[b], Y[b], rcond=None)[0].T
    return Theta


@dataclass
class IrlsResult:
    Theta: np.ndarray  # (B, m, d)
    iters: np.ndarray  # (B,) reweighted solves until the stopping rule
    trace: list[np.ndarray] = field(default_factory=list)  # objective per iteration, (B,) each; [0] = LS
    seconds: float = 0.0


def l2_irls(Phi: np.ndarray, Y: np.ndarray, iters: int = 200, grad_tol: float = 1e-6, eta: float = 1e-9,
            Theta0: np.ndarray | None = None) -> IrlsResult:
    """IRLS for argmin Σ_t ‖y_t − Θφ_t‖₂ from Θ̂_LS. A member stops once it meets the optimality
    condition, optimality_residual ≤ grad_tol · ‖Φ‖_rms (from the residuals that give the next weights),
    once a step no longer lowers its objective (the floating-point floor), or after `iters` solves; it
    keeps its last iterate."""
    start = time.perf_counter()
    Theta = least_squares(Phi, Y) if Theta0 is None else Theta0.copy()
    value = objective(Phi, Y, Theta)
    trace = [value.copy()]
    bound = grad_tol * phi_rms(Phi)
    count = np.zeros(len(Phi), dtype=np.int64)
    active = np.arange(len(Phi))
    while active.size:
        P, Yb = Phi[active], Y[active]
        r = Yb - predict(P, Theta[active])
        norm = np.linalg.norm(r, axis=-1)
        go = (_optimality_residual(P, r, norm, eta) > bound[active]) & (count[active] < iters)
        active, P, Yb, norm = active[go], P[go], Yb[go], norm[go]
        if active.size == 0:
            break
        Theta[active] = least_squares(P, Yb, 1.0 / np.maximum(norm, eta))
        new = objective(P, Yb, Theta[active])
        count[active] += 1
        lowered = new < value[active]
        value[active] = new
        trace.append(value.copy())
        active = active[lowered]
    return IrlsResult(Theta, count, trace, time.perf_counter() - start)


def lad_coordwise(Phi: np.ndarray, Y: np.ndarray, **irls) -> IrlsResult:
    """argmin Σ_t ‖y_t − Θφ_t‖₁ = Σ_j (the one-output ℓ₂ estimator of output j): one IRLS batch over
    every (problem, output) pair. Not the paper's estimator (its norm is row-wise)."""
    B, T, m = Y.shape
    out = l2_irls(np.repeat(Phi, m, axis=0), Y.transpose(0, 2, 1).reshape(B * m, T, 1), **irls)
    Theta = out.Theta.reshape(B, m, -1)
    return IrlsResult(Theta, out.iters.reshape(B, m).max(axis=1), [], out.seconds)


def cvxpy_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("cvxpy") is not None


def l2_cvx(Phi: np.ndarray, Y: np.ndarray) -> np.ndarray:
    """argmin Σ_t ‖y_t − Θφ_t‖₂ as the SOCP min Σ s_t s.t. ‖y_t − Θφ_t‖₂ ≤ s_t through cvxpy: Clarabel
    (an interior-point method), SCS if Clarabel is absent. One problem with constant data per fit: a
    parametrised (DPP) problem keeps a large parameter tensor per shape alive (gigabytes at T = 5000)."""
    import cvxpy as cp

    B, T, d = Phi.shape
    m = Y.shape[2]
    solver = cp.CLARABEL if cp.CLARABEL in cp.installed_solvers() else cp.SCS
    Theta = np.empty((B, m, d))
    for b in range(B):
        theta, bound = cp.Variable((m, d)), cp.Variable(T)
        problem = cp.Problem(cp.Minimize(cp.sum(bound)), [cp.SOC(bound, Y[b] - Phi[b] @ theta.T, axis=1)])
        problem.solve(solver=solver)
        if theta.value is None:
            raise RuntimeError(f"cvxpy ({solver}) found no solution: status {problem.status}")
        Theta[b] = theta.value
    return Theta


def huber(Phi: np.ndarray, Y: np.ndarray, epsilon: float = 1.35) -> np.ndarray:
    """Per-output Huber regression (scikit-learn; it also estimates each output's scale)."""
    import warnings

    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import HuberRegressor

    B, _, d = Phi.shape
    Theta = np.empty((B, Y.shape[2], d))
    for b in range(B):
        for j in range(Y.shape[2]):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConvergenceWarning)
                model = HuberRegressor(epsilon=epsilon, alpha=0.0, fit_intercept=False, max_iter=1000)
                Theta[b, j] = model.fit(Phi[b], Y[b, :, j]).coef_
    return Theta
