"""PPO for the E4 arms on RingWorld-lite: training with resumable checkpoints, and evaluation.

One update:
1. Rollout.  The `n_envs` environments play *complete* episodes: each env starts a new
   episode whenever one ends, until it has taken `rollout_min_steps` steps in this
   update, and then finishes the episode it is in.  No episode is cut by the rollout,
   so every stored sequence starts at a reset and the memory can be replayed from its
   initial state (no stored hidden states, no truncated BPTT).
2. The steps are packed episode-major into padded (T, N_episodes) tensors; GAE(γ, λ)
   runs along each episode.  The episode-length cut is treated as terminal: there is
   no reward after it and time is not observed.
3. `epochs` passes, each over a random split of the episodes into `minibatches`
   groups.  Learned memories recompute their features through `sequence` (BPTT over
   whole episodes); the fixed filter features are reused from the rollout.

Determinism: all randomness (environment, action sampling, minibatch order) comes from
one explicit torch.Generator seeded with the run's seed, and parameters are initialised
under `torch.random.fork_rng`, so the global generators are neither read nor changed.
Same seed on CPU → bit-identical curves and evaluations.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch.nn import functional as F

from icml.cli.runstore import atomic_torch_save, load_checkpoint

from .agents import DTYPE, FILTER_ARMS, Agent, build_agent, memory_size
from .config import BeliefFilterConfig
from .filters import argmax_random_ties
from .ringworld import NO_ACTION, RingWorld, build_model

EVAL_SEED_OFFSET = 1_000_003  # default evaluation seed = training seed + this


@dataclass
class EpisodeBatch:
    """Complete episodes, time-major and padded: entry [τ, e] is step τ of episode e."""

    obs: torch.Tensor  # (T, N) observation seen before acting
    prev_action: torch.Tensor  # (T, N) action that led to it (NO_ACTION at τ = 0)
    action: torch.Tensor  # (T, N)
    log_prob: torch.Tensor  # (T, N) log π(action) at rollout time
    value: torch.Tensor  # (T, N)
    reward: torch.Tensor  # (T, N) reward received after the action
    position: torch.Tensor  # (T, N) true position when acting (for decode errors)
    features: torch.Tensor  # (T, N, F) memory features at rollout time
    mask: torch.Tensor  # (T, N) bool, True on real steps
    length: torch.Tensor  # (N,)
    episode_return: torch.Tensor  # (N,)
    goal: torch.Tensor  # (N,) bool: ended on a goal
    trap: torch.Tensor  # (N,) bool: ended on a trap

    @property
    def n_steps(self) -> int:
        return int(self.length.sum())


def act(agent: Agent, state: torch.Tensor, obs: torch.Tensor, prev_action: torch.Tensor,
        generator: torch.Generator | None):
    """One step of the policy in every env: the memory takes the observation, the heads read its features, an
    action is sampled. Returns (state, features, action, log π(action), value)."""
    state, features = agent.memory.step(state, obs, prev_action)
    logits, value = agent.heads(features)
    log_probs = F.log_softmax(logits, dim=-1)
    action = torch.multinomial(log_probs.exp(), 1, generator=generator).squeeze(-1)
    return state, features, action, log_probs.gather(-1, action[:, None]).squeeze(-1), value


@torch.no_grad()
def collect_episodes(agent: Agent, env: RingWorld, min_steps: int,
                     generator: torch.Generator) -> EpisodeBatch:
    """Play complete episodes in every env (see the module docstring) and pack them."""
    n = env.n_envs
    device = env.device
    memory = agent.memory
    obs = env.reset()
    state = memory.initial_state(n)
    prev_action = torch.full((n,), NO_ACTION, dtype=torch.long, device=device)
    steps_taken = torch.zeros(n, dtype=torch.long, device=device)
    episode_ordinal = torch.zeros(n, dtype=torch.long, device=device)
    active = torch.ones(n, dtype=torch.bool, device=device)
    columns = {k: [] for k in ("obs", "prev_action", "action", "log_prob", "value", "reward",
                               "position", "features", "active", "tau", "ordinal", "terminal")}
    while bool(active.any()):
        state, features, action, log_prob, value = act(agent, state, obs, prev_action, generator)
        for key, val in (("obs", obs), ("prev_action", prev_action), ("action", action),
                         ("log_prob", log_prob), ("value", value), ("position", env.position), ("features", features),
                         ("active", active), ("tau", env.t), ("ordinal", episode_ordinal)):
            columns[key].append(val)

        next_obs, reward, done, terminal = env.step(action)
        columns["reward"].append(reward)
        columns["terminal"].append(terminal)
        steps_taken = steps_taken + active.long()
        finished = done & active
        restart = finished & (steps_taken < min_steps)
        active = active & ~(finished & ~restart)
        obs, prev_action = next_obs, action
        if bool(restart.any()):
            reset_obs = env.reset(restart)
            obs = torch.where(restart, reset_obs, obs)
            prev_action = torch.where(restart, torch.full_like(action, NO_ACTION), action)
            state = torch.where(restart.view(-1, *([1] * (state.dim() - 1))),
                                memory.initial_state(n), state)
            episode_ordinal = episode_ordinal + restart.long()

    stacked = {k: torch.stack(v) for k, v in columns.items()}  # (L, n, ...)
    return _pack_episodes(stacked, episodes_per_env=episode_ordinal + 1)


def _pack_episodes(steps: dict, episodes_per_env: torch.Tensor) -> EpisodeBatch:
    """Scatter the env-major step records into padded episode-major tensors."""
    first_episode = torch.cumsum(episodes_per_env, 0) - episodes_per_env
    n_episodes = int(episodes_per_env.sum())
    real = steps["active"]
    env_index = torch.arange(real.shape[1], device=real.device).expand_as(real)
    episode = (first_episode[env_index] + steps["ordinal"])[real]
    tau = steps["tau"][real]
    horizon = int(tau.max()) + 1

    def pack(values: torch.Tensor, fill=0) -> torch.Tensor:
        out = torch.full((horizon, n_episodes, *values.shape[2:]), fill,
                         dtype=values.dtype, device=values.device)
        out[tau, episode] = values[real]
        return out

    mask = pack(real, False)
    reward = pack(steps["reward"])
    terminal_reward = reward.sum(0)
    ended_terminal = pack(steps["terminal"], False).any(0)
    return EpisodeBatch(
        obs=pack(steps["obs"]), prev_action=pack(steps["prev_action"], NO_ACTION),
        action=pack(steps["action"]), log_prob=pack(steps["log_prob"]),
        value=pack(steps["value"]), reward=reward, position=pack(steps["position"]),
        features=pack(steps["features"]), mask=mask, length=mask.sum(0),
        episode_return=terminal_reward,
        goal=ended_terminal & (terminal_reward > 0), trap=ended_terminal & (terminal_reward < 0))


def gae(reward: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimates along padded episodes; V = 0 after the last step."""
    real = mask.to(value.dtype)
    advantage = torch.zeros_like(value)
    next_value = torch.zeros_like(value[0])
    next_advantage = torch.zeros_like(value[0])
    for k in range(value.shape[0] - 1, -1, -1):
        td_error = reward[k] + gamma * next_value - value[k]
        advantage[k] = (td_error + gamma * lam * next_advantage) * real[k]
        next_value = value[k] * real[k]
        next_advantage = advantage[k]
    return advantage, advantage + value


