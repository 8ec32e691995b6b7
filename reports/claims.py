"""A method's claims: paired differences between two arms of one metric, judged over seeds.

A method declares them in its report module, `CLAIMS = [Claim(...), ...]`; the group report
(`reports/groups.py`) evaluates each at every seed of a group (the two arms of one seed share its
data, so the difference is paired), and gives the difference's mean with its 95 % t-interval over
seeds. A claim *holds* only when that interval excludes zero on the claimed side, and never when the
difference is the same number at every seed (copies of one run are not seeds).

An arm's value is the mean of the rows it matches, so a claim must say what it averages: every tag
column (and `split`) in which an arm's rows differ must be pinned by `where` / the arm, or named in
`pool` — otherwise evaluating the claim raises `ClaimError` (a declaration error of the method, found by
tests over every method's runs), rather than silently mixing, say, two budgets of one variant.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

HOLDS, REVERSED, NOT_SHOWN, TOO_FEW = "holds", "reversed", "not shown", "needs ≥ 2 seeds"
IDENTICAL = "not shown: identical at every seed"

# Columns of metrics.parquet that are not tags: `step` is resolved by the phase (train: each variant's
# last step) and `seed` is the run's own (or a replicate within it, which a mean is right to pool).
NOT_TAGS = frozenset({"run_id", "method", "phase", "step", "variant", "metric", "value", "seed"})


class ClaimError(ValueError):
    """A claim's arm matches rows that differ in a tag the claim neither pins nor pools."""


@dataclass(frozen=True)
class Claim:
    """`a − b` of `metric` is claimed > 0 (`expect="higher"`) or < 0 (`"lower"`; default: the
    direction the method declares better for the metric). An arm is a variant name or a dict of
    column → value; `where` filters both arms (tags such as task or ratio, split); the value of an
    arm at one seed is the mean of its matching rows of `phase` (train: each variant's last step).
    `pool` names the tags that mean averages over on purpose (e.g. a mean over tasks); a tag in which
    the matched rows differ and that is neither pinned nor pooled is a `ClaimError`."""

    name: str
    metric: str
    a: Any
    b: Any
    where: dict = field(default_factory=dict)
    phase: str = "eval"
    expect: str | None = None
    pool: tuple[str, ...] = ()

    def direction(self, better: dict) -> str:
        return self.expect or better.get(self.metric) or "higher"


def _matches(column, value):
    if isinstance(value, float):
        return (column.astype("float64") - value).abs() <= 1e-9 * max(1.0, abs(value))
    if isinstance(value, (list, tuple, set)):
        return column.isin(list(value))
    return column == value


def arm_rows(frame, claim: Claim, arm):
    """The rows of one arm at one seed (None if a filtered column is absent), checked for silent pooling."""
    rows = frame[(frame["phase"] == claim.phase) & (frame["metric"] == claim.metric)]
    filters = {**claim.where, **(arm if isinstance(arm, dict) else {"variant": arm})}
    for column, value in filters.items():
        if column not in rows.columns:
            return None
        rows = rows[_matches(rows[column], value)]
    if claim.phase == "train" and not rows.empty:  # the last step of the rows the claim names (per experiment)
        rows = rows[rows["step"] == rows.groupby("variant")["step"].transform("max")]
    for column in rows.columns:
        if column in NOT_TAGS or column in filters or column in claim.pool:
            continue
        values = rows[column].dropna().unique()
        if len(values) > 1:
            shown = ", ".join(map(str, sorted(values, key=str)))
            raise ClaimError(f"claim '{claim.name}': arm {arm_label(arm)} averages rows of {column} = {shown}; "
                             f"pin {column} in where= or name it in pool=")
    return rows


def arm_value(frame, claim: Claim, arm) -> float:
    """The mean of the rows of one arm at one seed (NaN if there are none)."""
    rows = arm_rows(frame, claim, arm)
    return float(rows["value"].mean()) if rows is not None and not rows.empty else math.nan


def pooled_values(frames, claim: Claim) -> dict[str, list]:
    """The values of each tag in `claim.pool` that the claim's arms averaged over, across `frames`."""
    out: dict[str, set] = {tag: set() for tag in claim.pool}
    for frame in frames:
        for arm in (claim.a, claim.b):
            rows = arm_rows(frame, claim, arm)
            for tag in claim.pool:
                if rows is not None and tag in rows.columns:
                    out[tag].update(rows[tag].dropna().tolist())
    return {tag: sorted(values, key=str) for tag, values in out.items()}


def verdict(low: float, high: float, direction: str, diffs=()) -> str:
    """holds: the interval lies wholly on the claimed side of zero; reversed: wholly on the other; not
    shown otherwise, and whenever the per-seed differences `diffs` are all the same number (the runs are
    copies, or the claim does not depend on the seed: a zero-width interval is no evidence)."""
    if len(diffs) >= 2 and len({float(d) for d in diffs}) == 1:
        return IDENTICAL
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
