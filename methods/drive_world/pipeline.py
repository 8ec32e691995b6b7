"""train → eval of `icml drive-world`: tiles → gated VAE → cached latents → MeanFlow / flow / no-gate DiTs →
vocabulary → ΔSim variants; eval scores generators, latency, open-loop ΔSim and closed-loop rollouts."""
from __future__ import annotations

import time

import numpy as np
import pandas as pd
import torch

from icml.cli.runstore import load_checkpoint
from icml.cli.threads import single_thread

from . import deltasim, evaluation, meanflow, rollout, toy
from .config import POLICIES
from .models import EGRDiT, GatedVAE, denormalise_agents, normalise, vae_loss
from .world import make_tiles

# generator variant -> (trained DiT, solver, steps)
GENERATORS = {"meanflow_1": ("meanflow", "meanflow", 1), "meanflow_3": ("meanflow", "meanflow", 3),
              "flow_heun24": ("flow", "heun", 24), "flow_euler1": ("flow", "euler", 1),
              "meanflow_1_nogate": ("meanflow_nogate", "meanflow", 1)}
DITS = {"meanflow": ("meanflow", True), "flow": ("flow", True), "meanflow_nogate": ("meanflow", False)}
SIMS = {"deltasim_discrete": (False, True), "deltasim_no_dkal": (True, False), "deltasim": (True, True)}


def tensors(tiles: dict, idx=None) -> dict:
    out = {}
    for k, v in tiles.items():
        v = v if idx is None else v[idx]
        t = torch.as_tensor(v)
        out[k] = t.float() if t.dtype in (torch.float64, torch.float32) else t
    return out


def build_vae(cfg):
    return GatedVAE(cfg.data.lane_points, cfg.vae.d, cfg.vae.blocks, cfg.vae.heads, cfg.vae.lane_latent,
                    cfg.vae.agent_latent)


def build_dit(cfg, rel_gate: bool):
    d = cfg.dit
    return EGRDiT(cfg.vae.lane_latent, cfg.vae.agent_latent, d.lane_d, d.agent_d, d.heads, d.blocks, d.edge_d,
                  cfg.data.max_lanes, cfg.data.max_agents, rel_gate=rel_gate)


def build_policy(cfg, residual: bool):
    s = cfg.sim
    return deltasim.NPCPolicy(s.history, s.neighbours, s.d, s.layers, s.heads, s.vocab, residual)


