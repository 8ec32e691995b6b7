"""Tables and plots of `icml single-index report`, as the spec lists them.

Tables: escape times and slopes per target × variant × sign; the trap outcome; the passive mode;
the RKHS estimators (mean ± sd over seeds). Plots: m_t and risk vs log t per target; a_{k,t} of
he2_he4; log T½ vs log d with fitted and s−1 reference lines; the planted phase portrait of he2_he3;
RKHS |m| per iteration; learned vs true φ (sign-adjusted).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from icml.methods.single_index import METHOD
from icml.methods.single_index.config import ODE_VARIANTS, RKHS_VARIANTS, TARGETS, info_exponent
from icml.reports.plots import new_axes
from icml.reports.tables import Table, default_headline, fmt, metric_table

M, RISK = -1, -2
RISK_FLOOR = 1e-12  # a converged flow's risk is 0 to rounding: shown at the floor of the log axis
COLOURS = {"joint": "tab:blue", "planted": "tab:red", "l2_flow": "tab:green", "argmin_phi": "tab:purple",
           "save": "tab:orange", "sir": "tab:brown", "fixed_w": "tab:gray"}


def _eval(frame: pd.DataFrame, experiment: str) -> pd.DataFrame:
    return frame[(frame["phase"] == "eval") & (frame["experiment"] == experiment)]


def _rank(order):
    rank = {v: i for i, v in enumerate(order)}
    return lambda s: s.map(lambda v: rank.get(v, len(rank)))


def _value(rows: pd.DataFrame, metric: str) -> float:
    v = rows.loc[rows["metric"] == metric, "value"]
    return float(v.iloc[0]) if len(v) else float("nan")


# tables ----------------------------------------------------------------------------------------------
def reference_rate(target: str, variant: str) -> str:
    """The escape-time heuristic from m₀ = d^(−1/2): joint Θ(log d) for s = 1, Θ(d^(s−1)) for s ≥ 2;
    planted Θ(1), Θ(log d), Θ(d^((s−2)/2))."""
    s = info_exponent(target)
    if variant == "planted":
        return {1: "Θ(1)", 2: "log d"}.get(s, f"{(s - 2) / 2:g}")
    return "log d" if s == 1 else f"{s - 1:g}"


def _sweeps(frame: pd.DataFrame):
    rows = _eval(frame, "escape")
    groups = rows.groupby(["target", "variant", "sign"], sort=False)
    order = sorted(groups.groups, key=lambda key: (list(TARGETS).index(key[0]), ODE_VARIANTS.index(key[1]), -key[2]))
    return rows, [(key, groups.get_group(key)) for key in order]


def _sign(sign) -> str:
    return "+" if sign > 0 else "−"


def escape_table(frame: pd.DataFrame, config) -> Table:
    rows, sweeps = _sweeps(frame)
    d_grid = sorted(int(d) for d in rows["d"].dropna().unique())
    out = []
    for (target, variant, sign), group in sweeps:
        times = group[group["metric"] == "escape_time"].set_index("d")["value"]
        row = {"target": target, "variant": variant, "m₀": f"{_sign(sign)}d^(−1/2)"}
        row.update({f"d={d}": fmt(times.get(d, np.nan), 4) for d in d_grid})
        out.append(row)
    note = (f"first t with |m_t| ≥ ½ (ODE time, η = 1; inf: not before t_max = {config.ode.t_max:g}); a(0) = "
            f"{'a*' if config.ode.init_a == 'target' else '0'}")
    return Table("Escape times T½ (population ODE)", pd.DataFrame(out), note=note)


def slope_table(frame: pd.DataFrame, config) -> Table:
    rows, sweeps = _sweeps(frame)
    largest = rows["d"].max()
    out = []
    for (target, variant, sign), group in sweeps:
        times = group[(group["metric"] == "escape_time") & group["d"].notna()].set_index("d")["value"]
        fit = times[(times.index >= config.ode.slope_min_d) & np.isfinite(times.values)]
        per_log_d = np.polyfit(np.log(fit.index.astype(float)), fit.values, 1)[0] if len(fit) >= 2 else np.nan
        at_largest = group[group["d"] == largest]
        out.append({"target": target, "s": info_exponent(target), "variant": variant, "m₀ sign": _sign(sign),
                    "escape_slope": fmt(_value(group[group["d"].isna()], "escape_slope"), 3),
                    "expected": reference_rate(target, variant),
                    "dT½/dlog d": fmt(per_log_d, 3) if reference_rate(target, variant) == "log d" else "–",
                    f"final m (d={int(largest)})": fmt(_value(at_largest, "final_overlap"), 4),
                    "final_risk": fmt(_value(at_largest, "final_risk"), 3)})
    note = (f"escape_slope = least-squares slope of log T½ vs log d over d ≥ {config.ode.slope_min_d}; expected: "
            f"the heuristic rate (a log-d rate shows as dT½/dlog d ≈ const); final values at t_max")
    return Table("Escape-time scaling and final values", pd.DataFrame(out), {"final_risk": "lower"}, note)


def trap_table(frame: pd.DataFrame, config, trajectories: pd.DataFrame | None) -> Table:
    rows = _eval(frame, "trap")
    if rows.empty:
        return Table("Trap", pd.DataFrame(), note="no rows")
    out = []
    for variant, group in rows.groupby("variant", sort=False):
        row = {"variant": variant, "escape_time": fmt(_value(group, "escape_time"), 4),
               "final m": fmt(_value(group, "final_overlap"), 4), "final risk": fmt(_value(group, "final_risk"), 4),
               "coef_error": fmt(_value(group, "coef_error"), 3)}
        if trajectories is not None:
            traj = trajectories[(trajectories["experiment"] == "trap") & (trajectories["variant"] == variant)]
            last = traj[traj["t"] == traj["t"].max()].set_index("k")["value"]
            row.update({"final a₂": fmt(last.get(2, np.nan), 4), "final a₃": fmt(last.get(3, np.nan), 4)})
        out.append(row)
    table = pd.DataFrame(out).sort_values("variant", key=_rank(ODE_VARIANTS), kind="stable").reset_index(drop=True)
    return Table(f"Trap — φ* = h₂ + h₃ from m₀ = {config.ode.trap_m0:g}", table,
                 {"final risk": "lower", "coef_error": "lower"},
                 note="planted: stable fixed point m = −2/3, risk 50/27 ≈ 1.852; joint: the mirror solution "
                      "m → −1, a₃ → −1, risk → 0")


def passive_table(trajectories: pd.DataFrame | None) -> Table | None:
    if trajectories is None:
        return None
    traj = trajectories[(trajectories["experiment"] == "passive")]
    if traj.empty:
        return None
    out = []
    for variant, group in traj.groupby("variant", sort=False):
        wide = group.pivot_table(index="t", columns="k", values="value")
        a4, m = wide[4], wide[M]
        t_min = a4.idxmin()
        regrow = wide.index[(wide.index > t_min) & (a4 > 10 * a4.min())]
        t_up = regrow[0] if len(regrow) else np.nan
        out.append({"variant": variant, "a₄(0)": fmt(a4.iloc[0], 4), "min a₄": fmt(a4.min(), 3),
                    "t at min": fmt(t_min, 3), "m at min": fmt(m.loc[t_min], 3),
                    "t (a₄ > 10× min)": fmt(t_up, 4), "m then": fmt(m.loc[t_up] if len(regrow) else np.nan, 3),
                    "final a₄": fmt(a4.iloc[-1], 4), "final m": fmt(m.iloc[-1], 4)})
    return Table("Passive mode — φ* = (h₂ + h₄)/√2 from a(0) = a*", pd.DataFrame(out),
                 note="a₄ collapses to a*₄ m⁴ ≈ 0 while m is small (the fast phase), stays there through the slow "
                      "phase (partial equilibrium a_k ≈ a*_k m^k), and regrows once m crosses a threshold")


def rkhs_table(frame: pd.DataFrame) -> Table:
    rows = frame[(frame["phase"] == "eval") & (frame["solver"] == "rkhs")]
    experiment = rows["experiment"].iloc[0] if len(rows) else "rkhs"
    metrics = ["final_overlap", "overlap_abs", "test_mse", "final_risk", "coef_error", "train_mse"]
    n_seeds = rows["seed"].nunique()
    note = (f"mean ± sd over {n_seeds} seed(s); test_mse on fresh noiseless test points, final_risk = L(m, a) "
            "in closed form")
    if experiment == "user":
        note = f"user data, standardised; test_mse on the held-out split against y; {n_seeds} seed(s)"
    return metric_table(rows, "RKHS alternating estimator vs baselines (finite sample)", metrics, METHOD.metrics,
                        order=RKHS_VARIANTS, note=note)


def tables(frame: pd.DataFrame, config, run=None) -> list[Table]:
    trajectories = run.table("trajectories") if run is not None else None
    out = []
    if not _eval(frame, "escape").empty:
        out += [escape_table(frame, config), slope_table(frame, config)]
    if not _eval(frame, "trap").empty:
        out.append(trap_table(frame, config, trajectories))
    passive = passive_table(trajectories)
    if passive is not None:
        out.append(passive)
    if not frame[(frame["phase"] == "eval") & (frame["solver"] == "rkhs")].empty:
        out.append(rkhs_table(frame))
    elif not frame.empty:  # before eval: where training ended
        train = frame[frame["phase"] == "train"]
        last = train[train["step"] == train.groupby(["variant", "seed"])["step"].transform("max")]
        out.append(metric_table(last, "Estimators at the end of training",
                                ["overlap", "overlap_abs", "risk", "train_mse"], METHOD.metrics, order=RKHS_VARIANTS))
    return out


def headline(frame: pd.DataFrame) -> dict:
    out: dict = {}
    slopes = frame[(frame["phase"] == "eval") & (frame["metric"] == "escape_slope") & (frame["sign"] == 1)]
    if not slopes.empty:
        out["escape_slope"] = {f"{t}/{v}": float(x) for t, v, x in slopes[["target", "variant", "value"]].values}
    trap = _eval(frame, "trap")
    if not trap.empty:
        out["trap_final_overlap"] = trap[trap["metric"] == "final_overlap"].set_index("variant")["value"].to_dict()
    rkhs = frame[(frame["phase"] == "eval") & (frame["solver"] == "rkhs")]
    for metric in ("overlap_abs", "test_mse"):
        rows = rkhs[rkhs["metric"] == metric]
        if not rows.empty:
            out[f"rkhs_{metric}"] = rows.groupby("variant")["value"].mean().to_dict()
    return out or default_headline(frame, METHOD.metrics)


# plots -----------------------------------------------------------------------------------------------
def _wide(traj: pd.DataFrame) -> pd.DataFrame:
    return traj.pivot_table(index="t", columns="k", values="value")


def dynamics_plot(trajectories: pd.DataFrame, target: str):
    import matplotlib.pyplot as plt

    rows = trajectories[(trajectories["experiment"] == "escape") & (trajectories["target"] == target)]
    d = rows["d"].max()
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for (variant, m0), group in rows[rows["d"] == d].groupby(["variant", "m0"], sort=False):
        wide = _wide(group)
        wide = wide[wide.index > 0]
        style = "-" if m0 > 0 else "--"
        label = f"{variant}, m₀ = {'+' if m0 > 0 else '−'}d^(−1/2)"
        left.plot(wide.index, wide[M], style, color=COLOURS[variant], label=label, lw=1.2)
        right.plot(wide.index, np.maximum(wide[RISK], RISK_FLOOR), style, color=COLOURS[variant], lw=1.2)
    for axis, ylabel in ((left, "overlap m_t"), (right, "risk L(m_t, a_t)")):
        axis.set_xscale("log")
        axis.set_xlabel("t (η = 1)")
        axis.set_ylabel(ylabel)
    right.set_yscale("log")
    right.set_ylim(bottom=RISK_FLOOR)
    left.axhline(0, color="k", lw=0.5)
    left.legend(fontsize=6)
    figure.suptitle(f"{target} (s = {info_exponent(target)}), d = {int(d)}: joint vs planted")
    figure.tight_layout()
    return figure


def passive_plot(trajectories: pd.DataFrame):
    rows = trajectories[(trajectories["experiment"] == "passive") & (trajectories["variant"] == "joint")]
    wide = _wide(rows)
    wide = wide[wide.index > 0]
    d = int(rows["d"].iloc[0])
    figure, axis = new_axes(f"Passive mode: he2_he4 from a(0) = a*, m₀ = d^(−1/2), d = {d}", "t (η = 1)",
                            "a_k,t", xlog=True)
    for k in (2, 4):
        axis.plot(wide.index, wide[k], label=f"a_{k},t")
        axis.plot(wide.index, TARGETS["he2_he4"][k] * wide[M] ** k, ":", lw=1, label=f"a*_{k} m_t^{k}")
    axis.plot(wide.index, wide[M], "k-", lw=1.5, label="m_t")
    aligned = wide.index[wide[M].abs() > 0.999]
    if len(aligned):  # nothing moves after alignment: stop the axis a decade later
        axis.set_xlim(right=10 * aligned[0])
    axis.legend(fontsize=7)
    return figure


def escape_plot(frame: pd.DataFrame, config):
    rows = _eval(frame, "escape")
    rows = rows[(rows["metric"] == "escape_time") & (rows["sign"] == 1) & np.isfinite(rows["value"])]
    figure, axis = new_axes("Escape time T½ vs d (m₀ = +d^(−1/2)); dotted: reference slope s − 1",
                            "d", "T½", xlog=True, ylog=True, size=(6.8, 4.6))
    for (target, variant), group in rows.groupby(["target", "variant"], sort=False):
        if variant not in ("joint", "planted"):
            continue
        group = group.sort_values("d")
        d, t = group["d"].astype(float).values, group["value"].values
        line, = axis.plot(d, t, "o" if variant == "joint" else "s", ms=4,
                          label=f"{target} {variant}", mfc="none" if variant == "planted" else None)
        fit = d >= config.ode.slope_min_d
        if fit.sum() >= 2:
            slope, intercept = np.polyfit(np.log(d[fit]), np.log(t[fit]), 1)
            axis.plot(d, np.exp(intercept) * d ** slope, "-", color=line.get_color(), lw=1)
        if variant == "joint":
            s = info_exponent(target)
            ref = t[-1] * (d / d[-1]) ** (s - 1)
            axis.plot(d, ref, ":", color=line.get_color(), lw=1)
    axis.legend(fontsize=6, ncol=2)
    return figure


def phase_portrait(config):
    from icml.methods.single_index.hermite import target_coefficients
    from icml.methods.single_index.population import argmin_velocity, planted_fixed_points, planted_velocity

    a_star = target_coefficients("he2_he3", max(config.ode.K, 3))
    grid = np.linspace(-1, 1, 401)
    figure, axis = new_axes("he2_he3: ṁ(m), planted vs instantaneous-φ joint", "m", "ṁ")
    axis.plot(grid, [planted_velocity(m, a_star) for m in grid], color=COLOURS["planted"], label="planted")
    axis.plot(grid, [argmin_velocity(m, a_star) for m in grid], color=COLOURS["argmin_phi"],
              label="joint, a = a* m^k")
    for m, stable in planted_fixed_points(a_star) + [(-1.0, False), (1.0, True)]:
        axis.plot(m, 0, "o", color="k", mfc="k" if stable else "w", ms=6)
    axis.annotate("stable trap m = −2/3", (-2 / 3, 0), (-0.95, 1.0), fontsize=7, arrowprops={"arrowstyle": "->"})
    axis.axhline(0, color="k", lw=0.5)
    axis.legend(fontsize=7)
    return figure


def rkhs_overlap_plot(frame: pd.DataFrame):
    rows = frame[(frame["phase"] == "train") & (frame["metric"] == "overlap_abs")]
    figure, axis = new_axes("RKHS estimators: |m| per iteration (one line per seed)", "iteration", "|⟨w, w*⟩|")
    for variant, group in rows.groupby("variant", sort=False):
        for i, (_, curve) in enumerate(group.groupby("seed")):
            curve = curve.sort_values("step")
            kwargs = {"label": variant} if i == 0 else {}
            if curve["step"].max() == 0:  # one-shot baselines: a horizontal reference
                axis.axhline(curve["value"].iloc[0], color=COLOURS[variant], lw=0.8, ls="--", **kwargs)
            else:
                axis.plot(curve["step"], curve["value"], color=COLOURS[variant], lw=1, **kwargs)
    axis.set_ylim(0, 1.02)
    axis.legend(fontsize=7)
    return figure


def link_plot(trajectories: pd.DataFrame, config):
    from icml.methods.single_index.hermite import link, target_coefficients

    rows = trajectories[trajectories["solver"] == "rkhs"]
    figure, axis = new_axes("Learned φ(σz) vs true φ*(z), σ = sign(m) (first seed)", "z", "φ")
    z = np.linspace(-3, 3, 241)
    axis.plot(z, link(z, target_coefficients(config.rkhs.target, config.rkhs.K, unit_norm=True)), "k-", lw=2.5,
              alpha=0.4, label="φ*")
    first = rows["seed"].min()
    for variant, group in rows[rows["seed"] == first].groupby("variant", sort=False):
        last = _wide(group).iloc[-1]
        a = np.array([last[k] for k in range(config.rkhs.K + 1)])
        sigma = np.sign(last[M]) if M in last.index and last[M] != 0 else 1.0
        axis.plot(z, link(sigma * z, a), color=COLOURS[variant], lw=1, label=variant)
    axis.legend(fontsize=7)
    return figure


def plots(frame: pd.DataFrame, config, run=None) -> list:
    trajectories = run.table("trajectories") if run is not None else None
    out = []
    if trajectories is not None:
        for target in [t for t in TARGETS if t in set(trajectories["target"])]:
            if not trajectories[(trajectories["experiment"] == "escape") & (trajectories["target"] == target)].empty:
                out.append((f"dynamics {target}", dynamics_plot(trajectories, target)))
        if not trajectories[(trajectories["experiment"] == "passive")].empty:
            out.append(("passive mode he2_he4", passive_plot(trajectories)))
    if not _eval(frame, "escape").empty:
        out.append(("escape time vs d", escape_plot(frame, config)))
        out.append(("planted phase portrait he2_he3", phase_portrait(config)))
    if not frame[(frame["phase"] == "train") & (frame["metric"] == "overlap_abs")].empty:
        out.append(("rkhs overlap per iteration", rkhs_overlap_plot(frame)))
    estimators = trajectories[trajectories["solver"] == "rkhs"] if trajectories is not None else None
    if estimators is not None and config.data.path is None and estimators["k"].eq(M).any():  # φ* is known
        out.append(("learned vs true link", link_plot(trajectories, config)))
    return out
