"""Hidden Markov models for experiments E1-E3: construction and loading.

Conventions (the paper's, shared with filters.py): every matrix is column-stochastic.
T[i, j] = P(s_k = i | s_{k-1} = j) and E[y, i] = P(y | s = i).  An action-controlled
HMM stacks one transition matrix per action, T[a] of shape (n, n).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

DTYPE = torch.float64
STOCHASTIC_TOL = 1e-6  # tolerance on column sums of user-supplied matrices


@dataclass
class HMM:
    """T: (n, n), or (A, n, n) for one matrix per action; E: (m, n); pi0: (n,)."""

    T: torch.Tensor
    E: torch.Tensor
    pi0: torch.Tensor

    @property
    def n_states(self) -> int:
        return self.E.shape[1]

    @property
    def n_obs(self) -> int:
        return self.E.shape[0]

    @property
    def is_controlled(self) -> bool:
        return self.T.dim() == 3

    @property
    def n_actions(self) -> int:
        """Number of actions; 1 for an uncontrolled HMM."""
        return self.T.shape[0] if self.is_controlled else 1

    def transitions(self) -> torch.Tensor:
        """The transition matrices as a stack (A, n, n), A = 1 when uncontrolled."""
        return self.T if self.is_controlled else self.T.unsqueeze(0)

    def is_deterministic(self) -> bool:
        """True when every transition matrix is a permutation."""
        return all(is_permutation(T) for T in self.transitions())


# ----------------------------------------------------------------------------------
# Permutations (column-stochastic 0/1 matrices)


def permutation_matrix(next_state: list[int] | torch.Tensor) -> torch.Tensor:
    """The matrix P with P[next_state[s], s] = 1, i.e. P moves state s to next_state[s]."""
    next_state = torch.as_tensor(next_state, dtype=torch.long)
    n = len(next_state)
    P = torch.zeros(n, n, dtype=DTYPE)
    P[next_state, torch.arange(n)] = 1.0
    return P


def cyclic_shift(n: int, k: int = 1) -> torch.Tensor:
    """s -> s + k (mod n).  Non-symmetric for n > 2 and k != n/2, so P and P^T
    differ and a transposed-convention bug shows up (a symmetric swap would hide it)."""
    return permutation_matrix([(s + k) % n for s in range(n)])


def pair_swap(n: int) -> torch.Tensor:
    """Swap states (0, 1), (2, 3), ...; with n odd the last state stays put.  Symmetric."""
    nxt = [s + 1 if s % 2 == 0 else s - 1 for s in range(n)]
    if n % 2 == 1:
        nxt[-1] = n - 1
    return permutation_matrix(nxt)


def e1_action_permutations(n: int) -> torch.Tensor:
    """The four action permutations of E1/E3: +1, -1, +2 (cyclic) and pair-swap -> (4, n, n)."""
    return torch.stack([cyclic_shift(n, 1), cyclic_shift(n, -1), cyclic_shift(n, 2), pair_swap(n)])


def is_permutation(T: torch.Tensor) -> bool:
    T = torch.as_tensor(T)
    return bool(((T == 0) | (T == 1)).all() and (T.sum(0) == 1).all() and (T.sum(1) == 1).all())


def permutation_sources(P: torch.Tensor) -> torch.Tensor:
    """Index src with (P x)_i = x[src[i]]: for each row i the column holding its 1."""
    return P.argmax(dim=-1)


def permutation_period(P: torch.Tensor) -> int:
    """Smallest M >= 1 with P^M = I: the lcm of the cycle lengths."""
    nxt = P.argmax(dim=0).tolist()  # column j holds its 1 at row nxt[j]
    seen, period = set(), 1
    for start in range(len(nxt)):
        if start in seen:
            continue
        length, s = 0, start
        while s not in seen:
            seen.add(s)
            s = nxt[s]
            length += 1
        period = math.lcm(period, length)
    return period


def nearly_deterministic(P: torch.Tensor, eps: float, noise: str = "uniform") -> torch.Tensor:
    """T(ε) = (1-ε) P + ε Q with Q = U (uniform, all entries 1/n) or Q = I ("stay").

    The paper's §6.1 matrix [[ε, 1-ε], [1-ε, ε]] is (1-ε) swap + ε I, the "stay" case.
    """
    n = P.shape[-1]
    if noise == "uniform":
        Q = torch.full((n, n), 1.0 / n, dtype=DTYPE)
    elif noise == "stay":
        Q = torch.eye(n, dtype=DTYPE)
    else:
        raise ValueError(f"noise must be 'uniform' or 'stay', got {noise!r}")
    return (1.0 - eps) * P + eps * Q


# ----------------------------------------------------------------------------------
# Emissions


def floored_dirichlet_emissions(n_obs: int, n_states: int, floor: float, scale: float,
                                alpha: float, rng: np.random.Generator) -> torch.Tensor:
    """E columns = floor + scale * Dirichlet(alpha * 1), one independent draw per state.

    E1 uses scale = 1 - floor*m, which sums to one exactly.  E3's constants
    (0.01 + 0.88 * Dir, m = 12) also sum to one, but only for m = 12; for any other
    `e3.n_obs` the columns are renormalised so that E stays column-stochastic.
    """
    if floor < 0 or scale <= 0 or floor * n_obs >= 1:
        raise ValueError(f"emission floor {floor} with {n_obs} observations leaves no mass "
                         f"for the Dirichlet part (need 0 <= floor * n_obs < 1, scale > 0)")
    draws = rng.dirichlet(alpha * np.ones(n_obs), size=n_states).T  # (m, n), columns sum to 1
    E = torch.as_tensor(floor + scale * draws, dtype=DTYPE)
    return E / E.sum(dim=0, keepdim=True)


# ----------------------------------------------------------------------------------
# The experiments' default HMMs


def two_state_hmm(eps: float) -> HMM:
    """The paper's §6.1 example: T = [[ε, 1-ε], [1-ε, ε]], E = [[.9, .1], [.1, .9]], π0 = [1, 0]."""
    return HMM(T=nearly_deterministic(cyclic_shift(2), eps, noise="stay"),
               E=torch.tensor([[0.9, 0.1], [0.1, 0.9]], dtype=DTYPE),
               pi0=torch.tensor([1.0, 0.0], dtype=DTYPE))


