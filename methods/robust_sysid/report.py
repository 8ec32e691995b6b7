"""Tables and plots of `icml robust-sysid report`: error vs memory p per estimator and q, the fitted
decay rate against ρ, error vs q per attack (with the breakdown q), the bias floor in T, exact recovery,
the optimality checks of every fit; plots of the same, the IRLS trace and the residual histogram."""
from __future__ import annotations

import numpy as np
import pandas as pd

from icml.methods.robust_sysid.config import ESTIMATORS
from icml.reports.plots import new_axes
from icml.reports.tables import Table, fmt, mean_sd

ORDER = ESTIMATORS + ["truth"]
COLORS = {"l2_irls": "C0", "l2_cvx": "C9", "ls": "C3", "huber": "C2", "lad_coordwise": "C1", "truth": "k"}


def _ordered(frame: pd.DataFrame) -> pd.DataFrame:
    rank = {v: i for i, v in enumerate(ORDER)}
    return frame.assign(_rank=frame["variant"].map(lambda v: rank.get(v, len(rank)))).sort_values(
        [c for c in ("attack", "q") if c in frame.columns] + ["_rank"], kind="stable").drop(columns="_rank")


def _rows(frame: pd.DataFrame, experiment: str, metric: str, phase: str = "eval") -> pd.DataFrame:
    return frame[(frame["phase"] == phase) & (frame["experiment"] == experiment) & (frame["metric"] == metric)]


def _wide(rows: pd.DataFrame, index: list[str], column: str) -> pd.DataFrame:
    """index rows × one column per value of `column`, each cell mean ± sd over seeds."""
    if rows.empty:
        return pd.DataFrame()
    cells = rows.groupby(index + [column], dropna=False)["value"].apply(mean_sd).unstack(column)
    cells.columns = [f"{column}={_label(c)}" for c in cells.columns]
    table = cells.reset_index()
    rank = {v: i for i, v in enumerate(ORDER)}
    keys = [k for k in index if k != "variant"]
    table = table.assign(_rank=table["variant"].map(lambda v: rank.get(v, len(rank))))
    return table.sort_values(keys + ["_rank"], kind="stable").drop(columns="_rank").reset_index(drop=True)


def _label(value) -> str:
    if isinstance(value, float) and value.is_integer() and value > 1:
        return str(int(value))
    return fmt(value, 3) if isinstance(value, float) else str(value)


def breakdown_q(curve: pd.Series, threshold: float) -> float:
    """The first q (ascending) whose mean param_error_rel exceeds `threshold`; NaN if none does."""
    above = curve[curve > threshold]
    return float(above.index.min()) if not above.empty else float("nan")


def _reference_table(frame: pd.DataFrame) -> Table:
    rows = frame[(frame["phase"] == "train") & (frame["split"] == "fit")]
    metrics = ["param_error", "param_error_rel", "objective", "objective_gap_truth", "objective_gap_ls",
               "subgrad_norm", "optimality_residual_rel", "pred_error", "irls_iters", "fit_seconds", "truncation_norm", "attack_rate"]
    if rows.empty:
        return Table("Reference problem (train)", pd.DataFrame(), note="no rows")
    table = rows.pivot_table(index="variant", columns="metric", values="value", aggfunc="mean").reset_index()
    table = _ordered(table)[["variant"] + [m for m in metrics if m in table.columns]]
    first = rows.iloc[0]
    where = (f"user trajectory, p={int(first['p'])}, T={int(first['T'])}" if first["experiment"] == "user" else
             f"p={int(first['p'])}, q={first['q']:g}, T={int(first['T'])}, {first['attack']} attack on the "
             f"{first['attack_on']}, {first['input']} inputs, system seed {int(first['system_seed'])}")
    table = table.astype(object).map(lambda v: fmt(v) if isinstance(v, float) else v)
    return Table(f"Reference problem (train): {where}", table,
                 {m: "lower" for m in ("param_error", "param_error_rel", "objective", "pred_error", "subgrad_norm")},
                 "objective = (1/T)Σ‖y_t − Θ̂φ_t‖₂ for every variant; gaps ≤ 0 certify an optimal ℓ₂ fit; "
                 "truth = Θ*_p = [CB, CAB, …, CA^{p-1}B]")


