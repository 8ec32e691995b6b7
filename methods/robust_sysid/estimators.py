"""The estimators of `icml robust-sysid`, batched over problems of one shape (B, T, d) → Θ̂ (B, m, d).

- `least_squares`: argmin Σ_t ‖y_t − Θφ_t‖₂², by QR of Φ (never the normal equations).
- `l2_irls`: the paper's ℓ₂-norm estimator argmin Σ_t ‖y_t − Θφ_t‖₂ (non-squared, row-wise) by
  iteratively reweighted least squares from Θ̂_LS, weights w_t = 1/max(‖r_t‖, η), each step a
  least-squares solve on √w-scaled rows. It is a majorize–minimize scheme: ‖r‖ ≤ ‖r‖²/(2c) + c/2 with
  equality at c = ‖r‖, so the objective never increases while every ‖r_t‖ ≥ η.
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
    norm = np.linalg.norm(r, axis=-1, keepdims=True)
    unit = np.where(norm > eta, r / np.maximum(norm, eta), 0.0)
    return np.linalg.norm(np.einsum("btm,btd->bmd", unit, Phi), axis=(1, 2)) / Phi.shape[1]


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


def l2_irls(Phi: np.ndarray, Y: np.ndarray, iters: int = 200, tol: float = 1e-10, eta: float = 1e-9,
            Theta0: np.ndarray | None = None) -> IrlsResult:
    """IRLS for argmin Σ_t ‖y_t − Θφ_t‖₂ from Θ̂_LS; a member stops once its objective changes by less
    than `tol` relatively (or after `iters` solves) and keeps its last iterate."""
    start = time.perf_counter()
    Theta = least_squares(Phi, Y) if Theta0 is None else Theta0.copy()
    value = objective(Phi, Y, Theta)
    trace = [value.copy()]
    done = np.zeros(len(Phi), dtype=bool)
    count = np.zeros(len(Phi), dtype=np.int64)
    for _ in range(iters):
        active = np.flatnonzero(~done)
        if active.size == 0:
            break
        P, Yb = Phi[active], Y[active]
        weights = 1.0 / np.maximum(residual_norms(P, Yb, Theta[active]), eta)
        Theta[active] = least_squares(P, Yb, weights)
        new = objective(P, Yb, Theta[active])
        count[active] += 1
        done[active] = np.abs(value[active] - new) <= tol * np.maximum(value[active], np.finfo(float).tiny)
        value[active] = new
        trace.append(value.copy())
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
