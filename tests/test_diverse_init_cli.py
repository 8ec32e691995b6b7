"""`icml diverse-init` end to end on a tiny config built from the smoke preset: train → eval → report
with every arm, metric and extra table of the spec, the `generate` verb, --model through
from_pretrained, --data, and bad inputs (one line, no traceback, nothing created)."""
from __future__ import annotations

from dataclasses import astuple
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from conftest import invoke
from plotcheck import DPI, PAGE_PX, shown_texts

VARIANTS = ["base", "divin", "divin_no_noise", "divin_no_prior", "sail", "cads", "divin_cads", "ig", "divin_ig",
            "pg", "divin_pg"]
TINY = ["--preset", "smoke", "--set", f"variants={','.join(VARIANTS)}", "--set", "workers=1",
        "--set", "gmm.steps=20", "--set", "gmm.n_per_class=12", "--set", "gmm.n_ref=80", "--set", "gmm.sample_steps=3",
        "--set", "gmm.cfg_scales=1,4", "--set", "gmm.k_steps=1,3", "--set", "gmm.seeds=2",
        "--set", "digits.steps=2", "--set", "digits.batch_size=4", "--set", "digits.n_per_class=3",
        "--set", "digits.sample_steps=2", "--set", "digits.clf_steps=3", "--set", "digits.cfg_scales=2,4", "--set", "digits.block_out_channels=32,32,32",
        "--set", "digits.tau_sweep=false", "--set", "divin.calib_noises=8", "--set", "sail.steps=1",
        "--set", "sail.restarts=1"]
SPEC_METRICS = {"vendi", "precision", "recall", "density", "coverage", "fid", "inbatch_sim", "cond_acc",
                "u_before", "u_after", "z_norm_ratio", "force_ratio", "nfe", "wall_s"}
GMM_METRICS = {"mode_coverage", "minority_mass", "gmm_precision"}
GMM_COLUMNS = ["run_id", "variant", "param", "cfg_scale", "tau", "k_steps", "seed", "class_id", "x", "y", "component",
               "in_3sigma"]


def ok(*argv) -> dict | None:
    result = invoke(*argv)
    assert result.code == 0, result.err
    return result.json() if "--json" in argv else None


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("runs")
    path = Path(ok("diverse-init", "train", *TINY, "--runs-dir", runs, "--json")["run_dir"])
    result = ok("diverse-init", "eval", path, "--runs-dir", runs, "--json")
    assert result["status"] == "completed"
    ok("diverse-init", "report", path, "--format", "html", "--out", runs / "r.html", "--runs-dir", runs)
    return path