def minibatch_table(agent: Agent, batch: EpisodeBatch, advantage: torch.Tensor,
                    returns: torch.Tensor) -> torch.Tensor:
    """Everything the loss reads per step, as one (T, N, C) table, so that a minibatch
    is two indexing operations: [action, old log-prob, advantage, return, features…]
    (the features only for fixed memories; learned ones recompute theirs)."""
    columns = [batch.action.to(DTYPE), batch.log_prob, advantage, returns]
    table = torch.stack(columns, dim=-1)
    if not agent.memory.learned:
        table = torch.cat([table, batch.features], dim=-1)
    return table


def ppo_loss(agent: Agent, batch: EpisodeBatch, table: torch.Tensor, episodes: torch.Tensor,
             cfg: BeliefFilterConfig) -> torch.Tensor:
    """Clipped-surrogate PPO loss on a group of whole episodes."""
    horizon = int(batch.length[episodes].max())
    real = batch.mask[:horizon, episodes].nonzero(as_tuple=True)  # (τ, episode) of every real step, in mask order
    return surrogate_loss(agent, table[:horizon, episodes], batch.obs[:horizon, episodes],
                          batch.prev_action[:horizon, episodes], real, cfg)


def surrogate_loss(agent: Agent, table: torch.Tensor, obs: torch.Tensor, prev_action: torch.Tensor,
                   real: tuple[torch.Tensor, torch.Tensor], cfg: BeliefFilterConfig) -> torch.Tensor:
    """The loss on padded (T, N) episodes whose real steps are at `real` (index tensors, so that the loss itself
    has no data-dependent shapes: `icml belief-filter plan` runs it on the meta device)."""
    rows = table[real]
    if agent.memory.learned:  # replay the memory from the reset, with gradient
        features = agent.memory.sequence(obs, prev_action)[real]
    else:
        features = rows[:, 4:]
    action, old_log_prob, adv, target = rows[:, 0].long(), rows[:, 1], rows[:, 2], rows[:, 3]
    logits, value = agent.heads(features)
    log_probs = F.log_softmax(logits, dim=-1)
    if adv.numel() > 1:  # per-minibatch advantage normalisation
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)

    ratio = torch.exp(log_probs.gather(-1, action[:, None]).squeeze(-1) - old_log_prob)
    clip = cfg.ppo.clip
    policy_loss = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv).mean()
    value_loss = 0.5 * (value - target).pow(2).mean()
    entropy = -(log_probs.exp() * log_probs).sum(-1).mean()
    return policy_loss + cfg.ppo.vf_coef * value_loss - cfg.ppo.ent_coef * entropy


