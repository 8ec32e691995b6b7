"""E4 of belief-filter: RingWorld-lite, the seven feature arms, PPO with resumable checkpoints."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from icml.methods.belief_filter.agents import (
    FeatureModule, alf_delta, build_agent, memory_inputs)
from icml.methods.belief_filter.config import ARMS, preset
from icml.methods.belief_filter.filters import argmax_random_ties
from icml.methods.belief_filter.ppo import collect_episodes, evaluate_arm, train_arm
from icml.methods.belief_filter.ringworld import (
    ACTION_SHIFTS, N_ACTIONS, NO_ACTION, RingWorld, build_model, label_to_index)



def small_config(arms=None, total_steps=1500):
    cfg = preset("smoke")
    cfg.ppo.total_steps = total_steps
    cfg.ppo.n_envs = 16
    cfg.ppo.rollout_min_steps = 8
    cfg.ppo.checkpoint_every = 2
    cfg.ppo.eval_episodes = 100
    return cfg


def model_for(slip="stay", eps=0.05, kappa=2.0):
    cfg = preset("smoke")
    cfg.env.slip, cfg.env.eps, cfg.env.kappa = slip, eps, kappa
    return build_model(cfg.env)


def random_rollout(model, n_envs, steps, seed):
    """Random actions in a fresh env; returns obs (steps+1, B), prev actions, positions."""
    gen = torch.Generator().manual_seed(seed)
    env = RingWorld(model, n_envs, episode_len=10_000, generator=gen)
    obs, prev, pos = [env.reset()], [torch.full((n_envs,), NO_ACTION)], [env.position.clone()]
    for _ in range(steps):
        action = torch.randint(N_ACTIONS, (n_envs,), generator=gen)
        o, *_ = env.step(action)
        obs.append(o), prev.append(action), pos.append(env.position.clone())
    return torch.stack(obs), torch.stack(prev), torch.stack(pos)


# --- environment ---------------------------------------------------------------------------

@pytest.mark.parametrize("slip", ["stay", "uniform"])
def test_model_matrices_are_column_stochastic_with_the_right_structure(slip):
    m = model_for(slip)
    n = m.n_positions
    assert torch.allclose(m.T.sum(dim=1), torch.ones(N_ACTIONS + 1, n, dtype=torch.float64), atol=1e-15)
    assert torch.allclose(m.E.sum(dim=0), torch.ones(n, dtype=torch.float64), atol=1e-15)
    assert torch.equal(m.T[NO_ACTION], torch.eye(n, dtype=torch.float64))
    slip_target = torch.eye(n) if slip == "stay" else torch.full((n, n), 1 / n)
    for a, shift in enumerate(ACTION_SHIFTS):
        for j in range(n):  # column j of P(a) sends position j to j + shift
            assert m.P[a, (j + shift) % n, j] == 1 and m.P[a, :, j].sum() == 1
        assert torch.allclose(m.T[a], 0.95 * m.P[a] + 0.05 * slip_target.double(), atol=1e-15)
    # beacon law: P(o=j|s) ∝ exp(κ cos(θ_s − jπ/2)), with θ of label s equal to 2π(s−1)/12
    s_label, j = 5, 2
    theta = 2 * math.pi * (s_label - 1) / 12
    weights = [math.exp(2.0 * math.cos(theta - k * math.pi / 2)) for k in range(4)]
    assert m.E[j, label_to_index(s_label)].item() == pytest.approx(weights[j] / sum(weights), rel=1e-12)
    # the beacon at angle jπ/2 is the likeliest one at labels 1, 4, 7, 10
    for beacon, label in enumerate((1, 4, 7, 10)):
        assert int(m.E[:, label_to_index(label)].argmax()) == beacon


@pytest.mark.parametrize("slip", ["stay", "uniform"])
def test_simulator_matches_the_matrices(slip):
    """Empirical transition and emission frequencies from 20,000 draws per column lie
    within 5 binomial standard deviations of T(a) and E."""
    m = model_for(slip)
    n, per_column = m.n_positions, 20_000
    gen = torch.Generator().manual_seed(1)
    starts = torch.arange(n).repeat_interleave(per_column)
    env = RingWorld(m, n * per_column, episode_len=100, generator=gen)
    for a in range(N_ACTIONS):
        env.position = starts.clone()
        obs, *_ = env.step(torch.full_like(starts, a))
        moved = torch.zeros(n, n, dtype=torch.float64)
        moved.index_put_((env.position, starts), torch.ones(len(starts), dtype=torch.float64), accumulate=True)
        empirical = moved / per_column
        tol = 5 * torch.sqrt(m.T[a] * (1 - m.T[a]) / per_column) + 1e-12
        assert ((empirical - m.T[a]).abs() <= tol).all(), f"action {a}"
        # the emission after a move is drawn from the column of the *new* position
        seen = torch.zeros(m.n_obs, n, dtype=torch.float64)
        seen.index_put_((obs, env.position), torch.ones(len(obs), dtype=torch.float64), accumulate=True)
        visits = seen.sum(0, keepdim=True)
        E_tol = 5 * torch.sqrt(m.E * (1 - m.E) / visits) + 1e-12
        assert ((seen / visits - m.E).abs() <= E_tol).all()


def test_rewards_terminals_and_start_use_labels_not_indices():
    m = model_for()
    goal = {s + 1 for s in torch.nonzero(m.goal).flatten().tolist()}
    trap = {s + 1 for s in torch.nonzero(m.trap).flatten().tolist()}
    assert goal == {2, 3} and trap == {6, 11, 12}
    starts = {s + 1 for s in torch.nonzero(m.pi0).flatten().tolist()}
    assert starts == {1, 4, 5, 7, 8, 9, 10}
    assert torch.allclose(m.pi0[m.pi0 > 0], torch.full((7,), 1 / 7, dtype=torch.float64))

    no_slip = model_for(eps=0.0)
    gen = torch.Generator().manual_seed(0)
    env = RingWorld(no_slip, 4, episode_len=6, generator=gen)
    env.reset()
    # label 1 +CW1 -> 2 (goal); label 5 +CW1 -> 6 (trap); label 1 +CCW2 -> 11 (trap); label 4 +CW1 -> 5
    env.position = torch.tensor([label_to_index(s) for s in (1, 5, 1, 4)])
    _, reward, done, terminal = env.step(torch.tensor([0, 0, 3, 0]))
    assert (env.position + 1).tolist() == [2, 6, 11, 5]
    assert reward.tolist() == [1.0, -1.0, -1.0, 0.0]
    assert done.tolist() == [True, True, True, False] and terminal.tolist() == done.tolist()

    # the length cap: shuttling 8 <-> 9 never terminates and is cut after episode_len actions
    env.reset()
    env.position = torch.full((4,), label_to_index(8))
    for k in range(6):
        _, reward, done, terminal = env.step(torch.full((4,), 0 if k % 2 == 0 else 2))
        assert not terminal.any() and (reward == 0).all()
        assert done.all() == (k == 5)

    # a reset draws only non-terminal starts
    big = RingWorld(m, 5000, episode_len=50, generator=gen)
    big.reset()
    assert not m.terminal[big.position].any()
    assert set((big.position + 1).unique().tolist()) == starts


# --- features --------------------------------------------------------------------------------

def build(arm, cfg=None, seed=0):
    cfg = cfg or preset("smoke")
    torch.manual_seed(seed)
    return build_agent(cfg, arm, build_model(cfg.env))


@pytest.mark.parametrize("slip", ["stay", "uniform"])
def test_lof_features_equal_a_probability_space_bayes_filter(slip):
    cfg = preset("smoke")
    cfg.env.slip = slip
    m = build_model(cfg.env)
    obs, prev, _ = random_rollout(m, n_envs=32, steps=60, seed=3)
    T, E, pi0 = m.T.numpy(), m.E.numpy(), m.pi0.numpy()
    belief_arm, logit_arm = build("lof_belief", cfg).memory, build("lof_logits", cfg).memory
    sb, sl = belief_arm.initial_state(32), logit_arm.initial_state(32)
    belief = None
    for k in range(obs.shape[0]):
        o, a = obs[k].numpy(), prev[k].numpy()
        # b_k ∝ diag(E^T y_k) T(a_k) b_{k-1}, with b_{-1} = π0 and T(NO_ACTION) = I
        predicted = pi0[None, :].repeat(32, 0) if k == 0 else np.einsum("bij,bj->bi", T[a], belief)
        belief = E[o] * predicted
        belief /= belief.sum(1, keepdims=True)
        sb, feat_b = belief_arm.step(sb, obs[k], prev[k])
        sl, feat_l = logit_arm.step(sl, obs[k], prev[k])
        np.testing.assert_allclose(feat_b.numpy(), belief, rtol=1e-10, atol=1e-13)
        with np.errstate(divide="ignore"):
            np.testing.assert_allclose(feat_l.numpy(), np.maximum(np.log(belief), -20.0), rtol=1e-9, atol=1e-10)
    assert feat_l.max() <= 0 and feat_l.min() >= -20.0  # log-beliefs, clipped at -20


def test_alf_features_follow_the_leaky_recursion_and_deep_alf_starts_as_alf():
    cfg = preset("smoke")
    m = build_model(cfg.env)
    delta = alf_delta(cfg.env.eps, cfg.ppo.alf_lambda)
    assert delta == pytest.approx(0.7 / math.log(20.0))
    obs, prev, _ = random_rollout(m, n_envs=16, steps=40, seed=5)
    alf, deep = build("alf", cfg).memory, build("deep_alf", cfg).memory
    assert deep.delta.item() == pytest.approx(delta, rel=1e-14)
    P, log_E = m.P.numpy(), np.log(m.E.numpy())
    w = np.zeros((16, 12))
    sa, sd = alf.initial_state(16), deep.initial_state(16)
    alf_features = []
    for k in range(obs.shape[0]):
        w = (1 - delta) * np.einsum("bij,bj->bi", P[prev[k].numpy()], w) + delta * log_E[obs[k].numpy()]
        sa, fa = alf.step(sa, obs[k], prev[k])
        sd, fd = deep.step(sd, obs[k], prev[k])
        np.testing.assert_allclose(fa.numpy(), w, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(fd.detach().numpy(), fa.numpy(), rtol=1e-12, atol=1e-13)
        alf_features.append(fa)
    # the closed-form sequence used for BPTT agrees as well
    np.testing.assert_allclose(deep.sequence(obs, prev).detach().numpy(),
                               torch.stack(alf_features).numpy(), rtol=1e-11, atol=1e-12)


def test_exact_belief_decodes_positions_better_than_the_alf_and_chance():
    """The Bayes MAP decoder minimises the decoding error; along 40,000 decisions of
    random-action rollouts the ALF's argmax is worse, and both beat chance (11/12)."""
    cfg = preset("smoke")
    obs, prev, position = random_rollout(build_model(cfg.env), n_envs=2000, steps=19, seed=4)
    errors = {}
    for arm in ("lof_belief", "alf"):
        features = build(arm, cfg).memory.sequence(obs, prev)
        errors[arm] = (argmax_random_ties(features) != position).double().mean().item()
    assert errors["lof_belief"] < errors["alf"] - 0.02 and errors["alf"] < 11 / 12 - 0.1


