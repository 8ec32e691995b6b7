"""A method's claims: paired differences between two arms of one metric, judged over seeds.

A method declares them in its report module, `CLAIMS = [Claim(...), ...]`; the group report
(`reports/groups.py`) evaluates each at every seed of a group (the two arms of one seed share its
data, so the difference is paired), and gives the difference's mean with its 95 % t-interval over
seeds. A claim *holds* only when that interval excludes zero on the claimed side.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

HOLDS, REVERSED, NOT_SHOWN, TOO_FEW = "holds", "reversed", "not shown", "needs ≥ 2 seeds"


@dataclass(frozen=True)
class Claim:
    """`a − b` of `metric` is claimed > 0 (`expect="higher"`) or < 0 (`"lower"`; default: the
    direction the method declares better for the metric). An arm is a variant name or a dict of
    column → value; `where` filters both arms (tags such as task or ratio, split); the value of an
    arm at one seed is the mean of its matching rows of `phase` (train: each variant's last step)."""

    name: str
    metric: str
    a: Any
    b: Any
    where: dict = field(default_factory=dict)
    phase: str = "eval"
    expect: str | None = None

    def direction(self, better: dict) -> str:
        return self.expect or better.get(self.metric) or "higher"


def _matches(column, value):
    if isinstance(value, float):
        return (column.astype("float64") - value).abs() <= 1e-9 * max(1.0, abs(value))
    if isinstance(value, (list, tuple, set)):
        return column.isin(list(value))
    return column == value


def arm_value(frame, claim: Claim, arm) -> float:
    """The mean of the rows of one arm at one seed (NaN if there are none)."""
    rows = frame[(frame["phase"] == claim.phase) & (frame["metric"] == claim.metric)]
    if claim.phase == "train" and not rows.empty:
        rows = rows[rows["step"] == rows.groupby("variant")["step"].transform("max")]
    filters = {**claim.where, **(arm if isinstance(arm, dict) else {"variant": arm})}
    for column, value in filters.items():
        if column not in rows.columns:
            return math.nan
        rows = rows[_matches(rows[column], value)]
    return float(rows["value"].mean()) if not rows.empty else math.nan


def verdict(low: float, high: float, direction: str) -> str:
    """holds: the interval lies wholly on the claimed side of zero; reversed: wholly on the other."""
    if math.isnan(low) or math.isnan(high):
        return TOO_FEW
    sign = 1.0 if direction == "higher" else -1.0
    lo, hi = sorted((sign * low, sign * high))
    if lo > 0:
        return HOLDS
    if hi < 0:
        return REVERSED
    return NOT_SHOWN


def arm_label(arm) -> str:
    return arm if isinstance(arm, str) else ", ".join(f"{k}={v}" for k, v in arm.items())
