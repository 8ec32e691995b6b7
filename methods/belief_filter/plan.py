"""`icml belief-filter plan` (cli/plan.py): per E4 arm, one rollout step of the `n_envs` environments and a PPO
minibatch update (train), and one step of the `eval_episodes` evaluation environments (eval), on one device.

The networks are a few hundred parameters; what grows with the preset is the number of environments and episodes
stepped together. The rollout loop itself (`collect_episodes`: until every env has finished, a data-dependent
stop) and the packing of its steps into padded episodes are left out: the plan runs one step of the loop's body
(`act`, the environments' step) and the update on a padded minibatch given directly. That minibatch is an upper
bound: every episode of the update as long as the cap (`episode_len`), the update's steps at their most
(every env stops at the end of the first episode past `rollout_min_steps`). E1–E3 are numpy on the CPU.
"""
from __future__ import annotations

import math

import torch

from icml.cli.plan import Hardware, Step
from icml.methods.belief_filter.agents import DTYPE
from icml.methods.belief_filter.ppo import _seeded_agent, act, surrogate_loss
from icml.methods.belief_filter.ringworld import N_ACTIONS, NO_ACTION, RingWorld, build_model

LAYOUT = "one process per arm (the README's loop: 7 beside each other on one GPU), each training its seeds in turn"
OVERSIZE = ["ppo.n_envs=100000000"]


def hardware(preset: str) -> Hardware:
    return Hardware(1, 80e9)


def _world(cfg, arm: str, n_envs: int, device):
    """The model, agent and environments as train_arm / evaluate_arm build them (no generator: a meta one does
    not exist, so the plan's draws come from the device's default generator)."""
    model = build_model(cfg.env).to(device)
    agent = _seeded_agent(cfg, arm, model, 0, device)
    return model, agent, RingWorld(model, n_envs, cfg.env.episode_len, None)


def _rollout_step(agent, env) -> None:
    """One step of the loop of collect_episodes: the policy acts in every env, the envs step."""
    obs = env.reset()
    state = agent.memory.initial_state(env.n_envs)
    prev_action = torch.full((env.n_envs,), NO_ACTION, dtype=torch.long, device=obs.device)
    with torch.no_grad():
        _, _, action, _, _ = act(agent, state, obs, prev_action, None)
    env.step(action)


def minibatch_episodes(cfg) -> int:
    """Episodes of one planned minibatch: the update's most steps, n_envs × (rollout_min_steps + episode_len − 1),
    as full-length episodes, split into `minibatches`."""
    ppo, length = cfg.ppo, cfg.env.episode_len
    episodes = math.ceil(ppo.n_envs * (max(ppo.rollout_min_steps, 1) + length - 1) / length)
    return max(1, math.ceil(episodes / ppo.minibatches))


def _train(cfg, arm: str):
    def run(tracker):
        ppo, length = cfg.ppo, cfg.env.episode_len
        model, agent, env = _world(cfg, arm, ppo.n_envs, tracker.device)
        optimizer = torch.optim.Adam(agent.parameters(), lr=ppo.lr, eps=1e-5)
        tracker.watch(agent, optimizer)
        _rollout_step(agent, env)
        episodes, device = minibatch_episodes(cfg), tracker.device
        columns = 4 + (0 if agent.memory.learned else agent.memory.feature_dim)  # minibatch_table's
        with tracker.buffers():  # the minibatch's part of the padded episodes (time-major)
            table = torch.randn(length, episodes, columns, dtype=DTYPE, device=device)
            table[..., 0] = torch.randint(0, N_ACTIONS, (length, episodes), device=device)  # the actions taken
            obs = torch.randint(0, model.n_obs, (length, episodes), device=device)
            prev_action = torch.randint(0, N_ACTIONS, (length, episodes), device=device)
            steps = torch.arange(length * episodes, device=device)
            real = (steps // episodes, steps % episodes)  # every step real: the mask's nonzero, in its order
        for _ in range(2):  # the second update holds Adam's state from its start
            loss = surrogate_loss(agent, table, obs, prev_action, real, cfg)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(agent.parameters(), ppo.max_grad_norm)
            optimizer.step()
    return run


def _eval(cfg, arm: str):
    def run(tracker):
        _, agent, env = _world(cfg, arm, cfg.ppo.eval_episodes, tracker.device)
        agent.eval()
        tracker.watch(agent)
        _rollout_step(agent, env)
    return run


def steps(cfg, processes: int) -> list[Step]:
    ppo = cfg.ppo
    out = []
    for arm in cfg.arms:
        out.append(Step("train", f"{arm}: a rollout step of {ppo.n_envs} envs, a PPO update on "
                                 f"{minibatch_episodes(cfg)} episodes × {cfg.env.episode_len} steps",
                        _train(cfg, arm), repeats=2))
    for arm in cfg.arms:
        out.append(Step("eval", f"{arm}: a step of {ppo.eval_episodes} evaluation episodes", _eval(cfg, arm)))
    return out
