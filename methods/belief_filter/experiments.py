"""Experiments E1-E3 of `icml belief-filter` as pure functions returning result rows.

E1 checks the exactness claims (linear logit filter == logsumexp logit filter for
permutation dynamics), E2 runs the paper's §6.1 decoding protocol, E3 an
action-controlled version of it.  Each run_* returns a list of row dicts with keys
`experiment`, `variant`, `metric`, `value` plus tag keys (inv_eps, eps, delta,
horizon, n_traj, n_states, n_obs); the framework adds run id, seed and so on.

E2 and E3 are array code over (ε, trajectory, state), looping only over time and
keeping only the current step in memory.  All arithmetic is float64.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from scipy.integrate import quad

from icml.cli.threads import threads_for
from icml.reports.stats import wilson_interval

from .config import E1Config, E2Config, E3Config
from .filters import (argmax_random_ties, lof_linear_step, lof_step, normalise_logits,
                      obs_loglik, transition)
from .hmm import (DTYPE, HMM, e1_action_permutations, e1_hmm, e3_hmm, is_permutation,
                  nearly_deterministic, permutation_period, two_state_hmm)

Progress = Callable[[int, int], None]

# log 0 replaced by a large finite negative number wherever a filter multiplies logits
# by a matrix: 0 * (-inf) would be NaN.  e^-1000 is 0 in float64 anyway.
LOG_ZERO = -1000.0
# Log-beliefs below this are probabilities under 1e-304, i.e. zero in float64; E1
# compares normalised logits after clipping here so that two "zeros" count as equal.
COMPARE_FLOOR = -700.0
PROGRESS_EVERY = 10  # time steps between progress callbacks

_STREAM = {"e1": 1, "e2": 2, "e3": 3}  # independent random streams per experiment


def _generators(seed: int, experiment: str) -> tuple[np.random.Generator, torch.Generator]:
    """A numpy generator (HMM construction) and a torch generator (simulation)."""
    hmm_seq, sim_seq = np.random.SeedSequence([seed, _STREAM[experiment]]).spawn(2)
    gen = torch.Generator().manual_seed(int(sim_seq.generate_state(1)[0]))
    return np.random.default_rng(hmm_seq), gen


def _safe_log(x: torch.Tensor) -> torch.Tensor:
    return torch.log(x).clamp_min(LOG_ZERO)


def _column_cdfs(M: torch.Tensor) -> torch.Tensor:
    """Cumulative distribution of each column of a column-stochastic M (..., k, n) -> (..., n, k).

    The last entry is set to exactly 1 so that u in [0, 1) always lands on an outcome.
    """
    cdf = M.cumsum(dim=-2).transpose(-1, -2).contiguous()
    cdf[..., -1] = 1.0
    return cdf


def _sample(cdf: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One categorical draw per row of cdf (..., k): the number of cdf values <= u."""
    u = torch.rand(cdf.shape[:-1], generator=gen, dtype=DTYPE)
    return (u.unsqueeze(-1) >= cdf).sum(dim=-1)


def _rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """table[index] for a 2-D table and an integer index of any shape (as filters.obs_loglik).

    F.embedding is the same row gather, several times faster than advanced indexing
    on CPU; it matters in the E2/E3 inner loop.
    """
    return F.embedding(index, table)


def _progress(progress: Progress | None, k: int, total: int) -> None:
    if progress is not None and (k % PROGRESS_EVERY == 0 or k == total):
        progress(k, total)


# ==================================================================================
# E1: exactness of the linear logit filter


