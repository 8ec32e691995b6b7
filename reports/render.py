"""Render the report of one or more runs: terminal (rich, stderr), markdown, self-contained
HTML, CSV and JSON.

Per run, the method's `report` module gives `tables(frame, config)` and `plots(frame, config)`
(matplotlib figures, Agg backend); a hook that declares a `run` parameter also gets the run, to read
its extra tables (`run.table("allocations")`). Every report also lands in the run's `report/` folder as
report.md, report.html and one PNG per plot.
"""
from __future__ import annotations

import base64
import html
import inspect
import io
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from icml.cli import registry
from icml.cli.lifecycle import config_from_run
from icml.cli.results import metrics_schema, read_metrics
from icml.cli.runstore import Run, atomic_write_text
from icml.reports.tables import Table, default_headline, default_tables, fmt

FORMATS = ("terminal", "markdown", "html", "csv", "json")
SMOKE_NOTE = "smoke preset: a plumbing check on a tiny budget — its numbers say nothing about the method"


@dataclass
class Section:
    run: Run
    info: dict
    frame: pd.DataFrame
    tables: list[Table] = field(default_factory=list)
    plots: list[tuple[str, Path]] = field(default_factory=list)
    headline: dict = field(default_factory=dict)

    @property
    def title(self) -> str:
        return f"{self.info['method']} · {self.info['run_id']}"

    @property
    def smoke(self) -> bool:
        return self.info.get("preset") == "smoke"

    def facts(self) -> list[tuple[str, str]]:
        info = self.info
        versions = info.get("versions", {})
        phases = ", ".join(f"{p} {v.get('status')}" for p, v in info.get("phases", {}).items()) or "none"
        return [("method", info["method"]), ("run", info["run_id"]), ("preset", info.get("preset", "?")),
                ("seed", str(info.get("seed"))), ("device", str(info.get("device"))), ("phases", phases),
                ("started", str(info.get("started"))), ("torch", str(versions.get("torch"))),
                ("git", str(info.get("git_commit")))]


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")[:60] or "plot"


def _call_hook(hook, frame: pd.DataFrame, cfg, run: Run):
    """hook(frame, cfg), plus run=… for hooks that read the run's extra tables."""
    if "run" in inspect.signature(hook).parameters:
        return hook(frame, cfg, run=run)
    return hook(frame, cfg)


def build_section(run: Run, with_plots: bool = True) -> Section:
    info = run.info()
    method = registry.get(info["method"])
    schema = metrics_schema(method.tags)
    frame = read_metrics(run.metrics_path, schema) if run.metrics_path.exists() else \
        pd.DataFrame(columns=schema.names)
    section = Section(run, info, frame)
    if frame.empty:
        return section
    cfg, _, _ = config_from_run(method, run)
    try:
        hooks = method.part("report")
    except ModuleNotFoundError:
        hooks = None
    section.tables = _call_hook(hooks.tables, frame, cfg, run) if hooks and hasattr(hooks, "tables") \
        else default_tables(frame, method.metrics)
    section.headline = hooks.headline(frame) if hooks and hasattr(hooks, "headline") \
        else default_headline(frame, method.metrics)
    if with_plots and hooks and hasattr(hooks, "plots"):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        run.report_dir.mkdir(parents=True, exist_ok=True)
        for title, figure in _call_hook(hooks.plots, frame, cfg, run):
            path = run.report_dir / f"{_slug(title)}.png"
            tmp = path.with_suffix(".png.tmp")
            figure.savefig(tmp, dpi=110, bbox_inches="tight", format="png")
            os.replace(tmp, path)
            plt.close(figure)
            section.plots.append((title, path))
    return section


