"""`icml event-classify` end to end on a tiny config: every spec metric and variant lands in
metrics.parquet, profile.parquet has its columns, the report renders its tables and plots; a folder
of N-MNIST-style .bin files trains through --data; bad input gets one clear line."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from conftest import train_eval_report
from icml.methods.event_classify.config import VARIANTS

TINY = ["--preset", "smoke", "--set", "datasets=saccade-digits,direction", "--set", "samples=20",
        "--set", "arch.n_points=128", "--set", "arch.groups=16,8,4", "--set", "arch.k=4", "--set", "arch.d0=8",
        "--set", "epochs=1", "--set", f"variants={','.join(VARIANTS[1:])}",
        "--set", "compare.datasets=direction", "--set", "compare.arch.n_points=64", "--set", "compare.arch.groups=16,8,4",
        "--set", "compare.arch.k=4", "--set", "compare.arch.d0=8", "--set", "compare.train_samples=16",
        "--set", "profile.sweep_n=128,256", "--set", "profile.fixed_s1=16", "--set", "profile.latency_runs=2",
        "--set", "profile.warmups=0", "--set", "profile.throughput_batch=4", "--set", "profile.time_sweep=true"]
SPEC_METRICS = {"window_acc", "sample_acc", "params", "macs_total", "macs_embed", "macs_spatial_fa",
                "macs_temporal_fa", "macs_pool", "macs_residual", "macs_head", "grouping_ops", "params_temporal_fa",
                "latency_ms_b1", "throughput_sps", "events_per_sample", "loss", "train_acc", "val_window_acc"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return train_eval_report("event-classify", tmp_path_factory.mktemp("runs"), TINY)


def test_every_metric_variant_and_table(tiny_run):
    frame = pq.read_table(tiny_run / "metrics.parquet").to_pandas()
    assert SPEC_METRICS <= set(frame["metric"])
    train = frame[frame["phase"] == "train"]
    assert set(train["metric"]) >= {"loss", "train_acc", "val_window_acc", "learned_w"}
    acc = frame[(frame["metric"] == "window_acc") & (frame["sweep"] == "none")]
    assert set(acc["variant"]) == set(VARIANTS)
    assert set(acc.loc[acc["variant"] == "secnet_no_pt", "dataset"]) == {"direction"}
    assert set(acc.loc[acc["variant"] == "frame_cnn", "dataset"]) == {"saccade-digits", "direction"}
    assert acc["value"].between(0, 1).all()
    assert set(frame["sweep"].dropna()) == {"none", "n_scaling", "fixed_s"}
    confusion = frame[(frame["metric"] == "confusion") & (frame["variant"] == "secnet") & (frame["n_points"] == 128)
                      & (frame["dataset"] == "direction")]
    assert confusion["value"].sum() == 7  # the smoke preset tests a third of 20 samples, one vote each
    profile = pd.read_parquet(tiny_run / "profile.parquet")
    assert {"run_id", "variant", "n_points", "s1", "part", "macs", "params", "latency_ms"} <= set(profile.columns)
    total = profile[(profile["variant"] == "secnet") & (profile["sweep"] == "none")].set_index("part")["macs"]
    assert total["total"] == sum(total[p] for p in ("embed", "spatial_fa", "pool", "temporal_fa", "residual", "head"))
    html = (tiny_run.parent.parent / "r.html").read_text()
    for title in ("Accuracy — variant × dataset", "Ablations", "Cost — parameters", "Scaling — fitted", "Data —"):
        assert title in html
    assert html.count("data:image/png;base64,") == 5


def write_bin(path: Path, events: np.ndarray) -> None:
    t = events["t"].astype(np.int64)
    records = np.stack([events["x"], events["y"], (events["p"].astype(np.int64) << 7) | (t >> 16), (t >> 8) & 0xFF,
                        t & 0xFF], 1).astype(np.uint8)
    path.write_bytes(records.tobytes())


def test_bin_folder_trains_and_votes_over_windows(icml, tmp_path):
    from icml.data.events import simulate_dataset

    data = simulate_dataset("saccade-shapes", 12, 0)
    for i, (events, label) in enumerate(zip(data.events, data.labels)):
        folder = tmp_path / "nmnist" / ("Test" if i % 4 == 0 else "Train") / data.classes[label]
        folder.mkdir(parents=True, exist_ok=True)
        write_bin(folder / f"{i}.bin", events)
    result = icml("event-classify", "train", "--data", tmp_path / "nmnist", "--preset", "smoke", "--set", "windows=3",
                  "--set", "arch.n_points=64", "--set", "arch.groups=8,4", "--set", "arch.k=4", "--set", "arch.d0=8",
                  "--set", "epochs=1", "--set", "variants=frame_cnn", "--set", "profile.sweep_n=64",
                  "--set", "profile.fixed_s1=8", "--set", "profile.latency_runs=1", "--set", "profile.throughput_batch=2",
                  "--json")
    assert result.code == 0, result.err
    run = Path(result.json()["run_dir"])
    assert icml("event-classify", "eval", run, "--json").code == 0
    frame = pq.read_table(run / "metrics.parquet").to_pandas()
    acc = frame[(frame["phase"] == "eval") & frame["metric"].isin(["window_acc", "sample_acc"])]
    assert set(acc["dataset"]) == {"file"} and set(acc["windows"]) == {3}
    assert frame.loc[frame["metric"] == "events_per_sample", "value"].iloc[0] == pytest.approx(
        np.mean([len(e) for e in data.events]))


def test_bad_input_gets_one_line(icml, tmp_path):
    result = icml("event-classify", "train", "--set", "variants=frame_cnn,resnet")
    assert result.code == 2 and "unknown variant(s) ['resnet']" in result.err and "Traceback" not in result.err
    result = icml("event-classify", "train", "--set", "data=not-a-dataset")
    assert result.code == 2 and "neither a simulated set" in result.err
    result = icml("event-classify", "train", "--set", "arch.k=200")
    assert result.code == 2 and "arch.k" in result.err
    (tmp_path / "broken" / "0").mkdir(parents=True)
    (tmp_path / "broken" / "0" / "a.bin").write_bytes(b"\x07")
    result = icml("event-classify", "train", "--data", tmp_path / "broken", "--preset", "smoke")
    assert result.code == 2 and "a.bin: no complete 5-byte event record" in result.err
    assert len([line for line in result.err.splitlines() if "error" in line]) == 1


def test_validation_curve_never_sees_test_or_training_samples(tiny_run):
    for path in (tiny_run / "checkpoints" / "data").glob("*.npz"):
        data = np.load(path)
        train, val, test = (set(data[f"{part}_mark"].tolist()) for part in ("train", "val", "test"))
        assert val and not val & test and not val & train and not train & test, path.name
