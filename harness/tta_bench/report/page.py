"""The leaderboard page's content: what ``templates_html/leaderboard.html.j2`` shows, as
text (``_page``: tables as header and cell dicts, each method's provenance links and
preset), the Jinja2 environment that renders it, and the catalogue look-ups behind it
(``family``, ``method_links``). The summary and its notes are the markdown leaderboard's
(``collect.board_summary``, ``collect._notes``): per-sample comparisons, stream orders and
realtime twins where the board has them.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

from tta_bench import catalog
from tta_bench.report import stats, tables, tracks
from tta_bench.report.collect import (
    METRICS,
    RANKING_COLUMNS,
    Leaderboard,
    _config_hash,
    _notes,
    _provenance_rows,
    board_summary,
)
from tta_bench.report.columns import column, table_columns
from tta_bench.report.figures import Figure, _analyse, _Analysis

#: The family of a method whose catalogue entry declares none.
OTHER_FAMILY = "other"
#: The page template, in the package folder ``TEMPLATE_DIR``.
TEMPLATE_DIR = "templates_html"
TEMPLATE = "leaderboard.html.j2"


def family(method: str) -> str:
    """The family a method's catalogue entry declares (``family:``), the leaderboard's
    filter; ``OTHER_FAMILY`` where it declares none."""
    return str(catalog.entry("methods", method).get("family") or OTHER_FAMILY)


def _url(value: Any) -> str | None:
    """A catalogue link the page may point at: http(s) only."""
    text = str(value or "").strip()
    return text if text.startswith(("https://", "http://")) else None


def _short_url(url: str) -> str:
    return url.split("://", 1)[-1].removeprefix("www.").removeprefix("github.com/").rstrip("/")


def method_links(method: str) -> dict[str, str | None]:
    """A method's provenance from its catalogue entry: ``paper``, ``code`` (the official
    repository), ``commit`` (the one its implementation was read at) and ``code_at`` (the
    repository at that commit, for GitHub repositories; else the repository)."""
    meta = catalog.entry("methods", method)
    code = _url(meta.get("official_code"))
    commit = str(meta.get("official_commit") or "").strip() or None
    code_at = code
    if code and commit and code.startswith("https://github.com/"):
        code_at = f"{code.rstrip('/')}/tree/{commit}"
    return {"paper": _url(meta.get("paper")), "code": code, "commit": commit, "code_at": code_at}


_NUMBER = re.compile(r"^(<)?([+-]?\d[\d,]*(?:\.\d+)?)")


def _sort_value(text: str) -> str:
    """The number a cell shows, as its sort key (``<0.001`` sorts below 0.001); empty for
    a cell without one (``-``, ``diverged``), which sorts last."""
    m = _NUMBER.match(str(text).strip())
    if not m:
        return ""
    value = float(m.group(2).replace(",", ""))
    return repr(value / 2 if m.group(1) else value)


def _anchors(labels: list[str]) -> list[str]:
    out: list[str] = []
    for label in labels:
        base = "m-" + (re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-") or "run")
        anchor, n = base, 1
        while anchor in out:
            n += 1
            anchor = f"{base}-{n}"
        out.append(anchor)
    return out


#: What a header means, shown when the pointer rests on it.
HEADER_HELP = {
    "accuracy % (95% CI)": "mean over seeds of the mean over all cells, 95% Student t interval",
    "p": "two-sided p-value of the paired difference",
    "ms/sample": "total time per sample, mean over cells (ms)",
    "data ms": "data wait per sample (ms)",
    "adapt ms": "adaptation per sample: forward + backward + step (ms)",
    "predict ms": "prediction per sample (ms)",
    "peak MB": "peak memory of the heaviest cell (MiB)",
    "fwd/sample": "image-encoder forward passes per sample",
    "bwd/sample": "image-encoder backward passes per sample",
    "q (BH)": "p adjusted by Benjamini-Hochberg over the comparisons with the baseline",
    "tier": "runs of one tier cannot be told apart from its best (McNemar per sample, "
    "Benjamini-Hochberg adjusted)",
    tracks.ORDERS_ACCURACY: "mean over stream orders of the mean over all cells, 95% Student t "
    "interval",
    tracks.ORDERS: "stream orders per cell",
    tracks.ORDER_RANGE: "2.5th to 97.5th percentile of the orders' accuracies",
    tracks.ETA: "Expected Tail Accuracy: the mean accuracy of the worst 10% of orders",
    tracks.REALTIME_ACCURACY: "accuracy of the same run on the compute-matched realtime track, "
    "mean over seeds, 95% Student t interval",
    tracks.ADAPTED: "share of samples the realtime run adapted on, over all its cells",
}
#: What the comparison's headers mean when the board compares per sample.
SAMPLE_HELP = {
    "Δ": "difference to the baseline over the same samples, 95% block bootstrap interval "
    "over stream batches",
    "p": "McNemar's exact test on the samples only one of the two classifies correctly",
}
#: Columns of the page's summary: what a reader decides by; the rest of the cost table is
#: one click away (``PAGE_COST_LEAD``). ``METRICS``: every metric the runs hold.
#: The columns of the tracks (``report.tracks``) and of the per-sample comparisons show only
#: on boards that have them.
PAGE_SUMMARY = (*RANKING_COLUMNS, "peak MB")
#: The page's cost details: these, then every column of the cost table but its first (the
#: run's name, ``tables.cost_rows``).
PAGE_COST_LEAD = ("model", "seeds")


def _pick(
    wanted: Sequence[str], heads: Sequence[list[str]], metric_labels: list[str]
) -> list[tuple[str, int, int]]:
    """``(header, table, column)`` of each wanted column present in ``heads``."""
    out = []
    for col in wanted:
        names = metric_labels if col == METRICS else [col]
        for name in names:
            for t, head in enumerate(heads):
                hits = [i for i, h in enumerate(head) if h == name or (col == "Δ" and h[:1] == "Δ")]
                if hits:
                    out.append((head[hits[0]], t, hits[0]))
                    break
    return out


def _delta_class(cmp: stats.PairedComparison | None) -> str:
    if cmp is None or cmp.ci_low is None or cmp.ci_high is None:
        return ""
    return "better" if cmp.ci_low > 0 else "worse" if cmp.ci_high < 0 else ""


def _cell(
    text: Any, numeric: bool = True, cls: str = "", style: str = "", title: str = ""
) -> dict[str, Any]:
    """A table cell of the page: its text, its sort key, and how it shows."""
    text = str(text)
    sort = _sort_value(text) if numeric else text.lower()
    return {
        "text": text,
        "sort": sort,
        "numeric": numeric,
        "cls": cls,
        "style": style,
        "title": title,
    }


def _shade(value: float | None, limit: float) -> str:
    if value is None:
        return ""
    alpha = min(abs(value) / limit, 1.0) * 0.45
    rgb = "31,111,235" if value > 0 else "207,34,46"
    return f"background-color:rgba({rgb},{alpha:.2f})" if alpha >= 0.01 else ""


def _page(
    board: Leaderboard, baseline: str | None, test: str, figures: list[Figure] | None
) -> dict[str, Any]:
    """Everything the page template shows, as text: tables as header and cell dicts."""
    analysis = _analyse(board, baseline, test)
    records = [e.record for e in board.entries]
    labels = [e.label for e in board.entries]
    anchors = _anchors(labels)
    families = [family(r["method"]) for r in records]
    links = [method_links(r["method"]) for r in records]
    summary, cost = _summary_and_cost(board, links, analysis, baseline, test)
    p_head, p_rows = _provenance_rows(board)
    marks = verified_marks(board)
    entries = [
        {"rank": i + 1, "label": labels[i], "anchor": anchors[i], "family": families[i]}
        | {"verified": marks[i]}  # tta-bench verify's mark, or None
        for i in range(len(records))
    ]
    return {
        "title": f"Leaderboard: {board.suite}",
        "suite": board.suite,
        "protocol_id": board.protocol_id,
        "notes": _notes(board, baseline, test, per_sample=True) + verified_note(marks),  # as md
        "families": sorted(
            Counter(families).items(), key=lambda kv: (kv[0] == OTHER_FAMILY, kv[0].lower())
        ),
        "entries": entries,
        "summary": summary,
        "cost": cost,
        "shift": _shift_table(records, labels, analysis),
        "metric_tables": _metric_tables(records, labels),
        "baseline": analysis.baseline,
        "figures": figures or [],
        "methods": _methods(records, links),
        "runs": {"head": p_head, "rows": p_rows},
        "left_out": board.left_out,
    }


def verified_marks(board: Leaderboard) -> list[dict[str, str] | None]:
    """Each ranked run's mark from its verification report (``tta-bench verify --record``:
    ``<results file>.verify`` beside it, naming the file's digest), None where it has none or
    a stale one (``tta_bench.run.verify_report.verified_mark``)."""
    from tta_bench.run.verify_report import verified_mark

    return [verified_mark(e.path) for e in board.entries]


def verified_note(marks: Sequence[dict[str, str] | None]) -> list[str]:
    """The note that explains the marks, on a board that has one (else none)."""
    if not any(marks):
        return []
    return [
        "✓ k/K beside a method: K cells of its results file were re-run with `tta-bench "
        "verify` and k of them came out identical to the file's (✗: one differed); the "
        "report names the file's digest, so an edited file loses its mark (docs/submitting.md)."
    ]


def _header(name: str, numeric: bool = True, per_sample: bool = False) -> dict[str, Any]:
    """A column header of the page: its label, how it sorts and what it means
    (``per_sample``: the comparison is per sample, ``SAMPLE_HELP``)."""
    help_text = HEADER_HELP.get(name, "")
    if name.startswith("Δ"):
        help_text = "paired difference to the baseline, 95% interval"
    key = "Δ" if name.startswith("Δ") else name
    if per_sample and key in SAMPLE_HELP:
        help_text = SAMPLE_HELP[key]
    return {"label": name, "numeric": numeric, "help": help_text}


def _summary_and_cost(
    board: Leaderboard,
    links: list[dict[str, str | None]],
    analysis: _Analysis,
    baseline: str | None,
    test: str,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The page's summary (``PAGE_SUMMARY``, the model too where the runs have several) and
    its cost details, both picked from the board's summary (``collect.board_summary``, as
    the markdown's) and cost tables."""
    records = [e.record for e in board.entries]
    labels = [e.label for e in board.entries]
    s_head, s_rows = board_summary(board, baseline, test)
    c_head, c_rows = tables.cost_rows(records, labels)
    metric_labels = [c.label for c in table_columns(c for r in records for c in r["cells"])]
    several_models = len({r["model"]["name"] for r in records}) > 1
    summary_cols = _pick(
        (("model",) if several_models else ()) + PAGE_SUMMARY, (s_head, c_head), metric_labels
    )
    cost_cols = _pick((*PAGE_COST_LEAD, *c_head[1:]), (s_head, c_head), metric_labels)
    summary_rows, cost_rows = [], []
    for i in range(len(records)):
        both = (s_rows[i], c_rows[i])
        cells = []
        for name, t, col in summary_cols:
            extra = {"cls": _delta_class(analysis.comparisons[i])} if name[:1] == "Δ" else {}
            cells.append(_cell(both[t][col], name != "model", **extra))
        summary_rows.append({"cells": cells, "links": links[i]})
        cost_rows.append(
            {"cells": [_cell(both[t][col], name != "model") for name, t, col in cost_cols]}
        )
    head = [_header(n, n != "model", analysis.per_sample) for n, _, _ in summary_cols]
    summary = {"head": head, "rows": summary_rows}
    cost = {"head": [_header(n, n != "model") for n, _, _ in cost_cols], "rows": cost_rows}
    return summary, cost


