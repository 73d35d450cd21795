"""The leaderboard's runs: ``collect`` reads the results files of one suite in a directory,
keeps one complete run per (method, model, method config) under one protocol and ranks them
(a ``Leaderboard``, with every file left out and why); ``leaderboard_rows`` is its ranked
table, ``_notes`` and ``_provenance_rows`` what the markdown and the page say around it.

The realtime twins of the ranked runs (the same runs under the protocol's compute-matched
track, ``report.tracks``) are read from the same directory: never ranked, each fills its
run's realtime columns. The per-sample comparisons live in ``report.per_sample``.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tta_bench import catalog
from tta_bench.report import stats, tables, tracks
from tta_bench.report.columns import table_columns
from tta_bench.report.per_sample import (  # ``collect.sample_analysis`` as before
    SampleAnalysis,
    _sample_columns,
    _sample_notes,
    sample_analysis,
)
from tta_bench.run import results
from tta_bench.run.samples import method_label

#: Leaderboard columns, taken from the summary and cost tables; ``METRICS`` stands for the
#: summary's column of every metric the runs hold (``tta_bench.report.columns``). The
#: columns of the tracks (``report.tracks``) show only on boards that have them.
METRICS = "<metrics>"
#: The columns a reader ranks by, from the accuracy to the time per sample: the
#: leaderboard's and the page's summary's (``report.page.PAGE_SUMMARY``) shared run.
RANKING_COLUMNS = (
    tracks.ACCURACY,
    tracks.ORDERS_ACCURACY,
    *tracks.ORDERS_COLUMNS,
    "Δ",
    "p",
    "q (BH)",
    "tier",
    *tracks.REALTIME_COLUMNS,
    METRICS,
    "ms/sample",
)
LEADERBOARD_COLUMNS = (
    "method",
    "model",
    "seeds",
    *RANKING_COLUMNS,
    "data ms",
    "adapt ms",
    "predict ms",
    "peak MB",
    "trainable params",
    "fwd/sample",
    "bwd/sample",
)


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
    #: ``sample_analysis`` per baseline, computed once per board
    analyses: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)
    #: The realtime twin of a ranked run (``report.tracks``), by the ranked run's file.
    realtime: dict[Path, Entry] = field(default_factory=dict)

    def twins(self) -> list[Entry | None]:
        """Each ranked run's realtime twin (None: it has none), in rank order."""
        return [self.realtime.get(e.path) for e in self.entries]


def _config_hash(record: dict[str, Any]) -> str:
    blob = json.dumps(record.get("method_config") or {}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:6]


def _labels(records: Sequence[dict[str, Any]]) -> list[str]:
    """Method names; ``method [cfg abc123]`` where one method appears with several
    configurations."""
    configs: dict[str, set[str]] = {}
    for r in records:
        configs.setdefault(method_label(r), set()).add(_config_hash(r))
    return [
        f"{method_label(r)} [cfg {_config_hash(r)}]"
        if len(configs[method_label(r)]) > 1
        else method_label(r)
        for r in records
    ]


def _expected_protocol(suite: str, candidates: list[tuple[Path, dict[str, Any]]]) -> str:
    """The suite's protocol id from the catalogue; for a suite no installed catalogue
    defines, the id most files share (ties: the smallest id), realtime twins not counted
    unless every file is of a realtime track."""
    from tta_bench.run.protocol import load_protocol

    if suite in catalog.catalog()["suites"]:
        return load_protocol(suite).id
    main = [r for _, r in candidates if not tracks.is_realtime(r)]
    counts = Counter(r["protocol"]["id"] for r in main or [r for _, r in candidates])
    if not counts:
        raise ValueError(f"no results of suite {suite!r} to rank")
    return min(counts, key=lambda pid: (-counts[pid], pid))