def _decay_table(frame: pd.DataFrame, config) -> Table:
    rows = frame[(frame["phase"] == "eval") & (frame["metric"] == "decay_rate")]
    if rows.empty:
        return Table("decay_rate vs ρ", pd.DataFrame(), note="no p_sweep rows")
    rho = max(abs(v) for v in config.system.rho_spectrum)
    table = rows.groupby(["attack", "q", "variant"])["value"].apply(mean_sd).reset_index(name="decay_rate")
    table = _ordered(table)
    table["variant"] = table["variant"].replace({"truth": "truth (‖CA^p‖)"})
    table["rho"] = fmt(rho, 3)
    low, high = config.decay_p
    return Table(f"decay_rate = exp(slope of log param_error vs p), p ∈ [{low}, {high}], vs ρ", table.reset_index(drop=True),
                 note="≈ ρ when the error is set by the truncated memory; ≈ 1 when it does not improve with p")


def _q_table(frame: pd.DataFrame, config) -> Table:
    rows = _rows(frame, "q_sweep", "param_error")
    if rows.empty:
        return Table("q_sweep", pd.DataFrame(), note="no rows")
    table = _wide(rows, ["attack", "variant"], "q")
    rel = _rows(frame, "q_sweep", "param_error_rel").groupby(["attack", "variant", "q"])["value"].mean()
    table["breakdown_q"] = [fmt(breakdown_q(rel.loc[(a, v)], config.breakdown_rel), 3)
                            for a, v in zip(table["attack"], table["variant"])]
    p = int(rows["p"].iloc[0])
    return Table(f"param_error vs attack probability q (p={p}, T={int(rows['T'].iloc[0])})", table,
                 note=f"mean ± sd over seeds; breakdown_q = first q with mean param_error_rel > {config.breakdown_rel:g}")


def _diagnostics_table(frame: pd.DataFrame, config) -> Table:
    rows = frame[(frame["phase"] == "eval") & frame["variant"].isin(ESTIMATORS)]
    metrics = {"subgrad_norm": "max", "optimality_residual_rel": "max", "objective_gap_truth": "max", "objective_gap_ls": "max", "irls_iters": "max",
               "fit_seconds": "mean"}
    rows = rows[rows["metric"].isin(metrics)]
    if rows.empty:
        return Table("Fit diagnostics", pd.DataFrame())
    maxima = rows[rows["metric"].map(metrics) == "max"].groupby(["experiment", "variant", "metric"])["value"].max()
    means = rows[rows["metric"].map(metrics) == "mean"].groupby(["experiment", "variant", "metric"])["value"].mean()
    table = pd.concat([maxima, means])
    table = table.unstack("metric").reset_index()
    table = _ordered(table)[["experiment", "variant"] + [m for m in metrics if m in table.columns]]
    table = table.map(lambda v: fmt(v, 3) if isinstance(v, float) else v)
    return Table("Fit diagnostics (max over fits; fit_seconds: mean)", table.reset_index(drop=True),
                 note="for the ℓ₂ fits: objective_gap_truth ≤ 0 and objective_gap_ls ≤ 0 (optimality), "
                      f"optimality_residual_rel ≤ irls.grad_tol = {config.irls.grad_tol:g} (the IRLS stop: dist(0, ∂f) "
                      "÷ ‖Φ‖_rms with kink residuals as zero); subgrad_norm (zero-residual terms left out) stays "
                      "up to ‖φ_t‖/T at a kink; fit_seconds is amortised over a batch of same-shape problems")


