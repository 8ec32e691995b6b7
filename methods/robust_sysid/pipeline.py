"""The robust-sysid lifecycle.

train: the reference problem (p, q, T, attack.kind on attack.on, system.seed) fitted by every estimator;
  the IRLS objective per iteration (split=trace, step=iteration), the fit metrics (split=fit),
  checkpoints/system.npz and theta_<variant>.npz, and residuals.parquet (‖r_t‖ of l2_irls and ls with
  the attacked times). With `data` set: LS, ℓ₂ and the baselines at memory p on the user trajectory,
  scored by pred_error on its last 20 %.
eval: the sweeps. One job per (experiment, seed) draws one trajectory and cuts every problem (p, T,
  attack, q) from it (common random numbers); problems of one shape are fitted as one batch. The jobs
  run in `workers` processes. decay_rate is fitted afterwards from the p_sweep rows.
"""
from __future__ import annotations

import time

import numpy as np

from icml.cli.errors import IcmlError
from icml.cli.lifecycle import RunContext
from icml.cli.workers import run_in_workers
from icml.methods.robust_sysid import estimators as est
from icml.methods.robust_sysid.config import ESTIMATORS, EXPERIMENTS
from icml.methods.robust_sysid.system import (Problem, System, TrajectoryFormatError, build_problem, draw_system,
                                              draw_trajectory, load_user_trajectory, user_problem)

def make_system(cfg, run_seed: int) -> System:
    """The system of a run: drawn from (system.seed, run seed), so `--seeds` runs differ in the system too;
    numpy's seed sequence ignores a trailing 0, so run seed 0 draws the system of `system.seed` alone."""
    return draw_system(cfg.system.n, cfg.system.rho_spectrum, [cfg.system.seed, run_seed])


def estimators(cfg, log=None) -> list[str]:
    """The selected estimators that can run here (l2_cvx needs cvxpy)."""
    chosen = [v for v in ESTIMATORS if v in cfg.variants]
    if "l2_cvx" in chosen and not est.cvxpy_available():
        if log:
            log("note: cvxpy is not installed; the l2_cvx check is skipped (pip install cvxpy)")
        chosen.remove("l2_cvx")
    return chosen


# fitting -------------------------------------------------------------------------------------------
def fit_batch(problems: list[Problem], variants: list[str], irls_cfg) -> dict[str, dict]:
    """Every variant on a batch of same-shape problems: {variant: {Theta, iters, seconds, trace}};
    Θ̂_LS is always fitted (the IRLS start and the objective_gap_ls reference)."""
    Phi = np.stack([p.Phi for p in problems])
    Y = np.stack([p.Y for p in problems])
    irls = {"iters": irls_cfg.iters, "grad_tol": irls_cfg.grad_tol, "eta": irls_cfg.eta}
    out = {}
    start = time.perf_counter()
    ls = est.least_squares(Phi, Y)
    out["ls"] = {"Theta": ls, "seconds": time.perf_counter() - start}
    for variant in variants:
        start = time.perf_counter()
        if variant == "l2_irls":
            result = est.l2_irls(Phi, Y, Theta0=ls, **irls)
            out[variant] = {"Theta": result.Theta, "iters": result.iters, "trace": result.trace}
            out[variant]["seconds"] = time.perf_counter() - start + out["ls"]["seconds"]
        elif variant == "lad_coordwise":
            result = est.lad_coordwise(Phi, Y, **irls)
            out[variant] = {"Theta": result.Theta, "iters": result.iters}
        elif variant == "l2_cvx":
            out[variant] = {"Theta": est.l2_cvx(Phi, Y)}
        elif variant == "huber":
            out[variant] = {"Theta": est.huber(Phi, Y)}
        if variant != "l2_irls" and variant != "ls":
            out[variant]["seconds"] = time.perf_counter() - start
    return {v: out[v] for v in ["ls"] + variants if v in out}