def _data(ctx):
    path = ctx.checkpoints / "tiles.npz"
    if path.exists():
        z = np.load(path)
        train = {k[6:]: z[k] for k in z.files if k.startswith("train_")}
        held = {k[5:]: z[k] for k in z.files if k.startswith("held_")}
        return train, held
    d = ctx.config.data
    if d.data_dir:  # user tiles: the last share (by file name) is held out; n_tiles / eval_tiles cap the splits
        from icml.cli.errors import IcmlError

        from .scenario_dreamer import load_dir

        tiles = load_dir(d.data_dir, d)
        n = len(tiles["label"])
        if n < 2:
            raise IcmlError(f"data.data_dir {d.data_dir}: {n} tile; need ≥ 2 (train and held-out)")
        n_held = min(d.eval_tiles, max(1, n // 5))
        train = {k: v[:n - n_held][:d.n_tiles] for k, v in tiles.items()}
        held = {k: v[n - n_held:] for k, v in tiles.items()}
    else:
        train = make_tiles(d, d.n_tiles, 1000 * ctx.seed + 1, d.partition_frac)
        held = make_tiles(d, d.eval_tiles, 1000 * ctx.seed + 500_001, 0.0)  # other world seeds
    np.savez_compressed(path, **{f"train_{k}": v for k, v in train.items()}, **{f"held_{k}": v for k, v in held.items()})
    return train, held


def _fit(ctx, model, loss_fn, steps, lr, name, n_items, batch):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(ctx.seed)
    rows, started = [], time.time()
    with ctx.progress(f"train {name}", steps) as advance:
        for step in range(steps):
            idx = torch.randint(0, n_items, (batch,), generator=gen)
            loss, log = loss_fn(idx, gen)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if step % max(steps // 20, 1) == 0 or step == steps - 1:
                rows.append(dict(metric="loss", value=float(log), variant=name, step=step, model=name))
            advance(1)
    rows.append(dict(metric="wall_s", value=time.time() - started, variant=name, step=steps - 1, model=name))
    ctx.record(rows, split="train")


def _latents(vae, tiles, half):
    with torch.no_grad():
        b = tensors(tiles)
        lanes, agents = normalise(b, half)
        (ml, _), (ma, _) = vae.encode(lanes, agents, b["motion"], b["agent_type"], b["lane_mask"], b["agent_mask"])
    return ml, ma


def context_latents(vae, tiles: dict, half: float):
    """Latents (posterior means) of context tiles encoded from their fixed nodes alone: the free slots are
    placeholders (zeros) for the sampler, not part of the scene, and the encoder's attention would mix them into
    the fixed nodes' latents (measured at default: no decoded lane of compatible heading near a fixed lane's end in
    41 % of the successor pairs with them, 23 % without)."""
    only = dict(tiles, lane_mask=tiles["lane_mask"] & tiles["fixed_lanes"],
                agent_mask=tiles["agent_mask"] & tiles["fixed_agents"])
    return _latents(vae, only, half)


def _todo(ctx, stage: str, path) -> bool:
    """Train a model when its stage is listed, unless a resumed run already saved it."""
    return not path.exists() or (stage in ctx.config.stages and not ctx.resumed)


def train(ctx) -> None:
    cfg = ctx.config
    half = cfg.data.tile_m / 2
    with single_thread():
        train_tiles, _ = _data(ctx)
        n = len(train_tiles["label"])
        vae = build_vae(cfg)
        if _todo(ctx, "vae", ctx.checkpoints / "vae.pt"):
            _fit(ctx, vae, lambda idx, g: _vae_step(vae, train_tiles, idx, half, g), cfg.vae.steps, cfg.vae.lr,
                 "vae", n, cfg.vae.batch_size)
            torch.save(vae.state_dict(), ctx.checkpoints / "vae.pt")
        vae.load_state_dict(load_checkpoint(ctx.checkpoints / "vae.pt"))
        ml, ma = _latents(vae, train_tiles, half)
        lm, am = torch.as_tensor(train_tiles["lane_mask"]), torch.as_tensor(train_tiles["agent_mask"])
        scale_l, scale_a = ml[lm].std(0).clamp_min(1e-3), ma[am].std(0).clamp_min(1e-3)
        torch.save(dict(scale_l=scale_l, scale_a=scale_a), ctx.checkpoints / "latent_scale.pt")
        xl, xa = ml / scale_l, ma / scale_a
        b = tensors(train_tiles)
        for name, (mode, gate) in DITS.items():
            path = ctx.checkpoints / f"dit_{name}.pt"
            if not _todo(ctx, "dit", path):
                continue
            dit = build_dit(cfg, gate)
            _fit(ctx, dit, lambda idx, g: _dit_step(dit, xl, xa, b, idx, cfg, mode, g), cfg.dit.steps, cfg.dit.lr,
                 f"dit_{name}", n, cfg.dit.batch_size)
            torch.save(dit.state_dict(), path)
        if _todo(ctx, "sim", ctx.checkpoints / f"sim_{list(SIMS)[-1]}.pt"):
            vocab = torch.as_tensor(deltasim.build_vocabulary(cfg.sim.vocab, np.random.default_rng(ctx.seed)))
            feats, target, speed = rollout.sim_dataset(cfg.sim, n_worlds=max(2, cfg.sim.steps // 100), seed=ctx.seed)
            torch.save(vocab, ctx.checkpoints / "vocab.pt")
            m = len(target)
            for name, (residual, dkal) in SIMS.items():
                policy = build_policy(cfg, residual)

                def step(idx, g, policy=policy, dkal=dkal, state={"i": 0}):
                    state["i"] += 1
                    coef = cfg.sim.dkal * min(1.0, state["i"] / max(cfg.sim.steps / 2, 1)) if dkal else 0.0  # annealed in
                    f = {k: v[idx] for k, v in feats.items()}
                    loss, _ = deltasim.policy_loss(policy, f, target[idx], speed[idx], vocab, coef, cfg.sim.dkal_beta,
                                                     cfg.sim.dkal_cost_cap)
                    return loss, loss.item()
                _fit(ctx, policy, step, cfg.sim.steps, cfg.sim.lr, name, m, cfg.sim.batch_size)
                torch.save(policy.state_dict(), ctx.checkpoints / f"sim_{name}.pt")
        for mode in ("meanflow", "flow"):  # the 8-Gaussian toy, same MeanFlow / flow-matching code
            path = ctx.checkpoints / f"toy_{mode}.pt"
            if not _todo(ctx, "toy", path):
                continue
            torch.manual_seed(ctx.seed)
            net = toy.ToyNet(cfg.toy.hidden)

            def toy_step(idx, g, net=net, mode=mode):
                loss, raw = toy.toy_loss(net, toy.mixture(len(idx), g), cfg.dit, mode, g)
                return loss, raw.item()
            _fit(ctx, net, toy_step, cfg.toy.steps, cfg.toy.lr, f"toy_{mode}", 1, cfg.toy.batch_size)
            torch.save(net.state_dict(), path)


def _vae_step(vae, tiles, idx, half, gen):
    loss, _ = vae_loss(vae, tensors(tiles, idx.numpy()), half, gen)
    return loss, loss.item()


def _dit_step(dit, xl, xa, b, idx, cfg, mode, gen):
    label = b["label"][idx].clone()
    drop = torch.rand(len(idx), generator=gen) < cfg.dit.cfg_drop  # CFG: the null label, fixed across the JVP
    label[drop] = dit.n_labels
    cond = dict(lane_mask=b["lane_mask"][idx], agent_mask=b["agent_mask"][idx], label=label)
    loss, raw = meanflow.scene_loss(dit, xl[idx], xa[idx], cond, b["fixed_lanes"][idx], b["fixed_agents"][idx],
                                    cfg.dit, mode, gen)
    return loss, raw.item()


class Models:
    """Everything eval needs, loaded from a run's checkpoints."""

    def __init__(self, ctx):
        cfg, ck = ctx.config, ctx.checkpoints
        self.cfg, self.half = cfg, cfg.data.tile_m / 2
        self.vae = build_vae(cfg)
        self.vae.load_state_dict(load_checkpoint(ck / "vae.pt"))
        scale = load_checkpoint(ck / "latent_scale.pt")
        self.scale_l, self.scale_a = scale["scale_l"], scale["scale_a"]
        self.dits = {}
        for name, (_, gate) in DITS.items():
            self.dits[name] = build_dit(cfg, gate)
            self.dits[name].load_state_dict(load_checkpoint(ck / f"dit_{name}.pt"))
        self.vocab = load_checkpoint(ck / "vocab.pt")
        self.policies = {}
        for name, (residual, _) in SIMS.items():
            self.policies[name] = build_policy(cfg, residual)
            self.policies[name].load_state_dict(load_checkpoint(ck / f"sim_{name}.pt"))
            self.policies[name].eval()
        self.policies["deltasim_proj"] = self.policies["deltasim"]
        for m in [self.vae, *self.dits.values()]:
            m.eval()

    def decode(self, zl, za, cond) -> list[dict]:
        with torch.no_grad():
            out = self.vae.decode(zl * self.scale_l, za * self.scale_a, cond["lane_mask"], cond["agent_mask"])
        lanes = (out["lanes"] * self.half).unflatten(-1, (-1, 2)).numpy()
        agents = denormalise_agents(out["agents"], self.half).numpy()
        edges = out["pair"].argmax(-1).numpy()
        return [dict(lanes=lanes[i], edges=edges[i], agents=agents[i], motion=out["motion"][i].numpy(),
                     lane_mask=cond["lane_mask"][i].numpy(), agent_mask=cond["agent_mask"][i].numpy())
                for i in range(len(lanes))]

    def generate(self, variant, cond, generator=None, fixed=None) -> list[dict]:
        dit_name, solver, steps = GENERATORS[variant]
        d = self.cfg.dit
        zl, za = meanflow.sample(self.dits[dit_name], cond, self.cfg.vae.lane_latent, self.cfg.vae.agent_latent,
                                 steps, solver, d.guidance, d.clamp, fixed=fixed, generator=generator)
        return self.decode(zl, za, cond)

    def outpaint(self, context: dict, generator=None) -> dict:
        """One deployment step (meanflow_1) on a context tile: its fixed nodes are encoded (posterior means),
        imposed at initialisation and after the step; the decoded tile keeps the context's fixed masks."""
        b = {k: np.asarray(v)[None] for k, v in context.items()}
        ml, ma = context_latents(self.vae, b, self.half)
        fixed = (ml / self.scale_l, ma / self.scale_a, torch.as_tensor(b["fixed_lanes"]), torch.as_tensor(b["fixed_agents"]))
        tile = self.generate("meanflow_1", _cond(b, [0]), generator, fixed)[0]
        return dict(tile, fixed_lanes=context["fixed_lanes"], fixed_agents=context["fixed_agents"])


def _cond(tiles, idx) -> dict:
    return dict(lane_mask=torch.as_tensor(tiles["lane_mask"][idx]), agent_mask=torch.as_tensor(tiles["agent_mask"][idx]),
                label=torch.as_tensor(tiles["label"][idx]))


def generation_cond(train, n: int, seed: int) -> dict:
    """Conditions of n generated tiles: the lane / agent counts and scene labels of n training tiles drawn with
    replacement (seeded), i.e. the training distribution. Taking them from the held-out tiles being scored gave
    every generated tile its reference's lane count, so `fd_density` (the #lanes statistic) was 0 by construction."""
    idx = np.random.default_rng(seed).integers(0, len(train["label"]), n)
    return _cond(train, idx)


def _split(tiles, idx) -> list[dict]:
    return [{k: v[i] for k, v in tiles.items()} for i in idx]


def evaluate(ctx) -> None:
    cfg = ctx.config
    with single_thread():
        train, held = _data(ctx)
        models = Models(ctx)
        n = min(cfg.eval_samples, len(held["label"]))
        idx = np.arange(n)
        reference = _split(held, idx)
        cond = generation_cond(train, n, ctx.seed)
        gen = torch.Generator().manual_seed(ctx.seed)
        rows = []
        for variant, (dit_name, solver, steps) in {**GENERATORS, "vae_recon": (None, "none", 0)}.items():
            if variant == "vae_recon":
                ml, ma = _latents(models.vae, {k: v[idx] for k, v in held.items()}, models.half)
                tiles = models.decode(ml / models.scale_l, ma / models.scale_a, _cond(held, idx))  # its own masks
            else:
                tiles = models.generate(variant, cond, gen)
            if variant in ("meanflow_1", "vae_recon"):  # the report's tile gallery
                keep = tiles[:4]
                np.savez_compressed(ctx.checkpoints / f"gallery_{variant}.npz",
                                    **{k: np.stack([t[k] for t in keep]) for k in keep[0]})
            scores = evaluation.score_tiles(tiles, reference)
            scores["ms_per_tile"] = _latency(models, variant, held, cfg.latency_repeats)
            tags = dict(variant=variant, nfe=steps * (2 if solver == "heun" else 1), solver=solver,
                        cfg_scale=cfg.dit.guidance if steps else 0.0,
                        rel_gate=str(dit_name != "meanflow_nogate" if dit_name else "n/a"))
            rows += [dict(metric=k, value=float(v), **tags) for k, v in scores.items()]
        ctx.record(rows)
        _toy_eval(ctx)
        _open_loop(ctx, models)
        _closed_loop(ctx, models)


def load_toy(ctx) -> dict:
    nets = {}
    for mode in ("meanflow", "flow"):
        nets[mode] = toy.ToyNet(ctx.config.toy.hidden)
        nets[mode].load_state_dict(load_checkpoint(ctx.checkpoints / f"toy_{mode}.pt"))
        nets[mode].eval()
    return nets


def _toy_eval(ctx) -> None:
    """toy_energy_distance per sampler; the samples go to the report's scatter plot."""
    cfg = ctx.config
    scores, samples = toy.toy_scores(load_toy(ctx), cfg.toy.samples, cfg.dit.clamp, ctx.seed)
    np.savez_compressed(ctx.checkpoints / "toy_samples.npz", **samples)
    rows = []
    for variant, value in scores.items():
        _, solver, steps = toy.TOY_VARIANTS[variant]
        rows.append(dict(metric="toy_energy_distance", value=value, variant=variant, model="toy",
                         nfe=steps * (2 if solver == "heun" else 1), solver=solver, cfg_scale=0.0))
    ctx.record(rows)


def _latency(models, variant, held, repeats) -> float:
    """Median sample + decode wall time at batch 1, after 5 warm-ups (ms)."""
    cond = _cond(held, [0])
    times = []
    for i in range(5 + repeats):
        start = time.perf_counter()
        if variant == "vae_recon":
            ml, ma = _latents(models.vae, {k: v[:1] for k, v in held.items()}, models.half)
            models.decode(ml, ma, cond)
        else:
            models.generate(variant, cond)
        if i >= 5:
            times.append(1000 * (time.perf_counter() - start))
    return float(np.median(times))


def _open_loop(ctx, models) -> None:
    cfg = ctx.config
    feats, target, speed = rollout.sim_dataset(cfg.sim, n_worlds=1, seed=ctx.seed + 77_777, steps=30)
    rows = []
    for name, policy in models.policies.items():
        with torch.no_grad():
            k_gt = torch.as_tensor(deltasim.corner_error(target.numpy(), models.vocab.numpy()).argmin(1))
            logits, delta = policy(feats)
            k = logits.argmax(-1)
            action = models.vocab[k] + (delta if delta is not None else 0)
            if name == "deltasim_proj":
                action = deltasim.project(action.double(), speed.double(), cfg.sim).float()
        rows += [dict(metric="npc_token_acc", value=float((k == k_gt).float().mean()), variant=name, policy=name),
                 dict(metric="npc_ade_m", value=float((action[:, :2] - target[:, :2]).norm(dim=-1).mean()),
                      variant=name, policy=name)]
    ctx.record(rows)


KIN_BINS = np.linspace(-6, 4, 41)  # log10 C of the kinematic-cost histograms (C ≤ 1e-12 counted apart as 0)
JERK_AGES = 30  # jerk over the first 3 s after spawn, per step


def _closed_loop(ctx, models) -> None:
    cfg = ctx.config
    _, held = _data(ctx)
    rows, table, hists, jerks = [], [], {"edges": KIN_BINS}, {}
    for policy_name in POLICIES:
        for mode in ("warm", "cold"):
            results = []
            for i in range(cfg.rollout.n):
                outpaint = outpainter(models, held, cfg.data, seed=1000 * ctx.seed + i)
                res = rollout.run_rollout(10_000 * ctx.seed + i, policy_name, models.policies.get(policy_name),
                                          models.vocab, mode, cfg, outpaint)
                results.append(res)
                if i == 0 and policy_name in ("deltasim_discrete", "deltasim_proj") and mode == "warm":
                    save_trace(ctx.checkpoints / f"trace_{policy_name}.npz", res)
                table.append(dict(run_id=ctx.run.path.name, rollout_id=i, policy=policy_name, start_mode=mode,
                                  km=res["km"], end_reason=res["end_reason"], n_tiles=res["n_tiles"]))
            tags = dict(variant=policy_name, policy=policy_name, start_mode=mode)
            for key in ("kin_violation_rate", "kin_cost_mean", "offroad_rate", "sim_collision_rate",
                        "ttc_violation_rate", "jerk_first_1s", "jerk_mean", "stitch_fallback_rate"):
                rows.append(dict(metric=key, value=float(np.nanmean([r[key] for r in results])), **tags))
            gaps = np.concatenate([r["gaps"] for r in results])  # over every stitched joint of the arm
            rows.append(dict(metric="stitch_gap_m", value=float(gaps.mean()) if len(gaps) else float("nan"), **tags))
            rows.append(dict(metric="rollout_km", value=float(np.mean([r["km"] for r in results])), **tags))
            rows.append(dict(metric="rollout_success_1km",
                             value=float(np.mean([r["end_reason"] == "distance" for r in results])), **tags))
            cost = np.concatenate([r["kin_costs"] for r in results])
            hists[f"{policy_name}__{mode}"] = np.histogram(np.log10(np.clip(cost[cost > 1e-12], 10 ** KIN_BINS[0],
                                                                            10 ** KIN_BINS[-1])), KIN_BINS)[0]
            hists[f"{policy_name}__{mode}__zero"] = np.array([(cost <= 1e-12).sum()])
            ages = np.concatenate([r["jerk_age"] for r in results])
            jerks[f"{policy_name}__{mode}"] = np.array([ages[ages[:, 0] == k, 1].mean() if (ages[:, 0] == k).any()
                                                        else np.nan for k in range(JERK_AGES)])
    ctx.record(rows)
    ctx.write_table("rollouts", pd.DataFrame(table))
    np.savez_compressed(ctx.checkpoints / "kin_cost_hist.npz", **hists)
    np.savez_compressed(ctx.checkpoints / "jerk_by_age.npz", **jerks)


def save_trace(path, res) -> None:
    """One rollout for plots and `generate`: ego path, NPC paths (concatenated, with their lengths), the stitched
    map (lane points concatenated, lengths, source index into stitching.SOURCES), the route, the tile origins and
    the first box [x, y, ψ, length, width] of every spawned agent."""
    paths = res["npc_paths"] or [np.zeros((0, 3))]
    np.savez_compressed(path, ego=res["ego_path"], npc=np.concatenate(paths),
                        npc_len=np.array([len(p) for p in res["npc_paths"]], np.int64),
                        lanes=np.concatenate(res["lanes"]), lane_len=np.array([len(l) for l in res["lanes"]], np.int64),
                        lane_source=np.asarray(res["lane_source"], np.int64), route=res["route"], tiles=res["tiles"],
                        agents=res["spawned_boxes"], gaps=res["gaps"])


def outpainter(models, held, data_cfg, seed):
    """The rollout's frontier tiles: the k-th takes its scene label and its new-half counts (lanes with mean
    x > 0, agents with x > 0) from a held-out tile, and is outpainted by meanflow_1 around the fixed nodes."""
    from .stitching import context_tile

    gen = torch.Generator().manual_seed(seed)

    def outpaint(k, origin, pieces, rows):  # the model works in the tile frame: the pose is not an input
        j = (seed + k) % len(held["label"])
        lm, am = held["lane_mask"][j], held["agent_mask"][j]
        n_lanes = int((held["lanes"][j][lm, :, 0].mean(1) > 0).sum())
        n_agents = int((held["agents"][j][am, 0] > 0).sum())
        return models.outpaint(context_tile(pieces, rows, n_lanes, n_agents, held["label"][j], data_cfg), gen)
    return outpaint
