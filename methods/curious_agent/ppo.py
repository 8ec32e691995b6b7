"""PPO for the pixel actor-critic and for the CoT agent (VAGEN Bi-Level GAE), with GLANCE.

Order of one update of a GLANCE arm: roll out with the current weights, computing r^i_t = β·L_explore
with those pre-update weights at rollout time; add r^i (normalised) to the turn reward; turn-level
then token-level GAE; then PPO epochs in which every minibatch also takes one alignment step of
(f_v, g_ψ) on L_explore, followed by the EMA update of φ. Every K updates g_ψ and its Adam moments
are re-initialised.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from icml.methods.curious_agent.env import SLOTS, GridEnvs
from icml.methods.curious_agent.model import (ACT_POS, CLOSE_PRED, OBS_POS, PRED_POS, SAMPLED, CoTAgent,
                                              GlanceHead, VisionEncoder, explore_loss, slot_token_ids)

N_SLOTS = len(SLOTS)


# ---- advantages ---------------------------------------------------------------------------------
def gae(rewards, values, dones, last_value, gamma: float, lam: float):
    """Standard GAE over [T, N] arrays; dones[t] = the episode ended after step t."""
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(last_value)
    for t in reversed(range(rewards.shape[0])):
        next_value = last_value if t == rewards.shape[0] - 1 else values[t + 1]
        live = 1.0 - dones[t]
        delta = rewards[t] + gamma * next_value * live - values[t]
        running = delta + gamma * lam * live * running
        advantages[t] = running
    return advantages


def bilevel_gae(turn_rewards, token_values, dones, last_value, gamma_turn: float, gamma_token: float, lam: float):
    """VAGEN Bi-Level GAE. turn_rewards/dones [T,N]; token_values [T,N,K] (the critic before each
    sampled token; the last one is the turn value). Returns token advantages [T,N,K]."""
    turn_values = token_values[..., -1]
    turn_returns = gae(turn_rewards, turn_values, dones, last_value, gamma_turn, lam) + turn_values
    K = token_values.shape[-1]
    advantages = torch.zeros_like(token_values)
    running = torch.zeros_like(turn_rewards)
    for k in reversed(range(K)):  # inside the turn: the turn return is the reward of its last token
        reward = turn_returns if k == K - 1 else torch.zeros_like(turn_rewards)
        next_value = torch.zeros_like(turn_rewards) if k == K - 1 else token_values[..., k + 1]  # bootstrap 0
        delta = reward + gamma_token * next_value - token_values[..., k]
        running = delta + gamma_token * lam * running
        advantages[..., k] = running
    return advantages


class RunningStd:
    """Running variance of the discounted intrinsic return (the RND normaliser)."""

    def __init__(self, n_envs: int, gamma: float):
        self.gamma, self.ret = gamma, np.zeros(n_envs)
        self.count, self.mean, self.var = 1e-4, 0.0, 1.0

    def normalise(self, rewards: np.ndarray) -> np.ndarray:
        self.ret = self.gamma * self.ret + rewards
        batch_mean, batch_var, n = self.ret.mean(), self.ret.var(), len(self.ret)
        delta, total = batch_mean - self.mean, self.count + n
        self.mean += delta * n / total
        self.var = (self.var * self.count + batch_var * n + delta ** 2 * self.count * n / total) / total
        self.count = total
        return rewards / np.sqrt(self.var + 1e-8)


# ---- arms ---------------------------------------------------------------------------------------
@dataclass
class ArmSpec:
    cot: bool
    beta: float
    reset_every: float
    ema_alpha: float
    lm_grad: bool = False
    vision_only: bool = False
    rnd: bool = False


def arm_spec(arm: str, cfg) -> ArmSpec:
    g = cfg.glance
    return {"ppo": ArmSpec(False, 0.0, 0.0, g.ema_alpha),
            "ppo_rnd": ArmSpec(False, 0.0, 0.0, g.ema_alpha, rnd=True),
            "vagen_lite": ArmSpec(True, 0.0, 0.0, g.ema_alpha),
            "glance": ArmSpec(True, g.beta, g.reset_every, g.ema_alpha),
            "glance_no_reset": ArmSpec(True, g.beta, 0.0, g.ema_alpha),
            "glance_no_ema": ArmSpec(True, g.beta, g.reset_every, 0.0),
            "glance_lm_grad": ArmSpec(True, g.beta, g.reset_every, g.ema_alpha, lm_grad=True),
            "glance_vision_only": ArmSpec(True, g.beta, g.reset_every, g.ema_alpha, vision_only=True)}[arm]


def n_actions(cfg) -> int:
    return 5 if cfg.env.actions == "minimal" else 7


def new_agent(cfg, device: str = "cpu") -> CoTAgent:
    """The tiny agent (always on the CPU: CPU-scale), or with `--model` the same agent on a local HF
    VLM's vision tower and LM, on `device`."""
    m = cfg.model
    if m.path is not None:
        return CoTAgent.from_pretrained(m.path, m.visual_tokens, n_actions(cfg)).to(device)
    return CoTAgent(m.d_model, m.layers, m.heads, m.visual_tokens, n_actions(cfg))


