"""`icml drive-world` end to end through the CLI on a tiny config built from the smoke preset: train → eval →
report (--json), every generator/policy variant and spec metric, rollouts.parquet, bad inputs."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from conftest import invoke

TINY = ["--preset", "smoke", "--set", "data.n_tiles=16", "--set", "data.eval_tiles=6", "--set", "vae.steps=3",
        "--set", "dit.steps=2", "--set", "sim.steps=3", "--set", "eval_samples=4", "--set", "latency_repeats=1",
        "--set", "rollout.km=0.02", "--set", "dit.batch_size=4", "--set", "vae.batch_size=4",
        "--set", "sim.batch_size=16", "--set", "sim.vocab=32"]
GENERATORS = {"meanflow_1", "meanflow_3", "flow_heun24", "flow_euler1", "meanflow_1_nogate", "vae_recon"}
POLICIES = {"idm", "deltasim_discrete", "deltasim_no_dkal", "deltasim", "deltasim_proj"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    result = invoke("drive-world", "train", *TINY, "--runs-dir", runs, "--json")
    assert result.code == 0, result.err
    run = result.json()["run_dir"]
    result = invoke("drive-world", "eval", run, "--runs-dir", runs, "--json")
    assert result.code == 0, result.err
    return runs, run


def test_every_variant_and_metric(tiny_run):
    from icml.methods.drive_world import METHOD
    from icml.methods.drive_world.report import GEN, LOOP

    _, run = tiny_run
    frame = pd.read_parquet(f"{run}/metrics.parquet")
    ev = frame[frame["phase"] == "eval"]
    gen = ev[ev["metric"].isin(GEN)]
    assert set(gen["variant"]) == GENERATORS
    assert all(set(rows["metric"]) == set(GEN) for _, rows in gen.groupby("variant"))
    loop = ev[ev["metric"].isin(LOOP)]
    assert set(map(tuple, loop[["policy", "start_mode"]].values)) == {(p, m) for p in POLICIES for m in ("warm", "cold")}
    assert set(ev.loc[ev["metric"] == "npc_token_acc", "variant"]) == POLICIES - {"idm"}
    assert set(frame["metric"]) <= set(METHOD.metrics)
    assert set(ev.loc[ev["variant"] == "flow_heun24", "nfe"]) == {48}
    # the exact projection leaves no executed NPC step with a positive kinematic cost
    proj = loop[(loop["policy"] == "deltasim_proj") & loop["metric"].isin(["kin_violation_rate", "kin_cost_mean"])]
    assert len(proj) == 4 and (proj["value"] == 0).all()
    rollouts = pd.read_parquet(f"{run}/rollouts.parquet")
    assert list(rollouts.columns) == ["run_id", "rollout_id", "policy", "start_mode", "km", "end_reason", "n_tiles"]
    assert len(rollouts) == 10 and (rollouts["n_tiles"] >= 1).all()


def test_report_json_and_html(tiny_run, tmp_path):
    runs, run = tiny_run
    result = invoke("drive-world", "report", run, "--runs-dir", runs, "--format", "json")
    assert result.code == 0 and json.loads(result.out)
    out = tmp_path / "r.html"
    result = invoke("drive-world", "report", run, "--runs-dir", runs, "--format", "html", "--out", out)
    assert result.code == 0, result.err
    html = out.read_text()
    assert "Generators (held-out tiles)" in html and "Closed-loop rollouts" in html
    assert html.count("data:image/png;base64,") == 5  # gap vs latency, losses, jerk, 2 tile galleries


def test_bad_inputs(tmp_path):
    for setting, message in (("stages=[vae,fly]", "unknown stage 'fly'"), ("dit.r_equals_t=2", "dit.r_equals_t must be in"),
                             ("rollout.km=0", "rollout.km must be > 0"), ("dit.lane_d=50", "divisible")):
        result = invoke("drive-world", "train", "--set", setting, "--runs-dir", tmp_path)
        assert result.code == 2 and message in result.err and "Traceback" not in result.err, (setting, result.err)
