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
the reason.
"""

from __future__ import annotations

import hashlib
import html
import json
import re
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tta_bench import catalog
from tta_bench.paths import atomic_write_text
from tta_bench.report import plots, stats, tables
from tta_bench.report.columns import column, table_columns
from tta_bench.run import results

LEADERBOARD_MD = "leaderboard.md"
LEADERBOARD_HTML = "leaderboard.html"
PLOT_FOREST = "forest.png"
PLOT_HEATMAP = "delta_heatmap.png"
PLOT_SEVERITY = "accuracy_vs_severity.png"
PLOT_STREAM = "accuracy_over_stream.png"
PLOT_PARETO = "accuracy_vs_time.png"
#: Every figure a leaderboard may draw (``leaderboard_figures`` says which fit a suite).
PLOT_FILES = (PLOT_FOREST, PLOT_HEATMAP, PLOT_SEVERITY, PLOT_STREAM, PLOT_PARETO)
#: Reset policies whose cells form one stream in a fixed order: accuracy over the stream.
STREAM_RESETS = ("continual", "gradual")
#: The family of a method whose catalogue entry declares none.
OTHER_FAMILY = "other"
#: The page template, in the package folder ``TEMPLATE_DIR``.
TEMPLATE_DIR = "templates_html"
TEMPLATE = "leaderboard.html.j2"
SECTION_TITLES = {
    "shift": "Accuracy (%) per shift, mean ± std over seeds",
    "summary": "Suite summary: accuracy mean ± 95% CI over seeds, paired Δ vs baseline",
    "cost": "Cost per sample (measured), mean over cells",
}
#: Leaderboard columns, taken from the summary and cost tables; ``METRICS`` stands for the
#: summary's column of every metric the runs hold (``tta_bench.report.columns``).
METRICS = "<metrics>"
LEADERBOARD_COLUMNS = (
    "method",
    "model",
    "seeds",
    "accuracy % (95% CI)",
    "Δ",
    "p",
    METRICS,
    "ms/sample",
    "data ms",
    "adapt ms",
    "predict ms",
    "peak MB",
    "trainable params",
    "fwd/sample",
    "bwd/sample",
)


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


# -- leaderboard -----------------------------------------------------------------------
@dataclass
class Entry:
    """One ranked run."""

    path: Path
    record: dict[str, Any]
    label: str = ""

    @property
    def key(self) -> tuple[str, str, str]:
        r = self.record
        model = json.dumps([r["model"]["name"], r["model"].get("args")], sort_keys=True)
        return r["method"], model, _config_hash(r)


@dataclass
class Leaderboard:
    suite: str
    protocol_id: str
    entries: list[Entry] = field(default_factory=list)
    left_out: list[tuple[str, str]] = field(default_factory=list)  # (file name, reason)


def _config_hash(record: dict[str, Any]) -> str:
    blob = json.dumps(record.get("method_config") or {}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:6]


def _labels(records: Sequence[dict[str, Any]]) -> list[str]:
    """Method names; ``method [cfg abc123]`` where one method appears with several
    configurations."""
    configs: dict[str, set[str]] = {}
    for r in records:
        configs.setdefault(_name(r), set()).add(_config_hash(r))
    return [
        f"{_name(r)} [cfg {_config_hash(r)}]" if len(configs[_name(r)]) > 1 else _name(r)
        for r in records
    ]


def _name(record: dict[str, Any]) -> str:
    """A run's name: its preset (``method=<preset>``) when it came from one, else its method."""
    return record.get("method_preset") or record["method"]


def _expected_protocol(suite: str, candidates: list[tuple[Path, dict[str, Any]]]) -> str:
    """The suite's protocol id from the catalogue; for a suite no installed catalogue
    defines, the id most files share (ties: the smallest id)."""
    from tta_bench.run.protocol import load_protocol

    if suite in catalog.catalog()["suites"]:
        return load_protocol(suite).id
    counts = Counter(r["protocol"]["id"] for _, r in candidates)
    if not counts:
        raise ValueError(f"no results of suite {suite!r} to rank")
    return min(counts, key=lambda pid: (-counts[pid], pid))


