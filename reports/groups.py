"""Reports over seeds: a group of runs (one method, one preset and config, one run per seed).

Every table of the method's own report is built per seed, aligned row by row (by its leading text
columns, else by position) and shown with each numeric cell as mean ± the half-width of its 95 %
Student-t interval over seeds (`stats.t_interval`); a cell equal at every seed is shown as it is,
and text cells that differ are listed per seed. The method's declared claims (`report.CLAIMS`,
see `claims.py`) are judged from the paired per-seed differences. The same numbers go to
`groups.parquet` (tidy: one row per table cell or claim) in `runs/<method>/groups/<group-id>/`,
beside report.md and report.html, and to `--format json`.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from icml.cli import registry
from icml.cli.errors import UsageError
from icml.cli.runstore import Run, RunStore, atomic_write_text
from icml.reports.claims import Claim, ClaimError, arm_label, arm_value, pooled_values, verdict
from icml.reports.stats import T_INTERVAL, t_interval
from icml.reports.tables import Table, fmt, full_precision

# A number, then an optional unit or short tag ('%', or a marker such as the R / F of a retained or
# forgotten dataset), then an optional within-run spread or interval.
NUMBER = re.compile(r"^\s*([+\-−]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+\-−]?\d+)?)\s*(%|[A-Za-z]{1,2}\b)?\s*(?:±.*|\[.*\])?$")
MISSING = ("", "–", "-", "nan", "None")


def parse_cell(value) -> tuple[float | None, str]:
    """(number, unit) of a table cell — a float, or a string such as '0.73', '97.8 %', '0.58 F', '0.7 ± 0.1'
    or '0.05 [0.04, 0.06]' (the number; a within-run spread or interval gives way to the one over seeds)
    — or (None, text) for a text cell; missing cells give (nan, '')."""
    if value is None or isinstance(value, bool):
        return (math.nan, "") if value is None else (None, str(value))
    if isinstance(value, (int, float, np.integer, np.floating)):
        return float(value), ""
    text = str(value)
    if text.strip() in MISSING:
        return math.nan, ""
    match = NUMBER.match(text)
    if match is None:
        return None, text
    return float(match.group(1).replace("−", "-")), (" " + match.group(2) if match.group(2) else "")


def _is_text_column(frame: pd.DataFrame, column) -> bool:
    cells = [parse_cell(v) for v in frame[column]]
    return any(number is None for number, _ in cells) and all(
        number is None or math.isnan(number) for number, _ in cells)


def _mean_text(mean: float, low: float, high: float, unit: str) -> str:
    if math.isnan(low):
        return fmt(mean, 4) + unit
    return f"{fmt(mean, 3)} ± {fmt((high - low) / 2, 2)}{unit}"


def _aligned(frames: list[pd.DataFrame], keys: list) -> tuple[list[tuple] | None, list[list[int | None]]]:
    """Row labels and, per seed, the row index of each label (None where a seed lacks it). Labels are None when
    the key columns do not name the rows uniquely (a task repeated per ratio): the rows are then aligned by
    position, and the key columns are shown as any other text column."""
    if keys and all(not f.duplicated(subset=keys).any() for f in frames):
        labels = list(dict.fromkeys(tuple(str(v) for v in row) for f in frames
                                    for row in f[keys].itertuples(index=False)))
        index = [{tuple(str(v) for v in row): i for i, row in enumerate(f[keys].itertuples(index=False))}
                 for f in frames]
        return labels, [[ix.get(label) for ix in index] for label in labels]
    n = max(len(f) for f in frames)
    return None, [[i if i < len(f) else None for f in frames] for i in range(n)]


def aggregate_table(title: str, tables: list[Table], seeds: list[int], note: str | None = None,
                    shown: list[Table] | None = None) -> tuple[Table, list[dict]]:
    """One table over seeds (display) and its numeric cells (tidy rows for groups.parquet); `note`: the
    method's note of the table as one run's report shows it (default: the first seed's). `tables` are
    built at full precision (their numbers enter the intervals); `shown`, the same tables as each run's
    own report displays them, give the text of text cells (a range '0.41 – 0.58', a per-seed list)."""
    frames = [t.frame.reset_index(drop=True) for t in tables]
    shown_frames = [t.frame.reset_index(drop=True) for t in shown] if shown is not None else frames
    columns = list(dict.fromkeys(c for f in frames for c in f.columns))
    keys = []
    for column in columns:  # the leading text columns name the rows (variant, task, …)
        if column in frames[0].columns and _is_text_column(frames[0], column):
            keys.append(column)
        else:
            break
    labels, where = _aligned(frames, keys)
    if labels is None:  # aligned by position: a row is named by its key cells (first seed holding it) and position
        labels = []
        for n, at in enumerate(where):
            frame, i = next((f, i) for f, i in zip(frames, at) if i is not None)
            labels.append(tuple(str(frame.at[i, k]) for k in keys) + (str(n),))
        keys = []
    out_rows, cells = [], []
    for label, positions in zip(labels, where):
        row_name = " · ".join(label)
        first = next(k for k, i in enumerate(positions) if i is not None)
        display = {k: _shown_cell(shown_frames[first], positions[first], k, text) for k, text in zip(keys, label)}
        for column in columns:
            if column in keys:
                continue
            raw = [f.at[i, column] if i is not None and column in f.columns else None
                   for f, i in zip(frames, positions)]
            parsed = [parse_cell(v) for v in raw]
            tags = {u for number, u in parsed if number is not None and not math.isnan(number)}
            if any(number is None for number, _ in parsed) or len(tags) > 1:  # text: as is when equal, else per seed
                texts = [fmt(v) if v is not None else "–" for v in raw]
                seen = [_shown_cell(f, i, column, t) for f, i, t in zip(shown_frames, positions, texts)]
                display[column] = seen[0] if len(set(seen)) == 1 else " | ".join(
                    f"s{s}: {t}" for s, t in zip(seeds, seen))
                continue
            values = [number for number, _ in parsed]
            unit = next((u for number, u in parsed if u), "")
            finite = [v for v in values if not math.isnan(v)]
            if not finite:
                display[column] = "–"
                continue
            mean, low, high, sd, n = t_interval(finite)
            if len(set(finite)) == 1 and len(finite) == len(values):
                display[column] = fmt(finite[0], 4) + unit
            else:
                display[column] = _mean_text(mean, low, high, unit)
            cells.append({"kind": "cell", "table": title, "row": row_name, "column": str(column), "n": n,
                          "mean": mean, "ci_low": low, "ci_high": high, "sd": sd, "per_seed": values})
        if not keys:
            display = {k: display[k] for k in columns if k in display}
        out_rows.append(display)
    first = tables[0]
    frame = pd.DataFrame(out_rows, columns=[c for c in columns if any(c in r for r in out_rows)])
    own = first.note if note is None else note
    if len({t.note for t in tables}) > 1:  # e.g. a count of images behind a run's means: say whose note is shown
        own = f"{own} (seed {seeds[0]}'s; it differs by seed)"
    note = " — ".join(p for p in (f"per run: {own}" if own else "", f"here: mean ± 95 % t-interval half-width over "
                                 f"seeds {', '.join(map(str, seeds))} (a within-run ± or [interval] gives way to it); "
                                 "a cell without ± is equal at every seed") if p)
    return Table(title, frame, dict(first.better), note), cells


def _shown_cell(frame: pd.DataFrame, i: int | None, column, fallback: str) -> str:
    """A cell as the run's own report displays it (the full-precision text where the display lacks it)."""
    if i is None or column not in frame.columns or i >= len(frame):
        return fallback
    return fmt(frame.at[i, column])


def judge_claims(claims: list[Claim], frames: list[pd.DataFrame], better: dict) -> list[dict]:
    """Each claim at every seed (paired: both arms from that seed's run) and over seeds."""
    out = []
    for claim in claims:
        try:
            a = [arm_value(f, claim, claim.a) for f in frames]
            b = [arm_value(f, claim, claim.b) for f in frames]
            pooled = pooled_values(frames, claim)
        except ClaimError as exc:  # the method's declaration is at fault: no number, the reason instead
            a = b = [math.nan] * len(frames)
            pooled, error = {}, f"declaration error: {exc}"
        else:
            error = None
        diffs = [x - y for x, y in zip(a, b)]
        mean, low, high, sd, n = t_interval(diffs)
        a_mean, a_low, a_high, _, _ = t_interval(a)
        b_mean, b_low, b_high, _, _ = t_interval(b)
        direction = claim.direction(better)
        out.append({"kind": "claim", "claim": claim.name, "metric": claim.metric, "a": arm_label(claim.a),
                    "b": arm_label(claim.b), "expect": f"a − b {'>' if direction == 'higher' else '<'} 0",
                    "n": n, "mean": mean, "ci_low": low, "ci_high": high, "sd": sd, "per_seed": diffs,
                    "a_mean": a_mean, "a_ci_low": a_low, "a_ci_high": a_high,
                    "b_mean": b_mean, "b_ci_low": b_low, "b_ci_high": b_high,
                    "pooled": "; ".join(f"mean over {tag} = {', '.join(map(str, values))}"
                                        for tag, values in pooled.items() if values),
                    "verdict": error or (verdict(low, high, direction, diffs) if n == len(frames) else
                                         f"missing at {len(frames) - n} seed(s)" if n else "no rows")})
    return out


def claims_table(claims: list[dict], seeds: list[int]) -> Table:
    """One row per claim, its verdict and interval first (what a reader looks for), then the arms."""
    rows = [{"claim": c["claim"] + (f" ({c['pooled']})" if c.get("pooled") else ""), "verdict": c["verdict"],
             "a − b": fmt(c["mean"], 3),
             "95 % interval": "–" if math.isnan(c["ci_low"]) else f"[{fmt(c['ci_low'], 3)}, {fmt(c['ci_high'], 3)}]",
             "per seed": " / ".join(fmt(d, 3) for d in c["per_seed"]), "claimed": c["expect"],
             "a": c["a"], "b": c["b"],
             "a (mean ± CI)": _mean_text(c["a_mean"], c["a_ci_low"], c["a_ci_high"], ""),
             "b (mean ± CI)": _mean_text(c["b_mean"], c["b_ci_low"], c["b_ci_high"], "")}
            for c in claims]
    return Table("claims (paired differences over seeds)", pd.DataFrame(rows),
                 note=f"{T_INTERVAL} of the per-seed difference a − b (seeds {', '.join(map(str, seeds))}); "
                      "a claim holds only when its interval excludes zero on the claimed side")


@dataclass
class SeedGroup:
    """A group report; shaped like render.Section, so the terminal/markdown/html renderers draw it."""

    group_id: str
    method: str
    preset: str
    runs: list[Run]
    seeds: list[int]
    frame: pd.DataFrame
    tables: list[Table] = field(default_factory=list)
    numbers: pd.DataFrame = field(default_factory=pd.DataFrame)
    plots: list = field(default_factory=list)

    @property
    def title(self) -> str:
        return f"{self.method} · group {self.group_id} · {len(self.seeds)} seeds"

    @property
    def smoke(self) -> bool:
        return self.preset == "smoke"

    @property
    def folder(self) -> Path:
        return self.runs[0].path.parent / "groups" / self.group_id

    def facts(self) -> list[tuple[str, str]]:
        return [("method", self.method), ("group", self.group_id), ("preset", self.preset),
                ("seeds", ", ".join(map(str, self.seeds))), ("interval", T_INTERVAL),
                ("runs", ", ".join(r.path.name for r in self.runs))]


def _config_key(run: Run) -> str:
    record = run.config_record()
    return json.dumps(record.get("config", {}), sort_keys=True, default=str)


def build_group(runs: list[Run], group_id: str | None = None) -> SeedGroup:
    """The group report of `runs` (one method, one preset and config, distinct seeds)."""
    from icml.reports.render import build_section

    infos = [r.info() for r in runs]
    methods = {i["method"] for i in infos}
    presets = {i.get("preset") for i in infos}
    seeds = [int(i["seed"]) for i in infos]
    if len(methods) != 1 or len(presets) != 1:
        raise UsageError(f"a group holds one method and preset, not {sorted(methods)} / {sorted(map(str, presets))}",
                         "pass the runs of one --method and --preset")
    if len(set(seeds)) != len(seeds):
        raise UsageError(f"the runs repeat seeds ({seeds})", "one run per seed: pass --group or distinct runs")
    if len({_config_key(r) for r in runs}) != 1:
        raise UsageError("the runs' configs differ beyond the seed", "compare runs of one command (--group)")
    order = np.argsort(seeds, kind="stable")
    runs, infos, seeds = [runs[i] for i in order], [infos[i] for i in order], [seeds[i] for i in order]
    groups = {i.get("group") for i in infos}
    group_id = group_id or (groups.pop() if len(groups) == 1 and None not in groups else
                            f"{infos[0].get('preset')}-s{'-'.join(map(str, seeds))}")
    method = registry.get(methods.pop())
    with full_precision():  # each seed's tables at full precision: display rounding stays out of the means
        sections = [build_section(run, with_plots=False) for run in runs]
    displayed = [build_section(run, with_plots=False) for run in runs]  # text cells and notes as shown
    notes = {t.title: t.note for t in displayed[0].tables}
    if any(s.frame.empty for s in sections):
        empty = [str(s.run.path) for s in sections if s.frame.empty]
        raise UsageError(f"runs without results: {', '.join(empty)}", f"evaluate them: icml {method.name} eval --group …")
    titles = list(dict.fromkeys(t.title for s in sections for t in s.tables))
    tables, numbers = [], []
    for title in titles:
        # a seed's table as displayed, where its title matches (a title may print a number at full precision)
        present = [(seed, full, next((t for t in d.tables if t.title == title), full))
                   for seed, s, d in zip(seeds, sections, displayed)
                   for full in [next((t for t in s.tables if t.title == title), None)] if full is not None]
        table, cells = aggregate_table(title, [t for _, t, _ in present], [seed for seed, _, _ in present],
                                       notes.get(title), shown=[t for _, _, t in present])
        tables.append(table)
        numbers += cells
    try:
        hooks = method.part("report")
    except ModuleNotFoundError:
        hooks = None
    claims = judge_claims(list(getattr(hooks, "CLAIMS", ())), [s.frame for s in sections], method.metrics)
    if claims:
        tables.insert(0, claims_table(claims, seeds))
    numbers = claims + numbers
    frame = pd.concat([s.frame for s in sections], ignore_index=True)
    tidy = pd.DataFrame(numbers)
    if not tidy.empty:
        tidy.insert(0, "group_id", group_id)
        tidy.insert(1, "method", method.name)
        tidy.insert(2, "preset", infos[0].get("preset"))
        tidy.insert(3, "seeds", ",".join(map(str, seeds)))
        tidy["interval"] = "t95"
    return SeedGroup(group_id, method.name, str(infos[0].get("preset")), runs, seeds, frame, tables, tidy)


def select_runs(store: RunStore, method: str, *, group: str | None = None, seeds: list[int] | None = None,
                preset: str | None = None, phase: str = "eval") -> list[Run]:
    """The runs a group report or eval is about: a group id (its runs, optionally only `seeds`); else the
    newest group with a completed `phase` for `seeds`; else (preset) the newest run of each seed of that
    preset with `phase` completed and the newest run's config."""
    if group is not None:
        runs = store.group(group, method)
        if seeds is not None:
            have = {r.info()["seed"]: r for r in runs}
            missing = [s for s in seeds if s not in have]
            if missing:
                raise UsageError(f"group '{group}' has no run of seed(s) {missing}", f"its seeds: {sorted(have)}")
            runs = [have[s] for s in seeds]
        return runs
    if preset is None:
        return store.latest_group(method, phase, seeds)
    candidates = [r for r in store.runs(method) if _safe(lambda: r.info().get("preset")) == preset
                  and _safe(lambda: r.phase_status(phase)) == "completed"]
    if not candidates:
        raise UsageError(f"no run of {method} at preset {preset} with a completed {phase} in '{store.root}'",
                         f"run 'icml {method} train --preset {preset} --seeds 0,1,2' first")
    key = _config_key(candidates[-1])
    newest: dict[int, Run] = {}
    for run in reversed(candidates):
        seed = run.info()["seed"]
        if seed not in newest and _config_key(run) == key and (seeds is None or seed in seeds):
            newest[seed] = run
    if seeds is not None and any(s not in newest for s in seeds):
        raise UsageError(f"no run of {method} at preset {preset} for seed(s) {[s for s in seeds if s not in newest]}",
                         f"train them: icml {method} train --preset {preset} --seeds …")
    return [newest[s] for s in sorted(newest)]


def _safe(get):
    try:
        return get()
    except UsageError:
        return None


def _clean(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_clean(v) for v in value]
    if isinstance(value, (np.floating, np.integer)):
        return _clean(value.item())
    return value


def group_json(group: SeedGroup, parquet: Path | None) -> str:
    numbers = group.numbers.to_dict("records") if not group.numbers.empty else []
    doc = {"group": {"group_id": group.group_id, "method": group.method, "preset": group.preset,
                     "seeds": group.seeds, "runs": [str(r.path) for r in group.runs], "interval": T_INTERVAL,
                     "smoke": group.smoke, "groups_parquet": str(parquet) if parquet else None},
           "claims": [{k: _clean(v) for k, v in c.items() if k not in ("group_id", "method", "preset", "table",
                                                                        "row", "column", "kind", "interval")}
                      for c in numbers if c["kind"] == "claim"],
           "tables": [{"title": t.title, "columns": [str(c) for c in t.frame.columns], "better": t.better,
                       "rows": [[fmt(v) for v in row] for row in t.frame.itertuples(index=False)],
                       "cells": [{k: _clean(c[k]) for k in ("row", "column", "n", "mean", "ci_low", "ci_high",
                                                            "sd", "per_seed")}
                                 for c in numbers if c["kind"] == "cell" and c["table"] == t.title]}
                      for t in group.tables]}
    return json.dumps(doc, default=str)


def write_group(group: SeedGroup) -> Path:
    """groups.parquet, report.md and report.html of the group, in runs/<method>/groups/<group-id>/."""
    from icml.cli.results import write_frame
    from icml.reports.render import render_html, render_markdown

    folder = group.folder
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "groups.parquet"
    write_frame(path, group.numbers)
    atomic_write_text(folder / "report.md", render_markdown([group], base=folder))
    atomic_write_text(folder / "report.html", render_html([group]))
    return path


def render_group(group: SeedGroup, fmt_name: str, out: Path | None) -> str | None:
    """Like render.render for one group: text for stdout, or None when written to `out`/the terminal."""
    from icml.reports.render import render_html, render_markdown, render_terminal

    parquet = write_group(group)
    if fmt_name == "terminal":
        render_terminal([group])
        from icml.cli import console

        console.say(f"numbers: {parquet}")
        return None
    if fmt_name == "markdown":
        text = render_markdown([group], base=out.parent.resolve() if out else None)
    elif fmt_name == "html":
        text = render_html([group])
    elif fmt_name == "csv":
        text = group.numbers.to_csv(index=False)
    else:
        text = group_json(group, parquet)
    if out is not None:
        atomic_write_text(out, text)
        return None
    return text


def report_group(runs: list[Run], fmt_name: str, out: Path | None, as_json: bool) -> None:
    """The CLI's group report: one run is an ordinary report; several, the report over seeds."""
    from icml.cli import console
    from icml.cli.commands import report_runs

    if len(runs) < 2:
        console.say(f"only one run ({runs[0].path.name}): no interval over seeds")
        report_runs(runs, fmt_name, out, as_json)
        return
    text = render_group(build_group(runs), "json" if as_json else fmt_name, out)
    if text is not None:
        print(text, end="" if text.endswith("\n") else "\n")
    if out is not None:
        console.say(f"report written to {out}")
