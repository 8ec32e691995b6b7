"""`icml curious-agent`: the GLANCE identities (EMA target, gradient routing, 2 − 2cos loss,
projector reset, β = 0 ≡ vagen_lite), Bi-Level GAE's limiting case, KV-cached decoding and the describer."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from icml.methods.curious_agent.config import preset
from icml.methods.curious_agent.env import CELLS, DOOR, GOAL, describe
from icml.methods.curious_agent.model import CLOSE_PRED, SAMPLED, CoTAgent, explore_loss
from icml.methods.curious_agent.ppo import Glance, arm_spec, bilevel_gae, gae, train_arm

EPS64 = torch.finfo(torch.float64).eps
EPS32 = torch.finfo(torch.float32).eps


def tiny_cfg():
    cfg = preset("smoke")
    cfg.ppo.total_steps, cfg.ppo.n_envs, cfg.ppo.rollout, cfg.ppo.epochs = 32, 2, 8, 1
    cfg.env.max_steps = 10
    return cfg


def agent_and_glance(arm="glance", seed=0):
    cfg = tiny_cfg()
    torch.manual_seed(seed)
    agent = CoTAgent()
    return cfg, agent, Glance(agent, arm_spec(arm, cfg), cfg, seed)


def turn_batch(agent, n=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    frames, next_frames = torch.rand(n, 3, 28, 28, generator=g), torch.rand(n, 3, 28, 28, generator=g)
    tokens = agent.generate(frames, generator=g)[0]
    return frames, next_frames, tokens


def snapshot(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_explore_loss_is_two_minus_two_cosine():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(50, 64, generator=g, dtype=torch.float64), torch.randn(50, 64, generator=g, dtype=torch.float64)
    # a handful of roundings in the normalisation and a 64-term sum: 16 eps bounds the gap
    torch.testing.assert_close(explore_loss(a, b), 2 - 2 * F.cosine_similarity(a, b, dim=-1), atol=16 * EPS64, rtol=0)
    assert torch.allclose(explore_loss(3.0 * a, 0.5 * b), explore_loss(a, b), atol=16 * EPS64, rtol=0)  # scale-free
    assert explore_loss(a, -a).sub(4).abs().max() < 16 * EPS64 and explore_loss(a, a).abs().max() < 16 * EPS64
    a.requires_grad_(True), b.requires_grad_(True)
    explore_loss(a, b).sum().backward()
    assert b.grad is None and a.grad.abs().sum() > 0  # y is a stop-gradient target


def test_ema_update_is_exact_and_target_frozen():
    cfg, agent, glance = agent_and_glance()
    target = glance.head.target
    assert all(not p.requires_grad for p in target.parameters())
    for phi, v in zip(target.parameters(), agent.vision.parameters()):
        assert torch.equal(phi, v)  # φ starts at v
    before, online_before = snapshot(target), snapshot(agent.vision)
    frames, next_frames, tokens = turn_batch(agent)
    hidden = agent.forward_turn(frames, tokens)[2]
    glance.align(glance.loss(hidden, next_frames).mean())
    online = snapshot(agent.vision)
    alpha = cfg.glance.ema_alpha
    for name, phi in snapshot(target).items():
        assert not torch.equal(online[name], online_before[name])  # f_v learned
        expected = alpha * before[name] + (1 - alpha) * online[name]
        # mul then add in float32 vs the fused reference: at most one rounding each, 2 ulp of the size
        torch.testing.assert_close(phi, expected, atol=2 * EPS32 * expected.abs().max().item(), rtol=0)
        assert target.get_parameter(name).grad is None


def test_no_ema_target_tracks_the_online_encoder_exactly():
    _, agent, glance = agent_and_glance("glance_no_ema")
    frames, next_frames, tokens = turn_batch(agent)
    glance.align(glance.loss(agent.forward_turn(frames, tokens)[2], next_frames).mean())
    for phi, v in zip(glance.head.target.parameters(), agent.vision.parameters()):
        assert torch.equal(phi, v)  # α = 0: 0·φ + 1·v is exact


def test_curiosity_loss_leaves_language_model_bit_identical():
    _, agent, glance = agent_and_glance()
    lm_before, vision_before, proj_before = (snapshot(m) for m in (agent.lm, agent.vision, glance.head.projector))
    embed_before, head_before = snapshot(agent.embed), snapshot(agent.lm_head)
    frames, next_frames, tokens = turn_batch(agent)
    glance.align(glance.loss(agent.forward_turn(frames, tokens)[2], next_frames).mean())
    for before, module in ((lm_before, agent.lm), (embed_before, agent.embed), (head_before, agent.lm_head)):
        for name, value in module.state_dict().items():
            assert torch.equal(value, before[name]), name
    assert all(p.grad is None for p in agent.language_parameters())
    assert any(not torch.equal(v, vision_before[k]) for k, v in agent.vision.state_dict().items())
    assert any(not torch.equal(v, proj_before[k]) for k, v in glance.head.projector.state_dict().items())
    # the routing ablation does move Λ_ℓ: the check above can fail
    _, agent2, glance2 = agent_and_glance("glance_lm_grad")
    lm2 = snapshot(agent2.lm)
    glance2.align(glance2.loss(agent2.forward_turn(frames, tokens)[2], next_frames).mean())
    assert any(not torch.equal(v, lm2[k]) for k, v in agent2.lm.state_dict().items())


def test_loss_reaches_the_vision_encoder_through_the_language_model():
    _, agent, glance = agent_and_glance()
    frames, next_frames, tokens = turn_batch(agent)
    grads = glance.gradients(glance.loss(agent.forward_turn(frames, tokens)[2], next_frames).mean())
    n_vision = len(list(agent.vision.parameters()))
    assert all(g is not None and g.abs().sum() > 0 for g in grads[:n_vision])


def test_reset_touches_only_the_projector_and_its_adam_moments():
    _, agent, glance = agent_and_glance()
    frames, next_frames, tokens = turn_batch(agent)
    glance.align(glance.loss(agent.forward_turn(frames, tokens)[2], next_frames).mean())
    kept = [snapshot(m) for m in (agent, glance.head.target)]
    projector = snapshot(glance.head.projector)
    normaliser = copy.deepcopy(glance.normaliser.__dict__)
    vision_state = {id(p): copy.deepcopy(glance.optimiser.state[p]) for p in agent.vision.parameters()}
    glance.reset_projector()
    for before, module in zip(kept, (agent, glance.head.target)):
        for name, value in module.state_dict().items():
            assert torch.equal(value, before[name]), name
    assert all(not torch.equal(v, projector[k]) for k, v in glance.head.projector.state_dict().items())
    assert all(p not in glance.optimiser.state for p in glance.head.projector.parameters())
    for p in agent.vision.parameters():
        assert torch.equal(glance.optimiser.state[p]["exp_avg"], vision_state[id(p)]["exp_avg"])
    assert np.array_equal(glance.normaliser.ret, normaliser["ret"]) and glance.normaliser.var == normaliser["var"]


def test_projector_resets_fall_inside_the_schedule_never_on_its_last_updates():
    """Spec: every K = 20 % of the updates. At the default's 16 updates K = 3.2: resets at the 20, 40,
    60 and 80 % points (before updates 4, 7, 11, 14), so the projector that eval probes trained for
    3 updates. Update 16 (100 %) is not interior: a reset there leaves it trained for one."""
    from icml.methods.curious_agent.ppo import reset_updates

    cfg = tiny_cfg()
    cfg.ppo.n_envs, cfg.ppo.rollout, cfg.ppo.total_steps = 1, 2, 32  # 16 updates, as the default preset
    rows = train_arm(cfg, "glance", 0, None)[0]
    resets = [r["step"] // 2 for r in rows if r["metric"] == "projector_reset" and r["value"] > 0]
    assert resets == [4, 7, 11, 14]
    for updates in (4, 8, 10, 16, 25, 100):
        for every in (0.1, 0.2, 0.25, 0.3, 0.4, 0.5):
            period = every * updates
            last = max(reset_updates(updates, every), default=1)
            assert updates - last + 1 >= int(period), (updates, every)  # updates the final projector trains
            if period >= 1:  # distinct points: one reset per interior multiple of K
                assert len(reset_updates(updates, every)) == round(1 / every) - 1, (updates, every)
    assert reset_updates(16, 0.0) == set() and reset_updates(16, 1.0) == set()


def test_projector_initialisation_and_reset_draw_nothing_from_the_policy_rng():
    from icml.methods.curious_agent.model import Projector

    torch.manual_seed(3)
    state = torch.get_rng_state()
    projector = Projector(64, torch.Generator().manual_seed(1))
    first = snapshot(projector)
    projector.reinitialise()
    assert torch.equal(torch.get_rng_state(), state)
    assert all(not torch.equal(v, first[k]) for k, v in projector.state_dict().items())  # a fresh draw
    again = Projector(64, torch.Generator().manual_seed(1))
    assert all(torch.equal(v, first[k]) for k, v in again.state_dict().items())  # from its seed alone


def test_beta_zero_reproduces_the_exploitation_only_agent():
    cfg = tiny_cfg()
    cfg.glance.reset_every = 0.5  # two updates: a projector reset falls before the second
    warm = CoTAgent().state_dict()
    vagen_rows, vagen_state, _ = train_arm(cfg, "vagen_lite", 5, warm)
    cfg.glance.beta = 0.0
    glance_rows, glance_state, _ = train_arm(cfg, "glance", 5, warm)
    values = lambda rows: [(r["metric"], r["step"], r["value"]) for r in rows if r["metric"] != "sps"]
    assert values(vagen_rows) == values(glance_rows)
    for name, value in vagen_state["model"].items():
        assert torch.equal(value, glance_state["model"][name]), name
    cfg.glance.beta = 0.1  # and β > 0 does change the run
    assert values(train_arm(cfg, "glance", 5, warm)[0]) != values(vagen_rows)


def test_beta_scales_the_normalised_intrinsic_reward():
    # one update: the rollout's actions come from the same weights and RNG whatever β, so the
    # turn losses are identical and only β's place relative to the normaliser shows
    cfg = tiny_cfg()
    cfg.ppo.total_steps = cfg.ppo.n_envs * cfg.ppo.rollout
    warm = CoTAgent().state_dict()
    metric = {}
    for beta in (0.1, 0.2):
        cfg.glance.beta = beta
        rows = train_arm(cfg, "glance", 3, warm)[0]
        metric[beta] = {r["metric"]: r["value"] for r in rows if r.get("step") == cfg.ppo.total_steps}
    assert metric[0.2]["intrinsic_reward_raw"] == pytest.approx(2 * metric[0.1]["intrinsic_reward_raw"], rel=1e-12)
    assert metric[0.2]["intrinsic_reward_norm"] == pytest.approx(2 * metric[0.1]["intrinsic_reward_norm"], rel=1e-12)


def test_bilevel_gae_with_unit_discounts_is_token_level_gae():
    g = torch.Generator().manual_seed(0)
    T, N, K = 7, 3, 13
    rewards = torch.randn(T, N, generator=g, dtype=torch.float64)
    values = torch.randn(T, N, K, generator=g, dtype=torch.float64)
    dones = (torch.rand(T, N, generator=g) < 0.3).double()
    last = torch.randn(N, generator=g, dtype=torch.float64)
    bilevel = bilevel_gae(rewards, values, dones, last, 1.0, 1.0, 1.0)
    # the flat token sequence: the turn reward on its last token, episode ends after it
    flat_rewards = torch.zeros(T, K, N, dtype=torch.float64)
    flat_rewards[:, -1] = rewards
    flat_dones = torch.zeros(T, K, N, dtype=torch.float64)
    flat_dones[:, -1] = dones
    flat = gae(flat_rewards.reshape(T * K, N), values.permute(0, 2, 1).reshape(T * K, N),
               flat_dones.reshape(T * K, N), last, 1.0, 1.0).reshape(T, K, N).permute(0, 2, 1)
    # sums of at most T*K terms of unit size: T*K eps
    torch.testing.assert_close(bilevel, flat, atol=T * K * EPS64 * 8, rtol=0)
    # and the turn level alone is the ordinary GAE of the turn values
    turn = bilevel_gae(rewards, values, dones, last, 0.9, 1.0, 0.8)
    expected_last = gae(rewards, values[..., -1], dones, last, 0.9, 0.8)
    torch.testing.assert_close(turn[..., -1], expected_last, atol=64 * EPS64, rtol=0)


def test_cached_decoding_matches_the_teacher_forced_pass_and_h_is_causal():
    torch.manual_seed(0)
    agent = CoTAgent()
    frames = torch.rand(5, 3, 28, 28)
    tokens, logp, values, hidden = agent.generate(frames, generator=torch.Generator().manual_seed(0))
    logits, full_values, full_hidden = agent.forward_turn(frames, tokens)
    full_logp = logits.log_softmax(-1).gather(-1, tokens[:, SAMPLED, None]).squeeze(-1)
    # float32, 2 layers of width 64 summed in a different order by the cache: 64 ulp
    tol = 64 * EPS32
    torch.testing.assert_close(hidden, full_hidden, atol=tol * 10, rtol=tol)
    torch.testing.assert_close(logp, full_logp, atol=tol * 10, rtol=tol)
    torch.testing.assert_close(values, full_values, atol=tol * 10, rtol=tol)
    changed = tokens.clone()
    changed[:, CLOSE_PRED + 2] = tokens[torch.arange(5).roll(1), CLOSE_PRED + 2]  # other actions
    changed[:, CLOSE_PRED + 2] = torch.where(changed[:, CLOSE_PRED + 2] == tokens[:, CLOSE_PRED + 2],
                                             agent.action_ids[0] + agent.action_ids[1] - tokens[:, CLOSE_PRED + 2],
                                             changed[:, CLOSE_PRED + 2])
    after = agent.forward_turn(frames, changed)[2]
    assert torch.equal(after[:, CLOSE_PRED], full_hidden[:, CLOSE_PRED])  # h never sees the action
    assert not torch.equal(after[:, CLOSE_PRED + 2], full_hidden[:, CLOSE_PRED + 2])


def test_describer_reads_the_symbolic_view():
    view = np.zeros((7, 7, 3), np.int64)
    view[3, 5, 0] = CELLS.index("door")
    view[3, 5, 2] = 2  # locked
    view[2, 6, 0], view[4, 6, 0] = CELLS.index("wall"), CELLS.index("empty")
    view[0, 0, 0] = CELLS.index("goal")
    assert describe(view, None) == [CELLS.index("door"), CELLS.index("wall"), CELLS.index("empty"), 0,
                                    DOOR.index("locked"), GOAL.index("visible")]
    view[3, 5, 2], view[0, 0, 0] = 0, CELLS.index("unseen")
    assert describe(view, None)[4:] == [DOOR.index("open"), GOAL.index("unseen")]


def test_vision_only_ablation_ignores_the_language_query():
    _, agent, glance = agent_and_glance("glance_vision_only")
    frames, next_frames, tokens = turn_batch(agent)
    hidden = agent.forward_turn(frames, tokens)[2]
    actions = torch.tensor([1, 0, 2, 4, 3, 1])
    loss = glance.loss(hidden, next_frames, frames, actions)
    assert torch.equal(loss, glance.loss(torch.randn_like(hidden), next_frames, frames, actions))
    assert not torch.equal(loss, glance.loss(hidden, next_frames, frames, actions.roll(1)))
    lm = snapshot(agent.lm)
    glance.align(loss.mean())
    assert all(torch.equal(v, lm[k]) for k, v in agent.lm.state_dict().items())


def test_running_statistics_merge_batches_exactly():
    from icml.methods.curious_agent.ppo import RND, RunningStd

    g = torch.Generator().manual_seed(0)
    rnd = RND(64)
    rnd.count = 0.0  # start empty so that the merged statistics are those of the concatenation
    a, b = torch.rand(7, 3, 28, 28, generator=g), torch.rand(5, 3, 28, 28, generator=g)
    rnd.update_stats(a), rnd.update_stats(b)
    both = torch.cat([a, b])
    # Chan's pairwise merge in float32 on values in [0, 1]: a few ulp
    torch.testing.assert_close(rnd.mean, both.mean(0), atol=8 * EPS32, rtol=0)
    torch.testing.assert_close(rnd.var, both.var(0, unbiased=False), atol=8 * EPS32, rtol=0)
    assert all(not p.requires_grad for p in rnd.target.parameters())
    norm = RunningStd(3, 0.99)
    norm.count, norm.mean, norm.var = 0.0, 0.0, 0.0
    r1, r2 = np.array([0.3, 0.1, 0.7]), np.array([0.2, 0.5, 0.4])
    norm.normalise(r1)
    out = norm.normalise(r2)
    returns = np.concatenate([r1, 0.99 * r1 + r2])  # the discounted intrinsic returns seen so far
    assert abs(norm.var - returns.var()) < 16 * np.finfo(np.float64).eps
    np.testing.assert_allclose(out, r2 / np.sqrt(returns.var() + 1e-8), rtol=16 * np.finfo(np.float64).eps)


def test_coverage_counts_visited_states_over_every_layout():
    from icml.methods.curious_agent.env import GridEnvs

    envs = GridEnvs("MiniGrid-DoorKey-5x5-v0", 2, 0, max_steps=6)  # many short episodes, many layouts
    rng = np.random.default_rng(0)
    for _ in range(60):
        envs.step(rng.integers(0, 5, 2))
    assert envs.episodes_started > 10
    assert all((x, y) in envs.open_cells for x, y, _ in envs.visits)
    assert 0 < envs.coverage() <= 1 and envs.coverage() == len(envs.visits) / (4 * len(envs.open_cells))


def test_revisit_probe_is_neutral_without_learning_and_decays_with_it():
    """With a zero alignment learning rate no weight moves (φ = v, so the EMA is a fixed point):
    both probe ratios are 1 up to float32 rounding; with learning, the replayed transition's r^i falls."""
    from icml.methods.curious_agent.ppo import revisit_probe

    cfg, agent, glance = agent_and_glance()
    state = {"glance": glance.head.state_dict()}
    before = snapshot(agent)
    cfg.glance.lr = 0.0
    still = revisit_probe(cfg, arm_spec("glance", cfg), agent, state, seed=0, repeats=5)
    # α·φ + (1−α)·φ re-rounds each weight by at most an ulp: the loss moves by a few float32 eps
    assert abs(still["probe_ri_decay"] - 1) < 64 * EPS32 and abs(still["probe_fresh_ri_decay"] - 1) < 64 * EPS32
    cfg.glance.lr = 3e-3
    moved = revisit_probe(cfg, arm_spec("glance", cfg), agent, state, seed=0, repeats=20)
    assert moved["probe_ri_decay"] < 0.9
    assert all(torch.equal(v, before[k]) for k, v in agent.state_dict().items())  # the probe works on a copy


