"""Configuration of `icml belief-filter`: one dataclass tree, three presets.

Every field is settable with `--set section.key=value`; `config.json` of a run
holds the resolved tree and reproduces the run through `--config`.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def _grid(lo: float, hi: float, n: int) -> list[float]:
    return [lo + (hi - lo) * i / (n - 1) for i in range(n)]


@dataclass
class HMMConfig:
    path: str | None = None  # user HMM (JSON with T or P, E, pi0) for E1-E3


@dataclass
class E1Config:
    n_states: int = 8
    n_obs: int = 12
    n_seq: int = 64
    length: int = 200
    floor: float = 0.05  # E columns are floor + (1 - floor*m) * Dirichlet(1)
    stochastic_mix: float = 0.2  # negative control T = (1-mix) P + mix U


@dataclass
class E2Config:
    inv_eps_grid: list[float] = field(default_factory=lambda: _grid(30.0, 250.0, 23))
    n_traj: int = 20_000
    horizon: int = 1000
    lambda_: float = 0.7  # δ = λ / log(1/ε); spelled `e2.lambda` on the command line


@dataclass
class E3Config:
    n_states: int = 8
    n_obs: int = 12
    inv_eps_grid: list[float] = field(default_factory=lambda: [30.0, 60.0, 125.0, 250.0])
    n_traj: int = 2000
    horizon: int = 1000
    floor: float = 0.01  # E columns are floor + scale * Dirichlet(alpha)
    scale: float = 0.88
    alpha: float = 0.3
    lambda_: float = 0.7  # δ = λ / log(1/ε) for alf_lambda_log and alf_wrong_action (`e3.lambda`)


@dataclass
class EnvConfig:
    n_positions: int = 12
    eps: float = 0.05  # slip probability (the paper's value)
    kappa: float = 2.0  # beacon concentration (ours)
    episode_len: int = 50
    slip: str = "stay"  # stay | uniform


@dataclass
class PPOConfig:
    total_steps: int = 200_000  # environment steps per (arm, seed)
    n_envs: int = 64
    # each env plays complete episodes until it has taken this many steps in an update
    # (1: exactly one episode per env; 32 gives ~2.3k steps and ~95 updates per 200k)
    rollout_min_steps: int = 32
    epochs: int = 4
    minibatches: int = 4
    lr: float = 3e-3
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    hidden: int = 12  # learned memories (gru, diag_lrnn, deep_alf)
    policy_hidden: int = 0  # 0: linear-softmax heads; >0: one hidden layer MLP
    alf_lambda: float = 0.7  # δ = alf_lambda / log(1/ε) for the `alf` arm
    eval_episodes: int = 1000
    checkpoint_every: int = 20  # updates between checkpoints (for --resume)


ARMS = ["obs_only", "lof_belief", "lof_logits", "alf", "deep_alf", "diag_lrnn", "gru"]


@dataclass
class BeliefFilterConfig:
    hmm: HMMConfig = field(default_factory=HMMConfig)
    e1: E1Config = field(default_factory=E1Config)
    e2: E2Config = field(default_factory=E2Config)
    e3: E3Config = field(default_factory=E3Config)
    env: EnvConfig = field(default_factory=EnvConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    seeds: int = 3  # E4 seeds: run seed, run seed + 1, ...


def preset(name: str) -> BeliefFilterConfig:
    cfg = BeliefFilterConfig()
    if name == "smoke":
        cfg.e2.inv_eps_grid = [30.0, 125.0, 250.0]
        cfg.e2.n_traj = 2000
        cfg.e3.inv_eps_grid = [30.0, 250.0]
        cfg.e3.n_traj = 500
        cfg.ppo.total_steps = 5000
        cfg.ppo.eval_episodes = 200
        cfg.seeds = 1
    elif name == "paper":
        cfg.ppo.total_steps = 30_000_000
        cfg.seeds = 8
    return cfg


def validate(cfg: BeliefFilterConfig) -> None:
    """Reject values the experiments cannot run with, in one line each."""
    unknown = [a for a in cfg.arms if a not in ARMS]
    if unknown:
        raise ValueError(f"unknown arm(s) {unknown} in 'arms'; valid arms: {', '.join(ARMS)}")
    if cfg.env.slip not in ("stay", "uniform"):
        raise ValueError(f"env.slip must be 'stay' or 'uniform', not '{cfg.env.slip}'")
    if not 0 < cfg.env.eps < 1:
        raise ValueError(f"env.eps must be in (0, 1), not {cfg.env.eps}")
    grids = {"e2.inv_eps_grid": cfg.e2.inv_eps_grid, "e3.inv_eps_grid": cfg.e3.inv_eps_grid}
    for key, grid in grids.items():
        if not grid or any(v <= 1 for v in grid):
            raise ValueError(f"{key} must be a non-empty list of values > 1 (it holds 1/ε)")
    positive = {"e1.n_seq": cfg.e1.n_seq, "e1.length": cfg.e1.length, "e2.n_traj": cfg.e2.n_traj,
                "e2.horizon": cfg.e2.horizon, "e3.n_traj": cfg.e3.n_traj, "e3.horizon": cfg.e3.horizon,
                "ppo.total_steps": cfg.ppo.total_steps, "ppo.n_envs": cfg.ppo.n_envs, "seeds": cfg.seeds,
                "ppo.eval_episodes": cfg.ppo.eval_episodes, "ppo.hidden": cfg.ppo.hidden}
    for key, value in positive.items():
        if value <= 0:
            raise ValueError(f"{key} must be positive, not {value}")
    if cfg.hmm.path is not None:
        from pathlib import Path

        if not Path(cfg.hmm.path).is_file():
            raise ValueError(f"hmm.path '{cfg.hmm.path}' is not a file (expected JSON with T or P, E, pi0)")
        from icml.methods.belief_filter.hmm import load_hmm_json  # torch: only when a file is given

        load_hmm_json(cfg.hmm.path)  # a malformed file fails before training, not after
