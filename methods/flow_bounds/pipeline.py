"""The flow-bounds lifecycle.

train: writes couplings.parquet (the exact mode's coupling definitions) and, in learned mode, fits the
  bridge-matching drift of every seed and drift loss (`checkpoints/drift_seed{s}.pt`, the endpoint
  ablation `drift_endpoint_seed{s}.pt`), logging bm_loss every `log_every` optimizer steps.
eval: runs every exact-mode sweep (closed form, vectorised), writes schedules.parquet, then for every
  seed the learned-mode W₂ and ε̂² against N for the learned drifts, the exact mixture drift and the
  noise floor; samples.parquet keeps the first seed's generated and reference points at the largest N.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from icml.cli.errors import IcmlError
from icml.cli.lifecycle import RunContext
from icml.cli.workers import run_in_workers

VARIANT_OF = {"bridge": "learned", "endpoint": "learned_endpoint"}


def seeds_of(ctx: RunContext) -> list[int]:
    return [ctx.seed + i for i in range(ctx.config.seeds)]


def checkpoint_name(drift_loss: str, seed: int) -> str:
    return f"drift_seed{seed}.pt" if drift_loss == "bridge" else f"drift_{drift_loss}_seed{seed}.pt"


SPLIT_SEED = 0  # a user cloud's train/held-out split: one split, shared by every seed and both phases


def target_of(cfg):
    """(target, tag name): the built-in mixture, or the user's point cloud."""
    from icml.methods.flow_bounds.points import load_point_cloud, ring_mixture

    if cfg.data == "gmm":
        le = cfg.learned
        return ring_mixture(le.components, le.radius, le.component_std), f"gmm{le.components}"
    try:
        cloud = load_point_cloud(cfg.data, cfg.learned.holdout, SPLIT_SEED)
    except ValueError as exc:
        raise IcmlError(str(exc), "pass a .csv/.parquet with two numeric columns or an (n, 2) .npy, "
                                  "or drop --data to use the built-in mixture") from None
    return cloud, f"data:{cloud.name}"


def learned_tags(cfg, coupling: str, n_steps: int | None) -> dict:
    t_end = 1.0 - cfg.learned.delta
    return {"mode": "learned", "coupling": coupling, "d": 2, "n_steps": n_steps,
            "h": t_end / n_steps if n_steps else None, "delta": cfg.learned.delta, "schedule": "uniform",
            "sigma": cfg.sigma, "t_end": t_end}


# train ------------------------------------------------------------------------------------------------------
def couplings_table(cfg) -> pd.DataFrame:
    from icml.methods.flow_bounds import gaussian as g

    parts = []
    for name in cfg.exact.couplings:
        for v1 in ([1.0] if name == "ou" else cfg.exact.v1_grid):
            for d in sorted(set(cfg.exact.d_grid) | set(cfg.exact.schedule_d)):
                x = g.coupling(name, d, v1, cfg.sigma, cfg.exact.c)
                parts.append(pd.DataFrame({"coupling": name, "v1": v1, "d": d, "coord": np.arange(d), "m0": x.m0,
                                           "m1": x.m1, "var0": x.v0, "var1": x.v1, "cov": x.c, "sigma": x.sigma}))
    return pd.concat(parts, ignore_index=True)


def train_job(cfg, seed: int, drift_loss: str, path: str, coupling: str) -> list[dict]:
    """Fit one drift (in this process or a worker); returns its bm_loss rows. Deterministic in (cfg, seed)."""
    import torch

    from icml.cli.runstore import atomic_torch_save
    from icml.cli.threads import single_thread
    from icml.methods.flow_bounds.learned import DriftNet, train_drift

    le = cfg.learned
    target, _ = target_of(cfg)
    rows: list[dict] = []
    tags = learned_tags(cfg, coupling, None)
    with single_thread():  # a 2×64 MLP: one thread is fastest
        torch.manual_seed(seed)
        net = DriftNet(2, le.hidden, le.layers, le.frequencies, drift_loss)
        train_drift(net, target, le.steps, le.batch, le.lr, le.delta, cfg.sigma, seed, le.log_every,
                    on_log=lambda step, loss: rows.append({**tags, "variant": VARIANT_OF[drift_loss],
                                                           "metric": "bm_loss", "value": loss, "step": step,
                                                           "seed": seed}))
    atomic_torch_save({"state_dict": net.state_dict(), "drift_loss": drift_loss, "seed": seed,
                       "hidden": le.hidden, "layers": le.layers, "frequencies": le.frequencies}, Path(path))
    return rows


def train(ctx: RunContext) -> None:
    cfg = ctx.config
    ctx.write_table("couplings", couplings_table(cfg))
    if not cfg.learned.enabled:
        ctx.log("learned.enabled=false: wrote config and couplings.parquet only")
        return
    _, coupling = target_of(cfg)
    jobs = []
    for seed in seeds_of(ctx):
        for loss in cfg.learned.drift_losses:
            path = ctx.checkpoints / checkpoint_name(loss, seed)
            if not path.exists():  # --resume: finished drifts are kept
                jobs.append(((seed, loss), train_job, (cfg, seed, loss, str(path), coupling)))
    with ctx.progress("bridge matching (drifts)", len(jobs)) as advance:
        def done(key, rows):
            ctx.record(rows, split="train")
            ctx.log(f"  {VARIANT_OF[key[1]]} seed {key[0]}: final bm_loss {rows[-1]['value']:.3f}")
            advance(1)

        run_in_workers(min(cfg.workers, len(jobs)), jobs, done)


