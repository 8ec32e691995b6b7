"""cli/distributed.py under `torchrun --nproc-per-node 2` on CPU (gloo), through spectral-optim's real
training loop: a failure on one rank stops both with one error line and a failed run; `--resume`
under torchrun trains only the missing grid run; the data-parallel weights equal a single-process run
on the same global batches; and the run directory is written once, by rank 0."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from conftest import invoke

pytestmark = pytest.mark.slow  # torchrun / Ray start-up: seconds of CPU each

GRID = ["--preset", "smoke", "--set", "steps=3", "--set", "corpus_chars=30000", "--set", "variants=AdamS,mSGDZ",
        "--set", "lr_multipliers=1", "--set", "gpt.n_embd=32", "--set", "gpt.n_layer=1", "--set", "gpt.n_head=2",
        "--set", "block_size=32", "--set", "batch_size=4", "--set", "val_every=3", "--set", "val_batches=2",
        "--device", "cpu"]

# Rank 1 alone fails in its second grid run (mSGDZ), as an out-of-memory error would; rank 0 is then
# waiting in a collective of that run.
FAILING_RANK = """
import os, sys
from icml.methods.spectral_optim import lm
if os.environ["RANK"] == "1":
    train_one = lm.train_one
    def failing(cfg, variant, *args, **kwargs):
        if variant == "mSGDZ":
            raise RuntimeError("out of memory (simulated on rank 1)")
        return train_one(cfg, variant, *args, **kwargs)
    lm.train_one = failing
from icml.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def torchrun(program: list[str], runs: Path, scratch: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TMPDIR": str(scratch), "OMP_NUM_THREADS": "1"}
    env.pop("ICML_EXECUTOR", None)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", *program, "--runs-dir", str(runs)],
                          capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    runs, scratch = root / "runs", root / "scratch"
    scratch.mkdir()
    script = root / "failing_rank.py"
    script.write_text(FAILING_RANK)
    failed = torchrun([str(script), "spectral-optim", "train", *GRID], runs, scratch)
    (run,) = (runs / "spectral-optim").iterdir()
    after_failure = json.loads((run / "run.json").read_text())
    checkpoints_after_failure = sorted(p.name for p in (run / "checkpoints" / "runs").iterdir())
    resumed = torchrun(["-m", "icml.cli.main", "spectral-optim", "train", "--resume", str(run)], runs, scratch)
    single = invoke("spectral-optim", "train", *GRID, "--runs-dir", root / "single", "--json")
    assert single.code == 0, single.err
    return {"failed": failed, "after_failure": after_failure, "checkpoints_after_failure": checkpoints_after_failure,
            "resumed": resumed, "run": run, "runs": runs, "scratch": scratch,
            "single": Path(single.json()["run_dir"])}


def test_a_failing_rank_stops_every_rank_with_one_line(launches):
    failed = launches["failed"]
    assert failed.returncode != 0
    errors = [line for line in failed.stderr.splitlines() if line.startswith("icml: error:")]
    assert errors == ["icml: error: RuntimeError: out of memory (simulated on rank 1) — rerun with --debug "
                      "for the traceback"]
    train = launches["after_failure"]["phases"]["train"]
    assert train["status"] == "failed" and f"--resume {launches['run']}" in train["error"]
    assert launches["checkpoints_after_failure"] == ["AdamS_x1.pt"]  # the finished run was kept


def test_resume_under_torchrun_trains_only_the_missing_run(launches):
    resumed = launches["resumed"]
    assert resumed.returncode == 0, resumed.stderr
    assert "mSGDZ ×1" in resumed.stderr and "AdamS ×1" not in resumed.stderr  # AdamS was skipped
    info = json.loads((launches["run"] / "run.json").read_text())
    assert info["phases"]["train"]["status"] == "completed" and info["phases"]["train"]["resumed"]


def test_the_run_directory_is_written_once_by_rank_zero(launches):
    assert [p.name for p in (launches["runs"] / "spectral-optim").iterdir()] == [launches["run"].name]
    assert not list(launches["scratch"].glob("icml-rank*"))  # the other rank's scratch mirror is gone
    frame = pd.read_parquet(launches["run"] / "metrics.parquet")
    keys = ["variant", "metric", "step", "split"]
    assert not frame.duplicated(keys).any()  # one writer: every row once
    assert (frame["run_id"] == launches["run"].name).all()


def test_data_parallel_weights_equal_a_single_process_run_on_the_global_batch(launches):
    """Tolerance. Each rank's loss is the mean over its half of the global batch and DDP averages
    the gradients, so in exact arithmetic every update is the single-process one. In float32 the
    gradient sums run in another order (two half-batch sums, then their mean): a few ulps
    (eps32 = 1.2e-7) relative per step. Adam's normalisation g/(√v + ε) passes that through unchanged
    except where a gradient is at rounding level (the attention key bias: its exact gradient is 0,
    softmax being shift-invariant), where the step is lr × noise/(|noise| + ε). Measured after 4 steps:
    max |Δθ| 1.4e-6 (the c_attn bias), ||Δθ|| / ||θ − θ₀|| 6e-6. Bounds: 1e-5 per entry and 1e-4 of the
    update's norm, ~10× the measured values; any real defect (no gradient averaging, one rank's
    half-batch, a shifted shard) moves the weights by a sizeable fraction of the update itself."""
    from icml.cli.config import apply_overrides
    from icml.methods.spectral_optim.config import preset
    from icml.methods.spectral_optim.lm import prepare_grid

    cfg = preset("smoke")
    apply_overrides(cfg, [GRID[i + 1] for i, arg in enumerate(GRID) if arg == "--set"])
    initial = prepare_grid(cfg, 0).model_init.state_dict()
    for variant in ("AdamS", "mSGDZ"):
        ddp, single = (torch.load(run / "checkpoints" / "runs" / f"{variant}_x1.pt", weights_only=False)
                       for run in (launches["run"], launches["single"]))
        assert ddp["steps_done"] == single["steps_done"] == 3
        names = [name for name in initial if name in single["model_state"]]
        delta = torch.cat([(ddp["model_state"][n] - single["model_state"][n]).flatten() for n in names])
        update = torch.cat([(single["model_state"][n] - initial[n]).flatten() for n in names])
        assert delta.abs().max().item() <= 1e-5, variant
        assert (delta.norm() / update.norm()).item() <= 1e-4, variant
        assert ddp["final_val_loss"] == pytest.approx(single["final_val_loss"], rel=1e-5)


def test_shard_takes_this_ranks_equal_slice(monkeypatch):
    from icml.cli import distributed
    from icml.cli.errors import IcmlError

    batch = torch.arange(12).reshape(6, 2)
    assert distributed.shard(batch) is batch  # not under torchrun: the identity
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "1")
    assert distributed.shard(batch).tolist() == [[4, 5], [6, 7]]
    with pytest.raises(IcmlError, match="does not split evenly over 3 ranks"):
        distributed.shard(batch[:5])
