"""Report of `icml diverse-init`: arms × metrics at the main guidance scale per tier and parameterisation,
the τ sweep, cost; Pareto plots over w, τ-sweep curves, GMM scatter plots and minority mass against w,
‖z‖/√d histograms (prior term), digits sample grids from shared seeds."""
from __future__ import annotations


import numpy as np
import pandas as pd

from icml.methods.diverse_init import METHOD
from icml.methods.diverse_init.config import VARIANTS
from icml.methods.diverse_init.pipeline import ORACLE
from icml.reports.claims import Claim
from icml.reports.plots import new_axes
from icml.reports.tables import Table, fmt, metric_table

BETTER = METHOD.metrics
QUALITY = ["vendi", "recall", "precision", "density", "coverage", "fid", "inbatch_sim", "cond_acc"]
GMM_ONLY = ["mode_coverage", "minority_mass", "gmm_precision"]
INIT = ["u_before", "u_after", "z_norm_ratio", "force_ratio", "pull_noise_ratio"]
PARETO_ARMS = ("base", "divin", "cads", "divin_cads", "ig", "divin_ig", "pg", "divin_pg", "sail")
MAIN_CFG, MAIN_K = 4.0, 1  # the default preset's main scale and K, where the claims are read
FEATURES = {"gmm": "coord", "digits": "clf"}

VERB = {"vendi": "raises vendi", "inbatch_sim": "lowers in-batch similarity", "minority_mass": "raises minority mass"}


def _claim(tier: str, param: str, metric: str, variant: str = "divin", frac: float = 1.0) -> Claim:
    """`variant` at τ = frac·τ* (its own τ*) and K = 1 against base, at w = 4, in the tier's feature space, no
    trajectory option: every tag that tells the grid's rows apart is pinned."""
    who = "DivIn on the exact potential" if variant == ORACLE else "DivIn"
    scale = "τ*" if frac == 1 else f"{fmt(frac)}τ*"
    return Claim(f"{who} {VERB[metric]} on {tier} {param} (w = 4, τ = {scale}, K = 1)", metric,
                 {"variant": variant, "tau_frac": frac, "k_steps": MAIN_K}, "base",
                 where={"tier": tier, "param": param, "cfg_scale": MAIN_CFG, "feature_space": FEATURES[tier],
                        "traj": "none"})


# The spec's "DivIn at equal w: higher vendi, lower inbatch_sim", one cell per tier × param at τ = τ*; then the
# τ sweep's far end (8τ*) on both tiers and the oracle control (DivIn on the exact mixture's potential, GMM eps).
CLAIMS = [_claim(t, p, m) for t in ("gmm", "digits") for p in ("eps", "flow") for m in ("vendi", "inbatch_sim")] + \
    [_claim("gmm", p, m, frac=8.0) for p in ("eps", "flow") for m in ("vendi", "minority_mass")] + \
    [_claim("digits", p, m, frac=8.0) for p in ("eps", "flow") for m in ("vendi", "inbatch_sim")] + \
    [_claim("gmm", "eps", m, ORACLE, f) for f in (1.0, 8.0) for m in ("vendi", "inbatch_sim", "minority_mass")]