def e1_hmm(n_states: int, n_obs: int, floor: float, rng: np.random.Generator,
           controlled: bool = False) -> HMM:
    """E1: P = s -> s+1 (or the four action permutations), E = floor + (1 - floor*m) Dir(1), π0 uniform."""
    T = e1_action_permutations(n_states) if controlled else cyclic_shift(n_states)
    E = floored_dirichlet_emissions(n_obs, n_states, floor, 1.0 - floor * n_obs, 1.0, rng)
    return HMM(T=T, E=E, pi0=torch.full((n_states,), 1.0 / n_states, dtype=DTYPE))


def e3_hmm(n_states: int, n_obs: int, floor: float, scale: float, alpha: float,
           rng: np.random.Generator) -> HMM:
    """E3: the four E1 permutations (the ε-free part P(a)), peaked emissions, π0 uniform."""
    E = floored_dirichlet_emissions(n_obs, n_states, floor, scale, alpha, rng)
    return HMM(T=e1_action_permutations(n_states), E=E,
               pi0=torch.full((n_states,), 1.0 / n_states, dtype=DTYPE))


# ----------------------------------------------------------------------------------
# User HMM files


def load_hmm_json(path: str | Path) -> HMM:
    """Read a user HMM: {"T": n x n} or {"P": [n x n, ...] one per action}, "E": m x n, "pi0": n.

    A P list with a single matrix is treated as the uncontrolled T.

    Every problem raises ValueError with one line that names it and says how to fix it.
    Column sums are checked to 1e-6 and then renormalised to machine precision, so the
    filters work with exact probability vectors.
    """
    where = f"hmm file {path}"
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ValueError(f"{where}: cannot read it ({err.strerror or err}); "
                         f"give the path of a JSON file with T (or P), E and pi0") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON (line {err.lineno}, column {err.colno}: "
                         f"{err.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object with keys T (or P), E and pi0")

    if ("T" in data) == ("P" in data):
        raise ValueError(f"{where}: give exactly one of T (one n x n matrix) or "
                         f"P (a list of n x n matrices, one per action)")
    for key in ("E", "pi0"):
        if key not in data:
            raise ValueError(f"{where}: missing key {key!r} (E: m x n emission matrix, "
                             f"pi0: initial distribution of length n)")

    E = _as_array(data["E"], "E", where, ndim=2)
    n_obs, n = E.shape
    _check_stochastic(E, "E", where, "E[y][i] = P(y | s=i), columns must sum to 1")
    pi0 = _as_array(data["pi0"], "pi0", where, ndim=1)
    if pi0.shape != (n,):
        raise ValueError(f"{where}: pi0 has length {pi0.shape[0]}, expected {n} "
                         f"(one entry per state, the number of columns of E)")
    _check_stochastic(pi0[:, None], "pi0", where, "pi0 is the initial state distribution")

    if "T" in data:
        T = _as_array(data["T"], "T", where, ndim=2)
        _check_square(T, "T", n, where)
        _check_stochastic(T, "T", where, "T[i][j] = P(s_k=i | s_{k-1}=j), columns must sum to 1")
    else:
        if not isinstance(data["P"], list) or not data["P"]:
            raise ValueError(f"{where}: P must be a non-empty list of n x n matrices, one per action")
        mats = []
        for a, raw in enumerate(data["P"]):
            name = f"P[{a}]"
            M = _as_array(raw, name, where, ndim=2)
            _check_square(M, name, n, where)
            _check_stochastic(M, name, where, f"{name}[i][j] = P(s_k=i | s_{{k-1}}=j, a_k={a}), "
                                              f"columns must sum to 1")
            mats.append(M)
        # One action is no control at all: store it as the uncontrolled T.
        T = mats[0] if len(mats) == 1 else np.stack(mats)

    def exact(x: np.ndarray) -> torch.Tensor:
        x = torch.as_tensor(x, dtype=DTYPE)
        return x / x.sum(dim=-2, keepdim=True)

    return HMM(T=exact(T), E=exact(E), pi0=exact(pi0[:, None])[:, 0])