@pytest.mark.parametrize("arm", ["deep_alf", "diag_lrnn", "gru"])
def test_learned_memories_sequence_equals_iterated_steps(arm):
    memory = build(arm, seed=7).memory
    with torch.no_grad():  # move away from the initialisation
        for p in memory.parameters():
            p.add_(0.3 * torch.randn_like(p))
    obs, prev, _ = random_rollout(build_model(preset("smoke").env), n_envs=8, steps=30, seed=2)
    reference = FeatureModule.sequence(memory, obs, prev)  # the reference: iterate `step`
    np.testing.assert_allclose(memory.sequence(obs, prev).detach().numpy(),
                               reference.detach().numpy(), rtol=1e-10, atol=1e-12)


def test_diag_lrnn_eigenvalues_stay_inside_the_unit_circle():
    lrnn = build("diag_lrnn").memory
    assert (lrnn.eigenvalues().abs() < 1).all()
    with torch.no_grad():
        lrnn.nu.copy_(torch.linspace(-60.0, 5.0, lrnn.hidden, dtype=torch.float64))
    modulus = lrnn.eigenvalues().abs()
    assert (modulus < 1).all() and (modulus > 0).all()
    assert lrnn.feature_dim == 2 * lrnn.hidden


def test_memory_inputs_are_one_hot_obs_and_previous_action():
    x = memory_inputs(torch.tensor([2, 0]), torch.tensor([NO_ACTION, 1]), n_obs=4)
    assert x.tolist() == [[0, 0, 1, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 1, 0, 0]]


