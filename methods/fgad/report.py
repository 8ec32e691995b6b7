"""Tables and plots of `icml fgad report`: per-group detection quality of every variant
(client-weighted, pooled beside it), the views ablation, communication, and five plots."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd

from icml.methods.fgad.config import ABLATIONS, MAIN
from icml.reports.plots import new_axes
from icml.reports.claims import Claim
from icml.reports.groups import claims_table, judge_claims
from icml.reports.tables import Table, fmt, mean_sd

# The spec's expected results. One run already trains every grid seed (the `seeds` key, shifted by the run
# seed), so its report judges them over those seeds; a group of runs (`icml fgad report --group G`) judges
# them over run seeds, each run's arm being its mean over its grid seeds.
# Each grid seed injects its own anomalies, so a run's arm pools over their inject_ids on purpose.
CLAIMS = [
    Claim("mvfgad beats local_only at K = 10 (AUROC, all anomalies)", "auroc", "mvfgad", "local_only",
          where={"K": 10, "group": "all", "agg": "client_weighted"}, pool=("inject_id",)),
    Claim("mvfgad beats fedavg_dominant at K = 10 (AUROC, all anomalies)", "auroc", "mvfgad", "fedavg_dominant",
          where={"K": 10, "group": "all", "agg": "client_weighted"}, pool=("inject_id",)),
]

ORDER = MAIN + ABLATIONS
GROUP_ORDER = ["all", "str_strong", "str_weak", "ctx_strong", "ctx_weak"]
VIEWS = ["mvfgad", "view_attr", "view_smooth", "view_signed", "euclidean"]


def _rank(values, order):
    rank = {v: i for i, v in enumerate(order)}
    return values.map(lambda v: rank.get(v, len(rank)))


def _test(frame: pd.DataFrame, metric: str, agg: str | None = None) -> pd.DataFrame:
    rows = frame[(frame["phase"] == "eval") & (frame["metric"] == metric)]
    return rows if agg is None else rows[rows["agg"] == agg]


def _groups(rows: pd.DataFrame) -> list[str]:
    present = list(dict.fromkeys(rows["group"].dropna()))
    return sorted(present, key=lambda g: GROUP_ORDER.index(g) if g in GROUP_ORDER else len(GROUP_ORDER))


def _official(frame: pd.DataFrame) -> pd.DataFrame:
    """Without the diagnostic `<group>_intact` rows (eval: intact_members)."""
    return frame[~frame["group"].fillna("").str.endswith("_intact")]


def _intact_table(frame: pd.DataFrame) -> Table:
    """Each structural group beside its intact members, for the main arms."""
    intact = sorted(g for g in frame["group"].dropna().unique() if g.endswith("_intact"))
    wanted = [g for pair in ((g.removesuffix("_intact"), g) for g in intact) for g in pair]
    rows = frame[frame["group"].isin(wanted) & frame["variant"].isin(MAIN)]
    table = _group_table(rows, "auroc", title="Structural groups: all members vs intact cliques (diagnostic AUROC)",
                         note="<group>_intact = members keeping at least half of their clique edges inside their "
                              "client; Louvain and the anomaly moves strand the others, which are then no longer "
                              "structural anomalies in their client but still count in the official group")
    if not table.frame.empty:
        table.frame = table.frame[["variant", "K", "seeds"] + [g for g in wanted if g in table.frame.columns]]
    return table


def _group_table(frame: pd.DataFrame, metric: str, variants: list[str] | None = None, title: str = "",
                 note: str = "") -> Table:
    """variant × K rows, one column per group: client-weighted mean ± sd over seeds (pooled mean)."""
    weighted, pooled = _test(frame, metric, "client_weighted"), _test(frame, metric, "pooled")
    if variants is not None:
        weighted, pooled = weighted[weighted["variant"].isin(variants)], pooled[pooled["variant"].isin(variants)]
    if weighted.empty:
        return Table(title, pd.DataFrame(), note="no rows")
    out = []
    for (variant, k), rows in weighted.groupby(["variant", "K"], sort=False):
        row = {"variant": variant, "K": int(k), "seeds": rows["seed"].nunique()}
        for group in _groups(weighted):
            cell = rows[rows["group"] == group]["value"]
            pool = pooled[(pooled["variant"] == variant) & (pooled["K"] == k) & (pooled["group"] == group)]["value"]
            row[group] = f"{mean_sd(cell)} ({fmt(pool.mean(), 3)})"
        out.append(row)
    table = pd.DataFrame(out)
    table = table.sort_values(["variant", "K"], key=lambda s: _rank(s, ORDER) if s.name == "variant" else s,
                              kind="stable").reset_index(drop=True)
    return Table(title, table, {g: "higher" for g in _groups(weighted)}, note)


def _comm_table(frame: pd.DataFrame) -> Table:
    metrics = ["comm_bytes_per_round", "comm_bytes_total", "params_shared", "params_private", "wall_s",
               "cut_edge_frac", "u_density", "moved_nodes"]
    rows = frame[(frame["phase"] == "eval") & frame["metric"].isin(metrics)]
    if rows.empty:
        return Table("Communication and cost", pd.DataFrame())
    table = rows.pivot_table(index=["variant", "K"], columns="metric", values="value", aggfunc="mean").reset_index()
    table = table[["variant", "K"] + [m for m in metrics if m in table.columns]]
    table = table.sort_values(["variant", "K"], key=lambda s: _rank(s, ORDER) if s.name == "variant" else s,
                              kind="stable").reset_index(drop=True)
    return Table("Communication and cost (mean over seeds)", table,
                 {"comm_bytes_per_round": "lower", "comm_bytes_total": "lower", "wall_s": "lower"},
                 "bytes = 2·K·|θ_shared|·4 per round; mvfgad shares only the GCN, so its bytes equal fedavg_gcn's "
                 "whatever the private model's size; central_* and local_only communicate nothing")


def tables(frame: pd.DataFrame, config) -> list[Table]:
    if frame[frame["phase"] == "eval"].empty:
        loss = frame[(frame["metric"] == "loss")]
        last = loss[loss["step"] == loss.groupby(["variant", "stage", "K", "seed"])["step"].transform("max")]
        summary = last.groupby(["variant", "stage", "K"])["value"].mean().reset_index()
        return [Table("Final training loss (run eval for the full tables)", summary, {"value": "lower"})]
    cell = "client-weighted mean ± sd over seeds (pooled in brackets); test normals + that group's test anomalies"
    official = _official(frame)
    # the ablation seeds are the grid seeds that carry an ablation variant (config.ablation_seeds shifted by
    # the run seed, which the report does not know)
    ablation_seeds = sorted(int(s) for s in official.loc[official["variant"].isin(ABLATIONS), "seed"].unique())
    ablation = official[(official["K"] == config.ablation_K) & official["seed"].isin(ablation_seeds)]
    seeds = ", ".join(str(s) for s in ablation_seeds)
    out = [
        _group_table(official, "auroc", title="AUROC per anomaly group", note=cell),
        _group_table(official, "ap", title="AP per anomaly group", note=cell),
        _group_table(official, "recall_at_k", title="Recall@k per anomaly group", note=cell),
        _group_table(ablation, "auroc", VIEWS + ["local_only", "partition_random", "partition_metis"],
                     # one title for every run seed: a group report aligns the runs' tables by title
                     f"Ablations — AUROC at K={config.ablation_K}",
                     f"grid seed(s) {seeds}; single views and Euclidean scoring read the same mvfgad training, each "
                     "with its own validation-selected epoch; partition_* re-run mvfgad on another partition"),
        _comm_table(frame),
    ]
    intact = _intact_table(frame)
    return _grid_claims(official) + out + ([intact] if not intact.frame.empty else [])


def _grid_claims(official: pd.DataFrame) -> list[Table]:
    """The claims paired over the run's grid seeds (each seed's arms share its graph and partition)."""
    from icml.methods.fgad import METHOD

    seeds = sorted(int(s) for s in official["seed"].dropna().unique())
    if len(seeds) < 2:
        return []
    # one grid seed holds one injection: nothing to pool, and the claim names stay the same in every run
    # (a group report aligns the runs' rows by them)
    unpooled = [replace(claim, pool=()) for claim in CLAIMS]
    claims = judge_claims(unpooled, [official[official["seed"] == s] for s in seeds], METHOD.metrics)
    table = claims_table(claims, seeds)
    table.title = "claims (paired differences over the run's grid seeds)"  # not the group's, over run seeds
    return [table]


def headline(frame: pd.DataFrame) -> dict:
    rows = _test(frame, "auroc", "client_weighted")
    rows = rows[rows["group"] == "all"]
    if rows.empty:
        return {}
    at = rows[rows["K"] == rows["K"].max()]
    out = {"auroc": at.groupby("variant")["value"].mean().to_dict()}
    central = rows[rows["variant"].str.startswith("central_")]
    out["auroc"].update(central.groupby("variant")["value"].mean().to_dict())
    return out


# plots -----------------------------------------------------------------------------------------------------
def legend_outside(axis, **kw):
    """A legend to the right of the axes, so that it covers no data (the report's tight bbox keeps it)."""
    return axis.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=7, **kw)