def collect(results_dir: str | Path, suite: str, protocol_id: str | None = None) -> Leaderboard:
    """Read every ``*.json`` in ``results_dir`` (not recursive, sorted by name) and keep
    the complete runs of ``suite`` under one protocol (``protocol_id``, default: the
    suite's current one), one per (method, model, method config): the one with most cells,
    then the last file name. Ranked by mean accuracy, then label. Files of the realtime
    track of that protocol are the ranked runs' twins (``_twins``), not ranked."""
    root = Path(results_dir)
    if not root.is_dir():
        raise ValueError(f"results directory {str(root)!r} does not exist")
    left_out: list[tuple[str, str]] = []
    candidates = _candidates(root, suite, left_out)
    expected = protocol_id or _expected_protocol(suite, candidates)
    realtime = [
        (path, r)
        for path, r in candidates
        if tracks.is_realtime(r) and r["protocol"]["id"] != expected
    ]
    twin_files = {path for path, _ in realtime}
    others = [c for c in candidates if c[0] not in twin_files]
    complete = _complete(others, expected, left_out)
    complete = _one_model(complete, left_out)
    entries = _ranked(_chosen(complete, left_out))
    twins = _twins(entries, realtime, expected, left_out)
    return Leaderboard(suite, expected, entries, sorted(left_out), realtime=twins)


def _candidates(
    root: Path, suite: str, left_out: list[tuple[str, str]]
) -> list[tuple[Path, dict[str, Any]]]:
    """The readable results files of ``suite`` that are whole runs (no shard parts); the
    others go to ``left_out`` with the reason."""
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
    return candidates


def _complete(
    candidates: list[tuple[Path, dict[str, Any]]], expected: str, left_out: list[tuple[str, str]]
) -> list[Entry]:
    """The candidates of protocol ``expected`` with every cell, none diverged."""
    complete: list[Entry] = []
    for path, record in candidates:
        reason = _not_ranked(record, expected)
        if reason:
            left_out.append((path.name, reason))
        else:
            complete.append(Entry(path, record))
    return complete


def _not_ranked(record: dict[str, Any], expected: str) -> str | None:
    """Why a run of the suite is not ranked under protocol ``expected`` (None: it is)."""
    proto = record["protocol"]
    if proto["id"] != expected:
        return f"protocol {proto['id']} differs from the ranked {expected}"
    n_expected = len(proto["shifts"]) * len(proto["severities"]) * len(record["seeds"])
    if len(record["cells"]) < n_expected:
        return f"incomplete: {len(record['cells'])} of {n_expected} cells"
    bad = stats.diverged_cells(record)
    if bad:
        c = bad[0]
        return (
            f"diverged in {len(bad)} cell(s), not ranked (first: {c['shift']} sev "
            f"{c['severity']} seed {c['seed']}, batch {c['diverged']['batch']}: "
            f"{c['diverged']['reason']})"
        )
    return None


def _one_model(complete: list[Entry], left_out: list[tuple[str, str]]) -> list[Entry]:
    """The runs of the model weights most runs share (ties: the smallest hash)."""
    # Results of other model weights are another model: never ranked together.
    hashes = Counter(stats.model_hash(e.record) for e in complete)
    if len(hashes) <= 1:
        return complete
    ranked = min(hashes, key=lambda h: (-hashes[h], str(h)))
    for e in [e for e in complete if stats.model_hash(e.record) != ranked]:
        left_out.append(
            (
                e.path.name,
                f"model weights {str(stats.model_hash(e.record))[:12]} differ from the "
                f"ranked {str(ranked)[:12]} (another model: rank it separately)",
            )
        )
    return [e for e in complete if stats.model_hash(e.record) == ranked]


def _chosen(complete: list[Entry], left_out: list[tuple[str, str]]) -> list[Entry]:
    """One run per ``Entry.key``: the one with most cells, then the later file name."""
    chosen: dict[tuple[str, str, str], Entry] = {}
    for entry in complete:  # sorted by name: on equal cells the later file wins
        best = chosen.get(entry.key)
        if best is None or len(entry.record["cells"]) >= len(best.record["cells"]):
            if best is not None:
                left_out.append((best.path.name, f"superseded by {entry.path.name}"))
            chosen[entry.key] = entry
        else:
            left_out.append((entry.path.name, f"superseded by {best.path.name}"))
    return list(chosen.values())


