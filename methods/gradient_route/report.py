"""Tables and plots of `icml gradient-route report`, as the spec lists them.

CR summaries are averaged over the profiles within a seed (profile=mean rows), then over seeds,
with 90% t-intervals when a run holds several seeds.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from icml.methods.gradient_route import METHOD
from icml.methods.gradient_route.config import VARIANTS
from icml.reports.plots import new_axes
from icml.reports.tables import Table, default_headline, fmt

SUMMARY = ["core_cr", "retain_cr", "forget_cr", "elicited_cr", "elicit_gain_cr"]
BETTER = {m: METHOD.metrics[m] for m in SUMMARY}
ROLE_MARK = {"retain": "R", "forget": "F", "core": ""}


def _eval(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[frame["phase"] == "eval"]


def _rank(values: pd.Series) -> pd.Series:
    order = {v: i for i, v in enumerate(VARIANTS)}
    return values.map(lambda v: order.get(v, len(order)))


def t_interval(values: pd.Series, digits: int = 3) -> str:
    """mean ± the 90% t-interval's half-width over seeds (the mean alone for one seed)."""
    from scipy.stats import t

    values = values.dropna()
    if values.empty:
        return "–"
    if len(values) == 1:
        return fmt(values.iloc[0], digits)
    half = t.ppf(0.95, len(values) - 1) * values.std(ddof=1) / np.sqrt(len(values))
    return f"{fmt(values.mean(), digits)} ± {fmt(half, 2)}"


def _summary_table(frame: pd.DataFrame) -> Table:
    rows = _eval(frame)
    rows = rows[(rows["profile"] == "mean") & rows["metric"].isin(SUMMARY)]
    # forget_cr on val (the deployed model's) is the headline; elicitation lives on val_heldout
    rows = rows[~((rows["metric"] == "forget_cr") & (rows["split"] == "val_heldout"))]
    if rows.empty:
        return Table("Compute ratios per variant (mean over profiles)", pd.DataFrame())
    table = rows.pivot_table(index="variant", columns="metric", values="value", aggfunc=t_interval)
    table = table.reindex(columns=[m for m in SUMMARY if m in table.columns]).reset_index()
    table = table.sort_values("variant", key=_rank).fillna("–").reset_index(drop=True)
    n_seeds = rows["seed"].nunique()
    return Table("Compute ratios per variant (mean over profiles)", table, BETTER,
                 f"{n_seeds} seed(s){'; mean ± 90% t-interval' if n_seeds > 1 else ''}. CR = baseline training "
                 "the loss is worth ÷ the baseline's; forget_cr on val, elicited_cr = min val_heldout loss of the "
                 "relearning attack; elicit_gain_cr = elicited − forget CR on val_heldout")


def _profile_table(frame: pd.DataFrame) -> Table:
    rows = _eval(frame)
    rows = rows[rows["metric"].isin(SUMMARY) & (rows["profile"] != "mean")]
    rows = rows[~((rows["metric"] == "forget_cr") & (rows["split"] == "val_heldout"))]
    if rows.empty:
        return Table("Compute ratios per profile", pd.DataFrame())
    table = rows.pivot_table(index=["variant", "profile"], columns="metric", values="value", aggfunc="mean")
    table = table.reindex(columns=[m for m in SUMMARY if m in table.columns]).reset_index()
    table = table.sort_values(["variant", "profile"], key=lambda s: _rank(s) if s.name == "variant" else s)
    return Table("Compute ratios per profile", table.reset_index(drop=True), BETTER,
                 "profile all = every module kept (GRAM's all-on profile)")


def _grid_table(frame: pd.DataFrame, metric: str, title: str, note: str) -> Table:
    rows = _eval(frame)
    rows = rows[(rows["metric"] == metric) & (rows["split"] == "val") & rows["dataset"].notna()]
    rows = rows[~rows["dataset"].str.match(r"^t\d+$")]
    if rows.empty:
        return Table(title, pd.DataFrame())
    values = rows.groupby(["variant", "profile", "dataset"])["value"].mean()
    roles = rows.groupby(["variant", "profile", "dataset"])["role"].first()
    cells = [f"{fmt(v, 3)}{' ' + ROLE_MARK[r] if ROLE_MARK.get(r) else ''}" for v, r in zip(values, roles)]
    grid = pd.Series(cells, index=values.index).unstack("dataset").reset_index()
    datasets = [c for c in grid.columns if c not in ("variant", "profile")]
    grid = grid[["variant", "profile"] + sorted(datasets, key=lambda d: (d != "core", d))]
    grid = grid.sort_values(["variant", "profile"], key=lambda s: _rank(s) if s.name == "variant" else s)
    return Table(title, grid.fillna("–").reset_index(drop=True), note=note)


