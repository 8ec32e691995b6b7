"""`icml belief-filter` end to end through the CLI: every spec variant and metric lands in
metrics.parquet, the report renders, runs are reproducible, and user HMM files are checked."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import train_and_eval, train_eval_report
from icml.methods.belief_filter.config import ARMS

TINY = ["--preset", "smoke", "--set", "ppo.total_steps=600", "--set", "ppo.eval_episodes=40",
        "--set", "arms=obs_only,lof_logits,alf,deep_alf,gru", "--set", "e1.n_seq=8", "--set", "e1.length=50",
        "--set", "e2.inv_eps_grid=30,250", "--set", "e2.n_traj=300", "--set", "e2.horizon=200",
        "--set", "e3.inv_eps_grid=30,250", "--set", "e3.n_traj=200", "--set", "e3.horizon=200"]

SPEC_VARIANTS = {
    "e1": {"lof_linear", "lof_linear_actions", "lof_linear_init_corrected", "lof_linear_stochastic"},
    "e2": {"lof", "alf_sqrt_eps", "alf_lambda_log", "alf_eps_sq", "alf_zero", "alf_one"},
    "e3": {"bayes", "alf_sqrt_eps", "alf_lambda_log", "alf_eps_sq", "alf_wrong_action"},
}
DECODING = {"decode_error", "decode_error_ci_low", "decode_error_ci_high", "error_over_eps_log"}


def train_eval(icml, *extra: str) -> Path:
    return train_and_eval(icml, "belief-filter", *TINY, *extra)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny run shared by the tests that only read it."""
    return train_eval_report("belief-filter", tmp_path_factory.mktemp("runs"), [*TINY, "--seed", "7"])


def test_every_spec_variant_and_metric_is_recorded(tiny_run):
    frame = pq.read_table(tiny_run / "metrics.parquet").to_pandas()
    evaluated = frame[frame["phase"] == "eval"]
    for experiment, variants in SPEC_VARIANTS.items():
        rows = evaluated[evaluated["experiment"] == experiment]
        assert set(rows["variant"]) == variants
    e1 = evaluated[evaluated["experiment"] == "e1"]
    assert set(e1["metric"]) == {"max_logit_gap"}
    e1_gap = e1.set_index("variant")["value"]
    assert e1_gap.drop("lof_linear_stochastic").max() < 1e-9 and e1_gap["lof_linear_stochastic"] > 0.1
    for experiment in ("e2", "e3"):
        rows = evaluated[evaluated["experiment"] == experiment]
        assert DECODING <= set(rows["metric"])
        assert sorted(rows["inv_eps"].dropna().unique()) == [30.0, 250.0]
        assert (rows["horizon"] == 200).all()
    assert evaluated.loc[evaluated["metric"] == "xi", "value"].iloc[0] == pytest.approx(0.7206, abs=1e-3)
    e4 = evaluated[evaluated["experiment"] == "e4"]
    arms = {"obs_only", "lof_logits", "alf", "deep_alf", "gru"}
    assert set(e4["variant"]) == arms and (e4["seed"] == 7).all()
    assert {"final_return", "success_rate", "trap_rate", "return_auc", "feature_decode_error"} == set(e4["metric"])
    assert set(e4.loc[e4["metric"] == "feature_decode_error", "variant"]) == {"lof_logits", "alf", "deep_alf"}
    curves = frame[frame["phase"] == "train"]
    assert set(curves["metric"]) == {"episode_return"} and set(curves["variant"]) == arms
    assert (curves["split"] == "train").all() and curves["step"].max() >= 600
    for arm in arms:
        assert (tiny_run / "checkpoints" / f"policy_{arm}_seed7.pt").exists()


def test_report_renders_tables_and_plots(tiny_run):
    html = (tiny_run.parent.parent / "r.html").read_text()
    for title in ("E1 — linear vs logsumexp", "E2 — two-state HMM", "E3 — action-controlled",
                  "E4 — RingWorld-lite policies", "ξ = 0.7206", "smoke preset"):
        assert title in html
    assert html.count("data:image/png;base64,") == 5
    md = (tiny_run / "report" / "report.md").read_text()
    assert "max_logit_gap ↓" in md and "final_return ↑" in md


def test_same_seed_gives_identical_metrics(icml, tiny_run):
    import pandas as pd

    rerun = train_eval(icml, "--seed", "7")
    first = pq.read_table(tiny_run / "metrics.parquet").to_pandas().drop(columns="run_id")
    second = pq.read_table(rerun / "metrics.parquet").to_pandas().drop(columns="run_id")
    pd.testing.assert_frame_equal(first, second)


def write_hmm(path: Path, **matrices) -> Path:
    path.write_text(json.dumps(matrices))
    return path


def test_user_hmm_file_runs_the_experiments_it_supports(icml, tmp_path):
    shift = [[0, 0, 1], [1, 0, 0], [0, 1, 0]]  # s -> s+1, non-symmetric
    back = [[0, 1, 0], [0, 0, 1], [1, 0, 0]]  # s -> s-1
    E = [[0.7, 0.2, 0.1], [0.2, 0.6, 0.3], [0.1, 0.2, 0.6]]
    controlled = write_hmm(tmp_path / "controlled.json", P=[shift, back], E=E, pi0=[0.5, 0.25, 0.25])
    run = train_eval(icml, "--set", f"hmm.path={controlled}", "--set", "arms=obs_only")
    frame = pq.read_table(run / "metrics.parquet").to_pandas()
    evaluated = frame[frame["phase"] == "eval"]
    assert set(evaluated["experiment"]) == {"e1", "e3", "e4"}
    assert (evaluated.loc[evaluated["experiment"] == "e3", "n_states"] == 3).all()
    gaps = evaluated[evaluated["metric"] == "max_logit_gap"].set_index("variant")["value"]
    assert gaps.drop("lof_linear_stochastic", errors="ignore").max() < 1e-9


def test_bad_user_hmm_files_fail_in_one_line(icml, tmp_path):
    missing = icml("belief-filter", "train", *TINY, "--set", f"hmm.path={tmp_path / 'nope.json'}")
    assert missing.code == 2 and "hmm.path" in missing.err and "is not a file" in missing.err
    assert not (tmp_path / "runs").exists()

    bad = write_hmm(tmp_path / "bad.json", T=[[0.5, 0.5], [0.4, 0.5]], E=[[1, 0], [0, 1]], pi0=[1, 0])
    result = icml("belief-filter", "train", *TINY, "--set", f"hmm.path={bad}")
    assert result.code == 2 and "Traceback" not in result.err
    assert "column 0 of T sums to 0.9, expected 1" in result.err and not (tmp_path / "runs").exists()

    good = write_hmm(tmp_path / "good.json", T=[[0, 1], [1, 0]], E=[[0.9, 0.2], [0.1, 0.8]], pi0=[1, 0])
    assert icml("belief-filter", "train", *TINY, "--set", f"hmm.path={good}", "--set", "arms=obs_only").code == 0
    good.write_text("{\"T\": [[0, 1], [1, 0]]")  # the file breaks between train and eval
    result = icml("belief-filter", "eval")
    lines = [line for line in result.err.splitlines() if line.startswith("icml: error:")]
    assert result.code == 1 and len(lines) == 1 and "Traceback" not in result.err
    assert "not valid JSON" in lines[0] and " — " in lines[0]


def test_unknown_arm_is_rejected(icml):
    result = icml("belief-filter", "train", "--set", "arms=gru,lstm")
    assert result.code == 2
    assert "unknown arm(s) ['lstm']" in result.err and ", ".join(ARMS) in result.err