def _twins(
    entries: list[Entry],
    realtime: list[tuple[Path, dict[str, Any]]],
    expected: str,
    left_out: list[tuple[str, str]],
) -> dict[Path, Entry]:
    """The realtime twin of each ranked entry (``tracks.twin_of``), by the entry's file:
    complete and not diverged; of several, the one with most cells, then the later file
    name. A twin that is not used is left out, named as the realtime track of its run; a
    realtime file of no ranked run, with the usual reason."""
    found: dict[Path, Entry] = {}
    for path, record in realtime:  # sorted by name: on equal cells the later file wins
        entry = next((e for e in entries if tracks.twin_of(record, e.record)), None)
        if entry is None:
            reason = _not_ranked(record, expected) or ""
            if entries and tracks.same_protocol_but_realtime(record, entries[0].record):
                reason += "; realtime track of a run not ranked here"
            left_out.append((path.name, reason))
            continue
        why = _not_ranked(record, record["protocol"]["id"])
        best = found.get(entry.path)
        if why is None and best is not None:
            if len(record["cells"]) >= len(best.record["cells"]):
                left_out.append(
                    (best.path.name, f"realtime track of {entry.label}: superseded by {path.name}")
                )
            else:
                why = f"superseded by {best.path.name}"
        if why is not None:
            left_out.append((path.name, f"realtime track of {entry.label}: {why}"))
            continue
        found[entry.path] = Entry(path, record, f"{entry.label} (realtime)")
    return found


def _ranked(entries: list[Entry]) -> list[Entry]:
    """``entries`` labelled (``_labels``) and sorted by mean accuracy, then label and model."""
    for entry, label in zip(entries, _labels([e.record for e in entries])):
        entry.label = label

    def score(e: Entry) -> float:
        est = stats.suite_estimate(e.record, "accuracy")
        return est.mean if est is not None else float("-inf")

    entries.sort(key=lambda e: (-score(e), e.label, e.record["model"]["name"]))
    return entries


def board_summary(
    board: Leaderboard,
    baseline: str | None = tables.REFERENCE,
    test: str = "t",
    per_sample: bool = True,
) -> tuple[list[str], list[list[Any]]]:
    """The summary table of the ranked runs (``tables.summary_rows``), with what the board
    has beyond it: ``per_sample``, the per-sample Δ, p, ``q (BH)`` and ``tier`` where every
    run wrote per-sample files (``sample_analysis``; else the seed-level Δ and p); the
    columns of stream orders and of realtime twins (``tracks.with_track_columns``)."""
    records = [e.record for e in board.entries]
    labels = [e.label for e in board.entries]
    s_head, s_rows = tables.summary_rows(records, labels, baseline, test)
    analysis = sample_analysis(board, baseline) if per_sample else None
    if isinstance(analysis, SampleAnalysis):
        s_head, s_rows = _sample_columns(s_head, s_rows, analysis)
    twins = [t.record if t else None for t in board.twins()]
    return tracks.with_track_columns(s_head, s_rows, records, twins)


def leaderboard_rows(
    board: Leaderboard,
    baseline: str | None = tables.REFERENCE,
    test: str = "t",
    per_sample: bool = True,
) -> tuple[list[str], list[list[Any]]]:
    """The ranked table: ``rank`` and ``LEADERBOARD_COLUMNS`` (Δ named after the
    baseline) that the board has (``board_summary``)."""
    records = [e.record for e in board.entries]
    labels = [e.label for e in board.entries]
    s_head, s_rows = board_summary(board, baseline, test, per_sample)
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


def _same(text: str) -> str:
    return text


def _code_span(text: str) -> str:
    return f"`{text}`"


def _protocol_line(proto: dict[str, Any], text: Callable[[str], str] = _same) -> str:
    """The protocol in words; ``text`` quotes each value taken from the results file."""
    shifts = ", ".join(text(str(s)) for s in proto.get("shifts") or [])
    severities = ", ".join(text(str(s)) for s in proto.get("severities") or [])
    return (
        f"dataset {text(str(proto.get('dataset')))}, shifts {shifts}, "
        f"severities {severities}, "
        f"batch size {text(str(proto.get('batch_size')))}, reset {text(str(proto.get('reset')))}, "
        f"images {text(str(proto.get('max_images') or 'all'))}"
    )