def test_every_arm_metric_and_tag_is_recorded(run):
    frame = pd.read_parquet(run / "metrics.parquet")
    train, ev = frame[frame["phase"] == "train"], frame[frame["phase"] == "eval"]
    assert set(train["metric"]) == {"loss", "clf_acc"}
    assert set(train.loc[train["metric"] == "loss", "tier"] + "_" + train.loc[train["metric"] == "loss", "param"]) == \
        {"gmm_eps", "gmm_flow", "digits_eps", "digits_flow"}
    for tier in ("gmm", "digits"):
        for param in ("eps", "flow"):
            sub = ev[(ev["tier"] == tier) & (ev["param"] == param)]
            main = sub[sub["cfg_scale"] == 4.0]
            assert set(main["variant"]) == set(VARIANTS) | ({"divin_exact"} if (tier, param) == ("gmm", "eps") else set())
            assert SPEC_METRICS | (GMM_METRICS if tier == "gmm" else set()) <= set(main["metric"])
            assert set(sub.loc[sub["cfg_scale"] == (1.0 if tier == "gmm" else 2.0), "variant"]) == \
                (set(VARIANTS) if tier == "gmm" else {"base", "divin"})
            sweep = main[(main["variant"] == "divin") & (main["metric"] == "vendi") & (main["feature_space"] != "pixel")]
            if tier == "gmm":  # τ*·{0, ⅛, ¼, ½, 1, 2, 4, 8}, tagged with τ/τ*
                assert sorted(set(sweep.loc[sweep["k_steps"] == 1, "tau_frac"])) == [0, 0.125, 0.25, 0.5, 1, 2, 4, 8]
                assert sweep["tau"].nunique() == 8 and 0.0 in set(sweep["tau"])
            else:
                assert sweep["tau"].nunique() == 1  # digits.tau_sweep=false: the default τ only
            oracle = sub[(sub["variant"] == "divin_exact") & (sub["metric"] != "tau_star")]
            if (tier, param) == ("gmm", "eps"):  # the exact-potential control, at the main scale only
                assert set(oracle["cfg_scale"]) == {4.0}
                assert sorted(set(oracle["tau_frac"])) == [0.125, 0.25, 0.5, 1, 2, 4, 8]
                cos = sub.loc[sub["metric"] == "grad_cos_exact", "value"]
                assert len(cos) == 2 and cos.between(-1, 1).all()  # one per sampling seed
            else:
                assert oracle.empty
    assert set(ev["feature_space"].dropna()) == {"coord", "clf", "pixel", "init"}  # tau_star rows have none
    gmm_k = ev[(ev["tier"] == "gmm") & (ev["variant"] == "divin_no_prior")]
    assert set(gmm_k["k_steps"]) == {1, 3}
    assert set(ev.loc[ev["tier"] == "gmm", "seed"]) == {0, 1}
    nfe = ev[(ev["metric"] == "nfe") & (ev["tier"] == "gmm") & (ev["cfg_scale"] == 4.0)]
    by_arm = nfe.groupby(["variant", "k_steps"])["value"].first()
    assert by_arm[("base", 0)] == 3 and by_arm[("divin", 1)] == 4 and by_arm[("divin", 3)] == 6  # + K pairs
    assert set(ev.loc[ev["variant"] == "divin_cads", "traj"]) == {"cads"}


def test_initial_noise_is_shared_by_the_arms(run):
    frame = pd.read_parquet(run / "metrics.parquet")
    u0 = frame[(frame["metric"] == "u_before") & (frame["tier"] == "gmm") & (frame["param"] == "eps")
               & (frame["seed"] == 0) & (frame["cfg_scale"] == 4.0)]
    assert np.allclose(u0["value"], u0["value"].iloc[0], rtol=1e-6)  # every arm starts from the same z


def test_extra_tables_and_report(run):
    gmm = pd.read_parquet(run / "gmm_samples.parquet")
    assert list(gmm.columns) == GMM_COLUMNS and set(gmm["variant"]) == set(VARIANTS) | {"divin_exact"}
    assert set(gmm["seed"]) == {0}
    znorm = pd.read_parquet(run / "z_norms.parquet")
    assert set(znorm["variant"]) == {"base", "divin", "divin_no_prior"}
    with np.load(run / "checkpoints" / "digits_samples.npz") as grids:
        assert {f"eps/{v}" for v in VARIANTS} <= set(grids.files) and grids["eps/base"].shape == (30, 1, 16, 16)  # 3 per class (< GRID_PER_CLASS)
    html = (run.parent.parent / "r.html").read_text()
    for title in ("arms at w = 4", "τ sweep at w = 4", "calibrated τ* per tier × param", "prior term: divin vs divin_no_prior", "cost at w = 4",
                  "gmm pareto recall vs precision", "digits pareto vendi vs fid", "tau sweep",
                  "gmm samples base vs divin", "gmm minority mass vs w", "z norm histograms prior term",
                  "digits samples eps", "digits samples flow"):
        assert title in html, title
    assert (run / "checkpoints" / "gmm_flow" / "scheduler_config.json").exists()