def test_smoke_agent_reads_the_image():
    """The smoke preset's warmed-up agent must see the frame, or the smoke runs cannot catch a broken
    curiosity signal (h at </pred> would carry no image). Its warm-up once stopped after 32 Adam steps,
    and greedy decoding gave one identical turn for every state (a blind agent's best guess: each
    slot's most frequent value). Now: many distinct <obs>/<pred>, <obs> beats the blind guess, and
    the same turn on other frames changes."""
    from icml.methods.curious_agent.env import GridEnvs
    from icml.methods.curious_agent.model import OBS_POS, PRED_POS
    from icml.methods.curious_agent.ppo import new_agent, slot_accuracy, warmup

    cfg = preset("smoke")
    agent = new_agent(cfg)
    agent.load_state_dict(warmup(cfg, 0))
    envs = GridEnvs(cfg.env.id, 16, 7_000_000, cfg.env.actions, cfg.env.tile_size, cfg.env.max_steps)
    rng, frames, slots = np.random.default_rng(0), [], []
    for _ in range(6):  # 96 states of random walks on layouts the warm-up never saw
        frames.append(envs.frames.copy()), slots.append(envs.slots.copy())
        envs.step(rng.integers(0, 5, 16))
    frames, slots = torch.tensor(np.concatenate(frames)), np.concatenate(slots)
    tokens = agent.generate(frames, greedy=True)[0]
    obs, pred = tokens[:, OBS_POS], tokens[:, PRED_POS]
    assert len({tuple(r) for r in obs.tolist()}) >= 8 and len({tuple(r) for r in pred.tolist()}) >= 8
    read = float(slot_accuracy(tokens, torch.tensor(slots), OBS_POS).mean())
    blind = np.mean([np.bincount(slots[:, k]).max() / len(slots) for k in range(6)])
    assert read > blind + 0.05, (read, blind)
    shuffled = agent.generate(frames.roll(1, 0), greedy=True)[0]  # each turn on its neighbour's frame
    assert (shuffled[:, OBS_POS] != obs).any(1).float().mean() > 0.5