def _eval(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[(frame["phase"] == "eval") & frame["feature_space"].isin(["coord", "clf", "init"])]


def _defaults(frame: pd.DataFrame) -> dict[tuple[str, str], tuple[float, float]]:
    """(tier, param) → (default divin τ, τ*) from the tau_star rows."""
    rows = frame[(frame["phase"] == "eval") & (frame["metric"] == "tau_star") & (frame["variant"] == "divin")]
    return {(r.tier, r.param): (r.tau, r.value) for r in rows.itertuples()}


def _main_arms(ev: pd.DataFrame, tier: str, param: str, tau: float, k: int) -> pd.DataFrame:
    """Rows of the grid's standard arms (default τ and K; arms without DivIn have τ = NaN, K = 0)."""
    sub = ev[(ev["tier"] == tier) & (ev["param"] == param)]
    default = sub["tau"].isna() | (np.isclose(sub["tau"], tau) & (sub["k_steps"] == k))
    return sub[default]


def tables(frame: pd.DataFrame, config) -> list[Table]:
    out = []
    ev = _eval(frame)
    defaults = _defaults(frame)
    k = config.divin.k_steps
    for (tier, param), (tau, tau_star) in defaults.items():
        sub = _main_arms(ev, tier, param, tau, k)
        sub = sub[sub["cfg_scale"] == config.main_cfg]
        metrics = QUALITY + (GMM_ONLY if tier == "gmm" else []) + INIT
        # the title names the cell, not this seed's τ* (a group report aligns its seeds' tables by title;
        # τ* is in the learned-vs-exact table)
        if config.divin.tau is not None:
            scale = fmt(config.divin.tau)
        else:
            scale = "τ*" if config.divin.tau_frac == 1 else f"{fmt(config.divin.tau_frac)}·τ*"
        features = "coordinates" if tier == "gmm" else "classifier penultimate layer"
        note = f"mean ± sd over sampling seeds; features: {features}"
        if not _pareto_curves(_main_arms(ev, tier, param, tau, k), "precision", "recall"):
            scales = ", ".join(fmt(w) for w in sorted(ev.loc[ev["tier"] == tier, "cfg_scale"].unique()))
            note += (f"; one guidance scale per arm (w = {scales}): no Pareto plot over w for {tier} · {param} "
                     "(a curve needs ≥ 2 scales)")
        out.append(metric_table(sub, f"{tier} · {param}: arms at w = {fmt(config.main_cfg)} (τ = {scale}, "
                                     f"K = {k})", metrics, BETTER, order=list(VARIANTS), note=note))
    sweep = _sweep(ev, config)
    if not sweep.empty:
        out.append(metric_table(sweep.sort_values(["tier", "param", "variant", "tau_frac"], kind="stable"),
                                f"τ sweep at w = {fmt(config.main_cfg)} (τ/τ*; {ORACLE}: DivIn on the exact "
                                "mixture's potential, τ/τ* of its own τ*)",
                                ["vendi", "recall", "precision", "inbatch_sim", "minority_mass", "fid", "u_after",
                                 "force_ratio", "pull_noise_ratio"], BETTER,
                                rows=["tier", "param", "variant", "tau_frac"]))
    potentials = frame[(frame["phase"] == "eval") & (frame["metric"].isin(["tau_star", "grad_cos_exact"]))]
    if not potentials.empty:
        out.append(metric_table(potentials, f"calibrated τ* per tier × param ({ORACLE}: of the exact GMM potential) "
                                            "and the mean cosine of the learned and the exact ∇U",
                                ["tau_star", "grad_cos_exact"], BETTER, rows=["tier", "param", "variant"]))
    ks = ev[ev["variant"].isin(["divin", "divin_no_prior"]) & (ev["cfg_scale"] == config.main_cfg)]
    ks = ks[ks.apply(lambda r: np.isclose(r["tau"], defaults.get((r["tier"], r["param"]), (np.nan,))[0]), axis=1)] \
        if not ks.empty else ks
    if ks["k_steps"].nunique() > 1:
        out.append(metric_table(ks, "prior term: divin vs divin_no_prior over K", ["z_norm_ratio", "fid", "vendi",
                                                                                   "recall", "u_after"],
                                BETTER, rows=["tier", "param", "variant", "k_steps"]))
    cost = ev[ev["metric"].isin(["nfe", "wall_s"]) & (ev["cfg_scale"] == config.main_cfg)]
    if not cost.empty:
        cost = pd.concat([_main_arms(cost, t, p, tau, k) for (t, p), (tau, _) in defaults.items()])
        out.append(metric_table(cost, f"cost at w = {fmt(config.main_cfg)} (NFE per sample, a cond+uncond pair "
                                      "counts once; sampling seconds per sample)", ["nfe", "wall_s"], BETTER,
                                rows=["tier", "param", "variant"], order=list(VARIANTS)))
    train = frame[frame["phase"] == "train"]
    if not train.empty:
        last = train[train["step"] == train.groupby(["tier", "param"])["step"].transform("max")]
        out.append(metric_table(last, "training (final loss)", ["loss"], BETTER, rows=["tier", "param"]))
    clf = frame[frame["metric"] == "clf_acc"]
    if not clf.empty:
        out.append(metric_table(clf, "feature classifier", ["clf_acc"], BETTER))
    return out


def headline(frame: pd.DataFrame) -> dict:
    """{metric: {"tier/param/variant": mean}} for vendi, recall and precision of the standard arms at w = 4
    (or the largest scale present)."""
    ev = _eval(frame)
    out: dict = {}
    for (tier, param), (tau, _) in _defaults(frame).items():
        divin_k = ev.loc[ev["variant"] == "divin", "k_steps"]
        sub = _main_arms(ev, tier, param, tau, int(divin_k.min()) if len(divin_k) else 0)
        scale = 4.0 if (sub["cfg_scale"] == 4.0).any() else sub["cfg_scale"].max()
        sub = sub[(sub["cfg_scale"] == scale) & sub["metric"].isin(["vendi", "recall", "precision"])]
        for (variant, metric), value in sub.groupby(["variant", "metric"])["value"].mean().items():
            out.setdefault(metric, {})[f"{tier}/{param}/{variant}"] = float(value)
    return out


# plots ---------------------------------------------------------------------------------------------
PAGE_IN = 9.6  # the HTML page shows 1100 px and plots are saved at 110 dpi with 0.1 in margins: up to 10 in
# wide is shown unscaled
TEXT = 8  # the smallest font size (pt) of any label, at that unscaled size


def _sweep(ev: pd.DataFrame, config) -> pd.DataFrame:
    """divin (and the oracle) over τ at the main scale and K."""
    sweep = ev[ev["variant"].isin(["divin", ORACLE]) & (ev["cfg_scale"] == config.main_cfg)
               & (ev["k_steps"] == config.divin.k_steps)]
    return sweep if "tau_frac" in sweep else sweep.iloc[:0]  # runs recorded before the τ/τ* tag: no sweep


def _mean(sub: pd.DataFrame, metric: str, by: list[str]) -> pd.Series:
    return sub[sub["metric"] == metric].groupby(by)["value"].mean()


def _pareto_curves(sub: pd.DataFrame, x_metric: str, y_metric: str,
                   arms=PARETO_ARMS) -> dict[str, tuple[pd.Series, pd.Series]]:
    """{arm: (x, y) means indexed by guidance scale} for the arms measured at ≥ 2 scales: a curve of one
    point shows no trade-off over w (the arms table has that point)."""
    out = {}
    for variant in arms:
        part = sub[sub["variant"] == variant]
        xs, ys = _mean(part, x_metric, ["cfg_scale"]), _mean(part, y_metric, ["cfg_scale"])
        both = xs.index.intersection(ys.index)
        if len(both) >= 2:
            out[variant] = (xs[both], ys[both])
    return out


def _legend_below(fig, axes, ncol: int = 4) -> None:
    """One legend for the figure, below its panels (constrained layout keeps it off the data)."""
    handles = {}
    for ax in np.ravel(axes):
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncol=ncol, fontsize=TEXT)


