"""Diversity and quality metrics in the tool's own feature space (float64 numpy).

Per-class metrics (vendi, inbatch_sim, mode_coverage, minority_mass, …) are averaged over classes by the
caller; distribution metrics (precision/recall/density/coverage, FID) pool the samples over classes.
"""
from __future__ import annotations

import numpy as np

from icml.methods.diverse_init.data import class_components, component_class, nearest_component


def vendi(features: np.ndarray, kernel: str = "cosine", bandwidth: float = 0.1) -> float:
    """exp(−Σ λᵢ log λᵢ), λ the eigenvalues of K/n: cosine kernel, or exp(−‖x−y‖²/(2·bandwidth²))."""
    x = np.asarray(features, dtype=np.float64)
    if kernel == "cosine":
        x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
        k = x @ x.T
    else:
        d2 = ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1)
        k = np.exp(-d2 / (2 * bandwidth ** 2))
    lam = np.linalg.eigvalsh(k / len(x))
    lam = lam[lam > 1e-12]
    return float(np.exp(-(lam * np.log(lam)).sum()))


def inbatch_sim(features: np.ndarray) -> float:
    """Mean off-diagonal cosine similarity."""
    x = np.asarray(features, dtype=np.float64)
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    s = x @ x.T
    n = len(x)
    return float((s.sum() - np.trace(s)) / (n * (n - 1)))


def _distances(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    from scipy.spatial.distance import cdist

    return cdist(a, b)  # one pass in C: the ‖a‖² + ‖b‖² − 2ab expansion is ~10× slower here (three n×m temporaries)


def knn_radii(x: np.ndarray, k: int) -> np.ndarray:
    """Distance of each point to its k-th nearest neighbour in its own set (itself excluded)."""
    d = _distances(x, x)
    return np.partition(d, k, axis=1)[:, k]


def prdc(real: np.ndarray, fake: np.ndarray, k: int = 5, real_radii: np.ndarray | None = None) -> dict[str, float]:
    """Precision, recall, density and coverage (Naeem et al. 2020) with k nearest neighbours; `real_radii`
    (the real set's k-NN radii) can be computed once per reference set with `knn_radii`."""
    real, fake = np.asarray(real, np.float64), np.asarray(fake, np.float64)
    r_real = knn_radii(real, k) if real_radii is None else real_radii
    r_fake = knn_radii(fake, k)
    d = _distances(real, fake)  # [n_real, n_fake]
    inside_real = d < r_real[:, None]
    return {"precision": float(inside_real.any(0).mean()),
            "recall": float((d < r_fake[None, :]).any(1).mean()),
            "density": float(inside_real.sum(0).mean() / k),
            "coverage": float((d.min(1) < r_real).mean())}


def fid(real: np.ndarray, fake: np.ndarray) -> float:
    """‖μ_r − μ_g‖² + Tr(Σ_r + Σ_g − 2(Σ_r Σ_g)^½), the trace of the square root from the eigenvalues of the
    symmetric Σ_r^½ Σ_g Σ_r^½ (same spectrum as Σ_r Σ_g)."""
    real, fake = np.asarray(real, np.float64), np.asarray(fake, np.float64)
    mu_r, mu_g = real.mean(0), fake.mean(0)
    cov_r, cov_g = np.atleast_2d(np.cov(real, rowvar=False)), np.atleast_2d(np.cov(fake, rowvar=False))
    lam, vec = np.linalg.eigh(cov_r)
    root_r = (vec * np.sqrt(np.maximum(lam, 0))) @ vec.T
    cross = np.sqrt(np.maximum(np.linalg.eigvalsh(root_r @ cov_g @ root_r), 0)).sum()
    return float(((mu_r - mu_g) ** 2).sum() + np.trace(cov_r) + np.trace(cov_g) - 2 * cross)


def per_class(values: np.ndarray, labels: np.ndarray, fn) -> float:
    return float(np.mean([fn(values[labels == c]) for c in np.unique(labels)]))


def gmm_metrics(points: np.ndarray, labels: np.ndarray, sigma: float) -> dict[str, float]:
    """cond_acc (class of the nearest component), mode_coverage (share of a class's 4 components with ≥ 1
    sample within 3σ), minority_mass (share within 3σ of a minority component of the class; true 0.3),
    gmm_precision (share within 3σ of any component of the class)."""
    component, dist = nearest_component(points)
    within = dist <= 3 * sigma
    own = component_class(component) == labels
    coverage, minority = [], []
    for c in np.unique(labels):
        mask = labels == c
        comps = class_components(int(c))
        hit = [np.any(mask & within & (component == k)) for k in comps]
        coverage.append(np.mean(hit))
        minority.append(np.mean((within & np.isin(component, comps[1:]))[mask]))
    return {"cond_acc": float(own.mean()), "mode_coverage": float(np.mean(coverage)),
            "minority_mass": float(np.mean(minority)), "gmm_precision": float((within & own).mean())}