def test_claims_pin_every_tag_and_find_both_arms(run):
    """Each declared claim (divin − base on vendi and in-batch similarity, per tier × param) reads one cell:
    within a seed, the rows of each arm share every tag value (no pooling over τ, K, w, traj or feature
    space), and both arms exist in a default-shaped grid."""
    from icml.methods.diverse_init import METHOD
    from icml.methods.diverse_init.report import CLAIMS
    from icml.reports.claims import arm_value

    frame = pd.read_parquet(run / "metrics.parquet")
    at_tau_star = {(c.where["tier"], c.where["param"], c.metric) for c in CLAIMS
                   if c.a == {"variant": "divin", "tau_frac": 1.0, "k_steps": 1} and c.b == "base"}
    assert at_tau_star == {(t, p, m) for t in ("gmm", "digits") for p in ("eps", "flow") for m in ("vendi", "inbatch_sim")}
    swept = [c for c in CLAIMS if c.where["tier"] == "digits" and c.a["tau_frac"] != 1.0]
    assert {(c.where["param"], c.metric, c.a["tau_frac"]) for c in swept} == \
        {(p, m, 8.0) for p in ("eps", "flow") for m in ("vendi", "inbatch_sim")}
    for claim in CLAIMS:
        if claim in swept:  # TINY sets digits.tau_sweep=false (time): no digits rows away from τ*
            continue
        for arm in (claim.a, claim.b):
            rows = frame[(frame["phase"] == claim.phase) & (frame["metric"] == claim.metric)]
            for column, value in {**claim.where, **(arm if isinstance(arm, dict) else {"variant": arm})}.items():
                rows = rows[np.isclose(rows[column], value) if isinstance(value, float) else rows[column] == value]
            assert len(rows) and rows.groupby("seed").size().eq(1).all(), (claim.name, arm)  # one per sampling seed
            for tag in METHOD.tags:
                assert rows[tag].nunique(dropna=False) == 1, (claim.name, arm, tag)
            assert np.isfinite(arm_value(frame, claim, arm)), (claim.name, arm)


def overlapping_titles(figure) -> list[str]:
    """Titles (the suptitle, each panel's) whose box overlaps another panel or the suptitle."""
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    axes = [a for a in figure.axes if a.get_visible() and a.axison]
    boxes = [a.get_tightbbox(renderer) for a in axes]
    out = []
    if figure._suptitle is not None and figure._suptitle.get_text():
        sup = figure._suptitle.get_window_extent(renderer)
        out += [figure._suptitle.get_text() for b in boxes if sup.overlaps(b)]
    for i, a in enumerate(axes):
        if a.get_title():
            title = a.title.get_window_extent(renderer)
            out += [a.get_title() for j, b in enumerate(boxes) if j != i and title.overlaps(b)]
    return out


def _report_hooks(run):
    from icml.cli import registry
    from icml.cli.lifecycle import config_from_run
    from icml.cli.results import metrics_schema, read_metrics
    from icml.cli.runstore import Run
    from icml.methods.diverse_init import report

    method = registry.get("diverse-init")
    cfg, _, _ = config_from_run(method, Run(run))
    return report, read_metrics(run / "metrics.parquet", metrics_schema(method.tags)), cfg, Run(run)


def test_plots_are_readable_on_the_html_page(run):
    """Every plot as the HTML page shows it: text ≥ 8 pt, no title over a panel, a Pareto curve has ≥ 2 guidance
    scales (the tiny grid's digits arms other than base/divin have one: named, not drawn as a lone point), the
    digit samples ≥ 40 px each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report, frame, cfg, handle = _report_hooks(run)
    figures = dict(report.plots(frame, cfg, run=handle))
    assert {"gmm pareto recall vs precision", "digits pareto vendi vs fid", "digits samples eps",
            "gmm minority mass vs w"} <= set(figures)
    for title, figure in figures.items():
        small = [(t, round(s, 1)) for t, s in shown_texts(figure) if t and s < 8]
        assert not small, (title, small)
        assert not overlapping_titles(figure), (title, overlapping_titles(figure))
        if "pareto" in title or "vs w" in title:
            for axis in figure.axes:
                assert all(len(line.get_xdata()) >= 2 for line in axis.get_lines() if line.get_linestyle() != ":")
    assert "at one scale only" in figures["digits pareto vendi vs fid"]._suptitle.get_text()
    samples = figures["digits samples eps"]
    width_in = samples.get_tightbbox().width
    scale = min(1.0, PAGE_PX / (width_in * DPI))
    for axis in samples.axes:
        if axis.get_images():
            mosaic = axis.get_images()[0].get_array().shape[1]  # 10 classes of 16 px and 2 px gaps
            shown = axis.get_window_extent().width / samples.dpi * DPI * scale
            assert shown * 16 / mosaic >= 40, shown * 16 / mosaic
    plt.close("all")


def test_a_single_guidance_scale_draws_no_pareto_plot_and_says_so(run):
    """One guidance scale per arm (the smoke and default presets at w = 4): no Pareto or minority-mass-vs-w plot,
    and the arms table's note says why."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report, frame, cfg, handle = _report_hooks(run)
    frame = frame[frame["cfg_scale"].isna() | (frame["cfg_scale"] == 4.0)]
    titles = [t for t, _ in report.plots(frame, cfg, run=handle)]
    plt.close("all")
    assert not [t for t in titles if "pareto" in t or "vs w" in t], titles
    notes = [t.note for t in report.tables(frame, cfg) if "arms at w = 4" in t.title]
    assert len(notes) == 4 and all("no Pareto plot over w" in n for n in notes)