def _cost_table(frame: pd.DataFrame) -> Table:
    train = frame[frame["phase"] == "train"]
    out = []
    for variant, group in train.groupby("variant"):
        def mean(metric, g=group):
            picked = g[g["metric"] == metric]["value"]
            return picked.mean() if not picked.empty else np.nan

        walls = group[(group["metric"] == "wall_s") & (group["split"] == "train")]
        freq = group[group["metric"] == "routing_freq"]
        out.append({"variant": variant, "train_flops_ratio": mean("train_flops_ratio"),
                    "serve_params_ratio": mean("serve_params_ratio"), "compute_lambda": mean("compute_lambda"),
                    "observed p_cr": freq.loc[freq["dataset"] == "core", "value"].mean(),
                    "observed p_as": freq.loc[freq["dataset"] != "core", "value"].mean(),
                    "train wall_s": walls.groupby("seed")["value"].sum().mean() if not walls.empty else np.nan})
    table = pd.DataFrame(out)
    if not table.empty:
        table = table.sort_values("variant", key=_rank).reset_index(drop=True)
    return Table("Costs", table, {"train_flops_ratio": "lower", "serve_params_ratio": "lower", "train wall_s": "lower"},
                 "flops = Σ tokens × active parameters over a variant's models ÷ the baseline's; serve params = "
                 "parameters that serve every profile ÷ the baseline's; λ = GRAM's compute-matching token scale; "
                 "wall times on a shared machine")


def _fit_table(frame: pd.DataFrame) -> Table:
    rows = frame[frame["metric"].isin(["fit_a", "fit_alpha", "fit_s0", "fit_rmse"])]
    if rows.empty:
        return Table("Power-law fits of the baseline curves", pd.DataFrame())
    table = rows.pivot_table(index=["dataset", "split"], columns="metric", values="value", aggfunc="first")
    table = table.reset_index().sort_values(["split", "dataset"], key=lambda s: s.map(
        lambda d: (not str(d).startswith("core"), str(d))))
    return Table("Power-law fits of the baseline curves: L(s) = A (s + s₀)^−α", table.reset_index(drop=True),
                 {"fit_rmse": "lower"}, "s in baseline optimizer steps; rmse of log-loss residuals; a WSD decay bends "
                 "the curve so the fit runs to large α and s₀, where A overflows (inf) — CRs use log A (fits.parquet)")


def _titration_table(frame: pd.DataFrame) -> Table:
    rows = _eval(frame)
    rows = rows[rows["metric"] == "titration_cr"]
    if rows.empty:
        return Table("Titration", pd.DataFrame())
    table = rows.pivot_table(index="weight", columns="dataset", values="value", aggfunc="mean").reset_index()
    module = rows["profile"].iloc[0].split("+")[-1]
    return Table(f"Titration of module {module}: CR at output weight w", table,
                 note="monotone in w on the module's dataset, flat on core")