def test_filter_arms_have_no_parameters_and_learned_memories_do():
    for arm in ARMS:
        memory = build(arm).memory
        n_params = sum(p.numel() for p in memory.parameters())
        assert (n_params > 0) == (arm in ("deep_alf", "diag_lrnn", "gru")), arm


# --- PPO -------------------------------------------------------------------------------------

def test_rollouts_pack_complete_episodes():
    cfg = small_config()
    m = build_model(cfg.env)
    agent = build("gru", cfg)
    gen = torch.Generator().manual_seed(0)
    batch = collect_episodes(agent, RingWorld(m, 16, 50, gen), min_steps=8, generator=gen)
    n_episodes = batch.length.numel()
    assert n_episodes >= 16 and batch.mask.sum() == batch.length.sum()
    assert (batch.prev_action[0] == NO_ACTION).all()  # every episode starts at a reset
    last = batch.length - 1
    rewards_at_end = batch.reward[last, torch.arange(n_episodes)]
    assert torch.equal(rewards_at_end, batch.episode_return)  # reward only on the final step
    assert torch.equal(batch.goal | batch.trap, batch.episode_return != 0)
    assert ((batch.length == 50) | batch.goal | batch.trap).all()
    # features stored at rollout time are those a replay from the reset produces
    replay = agent.memory.sequence(batch.obs, batch.prev_action)
    np.testing.assert_allclose(replay[batch.mask].detach().numpy(),
                               batch.features[batch.mask].numpy(), rtol=1e-10, atol=1e-12)