def plots(frame: pd.DataFrame, config, run=None) -> list:
    import matplotlib.pyplot as plt

    figures = []
    ev = _eval(frame)
    defaults = _defaults(frame)
    k = config.divin.k_steps
    for tier in dict.fromkeys(t for t, _ in defaults):
        params = [p for t, p in defaults if t == tier]
        for x_metric, y_metric in (("precision", "recall"), ("fid", "vendi")):
            subs = {p: _main_arms(ev, tier, p, defaults[(tier, p)][0], k) for p in params}
            curves = {p: _pareto_curves(subs[p], x_metric, y_metric) for p in params}
            drawn = [p for p in params if curves[p]]
            if not drawn:  # one guidance scale per arm: the arms table's note says the plot is left out
                continue
            fig, axes = plt.subplots(1, len(drawn), figsize=(min(PAGE_IN, 4.8 * len(drawn)), 4.6), squeeze=False,
                                     layout="constrained")
            single = set()
            for ax, param in zip(axes[0], drawn):
                for variant, (xs, ys) in curves[param].items():
                    line, = ax.plot(xs.values, ys.values, "o-", label=variant,
                                    lw=2.2 if variant in ("base", "divin") else 1)
                    if variant in ("base", "divin"):  # the scales of the two main curves (the rest share them)
                        for w, xv, yv in zip(xs.index, xs.values, ys.values):
                            ax.annotate(f"w={fmt(w)}", (xv, yv), xytext=(3, 3), textcoords="offset points",
                                        fontsize=TEXT, color=line.get_color())
                single |= {v for v in PARETO_ARMS if v not in curves[param] and (subs[param]["variant"] == v).any()}
                ax.set(title=f"{tier} · {param}", xlabel=x_metric, ylabel=y_metric)
            _legend_below(fig, axes, ncol=5)
            title = f"{tier}: {y_metric} vs {x_metric} across guidance scale w"
            if single:
                title += f"\n(at one scale only, in the arms table: {', '.join(v for v in PARETO_ARMS if v in single)})"
            fig.suptitle(title)
            figures.append((f"{tier} pareto {y_metric} vs {x_metric}", fig))
    sweep = _sweep(ev, config)
    if not sweep.empty and sweep.groupby(["tier", "param"])["tau"].nunique().max() > 2:
        fig, axes = plt.subplots(2, 2, figsize=(PAGE_IN, 7.5), layout="constrained")
        for ax, metric in zip(axes.flat, ("vendi", "recall", "precision", "u_after")):
            for (tier, param, variant), part in sweep.groupby(["tier", "param", "variant"]):
                series = _mean(part, metric, ["tau_frac"])
                if len(series):
                    ax.plot(series.index, series.values, "o-" if variant == "divin" else "s--",
                            label=f"{tier} {param}" + (f" {variant}" if variant != "divin" else ""))
            ax.set(title=metric, xlabel="τ / τ*", xscale="symlog", xlim=(0, None))
            ticks = [v for v in sorted(sweep["tau_frac"].dropna().unique()) if v == 0 or v >= 0.5]
            ax.set_xticks(ticks, [fmt(v) for v in ticks])  # plain numbers, not 10⁰ (the linear part is below 2)
            ax.minorticks_off()
        _legend_below(fig, axes, ncol=3)
        fig.suptitle(f"τ sweep of divin at w = {fmt(config.main_cfg)}")
        figures.append(("tau sweep", fig))
    if run is not None:
        figures += _gmm_plots(run, ev, defaults, config)
        figures += _znorm_plot(run)
        figures += _grid_plots(run)
    return figures


