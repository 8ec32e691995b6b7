"""Tables and plots of `icml reason-stop report`, as the spec lists them."""
from __future__ import annotations

import numpy as np
import pandas as pd

from icml.methods.reason_stop import METHOD
from icml.methods.reason_stop.config import VARIANTS
from icml.methods.reason_stop.controller import ACTIONS
from icml.methods.reason_stop.evaluation import FIRST_ERROR
from icml.reports.plots import new_axes
from icml.reports.tables import Table, default_headline, metric_table

MAIN = ["accuracy", "mean_tokens", "compression_rate", "probe_overhead_tokens", "total_tokens", "mean_atp_count"]
COUNTS = [f"n_{a}" for a in ACTIONS]
ENTROPY = ["delta_h_correct", "delta_h_wrong", "jump_repeat_fraction", "wall_time_s"]


def _eval(frame: pd.DataFrame, split: str = "test") -> pd.DataFrame:
    return frame[(frame["phase"] == "eval") & (frame["split"] == split)]


def _variants(rows: pd.DataFrame) -> list[str]:
    present = set(rows["variant"])
    return [v for v in VARIANTS if v in present]


def decoding_note(config) -> str:
    """Sampled runs say so in their tables (greedy, the spec's decoding, adds nothing)."""
    if config.temperature == 0:
        return ""
    return (f"; SAMPLED decoding (a deviation from the spec's greedy): temperature {config.temperature:g}, "
            f"top_p {config.top_p:g}, probes greedy")


def tables(frame: pd.DataFrame, config) -> list[Table]:
    train = frame[frame["phase"] == "train"]
    out = []
    rows = _eval(frame)
    if not rows.empty:
        out.append(metric_table(rows, "All test problems: accuracy and tokens per variant", MAIN + COUNTS,
                                METHOD.metrics, order=VARIANTS,
                                note="mean_tokens: thinking + jump-prompt/suffix + final answer tokens; "
                                     "probe tokens are counted apart (probe_overhead_tokens), never as savings; "
                                     "compression_rate = mean_tokens / mean_tokens(vanilla); n_*: actions per problem"
                                     + decoding_note(config)))
        hard = _eval(frame, FIRST_ERROR)
        if not hard.empty:
            out.append(metric_table(hard, "test_first_error: problems whose vanilla first-ATP probe answer is wrong",
                                    ["accuracy", "mean_tokens", "compression_rate"], METHOD.metrics, order=VARIANTS,
                                    note=f"{int(config.n_eval)} test problems in all" + decoding_note(config)))
        out.append(metric_table(rows, "Attention-entropy statistics and wall time", ENTROPY, METHOD.metrics,
                                order=VARIANTS,
                                note="ΔH at ATPs i>1 whose probe is correct / wrong; jump_repeat_fraction: jumps "
                                     "whose action repeated the previous one verbatim (a loop)"))
    if not train.empty:
        last = train[train["step"] == train.groupby("metric")["step"].transform("max")]
        out.append(metric_table(last, "Tiny reasoner at the end of training", ["train_loss", "val_loss"],
                                METHOD.metrics))
    return out


def headline(frame: pd.DataFrame) -> dict:
    rows = _eval(frame)
    if rows.empty:
        return default_headline(frame, METHOD.metrics)
    out = {}
    for metric in ("accuracy", "compression_rate", "mean_tokens", "total_tokens"):
        picked = rows[rows["metric"] == metric].groupby("variant")["value"].mean()
        out[metric] = {v: float(picked[v]) for v in VARIANTS if v in picked.index}
    hard = _eval(frame, FIRST_ERROR)
    picked = hard[hard["metric"] == "accuracy"].groupby("variant")["value"].mean()
    if not picked.empty:
        out["accuracy@test_first_error"] = {v: float(picked[v]) for v in VARIANTS if v in picked.index}
    return out


# plots -----------------------------------------------------------------------------------------
def probed_events(events: pd.DataFrame) -> pd.DataFrame:
    """ATPs with a probe, each once: variants on the same greedy prefix probe the same state."""
    picked = events[events["confidence"].notna()]
    return picked.drop_duplicates(["problem_id", "atp_index", "position", "confidence", "entropy_h"])