def _auroc_vs_k(frame: pd.DataFrame):
    rows = _test(frame, "auroc", "client_weighted")
    rows = rows[(rows["group"] == "all") & rows["variant"].isin(MAIN)]
    figure, axis = new_axes("AUROC vs number of clients (all anomalies)", "K (clients)", "AUROC (client-weighted)")
    for variant, group in sorted(rows.groupby("variant"), key=lambda kv: ORDER.index(kv[0])):
        stats = group.groupby("K")["value"].agg(["mean", "std"]).fillna(0.0)
        if variant.startswith("central_"):
            axis.axhline(stats["mean"].iloc[0], ls="--", lw=1, label=f"{variant} (K=1)",
                         color="grey" if variant == "central_dominant" else "black")
        else:
            axis.errorbar(stats.index, stats["mean"], yerr=stats["std"], marker="o", capsize=3, label=variant)
    axis.set_xscale("log")
    ks = sorted(rows["K"].unique())
    axis.set_xticks(ks, [str(int(k)) for k in ks])
    legend_outside(axis)
    return figure


def _weak_vs_strong(frame: pd.DataFrame):
    rows = _test(frame, "auroc", "client_weighted")
    k_max = rows["K"].max()
    rows = rows[(rows["K"] == k_max) & rows["group"].isin(GROUP_ORDER[1:])
                & rows["variant"].isin(["mvfgad", "local_only", "fedavg_gcn", "fedavg_dominant"])]
    figure, axis = new_axes(f"Weak vs strong anomalies (K={k_max})", "anomaly group", "AUROC (client-weighted)")
    variants = [v for v in ORDER if v in set(rows["variant"])]
    groups = [g for g in GROUP_ORDER[1:] if g in set(rows["group"])]
    width = 0.8 / max(len(variants), 1)
    for i, variant in enumerate(variants):
        means = [rows[(rows["variant"] == variant) & (rows["group"] == g)]["value"].mean() for g in groups]
        axis.bar(np.arange(len(groups)) + i * width, means, width, label=variant)
    axis.set_xticks(np.arange(len(groups)) + 0.4 - width / 2, groups)
    axis.axhline(0.5, color="k", lw=0.8)
    axis.set_ylim(0, 1)
    legend_outside(axis)  # inside, it covered the tallest bars (AUROC near 1 is the common case)
    return figure


