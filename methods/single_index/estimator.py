"""The finite-sample RKHS alternating estimator and its baselines, in torch (float64, any device).

Data: x_i ~ N(0, I_d), w* uniform on the sphere, y = φ*(⟨w*,x⟩) + σ ε with ‖φ*‖_{L²} = 1. The kernel is
the truncated Mehler kernel K(z, z′) = Σ_{k≤K} λ_k h_k(z) h_k(z′), λ_k = ρ^k, so a predictor is
φ(z) = Σ a_k h_k(z) with RKHS norm² Σ a_k²/λ_k and one iteration of the alternating scheme is

  φ-step  a = (ΦᵀΦ/n + μΛ⁻¹)⁻¹ Φᵀy/n             kernel ridge at the current w (Φ_ik = h_k(⟨w,x_i⟩))
          (or `phi_steps` λ-preconditioned gradient steps on the same objective)
  w-step  g = (1/n) Σ (φ(z_i) − y_i) φ′(z_i) x_i,  w ← normalize(w − η (I − wwᵀ) g)

Baselines: `planted` (φ ≡ φ*, w-steps only), `save` / `sir` (sliced inverse-regression directions,
then the same kernel ridge), `fixed_w` (kernel ridge at w₀, w frozen).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from icml.cli.errors import IcmlError
from icml.methods.single_index.hermite import hermite_features, target_coefficients

DTYPE = torch.float64


# data --------------------------------------------------------------------------------------------------
@dataclass
class Sample:
    x: torch.Tensor  # (n, d)
    y: torch.Tensor  # (n,)
    x_test: torch.Tensor
    y_test: torch.Tensor  # noiseless φ*(⟨w*,x⟩) for synthetic data; held-out y for user data
    w_star: torch.Tensor | None  # None for user data without a known direction
    a_star: np.ndarray | None  # unit-norm target coefficients (length K + 1)
    source: str = "synthetic"


def _generator(seed: int, stream: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed) * 7919 + stream)  # independent streams per seed


def synthetic_sample(rkhs, seed: int, device: str = "cpu") -> Sample:
    """Training sample, w* and an independent noiseless test set, all from the seed (drawn on the CPU,
    so every device sees the same numbers)."""
    a_star = target_coefficients(rkhs.target, rkhs.K, unit_norm=True)
    g = _generator(seed, 0)
    w_star = torch.randn(rkhs.d, generator=g, dtype=DTYPE)
    w_star /= w_star.norm()
    x = torch.randn(rkhs.n, rkhs.d, generator=g, dtype=DTYPE)
    y = phi(x @ w_star, a_star) + rkhs.noise * torch.randn(rkhs.n, generator=g, dtype=DTYPE)
    gt = _generator(seed, 1)
    x_test = torch.randn(rkhs.n_test, rkhs.d, generator=gt, dtype=DTYPE)
    y_test = phi(x_test @ w_star, a_star)
    to = dict(device=device)
    return Sample(x.to(**to), y.to(**to), x_test.to(**to), y_test.to(**to), w_star.to(**to), a_star)


def initial_direction(w_star: torch.Tensor, m0: float, seed: int) -> torch.Tensor:
    """w₀ = m₀ w* + √(1 − m₀²) u with u a random unit vector orthogonal to w*."""
    u = torch.randn(len(w_star), generator=_generator(seed, 2), dtype=DTYPE).to(w_star.device)
    u -= (u @ w_star) * w_star
    u /= u.norm()
    return m0 * w_star + (1 - m0 * m0) ** 0.5 * u


def random_direction(d: int, seed: int, device: str) -> torch.Tensor:
    w = torch.randn(d, generator=_generator(seed, 3), dtype=DTYPE)
    return (w / w.norm()).to(device)


def load_user_sample(path: str, test_fraction: float, seed: int, device: str = "cpu") -> Sample:
    """A user file (CSV / Parquet / npz with columns x0…x{d−1}, y; npz may add `w_star`), standardised
    column-wise (x and y), split into train / held-out test by the seed."""
    file = Path(path)
    suffix = file.suffix.lower()
    w_star = None
    try:
        if suffix == ".npz":
            with np.load(file, allow_pickle=False) as archive:
                columns = {name: np.asarray(archive[name]) for name in archive.files}
            if "x" in columns:  # the array form: x (n, d), y (n,)
                x_all = np.asarray(columns["x"], float)
                if x_all.ndim != 2:
                    raise IcmlError(f"data.path '{path}': array x must be 2-D (n, d), not shape {x_all.shape}",
                                    "save x as an (n, d) array")
                columns.update({f"x{j}": x_all[:, j] for j in range(x_all.shape[1])})
            w_star = columns.get("w_star")
        else:
            import pandas as pd

            frame = pd.read_csv(file) if suffix == ".csv" else pd.read_parquet(file)
            columns = {str(c): frame[c].to_numpy() for c in frame.columns}
    except IcmlError:
        raise
    except Exception as exc:  # unreadable, corrupt or truncated files of any of the three formats
        raise IcmlError(f"data.path '{path}' cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})",
                        "pass a CSV, Parquet or npz file with columns x0…x{d−1} and y") from None
    names = sorted((c for c in columns if c.startswith("x") and c[1:].isdigit()), key=lambda c: int(c[1:]))
    if "y" not in columns or not names:
        raise IcmlError(f"data.path '{path}' needs columns x0…x{{d−1}} and y (found {sorted(columns)[:8]})",
                        "name the features x0, x1, … and the response y")
    d = len(names)
    if names != [f"x{j}" for j in range(d)]:
        raise IcmlError(f"data.path '{path}': feature columns must be x0…x{d - 1} without gaps",
                        "rename the feature columns consecutively")
    try:
        x = np.column_stack([np.asarray(columns[c], dtype=float) for c in names])
        y = np.asarray(columns["y"], dtype=float).reshape(-1)
    except (TypeError, ValueError):
        raise IcmlError(f"data.path '{path}' has non-numeric values", "keep only numbers in x0…x{d−1}, y") from None
    if len(y) != len(x) or not np.isfinite(x).all() or not np.isfinite(y).all():
        raise IcmlError(f"data.path '{path}' has missing or non-finite values", "drop or impute those rows")
    if len(y) < 20 or d < 2:
        raise IcmlError(f"data.path '{path}' has {len(y)} rows and {d} features; need ≥ 20 rows and ≥ 2 features",
                        "pass a larger data set")
    if w_star is not None:
        w_star = np.asarray(w_star, float).reshape(-1)
        if len(w_star) != d or not np.isfinite(w_star).all() or np.linalg.norm(w_star) == 0:
            raise IcmlError(f"data.path '{path}': w_star must be a finite non-zero vector of length {d}",
                            "drop w_star or fix its length")
    scale = x.std(0)
    if (scale == 0).any() or y.std() == 0:
        raise IcmlError(f"data.path '{path}' has a constant column", "drop constant features (or y)")
    x = (x - x.mean(0)) / scale
    y = (y - y.mean()) / y.std()
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = max(1, int(round(test_fraction * len(y))))
    test, train = order[:n_test], order[n_test:]
    tensor = lambda v: torch.as_tensor(v, dtype=DTYPE, device=device)  # noqa: E731
    if w_star is not None:  # standardising x by a diagonal D maps the index ⟨w*,x⟩ to ⟨D w*, x̃⟩
        w_star = w_star * scale
        w_star = tensor(w_star / np.linalg.norm(w_star))
    return Sample(tensor(x[train]), tensor(y[train]), tensor(x[test]), tensor(y[test]), w_star, None, source=file.stem)


# the link in the Hermite basis -----------------------------------------------------------------------
def phi(z: torch.Tensor, a) -> torch.Tensor:
    a = torch.as_tensor(a, dtype=z.dtype, device=z.device)
    return hermite_features(z, len(a) - 1) @ a


def eigenvalues(K: int, rho: float, device="cpu") -> torch.Tensor:
    return rho ** torch.arange(K + 1, dtype=DTYPE, device=device)


def ridge_coefficients(features: torch.Tensor, y: torch.Tensor, lam: torch.Tensor, mu: float) -> torch.Tensor:
    """a = (ΦᵀΦ/n + μΛ⁻¹)⁻¹ Φᵀy/n: kernel ridge with K = ΦΛΦᵀ and penalty nμ, in coefficient form."""
    n = len(y)
    gram = features.T @ features / n + torch.diag(mu / lam)
    return torch.linalg.solve(gram, features.T @ y / n)


def ridge_gradient_steps(a: torch.Tensor, features: torch.Tensor, y: torch.Tensor, lam: torch.Tensor, mu: float,
                         steps: int, lr: float) -> torch.Tensor:
    """`steps` RKHS gradient steps on ½‖Φa − y‖²/n + ½μ aᵀΛ⁻¹a: the gradient in the RKHS metric is Λ∇."""
    n = len(y)
    for _ in range(steps):
        a = a - lr * lam * (features.T @ (features @ a - y) / n + mu * a / lam)
    return a


def sphere_step(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, eta: float,
                features: torch.Tensor | None = None) -> torch.Tensor:
    """w ← normalize(w − η(I − wwᵀ)g), g = (1/n) Σ (φ(z_i) − y_i) φ′(z_i) x_i, z = Xw."""
    g = w_gradient(w, x, y, a, features)
    g_tangent = g - (g @ w) * w
    w = w - eta * g_tangent
    return w / w.norm()


def w_gradient(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor,
               features: torch.Tensor | None = None) -> torch.Tensor:
    """∇_w of ½ (1/n) Σ (φ(⟨w,x_i⟩) − y_i)² (the Euclidean gradient, before the tangent projection).
    `features` = [h_0 … h_K](Xw) if already computed; φ′ = Σ_k a_k √k h_{k−1} reuses them."""
    K = len(a) - 1
    if features is None:
        features = hermite_features(x @ w, K)
    residual = features @ a - y
    sqrt_k = torch.arange(1, K + 1, dtype=a.dtype, device=a.device).sqrt()
    slope = features[:, :K] @ (sqrt_k * a[1:])
    return x.T @ (residual * slope) / len(y)


# estimators ------------------------------------------------------------------------------------------
@dataclass
class Fit:
    w: torch.Tensor
    a: torch.Tensor
    w0: torch.Tensor
    overlap: list[float] = field(default_factory=list)  # per iteration (empty without w*)
    train_mse: list[float] = field(default_factory=list)
    coefficients: list[np.ndarray] = field(default_factory=list)


def _log(fit: Fit, sample: Sample, w: torch.Tensor, a: torch.Tensor, features: torch.Tensor) -> None:
    """Record the iterate (w, a); `features` are [h_k](Xw) at this w."""
    if sample.w_star is not None:
        fit.overlap.append(float(w @ sample.w_star))
    fit.train_mse.append(float(((features @ a - sample.y) ** 2).mean()))
    fit.coefficients.append(a.cpu().numpy().copy())


def fit_joint(sample: Sample, w0: torch.Tensor, rkhs) -> Fit:
    """The alternating scheme: per iteration a φ-step at the current w, then a sphere step with that φ.
    After the last iteration φ is refitted at the final w, so (w, a) are a consistent pair. The Hermite
    features at each w are computed once and serve the φ-step, the w-step and the log."""
    lam = eigenvalues(rkhs.K, rkhs.rho, w0.device)
    w, a = w0.clone(), torch.zeros(rkhs.K + 1, dtype=DTYPE, device=w0.device)
    fit = Fit(w, a, w0)

    def phi_step(features, a):
        if rkhs.phi_steps:
            return ridge_gradient_steps(a, features, sample.y, lam, rkhs.mu, rkhs.phi_steps, rkhs.phi_lr)
        return ridge_coefficients(features, sample.y, lam, rkhs.mu)

    features = hermite_features(sample.x @ w, rkhs.K)
    for _ in range(rkhs.iters):
        a = phi_step(features, a)
        w = sphere_step(w, sample.x, sample.y, a, rkhs.eta, features)
        features = hermite_features(sample.x @ w, rkhs.K)
        _log(fit, sample, w, a, features)
    fit.w, fit.a = w, phi_step(features, a)
    return fit


def fit_planted(sample: Sample, w0: torch.Tensor, rkhs) -> Fit:
    """φ ≡ φ* (the true link), w-steps only."""
    a = torch.as_tensor(sample.a_star, dtype=DTYPE, device=w0.device)
    K = len(a) - 1
    w = w0.clone()
    fit = Fit(w, a, w0)
    features = hermite_features(sample.x @ w, K)
    for _ in range(rkhs.iters):
        w = sphere_step(w, sample.x, sample.y, a, rkhs.eta, features)
        features = hermite_features(sample.x @ w, K)
        _log(fit, sample, w, a, features)
    fit.w = w
    return fit


def fit_at(sample: Sample, w: torch.Tensor, w0: torch.Tensor, rkhs) -> Fit:
    """Kernel ridge φ at a fixed direction (fixed_w, and the φ-fit of save / sir)."""
    lam = eigenvalues(rkhs.K, rkhs.rho, w.device)
    features = hermite_features(sample.x @ w, rkhs.K)
    a = ridge_coefficients(features, sample.y, lam, rkhs.mu)
    fit = Fit(w, a, w0)
    _log(fit, sample, w, a, features)
    return fit


def _whiten(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Z, Σ̂^{−1/2}) with Z = (x − x̄) Σ̂^{−1/2}."""
    centred = x - x.mean(0)
    cov = centred.T @ centred / (len(x) - 1)
    values, vectors = torch.linalg.eigh(cov)
    inv_sqrt = vectors @ torch.diag(values.clamp_min(1e-12) ** -0.5) @ vectors.T
    return centred @ inv_sqrt, inv_sqrt