def _accuracy_vs_compression(rows: pd.DataFrame):
    figure, axis = new_axes("Accuracy vs compression rate", "compression_rate (tokens / vanilla)", "accuracy")
    wide = rows.pivot_table(index="variant", columns="metric", values="value", aggfunc="mean")
    for variant in _variants(rows):
        if {"accuracy", "compression_rate"} <= set(wide.columns):
            x, y = wide.loc[variant, "compression_rate"], wide.loc[variant, "accuracy"]
            axis.scatter([x], [y], s=30)
            axis.annotate(variant, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    return figure


def _delta_h_histogram(events: pd.DataFrame, alpha: float):
    figure, axis = new_axes("ΔH at ATPs i>1 by probe correctness", "ΔH = (H_i − H_1) / H_1", "ATPs")
    later = events[events["atp_index"] > 1]
    values = later["delta_h"].dropna()
    bins = np.linspace(min(values.min(), alpha) - 0.01, max(values.max(), alpha) + 0.01, 30) if len(values) else 10
    for label, flag in (("probe correct", True), ("probe wrong", False)):
        axis.hist(later.loc[later["probe_correct"] == flag, "delta_h"].dropna(), bins=bins, alpha=0.6, label=label)
    axis.axvline(alpha, color="k", ls="--", lw=1, label=f"α = {alpha:g}")
    axis.legend(fontsize=7)
    return figure


def _action_counts(rows: pd.DataFrame):
    figure, axis = new_axes("Actions per problem", "variant", "mean count per problem", size=(7.5, 4.0))
    variants = _variants(rows)
    bottom = np.zeros(len(variants))
    for action in ACTIONS:
        picked = rows[rows["metric"] == f"n_{action}"].groupby("variant")["value"].mean()
        heights = np.array([picked.get(v, 0.0) for v in variants])
        axis.bar(range(len(variants)), heights, bottom=bottom, label=action)
        bottom += heights
    axis.set_xticks(range(len(variants)), variants, rotation=30, ha="right", fontsize=7)
    axis.legend(fontsize=7)
    return figure


def _confidence_vs_delta_h(events: pd.DataFrame, lam: float, alpha: float):
    figure, axis = new_axes("Probe confidence vs ΔH (quadrants of λ and α)", "ΔH", "confidence C")
    later = events[events["atp_index"] > 1]
    for label, flag in (("probe correct", True), ("probe wrong", False)):
        picked = later[later["probe_correct"] == flag]
        axis.scatter(picked["delta_h"], picked["confidence"], s=6, alpha=0.5, label=label)
    axis.axhline(lam, color="k", ls="--", lw=1, label=f"λ = {lam:g}")
    axis.axvline(alpha, color="k", ls=":", lw=1, label=f"α = {alpha:g}")
    axis.legend(fontsize=7)
    return figure


def _entropy_traces(events: pd.DataFrame, variant: str, n: int = 8):
    figure, axis = new_axes(f"Attention entropy H_i along example generations ({variant})", "ATP index i",
                            "H_i (sum over heads of the last layers)")
    picked = events[events["variant"] == variant]
    longest = picked.groupby("problem_id")["atp_index"].max().sort_values(ascending=False).index[:n]
    for k, problem in enumerate(sorted(longest)):
        trace = picked[picked["problem_id"] == problem].sort_values("atp_index")
        axis.plot(trace["atp_index"], trace["entropy_h"], "-", color=f"C{k % 10}", lw=1, label=f"problem {problem}")
        right = trace["probe_correct"] == True  # noqa: E712
        axis.scatter(trace.loc[right, "atp_index"], trace.loc[right, "entropy_h"], color=f"C{k % 10}", marker="o", s=14)
        axis.scatter(trace.loc[~right, "atp_index"], trace.loc[~right, "entropy_h"], color=f"C{k % 10}", marker="x",
                     s=18)
    from matplotlib.ticker import MaxNLocator

    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.legend(fontsize=6, title="o probe correct · x wrong / none", title_fontsize=6)
    return figure


def plots(frame: pd.DataFrame, config, run=None) -> list:
    rows = _eval(frame)
    if rows.empty:
        return []
    out = [("accuracy vs compression", _accuracy_vs_compression(rows)), ("action counts", _action_counts(rows))]
    events = run.table("atp_events") if run is not None else None
    if events is not None and not events.empty:
        probed = probed_events(events)
        if not probed.empty:
            out.append(("delta-H histogram", _delta_h_histogram(probed, config.alpha)))
            out.append(("confidence vs delta-H", _confidence_vs_delta_h(probed, config.lam, config.alpha)))
        probing = events[events["confidence"].notna()]
        source = probing if not probing.empty else events  # the longest-running probing variant shows most ATPs
        traced = source.groupby("variant")["atp_index"].count().idxmax()
        out.append(("entropy traces", _entropy_traces(events, traced)))
    return out
