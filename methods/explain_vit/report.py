"""Tables and plots of `icml explain-vit report`: arms × metrics on single images and on montages, the
ablation ladder, the identities, the α_max sweep; deletion/insertion curves, map galleries (the same images for
every arm, montages included), montage maps over their images with the target cell boxed, the mean spectrum of the maps with the patch-lattice frequencies marked,
stability against shift size and the α_max validation sweep."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd

from icml.methods.explain_vit import METHOD
from icml.methods.explain_vit.config import ARMS, BASELINES, LADDER
from icml.reports.claims import Claim
from icml.reports.plots import new_axes
from icml.reports.tables import Table, fmt, metric_table

# DAVE against every other arm on the spec's headline metrics, judged over the seeds of a group (`icml explain-vit
# report --seeds 0,1,2`: paired per-seed differences, 95 % t-interval): the spec's expected results (DAVE above
# ∇⊙x and IG in localisation and stability, less lattice energy than W_eff⊙x, LeRF best or tied, low class
# sensitivity) and the same comparison against every baseline; the ladder's inner rungs are in its table. Test split only (val holds the α_max sweep); deletion
# with the blurred fill; stability_shift averaged over its shifts.
CLAIM_METRICS = ["grid_pg", "class_sensitivity", "energy_pg", "pixel_auroc", "stability_noise", "stability_shift",
                 "lattice_energy", "deletion_lerf_auc"]
CLAIMS = [Claim(f"dave vs {arm}: {metric}", metric, "dave", arm,
                where={"split": "test", **({"fill": "blur"} if metric.startswith("deletion") else {})},
                pool=("shift_px",) if metric == "stability_shift" else ())
          for metric in CLAIM_METRICS for arm in ["input_x_grad", "weff", *BASELINES]]

SINGLE = ["energy_pg", "pointing_game", "pixel_auroc", "deletion_lerf_auc", "deletion_morf_auc", "insertion_auc",
          "stability_noise", "stability_shift", "lattice_energy", "lattice_grad_ratio", "wall_s_per_image",
          "n_backward"]
MONTAGE = ["grid_pg", "class_sensitivity"]
LADDER_METRICS = ["grid_pg", "energy_pg", "pixel_auroc", "stability_noise", "stability_shift", "lattice_energy",
                  "deletion_lerf_auc", "deletion_morf_auc"]


def _eval(frame: pd.DataFrame) -> pd.DataFrame:
    rows = frame[(frame["phase"] == "eval") & (frame["split"] == "test")]
    blur = rows["fill"].isna() | (rows["fill"] == "blur")
    return rows[blur]


def _per_run(rows: pd.DataFrame) -> pd.DataFrame:
    """One value per (run, arm, metric): stability_shift averaged over its shift sizes."""
    return rows.groupby(["run_id", "seed", "variant", "metric"], as_index=False)["value"].mean()


def tables(frame: pd.DataFrame, config) -> list[Table]:
    rows = _eval(frame)
    if rows.empty:
        train = frame[frame["phase"] == "train"]
        last = train[train["step"] == train["step"].max()]
        return [metric_table(last, "Training (last epoch; run eval for the attribution tables)", ["loss", "accuracy"],
                             METHOD.metrics)]
    confidence = rows[rows["metric"] == "n_confident"]
    rows = rows[rows["variant"] != "classifier"]
    per_run = _per_run(rows)
    alpha = rows["alpha_max"].dropna()
    note = (f"N = {config.dave.n_samples}, α_max = {fmt(alpha.iloc[0]) if len(alpha) else '–'}; confidently correct "
            f"test images ({_explained(confidence, config)} explained); deletion fill: blurred copy; stability_shift: mean over shifts {config.eval.shifts} px; "
            "rollout, GAE and Grad-CAM are patch-level maps upsampled bilinearly")
    out = [metric_table(per_run, "Single images: arms × metrics", SINGLE, METHOD.metrics, order=ARMS, note=note),
           _confidence_table(confidence, frame)]
    if per_run["metric"].isin(MONTAGE).any():  # without montages the confidence table's note says why
        out.append(metric_table(per_run, "Montages (2×2 grids of four confident cells)", MONTAGE, METHOD.metrics,
                                order=ARMS,
                                note="grid_pg chance = 0.25; class_sensitivity: Pearson r between two targets' maps"))
    out += [metric_table(per_run[per_run["variant"].isin(LADDER)], "Ablation ladder", LADDER_METRICS, METHOD.metrics,
                         order=LADDER, note="input_x_grad → weff (W_eff⊙x) → +Reynolds averaging → +noise schedule → "
                                            "+MAD aggregation → +post-processing (dave)"),
            metric_table(per_run, "Identities", ["completeness_gap", "opvar_ratio"], METHOD.metrics, order=ARMS,
                         note="completeness_gap: |Σc − z_y|/|z_y| on a bias-zeroed copy (W_eff⊙x is exact, ∇⊙x is "
                              "not); opvar_ratio: ‖∇z_y − W_eff‖/‖∇z_y‖ on the trained model")]
    constant = frame[(frame["phase"] == "eval") & (frame["fill"] == "constant")]
    if not constant.empty:
        out.append(metric_table(_per_run(constant), "Deletion with a constant fill", SINGLE[3:6], METHOD.metrics,
                                order=ARMS))
    sweep = frame[(frame["phase"] == "eval") & (frame["split"] == "val") & (frame["metric"] == "grid_pg")]
    if not sweep.empty:
        table = sweep.groupby("alpha_max", as_index=False)["value"].mean().rename(columns={"value": "val grid_pg"})
        table["val grid_pg"] = table["val grid_pg"].map(lambda v: fmt(v, 3))
        out.append(Table("α_max sweep (validation montages, DAVE GridPG)", table, {"val grid_pg": "higher"}))
    return out


def _explained(confidence: pd.DataFrame, config) -> str:
    """Images behind each run's single-image means: its confident test images, at most eval.n_test_images — a seed
    confident on a single image contributes that one image's scores to the group mean (issue 24)."""
    if confidence.empty:
        return "–"
    per_run = confidence.groupby("run_id", sort=False)["value"].sum().clip(upper=config.eval.n_test_images)
    return ", ".join(f"{v:.0f}" for v in per_run)