def _client_dots(clients: pd.DataFrame):
    rows = clients[clients["group"] == "all"]
    k_max = rows["K"].max()
    rows = rows[(rows["K"] == k_max)]
    variants = [v for v in ORDER if v in set(rows["variant"])]
    figure, axis = new_axes(f"Per-client test AUROC (K={k_max}, every seed)", "variant", "AUROC")
    for i, variant in enumerate(variants):
        values = rows[rows["variant"] == variant]["auroc"].dropna()
        jitter = np.random.default_rng(i).uniform(-0.15, 0.15, len(values))
        axis.scatter(i + jitter, values, s=10, alpha=0.7)
    axis.set_xticks(range(len(variants)), variants, rotation=45, ha="right", fontsize=7)
    return figure


def _partition_stats(frame: pd.DataFrame, clients: pd.DataFrame):
    """Client sizes (mvfgad's partitions) beside the share of edges each partition cuts; a panel without rows
    is left out (None when both are)."""
    import matplotlib.pyplot as plt

    sizes = clients[(clients["variant"] == "mvfgad") & (clients["group"] == "all")]
    sizes = sizes[sizes["seed"] == sizes["seed"].min()]
    cuts = frame[(frame["phase"] == "eval") & (frame["metric"] == "cut_edge_frac")]
    by_partition = cuts.groupby(["partition", "K"])["value"].mean().reset_index()
    panels = ([("sizes", max(3.0, 0.25 * (len(sizes) + sizes["K"].nunique())))] if not sizes.empty else []) \
        + ([("cuts", max(3.0, 0.6 * len(by_partition)))] if not by_partition.empty else [])  # widths from the bars
    if not panels:
        return None
    widths = [w for _, w in panels]
    figure, axes = plt.subplots(1, len(panels), figsize=(sum(widths) + 1.5 * len(panels), 3.8), squeeze=False,
                                gridspec_kw=dict(width_ratios=widths))
    for axis, (kind, _) in zip(axes[0], panels):
        if kind == "sizes":
            _client_sizes(axis, sizes)
            continue
        labels = [f"{p}\nK={int(k)}" for p, k in zip(by_partition["partition"], by_partition["K"])]
        axis.bar(range(len(labels)), by_partition["value"])
        axis.set_xticks(range(len(labels)), labels, fontsize=7)
        axis.set_title("Share of edges cut by the partition", fontsize=10)
        axis.set_ylabel("cut_edge_frac")
    figure.tight_layout()
    return figure


