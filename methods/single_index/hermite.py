"""Orthonormal (probabilists') Hermite calculus for the Gaussian single-index model.

h_k = He_k/√k! is orthonormal under N(0, 1), h_k′ = √k h_{k−1}, and for unit w, w* with
m = ⟨w, w*⟩ the Mehler identity E[h_j(⟨w,x⟩) h_k(⟨w*,x⟩)] = δ_jk m^k turns the population risk of
φ(⟨w,x⟩) against φ*(⟨w*,x⟩) into a function of (m, a) alone. The feature functions accept numpy
arrays or torch tensors (the estimator runs in torch, the report in numpy); nothing imports torch.
"""
from __future__ import annotations

import math

import numpy as np

from icml.methods.single_index.config import TARGETS


def _stack(columns: list, like):
    if type(like).__module__.startswith("torch"):
        import torch

        return torch.stack(columns, dim=-1)
    return np.stack(columns, axis=-1)


def hermite_features(z, K: int):
    """[h_0(z), …, h_K(z)] on a new last axis, by h_{k+1} = (z h_k − √k h_{k−1}) / √(k+1)."""
    columns = [z * 0 + 1, z]
    for k in range(1, K):
        columns.append((z * columns[k] - math.sqrt(k) * columns[k - 1]) / math.sqrt(k + 1))
    return _stack(columns[:K + 1], z)


def hermite_derivative_features(z, K: int):
    """[h_0′(z), …, h_K′(z)] with h_k′ = √k h_{k−1}."""
    h = hermite_features(z, max(K - 1, 0))
    columns = [z * 0] + [math.sqrt(k) * h[..., k - 1] for k in range(1, K + 1)]
    return _stack(columns, z)


def link(z, a):
    """φ(z) = Σ_k a_k h_k(z), for a coefficient vector a of length K + 1."""
    return hermite_features(z, len(a) - 1) @ a


def target_coefficients(target: str, K: int, unit_norm: bool = False) -> np.ndarray:
    """a* of a named target, zero-padded to length K + 1; optionally scaled to ‖φ*‖_{L²} = 1."""
    a = np.zeros(K + 1)
    for k, value in TARGETS[target].items():
        a[k] = value
    return a / np.linalg.norm(a) if unit_norm else a


def pad(a: np.ndarray, length: int) -> np.ndarray:
    out = np.zeros(max(length, len(a)))
    out[:len(a)] = a
    return out


def risk(m, a: np.ndarray, a_star: np.ndarray, noise_var: float = 0.0):
    """L(m, a) = ½ Σ_k (a_k² + a*_k² − 2 a_k a*_k m^k) + ½ σ²; m may be an array (then a is (…, K+1))."""
    length = max(len(a_star), np.shape(a)[-1])
    a, a_star = np.asarray(a, float), pad(a_star, length)
    if a.shape[-1] < length:
        a = np.concatenate([a, np.zeros(a.shape[:-1] + (length - a.shape[-1],))], axis=-1)
    powers = np.asarray(m, float)[..., None] ** np.arange(length)
    return 0.5 * ((a ** 2).sum(-1) + (a_star ** 2).sum() - 2 * (a * a_star * powers).sum(-1)) + 0.5 * noise_var


def sign_adjusted(a_star: np.ndarray, m: float) -> np.ndarray:
    """a*^{(σ)}_k = σ^k a*_k with σ = sign(m): the coefficients of the mirror solution (−w*, φ*(−·))."""
    sigma = -1.0 if m < 0 else 1.0
    return a_star * sigma ** np.arange(len(a_star))


def coef_error(a: np.ndarray, a_star: np.ndarray, m: float) -> float:
    """‖a − a*^{(sign m)}‖₂ over the union of both supports."""
    length = max(len(a), len(a_star))
    return float(np.linalg.norm(pad(a, length) - sign_adjusted(pad(a_star, length), m)))