def tables(frame: pd.DataFrame, config) -> list[Table]:
    out = [_reference_table(frame)]
    evaluated = frame[frame["phase"] == "eval"]
    if evaluated.empty:
        return out
    if (evaluated["experiment"] == "user_p_sweep").any():
        rows = _rows(frame, "user_p_sweep", "pred_error")
        out.append(Table("User trajectory: held-out pred_error vs p", _wide(rows, ["variant"], "p"),
                         note="mean ‖y − Θ̂φ‖₂ on the last 20 % of the trajectory"))
        return out
    sweep = _rows(frame, "p_sweep", "param_error")
    if not sweep.empty:
        out.append(Table(f"param_error vs memory p (T={int(sweep['T'].iloc[0])})", _wide(sweep, ["attack", "q", "variant"], "p"),
                         note="‖Θ̂ − Θ*_p‖_F, mean ± sd over seeds; q = 0 is the same data under every attack"))
        truncation = _rows(frame, "p_sweep", "truncation_norm").groupby("p")["value"].first()
        out.append(Table("Truncation ‖CA^p‖₂ (the ρ^p-scale reference)",
                         pd.DataFrame([{f"p={int(p)}": fmt(v, 3) for p, v in truncation.items()}])))
    out.append(_decay_table(frame, config))
    out.append(_q_table(frame, config))
    floor = _rows(frame, "t_sweep", "param_error")
    if not floor.empty:
        out.append(Table(f"Bias floor: param_error vs T (q={floor['q'].iloc[0]:g}, {floor['attack'].iloc[0]} attack)",
                         _wide(floor, ["p", "variant"], "T"),
                         note="at fixed p the ρ^p truncation term, not the sample size, sets the ℓ₂ error"))
    recovery = _rows(frame, "recovery", "param_error")
    if not recovery.empty:
        p = int(recovery["p"].iloc[0])
        truncation = _rows(frame, "recovery", "truncation_norm")["value"].iloc[0]
        out.append(Table(f"Recovery: noise 0, ρ = {config.recovery_rho:g}, p = {p} (‖CA^p‖ = {fmt(truncation, 3)})",
                         _wide(recovery, ["variant"], "q"),
                         note="param_error; the ℓ₂ estimator recovers Θ*_p up to the truncation term, LS does not"))
    out.append(_diagnostics_table(frame, config))
    return out


def headline(frame: pd.DataFrame) -> dict:
    out = {}
    reference = frame[(frame["phase"] == "train") & (frame["split"] == "fit")]
    errors = reference[reference["metric"] == "param_error"]
    if not errors.empty:
        out["param_error"] = errors.groupby("variant")["value"].mean().to_dict()
    decay = frame[(frame["phase"] == "eval") & (frame["metric"] == "decay_rate")]
    if not decay.empty:
        top = decay[decay["q"] == decay["q"].max()]
        out["decay_rate"] = top.groupby("variant")["value"].mean().to_dict()
    return out


# plots ---------------------------------------------------------------------------------------------
def _error_vs_p(frame: pd.DataFrame, config):
    import matplotlib.pyplot as plt

    rows = _rows(frame, "p_sweep", "param_error")
    attack = config.attacks[0]
    rows = rows[rows["attack"] == attack]
    qs = sorted(rows["q"].unique())
    truncation = _rows(frame, "p_sweep", "truncation_norm").groupby("p")["value"].first()
    rho = max(abs(v) for v in config.system.rho_spectrum)
    figure, axes = plt.subplots(1, len(qs), figsize=(5.2 * len(qs), 4), sharey=True, squeeze=False)
    for axis, q in zip(axes[0], qs):
        cell = rows[rows["q"] == q]
        for variant in [v for v in ORDER if v in set(cell["variant"])]:
            curve = cell[cell["variant"] == variant].groupby("p")["value"].mean()
            axis.plot(curve.index, curve.values, marker="o", ms=3, label=variant, color=COLORS.get(variant))
        ps = np.array(sorted(cell["p"].unique()), dtype=float)
        anchor = cell[(cell["variant"] == "l2_irls") & (cell["p"] == ps.min())]["value"].mean()
        if np.isfinite(anchor):
            axis.plot(ps, anchor * rho ** (ps - ps.min()), "k:", label=f"∝ ρ^p (ρ={rho:g})")
        axis.plot(truncation.index, truncation.values, "k--", lw=1, label="‖CA^p‖₂")
        axis.set_yscale("log")
        axis.set_title(f"param_error vs p ({attack}, q={q:g})")
        axis.set_xlabel("memory p")
    axes[0][0].set_ylabel("‖Θ̂ − Θ*_p‖_F (mean over seeds)")
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    return figure