def _shift_table(
    records: list[dict[str, Any]], labels: list[str], analysis: _Analysis
) -> dict[str, Any]:
    """The method x shift accuracy table, each cell shaded by its difference to the
    baseline (the difference in its title)."""
    shift_head, shift_rows = tables.method_shift_rows(records, labels) if records else ([], [])
    deltas = [v for row in analysis.per_shift if row for v in row if v is not None]
    limit = max([1.0, *(abs(v) for v in deltas)])
    rows = []
    for i, row in enumerate(shift_rows):
        diffs = analysis.per_shift[i] or [None] * (len(row) - 1)
        cells = []
        for text, d in zip(row[1:], diffs):
            title = "" if d is None else f"{d:+.1f} vs {analysis.baseline}"
            cells.append(_cell(text, style=_shade(d, limit), title=title))
        rows.append({"cells": cells})
    return {"head": [_header(n) for n in shift_head[1:]], "rows": rows}


def _metric_tables(records: list[dict[str, Any]], labels: list[str]) -> list[dict[str, Any]]:
    """Calibration and open-set metrics per shift, as the markdown has them."""
    out = []
    for name in tables.per_shift_metrics(records):
        m_head, m_rows = tables.method_shift_rows(records, labels, metric=name)
        out.append(
            {
                "id": f"per-shift-{name}",
                "title": per_shift_title(name),
                "head": [_header(n) for n in m_head[1:]],
                "rows": [{"cells": [_cell(text) for text in row[1:]]} for row in m_rows],
            }
        )
    return out


