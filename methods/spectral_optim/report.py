"""Tables and plots of `icml spectral-optim report`, as the spec lists them."""
from __future__ import annotations

import numpy as np
import pandas as pd

from icml.methods.spectral_optim import METHOD
from icml.methods.spectral_optim.config import ABLATIONS, VARIANTS
from icml.reports.plots import new_axes
from icml.reports.claims import Claim
from icml.reports.tables import Table, default_headline, fmt

# The spec's expected results, judged over the seeds of a group (`icml spectral-optim report --group G`).
CLAIMS = [
    Claim("mSGD's LR sensitivity exceeds Adam's (lr_spread)", "lr_spread", "mSGD", "Adam", expect="higher"),
    Claim("the mSGD family's best-loss spread exceeds the Adam family's", "family_best_spread", "msgd", "adam",
          expect="higher"),
    Claim("p = 0 (mSGDZ, Muon) improves on plain mSGD's best loss", "best_val_loss", "mSGDZ", "mSGD"),
    Claim("p = ½ (mSGDS) improves on plain mSGD's best loss", "best_val_loss", "mSGDS", "mSGD"),
]

ORDER = VARIANTS + ABLATIONS
FAMILIES = {"adam": "Adam family (RMS-normalised)", "msgd": "mSGD family (momentum SGD)"}


def _ordered(frame: pd.DataFrame, column: str = "variant") -> pd.DataFrame:
    rank = {v: i for i, v in enumerate(ORDER)}
    return frame.sort_values(column, key=lambda s: s.map(lambda v: rank.get(v, len(rank))), kind="stable")


