"""No file we are handed runs code: a run directory copied from a shared --runs-dir, a colleague or an
archive is read with torch's weights_only=True (tensors and plain containers), through one function,
`runstore.load_checkpoint`, which refuses anything else in one line."""
from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
import torch

from conftest import REPO
from icml.cli.errors import UsageError
from icml.cli.runstore import load_checkpoint


class _RunsCode:
    """Unpickling this calls `Path.touch(marker)`: stands for any code a planted pickle would run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def plant(path: Path, marker: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": _RunsCode(marker), "step": 3}, path)


def test_a_planted_pickle_is_refused_in_one_line_and_runs_nothing(tmp_path):
    marker, path = tmp_path / "ran", tmp_path / "state.pt"
    plant(path, marker)
    with pytest.raises(pickle.UnpicklingError):  # the planted file is a working exploit for a full unpickle:
        torch.load(path, weights_only=True)
    torch.load(path, weights_only=False)
    assert marker.exists()
    marker.unlink()
    with pytest.raises(UsageError, match="holds more than tensors and plain containers") as caught:
        load_checkpoint(path)
    assert not marker.exists() and len(caught.value.line().splitlines()) == 1
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(UsageError, match="cannot be read|holds more than"):
        load_checkpoint(path)
    torch.save({"w": torch.ones(2), "step": 1, "curve": [{"metric": "loss", "value": 0.5}]}, path)
    assert load_checkpoint(path)["curve"][0]["value"] == 0.5  # plain containers load


def test_eval_of_a_run_with_a_planted_checkpoint_refuses_it(icml, toy, tmp_path):
    assert icml("toy", "train", "--preset", "smoke").code == 0
    run = next((tmp_path / "runs" / "toy").iterdir())
    marker = tmp_path / "ran"
    plant(run / "checkpoints" / "sgd.pt", marker)
    result = icml("toy", "eval", str(run))
    assert result.code == 2 and "Traceback" not in result.err
    (line,) = [line for line in result.err.splitlines() if line.startswith("icml: error:")]
    assert "holds more than tensors and plain containers (it names " in line
    assert not marker.exists()


def test_no_torch_load_can_unpickle_code():
    """Run checkpoints go through load_checkpoint; a user's own .pt file may be read where its loader words
    its errors, but only with weights_only=True on the call (torch's default is False before 2.6, and
    pyproject admits torch ≥ 2.4)."""
    offenders = []
    for folder in ("cli", "methods", "data", "reports", "tests/toy_method"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"\btorch\.load\(", line) and "weights_only=True" not in line:
                    offenders.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