def _methods(
    records: list[dict[str, Any]], links: list[dict[str, str | None]]
) -> list[dict[str, Any]]:
    """Each run's method: its description, provenance links, preset and config."""
    from tta_bench.config import presets

    known_presets = presets()
    methods = []
    for i, rec in enumerate(records):
        preset = rec.get("method_preset")
        found = known_presets.get(preset) if preset else None
        config = rec.get("method_config") or {}
        methods.append(
            {
                "description": catalog.description("methods", rec["method"]),
                "method": rec["method"],
                "links": links[i],
                "code_name": _short_url(links[i]["code"]) if links[i]["code"] else "",
                "paper_name": _short_url(links[i]["paper"]) if links[i]["paper"] else "",
                "preset": preset,
                "preset_description": found.description if found else "",
                "preset_source": f"{found.package}: method/{preset}.yaml" if found else "",
                "config": ", ".join(f"{k}={json.dumps(v)}" for k, v in config.items()),
                "config_hash": rec.get("method_config_hash") or _config_hash(rec),
            }
        )
    return methods


_ENV: list[Any] = []


def _environment() -> Any:
    """The Jinja2 environment of the page templates (``tta_bench/report/templates_html``):
    autoescaped, strict about undefined names."""
    if not _ENV:
        import jinja2

        _ENV.append(
            jinja2.Environment(
                loader=jinja2.PackageLoader("tta_bench.report", TEMPLATE_DIR),
                autoescape=True,
                undefined=jinja2.StrictUndefined,
                trim_blocks=True,
                lstrip_blocks=True,
                keep_trailing_newline=True,
            )
        )
        _ENV[0].filters["code_marks"] = _code_marks
    return _ENV[0]


def _code_marks(text: str) -> Any:
    """Escaped ``text`` with its markdown code spans as ``<code>``."""
    from markupsafe import Markup, escape

    parts = str(escape(text)).split("`")
    return Markup("".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts)))


def per_shift_title(metric: str) -> str:
    """The heading of ``metric``'s method x shift table (markdown and page alike), with
    its binning when the catalogue declares one (``bins``)."""
    bins = catalog.entry("metrics", metric).get("bins")
    how = f"; {bins['count']} equal-width bins {bins['interval']}" if bins else ""
    label = column(metric).label.replace(" %", "")
    return f"{label} (%) per shift, mean ± std over seeds{how}"
