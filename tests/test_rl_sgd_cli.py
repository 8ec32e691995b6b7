"""`icml rl-sgd` end to end through the CLI at a test-sized config built from the smoke preset:
every spec metric and tag lands in metrics.parquet, the relative LR grids follow the best base
LR, the SFT warm start is cached and reruns reproduce, the report renders, and the real inputs
(--data FILE.jsonl, --model DIR, --reward module:function) run through the same path."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from conftest import invoke

TINY = ["--preset", "smoke", "--set", "llama.hidden=32", "--set", "llama.layers=1", "--set", "llama.heads=2",
        "--set", "llama.kv_heads=1", "--set", "llama.intermediate=64", "--set", "sft.max_steps=40",
        "--set", "sft.problems=2000", "--set", "sft.check_every=20", "--set", "sft.check_problems=20",
        "--set", "steps=3", "--set", "prompts_per_step=4", "--set", "group_size=4", "--set", "sft_batch=16",
        "--set", "eval_problems=24"]
ARMS = ["--set", "arms=adamw,sgd,sgd_momentum,sgd_bf16_master,sft_sgd", "--set", "grids.adamw=1e-3",
        "--set", "grids.sgd=0.1,0.3", "--set", "grids.sgd_momentum=0.1", "--set", "grids.sft_sgd=0.1"]
# a reward with variance inside every group, so the tiny untrained policy gets a gradient
REWARD = ["--set", "reward=test_rl_sgd_cli:first_digit_is_odd"]

EVAL_METRICS = {"accuracy", "best_accuracy", "update_density_bf16", "update_density_bf16_matrices",
                "update_density_tol", "update_density_fp32", "effective_rank_99", "effective_rank_99_bf16",
                "optimizer_state_bytes",
                "wall_time_s", "gap_adamw_minus_sgd"}


def first_digit_is_odd(prompt: str, completion: str, answer: str) -> float:
    digits = [c for c in completion if c.isdigit()]
    return float(bool(digits) and int(digits[0]) % 2 == 1)


def _run(runs: Path, *argv) -> Path:
    result = invoke("rl-sgd", "train", *TINY, *argv, "--runs-dir", runs, "--json")
    assert result.code == 0, result.err
    run = Path(result.json()["run_dir"])
    result = invoke("rl-sgd", "eval", run, "--runs-dir", runs, "--json")
    assert result.code == 0, result.err
    return run


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    run = _run(runs, *ARMS, *REWARD)
    report = invoke("rl-sgd", "report", run, "--runs-dir", runs, "--format", "html", "--out", runs / "r.html")
    assert report.code == 0, report.err
    return runs, run


def _frame(run: Path) -> pd.DataFrame:
    return pq.read_table(run / "metrics.parquet").to_pandas()


def test_every_spec_metric_and_tag_is_recorded(tiny):
    _, run = tiny
    frame = _frame(run)
    train = frame[(frame["phase"] == "train") & (frame["variant"] != "warm_start")]
    assert {"reward_mean", "frac_groups_skipped", "grad_norm"} <= set(train["metric"])
    evaluated = frame[frame["phase"] == "eval"]
    assert set(evaluated["metric"]) == EVAL_METRICS
    runs = evaluated[evaluated["metric"] == "accuracy"].dropna(subset=["lr"])
    assert set(zip(runs["variant"], runs["lr"])) >= {("adamw", 1e-3), ("sgd", 0.1), ("sgd", 0.3), ("sft_sgd", 0.1)}
    best_sgd = evaluated[(evaluated["metric"] == "best_accuracy") & (evaluated["variant"] == "sgd")]["lr"].item()
    assert runs.loc[runs["variant"] == "sgd_momentum", "lr"].tolist() == [pytest.approx(0.1 * best_sgd)]  # × best sgd
    assert runs.loc[runs["variant"] == "sgd_bf16_master", "lr"].tolist() == [pytest.approx(best_sgd)]
    for variant, group in runs.groupby("variant"):  # best = max over the grid, and the one `selected`
        best = evaluated[(evaluated["metric"] == "best_accuracy") & (evaluated["variant"] == variant)]
        assert best["value"].item() == group["value"].max()
        assert group.loc[group["selected"] == "true", "lr"].tolist() == best["lr"].tolist()
    tags = evaluated[evaluated["variant"] == "sgd_bf16_master"]
    assert set(tags["master_dtype"]) == {"bf16"} and set(tags["regime"]) == {"rl"} and set(tags["group_size"]) == {4}
    gap = evaluated[evaluated["metric"] == "gap_adamw_minus_sgd"]
    assert gap["regime"].tolist() == ["rl"]  # no sft_adamw arm, so no SFT gap
    info = json.loads((run / "run.json").read_text())
    assert len(info["theta0"]["hash"]) == 16


def test_train_accuracy_reproduces_in_eval_and_state_bytes(tiny):
    _, run = tiny
    frame = _frame(run)
    acc = frame[frame["metric"] == "accuracy"].dropna(subset=["lr"])
    # eval reloads each snapshot: the greedy accuracy of train's in-memory model must match
    pivot = acc.pivot_table(index=["variant", "lr"], columns="phase", values="value")
    assert (pivot["train"] == pivot["eval"]).all()
    state = frame[(frame["phase"] == "eval") & (frame["metric"] == "optimizer_state_bytes")].set_index("variant")
    updates = pq.read_table(run / "param_updates.parquet").to_pandas()
    n_params = updates[(updates["variant"] == "adamw")]["numel"].sum()
    n_tensors = (updates["variant"] == "adamw").sum()
    assert state.loc["sgd", "value"].min() == 0 and state.loc["sgd_bf16_master", "value"] == 0
    assert state.loc["sgd_momentum", "value"] == 4 * n_params
    assert state.loc["adamw", "value"] == 8 * n_params + 4 * n_tensors  # two moments + a float32 step each


def test_param_updates_table_agrees_with_the_run_densities(tiny):
    _, run = tiny
    updates = pq.read_table(run / "param_updates.parquet").to_pandas()
    assert {"run_id", "variant", "lr", "regime", "param_name", "shape", "numel", "density_bf16", "density_tol",
            "density_fp32", "effective_rank_99", "effective_rank_99_bf16", "max_rank",
            "delta_fro"} <= set(updates.columns)
    evaluated = _frame(run)
    evaluated = evaluated[evaluated["phase"] == "eval"]
    for (variant, lr), group in updates.groupby(["variant", "lr"]):
        overall = (group["density_bf16"] * group["numel"]).sum() / group["numel"].sum()
        recorded = evaluated[(evaluated["variant"] == variant) & (evaluated["lr"] == lr)
                             & (evaluated["metric"] == "update_density_bf16")]["value"].item()
        assert recorded == pytest.approx(overall, rel=1e-12)
        assert (group["density_tol"] <= group["density_bf16"]).all() or variant == "sgd_bf16_master"
        assert (group["density_bf16"] <= group["density_fp32"]).all()  # a bf16 change is an fp32 change
    adamw = updates[updates["variant"] == "adamw"]
    assert (adamw.loc[adamw["shape"].str.contains("x"), "density_bf16"] > 0.5).all()  # Adam moves nearly every entry


def test_report_renders_tables_and_plots(tiny):
    runs, _ = tiny
    html = (runs / "r.html").read_text()
    for title in ("Accuracy per arm at its best LR", "Update sparsity and effective rank", "Optimizer-state memory",
                  "AdamW − SGD accuracy gap", "Held-out accuracy over each arm"):
        assert title in html
    assert html.count("data:image/png;base64,") == 7


def test_warm_start_is_cached_and_reruns_reproduce(tiny):
    runs, first = tiny
    second = _run(runs, "--set", "arms=sgd", "--set", "grids.sgd=0.1", *REWARD)
    assert json.loads((second / "run.json").read_text())["theta0"] == json.loads((first / "run.json").read_text())["theta0"]
    assert len(list((runs / "rl-sgd" / "_cache").iterdir())) == 1

    def curve(run):
        frame = _frame(run)
        rows = frame[(frame["phase"] == "train") & (frame["variant"] == "sgd") & (frame["lr"] == 0.1)
                     & (frame["metric"] != "wall_time_s")]
        return rows[["step", "metric", "value"]].sort_values(["metric", "step"]).reset_index(drop=True)

    pd.testing.assert_frame_equal(curve(first), curve(second))


def test_user_data_and_local_model(tmp_path):
    from icml.methods.rl_sgd.model import tiny_llama
    from icml.methods.rl_sgd.task import build_tokenizer

    data = tmp_path / "sums.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"{a} plus {a + 1} is", "answer": 2 * a + 1})
                              for a in range(30)) + "\n")
    runs = tmp_path / "runs"
    run = _run(runs, "--data", data, "--set", "arms=sgd", "--set", "grids.sgd=0.1")  # SFT warm start on the file
    frame = _frame(run)
    assert frame[(frame["phase"] == "eval") & (frame["metric"] == "accuracy")]["value"].notna().all()

    tokenizer = build_tokenizer(["plus", "is"])
    model_dir = tmp_path / "policy"
    specials = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                "pad_token_id": tokenizer.pad_token_id}
    tiny_llama(len(tokenizer), 32, 1, 2, 1, 64, 64, specials, init_seed=1).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    run = _run(runs, "--data", data, "--model", model_dir, "--set", "arms=adamw", "--set", "grids.adamw=1e-3")
    info = json.loads((run / "run.json").read_text())
    assert info["theta0"]["path"] == str(model_dir.resolve())  # θ₀ is the checkpoint itself: no warm start
    assert not (runs / "rl-sgd" / "_cache" / "none").exists()


def test_bad_inputs(tmp_path):
    runs = ["--runs-dir", tmp_path]
    result = invoke("rl-sgd", "train", "--set", "arms=sgd,lion", *runs)
    assert result.code == 2 and "unknown arm(s) ['lion']" in result.err
    result = invoke("rl-sgd", "train", "--set", "arms=rmsprop", *runs)
    assert result.code == 2 and "add adamw to arms" in result.err
    result = invoke("rl-sgd", "train", "--set", "reward=no_colon", *runs)
    assert result.code == 2 and "is not module:function" in result.err
    result = invoke("rl-sgd", "train", "--model", tmp_path, *runs)
    assert result.code == 2 and "is not a checkpoint directory" in result.err
    result = invoke("rl-sgd", "train", "--set", "grids.sgd=0,1", *runs)
    assert result.code == 2 and "grids.sgd must be" in result.err
    corrupt = tmp_path / "bad.jsonl"
    corrupt.write_text('{"prompt": "1 + 1 =", "answer": "2"}\n{"prompt": 3}\n')
    result = invoke("rl-sgd", "train", *TINY, "--data", corrupt, *runs)
    lines = [line for line in result.err.splitlines() if line.startswith("icml: error:")]
    assert result.code == 2 and len(lines) == 1 and "line 2" in lines[0] and "Traceback" not in result.err
    result = invoke("rl-sgd", "train", *TINY, "--set", "reward=json:nothing_here", *runs)
    assert result.code == 1 and "has no callable 'nothing_here'" in result.err
