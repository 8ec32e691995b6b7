"""Tables and plots of `icml metaphor-bench report`: arms × (overall, strict, 8 type scores, n_scored)
per split and judge, retrieval diagnostics, the perception/mapping error split, example items with
their references; plots of the error split, overall vs hops/top_k, reference lengths and one item's
sampled frames."""
from __future__ import annotations

import pandas as pd

from icml.methods.metaphor_bench import TYPE_METRICS
from icml.methods.metaphor_bench.config import VARIANTS
from icml.methods.metaphor_bench.protocol import OFFICIAL_PER_TYPE_NOTE
from icml.reports.plots import new_axes
from icml.reports.tables import Table, fmt

SPLITS = ["test_heldout", "test_seen", "official"]
MAIN = ["overall", "overall_all", "strict_pct"] + TYPE_METRICS + ["n_scored"]
RETRIEVAL = ["keyword_recall", "retrieval_node_acc", "reference_hit_rate", "ref_chars_mean", "ref_truncated_frac",
             "parse_fail_rate", "judge_fail_rate"]
ERRORS = ["error_perception_frac", "error_mapping_frac", "mapping_acc_given_elements"]


def _eval(frame):
    return frame[frame["phase"] == "eval"]


def _pivot(frame, metrics):
    rows = _eval(frame)
    rows = rows[rows["metric"].isin(metrics)]
    if rows.empty:
        return pd.DataFrame()
    table = rows.pivot_table(index=["split", "judge", "variant"], columns="metric", values="value",
                             aggfunc="mean").reset_index()
    rank = {v: i for i, v in enumerate(VARIANTS)}
    srank = {s: i for i, s in enumerate(SPLITS)}
    table = table.sort_values(["split", "variant"], key=lambda s: s.map(srank if s.name == "split" else rank))
    table = table.reindex(columns=["split", "judge", "variant"] + metrics)  # a type without items shows "–"
    for m in metrics:
        table[m] = table[m].map(lambda v: fmt(v, 3))
    return table.reset_index(drop=True)


def tables(frame: pd.DataFrame, config, run=None) -> list[Table]:
    if _eval(frame).empty:
        loss = frame[frame["metric"].isin(["train_loss", "val_loss"])]
        last = loss.sort_values("step").groupby("metric").tail(1)[["metric", "step", "value"]]
        return [Table("Training loss (run eval for the full tables)", last.reset_index(drop=True), {"value": "lower"})]
    out = [Table("Scores per arm and metaphor type (loose × 10; strict %)", _pivot(frame, MAIN),
                 {m: "higher" for m in MAIN if m != "n_scored"},
                 "overall = mean(loose)×10 over judged items (official); overall_all counts unparsed items as 0. "
                 "Per-type: " + OFFICIAL_PER_TYPE_NOTE),
           Table("MetaphorBoost retrieval and parsing", _pivot(frame, RETRIEVAL),
                 {"keyword_recall": "higher", "retrieval_node_acc": "higher", "reference_hit_rate": "higher",
                  "parse_fail_rate": "lower", "judge_fail_rate": "lower"}),
           Table("Error split among failures (loose < 7)", _pivot(frame, ERRORS),
                 {"mapping_acc_given_elements": "higher"},
                 "perception: a gold element is missing from the answer; mapping: elements present, idea wrong or missing")]
    items = run.table("items") if run is not None else None
    if items is not None and not items.empty:
        sample = items[items["split"] == items["split"].iloc[0]]
        first = sample["video_id"].iloc[0]
        ex = sample[sample["video_id"] == first][["video_id", "variant", "loose", "strict", "error_class",
                                                   "answer_json", "reference"]].copy()
        ex["reference"] = ex["reference"].fillna("").str.replace("\n", " | ").str.slice(0, 240)
        out.append(Table(f"Example item {first}: each arm's answer and reference", ex.reset_index(drop=True)))
    return out


def headline(frame: pd.DataFrame) -> dict:
    rows = _eval(frame)
    rows = rows[rows["metric"] == "overall"]
    return {split: rows[rows["split"] == split].groupby("variant")["value"].mean().round(2).to_dict()
            for split in rows["split"].unique()}


def _error_bars(frame):
    rows = _eval(frame)
    rows = rows[rows["metric"].isin(["error_perception_frac", "error_mapping_frac"])]
    table = rows.pivot_table(index=["split", "variant"], columns="metric", values="value").fillna(0)
    figure, axis = new_axes("Failures (loose < 7): perception vs mapping", "", "share of failures", size=(8, 4))
    labels = [f"{v}\n{s.replace('test_', '')}" for s, v in table.index]
    per = table.get("error_perception_frac", pd.Series(0, index=table.index)).values
    mapping = table.get("error_mapping_frac", pd.Series(0, index=table.index)).values
    axis.bar(range(len(labels)), per, label="perception")
    axis.bar(range(len(labels)), mapping, bottom=per, label="mapping")
    axis.set_xticks(range(len(labels)), labels, fontsize=7)
    axis.legend()
    return figure


def _overall_vs_hops(frame):
    rows = _eval(frame)
    rows = rows[(rows["metric"] == "overall") & rows["variant"].isin(["kg_k0", "kg_h1", "kg_h2"])]
    figure, axis = new_axes("overall vs retrieval depth", "arm (hops, top_k)", "overall")
    for split, part in rows.groupby("split"):
        part = part.set_index("variant").reindex(["kg_k0", "kg_h1", "kg_h2"]).dropna(subset=["value"])
        axis.plot([f"{v} (h{int(r.hops)}, k{int(r.top_k)})" for v, r in part.iterrows()], part["value"], "o-", label=split)
    axis.legend()
    return figure


def _reference_lengths(items):
    figure, axis = new_axes("Reference length", "characters", "items")
    for variant, part in items.dropna(subset=["reference_chars"]).groupby("variant"):
        axis.hist(part["reference_chars"], bins=20, alpha=0.5, label=variant)
    axis.axvline(4000, color="k", linestyle=":", label="truncation (4000)")
    axis.legend(fontsize=7)
    return figure


def _frame_strip(run, video_id):
    from PIL import Image

    from icml.methods.metaphor_bench.protocol import frame_paths, sample_indices

    paths = frame_paths(run.path / "bench" / "test" / "videos" / video_id)
    if not paths:
        return None
    chosen = [paths[i] for i in sample_indices(len(paths), 50)][:8]
    figure, axes = __import__("matplotlib.pyplot", fromlist=["subplots"]).subplots(1, len(chosen), figsize=(1.4 * len(chosen), 1.8))
    for axis, path in zip(axes if len(chosen) > 1 else [axes], chosen):
        axis.imshow(Image.open(path))
        axis.set_axis_off()
        axis.set_title(path.stem[-3:], fontsize=7)
    figure.suptitle(f"sampled frames of {video_id}")
    return figure


def plots(frame: pd.DataFrame, config, run=None) -> list:
    if _eval(frame).empty:
        return []
    out = []
    if _eval(frame)["metric"].isin(["error_mapping_frac"]).any():
        out.append(("error split", _error_bars(frame)))
    out.append(("overall vs hops/top_k", _overall_vs_hops(frame)))
    items = run.table("items") if run is not None else None
    if items is not None and not items.empty:
        if items["reference_chars"].notna().any():
            out.append(("reference lengths", _reference_lengths(items)))
        strip = _frame_strip(run, items["video_id"].iloc[0])
        if strip is not None:
            out.append(("sampled frames", strip))
    return out
