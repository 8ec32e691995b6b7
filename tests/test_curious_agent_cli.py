"""`icml curious-agent` end to end through the CLI at a test-sized smoke config: every arm's
train and eval metrics land in metrics.parquet, the report renders, bad input fails in one line."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from conftest import train_and_eval

TINY = ["--preset", "smoke", "--set", "ppo.total_steps=32", "--set", "ppo.n_envs=2", "--set", "ppo.rollout=8",
        "--set", "ppo.epochs=1", "--set", "warmup.transitions=16", "--set", "warmup.epochs=1",
        "--set", "eval_episodes=2", "--set", "env.max_steps=6", "--set", "glance.reset_every=0.5",
        "--set", "arms=ppo,ppo_rnd,vagen_lite,glance", "--seed", "3"]


def test_train_eval_report_records_every_arm_and_metric(icml, tmp_path):
    run = train_and_eval(icml, "curious-agent", *TINY)
    frame = pq.read_table(run / "metrics.parquet").to_pandas()
    train, evaluated = frame[frame["phase"] == "train"], frame[frame["phase"] == "eval"]
    assert set(train["variant"]) == set(evaluated["variant"]) == {"ppo", "ppo_rnd", "vagen_lite", "glance"}
    assert (train["split"] == "train").all() and (evaluated["split"] == "eval").all()
    glance = train[train["variant"] == "glance"]
    assert {"explore_loss", "intrinsic_reward_raw", "intrinsic_reward_norm", "projector_reset", "coverage",
            "policy_entropy", "value_loss", "sps", "obs_slot_acc", "pred_slot_acc", "steps_to_first_success",
            "first_success_found", "ri_novel_over_revisit"} <= set(glance["metric"])
    resets = glance[glance["metric"] == "projector_reset"].sort_values("step")["value"].tolist()
    assert resets == [0.0, 1.0]  # 2 updates, reset every 50%: before the second
    assert "explore_loss" not in set(train.loc[train["variant"] == "vagen_lite", "metric"])
    assert (glance["beta"] == 0.1).all() and (glance["env_id"] == "MiniGrid-DoorKey-5x5-v0").all()
    assert {"success_rate", "mean_return"} <= set(evaluated.loc[evaluated["variant"] == "ppo", "metric"])
    assert {"obs_slot_acc", "pred_slot_acc", "probe_ri_decay"} <= set(evaluated.loc[evaluated["variant"] == "glance", "metric"])
    decay = evaluated.loc[evaluated["metric"] == "probe_ri_decay", "value"].iloc[0]
    assert 0 <= decay < 1  # 20 alignment steps on one transition must lower its r^i
    fresh = evaluated.loc[evaluated["metric"] == "probe_fresh_ri_decay", "value"].iloc[0]
    assert fresh > 0 and np.isfinite(fresh)
    assert "success_rate" in set(train.loc[train["variant"] == "ppo", "metric"])  # success vs env steps
    coverage = frame[(frame["metric"] == "coverage") & (frame["experiment"] == "final")]["value"]
    assert ((coverage > 0) & (coverage <= 1)).all()
    rnd = train[train["variant"] == "ppo_rnd"]
    assert {"intrinsic_reward_raw", "intrinsic_reward_norm"} <= set(rnd["metric"])
    for arm in ("ppo", "ppo_rnd", "vagen_lite", "glance"):
        assert (run / "checkpoints" / arm / "seed3" / "agent.pt").exists()
    assert (run / "visits.parquet").exists()
    out = tmp_path / "r.html"
    result = icml("curious-agent", "report", str(run), "--format", "html", "--out", str(out))
    assert result.code == 0, result.err
    html = out.read_text()
    assert "Greedy evaluation" in html and "Exploration during training" in html
    assert html.count("data:image/png;base64,") >= 7


def test_coverage_experiment_runs_without_task_reward_beside_the_main_one(icml):
    """coverage.env_id adds the zero-extrinsic-reward experiment to the same run: its own env,
    arms, budget and checkpoints, rows tagged reward_mode=intrinsic_only, its own report table."""
    run = Path(icml("curious-agent", "train", *TINY[:-4], "--set", "arms=ppo", "--set", "coverage.arms=glance",
                    "--set", "coverage.env_id=MiniGrid-FourRooms-v0", "--set", "coverage.total_steps=16",
                    "--json").json()["run_dir"])
    frame = pq.read_table(run / "metrics.parquet").to_pandas()
    intrinsic = frame[frame["reward_mode"] == "intrinsic_only"]
    assert set(intrinsic["variant"]) == {"glance"} and (intrinsic["env_id"] == "MiniGrid-FourRooms-v0").all()
    assert set(frame.loc[frame["reward_mode"] == "extrinsic", "variant"]) == {"ppo"}
    assert intrinsic.loc[intrinsic["metric"] == "coverage", "step"].max() == 16
    assert (run / "checkpoints" / "coverage" / "glance" / "seed0" / "agent.pt").exists()
    assert icml("curious-agent", "eval", str(run)).code == 0  # evaluates the main experiment only
    result = icml("curious-agent", "report", str(run), "--format", "markdown", "--out", str(run / "r.md"))
    assert result.code == 0, result.err
    assert "Zero extrinsic reward — MiniGrid-FourRooms-v0" in (run / "r.md").read_text()


def test_visit_heat_maps_are_explained():
    """The visit heat maps: one figure per environment with a panel per arm on the environment's whole grid (a
    DoorKey-5x5 run that never left column 1 still shows 5 × 5 cells), each panel titled and its axes labelled,
    a labelled colour bar shared by the arms, a title and a caption saying what a cell is."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from icml.methods.curious_agent.config import preset
    from icml.methods.curious_agent.report import plots

    env = "MiniGrid-DoorKey-5x5-v0"
    visits = pd.DataFrame([{"variant": arm, "seed": seed, "env_id": env, "x": 1, "y": y, "dir": 0, "count": 3 + y}
                           for arm in ("ppo", "glance") for seed in (0, 1) for y in (1, 2, 3)])

    class Run:
        def table(self, name):
            return visits if name == "visits" else None

    frame = pd.DataFrame(columns=["phase", "experiment", "env_id", "reward_mode", "variant", "metric", "step",
                                  "value"])
    figures = dict(plots(frame, preset("smoke"), run=Run()))
    assert list(figures) == [f"visits per cell {env}"]
    figure = figures[f"visits per cell {env}"]
    maps = [a for a in figure.axes if a.get_images()]
    bars = [a for a in figure.axes if not a.get_images() and a.get_ylabel()]
    assert [a.get_title() for a in maps] == ["ppo", "glance"]
    for axis in maps:
        assert axis.get_images()[0].get_array().shape == (5, 5)
        assert axis.get_xlabel() and axis.get_ylabel()
    assert len(bars) == 1 and bars[0].get_ylabel() == "log(1 + visits)"
    assert "DoorKey-5x5" in figure._suptitle.get_text()
    caption = figure._supxlabel.get_text()
    assert "cell is one tile of the 5 × 5 grid" in caption and "summed over 2 seeds" in caption
    plt.close("all")


