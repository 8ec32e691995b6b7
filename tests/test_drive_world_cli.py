"""`icml drive-world` end to end through the CLI on a tiny config built from the smoke preset: train → eval →
report (--json), every generator/policy variant and spec metric, rollouts.parquet, bad inputs."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from conftest import invoke
from plotcheck import figures_of, plot_defects

TINY = ["--preset", "smoke", "--set", "data.n_tiles=16", "--set", "data.eval_tiles=6", "--set", "vae.steps=3",
        "--set", "dit.steps=2", "--set", "sim.steps=3", "--set", "eval_samples=4", "--set", "latency_repeats=1",
        "--set", "rollout.km=0.02", "--set", "dit.batch_size=4", "--set", "vae.batch_size=4",
        "--set", "sim.batch_size=16", "--set", "sim.vocab=32", "--set", "toy.steps=2", "--set", "toy.samples=16"]
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
    toy = ev[ev["metric"] == "toy_energy_distance"]
    assert set(toy["variant"]) == {"meanflow_1", "meanflow_3", "flow_heun24", "flow_euler1"} and toy["value"].notna().all()
    # the exact projection leaves no executed NPC step with a positive kinematic cost
    proj = loop[(loop["policy"] == "deltasim_proj") & loop["metric"].isin(["kin_violation_rate", "kin_cost_mean"])]
    assert len(proj) == 4 and (proj["value"] == 0).all()
    rollouts = pd.read_parquet(f"{run}/rollouts.parquet")
    assert list(rollouts.columns) == ["run_id", "rollout_id", "policy", "start_mode", "km", "end_reason", "n_tiles"]
    assert len(rollouts) == 10 and (rollouts["n_tiles"] >= 1).all()
    # every arm reports its stitching: the fallback share of its tiles, and the gap where any lane was stitched
    stitch = loop[loop["metric"] == "stitch_fallback_rate"]
    assert len(stitch) == 10 and stitch["value"].between(0, 1).all()
    gap = loop.loc[loop["metric"] == "stitch_gap_m", "value"]
    assert len(gap) == 10 and ((gap >= 0) & (gap <= 1.0) | gap.isna()).all()


def test_generators_take_their_lane_counts_from_the_training_tiles(tiny_run):
    """Issue 47: with every held-out tile cut to one lane, the generators' tiles keep training-tile lane counts, so
    fd_density (√Fréchet of #lanes) is the closed form against counts of 1, not 0 by construction; the VAE
    reconstructs the held-out tiles themselves (0)."""
    import shutil
    from pathlib import Path

    import numpy as np

    from icml.methods.drive_world import evaluation, pipeline

    runs, run = tiny_run
    copy = Path(run).with_name(Path(run).name + "-held1")
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("metrics.parquet", "rollouts.parquet"))
    tiles = dict(np.load(copy / "checkpoints/tiles.npz"))
    tiles["held_lane_mask"][:, 1:] = False
    np.savez_compressed(copy / "checkpoints/tiles.npz", **tiles)
    result = invoke("drive-world", "eval", copy, "--runs-dir", runs, "--json")
    assert result.code == 0, result.err
    frame = pd.read_parquet(copy / "metrics.parquet")
    density = frame[(frame["phase"] == "eval") & (frame["metric"] == "fd_density")].set_index("variant")["value"]
    train = {k[6:]: v for k, v in tiles.items() if k.startswith("train_")}
    n = 4  # TINY's eval_samples; the run's seed is the default, 0
    drawn = pipeline.generation_cond(train, n, 0)["lane_mask"].sum(1).numpy().astype(float)
    expected = evaluation.frechet_1d(list(drawn), [1.0] * n)
    assert expected > 3  # training tiles have ≥ 4 lanes
    assert density["vae_recon"] == 0
    for variant in GENERATORS - {"vae_recon"}:
        assert abs(density[variant] - expected) < 1e-12, (variant, density[variant], expected)


def test_every_declared_claim_reads_two_arms_of_a_real_run(tiny_run):
    """The group report judges CLAIMS on these rows: each arm matches real rows, without silent pooling."""
    from icml.methods.drive_world import METHOD
    from icml.methods.drive_world.report import CLAIMS
    from icml.reports.claims import arm_rows

    _, run = tiny_run
    frame = pd.read_parquet(f"{run}/metrics.parquet")
    assert len(CLAIMS) >= 8
    for claim in CLAIMS:  # (values may be NaN here: the tiny generators decode no successor edge)
        assert claim.metric in METHOD.metrics, claim.name
        for arm in (claim.a, claim.b):
            rows = arm_rows(frame, claim, arm)
            assert rows is not None and len(rows) >= 1, (claim.name, arm)


def test_report_json_and_html(tiny_run, tmp_path):
    runs, run = tiny_run
    result = invoke("drive-world", "report", run, "--runs-dir", runs, "--format", "json")
    assert result.code == 0 and json.loads(result.out)
    out = tmp_path / "r.html"
    result = invoke("drive-world", "report", run, "--runs-dir", runs, "--format", "html", "--out", out)
    assert result.code == 0, result.err
    html = out.read_text()
    assert "Generators (held-out tiles)" in html and "Closed-loop rollouts" in html
    assert "8-Gaussian toy" in html
    assert "Rollout trajectories" in html and "stitch_fallback_rate" in html
    for title in ("Outpainting strip", "Kinematic-cost histograms", "Jerk over time", "Latency vs steps"):
        assert f"alt='{title}'" in html, title
    # gap vs latency (when a variant decoded a successor edge), latency vs steps, losses, early jerk, jerk over
    # time, cost histograms, toy, rollouts, strip, 2 galleries
    frame = pd.read_parquet(f"{run}/metrics.parquet")
    gap = np.isfinite(frame.loc[frame["metric"] == "endpoint_gap_m", "value"]).any()
    assert ("alt='Endpoint gap vs latency'" in html) == gap
    assert ("plot is left out" in html) == (not gap)
    assert html.count("data:image/png;base64,") == 10 + gap


def test_report_plots_have_data_room_and_no_legend_or_label_over_them(tiny_run):
    """Seen in a browser: an empty "Endpoint gap vs latency" (no variant decoded a successor edge), overlapping
    variant names at nfe 1, a legend over a third of "Jerk over time", a rollout panel 20 px high."""
    _, run = tiny_run
    figures = figures_of("drive-world", run)
    assert len(figures) >= 10
    assert [d for title, figure in figures for d in plot_defects(title, figure)] == []


def test_endpoint_gap_plot_is_drawn_when_a_gap_exists_and_left_out_with_a_note_when_none():
    from icml.methods.drive_world.report import plots, tables

    rows = [dict(phase="eval", metric=metric, variant=variant, value=value, nfe=nfe, model=None, policy=None,
                 start_mode=None, seed=0)
            for variant, nfe, gap, ms in (("meanflow_1", 1, 0.4, 11.0), ("flow_euler1", 1, 0.9, 10.8),
                                          ("flow_heun24", 48, 0.1, 350.0))
            for metric, value in (("endpoint_gap_m", gap), ("ms_per_tile", ms))]
    frame = pd.DataFrame(rows)
    figures = dict(plots(frame, None))
    assert {"Endpoint gap vs latency", "Latency vs steps"} <= set(figures)
    for title in ("Endpoint gap vs latency", "Latency vs steps"):
        assert plot_defects(title, figures[title]) == []  # meanflow_1 and flow_euler1 nearly coincide
        (axis,) = figures[title].axes
        assert [t.get_text() for t in axis.get_legend().get_texts()] == ["meanflow_1", "flow_heun24", "flow_euler1"]
    assert "left out" not in tables(frame, None)[0].note
    frame.loc[frame["metric"] == "endpoint_gap_m", "value"] = np.nan
    assert "Endpoint gap vs latency" not in dict(plots(frame, None))
    assert "Endpoint gap vs latency\" plot is left out" in tables(frame, None)[0].note


def test_bad_inputs(tmp_path):
    for setting, message in (("stages=[vae,fly]", "unknown stage 'fly'"), ("dit.r_equals_t=2", "dit.r_equals_t must be in"),
                             ("rollout.km=0", "rollout.km must be > 0"), ("dit.lane_d=50", "divisible"),
                             ("rollout.stitch_m=0", "rollout.stitch_m must be > 0")):
        result = invoke("drive-world", "train", "--set", setting, "--runs-dir", tmp_path)
        assert result.code == 2 and message in result.err and "Traceback" not in result.err, (setting, result.err)


def test_generate_tiles_and_rollout(tiny_run, tmp_path):
    import numpy as np

    runs, run = tiny_run
    out, png = tmp_path / "tiles.npz", tmp_path / "tiles.png"
    result = invoke("drive-world", "generate", run, "--runs-dir", runs, "--what", "tiles", "--variant", "meanflow_1",
                    "--n", "3", "--out", out, "--png", png, "--json")
    assert result.code == 0, result.err
    tiles = np.load(out)
    assert tiles["lanes"].shape[0] == 3 and tiles["edges"].shape[1:] == tiles["edges"].shape[1:][::-1]
    assert png.stat().st_size > 0 and result.json()["tiles"] == 3
    out = tmp_path / "rollout.npz"
    result = invoke("drive-world", "generate", run, "--runs-dir", runs, "--what", "rollout", "--variant", "deltasim_proj",
                    "--out", out, "--json")
    assert result.code == 0, result.err
    info, trace = result.json(), np.load(out)
    assert info["kin_violation_rate"] == 0 and trace["ego"].shape[1] == 3
    assert trace["npc_len"].sum() == len(trace["npc"]) and trace["lane_len"].sum() == len(trace["lanes"])
    assert len(trace["tiles"]) == info["n_tiles"] and 0 <= info["stitch_fallback_rate"] <= 1
    # the ego path runs the reported distance
    assert abs(np.linalg.norm(np.diff(trace["ego"][:, :2], axis=0), axis=1).sum() / 1000 - info["km"]) < 1e-9
    for args, message in ((["--what", "cars"], "--what must be"), (["--variant", "idm"], "not a tile variant"),
                          (["--out", "x.csv"], "must end in .npz")):
        result = invoke("drive-world", "generate", run, "--runs-dir", runs, *args)
        assert result.code == 2 and message in result.err and "Traceback" not in result.err, (args, result.err)


def test_data_dir_trains_on_user_tiles_through_the_same_path(tmp_path):
    import numpy as np

    from icml.methods.drive_world import scenario_dreamer
    from icml.methods.drive_world.config import preset
    from icml.methods.drive_world.world import make_tiles

    cfg = preset("smoke").data
    tiles = make_tiles(cfg, 10, 123, 0.3)
    scenario_dreamer.write_dir(tiles, tmp_path / "user")
    runs = tmp_path / "runs"
    result = invoke("drive-world", "train", *TINY, "--set", f"data.data_dir={tmp_path / 'user'}",
                    "--runs-dir", runs, "--json")
    assert result.code == 0, result.err
    cached = np.load(f"{result.json()['run_dir']}/checkpoints/tiles.npz")
    # the last 10 // 5 = 2 files are held out; the rest train; arrays identical to the generated ones
    assert np.array_equal(cached["train_lanes"], tiles["lanes"][:8]) and np.array_equal(cached["held_edges"], tiles["edges"][8:])
    for setting, message in ((f"data.data_dir={tmp_path / 'nowhere'}", "is not a directory"),
                             (f"data.data_dir={runs}", "holds no *.pkl")):
        result = invoke("drive-world", "train", "--set", setting, "--runs-dir", runs)
        assert result.code == 2 and message in result.err and "Traceback" not in result.err, (setting, result.err)
