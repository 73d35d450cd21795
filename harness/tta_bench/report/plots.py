"""Leaderboard figures (matplotlib, the optional ``plots`` extra): the forest plot of each
run's difference to the baseline with its 95% interval (the headline figure), the method x
shift heatmap of that difference, accuracy against severity (suites of several severities),
accuracy over the stream (stream-ordered suites), and accuracy against time per sample with
the Pareto front. The figures take numbers, not decisions: which of them a leaderboard
draws, and from what, is ``tta_bench.report.leaderboard``'s. Files are deterministic: fixed size and
dpi, no ``Software`` metadata, no timestamps, so regenerating from the same results gives
identical bytes on the same matplotlib version.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tta_bench.report import stats

DPI = 100
SIZE = (6.4, 4.0)  # inches
#: Colours of a difference whose interval lies above zero, below zero, or spans it.
BETTER, WORSE, UNCLEAR = "#1f6feb", "#cf222e", "#6e7781"


def available() -> bool:
    """True when matplotlib is installed (``pip install tta-bench[plots]``)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def literal(text: Any) -> str:
    """``text`` as matplotlib draws it verbatim: every ``$`` escaped, so no part of a name
    taken from a results file (method, preset, shift, baseline) is parsed as mathtext (a
    ``$`` pair would be typeset, a broken one would fail the whole figure)."""
    return str(text).replace("$", r"\$")


def _figure(size: tuple[float, float] = SIZE) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=DPI)
    FigureCanvasAgg(fig)  # a private canvas: no pyplot state, no GUI backend
    return fig


def _save(fig: Any, path: str | Path) -> Path:
    """Write ``fig`` as a PNG at ``path``; returns the path."""
    from tta_bench.paths import atomic_path

    out = Path(path)
    fig.tight_layout()
    with atomic_path(out) as tmp:  # never a half-written PNG under the final name
        fig.savefig(tmp, dpi=DPI, format="png", metadata={"Software": None})
    return out


def _colour(low: float | None, high: float | None) -> str:
    if low is not None and low > 0:
        return BETTER
    if high is not None and high < 0:
        return WORSE
    return UNCLEAR


def forest(
    rows: Sequence[tuple[str, float, float | None, float | None]],
    baseline: str,
    path: str | Path,
) -> Path:
    """One line per run, top to bottom in the given order: its difference to ``baseline``
    (``(label, mean, low, high)`` in percentage points) with the 95% interval as a bar,
    blue where the interval lies above zero, red below, grey where it spans zero; the
    figures are written at the right. Labels and ``baseline`` are drawn literally."""
    rows = [(literal(label), *rest) for label, *rest in rows]
    baseline = literal(baseline)
    n = len(rows)
    fig = _figure((7.2, 1.2 + 0.3 * max(n, 1)))
    ax = fig.add_subplot(1, 1, 1)
    for i, (_label, mean, low, high) in enumerate(rows):
        y = n - 1 - i
        colour = _colour(low, high)
        if low is not None and high is not None:
            ax.plot([low, high], [y, y], color=colour, linewidth=2, solid_capstyle="butt")
        ax.plot([mean], [y], marker="s", markersize=5, color=colour)
        text = f"{mean:+.1f}" + (
            f" [{low:+.1f}, {high:+.1f}]" if low is not None and high is not None else ""
        )
        ax.annotate(
            text,
            xy=(1.0, y),
            xycoords=("axes fraction", "data"),
            xytext=(6, 0),
            textcoords="offset points",
            va="center",
            fontsize=8,
            family="monospace",
        )
    ax.axvline(0.0, color="black", linewidth=0.8)
    ax.set_yticks(range(n), [label for label, *_ in rows][::-1])
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_xlabel(f"accuracy difference to {baseline} (percentage points, 95% CI)")
    ax.set_title(f"Difference to {baseline}", loc="left")
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def delta_heatmap(
    row_labels: Sequence[str],
    column_labels: Sequence[str],
    values: Sequence[Sequence[float | None]],
    baseline: str,
    path: str | Path,
) -> Path:
    """Rows x columns of differences to ``baseline`` (percentage points; None: no value),
    on a diverging scale symmetric around zero, each cell written in it. The last column is
    set off by a line (the mean, where the caller puts it last). Labels are drawn literally."""
    import numpy as np

    row_labels = [literal(r) for r in row_labels]
    column_labels = [literal(c) for c in column_labels]
    baseline = literal(baseline)

    arr = np.array(
        [[np.nan if v is None else float(v) for v in row] for row in values], dtype=float
    ).reshape(len(row_labels), len(column_labels))
    finite = np.abs(arr[np.isfinite(arr)])
    lim = max(1.0, float(finite.max())) if finite.size else 1.0
    fig = _figure((2.2 + 0.55 * len(column_labels), 1.6 + 0.3 * len(row_labels)))
    ax = fig.add_subplot(1, 1, 1)
    image = ax.imshow(arr, cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
    for (r, c), v in np.ndenumerate(arr):
        if math.isfinite(v):
            ax.text(
                c,
                r,
                f"{v:+.1f}",
                ha="center",
                va="center",
                fontsize=6.5,
                color="white" if abs(v) > 0.6 * lim else "black",
            )
    ax.set_xticks(range(len(column_labels)), column_labels)
    _slant(ax)
    ax.set_yticks(range(len(row_labels)), row_labels)
    if len(column_labels) > 1:
        ax.axvline(len(column_labels) - 1.5, color="black", linewidth=1)
    ax.set_title(f"Difference to {baseline} per shift (percentage points)", loc="left")
    fig.colorbar(image, ax=ax, fraction=0.03, pad=0.02)
    return _save(fig, path)


def _slant(ax: Any) -> None:
    """The x tick labels at 45 degrees, each ending under its tick."""
    ax.tick_params(axis="x", labelrotation=45)
    for label in ax.get_xticklabels():
        label.set_horizontalalignment("right")
        label.set_rotation_mode("anchor")


def _save_accuracy_lines(fig: Any, ax: Any, title: str, path: str | Path) -> Path:
    """Finish and write a plot of one accuracy line per run: the y label, ``title``, a grid
    and the legend outside the axes, at the right."""
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title, loc="left")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    return _save(fig, path)