def collect(results_dir: str | Path, suite: str, protocol_id: str | None = None) -> Leaderboard:
    """Read every ``*.json`` in ``results_dir`` (not recursive, sorted by name) and keep
    the complete runs of ``suite`` under one protocol (``protocol_id``, default: the
    suite's current one), one per (method, model, method config): the one with most cells,
    then the last file name. Ranked by mean accuracy, then label."""
    root = Path(results_dir)
    if not root.is_dir():
        raise ValueError(f"results directory {str(root)!r} does not exist")
    left_out: list[tuple[str, str]] = []
    candidates: list[tuple[Path, dict[str, Any]]] = []
    for path in sorted(root.glob("*.json")):
        try:
            record = results.load_results(path)
        except (ValueError, OSError) as exc:
            reason = str(exc).removeprefix(f"{path}: ")  # the file is named already
            left_out.append((path.name, f"unreadable: {reason}"))
            continue
        if record.get("suite") != suite:
            left_out.append((path.name, f"suite {record.get('suite')!r}, not {suite!r}"))
            continue
        if record.get("shard"):  # part of every cell, never a cell (tta_bench.run.shard)
            part = record["shard"]
            left_out.append(
                (
                    path.name,
                    f"shard part {part['index']}/{part['count']}: combine the parts with "
                    "tta-bench merge",
                )
            )
            continue
        candidates.append((path, record))
    expected = protocol_id or _expected_protocol(suite, candidates)
    complete: list[Entry] = []
    for path, record in candidates:
        proto = record["protocol"]
        if proto["id"] != expected:
            left_out.append(
                (path.name, f"protocol {proto['id']} differs from the ranked {expected}")
            )
            continue
        n_expected = len(proto["shifts"]) * len(proto["severities"]) * len(record["seeds"])
        if len(record["cells"]) < n_expected:
            left_out.append(
                (path.name, f"incomplete: {len(record['cells'])} of {n_expected} cells")
            )
            continue
        bad = stats.diverged_cells(record)
        if bad:
            c = bad[0]
            left_out.append(
                (
                    path.name,
                    f"diverged in {len(bad)} cell(s), not ranked (first: {c['shift']} sev "
                    f"{c['severity']} seed {c['seed']}, batch {c['diverged']['batch']}: "
                    f"{c['diverged']['reason']})",
                )
            )
            continue
        complete.append(Entry(path, record))
    # Results of other model weights are another model: never ranked together.
    hashes = Counter(stats.model_hash(e.record) for e in complete)
    if len(hashes) > 1:
        ranked = min(hashes, key=lambda h: (-hashes[h], str(h)))
        for e in [e for e in complete if stats.model_hash(e.record) != ranked]:
            left_out.append(
                (
                    e.path.name,
                    f"model weights {str(stats.model_hash(e.record))[:12]} differ from the "
                    f"ranked {str(ranked)[:12]} (another model: rank it separately)",
                )
            )
        complete = [e for e in complete if stats.model_hash(e.record) == ranked]
    chosen: dict[tuple[str, str, str], Entry] = {}
    for entry in complete:  # sorted by name: on equal cells the later file wins
        best = chosen.get(entry.key)
        if best is None or len(entry.record["cells"]) >= len(best.record["cells"]):
            if best is not None:
                left_out.append((best.path.name, f"superseded by {entry.path.name}"))
            chosen[entry.key] = entry
        else:
            left_out.append((entry.path.name, f"superseded by {best.path.name}"))
    entries = list(chosen.values())
    for entry, label in zip(entries, _labels([e.record for e in entries])):
        entry.label = label

    def score(e: Entry) -> float:
        est = stats.suite_estimate(e.record, "accuracy")
        return est.mean if est is not None else float("-inf")

    entries.sort(key=lambda e: (-score(e), e.label, e.record["model"]["name"]))
    return Leaderboard(suite, expected, entries, sorted(left_out))


def leaderboard_rows(
    board: Leaderboard, baseline: str | None = tables.REFERENCE, test: str = "t"
) -> tuple[list[str], list[list[Any]]]:
    """The ranked table: ``rank`` and ``LEADERBOARD_COLUMNS`` (Δ named after the
    baseline)."""
    records = [e.record for e in board.entries]
    labels = [e.label for e in board.entries]
    s_head, s_rows = tables.summary_rows(records, labels, baseline, test)
    c_head, c_rows = tables.cost_rows(records, labels)
    headers = ["rank"]
    picks: list[tuple[int, int]] = []  # (table, column)
    metric_labels = [c.label for c in table_columns(c for r in records for c in r["cells"])]
    for col in LEADERBOARD_COLUMNS:
        if col == METRICS:
            for label in metric_labels:
                headers.append(label)
                picks.append((0, s_head.index(label)))
        elif col == "Δ":
            matches = [i for i, h in enumerate(s_head) if h.startswith("Δ")]
            if matches:
                headers.append(s_head[matches[0]])
                picks.append((0, matches[0]))
        elif col in s_head:
            headers.append(col)
            picks.append((0, s_head.index(col)))
        elif col in c_head:
            headers.append(col)
            picks.append((1, c_head.index(col)))
    rows = []
    for rank, (srow, crow) in enumerate(zip(s_rows, c_rows), start=1):
        both = (srow, crow)
        rows.append([str(rank), *[both[t][c] for t, c in picks]])
    return headers, rows