# eval -------------------------------------------------------------------------------------------------------
def load_net(path: Path):
    import torch

    from icml.methods.flow_bounds.learned import DriftNet

    state = torch.load(path, map_location="cpu", weights_only=True)
    net = DriftNet(2, state["hidden"], state["layers"], state["frequencies"], state["drift_loss"])
    net.load_state_dict(state["state_dict"])
    return net.eval()


def eval_job(cfg, seed: int, checkpoints: str, coupling: str, keep_samples: bool):
    """W₂ (and ε̂² for the mixture) vs N for one seed; returns (rows, samples frame or None)."""
    from icml.cli.threads import single_thread
    from icml.methods.flow_bounds import learned as lm
    from icml.methods.flow_bounds.points import Mixture, interpolant

    le = cfg.learned
    t_end = 1.0 - le.delta
    target, _ = target_of(cfg)
    mixture = isinstance(target, Mixture)
    rng = np.random.default_rng([seed, 7])
    n = le.n_samples

    def exact_samples(m: int) -> np.ndarray:  # ν*_{T_end}: the interpolant's law at the end time
        return interpolant(np.full(m, t_end), rng.standard_normal((m, 2)), target.sample(m, rng),
                              rng.standard_normal((m, 2)), cfg.sigma)

    if mixture:
        reference, floor_set = exact_samples(n), exact_samples(n)
    else:  # a user cloud: W₂ against held-out points; floor = training points vs held-out points
        n = min(n, len(target.heldout), len(target.train))
        reference = target.heldout[rng.permutation(len(target.heldout))[:n]]
        floor_set = target.train[rng.permutation(len(target.train))[:n]]
    nets = {VARIANT_OF[loss]: load_net(Path(checkpoints) / checkpoint_name(loss, seed)) for loss in le.drift_losses}
    reference_drift = (lambda x, t: lm.mixture_drift(target, x, t, cfg.sigma)) if mixture else None
    rows = [{**learned_tags(cfg, coupling, None), "variant": "noise_floor", "metric": "w2_samples",
             "value": lm.w2_exact(floor_set, reference), "seed": seed}]
    samples = None
    fine = math.lcm(*le.N_grid)  # one Brownian path per seed, shared by every arm and N (when it divides)
    fine = fine if fine <= 4096 else None
    with single_thread():
        for n_steps in le.N_grid:
            grid = np.linspace(0.0, t_end, n_steps + 1)
            tags = learned_tags(cfg, coupling, n_steps)
            arms = {v: lm.net_drift(net) for v, net in nets.items()}
            if reference_drift is not None:
                arms["gmm_reference"] = reference_drift
            for variant, drift in arms.items():
                generated = lm.euler_maruyama(drift, n, grid, cfg.sigma, seed=seed * 100_003, fine_steps=fine)
                rows.append({**tags, "variant": variant, "metric": "w2_samples",
                             "value": lm.w2_exact(generated, reference), "seed": seed})
                if variant in nets and reference_drift is not None:
                    sq, l2 = lm.drift_error(drift, reference_drift, target, grid, le.eps_samples, cfg.sigma,
                                            seed=seed * 100_003 + n_steps + 1)
                    rows += [{**tags, "variant": variant, "metric": "eps_sq", "value": sq, "seed": seed},
                             {**tags, "variant": variant, "metric": "eps_l2", "value": l2, "seed": seed}]
                if keep_samples and n_steps == max(le.N_grid):
                    part = pd.DataFrame({"seed": seed, "variant": variant, "n_steps": n_steps,
                                         "x": generated[:, 0], "y": generated[:, 1]})
                    samples = part if samples is None else pd.concat([samples, part], ignore_index=True)
    if samples is not None:
        samples = pd.concat([samples, pd.DataFrame({"seed": seed, "variant": "target", "n_steps": 0,
                                                    "x": reference[:, 0], "y": reference[:, 1]})],
                            ignore_index=True)
    return rows, samples


def evaluate(ctx: RunContext) -> None:
    from icml.methods.flow_bounds import exact

    cfg = ctx.config
    with ctx.progress("exact Gaussian sweeps (grids)", exact.n_grids(cfg)) as advance:
        ctx.record(exact.run(cfg, progress=advance))
    ctx.write_table("schedules", exact.schedules_table(cfg).assign(run_id=ctx.run.path.name))
    if not cfg.learned.enabled:
        return
    _, coupling = target_of(cfg)
    seeds = seeds_of(ctx)
    for seed in seeds:
        for loss in cfg.learned.drift_losses:
            path = ctx.checkpoints / checkpoint_name(loss, seed)
            if not path.exists():
                raise IcmlError(f"checkpoint {path} is missing",
                                f"re-train the run: icml flow-bounds train --resume {ctx.run.path}")
    jobs = [(seed, eval_job, (cfg, seed, str(ctx.checkpoints), coupling, seed == seeds[0])) for seed in seeds]
    with ctx.progress("learned mode (seeds)", len(jobs)) as advance:
        def done(seed, result):
            rows, samples = result
            ctx.record(rows)
            if samples is not None:
                ctx.write_table("samples", samples.assign(run_id=ctx.run.path.name))
            advance(1)

        run_in_workers(min(cfg.workers, len(jobs)), jobs, done)