class Interrupt(Exception):
    pass


@pytest.mark.parametrize("arm", ["gru", "alf"])
def test_resume_from_a_checkpoint_continues_bit_identically(arm, tmp_path):
    cfg = small_config()
    uninterrupted = train_arm(cfg, arm, 3, tmp_path / "full.pt")
    assert len(uninterrupted) >= 6
    full_state = torch.load(tmp_path / "full.pt", weights_only=False)

    updates = []

    def crash_after_five(n_steps):
        updates.append(n_steps)
        if len(updates) == 5:  # checkpoints are written at updates 2 and 4
            raise Interrupt

    with pytest.raises(Interrupt):
        train_arm(cfg, arm, 3, tmp_path / "resumed.pt", progress=crash_after_five)
    partial = torch.load(tmp_path / "resumed.pt", weights_only=False)
    assert not partial["done"] and len(partial["curve"]) == 4
    resumed = train_arm(cfg, arm, 3, tmp_path / "resumed.pt")
    assert resumed == uninterrupted
    resumed_state = torch.load(tmp_path / "resumed.pt", weights_only=False)
    for key, value in full_state["model"].items():
        assert torch.equal(value, resumed_state["model"][key]), key
    # a finished checkpoint is returned as it is, without training
    assert train_arm(cfg, arm, 3, tmp_path / "resumed.pt", progress=crash_after_five) == uninterrupted


def test_same_seed_same_results_and_no_global_rng_leak(tmp_path):
    cfg = small_config(total_steps=800)
    global_state = torch.get_rng_state()
    curve_a = train_arm(cfg, "diag_lrnn", 1, tmp_path / "a.pt")
    train_arm(cfg, "deep_alf", 1, tmp_path / "other.pt")  # another arm in between
    curve_b = train_arm(cfg, "diag_lrnn", 1, tmp_path / "b.pt")
    assert curve_a == curve_b
    assert torch.equal(torch.get_rng_state(), global_state)
    eval_a = evaluate_arm(cfg, "diag_lrnn", 1, tmp_path / "a.pt")
    eval_b = evaluate_arm(cfg, "diag_lrnn", 1, tmp_path / "b.pt")
    assert eval_a == eval_b
    assert evaluate_arm(cfg, "diag_lrnn", 1, tmp_path / "a.pt", eval_seed=99) != eval_a
    assert train_arm(cfg, "diag_lrnn", 2, tmp_path / "c.pt") != curve_a


