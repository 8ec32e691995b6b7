"""The single-index lifecycle.

train: for every seed, the finite-sample estimators of `rkhs.variants` on one synthetic sample (or
  `joint` on a user file): per-iteration overlap, |overlap| and train_mse go to metrics.parquet
  (phase=train, step=iteration); each fit is saved as checkpoints/estimator_{variant}_seed{s}.npz.
eval: integrates the population flows (escape sweeps over targets × d × sign × ODE variants, the
  trap demo, the passive-mode demo), writes escape times, slopes and final values; scores every
  trained estimator on its fresh test points; writes trajectories.parquet (k = −1: m, k = −2: risk,
  k ≥ 0: a_k).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from icml.cli.errors import IcmlError
from icml.cli.lifecycle import RunContext
from icml.methods.single_index.config import info_exponent

if TYPE_CHECKING:
    from icml.methods.single_index.population import Flow

TRAJECTORY_M, TRAJECTORY_RISK = -1, -2


def seeds_of(ctx: RunContext) -> list[int]:
    return [ctx.seed + i for i in range(ctx.config.seeds)]


def user_mode(cfg) -> bool:
    return cfg.data.path is not None


def rkhs_tags(cfg) -> dict:
    r = cfg.rkhs
    if user_mode(cfg):
        return {"solver": "rkhs", "experiment": "user", "target": Path(cfg.data.path).stem, "K": r.K,
                "rho": r.rho, "eta": r.eta}
    return {"solver": "rkhs", "experiment": "rkhs", "target": r.target, "info_exp": info_exponent(r.target),
            "d": r.d, "m0": r.m0, "sign": int(math.copysign(1, r.m0)), "n": r.n, "K": r.K, "rho": r.rho,
            "eta": r.eta}


def checkpoint_path(ctx: RunContext, variant: str, seed: int) -> Path:
    return ctx.checkpoints / f"estimator_{variant}_seed{seed}.npz"


def rkhs_variants(cfg) -> list[str]:
    return ["joint"] if user_mode(cfg) else list(cfg.rkhs.variants)


# train -----------------------------------------------------------------------------------------------
def make_sample(cfg, seed: int, device: str):
    from icml.methods.single_index.estimator import load_user_sample, synthetic_sample

    if user_mode(cfg):
        return load_user_sample(cfg.data.path, cfg.data.test_fraction, seed, device)
    return synthetic_sample(cfg.rkhs, seed, device)


def start_direction(cfg, sample, seed: int):
    from icml.methods.single_index.estimator import initial_direction, random_direction

    if sample.w_star is not None and not user_mode(cfg):
        return initial_direction(sample.w_star, cfg.rkhs.m0, seed)
    return random_direction(sample.x.shape[1], seed, str(sample.x.device))  # no w* to place w₀ against


def save_fit(path: Path, fit, sample, variant: str, seed: int, cfg) -> None:
    from icml.cli.config import to_dict

    arrays = {"w": fit.w.cpu().numpy(), "a": fit.a.cpu().numpy(), "w0": fit.w0.cpu().numpy(),
              "w_star": np.array([]) if sample.w_star is None else sample.w_star.cpu().numpy(),
              "overlap": np.array(fit.overlap), "train_mse": np.array(fit.train_mse),
              "coefficients": np.array(fit.coefficients), "variant": np.array(variant), "seed": np.array(seed),
              "config": np.array(json.dumps(to_dict(cfg)))}
    tmp = path.with_name(path.stem + ".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)


def load_fit(path: Path) -> dict:
    if not path.exists():
        raise IcmlError(f"estimator checkpoint {path} is missing", "finish training: icml single-index train --resume")
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except Exception as exc:
        raise IcmlError(f"estimator checkpoint {path} is corrupt ({type(exc).__name__})",
                        "re-run training in a new run") from None


def train_rows(state: dict, variant: str, seed: int, tags: dict, a_star: np.ndarray | None) -> list[dict]:
    """Per-iteration overlap, |overlap|, train_mse and the closed-form risk L(m, a) where w* and φ* are known
    (step = iteration; step 0 for the one-shot baselines)."""
    from icml.methods.single_index.hermite import risk

    one_shot = variant in ("save", "sir", "fixed_w")
    rows = []
    for i, mse in enumerate(state["train_mse"]):
        step = 0 if one_shot else i + 1
        base = {**tags, "variant": variant, "seed": seed, "step": step}
        rows.append({**base, "metric": "train_mse", "value": float(mse)})
        if len(state["overlap"]):
            m = float(state["overlap"][i])
            rows += [{**base, "metric": "overlap", "value": m}, {**base, "metric": "overlap_abs", "value": abs(m)}]
            if a_star is not None:
                rows.append({**base, "metric": "risk", "value": float(risk(m, state["coefficients"][i], a_star))})
    return rows


def train(ctx: RunContext) -> None:
    from icml.cli.threads import threads_for
    from icml.methods.single_index.estimator import fit_variant
    from icml.methods.single_index.hermite import target_coefficients

    cfg = ctx.config
    tags = rkhs_tags(cfg)
    variants = rkhs_variants(cfg)
    seeds = seeds_of(ctx)
    a_star = None if user_mode(cfg) else target_coefficients(cfg.rkhs.target, cfg.rkhs.K, unit_norm=True)
    recorded = set()
    if ctx.resumed:  # a checkpoint whose rows did not reach metrics.parquet is recorded from the checkpoint
        done = ctx.metrics()
        recorded = set(zip(done["variant"], done["seed"]))
    with ctx.progress("single-index estimators", len(seeds) * len(variants)) as advance, \
            threads_for(cfg.rkhs.n * cfg.rkhs.d):
        for seed in seeds:
            sample = None
            for variant in variants:
                path = checkpoint_path(ctx, variant, seed)
                if not path.exists():
                    if sample is None:
                        sample = make_sample(cfg, seed, ctx.device)
                        w0 = start_direction(cfg, sample, seed)
                    save_fit(path, fit_variant(variant, sample, w0, cfg.rkhs), sample, variant, seed, cfg)
                if (variant, seed) not in recorded:
                    state = load_fit(path)
                    ctx.record(train_rows(state, variant, seed, tags, a_star), split="train")
                    if len(state["overlap"]):
                        ctx.log(f"  seed {seed} {variant}: overlap {float(state['overlap'][-1]):+.3f}, "
                                f"train_mse {float(state['train_mse'][-1]):.4f}")
                advance(1)


# eval: population ODE --------------------------------------------------------------------------------
def ode_runs(cfg) -> list[tuple[dict, Flow]]:
    """(tags, Flow) of every ODE run: escape sweeps, the trap demo, the passive-mode demo."""
    from icml.methods.single_index.hermite import target_coefficients
    from icml.methods.single_index.population import Flow

    ode = cfg.ode
    runs = []

    def flow(variant, a_star, m0, a0):
        return Flow(variant, tuple(a_star), float(m0), lam=ode.lam, a0=tuple(a0),
                    argmin=variant == "joint" and ode.phi_update == "argmin")

    def tags(experiment, target, variant, m0, d=None):
        rho = {"joint": ode.lam, "l2_flow": 1.0}.get(variant, float("nan"))
        if variant == "joint" and ode.phi_update == "argmin":
            rho = float("nan")
        return {"solver": "ode", "experiment": experiment, "target": target, "info_exp": info_exponent(target),
                "d": d, "m0": float(m0), "sign": int(math.copysign(1, m0)), "K": ode.K, "rho": rho, "eta": 1.0,
                "variant": variant}

    for target in ode.targets:
        a_star = target_coefficients(target, ode.K)
        a0 = a_star if ode.init_a == "target" else np.zeros_like(a_star)
        for d in ode.d_grid:
            for sign in (1, -1):
                m0 = sign / math.sqrt(d)
                runs += [(tags("escape", target, v, m0, d), flow(v, a_star, m0, a0)) for v in ode.variants]
    if "he2_he3" in ode.targets:  # the trap: planted stops at −2/3, joint takes the mirror solution
        a_star = target_coefficients("he2_he3", ode.K)
        runs += [(tags("trap", "he2_he3", v, ode.trap_m0), flow(v, a_star, ode.trap_m0, np.zeros_like(a_star)))
                 for v in ode.variants]
    if "he2_he4" in ode.targets:  # the passive a₄ mode: start at a(0) = a*, tiny positive overlap
        a_star = target_coefficients("he2_he4", ode.K)
        d = max(ode.d_grid)
        runs += [(tags("passive", "he2_he4", v, 1 / math.sqrt(d), d), flow(v, a_star, 1 / math.sqrt(d), a_star))
                 for v in ("joint", "l2_flow") if v in ode.variants]
    return runs


def final_rows(tag: dict, m: float, a: np.ndarray, a_star: np.ndarray, risk: float) -> list[dict]:
    from icml.methods.single_index.hermite import coef_error

    return [{**tag, "metric": "final_overlap", "value": m}, {**tag, "metric": "overlap_abs", "value": abs(m)},
            {**tag, "metric": "final_risk", "value": risk},
            {**tag, "metric": "coef_error", "value": coef_error(a, a_star, m)}]


def trajectory_frame(run_id: str, ident: dict, t: np.ndarray, m: np.ndarray | None, risk: np.ndarray | None,
                     a: np.ndarray):
    import pandas as pd

    blocks = []
    if m is not None:
        blocks.append((TRAJECTORY_M, m))
    if risk is not None:
        blocks.append((TRAJECTORY_RISK, risk))
    blocks += [(k, a[:, k]) for k in range(a.shape[1])]
    frame = pd.DataFrame({"t": np.tile(t, len(blocks)), "k": np.repeat([k for k, _ in blocks], len(t)),
                          "value": np.concatenate([v for _, v in blocks])})
    for column, value in reversed(list(ident.items())):
        frame.insert(0, column, value)
    frame.insert(0, "run_id", run_id)
    return frame


IDENT = ("solver", "experiment", "variant", "target", "d", "m0", "seed")


def evaluate_ode(ctx: RunContext) -> list:
    from icml.methods.single_index.population import escape_slope, integrate

    cfg, ode = ctx.config, ctx.config.ode
    runs = ode_runs(cfg)
    rows, frames, sweeps = [], [], {}
    with ctx.progress("population ODE runs", len(runs)) as advance:
        for tag, flow in runs:
            dense = 4 if tag["experiment"] == "passive" else 1  # the regrowth of a₄ is brief on a log-t axis
            result = integrate(flow, ode.t_max, dense * ode.n_grid, ode.rtol, ode.atol)
            a_star = np.asarray(flow.a_star)
            rows.append({**tag, "metric": "escape_time", "value": result.escape_time})
            rows += final_rows(tag, result.final_m, result.final_a, a_star, float(result.risk[-1]))
            if tag["experiment"] == "escape":  # one slope per (target, variant, sign), tagged like its runs
                slope_tag = {k: v for k, v in tag.items() if k not in ("d", "m0")}
                key = (tag["target"], tag["variant"], tag["sign"])
                sweeps.setdefault(key, (slope_tag, []))[1].append((tag["d"], result.escape_time))
            ident = {c: tag.get(c) for c in IDENT}
            frames.append(trajectory_frame(ctx.run.path.name, ident, result.t, result.m, result.risk, result.a))
            advance(1)
    for slope_tag, points in sweeps.values():
        d, times = np.array(points, dtype=float).T
        rows.append({**slope_tag, "metric": "escape_slope", "value": escape_slope(d, times, ode.slope_min_d)})
    ctx.record(rows)
    return frames


# eval: estimators ------------------------------------------------------------------------------------
def evaluate_rkhs(ctx: RunContext) -> list:
    import torch

    from icml.cli.threads import threads_for
    from icml.methods.single_index.estimator import phi
    from icml.methods.single_index.hermite import risk

    cfg = ctx.config
    tags = rkhs_tags(cfg)
    rows, frames = [], []
    variants, seeds = rkhs_variants(cfg), seeds_of(ctx)
    with ctx.progress("estimators on test points", len(seeds) * len(variants)) as advance, \
            threads_for(cfg.rkhs.n_test * cfg.rkhs.d):
        for seed in seeds:
            sample = make_sample(cfg, seed, ctx.device)
            for variant in variants:
                state = load_fit(checkpoint_path(ctx, variant, seed))
                w = torch.as_tensor(state["w"], device=ctx.device)
                a = torch.as_tensor(state["a"], device=ctx.device)
                if len(w) != sample.x.shape[1]:
                    raise IcmlError(f"checkpoint of {variant} seed {seed} has d={len(w)}, the data d="
                                    f"{sample.x.shape[1]}", "evaluate with the data the run was trained on")
                tag = {**tags, "variant": variant, "seed": seed}
                test_mse = float(((phi(sample.x_test @ w, a) - sample.y_test) ** 2).mean())
                rows += [{**tag, "metric": "test_mse", "value": test_mse},
                         {**tag, "metric": "train_mse", "value": float(state["train_mse"][-1]),
                          "split": "train"}]
                a_np = state["a"]
                m = None
                if sample.w_star is not None:
                    m = float(w @ sample.w_star)
                    if sample.a_star is not None:
                        rows += final_rows(tag, m, a_np, sample.a_star, float(risk(m, a_np, sample.a_star)))
                    else:
                        rows += [{**tag, "metric": "final_overlap", "value": m},
                                 {**tag, "metric": "overlap_abs", "value": abs(m)}]
                frames.append(rkhs_trajectory(ctx, tags, variant, seed, state, sample.a_star))
                advance(1)
    ctx.record(rows)
    return frames


def rkhs_trajectory(ctx: RunContext, tags: dict, variant: str, seed: int, state: dict, a_star):
    from icml.methods.single_index.hermite import risk

    coefficients = state["coefficients"]
    one_shot = variant in ("save", "sir", "fixed_w")
    t = np.zeros(1) if one_shot else np.arange(1, len(coefficients) + 1, dtype=float)
    m = state["overlap"] if len(state["overlap"]) else None
    r = risk(m, coefficients, a_star) if (m is not None and a_star is not None) else None
    ident = {"solver": "rkhs", "experiment": tags["experiment"], "variant": variant, "target": tags["target"],
             "d": tags.get("d"), "m0": tags.get("m0"), "seed": seed}
    return trajectory_frame(ctx.run.path.name, ident, t, m, r, coefficients)


def evaluate(ctx: RunContext) -> None:
    import pandas as pd

    frames = ([] if user_mode(ctx.config) else evaluate_ode(ctx)) + evaluate_rkhs(ctx)
    table = pd.concat(frames, ignore_index=True)
    table["d"] = table["d"].astype("Int64")
    table["seed"] = table["seed"].astype("Int64")
    table["m0"] = table["m0"].astype(float)
    ctx.write_table("trajectories", table)