def _provenance_rows(board: Leaderboard) -> tuple[list[str], list[list[str]]]:
    """Where each ranked run comes from: its file (and its realtime twin's), the code and
    the machine."""
    headers = ["file", "method", "git sha", "tta-bench", "torch", "device", "created"]
    rows = []
    for e, twin in zip(board.entries, board.twins()):
        prov = e.record.get("provenance") or {}
        packages = prov.get("packages") or {}
        device = prov.get("device") or {}
        rows.append(
            [
                e.path.name + (f" (realtime: {twin.path.name})" if twin else ""),
                e.label,
                str(prov.get("git_sha") or "unknown"),
                str(packages.get("tta-bench") or "unknown"),
                str(prov.get("torch") or packages.get("torch") or "unknown"),
                f"{device.get('type', '?')} ({device.get('name', '?')})",
                str(e.record.get("created", "unknown")),
            ]
        )
    return headers, rows


def _notes(
    board: Leaderboard,
    baseline: str | None,
    test: str,
    text: Callable[[str], str] = _same,
    code: Callable[[str], str] = _code_span,
    per_sample: bool = False,
) -> list[str]:
    """What the leaderboard says above its table, as markdown-ish text (the page turns its
    code spans into ``<code>``). ``text`` and ``code`` quote the values taken from results
    files as text and as a code span (the markdown leaderboard escapes them; the page's
    template escapes everything). ``per_sample``: the table is ``leaderboard_rows``'s with
    ``per_sample`` (the markdown's): say how it compares, or why not per sample."""
    records = [e.record for e in board.entries]
    proto = records[0]["protocol"] if records else {}
    test_name = "paired t" if test == "t" else "paired bootstrap (10,000 resamples)"
    notes = [
        f"Protocol {code(board.protocol_id)}: {_protocol_line(proto, text)}." if proto else "",
        tracks.accuracy_note(records),
        "Cost: measured during the runs (ms per sample split into data wait, adaptation = "
        "forward + backward + step, and prediction; peak memory of the heaviest cell; image "
        "encoder passes per sample).",
    ]
    analysis = sample_analysis(board, baseline) if per_sample else None
    _, label = tables.resolve_baseline(records, baseline)
    if label is not None:
        note = (
            f"Δ: difference to {text(label)} on the same seeds and cells, {test_name} interval "
            "and two-sided p-value."
        )
        if isinstance(analysis, SampleAnalysis):
            note = (
                f"Δ: difference to {text(label)} in points over the same samples of the same "
                "streams (the runs' per-sample files); 95% interval: block bootstrap over "
                "stream batches (10,000 resamples of whole batches, as samples of one batch "
                "are not independent); p: McNemar's exact test on the samples only one of "
                "the two classifies correctly."
            )
        if label != tables.baseline_name(baseline):
            note += (
                f" {text(label)}: the frozen source model each run scored on its identical stream."
            )
        notes.insert(2, note)
    if isinstance(analysis, SampleAnalysis):
        notes[-1:-1] = _sample_notes(analysis, label is not None)
    elif isinstance(analysis, str):
        notes.insert(
            -1,
            "Per-sample comparisons (block bootstrap, McNemar, tiers) need per-sample files "
            f"({code('log_samples=true')}) of every ranked run; not used: {text(analysis)}. "
            "Δ and p compare seed means.",
        )
    if any(rec.get("scores_are_logits") is False for rec in records):
        notes.append(
            "n/a (NLL, ECE): the method's outputs are scores, not the logits of a probability "
            f"model ({code('Method.scores_are_logits')}), so NLL and ECE are not defined for it."
        )
    notes.insert(2, tracks.orders_note(records, code) or "")  # after the accuracy
    notes.append(tracks.realtime_note([t.record if t else None for t in board.twins()], code) or "")
    return [n for n in notes if n]