def test_splitting_door_marks_the_goal_room_of_doorkey_only():
    from icml.methods.curious_agent.env import GridEnvs

    envs = GridEnvs("MiniGrid-DoorKey-5x5-v0", 3, 0)
    for i, env in enumerate(envs.envs):
        grid = env.unwrapped.grid
        doors = [(x, y) for x in range(grid.width) for y in range(grid.height)
                 if grid.get(x, y) is not None and grid.get(x, y).type == "door"]
        assert envs.door_x[i] == doors[0][0]
    assert not envs.past_door().any()  # DoorKey starts the agent left of the door
    goal_side = envs.envs[1].unwrapped
    goal_side.agent_pos = (int(envs.door_x[1]) + 1, 1)
    assert envs.past_door().tolist() == [False, True, False]
    assert (GridEnvs("MiniGrid-FourRooms-v0", 1, 0).door_x == -1).all()  # no splitting door: no late turns


def tiny_llava(directory):
    """A randomly initialised LLaVA (CLIP tower + Llama) and a CLIP image processor, written with save_pretrained."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    config = LlavaConfig(vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                        num_attention_heads=2, image_size=28, patch_size=7),
                         text_config=LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                                 max_position_embeddings=64),
                         image_token_index=99)
    vlm = LlavaForConditionalGeneration(config)
    vlm.save_pretrained(directory)
    CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}).save_pretrained(directory)
    return vlm


def test_local_hf_vlm_checkpoint_runs_the_same_agent_and_glance_identities(tmp_path):
    """--model DIR: the VLM's vision tower + projector become f_v, its language model Λ_ℓ, loaded
    with from_pretrained; cached decoding, the routing and the EMA hold as for the tiny agent."""
    from icml.methods.curious_agent.model import VLMVision
    from icml.methods.curious_agent.ppo import new_agent

    saved = tiny_llava(tmp_path)
    cfg = tiny_cfg()
    cfg.model.path = str(tmp_path)
    agent = new_agent(cfg)
    assert isinstance(agent.vision, VLMVision) and agent.embed.embedding_dim == 48  # the LM's width
    for name, value in saved.model.language_model.state_dict().items():
        assert torch.equal(agent.lm.state_dict()[name], value), name  # the checkpoint's weights, not a fresh init
    for name, value in saved.model.vision_tower.state_dict().items():
        assert torch.equal(agent.vision.tower.state_dict()[name], value), name
    frames, next_frames, _ = turn_batch(agent, n=4)
    tokens, _, values, hidden = agent.generate(frames, generator=torch.Generator().manual_seed(0))
    logits, full_values, full_hidden = agent.forward_turn(frames, tokens)
    tol = 64 * EPS32  # as for the tiny agent: the Llama cache sums in another order
    torch.testing.assert_close(hidden, full_hidden, atol=tol * 10, rtol=tol)
    torch.testing.assert_close(values, full_values, atol=tol * 10, rtol=tol)
    glance = Glance(agent, arm_spec("glance", cfg), cfg, 0)
    assert glance.head.projector.net[0].in_features == 48 and glance.head.target_feature(next_frames).shape == (4, 48)
    lm, vision, target = snapshot(agent.lm), snapshot(agent.vision), snapshot(glance.head.target)
    glance.align(glance.loss(agent.forward_turn(frames, tokens)[2], next_frames).mean())
    assert all(torch.equal(v, lm[k]) for k, v in agent.lm.state_dict().items())  # Λ_ℓ bit-identical
    online = snapshot(agent.vision)
    assert any(not torch.equal(v, vision[k]) for k, v in online.items())  # tower / projector learned
    alpha = cfg.glance.ema_alpha
    for name, phi in snapshot(glance.head.target).items():
        expected = alpha * target[name] + (1 - alpha) * online[name]
        torch.testing.assert_close(phi, expected, atol=2 * EPS32 * max(expected.abs().max().item(), 1.0), rtol=0)


def tiny_qwen(directory):
    """A randomly initialised Qwen2.5-VL (2-block vision tower with window + full attention and the 2x2
    merger, 2-layer LM with multimodal RoPE) and its image processor, written with save_pretrained."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=128,
                         bos_token_id=None, eos_token_id=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=28,
                           fullatt_block_indexes=[1]),
        image_token_id=120, video_token_id=121, vision_start_token_id=122)
    vlm = Qwen2_5_VLForConditionalGeneration(config)
    vlm.save_pretrained(directory)
    Qwen2VLImageProcessorPil().save_pretrained(directory)  # smart resize: 28x28 frames -> 56x56, 2x2 merged patches
    return vlm


