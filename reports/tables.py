"""Report tables: what a method's `report.tables(frame)` returns, and helpers to build them.

A Table holds a small DataFrame of display values plus, per column, which direction is
better; renderers add ↑/↓ to those headers so a reader knows how to compare variants.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import pandas as pd

ARROWS = {"higher": "↑", "lower": "↓"}


@dataclass
class Table:
    title: str
    frame: pd.DataFrame
    better: dict[str, str] = field(default_factory=dict)  # column -> higher | lower
    note: str = ""

    def headers(self) -> list[str]:
        return [f"{c} {ARROWS[self.better[c]]}" if self.better.get(c) in ARROWS else str(c)
                for c in self.frame.columns]


_min_digits = 0  # raised by full_precision()


@contextmanager
def full_precision(digits: int = 17) -> Iterator[None]:
    """Inside the block fmt (and so mean_sd) keeps at least `digits` significant digits: a report over
    seeds builds each seed's tables this way and reads its numbers back, so rounding for display does
    not enter the intervals."""
    global _min_digits
    previous, _min_digits = _min_digits, digits
    try:
        yield
    finally:
        _min_digits = previous


def fmt(value: object, digits: int = 4) -> str:
    digits = max(digits, _min_digits)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, (float, np.floating)):
        value = float(value)
        if value == 0:
            return "0"
        if abs(value) >= 1e4 or abs(value) < 1e-3:
            return f"{value:.{digits - 1}e}"
        return f"{value:.{digits}g}"
    return str(value)


def mean_sd(values: pd.Series, digits: int = 3) -> str:
    values = values.dropna()
    if values.empty:
        return "–"
    if len(values) == 1:
        return fmt(values.iloc[0], digits)
    return f"{fmt(values.mean(), digits)} ± {fmt(values.std(ddof=1), digits)}"


def metric_table(frame: pd.DataFrame, title: str, metrics: list[str], better: dict[str, str | None],
                 rows: list[str] = ("variant",), order: list[str] | None = None, note: str = "",
                 aggregate=mean_sd) -> Table:
    """rows × metrics, each cell aggregated over the remaining rows (e.g. seeds: mean ± sd)."""
    rows = list(rows)
    subset = frame[frame["metric"].isin(metrics)]
    if subset.empty:
        return Table(title, pd.DataFrame(columns=rows + list(metrics)), note=note or "no rows")
    grouped = subset.groupby(rows + ["metric"], sort=False, dropna=False)["value"].apply(aggregate)
    table = grouped.unstack("metric").reset_index()
    present = [m for m in metrics if m in table.columns]
    table = table[rows + present]
    if order is not None and "variant" in rows:
        rank = {v: i for i, v in enumerate(order)}
        table = table.sort_values(by="variant", key=lambda s: s.map(lambda v: rank.get(v, len(rank))),
                                  kind="stable")
    table = table.fillna("–").reset_index(drop=True)
    return Table(title, table, {m: better[m] for m in present if better.get(m)}, note)


def default_tables(frame: pd.DataFrame, better: dict[str, str | None]) -> list[Table]:
    """Without a method hook: one table per phase, variant × metric, mean ± sd over the rest."""
    tables = []
    for phase in ("eval", "train"):
        rows = frame[frame["phase"] == phase]
        if phase == "train" and not rows.empty:  # the end of training, not its average
            rows = rows[rows["step"] == rows.groupby("variant")["step"].transform("max")]
        if not rows.empty:
            metrics = list(dict.fromkeys(rows["metric"]))
            tables.append(metric_table(rows, f"{phase} metrics", metrics, better))
    return tables


def default_headline(frame: pd.DataFrame, better: dict[str, str | None]) -> dict:
    """{metric: {variant: mean}} of the directed metrics, from eval rows (else train's last step)."""
    rows = frame[frame["phase"] == "eval"]
    if rows.empty:
        rows = frame[frame["phase"] == "train"]
        if rows.empty:
            return {}
        rows = rows[rows["step"] == rows.groupby("variant")["step"].transform("max")]
    rows = rows[rows["metric"].map(lambda m: better.get(m) is not None)]
    out: dict = {}
    for (metric, variant), value in rows.groupby(["metric", "variant"], sort=False)["value"].mean().items():
        out.setdefault(metric, {})[variant] = float(value)
    return out