def _max_logit_gap(T_true: torch.Tensor, P_linear: torch.Tensor, E: torch.Tensor,
                   pi0: torch.Tensor, n_seq: int, length: int, gen: torch.Generator,
                   l0_linear: torch.Tensor | None = None) -> float:
    """Simulate the HMM with transitions T_true (A, n, n) (actions uniform at random when
    A > 1) and run the logsumexp LOF (exact Bayes, from log π0) next to the linear
    recursion l_k = P(a_k) l_{k-1} + (log E)^T y_k.

    The linear filter starts at log π0, or at `l0_linear` (n_seq, n) with the paper's
    first-step correction P(a_1)(log π0 - l0) added.  Returns the max over sequences and
    steps of the sup-norm between the two normalised logit vectors.
    """
    n_actions, n = T_true.shape[0], T_true.shape[-1]
    log_T = torch.log(T_true)  # -inf entries are fine inside logsumexp
    log_E, log_pi0 = _safe_log(E), _safe_log(pi0)
    transition_cdf, emission_cdf = _column_cdfs(T_true), _column_cdfs(E)

    s = _sample(_column_cdfs(pi0[:, None])[0].expand(n_seq, n), gen)
    l_exact = log_pi0.expand(n_seq, n)
    l_linear = l_exact if l0_linear is None else l0_linear
    gap = 0.0
    for k in range(length):
        a = torch.randint(n_actions, (n_seq,), generator=gen)
        s = _sample(transition_cdf[a, s], gen)
        log_lik = obs_loglik(log_E, _sample(emission_cdf[s], gen))
        l_exact = lof_step(l_exact, log_lik, log_T[a])
        l_linear = lof_linear_step(l_linear, log_lik, P_linear[a])
        if k == 0 and l0_linear is not None:  # the first-step correction P(a_1)(l*_0 - l_0)
            l_linear = l_linear + transition(P_linear[a], log_pi0 - l0_linear)
        diff = (normalise_logits(l_linear).clamp_min(COMPARE_FLOOR)
                - normalise_logits(l_exact).clamp_min(COMPARE_FLOOR))
        gap = max(gap, diff.abs().max().item())
    return gap


def run_e1(cfg: E1Config, seed: int, hmm: HMM | None = None) -> list[dict]:
    """Max normalised-logit gap, linear vs logsumexp filter, in four sub-cases.

    Default HMM: s -> s+1 on cfg.n_states, floored Dirichlet emissions, π0 uniform.
    With a user HMM the same checks run on its T (or per-action P): `lof_linear`
    (or `lof_linear_actions`), `lof_linear_init_corrected`, and `lof_linear_stochastic`
    with T_true = (1-mix) T + mix U.  If the user's T is not a permutation the first two
    gaps are not expected to vanish: they measure how far the linear filter is off.
    """
    rng, gen = _generators(seed, "e1")
    mix = cfg.stochastic_mix
    if hmm is None:
        base = e1_hmm(cfg.n_states, cfg.n_obs, cfg.floor, rng)
        actions = e1_action_permutations(cfg.n_states)  # same E and π0, four permutations
        P, E, pi0 = base.transitions(), base.E, base.pi0
        cases = {"lof_linear": (P, P), "lof_linear_actions": (actions, actions)}
    else:
        P, E, pi0 = hmm.transitions(), hmm.E, hmm.pi0
        cases = {"lof_linear_actions" if hmm.is_controlled else "lof_linear": (P, P)}
    n = E.shape[1]
    l0_arbitrary = 3.0 * torch.randn(cfg.n_seq, n, generator=gen, dtype=DTYPE)

    tags = dict(experiment="e1", metric="max_logit_gap", horizon=cfg.length,
                n_traj=cfg.n_seq, n_states=n, n_obs=E.shape[0])
    rows = []
    with threads_for(cfg.n_seq * n * n):
        for variant, (T_true, P_linear) in cases.items():
            gap = _max_logit_gap(T_true, P_linear, E, pi0, cfg.n_seq, cfg.length, gen)
            rows.append(dict(tags, variant=variant, value=gap))
        gap = _max_logit_gap(P, P, E, pi0, cfg.n_seq, cfg.length, gen, l0_linear=l0_arbitrary)
        rows.append(dict(tags, variant="lof_linear_init_corrected", value=gap))
        T_stochastic = nearly_deterministic(P, mix, noise="uniform")
        gap = _max_logit_gap(T_stochastic, P, E, pi0, cfg.n_seq, cfg.length, gen)
        rows.append(dict(tags, variant="lof_linear_stochastic", value=gap))
    return rows


# ==================================================================================
# E2 / E3: decoding error under nearly deterministic dynamics