# terminal ------------------------------------------------------------------------------------
def render_terminal(sections: list[Section]) -> None:
    from rich.panel import Panel
    from rich.table import Table as RichTable

    from icml.cli import console

    for section in sections:
        console.show(Panel(" · ".join(f"{k} {v}" for k, v in section.facts()[:6]), title=section.title))
        if section.smoke:
            console.say(f"⚠ {SMOKE_NOTE}", style="bold yellow")
        if section.frame.empty:
            console.say("no results recorded yet")
        for table in section.tables:
            rich_table = RichTable(title=table.title, caption=table.note or None, title_justify="left")
            for header in table.headers():
                rich_table.add_column(header, justify="right" if header not in ("variant",) else "left")
            for row in table.frame.itertuples(index=False):
                rich_table.add_row(*(fmt(v) for v in row))
            console.show(rich_table)
        for title, path in section.plots:
            console.say(f"plot: {title} → {path}")


# markdown ------------------------------------------------------------------------------------
def _md_table(table: Table) -> str:
    lines = [f"### {table.title}", ""]
    headers = table.headers()
    lines.append("| " + " | ".join(headers) + " |")
    lines.append("|" + "|".join("---" for _ in headers) + "|")
    for row in table.frame.itertuples(index=False):
        lines.append("| " + " | ".join(fmt(v).replace("|", "\\|") for v in row) + " |")
    if table.note:
        lines += ["", f"*{table.note}*"]
    return "\n".join(lines)


def render_markdown(sections: list[Section], base: Path | None = None) -> str:
    parts = ["# icml report", ""]
    for section in sections:
        parts += [f"## {section.title}", ""]
        parts += ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in section.facts()] + [""]
        if section.smoke:
            parts += [f"> ⚠ {SMOKE_NOTE}", ""]
        if section.frame.empty:
            parts += ["*no results recorded yet*", ""]
        for table in section.tables:
            parts += [_md_table(table), ""]
        for title, path in section.plots:
            ref = os.path.relpath(path, base) if base else str(path)
            parts += [f"![{title}]({ref})", ""]
    return "\n".join(parts)


# html ----------------------------------------------------------------------------------------
CSS = """body{font-family:system-ui,-apple-system,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}th,td{border:1px solid #ccc;padding:.25em .6em;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}caption{text-align:left;font-weight:600;padding:.3em 0}
.smoke{background:#fff4d6;border:1px solid #e0b000;padding:.5em 1em}.facts td{text-align:left}
figure{margin:1em 0}figcaption{font-weight:600}img{max-width:100%}.note{color:#666;font-style:italic}
.scroll{overflow-x:auto;max-width:100%}.scroll table{margin-top:0}.scroll td{white-space:nowrap}.scroll td:first-child{white-space:normal;min-width:12em;max-width:26em}nav ol{columns:2;padding-left:1.5em}
nav li{margin:.1em 0}h2,h3{scroll-margin-top:.5em}a.top{font-size:.8em;font-weight:400;margin-left:.5em}"""