def _protocol_line(proto: dict[str, Any]) -> str:
    return (
        f"dataset {proto.get('dataset')}, shifts {', '.join(proto.get('shifts') or [])}, "
        f"severities {', '.join(str(s) for s in proto.get('severities') or [])}, "
        f"batch size {proto.get('batch_size')}, reset {proto.get('reset')}, "
        f"images {proto.get('max_images') or 'all'}"
    )


def _provenance_rows(board: Leaderboard) -> tuple[list[str], list[list[str]]]:
    headers = ["file", "method", "git sha", "tta-bench", "torch", "device", "created"]
    rows = []
    for e in board.entries:
        prov = e.record.get("provenance") or {}
        packages = prov.get("packages") or {}
        device = prov.get("device") or {}
        rows.append(
            [
                e.path.name,
                e.label,
                str(prov.get("git_sha") or "unknown"),
                str(packages.get("tta-bench") or "unknown"),
                str(prov.get("torch") or packages.get("torch") or "unknown"),
                f"{device.get('type', '?')} ({device.get('name', '?')})",
                str(e.record.get("created", "unknown")),
            ]
        )
    return headers, rows


def _notes(board: Leaderboard, baseline: str | None, test: str) -> list[str]:
    proto = board.entries[0].record["protocol"] if board.entries else {}
    test_name = "paired t" if test == "t" else "paired bootstrap (10,000 resamples)"
    notes = [
        f"Protocol `{board.protocol_id}`: {_protocol_line(proto)}." if proto else "",
        "Accuracy: per seed the mean over all shift x severity cells, then the mean and the "
        "95% confidence interval (Student t) over seeds.",
        "Cost: measured during the runs (ms per sample split into data wait, adaptation = "
        "forward + backward + step, and prediction; peak memory of the heaviest cell; image "
        "encoder passes per sample).",
    ]
    _, label = tables.resolve_baseline([e.record for e in board.entries], baseline)
    if label is not None:
        note = (
            f"Δ: difference to {label} on the same seeds and cells, {test_name} interval and "
            "two-sided p-value."
        )
        if label != tables.baseline_name(baseline):
            note += f" {label}: the frozen source model each run scored on its identical stream."
        notes.insert(2, note)
    return [n for n in notes if n]