def test_bad_input_fails_in_one_line(icml):
    for assignment, message in (("arms=ppo,nope", "unknown arm(s) ['nope']"),
                                ("model.path=/nonexistent", "--model '/nonexistent' does not exist"),
                                ("coverage.arms=glance,nope", "unknown arm(s) ['nope'] in 'coverage.arms'"),
                                ("env.id=MiniGrid-Nope-v0", "env.id 'MiniGrid-Nope-v0' is not supported"),
                                ("glance.ema_alpha=1.5", "glance.ema_alpha must be in [0, 1)"),
                                ("reward_mode=dense", "reward_mode must be")):
        result = icml("curious-agent", "train", "--preset", "smoke", "--set", assignment)
        assert result.code == 2 and message in result.err and "Traceback" not in result.err, result.err


def test_missing_checkpoint_is_reported(icml):
    run = Path(icml("curious-agent", "train", *TINY[:-4], "--set", "arms=ppo", "--json").json()["run_dir"])
    (run / "checkpoints" / "ppo" / "seed0" / "agent.pt").write_bytes(b"not a checkpoint")
    result = icml("curious-agent", "eval", str(run))
    assert result.code == 1 and "cannot be read" in result.err and "Traceback" not in result.err


def test_model_option_trains_and_evaluates_a_local_hf_vlm(icml, tmp_path):
    """--model DIR (a LLaVA written by save_pretrained) goes through train -> eval like the tiny agent."""
    from test_curious_agent_math import tiny_llava

    tiny_llava(tmp_path / "vlm")
    run = train_and_eval(icml, "curious-agent", *TINY[:-4], "--set", "arms=glance", "--model", str(tmp_path / "vlm"))
    frame = pq.read_table(run / "metrics.parquet").to_pandas()
    assert {"explore_loss", "probe_ri_decay", "pred_slot_acc"} <= set(frame.loc[frame["variant"] == "glance", "metric"])
    import torch

    state = torch.load(run / "checkpoints" / "glance" / "seed0" / "agent.pt", weights_only=True)
    assert state["glance"]["projector.net.0.weight"].shape == (96, 48)  # g_psi sized to the LM's width
    bad = tmp_path / "not_a_vlm"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "gpt2"}')  # an architecture --model does not take
    result = icml("curious-agent", "train", *TINY[:-4], "--set", "arms=glance", "--model", str(bad))
    assert result.code == 2 and "Traceback" not in result.err, result.err
    assert "is a gpt2 checkpoint; curious-agent supports llava, qwen2_5_vl" in result.err
    (bad / "config.json").write_text('{"model_type": "qwen2_5_vl"}')  # a supported type without weights
    result = icml("curious-agent", "train", *TINY[:-4], "--set", "arms=glance", "--model", str(bad))
    assert result.code == 2 and "has no weights" in result.err and "Traceback" not in result.err, result.err


