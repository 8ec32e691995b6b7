"""Tables and plots of `icml rl-sgd report`, as the spec lists them."""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from icml.methods.rl_sgd import METHOD
from icml.methods.rl_sgd.config import ARMS
from icml.reports.plots import new_axes
from icml.reports.tables import Table, default_headline, fmt

DENSITIES = ["update_density_bf16", "update_density_bf16_matrices", "update_density_tol", "update_density_fp32"]


def _eval(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[frame["phase"] == "eval"]


def _ordered(table: pd.DataFrame, column: str = "variant") -> pd.DataFrame:
    rank = {v: i for i, v in enumerate(["theta0", *ARMS])}
    return table.sort_values(column, key=lambda s: s.map(lambda v: rank.get(v, len(rank))), kind="stable")


def _selected(frame: pd.DataFrame) -> pd.DataFrame:
    """Eval metrics of each arm's best-LR run, one row per arm."""
    rows = _eval(frame)
    rows = rows[rows["selected"] == "true"]
    if rows.empty:
        return pd.DataFrame()
    wide = rows.pivot_table(index=["variant", "lr", "regime", "optimizer", "master_dtype"], columns="metric",
                            values="value", aggfunc="first").reset_index()
    return _ordered(wide).reset_index(drop=True)


def _n_params(run) -> float:
    table = run.table("param_updates") if run is not None else None
    if table is None or table.empty:
        return float("nan")
    first = table[table["run_id"] == table["run_id"].iloc[0]]
    return float(first.groupby(["variant", "lr"])["numel"].sum().iloc[0])


def _accuracy_table(frame: pd.DataFrame, best: pd.DataFrame) -> Table:
    theta0 = _eval(frame)
    theta0 = theta0[(theta0["variant"] == "theta0") & (theta0["metric"] == "accuracy")]["value"]
    table = best[["variant", "regime", "optimizer", "lr", "best_accuracy", "wall_time_s"]].rename(
        columns={"lr": "best LR"})
    note = (f"θ₀ (the SFT warm start) accuracy {fmt(theta0.iloc[0], 3)}; " if not theta0.empty else "") + \
        "greedy exact match on the held-out problems; best LR = argmax over the arm's grid"
    return Table("Accuracy per arm at its best LR", table, {"best_accuracy": "higher", "wall_time_s": "lower"}, note)


def _sparsity_table(best: pd.DataFrame, config) -> Table:
    columns = ["variant", "master_dtype", *[c for c in DENSITIES if c in best], "effective_rank_99",
               "effective_rank_99_bf16"]
    table = best[[c for c in columns if c in best]].copy()
    sgd = best.loc[best["variant"] == "sgd", "update_density_bf16"]
    if not sgd.empty and sgd.iloc[0] > 0:
        table["bf16 density ÷ sgd's"] = best["update_density_bf16"] / sgd.iloc[0]
    return Table("Update sparsity and effective rank (best-LR runs)", table,
                 note="densities: fraction of entries changed — bf16: bf16(θ_T) ≠ bf16(θ₀); tol: |Δ| > tolerance "
                      "on the bf16 snapshots; fp32: any change of the masters against the fp32 θ₀ (the wrong lens; "
                      "for a bf16-master run the initial cast of θ₀ alone makes it ≈ 1); effective_rank_99: mean over "
                      f"2-D weights of r₉₉(ΔW)/min(m, n), ΔW of the {config.rank_source} "
                      f"{'masters' if config.rank_source == 'fp32' else 'snapshots'} (a bf16-master run's from "
                      "bf16(θ₀)); effective_rank_99_bf16: ΔW of the bf16 snapshots")


def _memory_table(best: pd.DataFrame, n_params: float) -> Table:
    table = best[["variant", "optimizer", "optimizer_state_bytes"]].copy()
    table["bytes per parameter"] = table["optimizer_state_bytes"] / n_params
    return Table("Optimizer-state memory at the end of training", table, {"optimizer_state_bytes": "lower"},
                 note=f"{n_params:,.0f} parameters; Σ numel × element_size over optimizer.state "
                      "(scalar step counters included)")


def _gap_table(frame: pd.DataFrame, best: pd.DataFrame) -> Table:
    rows = _eval(frame)
    gaps = rows[rows["metric"] == "gap_adamw_minus_sgd"]
    out = []
    for regime, adam, sgd in (("rl", "adamw", "sgd"), ("sft", "sft_adamw", "sft_sgd")):
        lookup = best.set_index("variant")["best_accuracy"] if not best.empty else pd.Series(dtype=float)
        gap = gaps.loc[gaps["regime"] == regime, "value"]
        out.append({"regime": regime, "best AdamW": lookup.get(adam, np.nan), "best SGD": lookup.get(sgd, np.nan),
                    "gap_adamw_minus_sgd": gap.iloc[0] if not gap.empty else np.nan})
    return Table("AdamW − SGD accuracy gap: SFT vs RL", pd.DataFrame(out),
                 note="the paper: the gap that SFT shows (Adam ahead) closes under RL")


def _grid_table(frame: pd.DataFrame) -> Table:
    rows = _eval(frame)
    rows = rows[(rows["metric"] == "accuracy") & rows["lr"].notna()]
    out = []
    for variant, group in rows.groupby("variant"):
        cells = ", ".join(f"{fmt(lr, 2)}: {fmt(acc, 3)}" for lr, acc in sorted(zip(group["lr"], group["value"])))
        out.append({"variant": variant, "LR: accuracy": cells})
    return Table("Held-out accuracy over each arm's LR grid", _ordered(pd.DataFrame(out)) if out else pd.DataFrame())


def tables(frame: pd.DataFrame, config, run=None) -> list[Table]:
    best = _selected(frame)
    if best.empty:  # trained, not evaluated: the selection accuracies of train
        train = frame[(frame["phase"] == "train") & (frame["metric"] == "accuracy")]
        return [Table("Held-out accuracy after training (run eval for the full tables)",
                      _ordered(train[["variant", "lr", "value"]].rename(columns={"value": "accuracy"})),
                      {"accuracy": "higher"})]
    return [_accuracy_table(frame, best), _sparsity_table(best, config), _memory_table(best, _n_params(run)),
            _gap_table(frame, best), _grid_table(frame)]


def headline(frame: pd.DataFrame) -> dict:
    best = _selected(frame)
    if best.empty:
        return default_headline(frame, METHOD.metrics)
    out = {m: best.set_index("variant")[m].to_dict() for m in ("best_accuracy", "update_density_bf16",
                                                               "effective_rank_99") if m in best}
    gaps = _eval(frame)
    gaps = gaps[gaps["metric"] == "gap_adamw_minus_sgd"]
    if not gaps.empty:
        out["gap_adamw_minus_sgd"] = gaps.set_index("regime")["value"].to_dict()
    return out


# plots -----------------------------------------------------------------------------------------
def _reward_curves(frame: pd.DataFrame, best: pd.DataFrame):
    train = frame[(frame["phase"] == "train") & (frame["metric"] == "reward_mean")]
    figure, axis = new_axes("GRPO reward at each arm's best LR", "step", "reward_mean (10-step mean)")
    for variant, lr in best.loc[best["regime"] == "rl", ["variant", "lr"]].itertuples(index=False):
        curve = train[(train["variant"] == variant) & np.isclose(train["lr"], lr)].sort_values("step")
        axis.plot(curve["step"], curve["value"].rolling(10, min_periods=1).mean(), label=f"{variant} ({fmt(lr, 2)})")
    axis.legend(fontsize=7)
    return figure


def _accuracy_vs_lr(frame: pd.DataFrame):
    rows = _eval(frame)
    rows = rows[(rows["metric"] == "accuracy") & rows["lr"].notna()]
    figure, axis = new_axes("Held-out accuracy vs LR", "LR", "accuracy", xlog=True)
    for variant, group in _ordered(rows).groupby("variant", sort=False):
        group = group.sort_values("lr")
        axis.plot(group["lr"], group["value"], marker="o", ls="--" if variant.startswith("sft_") else "-",
                  label=variant)
    axis.legend(fontsize=7)
    return figure


def _accuracy_vs_density(frame: pd.DataFrame):
    rows = _eval(frame)
    rows = rows[rows["lr"].notna()]
    wide = rows.pivot_table(index=["variant", "lr"], columns="metric", values="value", aggfunc="first").reset_index()
    figure, axis = new_axes("Accuracy vs bf16 update density (every run of every grid)",
                            "update_density_bf16", "accuracy", xlog=True)
    for variant, group in _ordered(wide).groupby("variant", sort=False):
        axis.scatter(group["update_density_bf16"].clip(lower=1e-7), group["accuracy"], label=variant, s=18,
                     marker="x" if variant.startswith("sft_") else "o")
    axis.legend(fontsize=7)
    return figure


def _density_bars(best: pd.DataFrame):
    figure, axis = new_axes("bf16 update density at the best LR", "arm", "fraction of entries changed", ylog=True,
                            size=(7.5, 4.0))
    x = np.arange(len(best))
    axis.bar(x - 0.2, best["update_density_bf16"].clip(lower=1e-7), width=0.4, label="bf16 (all)")
    axis.bar(x + 0.2, best["update_density_tol"].clip(lower=1e-7), width=0.4, label="|Δ| > tol")
    axis.set_xticks(x, best["variant"], rotation=30, ha="right", fontsize=7)
    axis.legend(fontsize=7)
    figure.tight_layout()
    return figure


LAYER = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.weight$")


def _heatmap(updates: pd.DataFrame, best: pd.DataFrame):
    import matplotlib.pyplot as plt

    arms = [a for a in ("adamw", "sgd") if a in set(best["variant"])] or list(best["variant"][:2])
    grids = {}
    for arm in arms:
        lr = best.loc[best["variant"] == arm, "lr"].iloc[0]
        rows = updates[(updates["variant"] == arm) & np.isclose(updates["lr"], lr)]
        parsed = rows["param_name"].str.extract(LAYER)
        rows = rows.assign(layer=parsed[0], matrix=parsed[1]).dropna(subset=["layer"])
        grid = rows.pivot_table(index="layer", columns="matrix", values="density_bf16", aggfunc="first")
        grids[arm] = (lr, grid.reindex(sorted(grid.index, key=int)))
    logs = {arm: np.log10(grid.values.astype(float).clip(1e-7)) for arm, (_, grid) in grids.items()}
    low = min((v.min() for v in logs.values() if v.size), default=-7.0)  # one colour scale: panels compare
    figure, axes = plt.subplots(1, len(arms), figsize=(5 * len(arms), 3.6), squeeze=False)
    for axis, arm in zip(axes[0], arms):
        lr, grid = grids[arm]
        image = axis.imshow(logs[arm], aspect="auto", cmap="viridis", vmin=low, vmax=0.0)
        axis.set_xticks(range(len(grid.columns)), grid.columns, rotation=30, fontsize=7)
        axis.set_yticks(range(len(grid.index)), grid.index)
        axis.set_ylabel("layer")
        axis.set_title(f"{arm} (lr {fmt(lr, 2)}): log10 bf16 density", fontsize=9)
        figure.colorbar(image, ax=axis)
    figure.tight_layout()
    return figure


def _rank_histogram(updates: pd.DataFrame, best: pd.DataFrame):
    figure, axis = new_axes("Effective rank r₉₉/min(m,n) of each weight delta (best-LR runs)",
                            "r₉₉ / min(m, n)", "weights")
    bins = np.linspace(0, 1, 21)
    for variant, lr in best[["variant", "lr"]].itertuples(index=False):
        rows = updates[(updates["variant"] == variant) & np.isclose(updates["lr"], lr) & updates["max_rank"].notna()]
        if not rows.empty:
            axis.hist(rows["effective_rank_99"] / rows["max_rank"], bins=bins, histtype="step", label=variant)
    axis.legend(fontsize=7)
    return figure


def _gap_bars(frame: pd.DataFrame):
    rows = _eval(frame)
    gaps = rows[rows["metric"] == "gap_adamw_minus_sgd"].set_index("regime")["value"]
    figure, axis = new_axes("AdamW − SGD best accuracy", "regime", "gap (accuracy points)")
    axis.bar(gaps.index, gaps.values, color=["tab:blue" if r == "rl" else "tab:orange" for r in gaps.index])
    axis.axhline(0, color="k", lw=0.8)
    return figure


def plots(frame: pd.DataFrame, config, run=None) -> list:
    best = _selected(frame)
    if best.empty:
        return []
    out = [("reward curves at the best LR", _reward_curves(frame, best)),
           ("accuracy vs LR", _accuracy_vs_lr(frame)),
           ("accuracy vs update density", _accuracy_vs_density(frame)),
           ("bf16 update density", _density_bars(best))]
    updates = run.table("param_updates") if run is not None else None
    if updates is not None and not updates.empty:
        out += [("per-layer bf16 density", _heatmap(updates, best)),
                ("effective-rank histogram", _rank_histogram(updates, best))]
    if not _eval(frame)[_eval(frame)["metric"] == "gap_adamw_minus_sgd"].empty:
        out.append(("SFT vs RL gap", _gap_bars(frame)))
    return out