def _confidence_table(confidence: pd.DataFrame, frame: pd.DataFrame) -> Table:
    """Confidently correct test images per class, and the montages they allow: a montage needs four confident
    classes, so a model confident on fewer leaves grid_pg and class_sensitivity unmeasured (issue 24)."""
    montages = frame[(frame["phase"] == "eval") & (frame["metric"] == "n_montages")]["value"]
    classes = confidence[confidence["value"] > 0]["class_name"].nunique()
    counts = ", ".join(f"{v:.0f}" for v in montages) or "–"
    note = f"montages of four confident classes per run: {counts}"
    if len(montages) and (montages == 0).all():
        plural = "es" if classes != 1 else ""
        note += (f" — none: over all runs the model is confident on {classes} class{plural} (4 needed), so "
                 "grid_pg and class_sensitivity are not measured (README: issue 24)")
    return metric_table(confidence, "Confidently correct test images per class", ["n_confident"], METHOD.metrics,
                        rows=["class_name"], note=note)


def headline(frame: pd.DataFrame) -> dict:
    rows = _eval(frame)
    if rows.empty:
        return {}
    per = _per_run(rows).groupby(["metric", "variant"])["value"].mean()
    return {m: per[m].to_dict() for m in ("grid_pg", "energy_pg", "deletion_lerf_auc", "stability_shift",
                                          "lattice_energy") if m in per.index.get_level_values(0)}


# plots -------------------------------------------------------------------------------------------
PAGE_IN = 9.6  # the HTML page shows 1100 px of a plot saved at 110 dpi with 0.1 in margins: ≤ 10 in is unscaled
TEXT = 9  # font size (pt) of the gallery's labels, shown at that size (the figures stay within PAGE_IN)


def _outside_legend(axis) -> None:
    """The legend right of the axes: with up to 13 arms, a legend inside covers the curves."""
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)


def _curves(curves: pd.DataFrame):
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(PAGE_IN, 3.8), sharey=True, layout="constrained")
    titles = {"lerf": "deletion, least relevant first (↑)", "morf": "deletion, most relevant first (↓)",
              "insertion": "insertion, most relevant first (↑)"}
    for axis, mode in zip(axes, ("lerf", "morf", "insertion")):
        for arm, rows in curves[(curves["mode"] == mode) & (curves["fill"] == "blur")].groupby("variant", sort=False):
            axis.plot(rows["frac"], rows["prob"], label=arm, lw=2.2 if arm == "dave" else 1.2)
        axis.set_title(titles[mode], fontsize=9)
        axis.set_xlabel("fraction of pixels changed")
    axes[0].set_ylabel("target softmax (mean)")
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, fontsize=8, loc="outside right upper")
    return figure