def _gmm_plots(run, ev, defaults, config) -> list:
    import matplotlib.pyplot as plt

    from icml.methods.diverse_init.data import gmm_means

    path = run.table_path("gmm_samples")
    if not path.exists():
        return []
    samples = run.table("gmm_samples")
    figures = []
    params = [p for t, p in defaults if t == "gmm"]
    scales = [w for w in (1.0, config.main_cfg) if w in set(samples["cfg_scale"])]
    cols = 2 * len(scales)
    panel = min(3.2, PAGE_IN / cols)
    fig, axes = plt.subplots(len(params), cols, figsize=(panel * cols, panel * len(params) + 0.6), squeeze=False,
                             sharex=True, sharey=True, layout="constrained")
    means = gmm_means()
    for row, param in zip(axes, params):
        tau = defaults[("gmm", param)][0]
        col = 0
        for w in scales:
            for variant in ("base", "divin"):
                ax = row[col]
                col += 1
                sub = samples[(samples["param"] == param) & (samples["variant"] == variant) & (samples["cfg_scale"] == w)]
                if variant == "divin":
                    sub = sub[np.isclose(sub["tau"], tau) & (sub["k_steps"] == config.divin.k_steps)]
                inside = sub[sub["in_3sigma"]]
                outside = sub[~sub["in_3sigma"]]
                ax.scatter(outside["x"], outside["y"], c="lightgrey", s=2)
                ax.scatter(inside["x"], inside["y"], c=inside["component"], cmap="tab20", vmin=0, vmax=15, s=2)
                ax.scatter(means[:, 0], means[:, 1], marker="+", c="k", s=30)
                ax.set_title(f"{param} · {variant} · w={fmt(w)}", fontsize=9)
                ax.set_aspect("equal")
                ax.set_xticks([])
                ax.set_yticks([])
    fig.suptitle("GMM samples coloured by nearest component (grey: outside 3σ; +: component means)")
    figures.append(("gmm samples base vs divin", fig))

    curves = {}
    for param in params:
        sub = _main_arms(ev, "gmm", param, defaults[("gmm", param)][0], config.divin.k_steps)
        arms = ("base", "divin", "sail", "cads", "divin_cads", "ig", "divin_ig", "pg", "divin_pg")
        for variant, (_, mass) in _pareto_curves(sub, "minority_mass", "minority_mass", arms).items():
            curves[(param, variant)] = mass
    if curves:  # one guidance scale: nothing to draw against w (the arms table has minority_mass)
        fig, ax = new_axes("GMM minority mass against guidance scale (true 0.3)", "guidance scale w",
                           "minority_mass", size=(PAGE_IN, 4.8))
        fig.set_layout_engine("constrained")
        for (param, variant), series in curves.items():
            ax.plot(series.index, series.values, "o-" if param == "eps" else "s--", label=f"{param} {variant}",
                    lw=2 if variant in ("base", "divin") else 0.8)
        ax.axhline(0.3, color="grey", lw=0.8, ls=":")
        ax.legend(fontsize=TEXT, ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1))
        figures.append(("gmm minority mass vs w", fig))
    return figures