def metric_rows(problems: list[Problem], fits: dict[str, dict], variants: list[str], eta: float,
                tags: list[dict]) -> list[dict]:
    """The spec's metrics of every (problem, variant); `truth` carries the objective at Θ*_p, the
    truncation norm and the realised attack rate."""
    Phi = np.stack([p.Phi for p in problems])
    Y = np.stack([p.Y for p in problems])
    Phi_test = np.stack([p.Phi_test for p in problems])
    Y_test = np.stack([p.Y_test for p in problems])
    has_truth = problems[0].truth is not None
    truth = np.stack([p.truth for p in problems]) if has_truth else None
    obj_ls = est.objective(Phi, Y, fits["ls"]["Theta"])
    obj_truth = est.objective(Phi, Y, truth) if has_truth else None
    rows = []

    def add(i, variant, metric, value, **extra):
        rows.append({**tags[i], "variant": variant, "metric": metric, "value": float(value), **extra})

    for variant in variants:
        fit = fits[variant]
        Theta = fit["Theta"]
        obj = est.objective(Phi, Y, Theta)
        grad = est.subgrad_norm(Phi, Y, Theta, eta)
        optimality = est.optimality_residual(Phi, Y, Theta, eta) / est.phi_rms(Phi)
        pred = est.objective(Phi_test, Y_test, Theta)
        for i in range(len(problems)):
            add(i, variant, "objective", obj[i])
            add(i, variant, "objective_gap_ls", obj[i] - obj_ls[i])
            add(i, variant, "subgrad_norm", grad[i])
            add(i, variant, "optimality_residual_rel", optimality[i])
            add(i, variant, "pred_error", pred[i])
            add(i, variant, "fit_seconds", fit["seconds"] / len(problems))  # amortised over the batch
            if "iters" in fit:
                add(i, variant, "irls_iters", fit["iters"][i])
            if has_truth:
                error = np.linalg.norm(Theta[i] - truth[i])
                add(i, variant, "param_error", error)
                add(i, variant, "param_error_rel", error / np.linalg.norm(truth[i]))
                add(i, variant, "objective_gap_truth", obj[i] - obj_truth[i])
    if has_truth:
        grad = est.subgrad_norm(Phi, Y, truth, eta)
        pred = est.objective(Phi_test, Y_test, truth)
        for i, problem in enumerate(problems):
            add(i, "truth", "objective", obj_truth[i])
            add(i, "truth", "objective_gap_ls", obj_truth[i] - obj_ls[i])
            add(i, "truth", "subgrad_norm", grad[i])
            add(i, "truth", "pred_error", pred[i])
            add(i, "truth", "truncation_norm", problem.truncation_norm)
            add(i, "truth", "attack_rate", problem.attacked.mean())
    return rows


# experiments ---------------------------------------------------------------------------------------
def experiment_grid(cfg, experiment: str) -> dict:
    """What one experiment varies: memories, lengths, attack models, q's, and its noise and ρ."""
    grid = {"noise": cfg.noise, "rho": None, "attacks": list(cfg.attacks)}
    if experiment == "p_sweep":
        grid.update(p=cfg.p_grid, T=[cfg.T], q=cfg.p_sweep_q)
    elif experiment == "q_sweep":
        grid.update(p=[cfg.p], T=[cfg.T], q=cfg.q_grid)
    elif experiment == "t_sweep":
        grid.update(p=cfg.t_sweep_p, T=cfg.T_grid, q=[cfg.q], attacks=[cfg.attack.kind])
    elif experiment == "recovery":  # noise-free, memory nearly exhausted: ρ^p ≈ 1e-8 at the defaults
        grid.update(p=[cfg.recovery_p], T=[cfg.T], q=cfg.recovery_q, attacks=[cfg.attack.kind], noise=0.0,
                    rho=cfg.recovery_rho)
    else:
        raise ValueError(f"unknown experiment '{experiment}'")
    return grid


def run_experiment(cfg, run_seed: int, experiment: str, seed: int) -> list[dict]:
    """One (experiment, seed) job: one trajectory, every problem cut from it, batched fits; its rows."""
    from threadpoolctl import threadpool_limits

    grid = experiment_grid(cfg, experiment)
    system = make_system(cfg, run_seed)
    if grid["rho"] is not None:
        system = system.rescaled(grid["rho"])
    rng = np.random.default_rng([run_seed, seed, EXPERIMENTS.index(experiment)])
    variants = [v for v in estimators(cfg) if v != "l2_cvx" or experiment in cfg.cvx_experiments]
    rows = []
    with threadpool_limits(1):  # one BLAS thread per job: the jobs themselves run in parallel
        traj = draw_trajectory(system, cfg, max(grid["T"]), max(grid["p"]), grid["noise"], rng)
        for p in grid["p"]:
            for T in grid["T"]:
                # q = 0 is the same data under every attack model: fit it once, label it for each
                cells = [(attack, q) for q in grid["q"]
                         for attack in (grid["attacks"][:1] if q == 0 else grid["attacks"])]
                problems = [build_problem(traj, attack, cfg.attack.on, q, p, T, cfg.attack) for attack, q in cells]
                fits = fit_batch(problems, variants, cfg.irls)
                tags = [{"experiment": experiment, "seed": seed, "p": p, "q": q, "T": T, "attack": attack,
                         "attack_on": cfg.attack.on, "input": cfg.input.kind, "noise": grid["noise"],
                         "system_seed": cfg.system.seed} for attack, q in cells]
                cell_rows = metric_rows(problems, fits, variants, cfg.irls.eta, tags)
                for row in [r for r in cell_rows if r["q"] == 0]:  # the other attack labels of q = 0
                    rows += [{**row, "attack": other} for other in grid["attacks"][1:]]
                rows += cell_rows
    return rows


