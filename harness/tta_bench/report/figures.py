"""The leaderboard's figures: which fit a suite (``leaderboard_figures``), what they are
drawn from (``_analyse``: each run's paired comparison with the baseline, per sample where
the markdown compares per sample, and its per-shift differences) and the glue that hands
them to ``tta_bench.report.plots`` (``_draw``), with each run's realtime twin's accuracy
for the accuracy-vs-cost figure.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tta_bench.report import plots, stats, tables
from tta_bench.report.collect import Leaderboard, SampleAnalysis, sample_analysis
from tta_bench.run.protocol import CORRELATED

PLOT_FOREST = "forest.png"
PLOT_HEATMAP = "delta_heatmap.png"
PLOT_SEVERITY = "accuracy_vs_severity.png"
PLOT_STREAM = "accuracy_over_stream.png"
PLOT_PARETO = "accuracy_vs_time.png"
#: Every figure a leaderboard may draw (``leaderboard_figures`` says which fit a suite).
PLOT_FILES = (PLOT_FOREST, PLOT_HEATMAP, PLOT_SEVERITY, PLOT_STREAM, PLOT_PARETO)
#: Reset policies whose cells form one stream in a fixed order: accuracy over the stream
#: (with the class-sorted policies that keep their order, ``run.protocol.CORRELATED``).
STREAM_RESETS = ("continual", "gradual")


@dataclass(frozen=True)
class Figure:
    """One figure of a leaderboard: its PNG next to the pages, its heading and caption."""

    file: str
    title: str
    caption: str
    #: Shown across the page's whole width (the others share rows).
    wide: bool = False


@dataclass
class _Analysis:
    """What the page and the figures read besides the tables: the baseline's label, each
    entry's paired comparison (``per_sample``: the per-sample one of ``sample_analysis``,
    as the markdown shows it), and the per-shift differences (percentage points; rows
    aligned with the entries, columns ``shifts`` then the mean)."""

    baseline: str | None
    comparisons: list[stats.PairedComparison | None]
    shifts: list[str]
    per_shift: list[list[float | None] | None]
    per_sample: bool = False


def _mean_difference(
    record: dict[str, Any], other: dict[str, Any], shift: str | None = None
) -> float | None:
    """``record - other`` in percentage points on the cells both hold (of ``shift`` only,
    when given): per seed the mean over those cells, then the mean over seeds."""
    mine, theirs = stats.cell_values(record), stats.cell_values(other)
    common = [k for k in mine if k in theirs and (shift is None or k[0] == shift)]
    if not common:
        return None
    a = stats.per_seed_means({k: mine[k] for k in common})
    b = stats.per_seed_means({k: theirs[k] for k in common})
    return 100 * statistics.fmean(a[s] - b[s] for s in a)


def _analyse(board: Leaderboard, baseline: str | None, test: str) -> _Analysis:
    records = [e.record for e in board.entries]
    base_rec, label = tables.resolve_baseline(records, baseline)
    shifts = tables.shift_order(records)
    comparisons: list[stats.PairedComparison | None] = []
    per_shift: list[list[float | None] | None] = []
    for rec in records:
        other = None
        if label is not None and not stats.diverged_cells(rec):
            other = tables.pairing_record(rec, base_rec, baseline)
        if other is None:
            comparisons.append(None)
            per_shift.append(None)
            continue
        comparisons.append(stats.paired_comparison(rec, other, test=test))
        row = [_mean_difference(rec, other, s) for s in shifts]
        per_shift.append([*row, _mean_difference(rec, other)])
    samples = sample_analysis(board, baseline)
    if isinstance(samples, SampleAnalysis):  # as the markdown: block bootstrap, McNemar
        return _Analysis(label, list(samples.versus), shifts, per_shift, per_sample=True)
    return _Analysis(label, comparisons, shifts, per_shift)


def _severities(board: Leaderboard) -> list[int]:
    return sorted({int(c["severity"]) for e in board.entries for c in e.record["cells"]})


def _stream_order(board: Leaderboard) -> list[tuple[str, int]]:
    """The (shift, severity) cells in the order a stream-ordered run visits them."""
    records = [e.record for e in board.entries]
    severities = _severities(board)
    return [(shift, sev) for shift in tables.shift_order(records) for sev in severities]


def leaderboard_figures(
    board: Leaderboard, baseline: str | None = tables.REFERENCE, test: str = "t"
) -> list[Figure]:
    """The figures that fit the suite, in page order: the forest plot and the heatmap of
    the difference to the baseline (when there is one to pair with), accuracy against
    severity (only for more than one severity), accuracy over the stream (only for
    stream-ordered suites, ``STREAM_RESETS``) and accuracy against cost."""
    return _figures(board, _analyse(board, baseline, test))


def _figures(board: Leaderboard, analysis: _Analysis) -> list[Figure]:
    if not board.entries:
        return []
    out = []
    label = analysis.baseline
    if label is not None and any(c is not None for c in analysis.comparisons):
        how = (
            "over the same samples of the same streams, in percentage points, with its 95% "
            "block bootstrap interval (whole stream batches resampled)"
            if analysis.per_sample
            else "on the same seeds and cells, in percentage points, with its 95% interval"
        )
        out.append(
            Figure(
                PLOT_FOREST,
                f"Difference to {label}",
                f"Each run's accuracy minus {label}'s {how}: blue where the interval lies "
                "above zero, red below, grey where it spans zero.",
                wide=True,
            )
        )
        out.append(
            Figure(
                PLOT_HEATMAP,
                f"Difference to {label} per shift",
                f"Per shift (mean over severities and seeds), each run's accuracy minus "
                f"{label}'s, in percentage points; the last column is the suite mean.",
                wide=True,
            )
        )
    if len(_severities(board)) > 1:
        out.append(
            Figure(
                PLOT_SEVERITY,
                "Accuracy vs severity",
                "Mean accuracy over shifts at each severity, 95% interval over seeds.",
            )
        )
    reset = board.entries[0].record["protocol"].get("reset")
    if CORRELATED.get(reset, reset) in STREAM_RESETS:
        out.append(
            Figure(
                PLOT_STREAM,
                "Accuracy over the stream",
                "Accuracy of each cell in the order the stream visits them (the model is "
                "never reset), mean over seeds; the frozen reference model dashed.",
            )
        )
    realtime = (
        " Hollow triangles: each run's accuracy on the compute-matched realtime track, "
        "drawn at its run's time per sample and joined to its point by a dotted line."
        if any(board.twins())
        else ""
    )
    out.append(
        Figure(
            PLOT_PARETO,
            "Accuracy vs cost",
            "Accuracy against measured time per sample; the dashed step line is the "
            "Pareto front (no other run is both faster and more accurate)." + realtime,
        )
    )
    return out


def _draw(board: Leaderboard, analysis: _Analysis, root: Path, figures: list[Figure]) -> list[Path]:
    records = [e.record for e in board.entries]
    labels = [e.label for e in board.entries]
    written = []
    for fig in figures:
        path = root / fig.file
        if fig.file == PLOT_FOREST:
            rows = [
                (e.label, 100 * c.mean_difference, _pct(c.ci_low), _pct(c.ci_high))
                for e, c in zip(board.entries, analysis.comparisons)
                if c is not None
            ]
            written.append(plots.forest(rows, str(analysis.baseline), path))
        elif fig.file == PLOT_HEATMAP:
            keep = [i for i, row in enumerate(analysis.per_shift) if row is not None]
            written.append(
                plots.delta_heatmap(
                    [labels[i] for i in keep],
                    [*analysis.shifts, "mean"],
                    [analysis.per_shift[i] or [] for i in keep],
                    str(analysis.baseline),
                    path,
                )
            )
        elif fig.file == PLOT_SEVERITY:
            written.append(plots.accuracy_vs_severity(records, labels, path))
        elif fig.file == PLOT_STREAM:
            flags = [tables.is_reference_run(r) for r in records]
            order = _stream_order(board)
            written.append(plots.accuracy_over_stream(records, labels, order, path, flags))
        elif fig.file == PLOT_PARETO:
            realtime = [_realtime_accuracy(t.record if t else None) for t in board.twins()]
            written.append(plots.accuracy_vs_time(records, labels, path, realtime))
    return written


def _pct(value: float | None) -> float | None:
    return None if value is None else 100 * value


def _realtime_accuracy(twin: dict[str, Any] | None) -> float | None:
    """A realtime twin's suite accuracy in percent (None: no twin, or no accuracy)."""
    est = stats.suite_estimate(twin) if twin is not None else None
    return None if est is None else 100 * est.mean
