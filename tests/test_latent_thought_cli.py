"""`icml latent-thought` through the CLI on a test-sized config built from the smoke preset:
train → eval → report (HTML), every spec metric with its tags, generate --json (K+1 decoder calls per
token, cache length in slots), the stdlib corpus rules on a fake stdlib, and bad input as one line."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import invoke

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(120))
TINY = ["--preset", "smoke", "--set", "seq_len=16", "--set", "steps=3", "--set", "batch=2", "--set", "n_val=2",
        "--set", "n_exact=1", "--set", "val_every=3", "--set", "val_windows_train=2", "--set", "gen_bytes=3",
        "--set", "tiny.hidden=16", "--set", "tiny.layers=1", "--set", "tiny.heads=2", "--set", "tiny.intermediate=24",
        "--set", "eval_Js=1,2", "--set", "eval_J=2", "--set", "train_log_every=1"]
EVAL_METRICS = {"val_nats_per_byte", "val_bits_per_byte", "jacobi_gap", "jacobi_residual", "jacobi_error",
                "exact_vs_cached_max_logit_diff", "train_flops_per_token", "infer_flops_per_token",
                "params_nonembed", "gen_tokens_per_s", "decoder_calls_per_token", "wall_s"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lt")
    data = root / "corpus.txt"
    data.write_text(TEXT)
    runs = root / "runs"
    result = invoke("latent-thought", "train", *TINY, "--data", data, "--runs-dir", runs, "--json")
    assert result.code == 0, result.err
    run = Path(result.json()["run_dir"])
    assert invoke("latent-thought", "eval", run, "--runs-dir", runs, "--json").code == 0
    report = invoke("latent-thought", "report", run, "--format", "html", "--out", root / "r.html", "--runs-dir", runs)
    assert report.code == 0, report.err
    return run, runs, root


def test_every_metric_and_tag(tiny_run):
    run, _, _ = tiny_run
    frame = pq.read_table(run / "metrics.parquet").to_pandas()
    train = frame[frame["phase"] == "train"]
    assert {"train_loss", "val_nats_per_byte", "wall_s", "train_tokens_per_s"} <= set(train["metric"])
    evaluated = frame[frame["phase"] == "eval"]
    assert set(evaluated["metric"]) == EVAL_METRICS
    assert set(evaluated["variant"]) == {"vanilla_1x", "ponderlm2_k1"}
    ponder = evaluated[evaluated["variant"] == "ponderlm2_k1"]
    nats = ponder[ponder["metric"] == "val_nats_per_byte"]
    assert set(nats["solve"]) == {"jacobi", "exact"} and set(nats["J"].dropna()) == {1, 2}
    assert set(ponder.loc[ponder["metric"] == "jacobi_residual", "iter"]) == {1, 2}
    assert set(ponder.loc[ponder["metric"] == "jacobi_error", "iter"]) == {0, 1, 2}
    gap = ponder[ponder["metric"] == "jacobi_gap"]["value"].iloc[0]
    at2 = nats[(nats["solve"] == "jacobi") & (nats["J"] == 2)]["value"].iloc[0]
    assert gap == pytest.approx(at2 - nats[nats["solve"] == "exact"]["value"].iloc[0], abs=1e-12)
    bits = ponder[(ponder["metric"] == "val_bits_per_byte") & (ponder["solve"] == "exact")]["value"].iloc[0]
    assert bits == pytest.approx(nats[nats["solve"] == "exact"]["value"].iloc[0] / np.log(2), rel=1e-12)
    # float32 eager attention: the exact solve and cached decoding agree to float32 rounding
    assert (evaluated.loc[evaluated["metric"] == "exact_vs_cached_max_logit_diff", "value"] < 1e-4).all()
    calls = evaluated[evaluated["metric"] == "decoder_calls_per_token"].set_index("variant")["value"]
    assert calls.to_dict() == {"vanilla_1x": 1.0, "ponderlm2_k1": 2.0}
    info = json.loads((run / "run.json").read_text())
    assert info["corpus"]["source"] == "file" and info["corpus"]["sha256"] == hashlib.sha256(TEXT.encode()).hexdigest()
    settings = json.loads((run / "checkpoints" / "ponderlm2_k1" / "config.json").read_text())["latent_thought"]
    assert settings["K"] == 1 and settings["train_J"] == [2, 3] and settings["scaled"]


def test_report_renders_tables_and_plots(tiny_run):
    _, _, root = tiny_run
    html = (root / "r.html").read_text()
    for title in ("Arms at T = 16", "Jacobi residual and error per iteration", "Exact solve vs cached decoding"):
        assert title in html
    assert html.count("data:image/png;base64,") == 6


def test_generate_json_counts_decoder_calls(tiny_run):
    run, runs, _ = tiny_run
    for prefill in ("jacobi", "exact"):
        result = invoke("latent-thought", "generate", run, "--arm", "ponderlm2_k1", "--prompt", "def f",
                        "--max-new", "4", "--prefill", prefill, "--runs-dir", runs, "--json")
        assert result.code == 0, result.err
        out = result.json()
        assert len(out["tokens"]) == 4 and out["decoder_calls_per_token"] == 2
        assert out["cache_length"] == 2 * (5 + 3)  # (K+1) slots per prompt token and decoded token
    bad = invoke("latent-thought", "generate", run, "--arm", "ponderlm2_k7", "--prompt", "x", "--runs-dir", runs)
    assert bad.code != 0 and "no arm 'ponderlm2_k7'" in bad.err and "Traceback" not in bad.err


def test_bad_input_is_one_line(tmp_path):
    runs = tmp_path / "runs"
    for argv, needle in ((["--set", "arms=vanilla_3x"], "unknown arm"), (["--set", "train_J="], "train_J"),
                         (["--set", "scale_embeds=maybe"], "scale_embeds"), (["--set", "tiny.heads=3"], "heads")):
        result = invoke("latent-thought", "train", "--preset", "smoke", *argv, "--runs-dir", runs)
        assert result.code == 2 and needle in result.err and "Traceback" not in result.err, result.err
    binary = tmp_path / "bad.txt"
    binary.write_bytes(b"\xff\xfe" * 2000)
    result = invoke("latent-thought", "train", *TINY, "--data", binary, "--runs-dir", runs)
    assert result.code != 0 and "not UTF-8" in result.err and "Traceback" not in result.err
    short = tmp_path / "short.txt"
    short.write_text("x = 1\n")
    result = invoke("latent-thought", "train", *TINY, "--data", short, "--runs-dir", runs)
    assert result.code != 0 and "seq_len" in result.err and "Traceback" not in result.err


def test_stdlib_corpus_rules(tmp_path):
    from icml.methods.latent_thought.data import is_validation, stdlib_corpus, stdlib_files

    files = {"a.py": b"A", "pkg/b.py": b"BB", "test/c.py": b"C", "pkg/tests/d.py": b"D", "idlelib/idle_test/e.py": b"E",
             "site-packages/f.py": b"F", "g.txt": b"G"}
    names = [f"m{i}.py" for i in range(60)]
    files.update({n: n.encode() for n in names})
    for rel, content in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(content)
    kept = stdlib_files(tmp_path)
    assert kept == sorted(["a.py", "pkg/b.py", *names])
    train, val, info = stdlib_corpus(tmp_path)
    val_files = [f for f in kept if int(hashlib.md5(f.encode()).hexdigest(), 16) % 20 == 0]
    assert val_files and info["val_files"] == len(val_files) and info["train_files"] == len(kept) - len(val_files)
    assert val == b"\x00".join(files[f] for f in val_files)
    assert train == b"\x00".join(files[f] for f in kept if not is_validation(f))
    digest = hashlib.sha256()
    for f in val_files:
        digest.update(f.encode() + b"\x00" + files[f] + b"\x00")
    assert info["val_sha256"] == digest.hexdigest()


def test_file_split_cuts_at_a_line_and_windows_are_deterministic(tmp_path):
    from icml.methods.latent_thought.data import file_corpus, train_windows, val_windows

    path = tmp_path / "t.txt"
    path.write_text(TEXT)
    train, val, _ = file_corpus(str(path))
    assert train + val == TEXT and train.endswith("\n") and len(val) == pytest.approx(0.05 * len(TEXT), abs=40)
    tokens = np.arange(100)
    assert val_windows(tokens, 10, 3).tolist() == [list(range(i * 10, i * 10 + 11)) for i in range(3)]
    a = train_windows(tokens, 10, 4, np.random.default_rng(0))
    assert np.array_equal(a, train_windows(tokens, 10, 4, np.random.default_rng(0))) and a.shape == (4, 11)