def decay_rows(rows: list[dict], cfg) -> list[dict]:
    """decay_rate = exp(slope of log param_error vs p over decay_p), per variant, attack, q and seed;
    `truth` gets the same fit of ‖CA^p‖ (→ ρ)."""
    import pandas as pd

    frame = pd.DataFrame([r for r in rows if r["experiment"] == "p_sweep"])
    if frame.empty:
        return []
    low, high = cfg.decay_p
    frame = frame[frame["p"].between(low, high) & frame["metric"].isin(["param_error", "truncation_norm"])]
    out = []
    for (variant, attack, q, seed), group in frame.groupby(["variant", "attack", "q", "seed"]):
        group = group.sort_values("p")
        if group["p"].nunique() < 2 or (group["value"] <= 0).any():
            continue
        slope = np.polyfit(group["p"].to_numpy(float), np.log(group["value"].to_numpy()), 1)[0]
        first = group.iloc[0]
        out.append({"experiment": "p_sweep", "seed": int(seed), "q": float(q), "T": int(first["T"]),
                    "attack": attack, "attack_on": first["attack_on"], "input": first["input"],
                    "noise": float(first["noise"]), "system_seed": int(first["system_seed"]),
                    "variant": variant, "metric": "decay_rate", "value": float(np.exp(slope))})
    return out


# train ---------------------------------------------------------------------------------------------
def _save_thetas(ctx: RunContext, fits: dict, truth: np.ndarray | None, p: int) -> None:
    for variant, fit in fits.items():
        arrays = {"theta": fit["Theta"][0], "p": np.array(p)}
        if truth is not None:
            arrays["truth"] = truth
        np.savez(ctx.checkpoints / f"theta_{variant}.npz", **arrays)


def _comparison(rows: list[dict], metric: str) -> str:
    values = {r["variant"]: r["value"] for r in rows if r["metric"] == metric and r["variant"] != "truth"}
    return " · ".join(f"{v} {values[v]:.4g}" for v in values)


def train(ctx: RunContext) -> None:
    if ctx.config.data is not None:
        return _train_user(ctx)
    import pandas as pd
    from threadpoolctl import threadpool_limits

    cfg = ctx.config
    system = make_system(cfg, ctx.seed)
    np.savez(ctx.checkpoints / "system.npz", A=system.A, B=system.B, C=system.C, rho=system.rho)
    variants = estimators(cfg, ctx.log)
    rng = np.random.default_rng([ctx.seed, 0, len(EXPERIMENTS)])  # a stream of its own, apart from eval's
    with threadpool_limits(1):
        traj = draw_trajectory(system, cfg, cfg.T, cfg.p, cfg.noise, rng)
        problem = build_problem(traj, cfg.attack.kind, cfg.attack.on, cfg.q, cfg.p, cfg.T, cfg.attack)
        fits = fit_batch([problem], variants, cfg.irls)
    tag = {"experiment": "reference", "p": cfg.p, "q": cfg.q, "T": cfg.T, "attack": cfg.attack.kind,
           "attack_on": cfg.attack.on, "input": cfg.input.kind, "noise": cfg.noise, "system_seed": cfg.system.seed}
    if "l2_irls" in fits:
        ctx.record([{**tag, "variant": "l2_irls", "metric": "objective", "value": float(value[0]), "step": step}
                    for step, value in enumerate(fits["l2_irls"]["trace"])], split="trace")
    rows = metric_rows([problem], fits, [v for v in fits if v in variants or v == "ls"], cfg.irls.eta, [tag])
    ctx.record(rows, split="fit")
    _save_thetas(ctx, fits, problem.truth, cfg.p)
    residuals = [pd.DataFrame({"t": np.arange(cfg.T), "variant": v, "attacked": problem.attacked,
                               "residual_norm": est.residual_norms(problem.Phi[None], problem.Y[None],
                                                                   fits[v]["Theta"])[0]})
                 for v in ("l2_irls", "ls") if v in fits]
    ctx.write_table("residuals", pd.concat(residuals, ignore_index=True))
    ctx.run.update(system={"rho": system.rho, "n": cfg.system.n, "seed": cfg.system.seed})
    ctx.log(f"ρ = {system.rho:.3g}, ‖CA^p‖ = {problem.truncation_norm:.3g}, attacked {problem.attacked.mean():.3f}")
    ctx.log(f"p={cfg.p} q={cfg.q} T={cfg.T} {cfg.attack.kind} attack on the {cfg.attack.on}: param_error "
            + _comparison(rows, "param_error"))