def test_qwen2_5_vl_checkpoint_runs_the_same_agent_and_glance_identities(tmp_path):
    """--model DIR with a Qwen2.5-VL: f_v = its `visual` tower (patches + image_grid_thw, merger), Λ_ℓ = its
    LM with multimodal RoPE. The agent's teacher-forced pass equals the VLM's own forward on the same frame
    and turn; cached decoding equals it; the curiosity step leaves Λ_ℓ bit-identical; φ is frozen and exact."""
    from icml.methods.curious_agent.model import QwenLanguageModel, QwenVision
    from icml.methods.curious_agent.ppo import new_agent

    saved = tiny_qwen(tmp_path)
    cfg = tiny_cfg()
    cfg.model.path = str(tmp_path)
    agent = new_agent(cfg)
    assert isinstance(agent.vision, QwenVision) and isinstance(agent.lm, QwenLanguageModel)
    assert agent.embed.embedding_dim == 48  # the LM's width
    for name, value in saved.model.language_model.state_dict().items():
        assert torch.equal(agent.lm.text.state_dict()[name], value), name  # the checkpoint's weights
    for name, value in saved.model.visual.state_dict().items():
        assert torch.equal(agent.vision.tower.state_dict()[name], value), name
    frames, next_frames, tokens = turn_batch(agent, n=3)

    # the reference: Qwen2_5_VLModel.forward on image placeholders + text ids, with its own get_rope_index
    n_vis, text_ids = 4, torch.randint(0, 100, (3, 19), generator=torch.Generator().manual_seed(2))
    inputs = agent.vision.processor(images=list(frames), do_rescale=False, return_tensors="pt")
    ids = torch.cat([torch.full((3, n_vis), saved.config.image_token_id), text_ids], 1)
    kinds = torch.cat([torch.ones(3, n_vis, dtype=torch.int), torch.zeros(3, 19, dtype=torch.int)], 1)
    positions, _ = saved.model.get_rope_index(ids, kinds, inputs["image_grid_thw"])
    assert torch.equal(agent.lm.positions(0, ids.shape[1], 3), positions)  # integers: exact
    with torch.no_grad():
        reference = saved.model(input_ids=ids, pixel_values=inputs["pixel_values"], mm_token_type_ids=kinds,
                                image_grid_thw=inputs["image_grid_thw"]).last_hidden_state
        embeds = torch.cat([agent.vision(frames), saved.model.language_model.embed_tokens(text_ids)], 1)
        ours = agent.lm(inputs_embeds=embeds).last_hidden_state
    torch.testing.assert_close(ours, reference, atol=64 * EPS32, rtol=64 * EPS32)  # same ops, same weights

    tokens, _, values, hidden = agent.generate(frames, generator=torch.Generator().manual_seed(0))
    logits, full_values, full_hidden = agent.forward_turn(frames, tokens)
    tol = 64 * EPS32  # the cache sums attention in another order than the full pass
    torch.testing.assert_close(hidden, full_hidden, atol=tol * 10, rtol=tol)
    torch.testing.assert_close(values, full_values, atol=tol * 10, rtol=tol)

    glance = Glance(agent, arm_spec("glance", cfg), cfg, 0)
    head = glance.head
    assert head.projector.net[0].in_features == 48 and head.target_feature(next_frames).shape == (3, 48)
    assert not any(p.requires_grad for p in head.target.parameters())  # φ is frozen
    assert all(torch.equal(v, agent.vision.state_dict()[k]) for k, v in head.target.state_dict().items())  # φ0 = v0
    loss = glance.loss(agent.forward_turn(frames, tokens)[2], next_frames)
    cosine = F.cosine_similarity(head.projector(full_hidden[:, CLOSE_PRED]), head.target_feature(next_frames), dim=-1)
    torch.testing.assert_close(loss, 2 - 2 * cosine, atol=8 * EPS32, rtol=0)  # ||ŷ/|ŷ| − y/|y|||² = 2 − 2cos
    language = [p.detach().clone() for p in agent.language_parameters()]
    vision, target = snapshot(agent.vision), snapshot(head.target)
    glance.align(loss.mean())
    assert all(torch.equal(p, q) for p, q in zip(agent.language_parameters(), language))  # Λ_ℓ bit-identical
    online = snapshot(agent.vision)
    assert any(not torch.equal(v, vision[k]) for k, v in online.items())  # the tower learned through Λ_ℓ
    alpha = cfg.glance.ema_alpha
    for name, phi in snapshot(head.target).items():
        expected = alpha * target[name] + (1 - alpha) * online[name]
        torch.testing.assert_close(phi, expected, atol=2 * EPS32 * max(expected.abs().max().item(), 1.0), rtol=0)