def test_generate_verb_and_a_local_model_directory(run, tmp_path):
    out = tmp_path / "grid.png"
    result = ok("diverse-init", "generate", run, "--class", "3", "--n", "4", "--variant", "divin", "--cfg", "2",
                "--traj", "cads,ig", "--steps", "2", "--out", out, "--json")
    assert result["param"] == "eps" and out.exists() and np.load(tmp_path / "grid.npy").shape == (4, 1, 16, 16)
    flow = ok("diverse-init", "generate", "--model", run / "checkpoints" / "digits_flow", "--n", "3", "--tau", "0.5",
              "--steps", "2", "--out", tmp_path / "f.png", "--json")
    assert flow["param"] == "flow" and flow["tau"] == 0.5  # from its FlowMatchEuler scheduler config
    # the run's checkpoint is a plain save_pretrained directory: train/eval with it as --model
    runs = tmp_path / "runs"
    trained = ok("diverse-init", "train", *TINY, "--set", "tiers=digits", "--model", run / "checkpoints" / "digits_flow",
                 "--runs-dir", runs, "--json")
    frame = pd.read_parquet(Path(trained["run_dir"]) / "metrics.parquet")
    assert "loss" not in set(frame["metric"])  # no denoiser training: the given model is used


def test_user_data_file(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "digits.npz"
    np.savez(path, images=rng.integers(0, 255, (60, 8, 8), dtype=np.uint8), labels=np.arange(60) % 10)
    trained = ok("diverse-init", "train", *TINY, "--set", "tiers=digits", "--set", "params=eps", "--data", path,
                 "--runs-dir", tmp_path / "runs", "--json")
    assert (Path(trained["run_dir"]) / "checkpoints" / "classifier.pt").exists()
    bad = tmp_path / "bad.npz"
    np.savez(bad, pictures=np.zeros((3, 8, 8)))
    code, _, err = astuple(invoke("diverse-init", "train", *TINY, "--data", bad, "--runs-dir", tmp_path / "runs"))
    lines = [line for line in err.splitlines() if line.startswith("icml: error:")]
    assert code == 1 and len(lines) == 1 and "lacks `images` or `labels`" in lines[0] and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--set", "variants=base,oracle"], "variants ['base', 'oracle'] must be a non-empty list"),
    (["--set", "divin.potential=l1"], "divin.potential must be sq or l2"),
    (["--set", "label_dropout=0"], "label_dropout must be in (0, 1)"),
    (["--set", "cads.tau1=0.9", "--set", "cads.tau2=0.5"], "cads needs 0 ≤ tau1 < tau2 ≤ 1"),
    (["--set", "main_cfg=3"], "main_cfg 3.0 is not in gmm.cfg_scales"),
    (["--preset", "paper"], "the paper preset needs --model DIR"),
])
def test_bad_config_is_one_line(tmp_path, argv, message):
    result = invoke("diverse-init", "train", *argv, "--runs-dir", tmp_path)
    assert result.code == 2 and message in result.err and "Traceback" not in result.err
    assert not (tmp_path / "diverse-init").exists()  # nothing created


def test_bad_model_directory_and_generate_options(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"_class_name": "UNet2DModel"}')
    code, _, err = astuple(invoke("diverse-init", "generate", "--model", folder, "--out", tmp_path / "g.png"))
    assert code == 1 and "has no scheduler_config.json" in err and "Traceback" not in err
    code, _, err = astuple(invoke("diverse-init", "generate", "--model", folder, "--variant", "cads"))
    assert code == 2 and "unknown --variant 'cads'" in err
