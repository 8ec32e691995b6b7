"""`icml flow-bounds` end to end at a test-sized smoke config: train → eval → report through the CLI,
every spec metric/variant/tag and table present, the exact rows' identities, user point clouds, bad input."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from conftest import invoke

TINY = ["--preset", "smoke", "--set", "exact.d_grid=1,4", "--set", "exact.N_grid=32,64",
        "--set", "exact.h_grid=0.04", "--set", "learned.steps=150", "--set", "learned.log_every=50",
        "--set", "learned.N_grid=8,16", "--set", "learned.n_samples=150", "--set", "learned.eps_samples=100"]
SPEC_METRICS = {"kl_terminal", "w2_terminal", "kl_path", "eps_sq", "eps_l2", "bound_thm1", "bound_thm2",
                "bound_thm3", "bound_thm4_w2", "bound_prior", "ratio_kl_bound", "slope_kl_terminal",
                "slope_kl_path", "slope_w2_terminal", "w2_samples", "bm_loss", "n_steps_actual"}
TAGS = ["mode", "coupling", "d", "n_steps", "h", "eps", "delta", "schedule", "v1", "sigma", "t_end"]


def _ok(result):
    assert result.code == 0, result.err
    return result.json()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    run = Path(_ok(invoke("flow-bounds", "train", *TINY, "--runs-dir", runs, "--json"))["run_dir"])
    doc = _ok(invoke("flow-bounds", "eval", run, "--runs-dir", runs, "--json"))
    report = invoke("flow-bounds", "report", run, "--runs-dir", runs, "--format", "html", "--out", runs / "r.html")
    assert report.code == 0, report.err
    return run, doc


@pytest.fixture(scope="module")
def metrics(tiny_run):
    return pd.read_parquet(tiny_run[0] / "metrics.parquet")


def test_every_metric_variant_and_tag(metrics):
    assert SPEC_METRICS <= set(metrics["metric"])
    assert set(metrics["variant"]) == {"exact", "biased", "bound", "learned", "learned_endpoint", "gmm_reference",
                                       "noise_floor"}
    assert set(TAGS) <= set(metrics.columns)
    exact = metrics[metrics["mode"] == "exact"]
    assert set(exact["coupling"]) == {"ou", "shifted", "aniso"} and set(exact["phase"]) == {"eval"}
    assert (exact["step"] == 0).all() and set(exact["schedule"]) == {"uniform", "nonuniform"}
    loss = metrics[metrics["metric"] == "bm_loss"]
    assert set(loss["phase"]) == {"train"} and sorted(loss["step"].unique()) == [50, 100, 150]
    learned = metrics[(metrics["mode"] == "learned") & (metrics["phase"] == "eval")]
    assert set(learned["coupling"]) == {"gmm8"} and (learned["t_end"] == 0.99).all()
    assert set(learned.loc[learned["variant"] != "noise_floor", "n_steps"]) == {8, 16}


def test_exact_rows_keep_their_identities(metrics):
    exact = metrics[(metrics["mode"] == "exact") & (metrics["variant"] != "bound")]
    wide = exact.pivot_table(index=["coupling", "d", "n_steps", "eps", "delta", "schedule", "v1"], columns="metric",
                             values="value").reset_index()
    # the injected drift error meets Thm 1's condition with equality, and adds ε²/(2σ²) to the path KL
    np.testing.assert_allclose(wide["eps_sq"], wide["eps"] ** 2, rtol=1e-12, atol=1e-300)
    base = wide[wide["eps"] == 0].set_index(["coupling", "d", "n_steps", "delta", "schedule", "v1"])["kl_path"]
    biased = wide[wide["eps"] > 0].set_index(["coupling", "d", "n_steps", "delta", "schedule", "v1"])
    sigma2 = np.where(biased.index.get_level_values("coupling") == "ou", 2.0, 1.0)
    gap = biased["kl_path"] - base.loc[biased.index].to_numpy()
    np.testing.assert_allclose(gap, biased["eps"] ** 2 / (2 * sigma2), rtol=1e-8)
    ou = wide[(wide["coupling"] == "ou") & (wide["eps"] == 0)]
    h = 1 / ou["n_steps"]
    np.testing.assert_allclose(ou["kl_path"], ou["d"] * ou["n_steps"] / 2 * (h + np.expm1(-h)), rtol=1e-10)
    # both schedules of a pair share N and the endpoint; the non-uniform grid wins on the near-degenerate target
    stopped = wide[wide["delta"] > 0].pivot_table(index=["coupling", "d", "n_steps", "eps", "v1"],
                                                  columns="schedule", values="kl_terminal")
    assert (stopped["nonuniform"] < stopped["uniform"]).all()
    assert (wide["n_steps_actual"] == wide["n_steps"]).all()


def test_tables_checkpoints_and_report(tiny_run):
    run, doc = tiny_run
    schedules = pd.read_parquet(run / "schedules.parquet")
    assert list(schedules.columns) == ["schedule", "h", "delta", "k", "t_k", "h_k", "run_id"]
    for (_, _), part in schedules.groupby(["h", "delta"]):
        lengths = part.groupby("schedule").size()
        assert lengths["uniform"] == lengths["nonuniform"]  # the same N …
        ends = part.groupby("schedule").apply(lambda p: (p["t_k"] + p["h_k"]).max(), include_groups=False)
        assert ends["uniform"] == pytest.approx(ends["nonuniform"], abs=1e-15)  # … and the same endpoint
    assert {"coupling", "d", "m0", "m1", "var0", "var1", "cov", "sigma"} <= set(
        pd.read_parquet(run / "couplings.parquet").columns)
    assert (run / "checkpoints" / "drift_seed0.pt").exists() and (run / "checkpoints" / "drift_endpoint_seed0.pt").exists()
    assert set(pd.read_parquet(run / "samples.parquet")["variant"]) == {"learned", "learned_endpoint", "gmm_reference",
                                                                        "target"}
    html = (run.parent.parent / "r.html").read_text()
    for title in ("Slopes of log metric vs log h", "Dimension dependence", "Drift error adds",
                  "Uniform vs non-uniform", "Learned mode (gmm8)"):
        assert title in html
    assert html.count("data:image/png;base64,") == 7
    assert {"slope_kl_path", "kl_terminal", "w2_samples"} <= set(doc["metrics"])


def test_user_point_cloud_and_exact_only(tmp_path):
    rng = np.random.default_rng(0)
    points = np.concatenate([rng.normal(-2, 0.3, (60, 2)), rng.normal(2, 0.3, (60, 2))])
    cloud = tmp_path / "two_blobs.csv"
    pd.DataFrame(points, columns=["x", "y"]).assign(label="a").to_csv(cloud, index=False)
    runs = tmp_path / "runs"
    small = ["--preset", "smoke", "--set", "exact.couplings=ou", "--set", "exact.d_grid=1", "--set",
             "exact.N_grid=32,64", "--set", "learned.steps=50", "--set", "learned.N_grid=8",
             "--set", "learned.drift_losses=bridge", "--runs-dir", runs, "--json"]
    run = Path(_ok(invoke("flow-bounds", "train", *small, "--data", cloud))["run_dir"])
    _ok(invoke("flow-bounds", "eval", run, "--runs-dir", runs, "--json"))
    frame = pd.read_parquet(run / "metrics.parquet")
    learned = frame[(frame["mode"] == "learned") & (frame["phase"] == "eval")]
    assert set(learned["coupling"]) == {"data:two_blobs"}
    assert set(learned["variant"]) == {"learned", "noise_floor"} and set(learned["metric"]) == {"w2_samples"}
    run = Path(_ok(invoke("flow-bounds", "train", *small, "--set", "learned.enabled=false"))["run_dir"])
    assert not (run / "metrics.parquet").exists() and (run / "couplings.parquet").exists()
    _ok(invoke("flow-bounds", "eval", run, "--runs-dir", runs, "--json"))
    assert set(pd.read_parquet(run / "metrics.parquet")["mode"]) == {"exact"}


@pytest.mark.parametrize("argv, needle", [
    (["--set", "exact.delta_grid=0.7"], "exact.delta_grid"),
    (["--set", "exact.couplings=ou,bogus"], "unknown coupling"),
    (["--set", "exact.c=0.5"], "exact.c"),
    (["--set", "learned.drift_losses=score"], "learned.drift_losses"),
    (["--set", "data=/nonexistent/cloud.csv"], "is not a file"),
])
def test_bad_config_is_one_line(tmp_path, argv, needle):
    result = invoke("flow-bounds", "train", "--preset", "smoke", *argv, "--runs-dir", tmp_path)
    assert result.code == 2 and needle in result.err and "Traceback" not in result.err
    assert len(result.err.strip().splitlines()) == 1


def test_corrupt_point_cloud_is_one_line(tmp_path):
    bad = tmp_path / "three.csv"
    pd.DataFrame(np.ones((30, 3)), columns=["a", "b", "c"]).to_csv(bad, index=False)
    garbage = tmp_path / "garbage.npy"
    garbage.write_bytes(b"not a numpy file")
    for path, needle in ((bad, "exactly 2 numeric columns"), (garbage, "cannot be read")):
        result = invoke("flow-bounds", "train", "--preset", "smoke", "--data", path, "--runs-dir", tmp_path)
        assert result.code == 2 and needle in result.err and "Traceback" not in result.err
        assert len(result.err.strip().splitlines()) == 1 and not (tmp_path / "flow-bounds").exists()  # no husk