def accuracy_vs_severity(
    records: Sequence[dict[str, Any]], labels: Sequence[str], path: str | Path
) -> Path:
    """Per method: mean accuracy over shifts at each severity (percent), with the 95% CI
    over seeds as error bars; labels are drawn literally."""
    labels = [literal(label) for label in labels]
    fig = _figure((8.0, 4.4))
    ax = fig.add_subplot(1, 1, 1)
    severities: set[int] = set()
    for label, rec in zip(labels, records):
        xs, ys, errs = [], [], []
        for sev in sorted({int(c["severity"]) for c in rec["cells"]}):
            sub = {**rec, "cells": [c for c in rec["cells"] if int(c["severity"]) == sev]}
            est = stats.suite_estimate(sub, "accuracy")
            if est is None:
                continue
            xs.append(sev)
            ys.append(100 * est.mean)
            errs.append(100 * (est.half_width or 0.0))
        severities.update(xs)
        ax.errorbar(xs, ys, yerr=errs, marker="o", capsize=3, label=label)
    ax.set_xticks(sorted(severities))
    ax.set_xlabel("severity")
    return _save_accuracy_lines(
        fig, ax, "Accuracy vs severity (mean over shifts, 95% CI over seeds)", path
    )


def accuracy_over_stream(
    records: Sequence[dict[str, Any]],
    labels: Sequence[str],
    order: Sequence[tuple[str, int]],
    path: str | Path,
    reference: Sequence[bool] = (),
) -> Path:
    """Per method: the accuracy of each (shift, severity) cell (percent, mean over seeds)
    in the stream's order ``order``, one line per run; runs flagged in ``reference`` (the
    frozen model) are drawn dashed in black. Labels and shift names are drawn literally."""
    labels = [literal(label) for label in labels]
    fig = _figure((8.0, 4.4))
    ax = fig.add_subplot(1, 1, 1)
    flags = list(reference) + [False] * (len(records) - len(reference))
    for label, rec, is_ref in zip(labels, records, flags):
        est = stats.cell_estimates(rec, "accuracy")
        xs = [i for i, key in enumerate(order) if key in est]
        ys = [100 * est[order[i]].mean for i in xs]
        style = {"color": "black", "linestyle": "--"} if is_ref else {"marker": "o"}
        ax.plot(xs, ys, markersize=3, linewidth=1.2, label=label, **style)
    several = len({sev for _, sev in order}) > 1
    ticks = [literal(f"{shift} {sev}" if several else shift) for shift, sev in order]
    ax.set_xticks(range(len(order)), ticks, fontsize="small")
    _slant(ax)
    ax.set_xlabel("stream (in order, never reset)")
    return _save_accuracy_lines(fig, ax, "Accuracy over the stream (mean over seeds)", path)


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points ``(time, accuracy)`` no other point beats on both (less or
    equal time and more or equal accuracy, one strictly), sorted by time."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front, best = [], float("-inf")
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


#: The legend entry of the realtime markers (``accuracy_vs_time``).
REALTIME_LEGEND = "realtime track (compute-matched)"


def time_accuracy_points(
    records: Sequence[dict[str, Any]],
) -> list[tuple[int, float, float, float]]:
    """``(index, ms per sample, accuracy %, 95% CI half-width %)`` of each record with an
    accuracy and timed cells, in order: the points of ``accuracy_vs_time``."""
    out = []
    for i, rec in enumerate(records):
        est = stats.suite_estimate(rec, "accuracy")
        times = [
            float(c["time_per_sample_s"])
            for c in rec["cells"]
            if c.get("time_per_sample_s") is not None
        ]
        if est is None or not times:
            continue
        out.append(
            (i, 1e3 * sum(times) / len(times), 100 * est.mean, 100 * (est.half_width or 0.0))
        )
    return out