def _eval(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[frame["phase"] == "eval"]


def _runs(frame: pd.DataFrame) -> pd.DataFrame:
    """Final eval val_loss of every (variant, lr) run of the grid."""
    rows = _eval(frame)
    return rows[(rows["metric"] == "val_loss") & rows["lr_multiplier"].notna()]


def _variant_table(frame: pd.DataFrame) -> Table:
    rows = _eval(frame)
    summary = rows[rows["metric"].isin(["best_val_loss", "lr_spread", "diverged"]) & rows["family"].notna()
                   & rows["variant"].isin(ORDER)]
    train = frame[frame["phase"] == "train"]  # step time and state size are measured while training
    costs = train[train["metric"].isin(["step_ms", "optimizer_state_bytes"])]
    out = []
    for variant, group in summary.groupby("variant"):
        best = group[group["metric"] == "best_val_loss"]
        cost = costs[costs["variant"] == variant]
        out.append({
            "variant": variant,
            "family": group["family"].iloc[0],
            "p": group["p"].iloc[0],
            "best matrix LR": best["lr"].iloc[0] if not best.empty else np.nan,
            "best_val_loss": best["value"].iloc[0] if not best.empty else np.nan,
            "lr_spread": group.loc[group["metric"] == "lr_spread", "value"].max(),
            "diverged": group.loc[group["metric"] == "diverged", "value"].sum(),
            "step_ms": cost.loc[cost["metric"] == "step_ms", "value"].mean(),
            "optimizer_state_bytes": cost.loc[cost["metric"] == "optimizer_state_bytes", "value"].max(),
        })
    table = _ordered(pd.DataFrame(out)) if out else pd.DataFrame()
    better = {"best_val_loss": "lower", "lr_spread": "lower", "diverged": "lower", "step_ms": "lower",
              "optimizer_state_bytes": "lower"}
    n_lrs = _runs(frame).groupby("variant")["lr_multiplier"].nunique()
    note = (f"{int(n_lrs.max()) if not n_lrs.empty else 0} matrix LRs per variant; diverged = runs of the grid "
            "with a non-finite loss or a final val_loss above the initial one; step_ms = mean optimizer step")
    return Table("Optimizer variants — LR sweep on the tiny GPT", table, better, note)


def _grid_table(frame: pd.DataFrame) -> Table:
    runs = _runs(frame)
    if runs.empty:
        return Table("Final val_loss over the LR grid", pd.DataFrame())
    grid = runs.pivot_table(index="variant", columns="lr_multiplier", values="value", aggfunc="first")
    grid.columns = [f"×{m:g}" for m in grid.columns]
    grid = _ordered(grid.reset_index())
    return Table("Final val_loss over the LR grid (× the paper's matrix LR)", grid,
                 {c: "lower" for c in grid.columns if c != "variant"}, "nats per character")


def _family_table(frame: pd.DataFrame) -> Table:
    rows = _eval(frame)
    spreads = rows[rows["metric"] == "family_best_spread"][["variant", "value"]]
    spreads = spreads.rename(columns={"variant": "family", "value": "family_best_spread"})
    return Table("Family spreads — max − min of best_val_loss within a family", spreads.reset_index(drop=True),
                 note="the paper: RMS-normalised (Adam) updates are far less sensitive than momentum SGD")


def _shape(rows: pd.DataFrame) -> pd.Series:
    return rows["rows"].astype(int).astype(str) + "×" + rows["cols"].astype(int).astype(str)


def _by_kappa(rows: pd.DataFrame, index: list[str], aggfunc="first") -> pd.DataFrame:
    wide = rows.assign(shape=_shape(rows)).pivot_table(index=index, columns="kappa", values="value",
                                                      aggfunc=aggfunc)
    wide.columns = [f"κ={k:g}" for k in wide.columns]
    wide = wide.reset_index()
    if "p" in wide.columns:
        others = [c for c in index if c != "p"]
        wide = wide.sort_values(["p"] + others, ascending=[False] + [True] * len(others))
        wide["p"] = wide["p"].map(lambda p: f"{p:g}")
    return wide.reset_index(drop=True)


def _psi_tables(frame: pd.DataFrame) -> list[Table]:
    rows = _eval(frame)
    tables = []
    error = rows[rows["metric"] == "psi_rel_error"]
    if not error.empty:
        wide = _by_kappa(error, ["p", "damping", "shape"])
        tables.append(Table("Ψ_p relative error against a float64 SVD", wide,
                            {c: "lower" for c in wide.columns if c.startswith("κ=")},
                            "‖Ψ̂_p(O) − Ψ_p(O)‖_F / ‖Ψ_p(O)‖_F; "
                            "damping bounds the accuracy as κ grows"))
    exponent = rows[rows["metric"] == "psi_cond_exponent"]
    if not exponent.empty:
        tables.append(Table("Condition exponent log κ(Ψ̂_p(O)) / log κ(O) (ideal: p)",
                            _by_kappa(exponent, ["p", "damping", "shape"])))
    band = rows[rows["metric"].isin(["psi_sv_min", "psi_sv_max"])]
    if not band.empty:
        tables.append(Table("Singular values of Ψ̂₀(O) (÷ shape factor): a band around 1",
                            _by_kappa(band, ["shape", "metric"]),
                            note="quintic Newton–Schulz is not exactly orthogonal"))
    speed = rows[rows["metric"].isin(["psi_ms", "svd_ms", "psi_speedup"])]
    if not speed.empty:
        timing = speed.assign(shape=_shape(speed)).pivot_table(index=["shape", "p"], columns="metric",
                                                               values="value", aggfunc="median").reset_index()
        timing["p"] = timing["p"].map(lambda p: f"{p:g}")
        tables.append(Table("Ψ_p speed against torch.linalg.svd (this machine, one thread)", timing,
                            {"psi_ms": "lower", "svd_ms": "lower", "psi_speedup": "higher"},
                            "median ms per call after warm-up; Newton–Schulz and the coupled Newton iteration "
                            "are matmul-only, so their advantage is a GPU property"))
    return tables


def tables(frame: pd.DataFrame, config) -> list[Table]:
    if _eval(frame).empty:
        train = frame[(frame["phase"] == "train") & (frame["metric"] == "val_loss")]
        last = train[train["step"] == train.groupby(["variant", "lr_multiplier"])["step"].transform("max")]
        grid = last.pivot_table(index="variant", columns="lr_multiplier", values="value", aggfunc="first")
        grid.columns = [f"×{m:g}" for m in grid.columns]
        return [Table("val_loss at the end of training (run eval for the full tables)",
                      _ordered(grid.reset_index()), {c: "lower" for c in grid.columns})]
    return [_variant_table(frame), _grid_table(frame), _family_table(frame), *_psi_tables(frame)]


def headline(frame: pd.DataFrame) -> dict:
    rows = _eval(frame)
    out = {}
    for metric in ("best_val_loss", "lr_spread"):
        picked = rows[(rows["metric"] == metric) & rows["variant"].isin(ORDER)]
        if not picked.empty:
            out[metric] = picked.groupby("variant")["value"].first().to_dict()
    spreads = rows[rows["metric"] == "family_best_spread"]
    if not spreads.empty:
        out["family_best_spread"] = spreads.groupby("variant")["value"].first().to_dict()
    return out or default_headline(frame, METHOD.metrics)


# plots -----------------------------------------------------------------------------------------
def _lr_sweep(frame: pd.DataFrame):
    import matplotlib.pyplot as plt

    runs = _runs(frame)
    figure, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for axis, family in zip(axes, FAMILIES):
        for variant, group in _ordered(runs[runs["family"] == family]).groupby("variant", sort=False):
            group = group.sort_values("lr")
            axis.plot(group["lr"], group["value"], marker="o", label=variant)
        axis.set_xscale("log")
        axis.set_xlabel("matrix LR")
        axis.set_title(FAMILIES[family])
        axis.legend(fontsize=7)
    axes[0].set_ylabel("final val_loss (nats/char)")
    return figure


def _best_curves(frame: pd.DataFrame):
    rows = _eval(frame)
    best = rows[rows["metric"] == "best_val_loss"][["variant", "lr"]]
    train = frame[(frame["phase"] == "train") & (frame["metric"] == "train_loss")]
    figure, axis = new_axes("Training curves at each variant's best LR", "step", "train_loss")
    for variant, lr in _ordered(best).itertuples(index=False):
        curve = train[(train["variant"] == variant) & np.isclose(train["lr"], lr)].sort_values("step")
        axis.plot(curve["step"], curve["value"], label=f"{variant} (LR {fmt(lr, 2)})")
    axis.legend(fontsize=7)
    return figure


def _psi_error(frame: pd.DataFrame):
    rows = _eval(frame)
    err = rows[(rows["metric"] == "psi_rel_error") & rows["p"].isin([0.5, 0.25])]
    figure, axis = new_axes("Ψ_p accuracy: the damping bounds it as κ grows",
                            "κ(O)", "relative error vs SVD", xlog=True, ylog=True)
    for (p, damping), group in err.groupby(["p", "damping"]):
        worst = group.groupby("kappa")["value"].max()  # over shapes
        axis.plot(worst.index, worst.values, marker="o", ls="-" if damping == "on" else "--",
                  label=f"p={p:g}, damping {damping} (worst shape)")
    axis.legend(fontsize=7)
    return figure


def _psi_speed(frame: pd.DataFrame):
    rows = _eval(frame)
    speed = rows[rows["metric"].isin(["psi_ms", "svd_ms"])]
    figure, axis = new_axes("Time vs size on this machine",
                            "matrix entries (rows × cols)", "ms per call", xlog=True, ylog=True)
    size = speed["rows"] * speed["cols"]  # entries
    for (metric, p), group in speed.assign(size=size).groupby(["metric", "p"]):
        if metric == "svd_ms" and p != speed["p"].max():
            continue  # the SVD costs the same whatever p
        curve = group.groupby("size")["value"].median()
        label = "torch.linalg.svd" if metric == "svd_ms" else f"Ψ_{p:g} (matmul-only)"
        axis.plot(curve.index, curve.values, marker="o", label=label, ls="--" if metric == "svd_ms" else "-")
    axis.legend(fontsize=7)
    return figure


def _ns_band(frame: pd.DataFrame):
    rows = _eval(frame)
    band = rows[rows["metric"].isin(["psi_sv_min", "psi_sv_max"])]
    figure, axis = new_axes("Quintic Newton–Schulz: a band around 1, not exact orthogonality",
                            "κ(O)", "singular values of Ψ̂₀(O)", xlog=True)
    for shape_name, group in band.assign(shape=_shape(band)).groupby("shape"):
        low = group[group["metric"] == "psi_sv_min"].set_index("kappa")["value"].sort_index()
        high = group[group["metric"] == "psi_sv_max"].set_index("kappa")["value"].sort_index()
        line, = axis.plot(low.index, low.values, marker="v", label=f"{shape_name} min")
        axis.plot(high.index, high.values, marker="^", color=line.get_color(), label=f"{shape_name} max")
    axis.axhline(1.0, color="k", lw=0.8)
    axis.legend(fontsize=6, ncol=2)
    return figure


def plots(frame: pd.DataFrame, config) -> list:
    rows = _eval(frame)
    out = []
    if not _runs(frame).empty:
        out.append(("val_loss vs matrix LR", _lr_sweep(frame)))
    if not rows[rows["metric"] == "best_val_loss"].empty:
        out.append(("training curves at the best LR", _best_curves(frame)))
    if not rows[rows["metric"] == "psi_rel_error"].empty:
        out.append(("psi error vs kappa", _psi_error(frame)))
    if not rows[rows["metric"] == "psi_ms"].empty:
        out.append(("psi time vs size", _psi_speed(frame)))
    if not rows[rows["metric"] == "psi_sv_min"].empty:
        out.append(("psi_0 singular values", _ns_band(frame)))
    return out
