"""`icml reason-stop` through the CLI at a test-sized config built from the smoke preset: train → eval
→ report (--json, HTML), every spec metric on both splits, the ATP events table, the `generate`
verb, `--model`/`--data` (a local checkpoint with a chat template and a JSONL file), and bad input
as one clear line."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import invoke

TINY = ["--preset", "smoke", "--set", "steps=4", "--set", "batch_size=4", "--set", "n_train=64", "--set", "n_val=8",
        "--set", "val_every=2", "--set", "train_log_every=2", "--set", "n_eval=2", "--set", "max_new_tokens=16", "--set", "probe_max_tokens=2",
        "--set", "tiny.hidden=32", "--set", "tiny.intermediate=64", "--set", "tiny.layers=4"]
TEST_METRICS = {"accuracy", "mean_tokens", "compression_rate", "probe_overhead_tokens", "total_tokens",
                "mean_atp_count", "n_exit", "n_forced_exit", "n_inject", "n_jump", "n_continue", "delta_h_correct",
                "delta_h_wrong", "jump_repeat_fraction", "wall_time_s"}
VARIANTS = {"vanilla", "nothinking", "deer", "asag", "asag_exit", "asag_exit_inject", "asag_exit_jump",
            "oracle_first_correct"}
EVENT_COLUMNS = {"run_id", "variant", "problem_id", "atp_index", "position", "confidence", "probe_answer",
                 "probe_correct", "entropy_h", "delta_h", "a_prev", "a_self", "trap", "action"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    result = invoke("reason-stop", "train", *TINY, "--runs-dir", runs, "--json")
    assert result.code == 0, result.err
    run = Path(result.json()["run_dir"])
    result = invoke("reason-stop", "eval", run, "--runs-dir", runs, "--json")
    assert result.code == 0, result.err
    report = invoke("reason-stop", "report", run, "--format", "html", "--out", runs / "r.html", "--runs-dir", runs)
    assert report.code == 0, report.err
    return run, result.json(), runs


def test_every_metric_variant_tag_and_table(tiny_run):
    run, summary, _ = tiny_run
    assert summary["status"] == "completed" and set(summary["metrics"]["accuracy"]) == VARIANTS
    frame = pq.read_table(run / "metrics.parquet").to_pandas()
    train = frame[frame["phase"] == "train"]
    assert set(train["metric"]) == {"train_loss", "val_loss"} and set(train["split"]) == {"train", "val"}
    test = frame[(frame["phase"] == "eval") & (frame["split"] == "test")]
    assert set(test["metric"]) == TEST_METRICS and set(test["variant"]) == VARIANTS
    assert set(test["lam"]) == {0.95} and set(test["alpha"]) == {-0.1} and set(test["max_jumps"]) == {2}
    assert set(test["inject_weight"]) == {0.05} and set(test["window"]) == {64}
    vanilla = test[test["variant"] == "vanilla"].set_index("metric")["value"]
    assert vanilla["compression_rate"] == 1 and vanilla["probe_overhead_tokens"] == 0
    assert vanilla["total_tokens"] == vanilla["mean_tokens"]
    hard = frame[frame["split"] == "test_first_error"]
    assert set(hard["metric"]) <= {"accuracy", "mean_tokens", "compression_rate"}
    events = pq.read_table(run / "atp_events.parquet").to_pandas()
    assert EVENT_COLUMNS <= set(events.columns)
    generations = pq.read_table(run / "generations.parquet").to_pandas()
    assert len(generations) == 2 * len(VARIANTS)
    per_variant = generations.groupby("variant")["n_tokens"].mean()
    for variant, value in per_variant.items():
        assert test[(test["variant"] == variant) & (test["metric"] == "mean_tokens")]["value"].item() == value


def test_report_renders_tables_and_plots(tiny_run):
    _, _, runs = tiny_run
    html = (runs / "r.html").read_text()
    for title in ("All test problems: accuracy and tokens per variant", "Attention-entropy statistics",
                  "Tiny reasoner at the end of training"):
        assert title in html
    assert html.count("data:image/png;base64,") >= 3  # accuracy vs CR, actions, entropy traces (+ ΔH plots)


def test_generate_verb_annotates_atps(tiny_run):
    run, _, runs = tiny_run
    result = invoke("reason-stop", "generate", run, "--prompt", "Q 3 + 5 - 9 =", "--variant", "deer",
                    "--runs-dir", runs, "--json")
    assert result.code == 0, result.err
    out = result.json()
    assert out["variant"] == "deer" and out["tokens"] >= 1 and isinstance(out["events"], list)
    text = invoke("reason-stop", "generate", run, "--prompt", "Q 1 + 1 =", "--runs-dir", runs)
    assert text.code == 0 and "answer" in text.out and "tokens" in text.out
    bad = invoke("reason-stop", "generate", run, "--variant", "magic", "--runs-dir", runs)
    assert bad.code == 2 and "unknown variant 'magic'" in bad.err and "Traceback" not in bad.err


def test_model_and_data_inputs(tiny_run, tmp_path):
    """A local checkpoint (the run's saved model, given a chat template) and real-format problems with
    \\boxed{} answers run through the same controller, with no training."""
    run, _, runs = tiny_run
    folder = tmp_path / "ckpt"
    shutil.copytree(run / "checkpoints" / "model", folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    data = tmp_path / "problems.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"Q {a} + 1 =", "answer": f"\\boxed{{{(a + 1) % 10}}}"})
                              for a in range(3)) + "\n")
    result = invoke("reason-stop", "train", "--preset", "smoke", "--model", folder, "--data", data,
                    "--set", "max_new_tokens=20", "--set", "variants=vanilla,deer,asag", "--runs-dir", runs, "--json")
    assert result.code == 0, result.err
    model_run = Path(result.json()["run_dir"])
    assert not (model_run / "checkpoints" / "model").exists()
    result = invoke("reason-stop", "eval", model_run, "--runs-dir", runs, "--json")
    assert result.code == 0, result.err
    generations = pq.read_table(model_run / "generations.parquet").to_pandas()
    assert len(generations) == 9 and set(generations["variant"]) == {"vanilla", "deer", "asag"}


def test_bad_input_is_one_line(tmp_path):
    runs = tmp_path / "runs"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "Q 1 + 1 ="\n')
    cases = [(["--data", bad], "line 1 is not valid JSON"),
             (["--set", "probe_position=middle"], "probe_position must be one of"),
             (["--set", "variants=asag,magic"], "magic"),
             (["--set", "inject_weight=2"], "inject_weight"),
             (["--set", "n_last_layers=8"], "tiny.layers (4) must be >= n_last_layers (8)"),
             (["--set", "recheck_weights=1,2"], "recheck_weights"),
             (["--set", "temperature=-1"], "temperature must be >= 0"),
             (["--set", "temperature=1", "--set", "top_p=0"], "top_p must be in (0, 1]"),
             (["--set", "top_p=0.9"], "top_p < 1 needs temperature > 0"),
             (["--set", "atp_words=wait,Wait"], "ATP word 'Wait' cannot be written by the synthetic word tokenizer"),
             (["--model", tmp_path], "not a checkpoint directory")]
    for argv, message in cases:
        result = invoke("reason-stop", "train", *TINY, *argv, "--runs-dir", runs)
        assert result.code == 2 and message in result.err, (argv, result.err)
        assert "Traceback" not in result.err and len(result.err.strip().splitlines()) == 1