def _user_problem(cfg, p: int) -> Problem:
    try:
        u, y = load_user_trajectory(cfg.data)
        return user_problem(u, y, p)
    except TrajectoryFormatError as exc:
        raise IcmlError(str(exc), "see the robust-sysid README for the accepted trajectory formats") from None


def _user_tags(cfg, p: int, T: int, experiment: str) -> dict:
    return {"experiment": experiment, "p": p, "T": T, "input": "user", "system_seed": None, "attack": None,
            "attack_on": None, "q": None, "noise": None}


def _train_user(ctx: RunContext) -> None:
    from pathlib import Path

    from threadpoolctl import threadpool_limits

    cfg = ctx.config
    problem = _user_problem(cfg, cfg.p)
    variants = estimators(cfg, ctx.log)
    with threadpool_limits(1):
        fits = fit_batch([problem], variants, cfg.irls)
    tag = _user_tags(cfg, cfg.p, len(problem.Y), "user")
    if "l2_irls" in fits:
        ctx.record([{**tag, "variant": "l2_irls", "metric": "objective", "value": float(value[0]), "step": step}
                    for step, value in enumerate(fits["l2_irls"]["trace"])], split="trace")
    rows = metric_rows([problem], fits, [v for v in fits], cfg.irls.eta, [tag])
    ctx.record(rows, split="fit")
    _save_thetas(ctx, fits, None, cfg.p)
    ctx.log(f"user trajectory {Path(cfg.data).name}: {len(problem.Y)} fitting samples, "
            f"{len(problem.Y_test)} held out; {problem.Y.shape[1]} outputs, {problem.Phi.shape[1]} regressors")
    ctx.log(f"p={cfg.p}: held-out pred_error " + _comparison(rows, "pred_error"))


# eval ----------------------------------------------------------------------------------------------
def evaluate(ctx: RunContext) -> None:
    """Every (experiment, seed) job; a finished job's rows are kept under checkpoints/eval/, so an
    interrupted eval re-run continues where it stopped. Seed by seed, so early seeds finish first."""
    import pandas as pd

    cfg = ctx.config
    if cfg.data is not None:
        return _evaluate_user(ctx)
    folder = ctx.checkpoints / "eval"
    folder.mkdir(exist_ok=True)
    keys = [(experiment, seed) for seed in cfg.seeds for experiment in EXPERIMENTS if experiment in cfg.experiments]
    path = {key: folder / f"{key[0]}_s{key[1]}.parquet" for key in keys}
    collected: list[dict] = []
    for key in keys:
        if path[key].exists():
            collected += pd.read_parquet(path[key]).to_dict("records")
    todo = [key for key in keys if not path[key].exists()]
    with ctx.progress("robust-sysid (experiment × seed)", len(keys)) as advance:
        advance(len(keys) - len(todo))

        def done(key, rows):
            from icml.cli.results import write_frame

            write_frame(path[key], pd.DataFrame(rows))
            collected.extend(rows)
            advance(1)

        run_in_workers(cfg.workers, [(key, run_experiment, (cfg, ctx.seed, *key)) for key in todo], done)
    collected = [{k: (None if isinstance(v, float) and np.isnan(v) and k not in ("value",) else v)
                  for k, v in row.items()} for row in collected]
    ctx.record(collected)
    ctx.record(decay_rows(collected, cfg))
    _log_summary(ctx, collected, cfg)


def _log_summary(ctx: RunContext, rows: list[dict], cfg) -> None:
    import pandas as pd

    frame = pd.DataFrame(rows)
    sweep = frame[(frame["experiment"] == "p_sweep") & (frame["metric"] == "param_error")]
    if sweep.empty:
        return
    q = max(cfg.p_sweep_q)
    for variant in ("l2_irls", "ls"):
        cell = sweep[(sweep["variant"] == variant) & (sweep["q"] == q) & (sweep["attack"] == cfg.attacks[0])]
        curve = cell.groupby("p")["value"].mean()
        ctx.log(f"{variant:8s} param_error vs p ({cfg.attacks[0]}, q={q}): "
                + " ".join(f"{int(p)}:{v:.3g}" for p, v in curve.items()))


def _evaluate_user(ctx: RunContext) -> None:
    """On a user trajectory: held-out pred_error and objective of every estimator over p_grid."""
    from threadpoolctl import threadpool_limits

    cfg = ctx.config
    variants = estimators(cfg)
    with ctx.progress("robust-sysid user p sweep", len(cfg.p_grid)) as advance:
        for p in cfg.p_grid:
            problem = _user_problem(cfg, p)
            with threadpool_limits(1):
                fits = fit_batch([problem], variants, cfg.irls)
            ctx.record(metric_rows([problem], fits, list(fits), cfg.irls.eta,
                                   [_user_tags(cfg, p, len(problem.Y), "user_p_sweep")]))
            advance(1)
