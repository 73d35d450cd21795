"""Leaderboard plots (matplotlib, the optional ``plots`` extra): accuracy vs severity per
method, and accuracy vs time per sample with the Pareto front. Files are deterministic:
fixed size and dpi, no ``Software`` metadata, no timestamps, so regenerating from the same
results gives identical bytes on the same matplotlib version.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tta_bench import stats

DPI = 100
SIZE = (6.4, 4.0)  # inches


def available() -> bool:
    """True when matplotlib is installed (``pip install tta-bench[plots]``)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _figure() -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=SIZE, dpi=DPI)
    FigureCanvasAgg(fig)  # a private canvas: no pyplot state, no GUI backend
    return fig


def _save(fig: Any, path: Path) -> None:
    from tta_bench.paths import atomic_path

    fig.tight_layout()
    with atomic_path(path) as tmp:  # never a half-written PNG under the final name
        fig.savefig(tmp, dpi=DPI, format="png", metadata={"Software": None})


def accuracy_vs_severity(
    records: Sequence[dict[str, Any]], labels: Sequence[str], path: str | Path
) -> Path:
    """Per method: mean accuracy over shifts at each severity (percent), with the 95% CI
    over seeds as error bars."""
    fig = _figure()
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
    ax.set_ylabel("accuracy (%)")
    ax.set_title("accuracy vs severity (mean over shifts, 95% CI over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    out = Path(path)
    _save(fig, out)
    return out


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


def accuracy_vs_time(
    records: Sequence[dict[str, Any]], labels: Sequence[str], path: str | Path
) -> Path:
    """Accuracy (percent, mean over seeds, 95% CI bars) against total time per sample (ms;
    log scale when the times span more than a decade); the Pareto front is a step line."""
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    points: list[tuple[float, float]] = []
    for label, rec in zip(labels, records):
        est = stats.suite_estimate(rec, "accuracy")
        times = [
            float(c["time_per_sample_s"])
            for c in rec["cells"]
            if c.get("time_per_sample_s") is not None
        ]
        if est is None or not times:
            continue
        x, y = 1e3 * sum(times) / len(times), 100 * est.mean
        points.append((x, y))
        ax.errorbar([x], [y], yerr=[100 * (est.half_width or 0.0)], marker="o", capsize=3)
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, 5), fontsize="small")
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
        ax.legend(fontsize="small")
    xs = [x for x, _ in points]
    log = bool(xs) and max(xs) > 10 * min(xs)  # a log axis only where times span a decade
    if log:
        ax.set_xscale("log")
    ax.set_xlabel("time per sample (ms, log scale)" if log else "time per sample (ms)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title("accuracy vs cost")
    ax.grid(alpha=0.3, which="both")
    out = Path(path)
    _save(fig, out)
    return out
