"""The exact-mode sweeps: every (coupling, d, v1, grid, ε) case as closed-form numbers, vectorised.

Two sweeps share one engine:
- `rates`: uniform grids t_k = k/N on [0, 1] (no early stop, the Thm 1 / Thm 4 setting) over N, d, ε
  and v1 (aniso: the first v1 only, its d distinct coordinates per d make it the costly coupling);
- `schedules`: at each (h, δ), Thm 3's non-uniform grid and the uniform grid with the same N and the
  same endpoint 1 − δ, over v1, ε and the dimensions `schedule_d` (non-`ou` couplings: `ou` has no
  degenerate target for a schedule to help with).
Per grid, the distinct scalar coordinates of all its cases are propagated once (Euler moments, path
terms); a case then sums its coordinates for each ε. The drift bias is q = ε/√(T_end d) on every
coordinate (q·𝟙 has norm ε/√T_end along 𝟙/√d), so Σ_k h_k‖q‖² = ε² exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from icml.methods.flow_bounds import gaussian as g

KL_BOUND_OF = {"thm1": "bound_thm1", "thm2": "bound_thm2", "thm3": "bound_thm3"}


@dataclass(frozen=True)
class Case:
    coupling: str
    d: int
    v1: float
    schedule: str  # uniform | nonuniform
    delta: float  # 0: no early stop (t_end = 1)
    n_steps: int
    h: float  # the bound's step parameter: t_end/N (uniform) or Thm 3's h (non-uniform)


def grid_of(case: Case) -> np.ndarray:
    if case.schedule == "nonuniform":
        return g.nonuniform_grid(case.h, case.delta)
    return g.uniform_grid(case.n_steps, 1.0 - case.delta)


def cases(cfg, sigma: float) -> list[Case]:
    ex = cfg.exact
    out = []
    for name in ex.couplings:
        v1s = [1.0] if name == "ou" else (ex.v1_grid[:1] if name == "aniso" else ex.v1_grid)
        out += [Case(name, d, v1, "uniform", 0.0, n, 1.0 / n) for v1 in v1s for d in ex.d_grid for n in ex.N_grid]
    for name in (c for c in ex.couplings if c != "ou"):
        for v1 in ex.v1_grid:
            for d in ex.schedule_d:
                for delta in ex.delta_grid:
                    for h in ex.h_grid:
                        n = len(g.nonuniform_grid(h, delta)) - 1
                        out += [Case(name, d, v1, "nonuniform", delta, n, h),
                                Case(name, d, v1, "uniform", delta, n, (1 - delta) / n)]
    return out


def schedules_table(cfg) -> pd.DataFrame:
    """Every grid of the schedule sweep: schedule, h (the pair's Thm 3 parameter), delta, k, t_k, h_k."""
    parts = []
    for delta in cfg.exact.delta_grid:
        for h in cfg.exact.h_grid:
            nonuniform = g.nonuniform_grid(h, delta)
            for schedule, grid in (("nonuniform", nonuniform),
                                   ("uniform", g.uniform_grid(len(nonuniform) - 1, 1 - delta))):
                parts.append(pd.DataFrame({"schedule": schedule, "h": h, "delta": delta,
                                           "k": np.arange(len(grid) - 1), "t_k": grid[:-1], "h_k": np.diff(grid)}))
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def _params(coords: g.Coordinates) -> np.ndarray:
    return np.stack([coords.m0, coords.m1, coords.v0, coords.v1, coords.c, coords.sigma], axis=1)


def run(cfg, progress=None) -> list[dict]:
    """All exact-mode metric rows (eval rows, step 0; sweep coordinates as tags)."""
    ex, sigma = cfg.exact, cfg.sigma
    by_grid: dict[tuple, list[Case]] = {}
    for case in cases(cfg, sigma):
        by_grid.setdefault((case.schedule, case.delta, case.n_steps, case.h if case.schedule == "nonuniform"
                            else None), []).append(case)
    rows: list[dict] = []
    for group in by_grid.values():
        grid = grid_of(group[0])
        coords = {case: g.coupling(case.coupling, case.d, case.v1, sigma, ex.c) for case in group}
        unique, inverse = np.unique(np.concatenate([_params(c) for c in coords.values()]), axis=0,
                                    return_inverse=True)
        distinct = g.Coordinates(*unique.T)
        moments, path = g.euler_moments(distinct, grid), g.path_terms(distinct, grid)
        target_m, target_v = g.marginal(distinct, grid[-1])
        offset = 0
        for case, c in coords.items():
            index = inverse.reshape(-1)[offset:offset + case.d]
            offset += case.d
            rows += _case_rows(case, c, grid, index, moments, path, target_m, target_v, ex)
        if progress is not None:
            progress(1)
    return rows + _slope_rows(rows, ex.slope_min_n)


def n_grids(cfg) -> int:
    return len({(c.schedule, c.delta, c.n_steps, c.h if c.schedule == "nonuniform" else None)
                for c in cases(cfg, cfg.sigma)})


def _case_rows(case: Case, coords: g.Coordinates, grid, index, moments, path, target_m, target_v, ex) -> list[dict]:
    t_end = float(grid[-1])
    sigma = coords.sigma  # per coordinate of this case, aligned with index
    s_pi = np.sqrt(g.score_moment8(g.joint_precision_eigs(coords)))
    s_01 = np.sqrt(g.score_moment8(g.conditional_precision_eigs(coords)))
    tags = {"mode": "exact", "coupling": case.coupling, "d": case.d, "n_steps": case.n_steps, "h": case.h,
            "delta": case.delta, "schedule": case.schedule, "v1": case.v1, "sigma": float(coords.sigma[0]),
            "t_end": t_end}
    applicable = "thm1" if case.delta == 0 else ("thm3" if case.schedule == "nonuniform" else "thm2")
    out = []
    for eps in ex.eps_grid:
        q = eps / np.sqrt(t_end * case.d)
        mean = moments.mean0[index] + q * moments.gain[index]
        kl_terminal = float(np.sum(g.kl_gauss(target_m[index], target_v[index], mean, moments.var[index])))
        w2_terminal = float(np.sqrt(np.sum(g.w2_sq_gauss(target_m[index], target_v[index], mean,
                                                         moments.var[index]))))
        kl_path = float(np.sum(path.kl(q, sigma, index)))
        h_k = np.diff(grid)
        eps_sq = float(np.sum(h_k) * case.d * q ** 2)  # Σ_k h_k ‖q·𝟙‖²
        eps_l2 = float(np.sum(h_k) * np.sqrt(case.d) * q)  # Σ_k h_k ‖q·𝟙‖
        bounds = g.bound_factors(case.d, case.h, eps_sq, eps_l2, case.delta, s_pi, s_01, ex.prior_a, ex.prior_b)
        variant = "exact" if eps == 0 else "biased"
        at = {**tags, "eps": float(eps)}
        out += [{**at, "variant": variant, "metric": m, "value": v} for m, v in (
            ("kl_terminal", kl_terminal), ("w2_terminal", w2_terminal), ("kl_path", kl_path),
            ("eps_sq", eps_sq), ("eps_l2", eps_l2), ("n_steps_actual", float(len(grid) - 1)),
            ("ratio_kl_bound", kl_path / float(bounds[KL_BOUND_OF[applicable]])))]
        out += [{**at, "variant": "bound", "metric": m, "value": float(v)} for m, v in bounds.items()
                if np.isfinite(v)]
    return out


def _slope_rows(rows: list[dict], min_n: int) -> list[dict]:
    """slope_<metric>: least-squares slope of log metric vs log h over the rates sweep's N ≥ min_n."""
    frame = pd.DataFrame([r for r in rows if r["delta"] == 0 and r["variant"] in ("exact", "biased")
                          and r["metric"] in ("kl_terminal", "kl_path", "w2_terminal")])
    if frame.empty:
        return []
    frame = frame[frame["n_steps"] >= min_n]
    out = []
    keys = ["variant", "coupling", "d", "eps", "v1", "sigma", "t_end", "delta", "schedule", "metric"]
    for key, part in frame.groupby(keys, sort=False):
        row = dict(zip(keys, key))
        metric = row.pop("metric")
        out.append({**row, "mode": "exact", "metric": f"slope_{metric}", "value": g.slope(part["h"], part["value"])})
    return out
