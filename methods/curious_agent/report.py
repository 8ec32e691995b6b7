"""Tables and plots of `icml curious-agent report`."""
from __future__ import annotations

import numpy as np
import pandas as pd

from icml.methods.curious_agent import METHOD
from icml.methods.curious_agent.config import ARMS
from icml.reports.claims import Claim
from icml.reports.plots import new_axes
from icml.reports.tables import default_headline, metric_table

MAIN = {"reward_mode": "extrinsic"}  # the DoorKey experiment (the coverage one has no task reward)
# the spec's expected results at `default`, judged over seeds (paired: both arms from one seed's run)
CLAIMS = [
    Claim("glance finds its first success earlier than vagen_lite", "steps_to_first_success", "glance",
          "vagen_lite", where=MAIN, phase="train"),
    Claim("glance finds its first success earlier than ppo", "steps_to_first_success", "glance", "ppo",
          where=MAIN, phase="train"),
    Claim("glance's greedy success_rate exceeds vagen_lite's", "success_rate", "glance", "vagen_lite", where=MAIN),
    Claim("glance's greedy success_rate exceeds ppo's", "success_rate", "glance", "ppo", where=MAIN),
    Claim("projector resets keep L_explore above glance_no_reset's (last update)", "explore_loss", "glance",
          "glance_no_reset", where=MAIN, phase="train", expect="higher"),
    Claim("glance predicts better past the door (pred_slot_acc_late)", "pred_slot_acc_late", "glance",
          "vagen_lite", where=MAIN),
]

FINAL = ["steps_to_first_success", "first_success_found", "coverage", "ri_novel_over_revisit"]
EVAL = ["success_rate", "mean_return", "obs_slot_acc", "pred_slot_acc", "pred_slot_acc_late", "probe_ri_decay",
        "probe_fresh_ri_decay"]


def _experiment(frame: pd.DataFrame, config, coverage: bool = False) -> pd.DataFrame:
    """The rows of the main experiment, or of the zero-extrinsic-reward coverage experiment."""
    env_id, mode = (config.coverage.env_id, "intrinsic_only") if coverage else (config.env.id, config.reward_mode)
    return frame[(frame["env_id"] == env_id) & (frame["reward_mode"] == mode)]