def _error_vs_q(frame: pd.DataFrame, config):
    import matplotlib.pyplot as plt

    rows = _rows(frame, "q_sweep", "param_error")
    rel = _rows(frame, "q_sweep", "param_error_rel")
    attacks = [a for a in config.attacks if a in set(rows["attack"])]
    figure, axes = plt.subplots(1, len(attacks), figsize=(5 * len(attacks), 4), sharey=True, squeeze=False)
    for axis, attack in zip(axes[0], attacks):
        cell = rows[rows["attack"] == attack]
        for variant in [v for v in ORDER if v in set(cell["variant"])]:
            curve = cell[cell["variant"] == variant].groupby("q")["value"].mean()
            axis.plot(curve.index, curve.values, marker="o", ms=3, label=variant, color=COLORS.get(variant))
        l2 = rel[(rel["attack"] == attack) & (rel["variant"] == "l2_irls")].groupby("q")["value"].mean()
        q_break = breakdown_q(l2, config.breakdown_rel) if not l2.empty else float("nan")
        if np.isfinite(q_break):
            axis.axvline(q_break, color=COLORS["l2_irls"], ls=":", label=f"ℓ₂ breakdown q={q_break:g}")
        axis.set_yscale("log")
        axis.set_title(f"param_error vs q ({attack})")
        axis.set_xlabel("attack probability q")
    axes[0][0].set_ylabel("‖Θ̂ − Θ*_p‖_F")
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    return figure


def _error_vs_t(frame: pd.DataFrame):
    rows = _rows(frame, "t_sweep", "param_error")
    figure, axis = new_axes("param_error vs T (bias floor)", "T (samples)", "‖Θ̂ − Θ*_p‖_F", xlog=True, ylog=True)
    styles = ["-", "--", ":", "-."]
    for i, p in enumerate(sorted(rows["p"].unique())):
        for variant in [v for v in ORDER if v in set(rows["variant"])]:
            curve = rows[(rows["p"] == p) & (rows["variant"] == variant)].groupby("T")["value"].mean()
            axis.plot(curve.index, curve.values, styles[i % 4], marker="o", ms=3, color=COLORS.get(variant),
                      label=f"{variant}, p={int(p)}")
    axis.legend(fontsize=6, ncol=2)
    return figure


def _irls_trace(frame: pd.DataFrame):
    rows = frame[(frame["phase"] == "train") & (frame["split"] == "trace")].sort_values("step")
    figure, axis = new_axes("IRLS objective (reference problem)", "iteration (0 = least squares)",
                            "objective − final (1/T Σ‖r_t‖₂)", ylog=True)
    gap = rows["value"].to_numpy() - rows["value"].min()
    axis.plot(rows["step"].to_numpy()[gap > 0], gap[gap > 0], marker="o", ms=3, color=COLORS["l2_irls"])
    return figure


def _residual_histogram(residuals: pd.DataFrame):
    import matplotlib.pyplot as plt

    variants = [v for v in ("l2_irls", "ls") if v in set(residuals["variant"])]
    figure, axes = plt.subplots(1, len(variants), figsize=(5.2 * len(variants), 4), squeeze=False)
    top = residuals["residual_norm"].max()
    bins = np.logspace(np.log10(max(residuals["residual_norm"].min(), 1e-12)), np.log10(top), 50)
    for axis, variant in zip(axes[0], variants):
        cell = residuals[residuals["variant"] == variant]
        axis.hist(cell.loc[~cell["attacked"], "residual_norm"], bins=bins, alpha=0.7, label="clean times")
        axis.hist(cell.loc[cell["attacked"], "residual_norm"], bins=bins, alpha=0.7, color="C3", label="attacked times")
        axis.set_xscale("log")
        axis.set_title(f"‖y_t − Θ̂φ_t‖₂ of {variant}")
        axis.set_xlabel("residual norm")
        axis.legend(fontsize=7)
    axes[0][0].set_ylabel("count")
    figure.tight_layout()
    return figure


def plots(frame: pd.DataFrame, config, run=None) -> list:
    """The residual histogram reads residuals.parquet (train)."""
    out = []
    if not frame[(frame["phase"] == "train") & (frame["split"] == "trace")].empty:
        out.append(("IRLS objective trace", _irls_trace(frame)))
    residuals = run.table("residuals") if run is not None else None
    if residuals is not None and not residuals.empty:
        out.append(("residual histogram", _residual_histogram(residuals)))
    if not _rows(frame, "p_sweep", "param_error").empty:
        out.append(("param_error vs p", _error_vs_p(frame, config)))
    if not _rows(frame, "q_sweep", "param_error").empty:
        out.append(("param_error vs q", _error_vs_q(frame, config)))
    if not _rows(frame, "t_sweep", "param_error").empty:
        out.append(("param_error vs T", _error_vs_t(frame)))
    return out
