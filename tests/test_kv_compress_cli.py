"""`icml kv-compress` through the CLI: train → calibrate → eval → report on a tiny config, every
spec metric and the allocations table, `calibrate` writing H̄, `--model`/`--data` inputs, and bad
input (EntroKV without calibration, malformed JSONL) as one clear line."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from conftest import train_eval_report
from plotcheck import figures_of, plot_defects

TINY = ["--preset", "smoke", "--set", "steps=4", "--set", "val_every=4", "--set", "val_per_task=2",
        "--set", "n_per_task=2", "--set", "n_calibration=3", "--set", "tiny.hidden=32",
        "--set", "tiny.intermediate=64", "--set", "context_min=60", "--set", "context_max=80",
        "--set", "train_context_min=60", "--set", "bootstrap=50",
        "--set", "variants=full,snapkv,h2o,streamingllm,pyramidkv,adakv,entrokv_snapkv,entrokv_h2o,"
        "entrokv_streamingllm,entrokv_alpha0,entrokv_alpha1,entrokv_perlayer,entrokv_qagnostic"]
EVAL_METRICS = {"exact_match", "retention", "answer_nll", "kl_to_full", "kept_entries", "kept_fraction",
                "memory_bytes", "overhead_ms", "budget_cv", "mean_entropy", "em_diff_ci_low", "em_diff_ci_high",
                "alloc_corr_retrieval_aggregation", "alloc_corr_retrieval_needle", "alloc_corr_needle_aggregation"}
ALLOCATION_COLUMNS = ["run_id", "variant", "task", "ratio", "example_id", "layer", "kv_head", "entropy", "signal",
                      "budget_raw", "budget", "kept"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return train_eval_report("kv-compress", tmp_path_factory.mktemp("runs"), TINY)


def test_every_spec_metric_tag_and_table(tiny_run):
    frame = pq.read_table(tiny_run / "metrics.parquet").to_pandas()
    assert {"train_loss", "val_loss", "val_exact_match"} <= set(frame.loc[frame["phase"] == "train", "metric"])
    evaluated = frame[frame["phase"] == "eval"]
    assert set(evaluated["metric"]) == EVAL_METRICS
    assert set(evaluated["ratio"]) == {0.3, 1.0} and set(evaluated["window"]) == {16}
    em = evaluated[evaluated["metric"] == "exact_match"]
    assert len(set(em["variant"])) == 13
    assert set(evaluated.loc[evaluated["variant"] == "entrokv_qagnostic", "question_aware"]) == {0}
    assert set(evaluated.loc[evaluated["variant"] == "entrokv_perlayer", "scope"]) == {"per_layer"}
    assert set(evaluated.loc[evaluated["variant"] == "entrokv_h2o", "operator"]) == {"h2o"}
    alloc = pq.read_table(tiny_run / "allocations.parquet").to_pandas()
    assert list(alloc.columns) == ALLOCATION_COLUMNS
    assert len(alloc) == 13 * 2 * 3 * 2 * 4 * 2  # variants × ratios × tasks × examples × layers × KV heads
    calibration = json.loads((tiny_run / "calibration.json").read_text())
    entrokv = alloc[alloc["variant"] == "entrokv_alpha1"]
    assert np.allclose(entrokv["signal"], entrokv["entropy"])  # α=1: the raw entropy
    alpha_half = alloc[alloc["variant"] == "entrokv_snapkv"]
    assert np.allclose(alpha_half["signal"], 0.5 * calibration["tiny"]["h_bar"] + 0.5 * alpha_half["entropy"])


def test_budget_map_correlations_are_recorded_for_the_spec_pair_and_the_needle_controls(tiny_run):
    """Every pair is recorded with its tasks; the values are pinned on known maps in test_kv_compress_alloc
    (this tiny run's maps are constant, so its correlations are NaN)."""
    frame = pq.read_table(tiny_run / "metrics.parquet").to_pandas()
    recorded = frame[frame["metric"].str.startswith("alloc_corr_")].set_index("metric")["task"].to_dict()
    assert recorded == {"alloc_corr_retrieval_aggregation": "kv_retrieval|aggregation",
                        "alloc_corr_retrieval_needle": "kv_retrieval|needle",
                        "alloc_corr_needle_aggregation": "needle|aggregation"}


def test_report_has_tables_and_plots(tiny_run):
    html = (tiny_run.parent.parent / "r.html").read_text()
    for title in ("exact_match — kv_retrieval", "retention — aggregation", "Cost and fidelity at r=0.3",
                  "Paired bootstrap 95% CI"):
        assert title in html
    # retention vs ratio (a panel per task where the full cache scores above 0: retention is 0/0 elsewhere, and
    # that task's retention table says that the plot leaves it out), memory, heatmaps, entropy scatter, forest plot
    frame = pq.read_table(tiny_run / "metrics.parquet").to_pandas()
    retention = frame[frame["metric"] == "retention"]
    finite = {task: np.isfinite(rows["value"]).any() for task, rows in retention.groupby("task")}
    assert ("alt='retention vs ratio'" in html) == any(finite.values())
    assert html.count("the retention plot leaves") == sum(not f for f in finite.values())
    assert html.count("data:image/png;base64,") == 4 + any(finite.values())


def _has_marker(line) -> bool:
    return line.get_marker() not in (None, "", " ", "None", "none")


def test_report_plots_mark_every_line_and_show_where_lines_coincide(tiny_run):
    """Seen in a browser: curves of variants with the same results drawn on top of each other in one marker,
    heatmap labels colliding with the next panel. Every data line has a marker, each variant its own; coinciding
    curves are nested (the first widest) and named under the panel."""
    _check_lines(dict(figures_of("kv-compress", tiny_run)))


def test_coinciding_retention_and_memory_curves_are_nested_and_named():
    """The tiny run's retention is 0/0 (its full cache scores 0): the retention panels on a made-up frame, where
    snapkv and entrokv_snapkv coincide on one task and differ on the other."""
    from icml.methods.kv_compress.report import plots

    values = {("full", "needle"): [1.0, 1.0], ("snapkv", "needle"): [0.5, 1.0],
              ("entrokv_snapkv", "needle"): [0.5, 1.0], ("full", "aggregation"): [1.0, 1.0],
              ("snapkv", "aggregation"): [0.6, 1.0], ("entrokv_snapkv", "aggregation"): [0.8, 1.0]}
    memory = {"full": [1e5, 1e5], "snapkv": [3e4, 1e5], "entrokv_snapkv": [3e4, 1e5]}
    frame = pd.DataFrame([dict(phase="eval", metric=metric, variant=variant, task=task, ratio=ratio, value=value)
                          for (variant, task), curve in values.items() for i, ratio in enumerate((0.3, 1.0))
                          for metric, value in (("retention", curve[i]), ("memory_bytes", memory[variant][i]))])
    figures = dict(plots(frame, None))
    needle, aggregation = figures["retention vs ratio"].axes
    assert "snapkv = entrokv_snapkv" in needle.texts[0].get_text() and not aggregation.texts
    _check_lines(figures)


def _check_lines(figures: dict) -> None:
    assert [d for title, figure in figures.items() for d in plot_defects(title, figure)] == []
    for title, figure in figures.items():  # reference lines (axhline, axvline) aside
        for axis in figure.axes:
            assert all(_has_marker(line) for line in axis.get_lines() if line.get_transform() == axis.transData), title
    coinciding = 0
    for title in [t for t in ("retention vs ratio", "memory vs ratio") if t in figures]:
        for axis in figures[title].axes:
            lines = [line for line in axis.get_lines() if not line.get_label().startswith("_")]
            assert lines and len({line.get_marker() for line in lines}) == len(lines), title
            same: dict[tuple, list] = {}
            for line in lines:
                same.setdefault((tuple(line.get_xdata()), tuple(np.round(line.get_ydata(), 9))), []).append(line)
            note = " ".join(text.get_text().replace("\n", " ") for text in axis.texts)
            for group in (g for g in same.values() if len(g) > 1):
                coinciding += 1
                widths = [line.get_linewidth() for line in group]
                assert widths == sorted(set(widths), reverse=True), (title, widths)  # nested: the first widest
                assert " = ".join(line.get_label() for line in group) in note, (title, note)
    assert coinciding  # these runs' variants share results: the check above ran


def test_calibrate_writes_h_bar_and_json(icml, tiny_run):
    from icml.methods.kv_compress.config import preset
    from icml.methods.kv_compress.config import TASKS
    from icml.methods.kv_compress.data import generate_set
    from icml.methods.kv_compress.pipeline import load_model, mean_entropy

    result = icml("kv-compress", "calibrate", tiny_run, "--n", "2", "--json")
    assert result.code == 0, result.err
    out = result.json()
    assert out["model"] == "tiny" and out["n"] == 2
    cfg = preset("smoke")
    cfg.tiny.hidden, cfg.tiny.intermediate, cfg.context_min, cfg.context_max = 32, 64, 60, 80
    model, tokenizer = load_model(tiny_run, cfg, None, "cpu")
    examples = generate_set(TASKS, 1, 0, 60, 80, "calibration")[:2]
    assert out["h_bar"] == pytest.approx(mean_entropy(model, tokenizer, examples, cfg, "cpu"), abs=1e-12)
    assert json.loads((tiny_run / "calibration.json").read_text())["tiny"]["h_bar"] == out["h_bar"]


def test_entrokv_without_calibration_is_refused(icml):
    result = icml("kv-compress", "train", *TINY, "--set", "calibrate_on_train=false", "--json")
    assert result.code == 0, result.err
    run = result.json()["run_dir"]
    result = icml("kv-compress", "eval", run)
    assert result.code == 2 and "calibration.json" in result.err and "h_bar" in result.err
    assert "Traceback" not in result.err
    assert [line for line in result.err.splitlines() if line.startswith("icml: error")] == \
        result.err.strip().splitlines()[-1:]
    result = icml("kv-compress", "train", *TINY, "--set", "calibrate_on_train=false", "--set", "h_bar=0.3",
                  "--set", "variants=full,entrokv_snapkv", "--json")
    run = result.json()["run_dir"]
    assert icml("kv-compress", "eval", run, "--json").code == 0  # an explicit H̄ suffices


def test_bad_input_is_one_line(icml, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "k1 v1 ;", "question": "? k1"\n')
    result = icml("kv-compress", "train", *TINY, "--data", bad)
    assert result.code == 2 and "line 1 is not valid JSON" in result.err and "Traceback" not in result.err
    result = icml("kv-compress", "train", "--set", "scope=everywhere")
    assert result.code == 2 and "scope must be one of" in result.err
    result = icml("kv-compress", "train", "--set", "variants=snapkv,entrokv_magic")
    assert result.code == 2 and "entrokv_magic" in result.err
    result = icml("kv-compress", "train", "--set", "train_threads=0")
    assert result.code == 2 and "train_threads must be positive" in result.err


def test_short_and_fully_held_apart_data_files_are_refused(icml, tmp_path):
    data = tmp_path / "qa.jsonl"
    long_line = {"context": " ".join(["k1"] * 40), "question": "? k1 =", "answer": "v1"}
    short_line = {"context": "k1 v1 ;", "question": "? k1 =", "answer": "v1"}
    data.write_text("\n".join(json.dumps(line) for line in (long_line, long_line, short_line, long_line)) + "\n")
    result = icml("kv-compress", "train", *TINY, "--data", data, "--set", "calibration_split=1",
                  "--set", "calibrate_on_train=false", "--set", "h_bar=0.3")
    assert result.code == 0, result.err
    result = icml("kv-compress", "eval")
    assert result.code == 2 and "line 3 has a" in result.err and "observation window (16)" in result.err
    assert "Traceback" not in result.err
    result = icml("kv-compress", "train", *TINY, "--data", data, "--set", "calibration_split=4")
    assert result.code == 2 and "all held apart for calibration" in result.err


def test_model_and_data_inputs(icml, tmp_path):
    """A local HF checkpoint (no training) and a JSONL file in the LongBench schema, scored by token F1."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from icml.methods.kv_compress.data import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                         max_position_embeddings=256))
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    data = tmp_path / "qa.jsonl"
    rows = [{"context": " ".join(f"f{(i * j) % 30}" for j in range(50)) + " magic v3 ;", "input": "? magic =",
             "answers": ["v3", "v 3"]} for i in range(5)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    result = icml("kv-compress", "train", "--preset", "smoke", "--model", folder, "--data", data,
                  "--set", "scoring=f1", "--set", "max_new_tokens=2", "--set", "calibration_split=2", "--json")
    assert result.code == 0, result.err
    run = Path(result.json()["run_dir"])
    calibration = json.loads((run / "calibration.json").read_text())[str(folder.resolve())]
    assert calibration["lines"] == [1, 2] and calibration["n"] == 2  # held apart from eval
    result = icml("kv-compress", "eval", run, "--json")
    assert result.code == 0, result.err
    frame = pq.read_table(run / "metrics.parquet").to_pandas()
    assert set(frame["task"].dropna()) == {"qa"}
    assert "token_f1" in set(frame["metric"]) and "exact_match" not in set(frame.loc[frame["phase"] == "eval", "metric"])
    assert {"token_f1_diff_ci_low", "token_f1_diff_ci_high"} <= set(frame["metric"])
    assert set(pq.read_table(run / "examples.parquet").to_pandas()["line"]) == {3, 4, 5}
    assert set(frame.loc[frame["metric"] == "kept_entries", "variant"]) == {"full", "snapkv", "entrokv_snapkv"}


def test_a_resumed_run_records_what_an_uninterrupted_one_does(tmp_path, monkeypatch):
    """Ctrl-C after step 3, resume from the step-2 checkpoint: every train row equals the uninterrupted run's
    (the step-4 train_loss averages steps 1–4 in both; it used to average only the resumed process's steps)."""
    import pandas as pd

    from conftest import interrupt_progress, invoke

    argv = ["kv-compress", "train", *TINY, "--set", "steps=6", "--set", "val_every=2", "--set", "train_log_every=4",
            "--set", "calibrate_on_train=false", "--runs-dir", tmp_path / "runs", "--json"]
    whole = invoke(*argv)
    assert whole.code == 0, whole.err
    restore = interrupt_progress(monkeypatch, lambda calls, steps: calls == 3)
    assert invoke(*argv).code == 130
    restore()
    interrupted = sorted((tmp_path / "runs" / "kv-compress").iterdir())[-1]
    resumed = invoke("kv-compress", "train", "--resume", interrupted, "--runs-dir", tmp_path / "runs")
    assert resumed.code == 0, resumed.err

    def train_rows(run) -> pd.DataFrame:
        frame = pd.read_parquet(Path(run) / "metrics.parquet")
        frame = frame[frame["phase"] == "train"].drop(columns=["run_id"])
        return frame.sort_values(["metric", "task", "step"], na_position="first").reset_index(drop=True)

    expected = train_rows(whole.json()["run_dir"])
    assert 4 in set(expected.loc[expected["metric"] == "train_loss", "step"])
    pd.testing.assert_frame_equal(train_rows(interrupted), expected, check_exact=True)