class PixelActorCritic(nn.Module):
    """The `ppo` baseline: the same f_v, pooled, into MLP actor and critic heads (no CoT)."""

    def __init__(self, d: int, n_act: int):
        super().__init__()
        self.vision = VisionEncoder(d, 4)
        self.actor = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, n_act))
        self.critic = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, 1))

        self.critic_int = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, 1))  # used by ppo_rnd only

    def forward(self, frames):
        z = self.vision(frames).mean(1)
        return self.actor(z), self.critic(z).squeeze(-1), self.critic_int(z).squeeze(-1)


class RND(nn.Module):
    """Random network distillation on o_{t+1}: a fixed random CNN target, a trained predictor;
    observations normalised by running per-pixel mean/std and clipped to [−5, 5]."""

    def __init__(self, d: int):
        super().__init__()
        self.target = nn.Sequential(VisionEncoder(d, 1), nn.Flatten(), nn.Linear(d, d))
        self.target.requires_grad_(False)
        self.predictor = nn.Sequential(VisionEncoder(d, 1), nn.Flatten(), nn.ReLU(), nn.Linear(d, d), nn.ReLU(),
                                       nn.Linear(d, d))
        self.register_buffer("mean", torch.zeros(3, 28, 28))
        self.register_buffer("var", torch.ones(3, 28, 28))
        self.count = 1e-4

    def update_stats(self, frames: torch.Tensor) -> None:
        m, v, n = frames.mean(0), frames.var(0, unbiased=False), frames.shape[0]
        delta, total = m - self.mean, self.count + n
        self.mean += delta * n / total
        self.var = (self.var * self.count + v * n + delta ** 2 * self.count * n / total) / total
        self.count = total

    def error(self, frames: torch.Tensor) -> torch.Tensor:
        x = ((frames - self.mean) / (self.var.sqrt() + 1e-8)).clamp(-5, 5)
        return (self.predictor(x) - self.target(x)).pow(2).sum(-1)