def _html_table(table: Table, anchor: str) -> str:
    """A table in a horizontally scrolling box: a wide table scrolls inside the page, never off its edge."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in table.headers())
    body = "".join("<tr>" + "".join(f"<td>{html.escape(fmt(v))}</td>" for v in row) + "</tr>"
                   for row in table.frame.itertuples(index=False))
    note = f"<p class='note'>{html.escape(table.note)}</p>" if table.note else ""
    return (f"<h3 id='{anchor}'>{html.escape(table.title)}</h3><div class='scroll'><table>"
            f"<tr>{head}</tr>{body}</table></div>{note}")


def _anchors(sections: list[Section]) -> list[tuple[str, list[str], list[str]]]:
    """Unique ids per section and for each of its tables and plots (titles repeat across sections)."""
    seen: dict[str, int] = {}

    def unique(text: str) -> str:
        base = _slug(text)
        seen[base] = seen.get(base, 0) + 1
        return base if seen[base] == 1 else f"{base}_{seen[base]}"

    out = []
    for section in sections:
        own = unique(section.title)
        out.append((own, [unique(f"{own} {t.title}") for t in section.tables],
                    [unique(f"{own} {title}") for title, _ in section.plots]))
    return out


def render_html(sections: list[Section]) -> str:
    """One self-contained page: a contents list of the runs (or groups) it holds, each linking to its
    section, tables and plots; then the sections."""
    anchors = _anchors(sections)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>icml report</title>"
             f"<style>{CSS}</style></head><body><h1 id='top'>icml report</h1>"]
    if len(sections) > 1:
        parts.append(f"<nav><p>{len(sections)} sections:</p><ol>")
        for section, (own, tables, plots) in zip(sections, anchors):
            parts.append(f"<li><a href='#{own}'>{html.escape(section.title)}</a> — {len(tables)} tables, "
                         f"{len(plots)} plots{' (smoke)' if section.smoke else ''}</li>")
        parts.append("</ol></nav>")
    for section, (own, tables, plots) in zip(sections, anchors):
        parts.append(f"<h2 id='{own}'>{html.escape(section.title)}<a class='top' href='#top'>↑ contents</a></h2>")
        links = [f"<a href='#{a}'>{html.escape(t.title)}</a>" for a, t in zip(tables, section.tables)]
        links += [f"<a href='#{a}'>{html.escape(title)}</a>" for a, (title, _) in zip(plots, section.plots)]
        if links:
            parts.append(f"<p class='note'>in this section: {' · '.join(links)}</p>")
        parts.append("<table class='facts'>")
        parts += [f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in section.facts()]
        parts.append("</table>")
        if section.smoke:
            parts.append(f"<p class='smoke'>⚠ {html.escape(SMOKE_NOTE)}</p>")
        if section.frame.empty:
            parts.append("<p class='note'>no results recorded yet</p>")
        parts += [_html_table(t, a) for t, a in zip(section.tables, tables)]
        for (title, path), anchor in zip(section.plots, plots):
            data = base64.b64encode(path.read_bytes()).decode()
            parts.append(f"<figure id='{anchor}'><figcaption>{html.escape(title)}</figcaption>"
                         f"<img alt='{html.escape(title)}' src='data:image/png;base64,{data}'></figure>")
    parts.append("</body></html>")
    return "\n".join(parts)


# data formats --------------------------------------------------------------------------------
def render_csv(sections: list[Section]) -> str:
    frames = [s.frame for s in sections if not s.frame.empty]
    frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    buffer = io.StringIO()
    frame.to_csv(buffer, index=False)
    return buffer.getvalue()


def render_json(sections: list[Section]) -> str:
    doc = {"runs": [{
        "run_dir": str(s.run.path), "run_id": s.info["run_id"], "method": s.info["method"],
        "preset": s.info.get("preset"), "status": s.info.get("status"), "smoke": s.smoke,
        "headline": s.headline,
        "tables": [{"title": t.title, "columns": [str(c) for c in t.frame.columns], "better": t.better,
                    "rows": [[fmt(v) for v in row] for row in t.frame.itertuples(index=False)]}
                   for t in s.tables],
        "plots": [{"title": title, "path": str(path)} for title, path in s.plots],
    } for s in sections]}
    return json.dumps(doc, default=str)  # one line: one JSON object for pipelines


def write_run_report(section: Section) -> None:
    """report/report.md and report/report.html inside the run directory."""
    section.run.report_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(section.run.report_dir / "report.md",
                      render_markdown([section], base=section.run.report_dir))
    atomic_write_text(section.run.report_dir / "report.html", render_html([section]))


def render(sections: list[Section], fmt_name: str, out: Path | None) -> str | None:
    """Render to `out` (or return the text for stdout); terminal renders to stderr."""
    for section in sections:
        if not section.frame.empty:
            write_run_report(section)
    if fmt_name == "terminal":
        render_terminal(sections)
        return None
    if fmt_name == "markdown":
        text = render_markdown(sections, base=out.parent.resolve() if out else None)
    elif fmt_name == "html":
        text = render_html(sections)
    elif fmt_name == "csv":
        text = render_csv(sections)
    else:
        text = render_json(sections)
    if out is not None:
        atomic_write_text(out, text)
        return None
    return text
