"""The seven E4 arms: a recurrent feature module under linear-softmax policy/value heads.

Every feature module has the same interface:
- `initial_state(batch)` — the memory before the first observation of an episode;
- `step(state, obs, prev_action) -> (new_state, features)` — one observation, with the
  action that led to it (NO_ACTION at reset, see ringworld.py);
- `sequence(obs, prev_action) -> features` — whole episodes (T, N) from the initial
  state, used to replay the memory through BPTT in PPO.  It agrees with iterating
  `step`; the linear memories compute it in closed form instead of a Python loop.

Filter arms (`lof_belief`, `lof_logits`, `alf`) are fixed functions of the history
built from the environment's true model; they have no parameters, so PPO can store
their features at rollout time.  `obs_only` is the memoryless baseline.  `deep_alf`,
`diag_lrnn` and `gru` are learned memories trained end to end.

Everything runs in float64: the networks are tiny, so the cost is Python overhead
either way, and float64 lets the tests pin the filter identities to ~1e-12.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from .config import BeliefFilterConfig
from .filters import alf_step, lof_step, normalise_logits
from .ringworld import N_ACTIONS, RingWorldModel

DTYPE = torch.float64
LOGIT_FLOOR = -20.0  # `lof_logits` clip: log-beliefs below e^-20 carry no usable information
FILTER_ARMS = ("lof_belief", "lof_logits", "alf", "deep_alf")  # features indexed by position
LEARNED_MEMORIES = ("deep_alf", "diag_lrnn", "gru")


def alf_delta(eps: float, alf_lambda: float) -> float:
    """δ = λ / log(1/ε), the schedule of the ALF guarantee."""
    if not 0.0 < eps < 1.0:
        raise ValueError(f"the ALF needs 0 < eps < 1 to set δ = λ/log(1/ε), got eps={eps}")
    return alf_lambda / math.log(1.0 / eps)


def memory_inputs(obs: torch.Tensor, prev_action: torch.Tensor, n_obs: int) -> torch.Tensor:
    """[one-hot obs, one-hot previous action]; NO_ACTION (reset) is the all-zero action part. Rows of identity
    matrices rather than F.one_hot: made in DTYPE at once, and the same kernels on every device (one_hot's meta
    kernel is not CPU's and CUDA's, so `icml belief-filter plan` would size other temporaries)."""
    obs_part = torch.eye(n_obs, dtype=DTYPE, device=obs.device)[obs]
    action_part = torch.eye(N_ACTIONS + 1, N_ACTIONS, dtype=DTYPE, device=obs.device)[prev_action]  # last row 0
    return torch.cat([obs_part, action_part], dim=-1)


class FeatureModule(nn.Module):
    feature_dim: int
    learned: bool = False  # does the PPO gradient flow into this module?

    def initial_state(self, batch: int) -> torch.Tensor:
        raise NotImplementedError

    def step(self, state: torch.Tensor, obs: torch.Tensor, prev_action: torch.Tensor):
        raise NotImplementedError

    def sequence(self, obs: torch.Tensor, prev_action: torch.Tensor) -> torch.Tensor:
        """Reference implementation: iterate `step` over the time axis (dim 0)."""
        state = self.initial_state(obs.shape[1])
        features = []
        for k in range(obs.shape[0]):
            state, feat = self.step(state, obs[k], prev_action[k])
            features.append(feat)
        return torch.stack(features)


class ObsOnly(FeatureModule):
    """No memory: the current beacon, one-hot."""

    def __init__(self, model: RingWorldModel):
        super().__init__()
        self.n_obs = model.n_obs
        self.feature_dim = model.n_obs
        self.register_buffer("_device_anchor", torch.zeros(0, dtype=DTYPE), persistent=False)

    def initial_state(self, batch: int) -> torch.Tensor:
        return torch.zeros(batch, 0, dtype=DTYPE, device=self._device_anchor.device)

    def step(self, state, obs, prev_action):
        return state, F.one_hot(obs, self.n_obs).to(DTYPE)


class LogitFilter(FeatureModule):
    """Exact Bayes filter of RingWorld-lite in logit space (LOF with actions).

    The slip makes T(a) = (1−ε)P(a) + εI a non-permutation, so the linear LOF
    l_k = P(a_k) l_{k−1} + (log E)ᵀy_k would *not* be exact here; this arm runs the
    logsumexp form l_k = log E[o_k] + log(T(a_k) exp(l_{k−1})) with the true T(a_k),
    i.e. the exact belief the linear filters approximate.  It starts from log π_0
    (−inf on goal/trap positions).  The state is renormalised every step, which only
    removes the additive constant.  It filters the ring HMM and does not condition on
    "the episode has not ended yet"; that information is a function of the features.

    `output="belief"`: softmax(l) (the `lof_belief` arm);
    `output="logits"`: l − logsumexp(l) clipped below at −20 (the `lof_logits` arm).
    """

    def __init__(self, model: RingWorldModel, output: str):
        super().__init__()
        if output not in ("belief", "logits"):
            raise ValueError(output)
        self.output = output
        self.feature_dim = model.n_positions
        self.register_buffer("log_T", model.log_T.to(DTYPE))
        self.register_buffer("log_E", model.log_E.to(DTYPE))
        self.register_buffer("log_pi0", model.log_pi0.to(DTYPE))

    def initial_state(self, batch: int) -> torch.Tensor:
        return self.log_pi0.expand(batch, -1).clone()

    def step(self, state, obs, prev_action):
        logits = normalise_logits(lof_step(state, self.log_E[obs], self.log_T[prev_action]))
        if self.output == "belief":
            return logits, logits.exp()
        return logits, logits.clamp(min=LOGIT_FLOOR)


class ApproximateLinearFilter(FeatureModule):
    """ALF with actions: w_k = (1−δ) P(a_k) w_{k−1} + δ log E[o_k], from w = 0.

    P(a_k) is the nominal permutation of the action taken (slip ignored), and
    δ = alf_lambda / log(1/ε) with the environment's ε.
    """

    def __init__(self, model: RingWorldModel, delta: float):
        super().__init__()
        self.delta = delta
        self.feature_dim = model.n_positions
        self.register_buffer("P", model.P.to(DTYPE))
        self.register_buffer("log_E", model.log_E.to(DTYPE))

    def initial_state(self, batch: int) -> torch.Tensor:
        return torch.zeros(batch, self.feature_dim, dtype=DTYPE, device=self.P.device)

    def step(self, state, obs, prev_action):
        w = alf_step(state, self.log_E[obs], self.P[prev_action], self.delta)
        return w, w


def shifted(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """out[..., i] = x[..., (i − shift) mod n], i.e. P(shift) x for the ring permutation."""
    n = x.shape[-1]
    index = (torch.arange(n, device=x.device) - shift.unsqueeze(-1)) % n
    return x.gather(-1, index)


def decay_kernel(log_decay: torch.Tensor, length: int) -> torch.Tensor:
    """K[k, j, ...] = exp((k−j) log_decay) for j ≤ k, else 0: the impulse response of
    h_k = decay·h_{k−1} + u_k, so h = Σ_j K[k, j] u_j.  The exponent is clamped at 0
    before exp so that the masked j > k entries never overflow (inf·0 would be NaN in
    the gradient)."""
    lag = torch.arange(length, device=log_decay.device)
    lag = lag[:, None] - lag[None, :]  # (T, T)
    causal = lag >= 0
    lag = lag.clamp(min=0).to(log_decay.dtype).reshape(length, length, *([1] * log_decay.dim()))
    kernel = torch.exp(lag * log_decay)
    return kernel * causal.to(lag.dtype).reshape(length, length, *([1] * log_decay.dim()))


class DeepALF(FeatureModule):
    """ALF-structured learned memory: h_k = (1−δ) P(a_k) h_{k−1} + δ W[o_k].

    The recurrence keeps the ALF's structure (the nominal permutation of the action
    taken, a scalar leak) while the input projection W (initialised at log E, one row
    per observation) and δ = sigmoid(ρ) (kept in (0, 1), initialised at `delta_init`)
    are learned.  With the initial parameters it *is* the ALF.  The hidden size is
    tied to the number of positions because P(a) acts on positions.

    `sequence` uses a closed form: in the frame that moves with the accumulated
    shift c_k = Σ_{j≤k} shift(a_j), g_k = P(−c_k) h_k obeys the scalar recurrence
    g_k = (1−δ) g_{k−1} + δ P(−c_k) W[o_k], a causal convolution with (1−δ)^{k−j}.
    """

    learned = True

    def __init__(self, model: RingWorldModel, delta_init: float):
        super().__init__()
        self.feature_dim = model.n_positions
        self.register_buffer("shifts", model.shifts.clone())
        self.input_loglik = nn.Parameter(model.log_E.to(DTYPE).clone())  # (m, n), row o = W[o]
        self.delta_logit = nn.Parameter(torch.tensor(math.log(delta_init / (1.0 - delta_init)),
                                                     dtype=DTYPE))

    @property
    def delta(self) -> torch.Tensor:
        return torch.sigmoid(self.delta_logit)

    def initial_state(self, batch: int) -> torch.Tensor:
        return torch.zeros(batch, self.feature_dim, dtype=DTYPE, device=self.shifts.device)

    def step(self, state, obs, prev_action):
        delta = self.delta
        h = (1.0 - delta) * shifted(state, self.shifts[prev_action]) + delta * self.input_loglik[obs]
        return h, h

    def sequence(self, obs, prev_action):
        length = obs.shape[0]
        offset = self.shifts[prev_action].cumsum(dim=0)  # c_k, (T, N)
        co_moving_input = shifted(self.input_loglik[obs], -offset)
        kernel = decay_kernel(F.logsigmoid(-self.delta_logit), length)  # (1−δ)^{k−j}
        g = self.delta * torch.einsum("kj,jnd->knd", kernel, co_moving_input)
        return shifted(g, offset)


class DiagonalLinearRNN(FeatureModule):
    """Complex diagonal linear RNN (LRU-style), standing in for the paper's S5.

    h_k = λ ⊙ h_{k−1} + γ ⊙ (B x_k) with λ = exp(−(e^ν + 1e-6) + iθ), so |λ| < 1 for
    every ν (the 1e-6 keeps the modulus strictly below 1 even where e^ν underflows),
    and γ a learned input scale initialised at √(1−|λ|²) as in the LRU.  Features are
    [Re h, Im h]; the linear heads play the role of the LRU's output projection.
    """

    learned = True
    MIN_DECAY = 1e-6

    def __init__(self, n_obs: int, hidden: int, r_min: float = 0.5, r_max: float = 0.99):
        super().__init__()
        self.n_obs = n_obs
        self.hidden = hidden
        self.feature_dim = 2 * hidden
        n_in = n_obs + N_ACTIONS
        # |λ| uniform on the ring r_min ≤ |λ| ≤ r_max (area-uniform, as in the LRU), phase in [0, 2π)
        u1, u2 = torch.rand(hidden, dtype=DTYPE), torch.rand(hidden, dtype=DTYPE)
        modulus = torch.sqrt(u1 * (r_max ** 2 - r_min ** 2) + r_min ** 2)
        self.nu = nn.Parameter(torch.log(-torch.log(modulus)))
        self.theta = nn.Parameter(2.0 * math.pi * u2)
        self.log_gamma = nn.Parameter(0.5 * torch.log(1.0 - modulus ** 2))
        self.B_re = nn.Parameter(torch.randn(hidden, n_in, dtype=DTYPE) / math.sqrt(2 * n_in))
        self.B_im = nn.Parameter(torch.randn(hidden, n_in, dtype=DTYPE) / math.sqrt(2 * n_in))

    def log_lambda(self) -> torch.Tensor:
        return torch.complex(-(torch.exp(self.nu) + self.MIN_DECAY), self.theta)

    def eigenvalues(self) -> torch.Tensor:
        return torch.exp(self.log_lambda())

    def _input(self, obs, prev_action) -> torch.Tensor:
        x = memory_inputs(obs, prev_action, self.n_obs)
        B = torch.complex(self.B_re, self.B_im) * torch.exp(self.log_gamma)[:, None]
        return x.to(B.dtype) @ B.T

    def _features(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([h.real, h.imag], dim=-1)

    def initial_state(self, batch: int) -> torch.Tensor:
        return torch.zeros(batch, self.hidden, dtype=torch.complex128, device=self.nu.device)

    def step(self, state, obs, prev_action):
        h = self.eigenvalues() * state + self._input(obs, prev_action)
        return h, self._features(h)

    def sequence(self, obs, prev_action):
        kernel = decay_kernel(self.log_lambda(), obs.shape[0])  # (T, T, H): λ^{k−j}
        h = torch.einsum("kjh,jnh->knh", kernel, self._input(obs, prev_action))
        return self._features(h)


class GRUMemory(FeatureModule):
    """A GRU over [one-hot obs, one-hot previous action]; features are its hidden state."""

    learned = True

    def __init__(self, n_obs: int, hidden: int):
        super().__init__()
        self.n_obs = n_obs
        self.hidden = hidden
        self.feature_dim = hidden
        self.gru = nn.GRU(n_obs + N_ACTIONS, hidden, dtype=DTYPE)

    def initial_state(self, batch: int) -> torch.Tensor:
        return torch.zeros(batch, self.hidden, dtype=DTYPE, device=self.gru.weight_hh_l0.device)

    def step(self, state, obs, prev_action):
        x = memory_inputs(obs, prev_action, self.n_obs)
        _, h = self.gru(x[None], state[None].contiguous())
        return h[0], h[0]

    def sequence(self, obs, prev_action):
        out, _ = self.gru(memory_inputs(obs, prev_action, self.n_obs))
        return out


def head(n_in: int, n_out: int, hidden: int, out_gain: float) -> nn.Module:
    """Linear head (hidden = 0) or one tanh hidden layer; orthogonal init."""
    if hidden > 0:
        first = nn.Linear(n_in, hidden, dtype=DTYPE)
        nn.init.orthogonal_(first.weight, math.sqrt(2.0))
        nn.init.zeros_(first.bias)
        body = [first, nn.Tanh()]
        n_in = hidden
    else:
        body = []
    last = nn.Linear(n_in, n_out, dtype=DTYPE)
    nn.init.orthogonal_(last.weight, out_gain)
    nn.init.zeros_(last.bias)
    return nn.Sequential(*body, last)


class Agent(nn.Module):
    """Feature module + policy head (action logits) + value head."""

    def __init__(self, arm: str, memory: FeatureModule, policy_hidden: int):
        super().__init__()
        self.arm = arm
        self.memory = memory
        # a near-uniform initial policy (gain 0.01) and a zero initial value: the
        # feature scales differ by arm (beliefs in [0,1], logits down to −20), and a
        # zero value head keeps the first critic errors equal across arms.
        self.policy = head(memory.feature_dim, N_ACTIONS, policy_hidden, out_gain=0.01)
        self.value = head(memory.feature_dim, 1, policy_hidden, out_gain=0.0)

    def heads(self, features: torch.Tensor):
        return self.policy(features), self.value(features).squeeze(-1)


def build_agent(cfg: BeliefFilterConfig, arm: str, model: RingWorldModel) -> Agent:
    """Construct an arm; the caller seeds the global generator around this call
    (parameter initialisers draw from it)."""
    delta = alf_delta(cfg.env.eps, cfg.ppo.alf_lambda) if arm in ("alf", "deep_alf") else None
    if arm == "obs_only":
        memory = ObsOnly(model)
    elif arm == "lof_belief":
        memory = LogitFilter(model, "belief")
    elif arm == "lof_logits":
        memory = LogitFilter(model, "logits")
    elif arm == "alf":
        memory = ApproximateLinearFilter(model, delta)
    elif arm == "deep_alf":
        memory = DeepALF(model, delta)
    elif arm == "diag_lrnn":
        memory = DiagonalLinearRNN(model.n_obs, cfg.ppo.hidden)
    elif arm == "gru":
        memory = GRUMemory(model.n_obs, cfg.ppo.hidden)
    else:
        raise ValueError(f"unknown E4 arm {arm!r}")
    return Agent(arm, memory, cfg.ppo.policy_hidden)


def memory_size(cfg: BeliefFilterConfig, arm: str) -> int | None:
    """The `hidden` tag of a learned memory (None for fixed features)."""
    if arm == "deep_alf":
        return cfg.env.n_positions
    if arm in ("diag_lrnn", "gru"):
        return cfg.ppo.hidden
    return None
