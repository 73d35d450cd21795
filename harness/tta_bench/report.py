"""``tta-bench table`` and ``tta-bench leaderboard``: reports rendered from results files only.

``table`` prints the shift-wise table, the suite summary and the cost table of one or more
results files of one protocol. ``leaderboard`` ranks the results of one suite found in a
directory and writes ``leaderboard.md``, ``leaderboard.html`` and (with matplotlib) two PNG
plots next to them. The output is a pure function of the results files: nothing depends on
the current time, file order or the absolute directory, so regenerating it is
byte-identical. Runs of another protocol (or incomplete, duplicate or unreadable files) are
never ranked; each one is listed with the reason.
"""

from __future__ import annotations

import hashlib
import html
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tta_bench import plots, results, stats, tables
from tta_bench.metric_columns import table_columns
from tta_bench.paths import atomic_write_text

LEADERBOARD_MD = "leaderboard.md"
LEADERBOARD_HTML = "leaderboard.html"
PLOT_SEVERITY = "accuracy_vs_severity.png"
PLOT_PARETO = "accuracy_vs_time.png"
SECTION_TITLES = {
    "shift": "Accuracy (%) per shift, mean ± std over seeds",
    "summary": "Suite summary: accuracy mean ± 95% CI over seeds, paired Δ vs baseline",
    "cost": "Cost per sample (measured), mean over cells",
}
#: Leaderboard columns, taken from the summary and cost tables; ``METRICS`` stands for the
#: summary's column of every metric the runs hold (``tta_bench.metric_columns``).
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


#: Numbers for programs (``tta_bench.export``): ``json`` (cells and summary), ``csv`` (the
#: long table, one row per cell), ``csv-summary`` (one row per run, interval bounds as
#: columns). ``csv-formatted`` is the three formatted tables as CSV, as ``csv`` was before.
MACHINE_FORMATS = ("json", "csv", "csv-summary")


def _machine(
    records: list[dict[str, Any]], labels: list[str], fmt: str, baseline: Any, test: str
) -> str:
    from tta_bench import export

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
    from tta_bench import catalog
    from tta_bench.protocol import load_protocol

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


def leaderboard_markdown(
    board: Leaderboard,
    baseline: str | None = tables.REFERENCE,
    test: str = "t",
    images: bool = True,
) -> str:
    headers, rows = leaderboard_rows(board, baseline, test)
    records = [e.record for e in board.entries]
    labels = [e.label for e in board.entries]
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
    if images:
        parts += [
            "## Plots",
            "",
            f"![accuracy vs severity]({PLOT_SEVERITY})",
            "",
            f"![accuracy vs time per sample]({PLOT_PARETO})",
            "",
        ]
    if board.left_out:
        parts += ["## Left out", ""]
        parts += [f"- `{name}`: {reason}" for name, reason in board.left_out]
        parts.append("")
    p_head, p_rows = _provenance_rows(board)
    parts += ["## Provenance", "", tables.render(p_rows, p_head, "github"), ""]
    return "\n".join(parts)


def leaderboard_html(
    board: Leaderboard,
    baseline: str | None = tables.REFERENCE,
    test: str = "t",
    images: bool = True,
) -> str:
    headers, rows = leaderboard_rows(board, baseline, test)
    records = [e.record for e in board.entries]
    labels = [e.label for e in board.entries]
    esc = html.escape
    title = f"Leaderboard: {board.suite}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        f"<title>{esc(title)}</title>",
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
        "td:nth-child(2),th:nth-child(2){text-align:left}</style>",
        "</head>",
        "<body>",
        f"<h1>{esc(title)}</h1>",
    ]
    parts += [f"<p>{esc(n).replace('`', '')}</p>" for n in _notes(board, baseline, test)]
    parts.append(tables.render(rows, headers, "html"))
    if records:
        parts.append("<h2>Accuracy (%) per shift, mean ± std over seeds</h2>")
        parts.append(tables.method_shift_table(records, "html", labels=labels))
    if images:
        parts.append("<h2>Plots</h2>")
        parts.append(f'<p><img src="{PLOT_SEVERITY}" alt="accuracy vs severity"></p>')
        parts.append(f'<p><img src="{PLOT_PARETO}" alt="accuracy vs time per sample"></p>')
    if board.left_out:
        parts.append("<h2>Left out</h2>")
        parts.append("<ul>")
        parts += [f"<li><code>{esc(n)}</code>: {esc(r)}</li>" for n, r in board.left_out]
        parts.append("</ul>")
    p_head, p_rows = _provenance_rows(board)
    parts += ["<h2>Provenance</h2>", tables.render(p_rows, p_head, "html"), "</body>", "</html>"]
    return "\n".join(parts) + "\n"


def write_leaderboard(
    results_dir: str | Path,
    suite: str,
    protocol_id: str | None = None,
    baseline: str | None = tables.REFERENCE,
    test: str = "t",
    with_plots: bool = True,
) -> tuple[Leaderboard, list[Path]]:
    """Write the leaderboard files into ``results_dir``; returns the board (entries and
    what was left out, with reasons) and the paths written."""
    board = collect(results_dir, suite, protocol_id)
    if not board.entries:
        reasons = "; ".join(f"{n}: {r}" for n, r in board.left_out) or "no *.json files"
        raise ValueError(
            f"no complete results of suite {suite!r} under protocol {board.protocol_id} in "
            f"{results_dir} ({reasons})"
        )
    root = Path(results_dir)
    images = with_plots and plots.available()
    written = []
    if images:
        records = [e.record for e in board.entries]
        labels = [e.label for e in board.entries]
        written.append(plots.accuracy_vs_severity(records, labels, root / PLOT_SEVERITY))
        written.append(plots.accuracy_vs_time(records, labels, root / PLOT_PARETO))
    for name, text in (
        (LEADERBOARD_MD, leaderboard_markdown(board, baseline, test, images)),
        (LEADERBOARD_HTML, leaderboard_html(board, baseline, test, images)),
    ):
        path = root / name
        atomic_write_text(path, text)  # a reader sees the old page or the new one, whole
        written.append(path)
    return board, sorted(written)
