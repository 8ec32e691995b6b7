"""Learned mode: bridge matching on a 2-D Gaussian mixture whose Markovian-projection drift is known exactly.

Source μ = N(0, I), target ν* = mixture of `components` Gaussians (means at `radius`, std s), independent
coupling, bridge X_t = (1−t)X0 + tX1 + σ(W_t − tW_1), so X_t | X0, X1 ~ N((1−t)X0 + tX1, σ²t(1−t)I).
The same σ drives the interpolant, the reference drift and the Euler–Maruyama sampler.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from icml.methods.flow_bounds.points import Mixture, interpolant


def mixture_drift(mixture: Mixture, x: torch.Tensor, t: torch.Tensor, sigma: float) -> torch.Tensor:
    """The exact Markovian-projection drift β_t(x) = (E[X1 | X_t = x] − x)/(1 − t), for t < 1.

    Given component j, X_t ~ N(tμ_j, v_j(t)I) with v_j(t) = t²s² + (1−t)² + σ²t(1−t) and
    E[X1 | X_t = x, j] = μ_j + (ts²/v_j(t))(x − tμ_j); the posterior over j is ∝ N(x; tμ_j, v_j(t)I)."""
    means = torch.as_tensor(mixture.means, dtype=x.dtype, device=x.device)
    t = t.reshape(-1, 1).to(x.dtype)
    s2 = mixture.std ** 2
    var = t ** 2 * s2 + (1 - t) ** 2 + sigma ** 2 * t * (1 - t)  # (n, 1), the same for every component
    centred = x[:, None, :] - t[:, :, None] * means[None]  # (n, K, 2)
    logits = -0.5 * (centred ** 2).sum(-1) / var  # equal weights and equal variances: the rest cancels
    post = torch.softmax(logits, dim=1)
    endpoint = means[None] + (t * s2 / var)[:, :, None] * centred
    return ((post[:, :, None] * endpoint).sum(1) - x) / (1 - t)


# model ------------------------------------------------------------------------------------------------------
class DriftNet(nn.Module):
    """MLP on (x, sinusoidal embedding of t). `parametrisation`: bridge (outputs β directly) or endpoint
    (outputs x̂1 ≈ E[X1 | X_t = x]; β = (x̂1 − x)/(1 − t), the ablation drift_loss=endpoint)."""

    def __init__(self, dim: int = 2, hidden: int = 64, layers: int = 2, frequencies: int = 16,
                 parametrisation: str = "bridge"):
        super().__init__()
        self.parametrisation = parametrisation
        # geometric frequencies 1 … 1000 rad per unit time: resolves both the slow and the t → 1 behaviour
        self.register_buffer("omega", torch.exp(torch.linspace(0.0, math.log(1000.0), frequencies)))
        widths = [dim + 2 * frequencies] + [hidden] * layers
        blocks: list[nn.Module] = []
        for a, b in zip(widths[:-1], widths[1:]):
            blocks += [nn.Linear(a, b), nn.SiLU()]
        self.body = nn.Sequential(*blocks, nn.Linear(widths[-1], dim))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The network's raw output (β or x̂1)."""
        phase = t.reshape(-1, 1) * self.omega
        return self.body(torch.cat([x, torch.sin(phase), torch.cos(phase)], dim=1))

    def drift(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        out = self(x, t)
        if self.parametrisation == "endpoint":
            return (out - x) / (1 - t.reshape(-1, 1))
        return out


def train_drift(net: DriftNet, target, steps: int, batch: int, lr: float, delta: float, sigma: float,
                seed: int, log_every: int, on_log=None) -> None:
    """Bridge matching: minimise E_{t,π,W}‖β^θ_t(X_t) − (X1 − X_t)/(1 − t)‖² with t ~ U[0, 1−δ]
    (the endpoint arm minimises ‖x̂1 − X1‖², the same regression up to the weight (1−t)⁻²).
    on_log(step, bm_loss) receives the mean bridge-matching loss of the last `log_every` steps."""
    rng = np.random.default_rng(seed)
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    running, count = 0.0, 0
    for step in range(1, steps + 1):
        t = rng.uniform(0.0, 1.0 - delta, batch)
        x0, x1 = rng.standard_normal((batch, 2)), target.sample(batch, rng)
        xt = interpolant(t, x0, x1, rng.standard_normal((batch, 2)), sigma)
        t_, xt_, x1_ = (torch.as_tensor(a, dtype=torch.float32) for a in (t, xt, x1))
        out = net(xt_, t_)
        one_minus = (1 - t_).reshape(-1, 1)
        if net.parametrisation == "endpoint":
            loss = ((out - x1_) ** 2).sum(1).mean()
            bm = (((out - x1_) / one_minus) ** 2).sum(1).mean()
        else:
            loss = ((out - (x1_ - xt_) / one_minus) ** 2).sum(1).mean()
            bm = loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        running, count = running + float(bm.detach()), count + 1
        if step % log_every == 0 or step == steps:
            if on_log is not None:
                on_log(step, running / count)
            running, count = 0.0, 0


# sampling and evaluation ------------------------------------------------------------------------------------
def euler_maruyama(drift, n: int, grid: np.ndarray, sigma: float, seed: int, fine_steps: int | None = None) -> np.ndarray:
    """Y_{k+1} = Y_k + h_k β_{t_k}(Y_k) + σ ΔB_k from Y_0 ~ N(0, I); the drift is never evaluated at t_N.

    With `fine_steps` (a multiple of the grid's N, uniform grid), ΔB_k sums the increments of one Brownian
    path on the fine uniform grid: every N then integrates the same Y_0 and path, so differences between N
    are discretization, not resampling (the mode counts of a mixture otherwise dominate W₂'s spread)."""
    generator = torch.Generator().manual_seed(seed)
    y = torch.randn(n, 2, generator=generator, dtype=torch.float64)
    steps = np.diff(grid)
    n_steps = len(steps)
    if fine_steps is not None and fine_steps % n_steps == 0 and np.ptp(steps) <= 1e-12 * grid[-1]:
        fine = torch.randn(fine_steps, n, 2, generator=generator, dtype=torch.float64) * math.sqrt(grid[-1] / fine_steps)
        increments = fine.reshape(n_steps, fine_steps // n_steps, n, 2).sum(1)
    else:
        increments = torch.randn(n_steps, n, 2, generator=generator, dtype=torch.float64) * torch.as_tensor(
            np.sqrt(steps))[:, None, None]
    for k, (t, h) in enumerate(zip(grid[:-1], steps)):
        beta = drift(y, torch.full((n,), float(t), dtype=torch.float64))
        y = y + h * beta + sigma * increments[k]
    return y.numpy()


def net_drift(net: DriftNet):
    def drift(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return net.drift(x.float(), t.float()).double()
    return drift


def drift_error(drift, reference, mixture: Mixture, grid: np.ndarray, n: int, sigma: float, seed: int):
    """(ε̂², ε̂_L2) = (Σ_k h_k E‖β^θ − β‖², Σ_k h_k (E‖β^θ − β‖²)^{1/2}) at the grid times, by Monte Carlo
    on exact interpolant samples X_{t_k}."""
    rng = np.random.default_rng(seed)
    sq, l2 = 0.0, 0.0
    for t, h in zip(grid[:-1], np.diff(grid)):
        times = np.full(n, t)
        xt = interpolant(times, rng.standard_normal((n, 2)), mixture.sample(n, rng), rng.standard_normal((n, 2)),
                         sigma)
        x, tt = torch.as_tensor(xt), torch.as_tensor(times)
        mean_sq = float(((drift(x, tt) - reference(x, tt)) ** 2).sum(1).mean())
        sq, l2 = sq + h * mean_sq, l2 + h * math.sqrt(mean_sq)
    return sq, l2


def w2_exact(a: np.ndarray, b: np.ndarray) -> float:
    """Exact empirical W₂ by optimal transport: POT's emd2 if installed, else the assignment problem
    (for equal-size uniform samples an optimal plan is a permutation, so this is exact too)."""
    from scipy.spatial.distance import cdist

    cost = cdist(a, b, "sqeuclidean")
    try:
        import ot  # noqa: F401
    except ImportError:
        from scipy.optimize import linear_sum_assignment

        if len(a) != len(b):
            raise ValueError("exact W2 without POT needs equal sample sizes")
        rows, cols = linear_sum_assignment(cost)
        return float(np.sqrt(cost[rows, cols].mean()))
    import ot

    return float(np.sqrt(ot.emd2(np.full(len(a), 1 / len(a)), np.full(len(b), 1 / len(b)), cost)))