def accuracy_vs_time(
    records: Sequence[dict[str, Any]],
    labels: Sequence[str],
    path: str | Path,
    realtime: Sequence[float | None] = (),
) -> Path:
    """Accuracy (percent, mean over seeds, 95% CI bars) against total time per sample (ms;
    log scale when the times span more than a decade); the Pareto front is a step line
    through its runs (``pareto_front``), which are labelled in bold. ``realtime``: each
    run's accuracy on the compute-matched track (percent; None: none), a hollow triangle
    at the run's time joined to its point by a dotted line, named in the legend. Labels
    are placed where they overlap no other, and drawn literally."""
    from matplotlib import colormaps

    fig = _figure((7.2, 4.5))
    ax = fig.add_subplot(1, 1, 1)
    colours = colormaps["tab20"].colors
    points: list[tuple[float, float]] = []
    names: list[str] = []
    extra: list[tuple[float, float]] = []  # the realtime markers
    for i, x, y, half in time_accuracy_points(records):
        colour = colours[len(points) % len(colours)]
        ax.errorbar([x], [y], yerr=[half], marker="o", capsize=3, color=colour)
        r = realtime[i] if i < len(realtime) else None
        if r is not None:
            ax.plot([x, x], [y, r], linestyle=":", linewidth=1, color=colour)
            ax.plot([x], [r], marker="v", markerfacecolor="none", color=colour, linestyle="none")
            extra.append((x, r))
        points.append((x, y))
        names.append(literal(labels[i]))
    front = pareto_front(points)
    if len(front) > 1:
        ax.step(
            [points[i][0] for i in front],
            [points[i][1] for i in front],
            where="post",
            linestyle="--",
            color="grey",
            label="Pareto front",
        )
    if extra:  # a legend entry for the markers, of no colour of its own
        ax.plot([], [], "v", markerfacecolor="none", color="grey", label=REALTIME_LEGEND)
    if len(front) > 1 or extra:
        ax.legend(fontsize="small", loc="upper left")
    xs = [x for x, _ in points]
    log = bool(xs) and max(xs) > 10 * min(xs)  # a log axis only where times span a decade
    if log:
        ax.set_xscale("log")
    ax.set_xlabel("time per sample (ms, log scale)" if log else "time per sample (ms)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title("Accuracy vs cost", loc="left")
    ax.grid(alpha=0.3, which="both")
    ax.margins(x=0.1, y=0.08)  # room for the labels of the outermost points
    _place_labels(fig, ax, points, names, set(front), extra)
    return _save(fig, path)


#: Where a point's label may go, in points from the point (tried in this order).
_LABEL_OFFSETS = [(5, 4), (5, -11), (5, 13), (5, -20), (-5, 4), (-5, -11), (-5, 13), (-5, -20)]


def _place_labels(
    fig: Any,
    ax: Any,
    points: list[tuple[float, float]],
    names: list[str],
    bold: set[int],
    others: Sequence[tuple[float, float]] = (),
) -> None:
    """Annotate each point with its name at the first offset of ``_LABEL_OFFSETS`` whose
    box lies inside the axes and overlaps no marker (of ``points`` or the unnamed
    ``others``) and no label placed before (the Pareto front's first, then by accuracy);
    where none is free, the first offset."""
    fig.tight_layout()
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    from matplotlib.transforms import Bbox

    marks = [ax.transData.transform(pt) for pt in [*points, *others]]
    placed: list[Any] = [Bbox.from_extents(x - 4, y - 4, x + 4, y + 4) for x, y in marks]
    order = sorted(range(len(points)), key=lambda i: (i not in bold, -points[i][1], names[i]))
    for i in order:
        chosen = None
        for dx, dy in _LABEL_OFFSETS:
            text = ax.annotate(
                names[i],
                points[i],
                textcoords="offset points",
                xytext=(dx, dy),
                ha="left" if dx > 0 else "right",
                fontsize="small",
                fontweight="bold" if i in bold else "normal",
            )
            box = text.get_window_extent(renderer).expanded(1.05, 1.1)
            inside = frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1)
            if inside and not any(box.overlaps(other) for other in placed):
                chosen = (text, box)
                break
            text.remove()
        if chosen is None:
            dx, dy = _LABEL_OFFSETS[0]
            text = ax.annotate(
                names[i],
                points[i],
                textcoords="offset points",
                xytext=(dx, dy),
                fontsize="small",
                fontweight="bold" if i in bold else "normal",
            )
            chosen = (text, text.get_window_extent(renderer))
        placed.append(chosen[1])
