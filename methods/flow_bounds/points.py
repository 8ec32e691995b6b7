"""Targets of learned mode (numpy only, so the config validator can check a user file without torch):
the ring mixture, a user's 2-D point cloud, and the bridge's one-time law given the endpoints."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


# target -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mixture:
    means: np.ndarray  # (K, 2)
    std: float

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        j = rng.integers(len(self.means), size=n)
        return self.means[j] + self.std * rng.standard_normal((n, self.means.shape[1]))


def ring_mixture(components: int, radius: float, std: float) -> Mixture:
    angles = 2 * np.pi * np.arange(components) / components
    return Mixture(radius * np.stack([np.cos(angles), np.sin(angles)], axis=1), std)


@dataclass(frozen=True)
class PointCloud:
    """A user's 2-D point cloud (standardised): training points are resampled, held-out points are W₂'s reference."""

    train: np.ndarray
    heldout: np.ndarray
    name: str

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return self.train[rng.integers(len(self.train), size=n)]


def load_point_cloud(path: str, holdout: float, seed: int) -> PointCloud:
    """A .csv/.parquet with exactly two numeric columns or an (n, 2) .npy; standardised per coordinate."""
    file = Path(path)
    suffix = file.suffix.lower()
    try:
        if suffix == ".npy":
            points = np.load(file, allow_pickle=False)
        else:
            import pandas as pd

            frame = pd.read_csv(file) if suffix == ".csv" else pd.read_parquet(file)
    except Exception as exc:  # unreadable / corrupt file: one line naming it
        raise ValueError(f"{path}: cannot be read as {suffix[1:]} ({type(exc).__name__}: {exc})") from None
    if suffix != ".npy":
        numeric = frame.select_dtypes("number")
        if numeric.shape[1] != 2:
            raise ValueError(f"{path}: expected exactly 2 numeric columns (x, y), found {numeric.shape[1]} "
                             f"({', '.join(map(str, numeric.columns)) or 'none'})")
        points = numeric.to_numpy()
    points = np.asarray(points, dtype=float)
    if points.ndim != 2 or points.shape[1] != 2:
        raise ValueError(f"{path}: expected an (n, 2) array of points, got shape {points.shape}")
    if not np.isfinite(points).all():
        raise ValueError(f"{path}: contains NaN or infinite values")
    n_heldout = int(round(holdout * len(points)))
    if n_heldout < 10 or len(points) - n_heldout < 10:
        raise ValueError(f"{path}: {len(points)} points are too few (need ≥ 10 for training and ≥ 10 held out)")
    scale = points.std(axis=0)
    if (scale == 0).any():
        raise ValueError(f"{path}: a coordinate is constant, so the cloud cannot be standardised")
    points = (points - points.mean(axis=0)) / scale
    order = np.random.default_rng(seed).permutation(len(points))
    return PointCloud(points[order[n_heldout:]], points[order[:n_heldout]], file.stem)


def interpolant(t: np.ndarray, x0: np.ndarray, x1: np.ndarray, z: np.ndarray, sigma: float) -> np.ndarray:
    """X_t = (1−t)X0 + tX1 + σ√(t(1−t)) Z: the Brownian bridge's one-time law given the endpoints."""
    t = t[:, None]
    return (1 - t) * x0 + t * x1 + sigma * np.sqrt(t * (1 - t)) * z