def lof_step_matmul(l_prev: torch.Tensor, log_lik: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
    """filters.lof_step for an entrywise-positive T, as one batched matrix product.

    log(T e^l) = m + log(T e^(l-m)) with m = max_j l_j: the logsumexp shift, with the
    weights T inside the sum.  The largest term is T_ij * 1 > 0, so nothing underflows
    to log 0 (hence T > 0, true for T(ε) with ε > 0).  The constant m is dropped:
    logits are defined up to a constant, the argmax ignores it, and the logits stay
    bounded over long horizons.  Avoiding the (n x n)-wide logsumexp makes the step
    2-3x cheaper, which matters for E2's 23 x 20,000 x 1000 steps.
    T: (n_eps, n, n), one matrix per ε shared by its trajectories (one GEMM per ε),
    or (n_eps, n_traj, n, n), one matrix per trajectory.
    """
    shifted = torch.exp(l_prev - l_prev.amax(dim=-1, keepdim=True))
    if T.dim() == 3:
        predicted = torch.bmm(shifted, T.transpose(-1, -2))
    else:
        predicted = transition(T, shifted)
    return log_lik + torch.log(predicted)


class FlowFrameALF:
    """The ALF w_k = (1-δ) P(a_k) w_{k-1} + δ log(E^T y_k) for several δ at once,
    stored in the frame that follows the deterministic flow.

    flow_k[j] is the state reached from j by the permutations applied so far and the
    stored state is v_k[j] = w_k[flow_k[j]].  Since P(a_k) moves the entry at
    flow_{k-1}[j] to flow_k[j], the recursion becomes v_k = (1-δ) v_{k-1} + δ ll_k[flow_k]:
    the permutation is applied to the small index array instead of the large
    (δ, ε, trajectory, state) array, every δ shares one input, and each step is one
    in-place lerp.  Permutations only move entries, so this is the arithmetic of
    filters.alf_step (the tests check it step by step).  Starts at w_0 = 0.
    """

    def __init__(self, delta: torch.Tensor, batch: tuple[int, ...], n: int, shared_flow: bool):
        """delta: (n_delta, ...) broadcasting against `batch` (e.g. (n_delta, n_eps) for
        batch (n_eps, n_traj)); shared_flow: every trajectory sees the same permutations."""
        trailing = len(batch) + 2 - delta.dim()
        self.delta = delta.reshape(delta.shape + (1,) * trailing)
        self.v = torch.zeros(delta.shape[0], *batch, n, dtype=DTYPE)
        self.flow = torch.arange(n) if shared_flow else torch.arange(n).expand(*batch, n)

    def step(self, next_state: torch.Tensor, log_lik: torch.Tensor) -> None:
        """next_state[..., s]: where P(a_k) moves s, shape (n,) if shared else (*batch, n);
        log_lik: (log E)^T y_k, shape (*batch, n)."""
        if self.flow.dim() == 1:
            self.flow = next_state[self.flow]
            evidence = log_lik.index_select(-1, self.flow)
        else:
            self.flow = torch.gather(next_state, -1, self.flow)
            evidence = torch.gather(log_lik, -1, self.flow)
        self.v.lerp_(evidence, self.delta)  # v + δ (evidence - v)

    def state(self) -> torch.Tensor:
        """w_k in the original state order: w[..., flow[j]] = v[..., j]."""
        return torch.empty_like(self.v).scatter_(-1, self.flow.expand(self.v.shape), self.v)

    def decode(self, gen: torch.Generator) -> torch.Tensor:
        """argmax_s w_k[s] with random ties, via the flow: flow[argmax_j v[j]]."""
        best = argmax_random_ties(self.v, gen)
        return torch.gather(self.flow.expand(self.v.shape), -1, best.unsqueeze(-1)).squeeze(-1)


def _decoding_errors(P: torch.Tensor, E: torch.Tensor, pi0: torch.Tensor, eps: torch.Tensor,
                     noise: str, alf_deltas: dict[str, torch.Tensor],
                     wrong_action_delta: torch.Tensor | None, horizon: int, n_traj: int,
                     gen: torch.Generator, progress: Progress | None) -> dict[str, np.ndarray]:
    """Simulate T(a, ε) = (1-ε) P(a) + ε Q for every ε at once and count decoding errors.

    P: (A, n, n) permutations, actions uniform at random when A > 1; Q = I ("stay") or
    U ("uniform").  s_0 ~ π0; each step draws the action, transitions, then emits.
    All filters start at logits 0.  Returns, per filter, the number of trajectories
    (of n_traj, per ε) whose argmax at step `horizon` (ties random) misses the true
    state: "exact" for the Bayes/LOF filter, the names of `alf_deltas` for ALFs with
    the true permutations, and "alf_wrong_action" for an ALF that applies a uniformly drawn
    different action's permutation (with δ = wrong_action_delta).
    """
    n_actions, n = P.shape[0], P.shape[-1]
    n_eps = eps.shape[0]
    batch = (n_eps, n_traj)
    controlled = n_actions > 1
    next_state = P.argmax(dim=-2)  # (A, n): P(a) moves state s to next_state[a, s]
    eps_col = eps[:, None]

    # T(a, ε) for the Bayes filter: (n_eps, A, n, n), entrywise positive for ε > 0.
    T = torch.stack([nearly_deterministic(P, float(e), noise) for e in eps])
    log_E = _safe_log(E)
    emission_cdf = _column_cdfs(E)

    s = _sample(_column_cdfs(pi0[:, None])[0].expand(*batch, n), gen)
    l_exact = torch.zeros(*batch, n, dtype=DTYPE)
    alf_names = list(alf_deltas)
    alf = FlowFrameALF(torch.stack([alf_deltas[name] for name in alf_names]), batch, n,
                       shared_flow=not controlled)
    if wrong_action_delta is not None:
        alf_wrong = FlowFrameALF(wrong_action_delta[None], batch, n, shared_flow=False)

    for k in range(1, horizon + 1):
        # --- the true state and its observation
        if controlled:
            a = torch.randint(n_actions, batch, generator=gen)
            follow_P = next_state[a, s]
        else:
            follow_P = torch.take(next_state[0], s)
        # T(a, ε) = (1-ε) P(a) + ε Q as a mixture: with probability ε, Q moves the state.
        jumped = s if noise == "stay" else torch.randint(n, batch, generator=gen)
        s = torch.where(torch.rand(batch, generator=gen, dtype=DTYPE) < eps_col, jumped, follow_P)
        log_lik = _rows(log_E, _sample(_rows(emission_cdf, s), gen))  # (log E)^T y_k

        # --- the filters
        T_k = T[torch.arange(n_eps)[:, None], a] if controlled else T[:, 0]
        l_exact = lof_step_matmul(l_exact, log_lik, T_k)
        alf.step(next_state[a] if controlled else next_state[0], log_lik)
        if wrong_action_delta is not None:
            other = (a + torch.randint(1, n_actions, batch, generator=gen)) % n_actions
            alf_wrong.step(next_state[other], log_lik)
        _progress(progress, k, horizon)

    def n_errors(decoded: torch.Tensor) -> np.ndarray:
        return (decoded != s).sum(dim=-1).numpy()

    errors = {"exact": n_errors(argmax_random_ties(l_exact, gen))}
    decoded = alf.decode(gen)
    for i, name in enumerate(alf_names):
        errors[name] = n_errors(decoded[i])
    if wrong_action_delta is not None:
        errors["alf_wrong_action"] = n_errors(alf_wrong.decode(gen)[0])
    return errors


def _decoding_rows(experiment: str, variant: str, errors: np.ndarray, eps: np.ndarray,
                   n_traj: int, delta: np.ndarray | None, tags: dict) -> list[dict]:
    rate = errors / n_traj
    low, high = wilson_interval(errors, n_traj)
    rows = []
    for i, e in enumerate(eps):
        row_tags = dict(tags, experiment=experiment, variant=variant, inv_eps=float(1 / e),
                        eps=float(e), n_traj=n_traj)
        if delta is not None:
            row_tags["delta"] = float(delta[i])
        for metric, value in (("decode_error", rate[i]), ("decode_error_ci_low", low[i]),
                              ("decode_error_ci_high", high[i]),
                              ("error_over_eps_log", rate[i] / (e * math.log(1 / e)))):
            rows.append(dict(row_tags, metric=metric, value=float(value)))
    return rows


def _schedule_rows(experiment: str, exact_variant: str, errors: dict, deltas: dict,
                   eps: torch.Tensor, cfg, base: HMM) -> list[dict]:
    """Rows of the exact filter (errors["exact"]) and of every δ schedule (errors[name])."""
    eps_np = eps.numpy()
    tags = dict(horizon=cfg.horizon, n_states=base.n_states, n_obs=base.n_obs)
    rows = _decoding_rows(experiment, exact_variant, errors["exact"], eps_np, cfg.n_traj, None, tags)
    for name, delta in deltas.items():
        rows += _decoding_rows(experiment, name, errors[name], eps_np, cfg.n_traj, delta.numpy(), tags)
    return rows


def _delta_schedules(eps: torch.Tensor, lam: float) -> dict[str, torch.Tensor]:
    """The valid (δ -> 0 with ε/δ -> 0) and the too-slow ε² schedules of the ALF."""
    return {"alf_sqrt_eps": eps.sqrt(), "alf_lambda_log": lam / torch.log(1 / eps),
            "alf_eps_sq": eps ** 2}


def _check_inv_eps(grid: list[float]) -> torch.Tensor:
    inv_eps = torch.tensor([float(x) for x in grid], dtype=DTYPE)
    if inv_eps.numel() == 0 or (inv_eps <= 1).any():
        raise ValueError(f"inv_eps_grid must be a non-empty list of values > 1 (ε = 1/x < 1), "
                         f"got {list(grid)}")
    return 1 / inv_eps


def run_e2(cfg: E2Config, seed: int, hmm: HMM | None = None,
           progress: Progress | None = None) -> list[dict]:
    """The paper's §6.1 protocol: decoding error at step `horizon` against 1/ε.

    Default: T(ε) = [[ε, 1-ε], [1-ε, ε]] = (1-ε) swap + ε I, E = [[.9,.1],[.1,.9]],
    s_0 = 0.  A user HMM must be uncontrolled with a permutation T = P; it runs with
    T(ε) = (1-ε) P + ε U and its own E and π0.  Also emits ξ (metric `xi`).
    """
    _, gen = _generators(seed, "e2")
    eps = _check_inv_eps(cfg.inv_eps_grid)
    if hmm is None:
        base, noise = two_state_hmm(0.0), "stay"  # ε = 0 leaves the permutation P
    else:
        if hmm.is_controlled or not hmm.is_deterministic():
            raise ValueError("E2 needs an uncontrolled HMM whose T is a permutation matrix "
                             "(it runs T(ε) = (1-ε) T + ε U); this hmm file has "
                             + ("per-action P: E3 uses it" if hmm.is_controlled
                                else "a stochastic T: only E1 applies"))
        base, noise = hmm, "uniform"
    P = base.transitions()

    deltas = _delta_schedules(eps, cfg.lambda_)
    deltas["alf_zero"] = torch.zeros_like(eps)
    deltas["alf_one"] = torch.ones_like(eps)
    with threads_for(len(deltas) * len(eps) * cfg.n_traj * base.n_states):
        errors = _decoding_errors(P, base.E, base.pi0, eps, noise, deltas, None,
                                  cfg.horizon, cfg.n_traj, gen, progress)

    rows = _schedule_rows("e2", "lof", errors, deltas, eps, cfg, base)
    rows.append(dict(experiment="e2", variant="alf_lambda_log", metric="xi",
                     value=separation_exponent(P[0], base.E),
                     n_states=base.n_states, n_obs=base.n_obs))
    return rows


def run_e3(cfg: E3Config, seed: int, hmm: HMM | None = None,
           progress: Progress | None = None) -> list[dict]:
    """Action-controlled decoding: T(a, ε) = (1-ε) P(a) + ε U with uniformly random actions.

    Default: E1's four permutations (+1, -1, +2, pair-swap) on cfg.n_states states,
    E columns floor + scale * Dir(alpha), π0 uniform.  A user HMM must give per-action
    permutations P (at least two, for the wrong-action control).
    """
    rng, gen = _generators(seed, "e3")
    eps = _check_inv_eps(cfg.inv_eps_grid)
    if hmm is None:
        base = e3_hmm(cfg.n_states, cfg.n_obs, cfg.floor, cfg.scale, cfg.alpha, rng)
    else:
        if not hmm.is_controlled or hmm.n_actions < 2 or not hmm.is_deterministic():
            raise ValueError("E3 needs an action-controlled HMM: P must be a list of at "
                             "least two permutation matrices (it runs T(a, ε) = (1-ε) P(a) "
                             "+ ε U); an uncontrolled permutation T runs in E2")
        base = hmm
    lam = cfg.lambda_
    deltas = _delta_schedules(eps, lam)
    wrong_delta = lam / torch.log(1 / eps)
    n = base.n_states  # largest arrays: the per-trajectory T(a_k, ε), (n_eps, n_traj, n, n)
    with threads_for(len(eps) * cfg.n_traj * n * max(n, len(deltas))):
        errors = _decoding_errors(base.T, base.E, base.pi0, eps, "uniform", deltas, wrong_delta,
                                  cfg.horizon, cfg.n_traj, gen, progress)

    return _schedule_rows("e3", "bayes", errors, {**deltas, "alf_wrong_action": wrong_delta}, eps, cfg, base)


def experiments_for(hmm: HMM | None) -> list[str]:
    """Which of E1-E3 apply: all for the built-in HMMs; for a user HMM, E1 always,
    E2 for an uncontrolled permutation T, E3 for two or more per-action permutations."""
    if hmm is None:
        return ["e1", "e2", "e3"]
    applicable = ["e1"]
    if hmm.is_deterministic():
        if not hmm.is_controlled:
            applicable.append("e2")
        elif hmm.n_actions >= 2:
            applicable.append("e3")
    return applicable


# ==================================================================================
# Separation exponent ξ (Thm 5.7)


def separation_exponent(P, E) -> float:
    """ξ = min over ordered pairs i != j of (1/M) Σ_{n ∈ Γ_ij} ∫_{-1/M}^0 Λ_n(t) / t dt.

    M is the period of the permutation P (P^M = I).  At phase n the two hypotheses sit
    in states P^n i and P^n j with emission laws p = E[:, P^n i], q = E[:, P^n j];
    Λ_n(t) = log E_p[(p/q)^t] = log Σ_y p^(1+t) q^(-t), and Γ_ij is the set of phases
    where p != q (the others add nothing).  Λ_n is convex with Λ_n(0) = Λ_n(-1) = 0, so
    Λ_n(t)/t >= 0 on (-1/M, 0) and ξ >= 0; this is the spec's
    -(1/M) Σ ∫_0^{-1/M} Λ_n(t)/t dt with the integration limits swapped.
    δ = λ / log(1/ε) is in the theorem's regime for λ in (0, ξ).
    """
    P = torch.as_tensor(P, dtype=DTYPE)
    E = torch.as_tensor(E, dtype=DTYPE).numpy()
    if P.dim() != 2 or not is_permutation(P):
        raise ValueError("separation_exponent needs a single permutation matrix P")
    n = P.shape[0]
    M = permutation_period(P)
    next_state = P.argmax(dim=0).numpy()

    # The integral depends only on the pair of emission columns: compute it per state pair.
    pair_integral = np.zeros((n, n))
    for a in range(n):
        for b in range(n):
            if a != b and not np.array_equal(E[:, a], E[:, b]):
                pair_integral[a, b] = _chernoff_integral(E[:, a], E[:, b], 1.0 / M)

    # orbit[n_phase, s] = P^n_phase applied to s
    orbit = np.empty((M, n), dtype=int)
    orbit[0] = np.arange(n)
    for phase in range(1, M):
        orbit[phase] = next_state[orbit[phase - 1]]
    xi = math.inf
    for i in range(n):
        for j in range(n):
            if i != j:
                xi = min(xi, pair_integral[orbit[:, i], orbit[:, j]].sum() / M)
    return float(xi)


def _chernoff_integral(p: np.ndarray, q: np.ndarray, width: float) -> float:
    """∫_{-width}^0 Λ(t)/t dt with Λ(t) = log Σ_y p^(1+t) q^(-t) (0 terms where p = 0)."""
    if np.any((p > 0) & (q == 0)):
        return math.inf  # an observation rules q out: Λ(0-) < 0 and the integral diverges
    support = p > 0
    log_p, log_q = np.log(p[support]), np.log(q[support])

    def integrand(t: float) -> float:
        z = (1 + t) * log_p - t * log_q
        top = z.max()
        return (top + math.log(np.exp(z - top).sum())) / t

    value, _ = quad(integrand, -width, 0.0, epsabs=1e-13, epsrel=1e-11, limit=200)
    return value