def _gallery(data, arms: list[str], kind: str, classes: list[str]):
    """Rows: the input, then one row per arm; columns: images (single) or (montage, target class) pairs, wrapped
    into blocks of at most 8 columns so that every map is ≥ 1 in and every label readable on the page."""
    import matplotlib.pyplot as plt

    pixels = data[f"{kind}_pixels"]
    if kind == "montage":  # one column per (montage, target)
        columns = [(i, k) for i in range(len(pixels)) for k in range(4)]
    else:
        columns = [(i, None) for i in range(len(pixels))]
    per_block = 8
    blocks = [columns[s:s + per_block] for s in range(0, len(columns), per_block)]
    width = max(len(b) for b in blocks)
    label_in = 1.7  # room for the arm names left of the first column
    cell = min(1.2, (PAGE_IN - label_in) / width)
    rows = len(arms) + 1
    what = ("montages (2×2 grids of four classes): each column explains the target class in its title"
            if kind == "montage" else "single test images")
    figure = plt.figure(figsize=(label_in + cell * width, len(blocks) * (cell * rows + 0.3) + 0.7),
                        layout="constrained")
    figure.suptitle(f"Maps of {what}\nrows: arms; each map scaled to its own peak |value| (inferno: non-negative, "
                    "blue–white–red: signed)", fontsize=10)
    subfigures = figure.subfigures(len(blocks), 1, squeeze=False)[:, 0]
    for block, sub in zip(blocks, subfigures):
        axes = sub.subplots(rows, width, squeeze=False)
        for j, (i, k) in enumerate(block):
            axes[0, j].imshow(pixels[i].transpose(1, 2, 0))
            if k is not None:
                axes[0, j].set_title(f"{i + 1}: {classes[int(data['montage_classes'][i][k])]}", fontsize=TEXT)
            else:
                axes[0, j].set_title(f"image {i + 1}", fontsize=TEXT)
            for r, arm in enumerate(arms, start=1):
                m = data[f"{kind}/{arm}"][i] if k is None else data[f"{kind}/{arm}"][i, k]
                peak = np.abs(m).max() + 1e-12
                signed = bool((m < 0).any())
                axes[r, j].imshow(m / peak, cmap="bwr" if signed else "inferno", vmin=-1 if signed else 0, vmax=1)
        axes[0, 0].set_ylabel("input", fontsize=TEXT, rotation=0, ha="right", va="center")
        for r, arm in enumerate(arms, start=1):
            axes[r, 0].set_ylabel(arm, fontsize=TEXT, rotation=0, ha="right", va="center")
        for axis in axes.flat:
            axis.set_xticks([])
            axis.set_yticks([])
        for axis in axes[:, len(block):].flat:  # the last block's unused columns
            axis.set_visible(False)
    return figure


OVERLAY_ARMS = ["dave", "input_x_grad", "integrated_gradients", "gae"]  # shown over the montages, where run