def test_row_contract(tmp_path):
    cfg = small_config(total_steps=600)
    for arm in ("lof_logits", "gru"):
        curve = train_arm(cfg, arm, 0, tmp_path / f"{arm}.pt")
        rows = evaluate_arm(cfg, arm, 0, tmp_path / f"{arm}.pt")
        steps = [r["step"] for r in curve]
        assert steps == sorted(steps) and steps[-1] >= cfg.ppo.total_steps
        assert all(r["metric"] == "episode_return" and r["split"] == "train" for r in curve)
        metrics = {r["metric"]: r["value"] for r in rows}
        expected = {"final_return", "success_rate", "trap_rate", "return_auc"}
        if arm == "lof_logits":
            expected.add("feature_decode_error")
        assert set(metrics) == expected
        assert metrics["return_auc"] == pytest.approx(np.mean([r["value"] for r in curve]))
        assert metrics["final_return"] == pytest.approx(metrics["success_rate"] - metrics["trap_rate"])
        for row in curve + rows:
            assert row["experiment"] == "e4" and row["variant"] == arm and row["seed"] == 0
            assert isinstance(row["value"], float) and isinstance(row["step"], int)
            assert ("hidden" in row) == (arm == "gru")
        assert {r["split"] for r in rows} == {"test"} and rows[0]["step"] == steps[-1]


def test_ppo_learns_beyond_the_initial_uniform_policy(tmp_path):
    """3000 steps lift the return from the near-uniform start (≈ −0.5: random moves hit a
    trap more often than a goal) to above 0.  When written, this setting gave final
    returns of 0.05–0.24 over seeds 0–4 for `alf` and `lof_logits`.  A stronger claim,
    such as `lof_belief` beating `obs_only` in a short run, is not reliable at κ = 2
    (see NOTES_e4.md) and is not tested."""
    cfg = small_config(total_steps=3000)
    curve = train_arm(cfg, "alf", 0, tmp_path / "alf.pt")
    metrics = {r["metric"]: r["value"] for r in evaluate_arm(cfg, "alf", 0, tmp_path / "alf.pt")}
    assert curve[0]["value"] < -0.3
    assert metrics["final_return"] > 0.0


def test_gae_limits_are_td_error_and_discounted_return():
    """λ = 0: one-step TD errors; λ = 1: discounted return-to-go minus V (V = 0 past the end)."""
    from icml.methods.belief_filter.ppo import gae

    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([5, 2, 7])
    horizon, gamma = 7, 0.9
    mask = torch.arange(horizon)[:, None] < lengths[None, :]
    reward = torch.randn(horizon, 3, generator=gen, dtype=torch.float64) * mask
    value = torch.randn(horizon, 3, generator=gen, dtype=torch.float64) * mask
    next_value = torch.cat([value[1:], torch.zeros(1, 3, dtype=torch.float64)]) * \
        torch.cat([mask[1:], torch.zeros(1, 3, dtype=torch.bool)])
    td0, _ = gae(reward, value, mask, gamma, 0.0)
    torch.testing.assert_close(td0, (reward + gamma * next_value - value) * mask, rtol=0, atol=1e-12)
    td1, returns = gae(reward, value, mask, gamma, 1.0)
    for n, length in enumerate(lengths.tolist()):
        for k in range(length):
            to_go = sum(gamma ** (j - k) * reward[j, n].item() for j in range(k, length))
            assert td1[k, n].item() == pytest.approx(to_go - value[k, n].item(), abs=1e-12)
            assert returns[k, n].item() == pytest.approx(to_go, abs=1e-12)
    assert (td1[~mask] == 0).all()
