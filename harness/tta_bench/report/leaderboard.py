"""``tta-bench table`` and ``tta-bench leaderboard``: reports rendered from results files only.

``table`` prints the shift-wise table, the suite summary and the cost table of one or more
results files of one protocol. ``leaderboard`` ranks the results of one suite found in a
directory and writes ``leaderboard.md``, ``leaderboard.html`` (a page rendered from the
Jinja2 template ``templates_html/leaderboard.html.j2``: sortable, filterable by method
family, self-contained) and (with matplotlib) the PNG figures that fit the suite next to
them. The output is a pure function of the results files and the installed catalogues
(method families and provenance links): nothing depends on the current time, file order
or the absolute directory, so regenerating it is byte-identical. Runs of another protocol
(or incomplete, duplicate or unreadable files) are never ranked; each one is listed with
the reason. The one exception: a ranked run's realtime twin (the same run on the protocol's
compute-matched track, in the same directory) fills that run's realtime columns; and runs of
many stream orders get the columns of their spread (``report.tracks``).

This module renders and writes; the runs a leaderboard ranks come from ``report.collect``,
its figures from ``report.figures`` and its page's content from ``report.page``.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tta_bench.paths import atomic_write_text
from tta_bench.report import plots, stats, tables
from tta_bench.report.collect import (
    LEADERBOARD_COLUMNS,
    METRICS,
    Entry,
    Leaderboard,
    _labels,
    _notes,
    _provenance_rows,
    collect,
    leaderboard_rows,
)
from tta_bench.report.figures import (
    PLOT_FILES,
    PLOT_FOREST,
    PLOT_HEATMAP,
    PLOT_PARETO,
    PLOT_SEVERITY,
    PLOT_STREAM,
    STREAM_RESETS,
    Figure,
    _analyse,
    _draw,
    _figures,
    leaderboard_figures,
)
from tta_bench.report.page import (
    OTHER_FAMILY,
    TEMPLATE,
    TEMPLATE_DIR,
    _environment,
    _page,
    _sort_value,
    family,
    method_links,
    per_shift_title,
    verified_marks,
    verified_note,
)
from tta_bench.run import results

#: What other code reads from this module; the runs, figures and page live in
#: ``report.collect``, ``report.figures`` and ``report.page``.
__all__ = [
    "LEADERBOARD_COLUMNS",
    "LEADERBOARD_HTML",
    "LEADERBOARD_MD",
    "MACHINE_FORMATS",
    "METRICS",
    "OTHER_FAMILY",
    "PLOT_FILES",
    "PLOT_FOREST",
    "PLOT_HEATMAP",
    "PLOT_PARETO",
    "PLOT_SEVERITY",
    "PLOT_STREAM",
    "SECTION_TITLES",
    "STREAM_RESETS",
    "TEMPLATE",
    "TEMPLATE_DIR",
    "Entry",
    "Figure",
    "Leaderboard",
    "_sort_value",
    "collect",
    "family",
    "leaderboard_figures",
    "leaderboard_html",
    "leaderboard_markdown",
    "leaderboard_rows",
    "load_many",
    "method_links",
    "per_shift_title",
    "render_tables",
    "tables",
    "write_leaderboard",
]

LEADERBOARD_MD = "leaderboard.md"
LEADERBOARD_HTML = "leaderboard.html"
SECTION_TITLES = {
    "shift": "Accuracy (%) per shift, mean ± std over seeds",
    "summary": "Suite summary: accuracy mean ± 95% CI over seeds, paired Δ vs baseline",
    "cost": "Cost per sample (measured), mean over cells",
}


# -- table -----------------------------------------------------------------------------
def load_many(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """Results records in the given order; a file that does not exist or does not parse is
    an error naming it."""
    out = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise ValueError(f"results file {str(path)!r} does not exist")
        try:
            out.append(results.load_results(path))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not a results JSON file ({exc})") from exc
    return out


def _heading(title: str, fmt: str) -> str:
    """``title`` (which holds the suite's name from a results file) as a heading of ``fmt``,
    on one line: a line break in it cannot start a row or a markdown block of its own."""
    title = " ".join(title.splitlines())
    if fmt in ("github", "markdown"):
        return f"### {title}\n"
    if fmt == "html":
        return f"<h3>{html.escape(title)}</h3>\n"
    if fmt == "latex":
        return f"% {title}\n"
    if fmt == "csv":
        return f"# {title}\n"
    return f"{title}\n"


def render_tables(
    paths: Sequence[str | Path],
    fmt: str = "github",
    baseline: str | None = tables.REFERENCE,
    test: str = "t",
    labels: Sequence[str] | None = None,
) -> str:
    """The three tables of ``tta-bench table``: the shift-wise table (shift x severity for
    one file, method x shift for several), the suite summary and the cost table. Files of
    different protocols are refused (``stats.ProtocolMismatchError``). ``labels`` name the
    rows (default: the method, with a config hash where a method appears twice)."""
    formatted = [f for f in tables.FORMATS if f != "csv"] + ["csv-formatted"]
    if fmt not in (*formatted, *MACHINE_FORMATS):
        known = ", ".join((*formatted, *MACHINE_FORMATS))
        raise ValueError(f"unknown table format {fmt!r}; available: {known}")
    records = load_many(paths)
    if not records:
        raise ValueError("no results files given")
    for other in records[1:]:
        stats.check_same_protocol(records[0], other)
    labels = list(labels) if labels is not None else _labels(records)
    if fmt in MACHINE_FORMATS:
        return _machine(records, labels, fmt, baseline, test)
    fmt = "csv" if fmt == "csv-formatted" else fmt
    if len(records) == 1:
        shift = tables.shift_table(records[0], fmt)
    else:
        shift = tables.method_shift_table(records, fmt, labels=labels)
    sections = [
        ("shift", shift),
        ("summary", tables.summary_table(records, fmt, baseline, test, labels=labels)),
        ("cost", tables.cost_table(records, fmt, labels=labels)),
    ]
    proto = records[0]["protocol"]["id"]
    head = _heading(f"{records[0]['suite']} ({proto})", fmt)
    body = "\n\n".join(_heading(SECTION_TITLES[k], fmt) + t for k, t in sections)
    return head + "\n" + body + "\n"


#: Numbers for programs (``tta_bench.report.export``): ``json`` (cells and summary), ``csv`` (the
#: long table, one row per cell), ``csv-summary`` (one row per run, interval bounds as
#: columns). ``csv-formatted`` is the three formatted tables as CSV, as ``csv`` was before.
MACHINE_FORMATS = ("json", "csv", "csv-summary")


def _machine(
    records: list[dict[str, Any]], labels: list[str], fmt: str, baseline: Any, test: str
) -> str:
    from tta_bench.report import export

    if fmt == "json":
        return export.to_json(records, labels, baseline=baseline, test=test)
    if fmt == "csv":
        return export.to_csv(export.long_rows(records, labels))
    return export.to_csv(export.summary_rows(records, labels, baseline, test))


# -- markdown: what results files say is shown as text -----------------------------------
#: A '<' that starts no tag, comment or autolink (``<0.001``, the tables' small p-values).
_TAG_LT = re.compile(r"<(?![0-9.]+(?:[^0-9.@A-Za-z]|$))")


def md_text(value: Any) -> str:
    """``value`` as markdown that renders as its own text: on one line (a line break cannot
    start a block), ``&``, ``<`` and ``>`` as entities (no HTML tag, comment or autolink;
    the ``<`` of ``<0.001`` is kept), ``\\``, ``|`` and backticks escaped (no extra table
    column, no code span) and ``](`` broken (no link, no image). The harness's own cells
    and headings hold none of these, so a leaderboard of ordinary results is byte-identical
    to an unescaped one."""
    text = " ".join(str(value).splitlines()).replace("\\", "\\\\")
    text = _TAG_LT.sub("&lt;", text.replace("&", "&amp;").replace(">", "&gt;"))
    return text.replace("|", "\\|").replace("`", "\\`").replace("](", "]\\(")


def md_code(value: Any) -> str:
    """``value`` as one markdown code span, shown verbatim whatever it holds: its fence is
    one backtick longer than its longest run of backticks (padded with spaces where it
    holds any), and a line break is a space."""
    text = " ".join(str(value).splitlines())
    runs = [len(r) for r in re.findall(r"`+", text)]
    fence = "`" * (max(runs, default=0) + 1)
    pad = " " if runs else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _md_table(rows: Sequence[Sequence[Any]], headers: Sequence[Any]) -> str:
    """A github table of ``md_text`` cells."""
    return tables.render(
        [[md_text(c) for c in row] for row in rows], [md_text(h) for h in headers], "github"
    )


def leaderboard_markdown(
    board: Leaderboard,
    baseline: str | None = tables.REFERENCE,
    test: str = "t",
    images: bool | Sequence[Figure] = True,
) -> str:
    """The leaderboard as markdown: the ranked table (``leaderboard_rows``), the method x
    shift table, the figures (``images``: the figures to show; True: those that fit the
    suite, ``leaderboard_figures``), what was left out and the provenance. Every string
    taken from a results file (method, preset, model, shift, protocol, provenance, file
    names and reasons) renders as text (``md_text``, ``md_code``): no HTML, link or table
    column of its own."""
    headers, rows = leaderboard_rows(board, baseline, test)
    marks = verified_marks(board)  # tta-bench verify's reports: a mark after the method
    for row, mark in zip(rows, marks):
        if mark:
            row[headers.index("method")] += f" {mark['text']}"
    records = [e.record for e in board.entries]
    labels = [e.label for e in board.entries]
    figures = _figure_list(board, baseline, test, images)
    parts = [f"# Leaderboard: {md_text(board.suite)}", ""]
    notes = _notes(board, baseline, test, md_text, md_code, True) + verified_note(marks)
    parts += [f"{n}\n" for n in notes]
    parts += [_md_table(rows, headers), ""]
    if records:
        head, rows = tables.method_shift_rows(records, labels)
        parts += ["## Accuracy (%) per shift, mean ± std over seeds", "", _md_table(rows, head), ""]
        for name in tables.per_shift_metrics(records):
            head, rows = tables.method_shift_rows(records, labels, metric=name)
            parts += [f"## {md_text(per_shift_title(name))}", "", _md_table(rows, head), ""]
    if figures:
        parts += ["## Plots", ""]
        for fig in figures:  # the alt text holds the baseline's name: no bracket ends it
            alt = md_text(fig.title).replace("[", "\\[").replace("]", "\\]")
            parts += [f"![{alt}]({fig.file})", ""]
    if board.left_out:
        parts += ["## Left out", ""]
        parts += [f"- {md_code(name)}: {md_text(reason)}" for name, reason in board.left_out]
        parts.append("")
    p_head, p_rows = _provenance_rows(board)
    parts += ["## Provenance", "", _md_table(p_rows, p_head), ""]
    return "\n".join(parts)


def _figure_list(
    board: Leaderboard, baseline: str | None, test: str, images: bool | Sequence[Figure]
) -> list[Figure]:
    if images is True:
        return leaderboard_figures(board, baseline, test)
    return list(images or [])


def leaderboard_html(
    board: Leaderboard,
    baseline: str | None = tables.REFERENCE,
    test: str = "t",
    images: bool | Sequence[Figure] = True,
) -> str:
    """The leaderboard page: one self-contained HTML file (style and script inline, no
    network at view time; figures as PNG files beside it, by relative path) from the
    template ``templates_html/leaderboard.html.j2``: the summary a reader decides by,
    sortable by any column and filterable by method family, the cost details one click
    away, the figures, the per-shift table scrolling in its own box, and each method's
    provenance (paper, official code at its commit, preset)."""
    figures = _figure_list(board, baseline, test, images)
    page = _page(board, baseline, test, figures)
    return _environment().get_template(TEMPLATE).render(**page)


def write_leaderboard(
    results_dir: str | Path,
    suite: str,
    protocol_id: str | None = None,
    baseline: str | None = tables.REFERENCE,
    test: str = "t",
    with_plots: bool = True,
) -> tuple[Leaderboard, list[Path]]:
    """Write the leaderboard files into ``results_dir``; returns the board (entries and
    what was left out, with reasons) and the paths written. With plots, the figures that
    fit the suite are drawn and any other figure of ``PLOT_FILES`` there (left by an
    earlier leaderboard of another shape) is removed."""
    board = collect(results_dir, suite, protocol_id)
    if not board.entries:
        reasons = "; ".join(f"{n}: {r}" for n, r in board.left_out) or "no *.json files"
        raise ValueError(
            f"no complete results of suite {suite!r} under protocol {board.protocol_id} in "
            f"{results_dir} ({reasons})"
        )
    root = Path(results_dir)
    images = with_plots and plots.available()
    written: list[Path] = []
    figures: list[Figure] = []
    if images:
        analysis = _analyse(board, baseline, test)
        figures = _figures(board, analysis)
        written += _draw(board, analysis, root, figures)
        drawn = {f.file for f in figures}
        for name in PLOT_FILES:
            if name not in drawn and (root / name).is_file():
                (root / name).unlink()
    for name, text in (
        (LEADERBOARD_MD, leaderboard_markdown(board, baseline, test, figures)),
        (LEADERBOARD_HTML, leaderboard_html(board, baseline, test, figures)),
    ):
        path = root / name
        atomic_write_text(path, text)  # a reader sees the old page or the new one, whole
        written.append(path)
    return board, sorted(written)