def _montage_overlays(data, arms: list[str], classes: list[str]):
    """Montage maps over their images: per target (column) and arm (row), the map's positive part over the grey
    input with the target's cell outlined and its share of the positive attribution (its GridPG) written below —
    where an arm puts a class, which the gallery's bare maps leave to the reader's eye. At most two montages."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    shown = [a for a in OVERLAY_ARMS if a in arms] or arms[:4]
    pixels = data["montage_pixels"][:2]
    columns = [(i, k) for i in range(len(pixels)) for k in range(4)]
    label_in = 1.7
    cell = min(1.2, (PAGE_IN - label_in) / len(columns))
    figure, axes = plt.subplots(len(shown), len(columns), squeeze=False, layout="constrained",
                                figsize=(label_in + cell * len(columns), len(shown) * (cell + 0.25) + 0.8))
    figure.suptitle("Montage maps over their images: positive attribution (inferno, each map at its own peak), "
                    "the target's cell boxed,\nits share of the positive attribution below (GridPG; chance 0.25)",
                    fontsize=10)
    for j, (i, k) in enumerate(columns):
        image = pixels[i].transpose(1, 2, 0)
        h, w = image.shape[:2]
        r, c = divmod(k, 2)
        for row, arm in enumerate(shown):
            axis = axes[row, j]
            m = np.clip(data[f"montage/{arm}"][i, k], 0, None)
            total = m.sum()
            share = m[r * h // 2:(r + 1) * h // 2, c * w // 2:(c + 1) * w // 2].sum() / total if total > 0 else np.nan
            axis.imshow(image.mean(-1), cmap="gray", vmin=0, vmax=1)
            axis.imshow(np.ma.masked_less_equal(m / (m.max() + 1e-12), 0.15), cmap="inferno", alpha=0.75, vmin=0,
                        vmax=1)
            axis.add_patch(Rectangle((c * w / 2 - 0.5, r * h / 2 - 0.5), w / 2, h / 2, fill=False, ec="cyan", lw=1.5))
            axis.set_xlabel(fmt(share, 2), fontsize=TEXT, labelpad=1)
            axis.set_xticks([])
            axis.set_yticks([])
            if row == 0:
                axis.set_title(f"{i + 1}: {classes[int(data['montage_classes'][i][k])]}", fontsize=TEXT)
            if j == 0:
                axis.set_ylabel(arm, fontsize=TEXT, rotation=0, ha="right", va="center")
    return figure


def _spectrum(spectra: pd.DataFrame, side: int, patch: int):
    figure, axis = new_axes("Mean log-spectrum of the maps along x", "frequency (cycles per image)",
                            "log10 power (maps at unit energy)")
    for arm, rows in spectra.groupby("variant", sort=False):
        axis.plot(rows["bin"], rows["log_power"], label=arm, lw=2.2 if arm == "dave" else 1.0)
    for m in range(1, patch):
        f = m * side / patch
        if f <= side / 2:
            axis.axvline(f, color="grey", ls="--", lw=0.8)
    _outside_legend(axis)
    axis.set_title("Mean log-spectrum of the maps (dashed: multiples of 1/patch)")
    return figure


def _stability(rows: pd.DataFrame):
    figure, axis = new_axes("Stability under shifts", "shift (px)", "Pearson r of E(shift x) vs shift E(x)")
    shifts = rows[rows["metric"] == "stability_shift"]
    for arm, part in shifts.groupby("variant", sort=False):
        part = part.groupby("shift_px")["value"].mean()
        axis.plot(part.index, part.values, marker="o", label=arm, lw=2.2 if arm == "dave" else 1.0)
    _outside_legend(axis)
    return figure


def _sweep(sweep: pd.DataFrame, chosen: float | None = None):
    """GridPG over α_max on [0, 1] (it is a fraction; chance 0.25), each point labelled with its value: a sweep
    whose values differ by 3e-4 is shown flat, not stretched over the whole axis."""
    figure, axis = new_axes("α_max validation sweep (DAVE GridPG on validation montages)", "α_max",
                            "GridPG (chance 0.25)")
    part = sweep.groupby("alpha_max")["value"].mean().dropna()
    axis.plot(part.index, part.values, marker="o", label="DAVE")
    for alpha, value in part.items():
        axis.annotate(fmt(value, 3), (alpha, value), xytext=(0, 7), textcoords="offset points", ha="center",
                      fontsize=9)
    axis.axhline(0.25, color="grey", ls=":", lw=1, label="chance (0.25)")
    if chosen is not None:
        axis.axvline(chosen, color="k", ls="--", lw=0.8, label=f"α_max used on test ({fmt(chosen)})")
    axis.set_ylim(0, 1)
    axis.set_xticks(part.index, [fmt(a) for a in part.index])
    spread = float(part.max() - part.min()) if len(part) else 0.0
    axis.text(0.02, 0.96, f"spread over α_max: {fmt(spread, 2)}", transform=axis.transAxes, va="top", fontsize=9)
    axis.legend(fontsize=8, loc="upper right")
    return figure


def plots(frame: pd.DataFrame, config, run=None) -> list:
    rows = _eval(frame)
    if rows.empty or run is None:
        return []
    out = []
    curves = run.table("curves")
    if curves is not None and not curves.empty:
        out.append(("deletion and insertion curves", _curves(curves)))
    gallery_path = run.path / "gallery.npz"
    if gallery_path.exists():
        info = json.loads((run.path / "gallery.json").read_text())
        with np.load(gallery_path) as data:
            data = dict(data)
        for kind in ("single", "montage"):
            if f"{kind}_pixels" in data and len(data[f"{kind}_pixels"]):
                out.append((f"map gallery {kind}", _gallery(data, info["arms"], kind, info["classes"])))
        if "montage_pixels" in data and len(data["montage_pixels"]):
            out.append(("montage overlays", _montage_overlays(data, info["arms"], info["classes"])))
    spectra = run.table("spectra")
    if spectra is not None and not spectra.empty:
        side = int(2 * spectra["bin"].max())
        patch = config.vit.patch_size if not config.model else _patch_of(config.model)
        out.append(("map spectrum", _spectrum(spectra, side, patch)))
    if not rows[rows["metric"] == "stability_shift"].empty:
        out.append(("stability vs shift", _stability(rows)))
    sweep = frame[(frame["phase"] == "eval") & (frame["split"] == "val") & (frame["metric"] == "grid_pg")]
    if sweep["alpha_max"].nunique() >= 2:  # one α_max is no sweep: the table has its value
        chosen = rows["alpha_max"].dropna()
        out.append(("alpha_max sweep", _sweep(sweep, float(chosen.iloc[0]) if len(chosen) else None)))
    return out


def _patch_of(model: str) -> int:
    from pathlib import Path

    patch = json.loads((Path(model) / "config.json").read_text()).get("patch_size", 16)
    return patch if isinstance(patch, int) else patch[0]