def _seeded_agent(cfg: BeliefFilterConfig, arm: str, model, seed: int, device: str) -> Agent:
    """Build the arm with parameters drawn from `seed`, leaving the global RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        agent = build_agent(cfg, arm, model)
    return agent.to(device)


def _tags(cfg: BeliefFilterConfig, arm: str, seed: int, step: int, split: str) -> dict:
    row = {"experiment": "e4", "variant": arm, "seed": int(seed), "step": int(step),
           "split": split, "eps": float(cfg.env.eps)}
    hidden = memory_size(cfg, arm)
    if hidden is not None:
        row["hidden"] = int(hidden)
    return row



def _load(path: Path, device: str) -> dict:
    # our own file, holding numpy/python RNG states next to the tensors
    return load_checkpoint(path, map_location=device)


def train_arm(cfg: BeliefFilterConfig, arm: str, seed: int, checkpoint_path: Path,
              device: str = "cpu", progress: Callable[[int], None] | None = None) -> list[dict]:
    """Train `arm` with PPO for cfg.ppo.total_steps environment steps; return the curve.

    Checkpoints (model, optimiser, generator state, step, curve, done flag) are written
    atomically every `checkpoint_every` updates and at the end.  An existing checkpoint
    is resumed (or returned as is when done); resuming from an update boundary
    continues exactly the sequence of an uninterrupted run.
    """
    checkpoint_path = Path(checkpoint_path)
    ppo = cfg.ppo
    model = build_model(cfg.env).to(device)
    agent = _seeded_agent(cfg, arm, model, seed, device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=ppo.lr, eps=1e-5, fused=device == "cpu")
    generator = torch.Generator(device=device).manual_seed(seed)
    env = RingWorld(model, ppo.n_envs, cfg.env.episode_len, generator)
    step, update, curve = 0, 0, []

    if checkpoint_path.exists():
        saved = _load(checkpoint_path, device)
        if saved["arm"] != arm or saved["seed"] != seed:
            raise ValueError(f"{checkpoint_path} holds {saved['arm']} seed {saved['seed']}, "
                             f"not {arm} seed {seed}")
        if saved["done"]:
            return list(saved["curve"])
        agent.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        generator.set_state(saved["rng"]["generator"])
        step, update, curve = saved["step"], saved["update"], list(saved["curve"])

    def checkpoint(done: bool) -> None:
        # Training draws only from `generator`, so its state is all a resume needs; tensors and plain
        # containers only, so that the checkpoint loads with weights_only=True.
        atomic_torch_save({"arm": arm, "seed": seed, "model": agent.state_dict(),
                           "optimizer": optimizer.state_dict(), "step": step, "update": update,
                           "curve": curve, "done": done,
                           "rng": {"generator": generator.get_state()}}, checkpoint_path)

    while step < ppo.total_steps:
        batch = collect_episodes(agent, env, ppo.rollout_min_steps, generator)
        with torch.no_grad():
            advantage, returns = gae(batch.reward, batch.value, batch.mask, ppo.gamma,
                                     ppo.gae_lambda)
        table = minibatch_table(agent, batch, advantage, returns)
        n_episodes = batch.length.numel()
        for _ in range(ppo.epochs):
            order = torch.randperm(n_episodes, generator=generator, device=device)
            for episodes in order.chunk(ppo.minibatches):
                loss = ppo_loss(agent, batch, table, episodes, cfg)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(agent.parameters(), ppo.max_grad_norm)
                optimizer.step()

        step += batch.n_steps
        update += 1
        curve.append({**_tags(cfg, arm, seed, step, "train"), "metric": "episode_return",
                      "value": float(batch.episode_return.mean())})
        if update % ppo.checkpoint_every == 0 and step < ppo.total_steps:
            checkpoint(done=False)
        if progress is not None:
            progress(batch.n_steps)
    checkpoint(done=True)
    return curve


@torch.no_grad()
def evaluate_arm(cfg: BeliefFilterConfig, arm: str, seed: int, checkpoint_path: Path,
                 device: str = "cpu", eval_seed: int | None = None) -> list[dict]:
    """Play cfg.ppo.eval_episodes fresh episodes (actions sampled from the policy) with the
    trained policy of `checkpoint_path` and return the test rows."""
    saved = _load(Path(checkpoint_path), device)
    if not saved["done"]:
        raise RuntimeError(f"{checkpoint_path} is an unfinished training run")
    model = build_model(cfg.env).to(device)
    agent = _seeded_agent(cfg, arm, model, seed, device)
    agent.load_state_dict(saved["model"])
    agent.eval()
    eval_seed = seed + EVAL_SEED_OFFSET if eval_seed is None else eval_seed
    generator = torch.Generator(device=device).manual_seed(eval_seed)
    env = RingWorld(model, cfg.ppo.eval_episodes, cfg.env.episode_len, generator)
    batch = collect_episodes(agent, env, min_steps=1, generator=generator)  # one episode each

    curve_returns = [row["value"] for row in saved["curve"]]
    metrics = {
        "final_return": float(batch.episode_return.mean()),
        "success_rate": float(batch.goal.double().mean()),
        "trap_rate": float(batch.trap.double().mean()),
        "return_auc": float(np.mean(curve_returns)) if curve_returns else float("nan"),
    }
    if arm in FILTER_ARMS:
        decoded = argmax_random_ties(batch.features[batch.mask], generator=generator)
        metrics["feature_decode_error"] = float(
            (decoded != batch.position[batch.mask]).to(DTYPE).mean())
    return [{**_tags(cfg, arm, seed, saved["step"], "test"), "metric": name, "value": value}
            for name, value in metrics.items()]
