"""Tables and plots of `icml attribute-motion report`, as the spec lists them: retrieval per
selector, fine-tuning arms side by side, score distributions, score vs valid length, P@k curves,
projected vs exact cosines, galleries (top clips per query, masks, generated frames per arm)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from icml.methods.attribute_motion import METHOD
from icml.methods.attribute_motion.config import ARMS, SELECTORS
from icml.reports.claims import Claim
from icml.reports.plots import new_axes
from icml.reports.tables import Table, default_headline, fmt, mean_sd

# The spec's expected results at `default`, judged over the seeds of a group (`icml attribute-motion
# report --group G`). Retrieval claims compare selectors (eval rows of the pool split), generation
# claims compare fine-tuning arms (split "generated"); both are means over target motions.
_RETRIEVAL, _GENERATED = {"split": "pool"}, {"split": "generated"}
_OVER_TARGETS = ("target_motion", "attr_seed")  # a retrieval arm's value at one seed: its mean over both
CLAIMS = [
    Claim("Motive retrieves same-motion clips better than no_mask (AP)", "ap", "motive", "no_mask",
          where=_RETRIEVAL, pool=_OVER_TARGETS, expect="higher"),
    Claim("Motive is outranked by same-appearance clips less often than no_mask", "appearance_outrank_rate",
          "motive", "no_mask", where=_RETRIEVAL, pool=_OVER_TARGETS, expect="lower"),
    Claim("flow_magnitude selects more decoys (jitter, pans) than Motive", "decoy_rate", "flow_magnitude",
          "motive", where=_RETRIEVAL, pool=_OVER_TARGETS, expect="higher"),
    Claim("Without Z(x) (no_length_norm) scores rise with clip length more than Motive's (length_spearman)",
          "length_spearman", "no_length_norm", "motive", where=_RETRIEVAL, pool=_OVER_TARGETS, expect="higher"),
    Claim("Averaging 4 shared (t*, ε) draws (multi_draw) ranks more alike across attribution seeds than one",
          "seed_spearman", "multi_draw", "motive", where=_RETRIEVAL, pool=_OVER_TARGETS, expect="higher"),
    Claim("Motive-selected fine-tuning beats random selection (target_motion_acc)", "target_motion_acc",
          "motive", "random", where=_GENERATED, expect="higher"),
    Claim("Motive-selected fine-tuning beats fine-tuning on the full pool (target_motion_acc)",
          "target_motion_acc", "motive", "full", where=_GENERATED, expect="higher"),
    Claim("Motive-selected fine-tuning beats no_mask selection (target_motion_acc)", "target_motion_acc",
          "motive", "no_mask", where=_GENERATED, expect="higher"),
    Claim("Motive-selected fine-tuning raises dynamic degree over random selection", "dynamic_degree",
          "motive", "random", where=_GENERATED, expect="higher"),
]

RETRIEVAL = ["p_at_k", "ap", "appearance_outrank_rate", "pan_outrank_rate", "decoy_rate", "length_spearman",
             "seed_spearman", "proj_cos_err", "featurize_s_per_clip"]
GENERATION = ["target_motion_acc", "dynamic_degree", "top_flow_px", "win_rate_vs_base", "motion_smoothness", "subject_consistency",
              "fm_loss_heldout", "finetune_s"]
ARM_ORDER = ["base"] + ARMS


def _order(frame: pd.DataFrame, order: list[str]) -> pd.DataFrame:
    rank = {v: i for i, v in enumerate(order)}
    return frame.sort_values("variant", key=lambda s: s.map(lambda v: rank.get(v, len(rank))), kind="stable")


def _retrieval_table(frame: pd.DataFrame, config) -> Table | None:
    rows = frame[(frame["phase"] == "eval") & frame["metric"].isin(RETRIEVAL)].copy()
    if rows.empty:
        return None
    rows["column"] = np.where(rows["metric"] == "p_at_k", "p@" + rows["k"].astype("Int64").astype(str), rows["metric"])
    columns = sorted(c for c in rows["column"].unique() if c.startswith("p@"))
    columns = sorted(columns, key=lambda c: int(c[2:])) + [m for m in RETRIEVAL[1:] if m in set(rows["column"])]
    table = rows.groupby(["target_motion", "variant", "column"], sort=False)["value"].apply(mean_sd).unstack("column")
    table = table.reset_index()[["target_motion", "variant", *columns]].fillna("–")
    targets = {t: i for i, t in enumerate(config.clips.targets)}
    selectors = {v: i for i, v in enumerate(SELECTORS)}
    table = table.assign(_t=table["target_motion"].map(targets), _v=table["variant"].map(selectors))
    table = table.sort_values(["_t", "_v"], kind="stable").drop(columns=["_t", "_v"])
    better = {c: METHOD.better("p_at_k" if c.startswith("p@") else c) for c in columns}
    return Table("Retrieval per selector (mean ± sd over attribution seeds)", table.reset_index(drop=True),
                 {c: b for c, b in better.items() if b},
                 "p@k: share of the target motion in the aggregated top-k (k = 10 and the budget); "
                 "appearance_outrank_rate: twins (query look, other motion) ranked above target-motion clips; "
                 "pan_outrank_rate: camera-pan decoys ranked above target-motion clips")


def _generation_table(frame: pd.DataFrame) -> Table | None:
    rows = frame[(frame["phase"] == "eval") & frame["metric"].isin(GENERATION)]
    if rows.empty:
        return None
    table = rows.pivot_table(index="variant", columns="metric", values="value", aggfunc="mean").reset_index()
    table = _order(table, ARM_ORDER)[["variant", *[m for m in GENERATION if m in table.columns]]]
    target = rows["target_motion"].dropna().iloc[0] if rows["target_motion"].notna().any() else "?"
    return Table(f"Fine-tuning arms side by side (target {target}; equal step budget; 'base' = no fine-tuning)",
                 table.reset_index(drop=True).astype(object).fillna("–"),
                 {m: METHOD.better(m) for m in GENERATION if METHOD.better(m)},
                 "generated from shared seeds and prompts; win_rate_vs_base: classifier probability of the "
                 "prompted motion above base's on the same seed (ties 0.5)")


def _train_table(frame: pd.DataFrame) -> Table:
    rows = frame[frame["phase"] == "train"]
    loss = rows[rows["metric"] == "loss"].sort_values("step")
    out = []
    if not loss.empty:
        out.append({"quantity": "pretraining FM loss (last logged step)", "value": loss["value"].iloc[-1],
                    "step": int(loss["step"].iloc[-1])})
    for _, row in rows[rows["metric"] == "evaluator_acc"].iterrows():
        out.append({"quantity": f"held-out accuracy of {row['variant']}", "value": row["value"], "step": None})
    return Table("Training", pd.DataFrame(out, columns=["quantity", "value", "step"]).astype(object).fillna("–"))


def tables(frame: pd.DataFrame, config) -> list[Table]:
    out = [t for t in (_retrieval_table(frame, config), _generation_table(frame)) if t is not None]
    return out + [_train_table(frame)]


def headline(frame: pd.DataFrame) -> dict:
    rows = frame[frame["phase"] == "eval"]
    out = {}
    for metric in ("ap", "appearance_outrank_rate", "target_motion_acc", "dynamic_degree", "win_rate_vs_base"):
        picked = rows[rows["metric"] == metric]
        if not picked.empty:
            out[metric] = {k: float(v) for k, v in picked.groupby("variant")["value"].mean().items()}
    return out or default_headline(frame, METHOD.metrics)


# plots -------------------------------------------------------------------------------------------
PAGE_IN = 9.6  # the HTML page shows 1100 px of a plot saved at 110 dpi with 0.1 in margins: ≤ 10 in is unscaled
TEXT = 9  # the galleries' labels (pt), shown at that size since the figures stay within PAGE_IN
MAX_FRAMES = 8  # frames shown per clip: evenly spaced when a clip has more (Wan's 81)


def _aggregated(run, config) -> pd.DataFrame | None:
    scores = run.table("scores")
    if scores is None:
        return None
    first = config.attr.attr_seeds[0]
    return scores[(scores["query_id"] == -1) & (scores["attr_seed"] == first)
                  & (scores["target_motion"] == config.primary_target)]


def _legend_right(axis) -> None:
    """Legend right of the axes: eleven selectors inside would cover the points."""
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)


def _score_distributions(agg: pd.DataFrame, target: str):
    import matplotlib.pyplot as plt

    variants = [v for v in SELECTORS if v in set(agg["variant"])]
    cols = min(3, len(variants))
    rows = (len(variants) + cols - 1) // cols
    figure, axes = plt.subplots(rows, cols, figsize=(PAGE_IN / 3 * cols, 2.6 * rows + 0.8), squeeze=False,
                                layout="constrained")
    for axis, variant in zip(axes.flat, variants):
        part = agg[agg["variant"] == variant]
        groups = {"target motion": part["motion"] == target,
                  "decoy (pan/jitter/static)": part["decoy_type"].isin(["pan", "jitter", "static"]),
                  "twin": part["decoy_type"] == "twin"}
        groups["other"] = ~(groups["target motion"] | groups["decoy (pan/jitter/static)"] | groups["twin"])
        bins = np.linspace(part["score"].min(), part["score"].max() + 1e-12, 25)
        for label, mask in groups.items():
            axis.hist(part.loc[mask, "score"], bins=bins, alpha=0.55, label=label)
        axis.set_title(variant, fontsize=10)
    for axis in list(axes.flat)[len(variants):]:
        axis.axis("off")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    figure.legend(handles, labels, fontsize=8, ncol=4, loc="outside lower center")
    figure.suptitle(f"Aggregated score distributions (target {target})")
    return figure


def _score_vs_length(agg: pd.DataFrame, target: str):
    figure, axis = new_axes(f"Score vs valid length, {target} clips of the pool", "valid frames",
                            "score (rank-normalised within selector)")
    same = agg[agg["motion"] == target]
    for i, (variant, part) in enumerate(same.groupby("variant", sort=False)):
        ranks = part["score"].rank(pct=True)
        jitter = (i - len(SELECTORS) / 2) * 0.05
        axis.plot(part["valid_len"] + jitter, ranks, "o", ms=3, label=variant)
    _legend_right(axis)
    return figure


def _p_at_k(agg: pd.DataFrame, target: str):
    figure, axis = new_axes(f"P@k of the aggregated ranking (target {target})", "k", "P@k")
    for variant in [v for v in SELECTORS if v in set(agg["variant"])]:
        part = agg[agg["variant"] == variant].sort_values("rank")
        relevant = (part["motion"] == target).to_numpy()
        ks = np.arange(1, len(relevant) + 1)
        axis.plot(ks, np.cumsum(relevant) / ks, label=variant)
    _legend_right(axis)
    return figure


def _arm_bars(frame: pd.DataFrame):
    import matplotlib.pyplot as plt

    rows = frame[(frame["phase"] == "eval") & frame["metric"].isin(["target_motion_acc", "dynamic_degree",
                                                                     "win_rate_vs_base"])]
    figure, axes = plt.subplots(1, 3, figsize=(PAGE_IN, 3.6), layout="constrained")
    for axis, metric in zip(axes, ["target_motion_acc", "dynamic_degree", "win_rate_vs_base"]):
        part = _order(rows[rows["metric"] == metric].groupby("variant", as_index=False)["value"].mean(), ARM_ORDER)
        bars = axis.bar(part["variant"], part["value"], color=["#888" if v == "base" else "#3a7" if v == "motive"
                                                               else "#69c" for v in part["variant"]])
        axis.bar_label(bars, [fmt(v, 2) for v in part["value"]], fontsize=8, padding=1)  # a 0 bar is still read
        axis.set_ylim(0, 1.1)  # all three are fractions
        axis.set_title(metric)
        axis.tick_params(axis="x", rotation=45, labelsize=8)
    return figure


def _cosines(run):
    cos = run.table("cosines")
    figure, axis = new_axes("Projected vs exact gradient cosines (pairs of a pool subset)", "exact cos(g_a, g_b)",
                            "projected cos(Pg_a, Pg_b)")
    for (variant, proj), part in cos.groupby(["variant", "proj"]):
        axis.plot(part["exact"], part["projected"], ".", ms=2, label=f"{variant} ({proj})")
    lo, hi = float(cos["exact"].min()), float(cos["exact"].max())
    axis.plot([lo, hi], [lo, hi], "k-", lw=0.7)
    axis.legend(fontsize=8)
    return figure


def _to_image(frame: np.ndarray) -> np.ndarray:
    return np.clip((frame + 1) / 2, 0, 1)


def _shown_frames(count: int) -> list[int]:
    """At most MAX_FRAMES frame indices, evenly spaced, first and last included."""
    return sorted({int(round(i)) for i in np.linspace(0, count - 1, min(count, MAX_FRAMES))})


def _bare(axis) -> None:
    """No ticks or frame, but the y label stays (axis("off") would hide it)."""
    axis.set_xticks([])
    axis.set_yticks([])
    for spine in axis.spines.values():
        spine.set_visible(False)


def _gallery(run, config, agg: pd.DataFrame):
    """Top-10 pool clips of a few queries (motive, first seed), each as a 2 × 2 tile of its first 4 frames."""
    import matplotlib.pyplot as plt

    scores = run.table("scores")
    clips = run.table("clips")
    with np.load(run.checkpoints / "clips.npz") as data:
        videos = data["videos"]
    row_of = {cid: i for i, cid in enumerate(clips["clip_id"])}
    per_query = scores[(scores["variant"] == "motive") & (scores["attr_seed"] == config.attr.attr_seeds[0])
                       & (scores["target_motion"] == config.primary_target) & (scores["query_id"] >= 0)]
    query_ids = sorted(per_query["query_id"].unique())[:2]
    cell = PAGE_IN / 11

    def tile(video):
        frames = [_to_image(f) for f in video[:4]]
        frames += [np.ones_like(frames[0])] * (4 - len(frames))
        return np.concatenate([np.concatenate(frames[:2], 1), np.concatenate(frames[2:], 1)], 0)

    figure, axes = plt.subplots(len(query_ids), 11, figsize=(PAGE_IN, (cell + 0.45) * len(query_ids) + 0.6),
                                squeeze=False, layout="constrained")
    for r, qid in enumerate(query_ids):
        top = per_query[per_query["query_id"] == qid].sort_values("rank").head(10)
        strips = [(videos[int(qid)], f"query {r + 1}")] + [(videos[row_of[c]], f"{m}\n{d}") for c, m, d in
                                                           zip(top["clip_id"], top["motion"], top["decoy_type"])]
        for c, (video, title) in enumerate(strips):
            axes[r, c].imshow(tile(video))
            axes[r, c].set_title(title, fontsize=8.5, fontweight="bold" if c == 0 else "normal")
            axes[r, c].axis("off")
        for axis in axes[r, len(strips):]:
            axis.axis("off")
    figure.suptitle("motive: each query, then its top-10 pool clips by rank (frames 0–3 as a 2 × 2 tile; "
                    "titles: motion, decoy type)", fontsize=10)
    return figure


def _masks(run, config):
    """Motion masks of a few pool clips (one of each kind)."""
    import matplotlib.pyplot as plt
    import torch

    from icml.methods.attribute_motion.flow import motion_mask

    clips = run.table("clips")
    with np.load(run.checkpoints / "clips.npz") as data:
        videos, valid, flow = data["videos"], data["valid"], data["flow"]
    pool = clips[clips["split"] == "pool"]
    picks = []
    for kind in ("none", "pan", "jitter", "static", "twin"):
        found = pool.index[pool["decoy_type"] == kind]
        if len(found):
            picks.append((int(found[0]), f"{pool.loc[found[0], 'motion']} / {kind}"))
    idx = [i for i, _ in picks]
    masks = motion_mask(torch.as_tensor(flow[idx]), torch.as_tensor(valid[idx]), config.attr.patch,
                        config.attr.camera, config.attr.flow_floor).numpy()
    shown = _shown_frames(videos.shape[1])
    label_in = 1.4  # the row labels (motion / decoy type)
    cell = min(1.0, (PAGE_IN - label_in) / len(shown))
    figure, axes = plt.subplots(2 * len(picks), len(shown), figsize=(label_in + cell * len(shown),
                                                                      (2 * cell + 0.1) * len(picks) + 0.9),
                                squeeze=False, layout="constrained")
    for r, (i, title) in enumerate(picks):
        for c, f in enumerate(shown):
            axes[2 * r, c].imshow(_to_image(videos[i, f]))
            axes[2 * r + 1, c].imshow(masks[r, f], vmin=0, vmax=1, cmap="magma")
            _bare(axes[2 * r, c])
            _bare(axes[2 * r + 1, c])
            if r == 0:
                axes[0, c].set_title(f"frame {f}", fontsize=TEXT)
        axes[2 * r, 0].set_ylabel(title, fontsize=TEXT, rotation=0, ha="right", va="center")
        axes[2 * r + 1, 0].set_ylabel("its mask", fontsize=TEXT, rotation=0, ha="right", va="center")
    figure.suptitle("Pool clips (motion / decoy type) and their motion masks (patch-pooled, normalised per clip, "
                    "0 on padded frames)", fontsize=10)
    return figure


def _samples(run):
    import matplotlib.pyplot as plt

    with np.load(run.checkpoints / "samples.npz") as data:
        arms = [a for a in ARM_ORDER if a in data.files]
        samples = {a: data[a] for a in arms}
    per_arm = 2
    shown = _shown_frames(next(iter(samples.values())).shape[1])
    cell = min(1.0, (PAGE_IN - 1.0) / len(shown))
    figure, axes = plt.subplots(len(arms) * per_arm, len(shown),
                                figsize=(1.0 + cell * len(shown), (cell + 0.1) * per_arm * len(arms) + 0.8),
                                squeeze=False, layout="constrained")
    for r, arm in enumerate(arms):
        for s in range(per_arm):
            for c, f in enumerate(shown):
                axis = axes[r * per_arm + s, c]
                axis.imshow(_to_image(samples[arm][s, f]))
                _bare(axis)
                if r == 0 and s == 0:
                    axis.set_title(f"frame {f}", fontsize=TEXT)
            axes[r * per_arm + s, 0].set_ylabel(f"{arm}\nvideo {s + 1}", fontsize=TEXT, rotation=0, ha="right",
                                                va="center")
    figure.suptitle("Generated videos per arm (same seeds and prompts; frames left to right)", fontsize=10)
    return figure


def plots(frame: pd.DataFrame, config, run=None) -> list:
    out = []
    if run is None:
        return out
    agg = _aggregated(run, config)
    target = config.primary_target
    if agg is not None and not agg.empty:
        out += [("score distributions", _score_distributions(agg, target)),
                ("score vs valid length", _score_vs_length(agg, target)),
                ("p at k curves", _p_at_k(agg, target))]
        if "motive" in set(agg["variant"]):
            out.append(("top clips per query", _gallery(run, config, agg)))
    if run.table("cosines") is not None:
        out.append(("projected vs exact cosines", _cosines(run)))
    if (run.checkpoints / "clips.npz").exists() and run.table("clips") is not None \
            and (run.table("clips")["split"] == "pool").any() and config.data is None:
        out.append(("motion masks", _masks(run, config)))
    if not frame[(frame["phase"] == "eval") & (frame["metric"] == "target_motion_acc")].empty:
        out.append(("arms target motion dynamic degree win rate", _arm_bars(frame)))
    if (run.checkpoints / "samples.npz").exists():
        out.append(("generated frames per arm", _samples(run)))
    return out
