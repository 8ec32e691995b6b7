"""What a reader of the HTML report sees of a method's plots, checked in tests: the figures its report hook
draws for a finished run, and the defects a browser shows (empty axes, cramped panels, legends or labels over
data, text too small at the page's width)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

PAGE_PX, DPI = 1100, 110  # the HTML report's page width and the dpi reports/render.py saves plots at


def figures_of(method_name: str, run_dir) -> list:
    """(title, figure) of the method's report hook on a finished run, as `report` draws them."""
    import matplotlib

    matplotlib.use("Agg")
    from icml.cli import registry
    from icml.cli.lifecycle import config_from_run
    from icml.cli.results import metrics_schema, read_metrics
    from icml.cli.runstore import Run

    method, run = registry.get(method_name), Run(Path(run_dir))
    frame = read_metrics(run.metrics_path, metrics_schema(method.tags))
    cfg, _, _ = config_from_run(method, run)
    return method.part("report").plots(frame, cfg, run=run)


def plot_defects(title: str, figure) -> list[str]:
    """What a reader sees as broken at the report's 110 dpi: axes without data, a panel under 60 px, a legend over
    data, texts (titles, labels, notes, point labels) overlapping each other or another panel."""
    from matplotlib.patches import Rectangle

    figure.set_dpi(110)
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    out, texts = [], []
    for ax in figure.axes:
        box = ax.get_window_extent(renderer)
        if hasattr(ax, "_colorbar"):
            continue
        if box.height < 60 or box.width < 60:
            out.append(f"{title}: a panel of {box.width:.0f}×{box.height:.0f} px")
        points, boxes = [], [p.get_window_extent(renderer) for p in ax.patches if isinstance(p, Rectangle)]
        paths = [(line.get_transform(), line.get_xydata()) for line in ax.get_lines()
                 if line.get_transform() == ax.transData]  # not axhline / axvline
        paths += [(p.get_transform(), p.get_path().vertices) for p in ax.patches if not isinstance(p, Rectangle)]
        for transform, xy in paths:  # the vertices and 20 points along every segment
            display = transform.transform(xy[np.isfinite(xy).all(axis=1)])
            points += [display] + [a + (b - a) * t for a, b in zip(display[:-1], display[1:])
                                   for t in np.linspace(0, 1, 20)[:, None]]
        for collection in ax.collections:
            offsets = np.asarray(collection.get_offsets())
            if len(offsets):
                points.append(collection.get_offset_transform().transform(offsets))
        points = np.concatenate([np.atleast_2d(p) for p in points]) if points else np.zeros((0, 2))
        points = points[np.isfinite(points).all(axis=1)]
        points = points[((points >= box.min) & (points <= box.max)).all(axis=1)]  # what the panel shows
        if not len(points) and not boxes and not ax.images:
            out.append(f"{title}: axes {ax.get_title()!r} without data")
        legend = ax.get_legend()
        if legend is not None:
            area = legend.get_window_extent(renderer)
            if area.count_contains(points) or any(area.overlaps(b) for b in boxes if b.width * b.height > 0):
                out.append(f"{title}: the legend of {ax.get_title()!r} covers data")
        own = [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        texts += [(ax, t.get_window_extent(renderer), t.get_text()) for t in own
                  if t.get_visible() and t.get_text().strip() and t.get_rotation() % 90 == 0]
    panels = [(ax, ax.get_window_extent(renderer)) for ax in figure.axes if not hasattr(ax, "_colorbar")]
    for i, (ax, box, text) in enumerate(texts):
        out += [f"{title}: {text!r} overlaps {other!r}" for _, box2, other in texts[i + 1:] if box.overlaps(box2)]
        out += [f"{title}: {text!r} overlaps the panel {p.get_title()!r}" for p, area in panels
                if p is not ax and box.overlaps(area)]
    return out


def shown_texts(figure) -> list[tuple[str, float]]:
    """(text, size in pt as the HTML page shows it) of every text the figure draws: saved as the renderer does
    (tight bbox, 110 dpi), scaled down when wider than the page."""
    import io
    import re

    import matplotlib

    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        figure.savefig(buffer, format="svg", bbox_inches="tight")
    svg = buffer.getvalue()
    width_in = float(re.search(r'<svg[^>]*width="([\d.]+)pt"', svg).group(1)) / 72
    scale = min(1.0, PAGE_PX / (width_in * DPI))
    return [(text.strip(), float(size) * scale) for size, text in re.findall(r"font-size: ([\d.]+)px[^>]*>([^<]*)", svg)]


def overlapping_labels(figure) -> list[tuple[str, str]]:
    """Pairs of drawn titles and axis labels (the suptitle included) whose boxes overlap."""
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    texts = [figure._suptitle] if figure._suptitle is not None else []
    for axis in figure.axes:
        texts += [axis.title, axis._left_title, axis._right_title]
        texts += [axis.xaxis.label, axis.yaxis.label] if axis.axison else []
    texts = [t for t in texts if t.get_visible() and t.get_text().strip()]
    boxes = [t.get_window_extent(renderer) for t in texts]
    return [(a.get_text(), b.get_text()) for i, (a, p) in enumerate(zip(texts, boxes))
            for b, q in zip(texts[i + 1:], boxes[i + 1:])
            if min(p.x1, q.x1) - max(p.x0, q.x0) > 1 and min(p.y1, q.y1) - max(p.y0, q.y0) > 1]
