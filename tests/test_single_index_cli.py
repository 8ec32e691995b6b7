"""`icml single-index` end to end at a test-sized smoke config: train → eval → report through the CLI,
every spec metric, variant, tag and table present, the trap and the escape sweep in the results, user
data files through the same estimator path, and bad input as one line."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from conftest import invoke

TINY = ["--preset", "smoke", "--set", "rkhs.n=800", "--set", "rkhs.iters=40", "--set", "rkhs.n_test=2000",
        "--set", "ode.n_grid=30"]
SPEC_METRICS = {"overlap", "overlap_abs", "risk", "escape_time", "escape_slope", "final_overlap", "final_risk",
                "train_mse", "test_mse", "coef_error"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    train = invoke("single-index", "train", *TINY, "--runs-dir", runs, "--json")
    assert train.code == 0, train.err
    run = Path(train.json()["run_dir"])
    evaluation = invoke("single-index", "eval", run, "--runs-dir", runs, "--json")
    assert evaluation.code == 0, evaluation.err
    report = invoke("single-index", "report", run, "--runs-dir", runs, "--format", "html", "--out", runs / "r.html")
    assert report.code == 0, report.err
    return run, evaluation.json()


@pytest.fixture(scope="module")
def metrics(tiny_run):
    return pq.read_table(tiny_run[0] / "metrics.parquet").to_pandas()


def test_every_metric_variant_and_tag(metrics):
    assert SPEC_METRICS <= set(metrics["metric"])
    ode = metrics[metrics["solver"] == "ode"]
    rkhs = metrics[metrics["solver"] == "rkhs"]
    assert set(ode["variant"]) == {"joint", "planted", "l2_flow", "argmin_phi"}
    assert set(rkhs["variant"]) == {"joint", "planted", "save", "sir", "fixed_w"}
    assert set(ode["experiment"]) == {"escape", "trap"} and set(ode["target"]) == {"he2", "he2_he3"}
    sweep = ode[(ode["experiment"] == "escape") & (ode["metric"] == "escape_time")]
    assert len(sweep) == 2 * 2 * 2 * 4 and set(sweep["d"]) == {100, 400}  # targets × d × sign × variant
    np.testing.assert_allclose(sweep["m0"].abs(), 1 / np.sqrt(sweep["d"].astype(float)), rtol=1e-15)
    assert set(sweep["info_exp"]) == {2}
    slopes = ode[ode["metric"] == "escape_slope"]
    assert len(slopes) == 2 * 2 * 4 and slopes["d"].isna().all()
    joint = slopes[(slopes["variant"] == "joint")]["value"]
    assert joint.between(0.85, 1.1).all()  # s = 2: T½ ~ d^(s−1)
    train = metrics[metrics["phase"] == "train"]
    curve = train[(train["variant"] == "joint") & (train["metric"] == "overlap")]
    assert sorted(curve["step"].unique()) == list(range(1, 41)) and set(curve["seed"]) == {0, 1}
    assert rkhs[["n", "K", "rho", "eta", "d", "m0"]].notna().all().all()
    assert set(rkhs["n"]) == {800} and set(rkhs["d"]) == {32} and set(rkhs["m0"]) == {-0.3}


def test_trap_and_estimator_outcomes(metrics):
    trap = metrics[(metrics["experiment"] == "trap")].pivot_table(index="variant", columns="metric", values="value")
    assert trap.loc["planted", "final_overlap"] == pytest.approx(-2 / 3, abs=1e-6)
    assert trap.loc["planted", "final_risk"] == pytest.approx(50 / 27, abs=1e-6)
    assert trap.loc["joint", "final_overlap"] == pytest.approx(-1, abs=1e-6)
    assert trap.loc["joint", "final_risk"] == pytest.approx(0, abs=1e-8)
    rkhs = metrics[(metrics["solver"] == "rkhs") & (metrics["phase"] == "eval")]
    final = rkhs.pivot_table(index=["variant", "seed"], columns="metric", values="value")
    assert (final.loc["joint", "final_overlap"] < -0.9).all()  # the mirror solution from m₀ = −0.3
    np.testing.assert_allclose(final.loc["fixed_w", "final_overlap"], -0.3, rtol=0, atol=1e-12)  # w frozen at w₀
    assert (final.loc["joint", "test_mse"] < final.loc["planted", "test_mse"]).all()
    assert (final["overlap_abs"] == final["final_overlap"].abs()).all()


def test_tables_checkpoints_and_report(tiny_run):
    run, evaluation = tiny_run
    trajectories = pq.read_table(run / "trajectories.parquet").to_pandas()
    assert {"run_id", "solver", "experiment", "variant", "target", "d", "m0", "seed", "t", "k", "value"} <= set(
        trajectories.columns)
    assert {-2, -1, 0, 1, 2, 3, 4, 5, 6} == set(trajectories["k"])
    joint = trajectories[(trajectories["solver"] == "rkhs") & (trajectories["variant"] == "joint")
                         & (trajectories["seed"] == 0) & (trajectories["k"] == -1)]
    assert len(joint) == 40
    ckpt = np.load(run / "checkpoints" / "estimator_joint_seed1.npz")
    assert {"w", "a", "w_star", "config"} <= set(ckpt.files)
    assert abs(np.linalg.norm(ckpt["w"]) - 1) < 1e-14 and json.loads(str(ckpt["config"]))["rkhs"]["n"] == 800
    html = (run.parent.parent / "r.html").read_text()
    for title in ("Escape times T½ (population ODE)", "Escape-time scaling and final values", "Trap",
                  "RKHS alternating estimator vs baselines"):
        assert title in html
    assert html.count("data:image/png;base64,") == 6
    headline = evaluation["metrics"]  # eval --json: one object with the headline numbers for pipelines
    assert headline["trap_final_overlap"]["planted"] == pytest.approx(-2 / 3, abs=1e-6)
    assert set(headline["rkhs_test_mse"]) == {"joint", "planted", "save", "sir", "fixed_w"}


def _user_npz(path: Path, with_w_star: bool) -> Path:
    from icml.methods.single_index.config import preset
    from icml.methods.single_index.estimator import synthetic_sample

    cfg = preset("smoke").rkhs
    cfg.d, cfg.n, cfg.n_test = 8, 1500, 10
    sample = synthetic_sample(cfg, 3)
    arrays = {"x": sample.x.numpy(), "y": sample.y.numpy()}
    if with_w_star:
        arrays["w_star"] = sample.w_star.numpy()
    np.savez(path, **arrays)
    return path


def test_user_npz_with_w_star(icml, tmp_path):
    data = _user_npz(tmp_path / "mine.npz", with_w_star=True)
    train = icml("single-index", "train", "--preset", "smoke", "--set", f"data.path={data}", "--set", "seeds=1",
                 "--set", "rkhs.iters=60", "--json")
    assert train.code == 0, train.err
    run = Path(train.json()["run_dir"])
    assert icml("single-index", "eval", run, "--json").code == 0
    frame = pq.read_table(run / "metrics.parquet").to_pandas()
    final = frame[frame["phase"] == "eval"].set_index("metric")["value"]
    assert set(frame["variant"]) == {"joint"} and set(frame["experiment"]) == {"user"}
    assert set(frame["target"]) == {"mine"} and "escape_time" not in set(frame["metric"])
    assert final["overlap_abs"] > 0.9 and final["test_mse"] < 0.3  # a random start still finds w* (or −w*)
    assert icml("single-index", "report", run).code == 0


def test_user_csv_without_w_star(icml, tmp_path):
    source = np.load(_user_npz(tmp_path / "src.npz", with_w_star=False))
    frame = pd.DataFrame(source["x"], columns=[f"x{j}" for j in range(8)]).assign(y=source["y"])
    frame.to_csv(tmp_path / "mine.csv", index=False)
    train = icml("single-index", "train", "--preset", "smoke", "--data", tmp_path / "mine.csv",
                 "--set", "seeds=1", "--set", "rkhs.iters=20", "--json")
    assert train.code == 0, train.err
    run = Path(train.json()["run_dir"])
    assert icml("single-index", "eval", run).code == 0
    metrics = set(pq.read_table(run / "metrics.parquet").to_pandas()["metric"])
    assert metrics == {"train_mse", "test_mse"}  # without w*: prediction metrics only


@pytest.mark.parametrize("argv, message", [
    (["--set", "ode.targets=he2,he9"], "unknown value(s) ['he9'] in 'ode.targets'"),
    (["--set", "ode.K=2"], "ode.K (2) is below the degree 3"),
    (["--set", "rkhs.rho=0"], "rkhs.rho must be in (0, 1]"),
    (["--set", "rkhs.m0=1.5"], "must be overlaps in (−1, 1)"),
    (["--set", "ode.phi_update=newton"], "ode.phi_update must be one of gradient, argmin"),
    (["--set", "data.path=/no/such/file.csv"], "data.path '/no/such/file.csv' is not a file"),
])
def test_bad_config_is_one_line(icml, argv, message):
    result = icml("single-index", "train", "--preset", "smoke", *argv)
    assert result.code == 2
    lines = [line for line in result.err.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.err


@pytest.mark.parametrize("content, message", [
    ("a,b\n1,2\n", "needs columns x0…x{d−1} and y"),
    ("x0,x1,y\n" + "1,2,oops\n" * 30, "non-numeric values"),
    ("x0,x2,y\n" + "1,2,3\n" * 30, "must be x0…x1 without gaps"),
    ("x0,x1,y\n" + "1,,3\n" * 30, "missing or non-finite values"),
])
def test_bad_user_file_is_one_line(icml, tmp_path, content, message):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    result = icml("single-index", "train", "--preset", "smoke", "--set", f"data.path={path}")
    assert result.code == 2
    lines = [line for line in result.err.splitlines() if line.startswith("icml: error")]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.err


def test_corrupt_npz_is_one_line(icml, tmp_path):
    path = tmp_path / "bad.npz"
    path.write_bytes(b"PK\x03\x04 not really a zip")
    result = icml("single-index", "train", "--preset", "smoke", "--set", f"data.path={path}")
    assert result.code == 2 and "cannot be read" in result.err and "Traceback" not in result.err