def _slices(y: torch.Tensor, n_slices: int) -> list[torch.Tensor]:
    return list(torch.tensor_split(torch.argsort(y), n_slices))


def save_matrix(x: torch.Tensor, y: torch.Tensor, n_slices: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_h p_h (I − Cov(z | slice h))², Σ̂^{−1/2}): sliced average variance estimation on whitened z."""
    z, inv_sqrt = _whiten(x)
    eye = torch.eye(x.shape[1], dtype=x.dtype, device=x.device)
    matrix = torch.zeros_like(eye)
    for members in _slices(y, n_slices):
        zh = z[members]
        centred = zh - zh.mean(0)
        gap = eye - centred.T @ centred / max(len(members) - 1, 1)
        matrix += len(members) / len(y) * gap @ gap
    return matrix, inv_sqrt


def sir_matrix(x: torch.Tensor, y: torch.Tensor, n_slices: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_h p_h z̄_h z̄_hᵀ, Σ̂^{−1/2}): sliced inverse regression, blind to even links (E[z | y] = 0)."""
    z, inv_sqrt = _whiten(x)
    matrix = torch.zeros(x.shape[1], x.shape[1], dtype=x.dtype, device=x.device)
    for members in _slices(y, n_slices):
        mean = z[members].mean(0)
        matrix += len(members) / len(y) * torch.outer(mean, mean)
    return matrix, inv_sqrt


def save_direction(x: torch.Tensor, y: torch.Tensor, n_slices: int) -> torch.Tensor:
    return _top_direction(*save_matrix(x, y, n_slices))


def sir_direction(x: torch.Tensor, y: torch.Tensor, n_slices: int) -> torch.Tensor:
    return _top_direction(*sir_matrix(x, y, n_slices))


def _top_direction(matrix: torch.Tensor, inv_sqrt: torch.Tensor) -> torch.Tensor:
    """The top eigenvector, mapped back from whitened coordinates to a unit direction of x."""
    _, vectors = torch.linalg.eigh(matrix)
    w = inv_sqrt @ vectors[:, -1]
    return w / w.norm()


def fit_variant(variant: str, sample: Sample, w0: torch.Tensor, rkhs) -> Fit:
    if variant == "joint":
        return fit_joint(sample, w0, rkhs)
    if variant == "planted":
        return fit_planted(sample, w0, rkhs)
    if variant == "fixed_w":
        return fit_at(sample, w0, w0, rkhs)
    direction = {"save": save_direction, "sir": sir_direction}[variant]
    return fit_at(sample, direction(sample.x, sample.y, rkhs.slices), w0, rkhs)
