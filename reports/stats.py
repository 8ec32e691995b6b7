"""Small statistics shared by every method's reports."""
from __future__ import annotations

import numpy as np

Z_95 = 1.959963984540054  # two-sided 95% normal quantile


def wilson_interval(k, n, z: float = Z_95) -> tuple[np.ndarray, np.ndarray]:
    """Wilson score interval for a binomial proportion k/n, elementwise over arrays.

    The bounds are the two roots p of (k/n - p)^2 = z^2 p (1 - p) / n.  Unlike the
    normal (Wald) interval it stays inside [0, 1] and is not degenerate at k = 0 or
    k = n, which matters for decoding errors near zero.  Entries with n = 0 give NaN.
    Returns (low, high) as float arrays of the broadcast shape of k and n.
    """
    k = np.asarray(k, dtype=np.float64)
    n = np.asarray(n, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        p_hat = k / n
        z2_n = z * z / n
        centre = (p_hat + z2_n / 2) / (1 + z2_n)
        half = z * np.sqrt(p_hat * (1 - p_hat) / n + z2_n / (4 * n)) / (1 + z2_n)
    low = np.clip(centre - half, 0.0, 1.0)
    high = np.clip(centre + half, 0.0, 1.0)
    return low, high


T_INTERVAL = "95 % Student-t interval over seeds: mean ± t(0.975, n−1) · sd / √n"


def t_interval(values) -> tuple[float, float, float, float, int]:
    """(mean, low, high, sd, n) of the finite `values`: the two-sided 95 % Student-t interval of
    their mean, t(0.975, n−1) · sd/√n wide on each side (sd with ddof = 1). Seeds are few (3–5),
    which is where t and not the normal quantile is right; a bootstrap of 3 values has only 10
    distinct resamples. n < 2 gives NaN bounds (no interval from one seed)."""
    from scipy.stats import t as student_t

    x = np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=np.float64)
    n = len(x)
    if n == 0:
        return float("nan"), float("nan"), float("nan"), float("nan"), 0
    mean = float(x.mean())
    if n < 2:
        return mean, float("nan"), float("nan"), float("nan"), n
    sd = float(x.std(ddof=1))
    half = float(student_t.ppf(0.975, n - 1)) * sd / np.sqrt(n)
    return mean, mean - half, mean + half, sd, n