def _maxent_sweep_table(frame: pd.DataFrame) -> Table:
    """Each λ of MaxEnt's sweep against the filtered model on the held-apart select windows, and how
    often the rule (least filter_distance) chose it."""
    title = "MaxEnt λ sweep on held-apart windows (select split)"
    train = frame[frame["phase"] == "train"]
    crs = train[train["metric"] == "maxent_select_cr"]
    if crs.empty:
        return Table(title, pd.DataFrame())
    scores = train[train["metric"] == "maxent_select_score"]
    chosen = train[train["metric"] == "maxent_lambda"]
    # as the summary: datasets → role, profiles → seed, then the interval over seeds
    per_seed = (crs.groupby(["variant", "weight", "seed", "profile", "role"], dropna=False)["value"].mean()
                .groupby(["variant", "weight", "seed", "role"], dropna=False).mean())
    table = per_seed.groupby(["variant", "weight", "role"], dropna=False).agg(t_interval).unstack("role")
    table = table.reindex(columns=[r for r in ("core", "retain", "forget") if r in table.columns])
    table.columns = [f"{role}_cr" for role in table.columns]
    table = table.reset_index()
    score = scores.groupby(["weight", "seed"])["value"].mean().groupby("weight").agg(t_interval)
    table["select_score"] = [score.get(w, "–") if v == "maxent" else "–" for v, w in zip(table["variant"], table["weight"])]
    table["chosen"] = [f"{int((chosen['value'] == w).sum())}/{len(chosen)}" if v == "maxent" else "–"
                       for v, w in zip(table["variant"], table["weight"])]
    table = table.rename(columns={"weight": "λ"}).sort_values(["variant", "λ"], key=lambda s: _rank(s) if s.name ==
                                                              "variant" else s).fillna("–").reset_index(drop=True)
    return Table(title, table, {"select_score": "lower"},
                 "CR through the baseline's val fits, mean over profiles, then over seeds (± 90% t-interval); select_score "
                 "= mean over roles of the mean squared CR gap to the filtered model (the released code's MaxEnt "
                 "objective); chosen = (profile, seed) pairs whose MaxEnt kept this λ")


def tables(frame: pd.DataFrame, config) -> list[Table]:
    if _eval(frame).empty:
        train = frame[(frame["phase"] == "train") & (frame["metric"] == "train_loss")]
        last = train[train["step"] == train.groupby(["variant", "profile", "seed"], dropna=False)["step"].transform("max")]
        table = last.groupby(["variant", "profile"], dropna=False)["value"].mean().reset_index()
        return [Table("train_loss at the end of training (run eval for the full tables)",
                      table.rename(columns={"value": "train_loss"}).fillna("–"), {"train_loss": "lower"}),
                _cost_table(frame), _maxent_sweep_table(frame), _fit_table(frame)]
    return [_summary_table(frame), _profile_table(frame), _maxent_sweep_table(frame),
            _grid_table(frame, "cr", "CR per profile × dataset (val)", "R = retained module's dataset, "
                        "F = forgotten; baseline rows show the dense model under each profile's roles"),
            _grid_table(frame, "val_loss", "Raw val_loss per profile × dataset (nats per character)",
                        "R = retained, F = forgotten"),
            _titration_table(frame), _cost_table(frame), _fit_table(frame)]


def headline(frame: pd.DataFrame) -> dict:
    rows = _eval(frame)
    rows = rows[(rows["profile"] == "mean") & rows["metric"].isin(SUMMARY)
                & ~((rows["metric"] == "forget_cr") & (rows["split"] == "val_heldout"))]
    if rows.empty:
        return default_headline(frame, METHOD.metrics)
    out: dict = {}
    for (metric, variant), value in rows.groupby(["metric", "variant"])["value"].mean().items():
        out.setdefault(metric, {})[variant] = float(value)
    return out


# --- plots ----------------------------------------------------------------------------------------------
def _profile_bars(frame: pd.DataFrame):
    import matplotlib.pyplot as plt

    rows = _eval(frame)
    rows = rows[rows["metric"].isin(["core_cr", "retain_cr", "forget_cr"]) & (rows["split"] == "val")
                & ~rows["profile"].isin(["mean", "all"])]
    variants = [v for v in VARIANTS if v in set(rows["variant"]) and v != "baseline"]
    profiles = sorted(rows["profile"].unique(), key=lambda p: (p != "core", p))
    figure, axes = plt.subplots(1, len(profiles), figsize=(3.6 * len(profiles), 3.6), sharey=True, squeeze=False)
    width = 0.8 / max(1, len(variants))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, profile in zip(axes[0], profiles):
        picked = rows[rows["profile"] == profile].groupby(["variant", "metric"])["value"].mean()
        for k, variant in enumerate(variants):
            for j, metric in enumerate(["core_cr", "retain_cr", "forget_cr"]):
                value = picked.get((variant, metric), np.nan)
                axis.bar(j + (k - (len(variants) - 1) / 2) * width, value, width, color=colors[k % len(colors)],
                         hatch="//" if metric == "forget_cr" else None, edgecolor="k", lw=0.4,
                         label=variant if j == 0 else None)
        axis.axhline(1.0, color="k", lw=0.8, ls=":")
        axis.set_xticks(range(3), ["core", "retain", "forget"])
        axis.set_title(profile)
    axes[0][0].set_ylabel("CR (baseline = 1)")
    axes[0][0].legend(fontsize=7)
    figure.suptitle("CR per profile (hatched: forget, lower is better)")
    figure.tight_layout()
    return figure