def test_micro_batches_give_the_whole_minibatch_step():
    """ppo.micro_batch: the minibatch through forward/backward in parts, losses weighted by their share and
    gradients accumulated (the alignment's too) before one step of each optimiser — the same update and logged
    values as the whole minibatch at once, up to float32 summation order."""
    from icml.methods.curious_agent.ppo import ppo_minibatch

    results = []
    for micro in (0, 4):
        cfg, agent, glance = agent_and_glance("glance_lm_grad")
        cfg.ppo.micro_batch = micro
        frames, next_frames, tokens = turn_batch(agent, n=10)
        g = torch.Generator().manual_seed(3)
        mb = {"frames": frames, "next": next_frames, "tokens": tokens, "actions": torch.zeros(10, dtype=torch.long),
              "logp": -torch.rand(10, len(SAMPLED), generator=g)}
        adv, ret = torch.randn(10, len(SAMPLED), generator=g), torch.randn(10, len(SAMPLED), generator=g)
        optimiser = torch.optim.Adam(agent.parameters(), lr=cfg.ppo.lr)
        logged = ppo_minibatch(agent, optimiser, arm_spec("glance_lm_grad", cfg), cfg.ppo, mb, adv, ret, glance)
        results.append((snapshot(agent), snapshot(glance.head), {k: float(v) for k, v in logged.items()}))
    (agent_a, head_a, log_a), (agent_b, head_b, log_b) = results
    for name in agent_a:
        torch.testing.assert_close(agent_a[name], agent_b[name], rtol=1e-5, atol=1e-6, msg=name)
    for name in head_a:
        torch.testing.assert_close(head_a[name], head_b[name], rtol=1e-5, atol=1e-6, msg=name)
    assert log_a.keys() == log_b.keys() == {"explore_loss", "policy_entropy", "value_loss"}
    for key in log_a:
        assert log_a[key] == pytest.approx(log_b[key], rel=1e-5)
