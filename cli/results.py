"""The Parquet results of a run: one long/tidy `metrics.parquet` plus declared extra tables.

Every metrics row is (run_id, method, phase, step, split, variant, metric, value, seed)
plus the method's tag columns (null where a tag does not apply). The schema is built from
the method's declaration and checked with pyarrow on every write; every write goes to a
temporary file that is renamed over the target, so a crash never leaves half a file and
appending never loses earlier rows.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from .errors import IcmlError
from .runstore import temp_sibling

CORE_COLUMNS: list[tuple[str, pa.DataType]] = [
    ("run_id", pa.string()),
    ("method", pa.string()),
    ("phase", pa.string()),
    ("step", pa.int64()),
    ("split", pa.string()),
    ("variant", pa.string()),
    ("metric", pa.string()),
    ("value", pa.float64()),
    ("seed", pa.int64()),
]
REQUIRED = ("run_id", "method", "phase", "variant", "metric")
TAG_TYPES = {"string": pa.string(), "int64": pa.int64(), "float64": pa.float64()}


def metrics_schema(tags: dict[str, str]) -> pa.Schema:
    fields = [pa.field(name, dtype) for name, dtype in CORE_COLUMNS]
    for name, type_name in tags.items():
        if name in dict(CORE_COLUMNS):
            raise ValueError(f"tag column '{name}' clashes with a core column")
        fields.append(pa.field(name, TAG_TYPES[type_name]))
    return pa.schema(fields)


def to_table(frame: pd.DataFrame, schema: pa.Schema) -> pa.Table:
    """Validate a frame against the schema and convert it; raise ValueError on any mismatch."""
    unknown = [c for c in frame.columns if c not in schema.names]
    if unknown:
        raise ValueError(f"columns {unknown} are not in the metrics schema "
                         f"(declare them as tags of the method)")
    frame = frame.reindex(columns=schema.names)
    for name in REQUIRED:
        if frame[name].isna().any():
            raise ValueError(f"column '{name}' has missing values")
    try:
        for name in schema.names:  # integer columns with nulls need pandas' nullable Int64 to reach arrow
            if pa.types.is_integer(schema.field(name).type):
                frame[name] = frame[name].astype("Int64")
        return pa.Table.from_pandas(frame, schema=schema, preserve_index=False)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as exc:
        raise ValueError(f"metrics rows do not fit the schema: {exc}") from None


def atomic_write_table(table: pa.Table, path: Path) -> None:
    tmp = temp_sibling(path)
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_table(path: Path) -> pd.DataFrame:
    if not path.exists():
        raise IcmlError(f"results file '{path}' is missing", "run the method's train/eval to create it")
    try:
        return pq.read_table(path).to_pandas()
    except (pa.ArrowInvalid, OSError) as exc:
        raise IcmlError(f"results file '{path}' is corrupt ({str(exc).splitlines()[0]})",
                        "re-run the method's eval to rewrite it") from None


def read_metrics(path: Path, schema: pa.Schema) -> pd.DataFrame:
    frame = read_table(path)
    missing = [n for n in schema.names if n not in frame.columns]
    if missing:
        raise IcmlError(f"results file '{path}' lacks columns {missing}",
                        "it was written by another version of the method; re-run eval")
    return frame


def append_metrics(path: Path, rows: Iterable[dict] | pd.DataFrame, schema: pa.Schema,
                   replace: dict | None = None) -> int:
    """Append rows to metrics.parquet atomically; return the number of rows written.

    `replace` (e.g. {"phase": "eval"}) first drops the existing rows matching all its
    items, so re-running a phase supersedes its earlier results instead of doubling them;
    every other row is kept.
    """
    new = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    new_table = to_table(new, schema)
    if path.exists():
        old = read_metrics(path, schema)
        if replace:
            keep = pd.Series(False, index=old.index)
            for column, value in replace.items():
                keep |= old[column] != value
            old = old[keep]
        table = pa.concat_tables([to_table(old[schema.names], schema), new_table])
    else:
        table = new_table
    atomic_write_table(table, path)
    return new_table.num_rows


def drop_metrics(path: Path, schema: pa.Schema, match: dict) -> None:
    """Drop the rows of metrics.parquet that match every item of `match`, atomically."""
    if not path.exists():
        return
    old = read_metrics(path, schema)
    hit = pd.Series(True, index=old.index)
    for column, value in match.items():
        hit &= old[column] == value
    if hit.any():
        atomic_write_table(to_table(old.loc[~hit, schema.names], schema), path)


def write_frame(path: Path, frame: pd.DataFrame) -> None:
    """A method's extra table (e.g. scores.parquet): any columns, written atomically."""
    atomic_write_table(pa.Table.from_pandas(frame, preserve_index=False), path)