def _as_array(raw, name: str, where: str, ndim: int) -> np.ndarray:
    shape = "a list of numbers" if ndim == 1 else "a list of rows (lists of numbers)"
    try:
        x = np.array(raw, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {name} must be {shape} of equal length") from None
    if x.ndim != ndim or x.size == 0:
        raise ValueError(f"{where}: {name} must be {shape}, got an array of shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError(f"{where}: {name} contains NaN or infinite entries; use probabilities in [0, 1]")
    if (x < 0).any():
        idx = tuple(int(i) for i in np.argwhere(x < 0)[0])
        raise ValueError(f"{where}: {name}{list(idx)} = {x[idx]:g} is negative; "
                         f"probabilities must be >= 0")
    return x


def _check_square(M: np.ndarray, name: str, n: int, where: str) -> None:
    if M.shape != (n, n):
        raise ValueError(f"{where}: {name} has shape {M.shape[0]} x {M.shape[1]}, expected "
                         f"{n} x {n} (n = number of states = columns of E)")


def _check_stochastic(M: np.ndarray, name: str, where: str, rule: str) -> None:
    """Every column of M must sum to 1 (within STOCHASTIC_TOL); `rule` explains why."""
    sums = M.sum(axis=0)
    bad = np.flatnonzero(np.abs(sums - 1.0) > STOCHASTIC_TOL)
    if bad.size:
        j = int(bad[0])
        what = name if M.shape[1] == 1 else f"column {j} of {name}"
        raise ValueError(f"{where}: {what} sums to {sums[j]:.6g}, expected 1 ({rule})")
