"""metrics.parquet: schema checked on every write, atomic writes, appends that keep rows;
the run store's layout and lookups."""
from __future__ import annotations

import json
import os

import pandas as pd
import pyarrow.parquet as pq
import pytest

from icml.cli import results
from icml.cli.errors import IcmlError, UsageError
from icml.cli.runstore import Run, RunStore

SCHEMA = results.metrics_schema({"experiment": "string", "inv_eps": "float64", "hidden": "int64"})


def rows(n, phase="train", **extra):
    return [{"run_id": "r", "method": "m", "phase": phase, "step": i, "split": "train", "variant": "a",
             "metric": "loss", "value": float(i), "seed": 0, **extra} for i in range(n)]


def test_schema_has_core_then_tag_columns():
    assert SCHEMA.names == ["run_id", "method", "phase", "step", "split", "variant", "metric", "value", "seed",
                            "experiment", "inv_eps", "hidden"]
    with pytest.raises(ValueError, match="clashes"):
        results.metrics_schema({"value": "float64"})


def test_append_keeps_earlier_rows_and_types(tmp_path):
    path = tmp_path / "metrics.parquet"
    results.append_metrics(path, rows(3, experiment="e1"), SCHEMA)
    results.append_metrics(path, rows(2, hidden=12), SCHEMA)
    table = pq.read_table(path)
    assert table.schema == SCHEMA
    frame = table.to_pandas()
    assert len(frame) == 5 and frame["experiment"].tolist()[:3] == ["e1"] * 3
    assert frame["hidden"].isna().sum() == 3 and frame["hidden"].dropna().tolist() == [12, 12]


def test_replace_supersedes_only_the_named_phase(tmp_path):
    path = tmp_path / "metrics.parquet"
    results.append_metrics(path, rows(3) + rows(2, phase="eval"), SCHEMA)
    results.append_metrics(path, rows(1, phase="eval"), SCHEMA, replace={"phase": "eval"})
    frame = pq.read_table(path).to_pandas()
    assert (frame["phase"] == "train").sum() == 3 and (frame["phase"] == "eval").sum() == 1


@pytest.mark.parametrize("bad, message", [
    (rows(1, nope=1), "not in the metrics schema"),
    (rows(1, hidden="twelve"), "do not fit the schema"),
    ([{**rows(1)[0], "metric": None}], "'metric' has missing values"),
    ([{**rows(1)[0], "value": "x"}], "do not fit the schema"),
])
def test_schema_violations_are_rejected_and_the_file_is_untouched(tmp_path, bad, message):
    path = tmp_path / "metrics.parquet"
    results.append_metrics(path, rows(2), SCHEMA)
    before = path.read_bytes()
    with pytest.raises(ValueError, match=message):
        results.append_metrics(path, bad, SCHEMA)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["metrics.parquet"]  # no temp files left behind


def test_corrupt_or_missing_file_is_a_clear_error(tmp_path):
    path = tmp_path / "metrics.parquet"
    with pytest.raises(IcmlError, match="is missing"):
        results.read_metrics(path, SCHEMA)
    path.write_bytes(b"not parquet at all")
    with pytest.raises(IcmlError, match="is corrupt"):
        results.append_metrics(path, rows(1), SCHEMA)
    assert path.read_bytes() == b"not parquet at all"


def test_run_store_layout_and_latest(tmp_path):
    store = RunStore(tmp_path)
    first = store.create("m", "smoke", 1, "cpu", {"a": 1})
    second = store.create("m", "smoke", 2, "cpu", {"a": 2})
    assert first.path.parent == tmp_path / "m"
    assert json.loads(first.config_path.read_text()) == {"method": "m", "preset": "smoke", "seed": 1,
                                                         "config": {"a": 1}}
    assert first.info()["status"] == "running"
    first.set_phase("train", "completed")
    second.set_phase("train", "failed", error="boom")
    assert store.latest("m", "train").path == first.path  # failed runs are not "latest completed"
    with pytest.raises(UsageError, match="completed eval"):
        store.latest("m", "eval")
    (second.path / "run.json").write_text("{")  # a corrupt newer run does not hide the good one
    assert store.latest("m", "train").path == first.path
    assert [r.path for r in store.runs("m")] == [first.path, second.path]
    with pytest.raises(UsageError, match="is corrupt"):
        second.info()
    with pytest.raises(UsageError, match="not a run directory"):
        Run(tmp_path).info()