def _znorm_plot(run) -> list:
    import matplotlib.pyplot as plt

    if not run.table_path("z_norms").exists():
        return []
    znorm = run.table("z_norms")
    groups = list(znorm.groupby(["tier", "param"]))
    cols = min(2, len(groups))
    rows = (len(groups) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(min(PAGE_IN, 4.8 * cols), 3.4 * rows + 0.4), squeeze=False,
                             layout="constrained")
    for ax, ((tier, param), sub) in zip(axes.flat, groups):
        for (variant, k), part in sub.groupby(["variant", "k_steps"]):
            ax.hist(part["z_norm"], bins=30, histtype="step", density=True, label=f"{variant} K={k}")
        ax.set(title=f"{tier} · {param}", xlabel="‖z‖/√d", ylabel="density")
        ax.legend(fontsize=TEXT)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    fig.suptitle("prior term: ‖z‖/√d after initialisation")
    return [("z norm histograms prior term", fig)]


def _mosaic(images: np.ndarray, per_class: int, pad: int = 2) -> np.ndarray:
    """(n, h, w) images of 10 classes, per_class each in class order → one image: a row per sample, a column
    per class, separated by `pad` grey pixels."""
    n, h, w = images.shape
    classes = n // per_class
    out = np.full((per_class * (h + pad) - pad, classes * (w + pad) - pad), 0.5)
    for c in range(classes):
        for s in range(per_class):
            out[s * (h + pad):s * (h + pad) + h, c * (w + pad):c * (w + pad) + w] = images[c * per_class + s]
    return out


def _grid_plots(run) -> list:
    import matplotlib.pyplot as plt

    path = run.path / "checkpoints" / "digits_samples.npz"
    if not path.exists():
        return []
    with np.load(path) as archive:
        grids = {key: archive[key] for key in archive.files}
    figures = []
    for param in sorted({key.split("/")[0] for key in grids}):
        arms = [v for v in VARIANTS if f"{param}/{v}" in grids]
        n, _, h, w = grids[f"{param}/{arms[0]}"].shape
        per_class = n // 10 if n % 10 == 0 else n  # the pipeline keeps the same number of each class 0–9
        classes = n // per_class
        cols = 1 if len(arms) == 1 else 2
        rows = (len(arms) + cols - 1) // cols
        panel_w = min(PAGE_IN / cols, 0.5 * classes)  # ≥ 0.45 in (≈ 50 px) per digit
        panel_h = panel_w * per_class * (h + 2) / (classes * (w + 2)) + 0.35
        fig, axes = plt.subplots(rows, cols, figsize=(panel_w * cols, panel_h * rows + 0.5), squeeze=False,
                                 layout="constrained")
        for ax, variant in zip(axes.flat, arms):
            images = np.clip((grids[f"{param}/{variant}"][:, 0] + 1) / 2, 0, 1)
            ax.imshow(_mosaic(images, per_class), cmap="gray", vmin=0, vmax=1, interpolation="nearest")
            ax.set_title(variant, fontsize=10)
            if classes == 10:
                ax.set_xticks([c * (w + 2) + w / 2 - 0.5 for c in range(classes)], [str(c) for c in range(classes)],
                              fontsize=TEXT)
                ax.tick_params(length=0, pad=1)
            else:
                ax.set_xticks([])
            ax.set_yticks([])
        for ax in list(axes.flat)[len(arms):]:
            ax.axis("off")
        fig.suptitle(f"digits · {param}: {per_class} samples per class (columns: class 0–9), "
                     "every arm from the same seeds")
        figures.append((f"digits samples {param}", fig))
    return figures
