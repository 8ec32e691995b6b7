"""Tables and plots of `icml explain-vit report`: arms × metrics on single images and on montages, the
ablation ladder, the identities, the α_max sweep; deletion/insertion curves, map galleries (the same images for
every arm, montages included), the mean spectrum of the maps with the patch-lattice frequencies marked,
stability against shift size and the α_max validation sweep."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd

from icml.methods.explain_vit import METHOD
from icml.methods.explain_vit.config import ARMS, LADDER
from icml.reports.plots import new_axes
from icml.reports.tables import Table, fmt, metric_table

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
def _curves(curves: pd.DataFrame):
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(14, 4), sharey=True)
    titles = {"lerf": "deletion, least relevant first (↑)", "morf": "deletion, most relevant first (↓)",
              "insertion": "insertion, most relevant first (↑)"}
    for axis, mode in zip(axes, ("lerf", "morf", "insertion")):
        for arm, rows in curves[(curves["mode"] == mode) & (curves["fill"] == "blur")].groupby("variant", sort=False):
            axis.plot(rows["frac"], rows["prob"], label=arm, lw=2.2 if arm == "dave" else 1.2)
        axis.set_title(titles[mode])
        axis.set_xlabel("fraction of pixels changed")
    axes[0].set_ylabel("target softmax (mean)")
    axes[-1].legend(fontsize=7, loc="best")
    return figure


def _gallery(data, arms: list[str], kind: str, classes: list[str]):
    import matplotlib.pyplot as plt

    pixels = data[f"{kind}_pixels"]
    if kind == "montage":  # one column per (montage, target)
        columns = [(i, k) for i in range(len(pixels)) for k in range(4)]
    else:
        columns = [(i, None) for i in range(len(pixels))]
    figure, axes = plt.subplots(len(arms) + 1, len(columns), figsize=(1.3 * len(columns), 1.3 * (len(arms) + 1)),
                                squeeze=False)
    for j, (i, k) in enumerate(columns):
        axes[0, j].imshow(pixels[i].transpose(1, 2, 0))
        if k is not None:
            axes[0, j].set_title(classes[int(data["montage_classes"][i][k])], fontsize=7)
        for r, arm in enumerate(arms, start=1):
            m = data[f"{kind}/{arm}"][i] if k is None else data[f"{kind}/{arm}"][i, k]
            peak = np.abs(m).max() + 1e-12
            axes[r, j].imshow(m / peak, cmap="bwr" if (m < 0).any() else "inferno", vmin=-1 if (m < 0).any() else 0,
                              vmax=1)
            if j == 0:
                axes[r, j].set_ylabel(arm, fontsize=7, rotation=0, ha="right", va="center")
    for axis in axes.flat:
        axis.set_xticks([])
        axis.set_yticks([])
    figure.tight_layout()
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
    axis.legend(fontsize=7)
    axis.set_title("Mean log-spectrum of the maps (dashed: multiples of 1/patch)")
    return figure


def _stability(rows: pd.DataFrame):
    figure, axis = new_axes("Stability under shifts", "shift (px)", "Pearson r of E(shift x) vs shift E(x)")
    shifts = rows[rows["metric"] == "stability_shift"]
    for arm, part in shifts.groupby("variant", sort=False):
        part = part.groupby("shift_px")["value"].mean()
        axis.plot(part.index, part.values, marker="o", label=arm, lw=2.2 if arm == "dave" else 1.0)
    axis.legend(fontsize=7)
    return figure


def _sweep(sweep: pd.DataFrame):
    figure, axis = new_axes("α_max validation sweep", "α_max", "DAVE GridPG on validation montages")
    part = sweep.groupby("alpha_max")["value"].mean()
    axis.plot(part.index, part.values, marker="o")
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
    spectra = run.table("spectra")
    if spectra is not None and not spectra.empty:
        side = int(2 * spectra["bin"].max())
        patch = config.vit.patch_size if not config.model else _patch_of(config.model)
        out.append(("map spectrum", _spectrum(spectra, side, patch)))
    if not rows[rows["metric"] == "stability_shift"].empty:
        out.append(("stability vs shift", _stability(rows)))
    sweep = frame[(frame["phase"] == "eval") & (frame["split"] == "val") & (frame["metric"] == "grid_pg")]
    if not sweep.empty:
        out.append(("alpha_max sweep", _sweep(sweep)))
    return out


def _patch_of(model: str) -> int:
    from pathlib import Path

    patch = json.loads((Path(model) / "config.json").read_text()).get("patch_size", 16)
    return patch if isinstance(patch, int) else patch[0]
