"""`icml spectral-optim` end to end through the CLI on a tiny grid: every spec metric lands in
metrics.parquet, the report renders, grid results do not depend on the number of workers, and
the real inputs (--data FILE.txt, --model DIR) work."""
from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import train_and_eval, train_eval_report

TINY = ["--preset", "smoke", "--set", "steps=6", "--set", "corpus_chars=30000", "--set", "variants=Adam,mSGD,mSGDZ",
        "--set", "lr_multipliers=1,3", "--set", "gpt.n_embd=32", "--set", "gpt.n_layer=1", "--set", "gpt.n_head=2",
        "--set", "block_size=32", "--set", "batch_size=4", "--set", "val_every=3", "--set", "val_batches=2",
        "--set", "eval_val_batches=3", "--set", "psi_sizes=16x16,32x8", "--set", "psi_kappas=2,10",
        "--set", "psi_repeats=1"]

RUN_METRICS = {"train_loss", "val_loss", "step_ms", "optimizer_state_bytes", "diverged"}
EVAL_METRICS = {"val_loss", "best_val_loss", "lr_spread", "diverged", "family_best_spread", "psi_rel_error",
                "psi_cond_exponent", "psi_sv_min", "psi_sv_max", "psi_ms", "svd_ms", "psi_speedup"}


def train_eval(icml, *extra: str) -> Path:
    return train_and_eval(icml, "spectral-optim", *TINY, *extra)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return train_eval_report("spectral-optim", tmp_path_factory.mktemp("runs"), TINY)


def test_every_spec_metric_is_recorded(tiny_run):
    frame = pq.read_table(tiny_run / "metrics.parquet").to_pandas()
    train = frame[frame["phase"] == "train"]
    assert set(train["metric"]) == RUN_METRICS
    assert set(zip(train["variant"], train["lr_multiplier"])) == {(v, m) for v in ("Adam", "mSGD", "mSGDZ")
                                                                 for m in (1.0, 3.0)}
    evaluated = frame[frame["phase"] == "eval"]
    assert set(evaluated["metric"]) == EVAL_METRICS
    best = evaluated[evaluated["metric"] == "best_val_loss"].set_index("variant")
    runs = evaluated[(evaluated["metric"] == "val_loss")]
    for variant, row in best.iterrows():  # best = min over the grid, tagged with the argmin's LR
        grid = runs[runs["variant"] == variant]
        assert row["value"] == pytest.approx(grid["value"].min()) or row["value"] == pytest.approx(
            __import__("math").log(50), rel=0.2)
    assert set(evaluated.loc[evaluated["metric"] == "family_best_spread", "variant"]) == {"msgd"}
    assert (train.loc[train["variant"] == "mSGD", "lr"].unique() == [5.0, 15.0]).all()  # × the paper's LR
    assert set(evaluated.loc[evaluated["metric"] == "psi_ms", "psi_method"]) == {"ns"}
    for variant in ("Adam", "mSGD", "mSGDZ"):
        assert (tiny_run / "checkpoints" / "best" / variant / "config.json").exists()


def test_report_renders_tables_and_plots(tiny_run):
    html = (tiny_run.parent.parent / "r.html").read_text()
    for title in ("Optimizer variants — LR sweep", "Final val_loss over the LR grid", "Family spreads",
                  "Ψ_p relative error", "Condition exponent", "Singular values of Ψ̂₀", "Ψ_p speed"):
        assert title in html
    assert html.count("data:image/png;base64,") == 5


def test_best_checkpoint_loads_with_from_pretrained(tiny_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_run / "checkpoints" / "best" / "Adam"
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert model.config.n_embd == 32 and tokenizer.decode(tokenizer("12 + 7 = 19")["input_ids"]) == "12 + 7 = 19"


def test_workers_do_not_change_results(icml, tiny_run):
    import pandas as pd

    parallel = train_eval(icml, "--set", "workers=2")
    columns = ["phase", "variant", "metric", "step", "lr_multiplier", "value"]
    timing = ["step_ms", "psi_ms", "svd_ms", "psi_speedup"]

    def results(run):
        frame = pq.read_table(run / "metrics.parquet").to_pandas()
        frame = frame[~frame["metric"].isin(timing)][columns]
        return frame.sort_values(columns[:-1]).reset_index(drop=True)

    pd.testing.assert_frame_equal(results(tiny_run), results(parallel))


def test_user_text_file_and_local_model(icml, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat. " * 400)
    run = train_eval(icml, "--data", corpus, "--set", "variants=Adam", "--set", "lr_multipliers=1")
    info = (run / "config.json").read_text()
    assert '"corpus": "file"' in info and str(corpus) in info

    from icml.methods.spectral_optim.data import build_char_tokenizer
    from icml.methods.spectral_optim.model import tiny_gpt2

    tokenizer = build_char_tokenizer("the cat sat on the mat. 0123456789+=\n")
    model_dir = tmp_path / "tiny-lm"
    tiny_gpt2(32, 1, 2, 64, len(tokenizer), init_seed=0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    run = train_eval(icml, "--data", corpus, "--model", model_dir, "--set", "variants=Adam,AdamZ",
                     "--set", "lr_multipliers=1")
    frame = pq.read_table(run / "metrics.parquet").to_pandas()
    assert set(frame.loc[frame["phase"] == "eval", "variant"]) >= {"Adam", "AdamZ"}


def test_bad_inputs(icml, tmp_path):
    result = icml("spectral-optim", "train", "--set", "variants=Adam,Lion")
    assert result.code == 2 and "unknown variant(s) ['Lion']" in result.err
    result = icml("spectral-optim", "train", "--model", tmp_path)
    assert result.code == 2 and "is not a checkpoint directory" in result.err
    result = icml("spectral-optim", "train", "--set", "psi_sizes=64by64")
    assert result.code == 2 and "is not ROWSxCOLS" in result.err
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    result = icml("spectral-optim", "train", *TINY, "--data", empty)
    lines = [line for line in result.err.splitlines() if line.startswith("icml: error:")]
    assert result.code == 2 and len(lines) == 1 and "Traceback" not in result.err