def test_model_option_runs_a_local_qwen2_5_vl_through_train_eval_report(icml, tmp_path):
    """--model DIR (a Qwen2.5-VL written by save_pretrained): the same agent loop on its vision tower and
    LM; train, eval and report produce the metrics; the checkpoint holds the tower, its EMA copy and g_ψ."""
    from test_curious_agent_math import tiny_qwen

    tiny_qwen(tmp_path / "qwen")
    run = train_and_eval(icml, "curious-agent", *TINY[:-4], "--set", "arms=glance", "--model", str(tmp_path / "qwen"))
    frame = pq.read_table(run / "metrics.parquet").to_pandas()
    assert {"explore_loss", "intrinsic_reward_norm", "projector_reset", "pred_slot_acc", "coverage",
            "steps_to_first_success"} <= set(frame.loc[frame["phase"] == "train", "metric"])
    assert {"success_rate", "mean_return", "pred_slot_acc", "probe_ri_decay"} <= set(frame.loc[frame["phase"] == "eval", "metric"])
    assert np.isfinite(frame["value"]).all()
    import torch

    state = torch.load(run / "checkpoints" / "glance" / "seed0" / "agent.pt", weights_only=True)
    assert state["glance"]["projector.net.0.weight"].shape == (96, 48)  # g_psi sized to the LM's width
    assert any(k.startswith("target.tower.merger.") for k in state["glance"])  # φ: the EMA of the visual tower
    assert any(k.startswith("lm.text.layers.") for k in state["model"])
    result = icml("curious-agent", "report", str(run), "--format", "markdown", "--out", str(tmp_path / "r.md"))
    assert result.code == 0, result.err
    assert "Greedy evaluation" in (tmp_path / "r.md").read_text()