def _final(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[(frame["phase"] == "train") & (frame["experiment"] == "final")]


def _curves(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[(frame["phase"] == "train") & (frame["experiment"] != "final")]


def tables(frame: pd.DataFrame, config) -> list:
    out = []
    coverage = _experiment(frame, config, coverage=True) if config.coverage.env_id else frame.iloc[:0]
    frame = _experiment(frame, config)
    evaluated = frame[frame["phase"] == "eval"]
    n_seeds = frame["seed"].nunique()
    if not evaluated.empty:
        out.append(metric_table(evaluated, f"Greedy evaluation — {config.env.id}", EVAL, METHOD.metrics,
                                order=ARMS, note=f"mean ± sd over {n_seeds} seed(s), {config.eval_episodes} "
                                                 "episodes each, env seeds disjoint from training"))
    final = _final(frame)
    if not final.empty:
        out.append(metric_table(final, f"Exploration during training — {config.env.id}", FINAL, METHOD.metrics,
                                order=ARMS, note=f"reward_mode={config.reward_mode}; coverage = unique (x, y, dir) "
                                                 "÷ 4 × non-wall cells of the layouts seen"))
    if not _final(coverage).empty:
        out.append(metric_table(_final(coverage), f"Zero extrinsic reward — {config.coverage.env_id}", FINAL,
                                METHOD.metrics, order=ARMS,
                                note=f"reward_mode=intrinsic_only, {config.coverage.total_steps} env steps per arm "
                                     "and seed; the spec expects glance coverage ≥ 1.2 × vagen_lite"))
    return out


def headline(frame: pd.DataFrame) -> dict:
    out = {}
    final = _final(frame)
    for key, metric, rows in (("success_rate", "success_rate", frame[frame["phase"] == "eval"]),
                              ("coverage", "coverage", final[final["reward_mode"] == "extrinsic"]),
                              ("steps_to_first_success", "steps_to_first_success", final[final["reward_mode"] == "extrinsic"]),
                              ("coverage_intrinsic_only", "coverage", final[final["reward_mode"] == "intrinsic_only"])):
        rows = rows[rows["metric"] == metric]
        if not rows.empty:
            out[key] = rows.groupby("variant")["value"].mean().to_dict()
    return out or default_headline(frame, METHOD.metrics)


def _curve_plot(curves: pd.DataFrame, metric: str, title: str, ylabel: str, resets: bool = False):
    figure, axis = new_axes(title, "environment steps", ylabel)
    rows = curves[curves["metric"] == metric]
    for variant in [v for v in ARMS if v in set(rows["variant"])]:
        mean = rows[rows["variant"] == variant].groupby("step")["value"].mean()
        line, = axis.plot(mean.index, mean.values, marker="o", ms=2, label=variant)
        if resets:
            marks = curves[(curves["metric"] == "projector_reset") & (curves["variant"] == variant)
                           & (curves["value"] > 0)]["step"].unique()
            for step in marks:
                axis.axvline(step, color=line.get_color(), ls=":", lw=1)
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=7)
    return figure


def _novelty_bars(final: pd.DataFrame):
    figure, axis = new_axes("r^i on first visits ÷ r^i on revisits", "variant", "ratio")
    rows = final[final["metric"] == "ri_novel_over_revisit"].groupby("variant")["value"].mean()
    axis.bar(rows.index, rows.values)
    axis.axhline(1.0, color="k", lw=1)
    return figure


def _grid_size(env_id: str, visits: pd.DataFrame) -> tuple[int, int]:
    """(width, height) of the environment's grid, walls included; from the visits' extent if it cannot be built."""
    try:
        import gymnasium as gym
        import minigrid  # noqa: F401  (registers the MiniGrid-* ids)

        env = gym.make(env_id).unwrapped
        return int(env.width), int(env.height)
    except Exception:  # noqa: BLE001 — an unknown id in an old run: the visited cells plus the outer wall
        return int(visits["x"].max()) + 2, int(visits["y"].max()) + 2


def _heat_maps(visits: pd.DataFrame, env_id: str):
    """One panel per arm: the environment's grid (walls included), each cell coloured by how often the agent
    stood on it during training, on one colour scale for all arms."""
    import matplotlib.pyplot as plt

    arms = [v for v in ARMS if v in set(visits["variant"])]
    width, height = _grid_size(env_id, visits)
    grids = {}
    for variant in arms:
        counts = visits[visits["variant"] == variant].groupby(["x", "y"])["count"].sum()
        grid = np.zeros((height, width))
        for (x, y), c in counts.items():
            if 0 <= y < height and 0 <= x < width:
                grid[y, x] = c
        grids[variant] = grid
    top = max(float(np.log1p(g).max()) for g in grids.values()) or 1.0
    cols = min(4, len(arms))
    rows = (len(arms) + cols - 1) // cols
    panel = min(2.6, 8.4 / cols)
    figure, axes = plt.subplots(rows, cols, figsize=(panel * cols + 1.2, panel * rows + 1.5), squeeze=False,
                                layout="constrained")
    cmap = plt.get_cmap("viridis").with_extremes(bad="lightgrey")
    for axis, variant in zip(axes.flat, arms):
        shown = np.ma.masked_equal(np.log1p(grids[variant]), 0)  # never visited (walls included): grey
        image = axis.imshow(shown, cmap=cmap, vmin=0, vmax=top)
        axis.set_title(variant, fontsize=10)
        axis.set_xlabel("x (column)", fontsize=9)
        axis.set_ylabel("y (row)", fontsize=9)
        step = max(1, width // 6)
        axis.set_xticks(range(0, width, step))
        axis.set_yticks(range(0, height, max(1, height // 6)))
        axis.tick_params(labelsize=8)
    for axis in list(axes.flat)[len(arms):]:
        axis.axis("off")
    bar = figure.colorbar(image, ax=axes, shrink=0.9)
    bar.set_label("log(1 + visits)", fontsize=9)
    bar.ax.tick_params(labelsize=8)
    seeds = visits["seed"].nunique() if "seed" in visits else 1
    figure.suptitle(f"Where each arm went during training — {env_id.removeprefix('MiniGrid-')}")
    figure.supxlabel(f"A cell is one tile of the {width} × {height} grid (walls included, y down); its colour is "
                     f"log(1 + env steps the agent stood\non it, any heading) over all training episodes, summed "
                     f"over {seeds} seed{'s' if seeds != 1 else ''}; grey: never visited (walls, unreached "
                     "cells). Layouts change per episode.", fontsize=8.5)
    return figure


def plots(frame: pd.DataFrame, config, run=None) -> list:
    out = []
    coverage = _curves(_experiment(frame, config, coverage=True)) if config.coverage.env_id else frame.iloc[:0]
    frame = _experiment(frame, config)
    curves = _curves(frame)
    if not curves.empty:
        out.append(("success", _curve_plot(curves, "success_rate", "Success vs env steps (sampled training episodes)",
                                           "fraction of the update's finished episodes that succeeded")))
        out.append(("learning curves", _curve_plot(curves, "episode_return", "Training episode return",
                                                   "mean return of finished episodes")))
        out.append(("coverage", _curve_plot(curves, "coverage", f"Coverage ({config.reward_mode})",
                                            "unique (x, y, dir) ÷ reachable")))
        if "explore_loss" in set(curves["metric"]):
            out.append(("curiosity", _curve_plot(curves, "explore_loss",
                                                 "L_explore (dotted: projector resets)", "L_explore", resets=True)))
        out.append(("slot accuracy", _curve_plot(curves, "pred_slot_acc", "<pred> slot accuracy (training)",
                                                 "accuracy vs describer(o_t+1)")))
    if not coverage.empty:
        out.append(("intrinsic-only coverage", _curve_plot(coverage, "coverage",
                                                           f"Coverage, zero extrinsic reward ({config.coverage.env_id})",
                                                           "unique (x, y, dir) ÷ reachable")))
        if "explore_loss" in set(coverage["metric"]):
            out.append(("intrinsic-only curiosity", _curve_plot(coverage, "explore_loss",
                                                                f"L_explore, zero extrinsic reward ({config.coverage.env_id})",
                                                                "L_explore", resets=True)))
    final = _final(frame)
    if "ri_novel_over_revisit" in set(final["metric"]):
        out.append(("novel vs revisit", _novelty_bars(final)))
    visits = run.table("visits") if run is not None else None
    if visits is not None and not visits.empty:
        if "env_id" not in visits:  # runs written before the coverage experiment existed
            visits = visits.assign(env_id=config.env.id)
        for env_id, rows in visits.groupby("env_id", sort=False):
            out.append((f"visits per cell {env_id}", _heat_maps(rows, env_id)))
    return out
