"""RingWorld-lite (experiment E4): a noisy-beacon ring, vectorised over environments.

The world is 12 positions on a ring, labelled 1..12 at angles θ_s = 2π(s−1)/12.  In
code a position is always its *index* s−1 ∈ {0..11}; `label_to_index` is the only place
where labels meet indices.

Dynamics, in the paper's conventions (see filters.py):
- Actions CW1, CW2, CCW1, CCW2 move the agent by +1, +2, −1, −2 (mod 12); the nominal
  move is the permutation P(a), P(a)[i, j] = 1 iff i = j + shift(a) mod 12.
- With probability ε the move slips.  `slip="stay"`: the agent stays put, so
  T(a) = (1−ε)P(a) + εI.  `slip="uniform"`: it lands on a uniformly random position,
  so T(a) = (1−ε)P(a) + εU with U = 𝟙𝟙ᵀ/12.  T(a) is column-stochastic.
- Four beacons at angles β_j = jπ/2, j = 0..3; the observation is the index of one
  beacon, P(o = j | s) ∝ exp(κ cos(θ_s − β_j)).  E[j, i] = P(o = j | s = i) is
  column-stochastic.
- Goal labels {2, 3} pay +1, trap labels {6, 11, 12} pay −1; both end the episode.
  Episodes start uniformly over the seven non-terminal positions and are cut after
  `episode_len` actions (reward 0 at the cut).

Order of events (the filters depend on it): at reset the position s_0 is drawn and a
first observation o_0 ~ E[:, s_0] is emitted, so the agent sees a beacon before its
first action.  Each `step(a_k)` then *transitions first* (s_{k+1} ~ T(a_k)[:, s_k]),
pays the reward of the new position, and *then emits* o_{k+1} ~ E[:, s_{k+1}].

A fifth pseudo-action NO_ACTION (shift 0, T = P = I) is the "previous action" fed to the
agents at reset.  With it every filter runs one uniform update per observation:
the LOF gives l_0 = log π_0 + log E[o_0, :], the ALF gives w_0 = δ log E[o_0, :].
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import EnvConfig
from .hmm import cyclic_shift

ACTION_NAMES = ("CW1", "CW2", "CCW1", "CCW2")
ACTION_SHIFTS = (+1, +2, -1, -2)
N_ACTIONS = len(ACTION_NAMES)
NO_ACTION = N_ACTIONS  # pseudo-action at reset: identity transition
N_BEACONS = 4
GOAL_LABELS = (2, 3)
TRAP_LABELS = (6, 11, 12)


def label_to_index(label: int) -> int:
    """Positions are labelled 1..n in the paper and indexed 0..n−1 in code."""
    return label - 1


@dataclass
class RingWorldModel:
    """The exact model of the environment, as the filter features use it.

    All matrices are float64 and indexed by position index (0..n−1).  The action axis
    has N_ACTIONS + 1 entries: the four moves, then NO_ACTION (identity).
    """

    n_positions: int
    eps: float
    kappa: float
    slip: str
    shifts: torch.Tensor  # (A+1,) long: position shift of each action, 0 for NO_ACTION
    P: torch.Tensor  # (A+1, n, n) nominal permutations (identity for NO_ACTION)
    T: torch.Tensor  # (A+1, n, n) column-stochastic transitions with slip (I for NO_ACTION)
    E: torch.Tensor  # (m, n) column-stochastic emissions
    pi0: torch.Tensor  # (n,) start distribution: uniform over non-terminal positions
    reward: torch.Tensor  # (n,) reward for entering each position
    goal: torch.Tensor  # (n,) bool
    trap: torch.Tensor  # (n,) bool

    @property
    def n_obs(self) -> int:
        return self.E.shape[0]

    @property
    def terminal(self) -> torch.Tensor:
        return self.goal | self.trap

    @property
    def log_T(self) -> torch.Tensor:
        return torch.log(self.T)  # exact zeros become −inf, which logsumexp handles

    @property
    def log_E(self) -> torch.Tensor:
        return torch.log(self.E)

    @property
    def log_pi0(self) -> torch.Tensor:
        return torch.log(self.pi0)

    def to(self, device: str | torch.device) -> "RingWorldModel":
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()}
        return RingWorldModel(**moved)


def build_model(env: EnvConfig) -> RingWorldModel:
    n = env.n_positions
    if n < 12:
        # the goal and trap labels go up to 12
        raise ValueError(f"RingWorld-lite needs at least 12 positions, got {n}")
    if env.slip not in ("stay", "uniform"):
        raise ValueError(f"env.slip must be 'stay' or 'uniform', got {env.slip!r}")
    if not 0.0 <= env.eps < 1.0:
        raise ValueError(f"env.eps must be in [0, 1), got {env.eps}")

    shifts = torch.tensor(list(ACTION_SHIFTS) + [0], dtype=torch.long)
    P = torch.stack([cyclic_shift(n, int(s)) for s in shifts])  # P[i, j] = 1 iff i = j + shift
    slip_target = torch.eye(n, dtype=torch.float64) if env.slip == "stay" \
        else torch.full((n, n), 1.0 / n, dtype=torch.float64)
    T = (1.0 - env.eps) * P + env.eps * slip_target
    T[NO_ACTION] = torch.eye(n, dtype=torch.float64)

    theta = 2.0 * math.pi * torch.arange(n, dtype=torch.float64) / n  # index i = label i+1
    beta = (math.pi / 2.0) * torch.arange(N_BEACONS, dtype=torch.float64)
    affinity = torch.exp(env.kappa * torch.cos(theta[None, :] - beta[:, None]))  # (m, n)
    E = affinity / affinity.sum(dim=0, keepdim=True)

    goal = torch.zeros(n, dtype=torch.bool)
    goal[[label_to_index(s) for s in GOAL_LABELS]] = True
    trap = torch.zeros(n, dtype=torch.bool)
    trap[[label_to_index(s) for s in TRAP_LABELS]] = True
    reward = goal.double() - trap.double()
    pi0 = (~(goal | trap)).double()
    pi0 = pi0 / pi0.sum()
    return RingWorldModel(n_positions=n, eps=env.eps, kappa=env.kappa, slip=env.slip,
                          shifts=shifts, P=P, T=T, E=E, pi0=pi0, reward=reward,
                          goal=goal, trap=trap)


class RingWorld:
    """`n_envs` independent copies of RingWorld-lite, stepped together.

    Every random draw comes from the `generator` passed in, and every call draws the
    same number of numbers whatever the masks say, so a run is a pure function of the
    generator's state.
    """

    def __init__(self, model: RingWorldModel, n_envs: int, episode_len: int,
                 generator: torch.Generator):
        self.model = model
        self.n_envs = n_envs
        self.episode_len = episode_len
        self.generator = generator
        device = model.E.device
        self.device = device
        # the support of pi0 (the non-terminal positions), from the labels rather than from pi0's values: no
        # device-to-host read on a GPU, and it builds on the meta device of `icml belief-filter plan`
        terminal = {label_to_index(s) for s in GOAL_LABELS + TRAP_LABELS}
        self._start_positions = torch.tensor([i for i in range(model.n_positions) if i not in terminal],
                                             dtype=torch.long, device=device)
        self._emission_cdf = model.E.T.cumsum(dim=-1)  # (n, m): row i is the CDF of o given s=i
        self.position = torch.zeros(n_envs, dtype=torch.long, device=device)
        self.t = torch.zeros(n_envs, dtype=torch.long, device=device)  # actions taken this episode

    def _uniform(self) -> torch.Tensor:
        return torch.rand(self.n_envs, generator=self.generator, dtype=torch.float64,
                          device=self.device)

    def emit(self, position: torch.Tensor) -> torch.Tensor:
        """o ~ E[:, position] by inverting the CDF: o = #{j < m−1 : u > CDF_j}."""
        u = self._uniform()
        return (u[:, None] > self._emission_cdf[position, :-1]).sum(dim=-1)

    def reset(self, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Start new episodes where `mask` (all envs if None); return every env's
        observation, freshly emitted for the reset envs and meaningless elsewhere."""
        pick = torch.randint(len(self._start_positions), (self.n_envs,),
                             generator=self.generator, device=self.device)
        start = self._start_positions[pick]
        if mask is None:
            mask = torch.ones(self.n_envs, dtype=torch.bool, device=self.device)
        self.position = torch.where(mask, start, self.position)
        self.t = torch.where(mask, torch.zeros_like(self.t), self.t)
        return self.emit(self.position)

    def step(self, action: torch.Tensor):
        """Transition, then emit.  Returns (obs, reward, done, terminal) for all envs;
        `terminal` marks goal/trap arrivals, `done` adds the episode-length cut."""
        n = self.model.n_positions
        moved = (self.position + self.model.shifts[action]) % n
        slipped = self._uniform() < self.model.eps
        random_position = torch.randint(n, (self.n_envs,), generator=self.generator,
                                         device=self.device)
        slip_position = self.position if self.model.slip == "stay" else random_position
        self.position = torch.where(slipped, slip_position, moved)
        self.t = self.t + 1
        reward = self.model.reward[self.position]
        terminal = self.model.terminal[self.position]
        done = terminal | (self.t >= self.episode_len)
        obs = self.emit(self.position)
        return obs, reward, done, terminal