# -- the page: figures, families, provenance links ---------------------------------------
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
    entry's paired comparison, and the per-shift differences (percentage points; rows
    aligned with the entries, columns ``shifts`` then the mean)."""

    baseline: str | None
    comparisons: list[stats.PairedComparison | None]
    shifts: list[str]
    per_shift: list[list[float | None] | None]


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
        out.append(
            Figure(
                PLOT_FOREST,
                f"Difference to {label}",
                f"Each run's accuracy minus {label}'s on the same seeds and cells, in "
                "percentage points, with its 95% interval: blue where the interval lies "
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
    if board.entries[0].record["protocol"].get("reset") in STREAM_RESETS:
        out.append(
            Figure(
                PLOT_STREAM,
                "Accuracy over the stream",
                "Accuracy of each cell in the order the stream visits them (the model is "
                "never reset), mean over seeds; the frozen reference model dashed.",
            )
        )
    out.append(
        Figure(
            PLOT_PARETO,
            "Accuracy vs cost",
            "Accuracy against measured time per sample; the dashed step line is the "
            "Pareto front (no other run is both faster and more accurate).",
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
            written.append(plots.accuracy_vs_time(records, labels, path))
    return written


def _pct(value: float | None) -> float | None:
    return None if value is None else 100 * value


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
}
#: Columns of the page's summary: what a reader decides by; the rest of the cost table is
#: one click away (``PAGE_COST``). ``METRICS``: every metric the runs hold.
PAGE_SUMMARY = ("accuracy % (95% CI)", "Δ", "p", METRICS, "ms/sample", "peak MB")
PAGE_COST = (
    "model",
    "seeds",
    "ms/sample",
    "data ms",
    "adapt ms",
    "predict ms",
    "samples/s",
    "peak MB",
    "trainable params",
    "total params",
    "fwd/sample",
    "bwd/sample",
    "GFLOPs/sample",
)


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
    from tta_bench.config import presets

    analysis = _analyse(board, baseline, test)
    records = [e.record for e in board.entries]
    labels = [e.label for e in board.entries]
    anchors = _anchors(labels)
    families = [family(r["method"]) for r in records]
    s_head, s_rows = tables.summary_rows(records, labels, baseline, test)
    c_head, c_rows = tables.cost_rows(records, labels)
    metric_labels = [c.label for c in table_columns(c for r in records for c in r["cells"])]
    several_models = len({r["model"]["name"] for r in records}) > 1
    summary_cols = _pick(
        (("model",) if several_models else ()) + PAGE_SUMMARY, (s_head, c_head), metric_labels
    )
    cost_cols = _pick(PAGE_COST, (s_head, c_head), metric_labels)

    def head(name: str, numeric: bool = True) -> dict[str, Any]:
        help_text = HEADER_HELP.get(name, "")
        if name.startswith("Δ"):
            help_text = "paired difference to the baseline, 95% interval"
        return {"label": name, "numeric": numeric, "help": help_text}

    links = [method_links(r["method"]) for r in records]
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
    shift_head, shift_rows = tables.method_shift_rows(records, labels) if records else ([], [])
    deltas = [v for row in analysis.per_shift if row for v in row if v is not None]
    limit = max([1.0, *(abs(v) for v in deltas)])
    shift_table = []
    for i, row in enumerate(shift_rows):
        diffs = analysis.per_shift[i] or [None] * (len(row) - 1)
        cells = []
        for text, d in zip(row[1:], diffs):
            title = "" if d is None else f"{d:+.1f} vs {analysis.baseline}"
            cells.append(_cell(text, style=_shade(d, limit), title=title))
        shift_table.append({"cells": cells})
    metric_tables = []  # calibration and open-set metrics per shift, as the markdown has them
    for name in tables.per_shift_metrics(records):
        m_head, m_rows = tables.method_shift_rows(records, labels, metric=name)
        metric_tables.append(
            {
                "id": f"per-shift-{name}",
                "title": per_shift_title(name),
                "head": [head(n) for n in m_head[1:]],
                "rows": [{"cells": [_cell(text) for text in row[1:]]} for row in m_rows],
            }
        )
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
    p_head, p_rows = _provenance_rows(board)
    entries = [
        {"rank": i + 1, "label": labels[i], "anchor": anchors[i], "family": families[i]}
        for i in range(len(records))
    ]
    return {
        "title": f"Leaderboard: {board.suite}",
        "suite": board.suite,
        "protocol_id": board.protocol_id,
        "notes": _notes(board, baseline, test),
        "families": sorted(
            Counter(families).items(), key=lambda kv: (kv[0] == OTHER_FAMILY, kv[0].lower())
        ),
        "entries": entries,
        "summary": {
            "head": [head(n, n != "model") for n, _, _ in summary_cols],
            "rows": summary_rows,
        },
        "cost": {"head": [head(n, n != "model") for n, _, _ in cost_cols], "rows": cost_rows},
        "shift": {"head": [head(n) for n in shift_head[1:]], "rows": shift_table},
        "metric_tables": metric_tables,
        "baseline": analysis.baseline,
        "figures": figures or [],
        "methods": methods,
        "runs": {"head": p_head, "rows": p_rows},
        "left_out": board.left_out,
    }


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


def leaderboard_markdown(
    board: Leaderboard,
    baseline: str | None = tables.REFERENCE,
    test: str = "t",
    images: bool | Sequence[Figure] = True,
) -> str:
    """The leaderboard as markdown: the ranked table (``leaderboard_rows``), the method x
    shift table, the figures (``images``: the figures to show; True: those that fit the
    suite, ``leaderboard_figures``), what was left out and the provenance."""
    headers, rows = leaderboard_rows(board, baseline, test)
    records = [e.record for e in board.entries]
    labels = [e.label for e in board.entries]
    figures = _figure_list(board, baseline, test, images)
    parts = [f"# Leaderboard: {board.suite}", ""]
    parts += [f"{n}\n" for n in _notes(board, baseline, test)]
    parts += [tables.render(rows, headers, "github"), ""]
    if records:
        parts += [
            "## Accuracy (%) per shift, mean ± std over seeds",
            "",
            tables.method_shift_table(records, "github", labels=labels),
            "",
        ]
        for name in tables.per_shift_metrics(records):
            head, rows = tables.method_shift_rows(records, labels, metric=name)
            parts += [
                f"## {per_shift_title(name)}",
                "",
                tables.render(rows, head, "github"),
                "",
            ]
    if figures:
        parts += ["## Plots", ""]
        for fig in figures:
            parts += [f"![{fig.title}]({fig.file})", ""]
    if board.left_out:
        parts += ["## Left out", ""]
        parts += [f"- `{name}`: {reason}" for name, reason in board.left_out]
        parts.append("")
    p_head, p_rows = _provenance_rows(board)
    parts += ["## Provenance", "", tables.render(p_rows, p_head, "github"), ""]
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
