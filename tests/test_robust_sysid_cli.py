"""`icml robust-sysid` end to end on a tiny config built from the smoke preset: train → eval → report
(--json, HTML), every spec metric/variant/tag, the checkpoints and tables, a user trajectory (CSV, npz,
Parquet through the same loader), and bad input as one line."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from conftest import invoke

TINY = ["--preset", "smoke", "--set", "T=400", "--set", "T_grid=200,400", "--set", "p=3", "--set", "p_grid=2,3,4",
        "--set", "t_sweep_p=2", "--set", "recovery_p=4", "--set", "holdout=100", "--set", "q_grid=0,0.3",
        "--set", "attacks=bias,adaptive", "--set", "irls.iters=60", "--set", "cvx_experiments=recovery"]
SPEC_METRICS = {"param_error", "param_error_rel", "objective", "objective_gap_truth", "objective_gap_ls",
                "subgrad_norm", "truncation_norm", "decay_rate", "attack_rate", "pred_error", "irls_iters",
                "fit_seconds"}
TAGS = ["experiment", "p", "q", "T", "attack", "attack_on", "input", "noise", "system_seed"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    train = invoke("robust-sysid", "train", *TINY, "--json", "--runs-dir", runs)
    assert train.code == 0, train.err
    doc = train.json()
    assert doc["status"] == "completed" and "param_error" in doc["metrics"]
    run = Path(doc["run_dir"])
    result = invoke("robust-sysid", "eval", run, "--json", "--runs-dir", runs)
    assert result.code == 0, result.err
    assert "decay_rate" in result.json()["metrics"]
    report = invoke("robust-sysid", "report", run, "--format", "html", "--out", runs / "r.html", "--runs-dir", runs)
    assert report.code == 0, report.err
    return run


@pytest.fixture(scope="module")
def metrics(tiny_run):
    return pd.read_parquet(tiny_run / "metrics.parquet")


def test_every_metric_variant_and_tag(metrics):
    from icml.methods.robust_sysid.estimators import cvxpy_available

    evaluated = metrics[metrics["phase"] == "eval"]
    assert SPEC_METRICS <= set(evaluated["metric"])
    expected = {"l2_irls", "ls", "huber", "lad_coordwise", "truth"} | ({"l2_cvx"} if cvxpy_available() else set())
    assert set(evaluated["variant"]) == expected
    assert set(evaluated["experiment"]) == {"p_sweep", "q_sweep", "t_sweep", "recovery"}
    scored = evaluated[evaluated["metric"] == "param_error"]
    assert scored[TAGS + ["seed"]].notna().all().all()
    assert set(scored.loc[scored["experiment"] == "p_sweep", "p"]) == {2, 3, 4}
    assert set(scored.loc[scored["experiment"] == "t_sweep", "T"]) == {200, 400}
    assert set(scored["attack"]) == {"bias", "adaptive"}
    assert set(evaluated.loc[evaluated["experiment"] == "recovery", "noise"]) == {0.0}
    if cvxpy_available():  # the SOCP check runs where cvx_experiments says
        cvx = scored[scored["variant"] == "l2_cvx"]
        assert set(cvx["experiment"]) == {"recovery"}
    # q = 0 is one fit labelled for each attack model: identical numbers
    q0 = scored[(scored["experiment"] == "q_sweep") & (scored["q"] == 0)]
    pivot = q0.pivot_table(index="variant", columns="attack", values="value")
    np.testing.assert_array_equal(pivot["bias"], pivot["adaptive"])
    # param_error_rel = param_error / ‖Θ*_p‖_F and the decay fit is one row per variant, attack, q, seed
    decay = evaluated[evaluated["metric"] == "decay_rate"]
    assert len(decay) == decay[["variant", "attack", "q", "seed"]].drop_duplicates().shape[0] > 0
    assert decay["value"].between(0, 10).all()
    rates = evaluated[evaluated["metric"] == "attack_rate"]
    assert (rates.loc[rates["q"] == 0, "value"] == 0).all() and rates["value"].between(0, 1).all()


def test_l2_fits_are_optimal_and_recover(metrics):
    evaluated = metrics[metrics["phase"] == "eval"]
    l2 = evaluated[evaluated["variant"] == "l2_irls"].pivot_table(
        index=["experiment", "p", "T", "q", "attack", "seed"], columns="metric", values="value")
    # an optimal ℓ₂ fit is at most the objective of Θ*_p and of Θ̂_LS (the IRLS start: monotone)
    assert (l2["objective_gap_ls"] <= 0).all()
    assert (l2.drop(index="recovery", level="experiment")["objective_gap_truth"] <= 0).all()
    recovery = evaluated[(evaluated["experiment"] == "recovery") & (evaluated["metric"] == "param_error")]
    by_variant = recovery.groupby("variant")["value"].max()
    truncation = evaluated[(evaluated["experiment"] == "recovery") & (evaluated["metric"] == "truncation_norm")]
    assert by_variant["l2_irls"] < 100 * truncation["value"].max()  # ρ^p = 1e-4: error at the truncation scale
    assert by_variant["ls"] > 0.5


def test_train_outputs(tiny_run, metrics):
    trained = metrics[metrics["phase"] == "train"]
    trace = trained[trained["split"] == "trace"].sort_values("step")
    assert set(trace["variant"]) == {"l2_irls"} and trace["step"].iloc[0] == 0 and len(trace) >= 3
    assert (np.diff(trace["value"]) <= 1e-12 * trace["value"].iloc[0]).all()  # majorize–minimize
    fit = trained[trained["split"] == "fit"]
    assert set(fit.loc[fit["metric"] == "param_error", "variant"]) >= {"l2_irls", "ls", "huber", "lad_coordwise"}
    system = np.load(tiny_run / "checkpoints" / "system.npz")
    assert float(system["rho"]) == pytest.approx(0.7, abs=1e-12)
    theta = np.load(tiny_run / "checkpoints" / "theta_l2_irls.npz")
    assert theta["theta"].shape == theta["truth"].shape == (2, 6)
    residuals = pd.read_parquet(tiny_run / "residuals.parquet")
    assert set(residuals["variant"]) == {"l2_irls", "ls"} and len(residuals) == 2 * 400
    assert residuals["attacked"].any() and not residuals["attacked"].all()


def test_report_renders(tiny_run):
    html = (tiny_run.parent.parent / "r.html").read_text()
    for title in ("Reference problem (train)", "param_error vs memory p", "decay_rate", "param_error vs attack probability q",
                  "Bias floor", "Recovery", "Fit diagnostics"):
        assert title in html, title
    assert html.count("data:image/png;base64,") == 5


def _user_trajectory(n: int = 600):
    from icml.methods.robust_sysid.system import draw_system, features, simulate

    rng = np.random.default_rng(0)
    system = draw_system(4, [0.5, 0.4, -0.3, 0.2], 1)
    u = 1 + rng.standard_normal((n, 1))
    y = simulate(system, features(u), 0.01 * rng.standard_normal((n, 4)), 0.01 * rng.standard_normal((n, 2)))
    return u, y


@pytest.mark.parametrize("suffix", [".csv", ".npz", ".parquet"])
def test_user_trajectory(icml, tmp_path, suffix):
    u, y = _user_trajectory()
    path = tmp_path / f"traj{suffix}"
    frame = pd.DataFrame({"u": u[:, 0], "y1": y[:, 0], "y2": y[:, 1]})
    if suffix == ".csv":
        frame.to_csv(path, index=False)
    elif suffix == ".parquet":
        frame.to_parquet(path)
    else:
        np.savez(path, u=u, y=y)
    train = icml("robust-sysid", "train", "--preset", "smoke", "--data", path, "--set", "p=4", "--set", "p_grid=2,4",
                 "--set", "variants=l2_irls,ls", "--json")
    assert train.code == 0, train.err
    run = Path(train.json()["run_dir"])
    frame = pd.read_parquet(run / "metrics.parquet")
    fit = frame[frame["split"] == "fit"]
    assert set(fit["variant"]) == {"l2_irls", "ls"} and set(fit["experiment"]) == {"user"}
    assert set(fit["T"]) == {round(0.8 * (600 - 4))}  # the first 80 % of the samples with a full window
    if suffix != ".csv":  # the loader is the only difference between the formats
        return
    assert icml("robust-sysid", "eval", run, "--json").code == 0
    frame = pd.read_parquet(run / "metrics.parquet")
    pred = frame[(frame["metric"] == "pred_error") & (frame["phase"] == "eval")]
    assert set(pred["experiment"]) == {"user_p_sweep"} and set(pred["p"]) == {2, 4}
    assert set(pred["variant"]) == {"l2_irls", "ls"} and set(pred["input"]) == {"user"}
    by_p = pred.groupby("p")["value"].max()
    assert by_p[4] < by_p[2] and by_p[4] < 0.5  # a clean stable system: a longer memory predicts better
    assert "param_error" not in set(frame["metric"])  # no truth for user data
    report = icml("robust-sysid", "report", run, "--format", "markdown")
    assert report.code == 0 and "held-out pred_error vs p" in report.out + report.err


@pytest.mark.parametrize("argv, message", [
    (["--set", "variants=l2_irls,nope"], "variants must be a non-empty list"),
    (["--set", "attack.kind=zzz"], "attack.kind must be one of"),
    (["--set", "system.rho_spectrum=0.7,1.2,0.1,0.1"], "every |eigenvalue| < 1"),
    (["--set", "q=1.5"], "attack probabilities"),
    (["--set", "T=20"], "T and T_grid need at least"),
    (["--data", "/no/such/traj.csv"], "--data '/no/such/traj.csv' does not exist"),
])
def test_bad_input_is_one_line(icml, argv, message):
    result = icml("robust-sysid", "train", "--preset", "smoke", *argv)
    assert result.code == 2
    lines = [line for line in result.err.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.err


@pytest.mark.parametrize("content, message", [
    ("a,b\n1,2\n", "needs input columns u* and output columns y*"),
    ("u,y\n1,2\n2,\n", "missing or non-finite values"),
    ("u,y\n1,2\n2,3\n", "too few for p = 6"),
])
def test_bad_user_file_is_one_line(icml, tmp_path, content, message):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    result = icml("robust-sysid", "train", "--preset", "smoke", "--data", path)
    assert result.code == 2
    lines = [line for line in result.err.splitlines() if line.strip().startswith("icml: error")]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.err
