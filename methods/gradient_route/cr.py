"""The compute ratio (App. M): how much of the baseline's training a model's loss is worth.

Per dataset, L(s) = A·(s + s₀)^(−α) is fit to the baseline's validation curve (least squares in log
space, baseline seeds pooled); L⁻¹(ℓ) = (A/ℓ)^(1/α) − s₀, clipped at 0 (a loss worse than the fitted
curve at s = 0 is worth no training); CR(M, D) = L⁻¹(ℓ(M, D)) / S̄, S̄ the mean over baseline seeds of
L⁻¹(ℓ(baseline, D)). So the baseline's CR averages to exactly 1, and CR falls as the loss rises.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PowerLaw:
    log_a: float  # log A: a curve bent like a WSD decay fits with large α and s₀, where A itself overflows
    alpha: float
    s0: float
    rmse: float  # of the log-space residuals
    n_points: int

    @property
    def a(self) -> float:
        with np.errstate(over="ignore"):
            return float(np.exp(self.log_a))

    def __call__(self, s):
        return np.exp(self.log_a - self.alpha * np.log(np.asarray(s, dtype=float) + self.s0))

    def inverse(self, loss):
        """Training steps the baseline needs to reach `loss` (0 for losses above the curve's start)."""
        log_s = (self.log_a - np.log(np.asarray(loss, dtype=float))) / self.alpha  # = log(s + s₀)
        with np.errstate(over="ignore"):
            return np.maximum(np.exp(log_s) - self.s0, 0.0)


def fit_power_law(steps, losses) -> PowerLaw:
    """Least squares on log A − α·log(s + s₀) − log ℓ with α > 0 and s + s₀ > 0 for every point."""
    from scipy.optimize import least_squares

    s = np.asarray(steps, dtype=float)
    y = np.log(np.asarray(losses, dtype=float))
    if len(s) < 2 or np.ptp(s) == 0:
        raise ValueError("a power-law fit needs losses at two or more distinct steps")
    floor = -s.min() + 1e-6 * max(1.0, s.max())

    def residual(theta):
        log_a, alpha, s0 = theta
        return log_a - alpha * np.log(s + s0) - y

    best = None
    for s0 in (0.0 if floor < 0 else floor + 1.0, s.max() / 4, s.max()):  # a few starts: the s₀ valley is flat
        s0 = max(s0, floor + 1e-9)
        slope = -np.polyfit(np.log(s + s0), y, 1)[0]
        alpha = max(slope, 1e-3)
        log_a = float(np.mean(y + alpha * np.log(s + s0)))
        result = least_squares(residual, [log_a, alpha, s0], bounds=([-np.inf, 1e-8, floor], [np.inf, np.inf, np.inf]),
                               x_scale="jac", max_nfev=2000)
        if best is None or result.cost < best.cost:
            best = result
    log_a, alpha, s0 = best.x
    rmse = float(np.sqrt(np.mean(residual(best.x) ** 2)))
    return PowerLaw(float(log_a), float(alpha), float(s0), rmse, len(s))


def reference_steps(law: PowerLaw, baseline_losses) -> float:
    """S̄: the mean over baseline seeds of L⁻¹ of the baseline's final loss."""
    return float(np.mean(law.inverse(np.asarray(baseline_losses, dtype=float))))


def compute_ratio(law: PowerLaw, s_bar: float, loss):
    return law.inverse(loss) / s_bar
