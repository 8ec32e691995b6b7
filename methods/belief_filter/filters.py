"""The three HMM filters of the paper, batched over any leading dimensions.

Conventions (the paper's): T is column-stochastic, T[i, j] = P(s_k = i | s_{k-1} = j);
E is column-stochastic, E[j, i] = P(y = j | s = i), so the log-likelihood of a one-hot
observation y is (log E)^T y = log E[y, :].  State vectors live in the last dimension;
transition matrices broadcast against them as (..., n, n), so one call advances every
trajectory, every ε and every action at once.
"""
from __future__ import annotations

import torch


def transition(T: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Apply a (batched) matrix to state vectors: (T x)_i = Σ_j T_ij x_j."""
    return (T @ x.unsqueeze(-1)).squeeze(-1)


def obs_loglik(log_E: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(log E)^T y for integer observations y of any shape -> (*y.shape, n)."""
    return log_E[y]


def lof_step(l_prev: torch.Tensor, log_lik: torch.Tensor, log_T: torch.Tensor) -> torch.Tensor:
    """Exact Bayes filter in logit space: l_k = log(E^T y_k) + log(T exp(l_{k-1})).

    Computed with logsumexp, never through beliefs, so nothing underflows.
    """
    return log_lik + torch.logsumexp(log_T + l_prev.unsqueeze(-2), dim=-1)


def lof_linear_step(l_prev: torch.Tensor, log_lik: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """Linear logit filter for a permutation (or action-selected permutations) P:
    l_k = P l_{k-1} + (log E)^T y_k.  Exact up to an additive constant when T = P."""
    return transition(P, l_prev) + log_lik


def alf_step(w_prev: torch.Tensor, log_lik: torch.Tensor, P: torch.Tensor,
             delta: torch.Tensor | float) -> torch.Tensor:
    """Approximate (leaky) linear filter: w_k = (1-δ) P w_{k-1} + δ log(E^T y_k).

    `P` is diag(P, I_r) (recurrent permutation, transient identity) or P(a_k);
    `delta` broadcasts against the leading dimensions (one δ per ε, say).
    """
    if isinstance(delta, torch.Tensor):
        delta = delta.unsqueeze(-1)
    return (1.0 - delta) * transition(P, w_prev) + delta * log_lik


def normalise_logits(l: torch.Tensor) -> torch.Tensor:
    """l - logsumexp(l): the log-belief, invariant to the additive constant."""
    return l - torch.logsumexp(l, dim=-1, keepdim=True)


def argmax_random_ties(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """argmax over the last dimension, breaking exact ties uniformly at random.

    A deterministic argmax would always pick the first state and distort δ = 0
    (all-zero filter state) into a biased rather than a chance-level decoder.
    """
    is_max = x == x.amax(dim=-1, keepdim=True)
    u = torch.rand(x.shape, generator=generator, dtype=torch.float64, device=x.device)
    return torch.where(is_max, u, torch.full_like(u, -1.0)).argmax(dim=-1)