def slot_accuracy(tokens: torch.Tensor, slots: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """Per-row fraction of slots whose generated value equals the describer's."""
    truth = torch.stack([torch.tensor(slot_token_ids(k))[slots[:, k]] for k in range(N_SLOTS)], 1)
    return (tokens[:, positions] == truth).float().mean(1)


def teacher_tokens(slots_t: torch.Tensor, slots_next: torch.Tensor, actions: torch.Tensor, agent: CoTAgent):
    """The describer's turn (for the warm-up): <obs>=describer(o_t), <pred>=describer(o_t+1), <ans>=a_t."""
    from icml.methods.curious_agent.model import TEMPLATE, TOKEN

    tokens = torch.zeros(len(actions), len(TEMPLATE), dtype=torch.long)
    for p, t in enumerate(TEMPLATE):
        if isinstance(t, str):
            tokens[:, p] = TOKEN[t]
    for k in range(N_SLOTS):
        ids = torch.tensor(slot_token_ids(k))
        tokens[:, OBS_POS[k]], tokens[:, PRED_POS[k]] = ids[slots_t[:, k]], ids[slots_next[:, k]]
    tokens[:, ACT_POS] = torch.tensor(agent.action_ids)[actions]
    return tokens


def cpu_state(module: nn.Module) -> dict:
    """The state dict on the CPU (checkpoints load anywhere); the tiny agent's tensors are returned as they are."""
    return {k: v.cpu() for k, v in module.state_dict().items()}


def warmup(cfg, seed: int, device: str = "cpu") -> dict:
    """Perception warm-up: teacher-forced CE on random-walk transitions; returns the agent's weights."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    agent = new_agent(cfg, device)
    envs = GridEnvs(cfg.env.id, cfg.ppo.n_envs, 1_000_000 + seed * 1000, cfg.env.actions, cfg.env.tile_size,
                    cfg.env.max_steps)
    frames, slots, nexts, actions = [], [], [], []
    while len(frames) * cfg.ppo.n_envs < cfg.warmup.transitions:
        act = rng.integers(0, n_actions(cfg), cfg.ppo.n_envs)
        f, s = envs.frames.copy(), envs.slots.copy()
        _, _, _, _, _, next_slots = envs.step(act)
        frames.append(f), slots.append(s), nexts.append(next_slots), actions.append(act)
    frames = torch.tensor(np.concatenate(frames))
    tokens = teacher_tokens(torch.tensor(np.concatenate(slots)), torch.tensor(np.concatenate(nexts)),
                            torch.tensor(np.concatenate(actions)), agent)
    optimiser = torch.optim.Adam(agent.parameters(), lr=cfg.warmup.lr)
    for _ in range(cfg.warmup.epochs):
        for idx in torch.randperm(len(frames)).split(cfg.warmup.batch):
            warmup_step(agent, optimiser, frames[idx], tokens[idx])
    return cpu_state(agent)


def warmup_step(agent: CoTAgent, optimiser, frames: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """One teacher-forced step: cross-entropy of the describer's turn tokens at the sampled positions."""
    optimiser.zero_grad()  # first: the last step's gradients are not held through this forward
    logits, _, _ = agent.forward_turn(frames, tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, SAMPLED].flatten())
    loss.backward()
    optimiser.step()
    return loss


# ---- the GLANCE learner -------------------------------------------------------------------------
class Glance:
    """Projector g_ψ, EMA target φ, the alignment optimiser over f_v and g_ψ (and Λ_ℓ only for the
    routing ablation), the intrinsic-reward normaliser and the periodic projector reset."""

    def __init__(self, agent: CoTAgent, spec: ArmSpec, cfg, seed: int):
        self.agent, self.spec, self.cfg = agent, spec, cfg
        self.n_actions = len(agent.action_ids)
        self.head = GlanceHead(agent, seed, d_in=agent.embed.embedding_dim + self.n_actions if spec.vision_only else None)
        self.position = CLOSE_PRED if cfg.glance.h_position == "close" else CLOSE_PRED - 1
        self.params = list(agent.vision.parameters()) + list(self.head.projector.parameters())
        if spec.lm_grad:
            self.params += agent.language_parameters()
        self.optimiser = torch.optim.Adam(self.params, lr=cfg.glance.lr)
        self.normaliser = RunningStd(cfg.ppo.n_envs, cfg.glance.gamma_int)

    @property
    def active(self) -> bool:
        return self.spec.beta > 0 or self.cfg.glance.align_when_beta0

    def loss(self, hidden: torch.Tensor, next_frames: torch.Tensor, frames: torch.Tensor | None = None,
             actions: torch.Tensor | None = None) -> torch.Tensor:
        """Per-turn L_explore from the hidden states [B, 19, d] of the turns; the vision-only
        ablation (BYOL-Explore style) queries with pooled f_v(o_t) ⊕ one-hot(a_t) instead."""
        device = self.agent.device  # hidden comes on the CPU; g_ψ and φ live with the agent
        if self.spec.vision_only:
            query = torch.cat([self.agent.vision(frames).mean(1),
                               F.one_hot(actions, self.n_actions).float().to(device)], -1)
        else:
            query = hidden[:, self.position].to(device)
        return explore_loss(self.head.projector(query), self.head.target_feature(next_frames)).to(self.agent.host)

    def gradients(self, loss: torch.Tensor) -> tuple:
        """∂L_explore w.r.t. f_v and g_ψ only (Λ_ℓ too for `glance_lm_grad`): L back-propagates
        through Λ_ℓ into the visual tokens, but Λ_ℓ's .grad is never written."""
        return torch.autograd.grad(loss, self.params, retain_graph=True, allow_unused=True)

    def step(self, grads: tuple) -> None:
        """The alignment optimiser's step on the given gradients, then φ ← αφ + (1−α)v."""
        for p, g in zip(self.params, grads):
            p.grad = g
        self.optimiser.step()
        for p in self.params:
            p.grad = None
        self.head.ema_update(self.agent.vision, self.spec.ema_alpha)

    def align(self, loss: torch.Tensor) -> None:
        self.step(self.gradients(loss))

    def reset_projector(self) -> None:
        """Re-initialise g_ψ and its Adam moments; f_v, φ and the normaliser are kept."""
        self.head.projector.reinitialise()
        for p in self.head.projector.parameters():
            self.optimiser.state.pop(p, None)