def _client_sizes(axis, sizes: pd.DataFrame) -> None:
    """Each client's node count as a bar, largest first, one group of bars per K (with N/K dotted: equal
    shares); a line through them read as a trend along a client index, which has no order of its own."""
    x0, centres, labels = 0, [], []
    for i, (k, group) in enumerate(sizes.groupby("K")):
        values = np.sort(group["n_nodes"].to_numpy())[::-1]
        xs = x0 + np.arange(len(values))
        axis.bar(xs, values, 0.8, color=f"C{i}")
        axis.hlines(values.sum() / len(values), xs[0] - 0.4, xs[-1] + 0.4, colors="k", linestyles=":", lw=1)
        centres.append(xs.mean())
        labels.append(f"K={int(k)}")
        x0 += len(values) + 1
    axis.set_xticks(centres, labels)
    seed = f", grid seed {int(sizes['seed'].iloc[0])}" if not sizes.empty else ""
    axis.set_title(f"Client sizes (Louvain, capped and balanced{seed})", fontsize=10)
    axis.set_xlabel("clients, largest first (dotted: N/K)")
    axis.set_ylabel("nodes")


def _score_histograms(histogram: pd.DataFrame):
    k = int(histogram["K"].iloc[0])
    figure, axis = new_axes(f"mvfgad test scores (K={k}, seed {int(histogram['seed'].iloc[0])})", "fused score",
                            "density")
    for group, curve in histogram.groupby("group", sort=False):
        curve = curve.sort_values("bin")
        axis.plot(curve["bin"], curve["density"], label=group, lw=2.5 if group == "normal" else 1.2,
                  color="black" if group == "normal" else None)
    legend_outside(axis)
    return figure


def plots(frame: pd.DataFrame, config, run=None) -> list:
    """The per-client and score-histogram plots read client_metrics / score_histogram.parquet."""
    evaluated = frame[frame["phase"] == "eval"]
    if evaluated.empty:
        return []
    out = [("AUROC vs K", _auroc_vs_k(frame))]
    if set(evaluated["group"].dropna()) & set(GROUP_ORDER[1:]):  # a user file has no anomaly types
        out.append(("weak vs strong", _weak_vs_strong(frame)))
    clients = run.table("client_metrics") if run is not None else None
    if clients is not None and not clients.empty:
        out.append(("per-client AUROC", _client_dots(clients)))
        partition = _partition_stats(frame, clients)
        if partition is not None:
            out.append(("partition statistics", partition))
    histogram = run.table("score_histogram") if run is not None else None
    if histogram is not None and not histogram.empty:
        out.append(("score histograms", _score_histograms(histogram)))
    return out