def _curves(frame: pd.DataFrame, run):
    from icml.methods.gradient_route.pipeline import read_fits

    curve = frame[(frame["phase"] == "train") & (frame["variant"] == "baseline") & (frame["metric"] == "val_loss")
                  & (frame["split"] == "val") & ~frame["dataset"].str.match(r"^t\d+$", na=False)]
    fits = read_fits(run)
    figure, axis = new_axes("Baseline validation curves and fitted power laws", "baseline step", "val_loss",
                            xlog=True, ylog=True)
    for dataset, group in curve.groupby("dataset"):
        points, = axis.plot(group["step"], group["value"], "o", ms=3, label=dataset)
        if (dataset, "val") in fits:
            s = np.linspace(group["step"].min(), group["step"].max(), 100)
            axis.plot(s, fits[(dataset, "val")][0](s), color=points.get_color(), lw=1)
    axis.legend(fontsize=7)
    return figure


def _elicitation(run):
    table = run.table("elicit")
    figure, axis = new_axes("Relearning attack: held-out forget loss vs round", "round", "val_heldout loss")
    if "lr_divisor" not in table:  # runs from before the lr grid
        table = table.assign(lr_divisor=4.0)
    for (variant, divisor), group in table.groupby(["variant", "lr_divisor"]):
        curve = group.groupby("round")["loss"].mean()  # over profiles, forget datasets and seeds
        axis.plot(curve.index, curve.values, marker=".", label=f"{variant} lr/{divisor:g}")
    axis.legend(fontsize=7)
    return figure


def _forget_vs_elicited(frame: pd.DataFrame):
    rows = _eval(frame)
    rows = rows[(rows["split"] == "val_heldout") & rows["metric"].isin(["forget_cr", "elicited_cr"])
                & ~rows["profile"].isin(["mean", "all"])]
    wide = rows.pivot_table(index=["variant", "profile"], columns="metric", values="value", aggfunc="mean").dropna()
    figure, axis = new_axes("Forget CR before and after the attack (val_heldout)", "forget_cr", "elicited_cr")
    for variant, group in wide.groupby(level="variant"):
        axis.plot(group["forget_cr"], group["elicited_cr"], "o", label=variant)
    low = np.nanmin(wide.values) if wide.size else 0
    high = np.nanmax(wide.values) if wide.size else 1
    axis.plot([low, high], [low, high], "k:", lw=0.8, label="no recovery")
    axis.legend(fontsize=7)
    return figure


def _titration(frame: pd.DataFrame):
    rows = _eval(frame)
    rows = rows[rows["metric"] == "titration_cr"]
    figure, axis = new_axes("Titration: module output weight w", "w", "CR")
    for dataset, group in rows.groupby("dataset"):
        curve = group.groupby("weight")["value"].mean()
        axis.plot(curve.index, curve.values, marker="o", label=dataset)
    axis.legend(fontsize=7)
    return figure


def plots(frame: pd.DataFrame, config, run=None) -> list:
    out = []
    rows = _eval(frame)
    if run is not None and run.table_path("fits").exists():
        out.append(("baseline curves and power laws", _curves(frame, run)))
    if not rows[rows["metric"] == "forget_cr"].empty:
        out.append(("cr per profile", _profile_bars(frame)))
    if not rows[rows["metric"] == "elicited_cr"].empty:
        out.append(("forget vs elicited", _forget_vs_elicited(frame)))
        if run is not None and run.table_path("elicit").exists():
            out.append(("elicitation loss vs round", _elicitation(run)))
    if not rows[rows["metric"] == "titration_cr"].empty:
        out.append(("titration", _titration(frame)))
    return out