# ---- training -----------------------------------------------------------------------------------
def reset_updates(updates: int, every: float) -> set[int]:
    """The updates (1-based) that start with a projector reset: every K = `every` × `updates` updates
    (K fractional, each point rounded), at the interior points of the schedule only. The last reset
    comes ⌊K⌋ or more updates before the end, so the projector that is evaluated trained about as long
    as every other (a reset on the final update would leave it trained for a single update)."""
    if every <= 0:
        return set()
    period = every * updates
    points = {round(j * period) for j in range(1, int(1 / every + 1e-9))}  # j K ≤ (1 − every) × updates
    return {point + 1 for point in points if 1 <= point < updates}


def _tag(cfg, spec: ArmSpec) -> dict:
    return {"env_id": cfg.env.id, "reward_mode": cfg.reward_mode, "beta": spec.beta,
            "reset_every": spec.reset_every, "ema_alpha": spec.ema_alpha}


def train_arm(cfg, arm: str, seed: int, warm_state: dict | None, progress=None, device: str = "cpu"):
    """Train one (arm, seed); -> (metric rows of the train split, final state dict). `device` places a
    `--model` VLM agent; the tiny agent and the pixel baselines stay on the CPU."""
    spec = arm_spec(arm, cfg)
    torch.manual_seed(seed)
    rng = torch.Generator().manual_seed(seed)
    p = cfg.ppo
    envs = GridEnvs(cfg.env.id, p.n_envs, seed * 100_000, cfg.env.actions, cfg.env.tile_size, cfg.env.max_steps)
    if spec.cot:
        model = new_agent(cfg, device)
        if warm_state is not None:
            model.load_state_dict(warm_state)
        glance = Glance(model, spec, cfg, seed)
    else:
        model, glance = PixelActorCritic(cfg.model.d_model, n_actions(cfg)), None
    rnd = RND(cfg.model.d_model) if spec.rnd else None
    rnd_norm = RunningStd(p.n_envs, cfg.glance.gamma_int) if spec.rnd else None
    optimiser = torch.optim.Adam(list(model.parameters()) + (list(rnd.predictor.parameters()) if rnd else []),
                                 lr=p.lr)
    updates = max(1, p.total_steps // (p.n_envs * p.rollout))
    resets = reset_updates(updates, spec.reset_every)
    tags, rows = _tag(cfg, spec), []
    steps, first_success, returns_now = 0, None, np.zeros(p.n_envs)
    ri_novel, ri_revisit = [], []
    for update in range(1, updates + 1):
        start = time.perf_counter()
        reset = glance is not None and glance.active and update in resets
        if reset:
            glance.reset_projector()
        buf = {k: [] for k in ("frames", "next", "tokens", "logp", "values", "reward", "done", "ri_raw",
                               "ri", "obs_acc", "pred_acc", "actions", "values_int", "ri_rnd")}
        finished, finished_success = [], []
        for _ in range(p.rollout):
            frames = torch.tensor(envs.frames)
            slots_t = torch.tensor(envs.slots)
            with torch.no_grad():
                if spec.cot:
                    tokens, logp, values, hidden = model.generate(frames, generator=rng)
                    action_index = torch.tensor([model.action_ids.index(int(t)) for t in tokens[:, ACT_POS]])
                else:
                    logits, value, value_int = model(frames)
                    buf["values_int"].append(value_int)
                    dist = torch.distributions.Categorical(logits=logits)
                    action_index = torch.multinomial(dist.probs, 1, generator=rng)[:, 0]
                    logp, values, tokens = dist.log_prob(action_index)[:, None], value[:, None], action_index
            reward, done, success, novel, next_frames, next_slots = envs.step(action_index.numpy())
            steps += p.n_envs
            returns_now += reward
            for i in np.flatnonzero(done):
                finished.append(returns_now[i])
                finished_success.append(float(success[i]))
                returns_now[i] = 0.0
            if first_success is None and success.any():
                first_success = steps
            task = reward if cfg.reward_mode == "extrinsic" else np.zeros_like(reward)
            turn_reward = task.copy()
            next_t = torch.tensor(next_frames)
            if rnd is not None:
                with torch.no_grad():
                    buf["ri_raw"].append(rnd.error(next_t).numpy())
                buf["ri_rnd"].append(torch.tensor(rnd_norm.normalise(buf["ri_raw"][-1]), dtype=torch.float32))
            if spec.cot:
                obs_acc = slot_accuracy(tokens, slots_t, OBS_POS)
                pred_acc = slot_accuracy(tokens, torch.tensor(next_slots), PRED_POS)
                turn_reward += p.reason_coef * 0.5 * (obs_acc + pred_acc).numpy()
                buf["obs_acc"].append(obs_acc), buf["pred_acc"].append(pred_acc)
                ri_raw = np.zeros(p.n_envs)
                ri = np.zeros(p.n_envs)
                if glance.active:  # pre-update weights, at rollout time, one scalar per turn
                    with torch.no_grad():
                        loss_now = glance.loss(hidden, next_t, frames, action_index).numpy()
                    ri_raw = spec.beta * loss_now
                    # β weights the normalised signal (as RND's int_coef does): the running std of
                    # β·L's return is β times L's, so normalising β·L would cancel β exactly
                    ri = spec.beta * glance.normaliser.normalise(loss_now)
                    turn_reward += ri  # added before advantage estimation
                    for i in range(p.n_envs):
                        (ri_novel if novel[i] else ri_revisit).append(ri_raw[i])
                buf["ri_raw"].append(ri_raw), buf["ri"].append(ri)
            for key, value in (("frames", frames), ("next", next_t), ("tokens", tokens), ("logp", logp),
                               ("values", values), ("reward", torch.tensor(turn_reward, dtype=torch.float32)),
                               ("done", torch.tensor(done, dtype=torch.float32)), ("actions", action_index)):
                buf[key].append(value)
        with torch.no_grad():
            frames = torch.tensor(envs.frames)
            last_value = model.generate(frames, generator=rng)[2][:, -1] if spec.cot else model(frames)[1]
            last_int = None if spec.cot else model(frames)[2]
        batch = {k: torch.stack(v) for k, v in buf.items() if v and k not in ("ri_raw", "ri")}
        if rnd is not None:
            rnd.update_stats(batch["next"].flatten(0, 1))
        if spec.cot:
            advantages = bilevel_gae(batch["reward"], batch["values"], batch["done"], last_value,
                                     p.gamma_turn, p.gamma_token, p.gae_lambda)
        else:
            advantages = gae(batch["reward"], batch["values"][..., 0], batch["done"], last_value,
                             p.gamma_turn, p.gae_lambda)[..., None]
        returns = advantages + batch["values"]
        if rnd is not None:  # two value heads; the intrinsic stream is non-episodic (RND)
            adv_int = gae(batch["ri_rnd"], batch["values_int"], torch.zeros_like(batch["done"]), last_int,
                          cfg.glance.gamma_int, p.gae_lambda)
            returns_int = (adv_int + batch["values_int"]).flatten(0, 1)
            advantages = 2.0 * advantages + 1.0 * adv_int[..., None]  # ext_coef 2, int_coef 1
        flat = {k: v.flatten(0, 1) for k, v in batch.items()}
        adv, ret = advantages.flatten(0, 1), returns.flatten(0, 1)
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)  # whitened over generated tokens
        stats = {"policy_entropy": [], "value_loss": [], "explore_loss": []}
        n = adv.shape[0]
        for _ in range(p.epochs):
            for idx in torch.randperm(n, generator=rng).split(max(1, n // p.minibatches)):
                logged = ppo_minibatch(model, optimiser, spec, p, {k: v[idx] for k, v in flat.items()}, adv[idx],
                                       ret[idx], glance, rnd, returns_int[idx] if rnd is not None else None, rng)
                for key, value in logged.items():
                    stats[key].append(float(value))
        elapsed = time.perf_counter() - start
        metrics = {"policy_entropy": np.mean(stats["policy_entropy"]), "value_loss": np.mean(stats["value_loss"]),
                   "coverage": envs.coverage(), "sps": p.n_envs * p.rollout / elapsed}
        if finished:  # the sampled training episodes that ended in this update
            metrics["episode_return"] = float(np.mean(finished))
            metrics["success_rate"] = float(np.mean(finished_success))
        if spec.cot:
            metrics["obs_slot_acc"] = float(batch["obs_acc"].mean())
            metrics["pred_slot_acc"] = float(batch["pred_acc"].mean())
        if rnd is not None:
            metrics["intrinsic_reward_raw"] = float(np.mean(buf["ri_raw"]))
            metrics["intrinsic_reward_norm"] = float(batch["ri_rnd"].mean())
        if glance is not None and glance.active:
            metrics["explore_loss"] = float(np.mean(stats["explore_loss"]))
            metrics["intrinsic_reward_raw"] = float(np.mean(buf["ri_raw"]))
            metrics["intrinsic_reward_norm"] = float(np.mean(buf["ri"]))
            metrics["projector_reset"] = float(reset)
        rows += [{"metric": k, "value": float(v), "variant": arm, "step": steps, "seed": seed, **tags}
                 for k, v in metrics.items()]
        if progress is not None:
            progress(p.n_envs * p.rollout)
    budget = updates * p.n_envs * p.rollout
    final = {"steps_to_first_success": first_success if first_success is not None else budget,
             "first_success_found": float(first_success is not None), "coverage": envs.coverage()}
    if ri_novel and ri_revisit:
        final["ri_novel_over_revisit"] = float(np.mean(ri_novel) / max(np.mean(ri_revisit), 1e-12))
    rows += [{"metric": k, "value": float(v), "variant": arm, "step": steps, "seed": seed,
              "experiment": "final", **tags} for k, v in final.items()]
    state = {"model": cpu_state(model)}
    if glance is not None:
        state["glance"] = cpu_state(glance.head)
    return rows, state, envs.visits


def ppo_minibatch(model, optimiser, spec: ArmSpec, p, mb: dict, a: torch.Tensor, ret: torch.Tensor,
                  glance: Glance | None = None, rnd: RND | None = None, returns_int: torch.Tensor | None = None,
                  rng: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """One PPO minibatch step on the rollout rows `mb` (frames, tokens, logp, actions, next, …), their
    whitened advantages `a` and returns `ret`: the clipped policy loss, the value loss and the entropy bonus
    (RND's predictor and intrinsic value for ppo_rnd); for an active GLANCE arm the alignment gradients at the
    same weights, applied after the policy's step by the alignment optimiser. With `p.micro_batch` > 0 the rows
    go through forward and backward that many at a time, each part's losses weighted by its share of the rows
    (the minibatch's means), gradients accumulated before the one step. Returns what the update logs (detached:
    explore_loss, policy_entropy, value_loss)."""
    rows = len(a)
    size = p.micro_batch if 0 < p.micro_batch < rows else rows
    optimiser.zero_grad()  # first: the last minibatch's gradients are not held through this forward
    logged, align_grads = {}, None
    for start in range(0, rows, size):
        part = slice(start, min(rows, start + size))
        share = (part.stop - part.start) / rows
        loss, align, entropy, value_loss = _ppo_losses(
            model, spec, p, {k: v[part] for k, v in mb.items()}, a[part], ret[part], glance, rnd,
            returns_int[part] if returns_int is not None else None, rng)
        if align is not None:  # both gradients at the same weights: no step before the last part
            grads = glance.gradients(align * share if share < 1 else align)
            align_grads = grads if align_grads is None else tuple(
                g if total is None else total if g is None else total.add_(g) for total, g in zip(align_grads, grads))
        (loss * share if share < 1 else loss).backward()
        for key, value in (("explore_loss", align), ("policy_entropy", entropy), ("value_loss", value_loss)):
            if value is not None:
                value = value.detach() * share
                logged[key] = value if key not in logged else logged[key] + value
    nn.utils.clip_grad_norm_(model.parameters(), p.max_grad_norm)
    optimiser.step()
    if align_grads is not None:
        glance.step(align_grads)  # own optimiser and parameters, then the EMA of φ
    return logged


def _ppo_losses(model, spec: ArmSpec, p, mb: dict, a, ret, glance, rnd, returns_int, rng):
    """(PPO loss, L_explore or None, entropy, value loss), each a mean over the rows of `mb`."""
    if spec.cot:
        logits, values, hidden = model.forward_turn(mb["frames"], mb["tokens"])
        dist = torch.distributions.Categorical(logits=logits)
        new_logp = dist.log_prob(mb["tokens"][:, SAMPLED])
        entropy = dist.entropy()
    else:
        logits, value, value_int = model(mb["frames"])
        dist = torch.distributions.Categorical(logits=logits)
        new_logp, values = dist.log_prob(mb["actions"])[:, None], value[:, None]
        entropy = dist.entropy()[:, None]
    ratio = (new_logp - mb["logp"]).exp()
    policy_loss = -torch.min(ratio * a, ratio.clamp(1 - p.clip, 1 + p.clip) * a).mean()
    value_loss = (values - ret).pow(2).mean()
    loss = policy_loss + p.vf_coef * value_loss - p.ent_coef * entropy.mean()
    if rnd is not None:
        errors = rnd.error(mb["next"])
        keep = (torch.rand(len(a), generator=rng) < 0.25).float()  # predictor on 25% of samples
        loss = loss + p.vf_coef * (value_int - returns_int).pow(2).mean() \
            + (errors * keep).sum() / keep.sum().clamp(min=1)
    align = None
    if glance is not None and glance.active:
        align = glance.loss(hidden, mb["next"], mb["frames"], mb["actions"]).mean()
    return loss, align, entropy.mean(), value_loss


def _greedy_transitions(cfg, model: CoTAgent, n: int, env_seed: int):
    """n first transitions of fresh episodes under the greedy policy -> frames, tokens, actions, next frames."""
    envs = GridEnvs(cfg.env.id, n, env_seed, cfg.env.actions, cfg.env.tile_size, cfg.env.max_steps)
    frames = torch.tensor(envs.frames)
    with torch.no_grad():
        tokens = model.generate(frames, greedy=True)[0]
    actions = torch.tensor([model.action_ids.index(int(t)) for t in tokens[:, ACT_POS]])
    return frames, tokens, actions, torch.tensor(envs.step(actions.numpy())[4])


def revisit_probe(cfg, spec: ArmSpec, model: CoTAgent, state: dict, seed: int, repeats: int = 20,
                  n_fresh: int = 16) -> dict:
    """One stored transition replayed `repeats` times through the head, each replay followed by an
    alignment step (on a copy of the agent). `probe_ri_decay`: its r^i after the last repeat ÷ at the
    first (a working curiosity decays); `probe_fresh_ri_decay`: the mean r^i of `n_fresh` transitions
    never trained on, after ÷ before the probe (near 1: the decay is specific to the revisited state,
    not a collapse of the whole signal)."""
    model = copy.deepcopy(model)  # the probe's updates must not leak into the evaluated agent
    glance = Glance(model, spec, cfg, seed)
    glance.head.load_state_dict(state["glance"])
    frames, tokens, action, next_frames = _greedy_transitions(cfg, model, 1, 2 * 10**9 + seed)
    fresh = _greedy_transitions(cfg, model, n_fresh, 3 * 10**9 + seed)

    def fresh_ri() -> float:
        with torch.no_grad():
            f, t, a, nxt = fresh
            return spec.beta * float(glance.loss(model.forward_turn(f, t)[2], nxt, f, a).mean())

    fresh_before = fresh_ri()
    rewards = []
    for _ in range(repeats):
        loss = glance.loss(model.forward_turn(frames, tokens)[2], next_frames, frames, action).mean()
        rewards.append(spec.beta * float(loss.detach()))
        glance.align(loss)
    return {"probe_ri_decay": rewards[-1] / max(rewards[0], 1e-12),
            "probe_fresh_ri_decay": fresh_ri() / max(fresh_before, 1e-12)}


def evaluate_arm(cfg, arm: str, seed: int, state: dict, device: str = "cpu") -> list[dict]:
    """Greedy evaluation on env seeds disjoint from training: success, return, slot accuracy."""
    spec = arm_spec(arm, cfg)
    model = new_agent(cfg, device) if spec.cot else PixelActorCritic(cfg.model.d_model, n_actions(cfg))
    model.load_state_dict(state["model"])
    n = min(cfg.eval_episodes, 16)
    envs = GridEnvs(cfg.env.id, n, 10**9 + seed * 10_000, cfg.env.actions, cfg.env.tile_size, cfg.env.max_steps)
    returns, successes, obs_acc, pred_acc, late_acc = [], [], [], [], []
    running = np.zeros(n)
    active = np.ones(n, bool)
    started = n
    with torch.no_grad():
        while len(returns) < cfg.eval_episodes:
            frames, slots_t = torch.tensor(envs.frames), torch.tensor(envs.slots)
            late = envs.past_door() & active  # turns taken in the goal room, behind the door
            if spec.cot:
                tokens = model.generate(frames, greedy=True)[0]
                action = np.array([model.action_ids.index(int(t)) for t in tokens[:, ACT_POS]])
            else:
                action = model(frames)[0].argmax(-1).numpy()
            reward, done, success, _, _, next_slots = envs.step(action)
            if spec.cot:
                obs_acc += slot_accuracy(tokens, slots_t, OBS_POS)[active].tolist()
                accuracy = slot_accuracy(tokens, torch.tensor(next_slots), PRED_POS)
                pred_acc += accuracy[active].tolist()
                late_acc += accuracy[late].tolist()
            running += reward
            for i in np.flatnonzero(done & active):
                returns.append(running[i]), successes.append(float(success[i]))
                running[i] = 0.0
                if started >= cfg.eval_episodes:
                    active[i] = False
                started += 1
    tags = _tag(cfg, spec)
    metrics = {"success_rate": np.mean(successes), "mean_return": np.mean(returns)}
    if spec.cot:
        metrics.update(obs_slot_acc=np.mean(obs_acc), pred_slot_acc=np.mean(pred_acc))
        if late_acc:  # only where the agent got past the door in some eval episode
            metrics["pred_slot_acc_late"] = np.mean(late_acc)
    if spec.cot and spec.beta > 0 and "glance" in state:
        metrics.update(revisit_probe(cfg, spec, model, state, seed))
    return [{"metric": k, "value": float(v), "variant": arm, "seed": seed, **tags} for k, v in metrics.items()]
