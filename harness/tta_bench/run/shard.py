"""One large cell split over N workers: ``protocol.shard=i/N`` and ``tta-bench merge``.

A method reset after every batch (reset policies ``episodic_batch``, ``episodic_sample``)
computes each batch's outputs from the frozen model, that batch and the batch's own seed
alone, so the batches of a cell can run anywhere, in any order. ``protocol.shard=i/N``
runs the stream's batches whose number is ``i`` modulo ``N`` (every cell's batches spread
over the N parts) and writes a *part*: a normal results file whose record says
``shard: {index, count}`` and whose per-sample outputs hold the logits (a part always logs
them: the merge needs them). A part is not a cell: the leaderboard ignores parts, and the
run key (``tta_bench.run.results.record_key``) includes the shard, so resume never mixes parts.

``merge_parts`` combines the N parts of one run into the record the unsharded run writes:
each cell's samples gathered from the parts and put back in stream order (by batch number),
then every metric computed once over them by the same functions (``metrics.compute_all``),
so accuracy, NLL and ECE are those of the whole cell (exact counts, never means of means).
Costs are combined by their sample counts (times per timed sample, passes per sample),
peak memory is the largest part's. The merge refuses parts of different runs (model and
weights, method config, protocol id, seeds, or any setting that changes numbers), a shard
missing or given twice, unfinished parts, and parts of online or continual protocols.

Nothing a part says about its numbers is trusted: every figure, the reference accuracy
included (from the frozen model's predictions logged beside each sample), is recomputed
from the rows; each part's cell files must be that part's own (``samples.verify_cell``);
and each part records the layout of the whole stream (``stream_layout``: every cell's
batch numbers and sample count, before the shard took its batches), which all parts must
agree on, so a merged cell holds every batch of the layout exactly once, each from the
part that owns it (batch number = part index mod N): no sample counted twice, none missing.
A part that got no batch of the stream writes an empty part, merged like any other.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Reset policies under which a cell's batches are independent of each other.
SHARDABLE = ("episodic_batch", "episodic_sample")
#: Config entries that say where and how a run executes, never what it computes: parts
#: may differ in them.
WHERE_NOT_WHAT = frozenset(
    {
        "output",
        "results_dir",
        "progress",
        "batch_log",
        "logger",
        "loader",
        "cache",
        "resume",
        "data_dir",
        "log_samples",
        "log_samples_top_k",
    }
)
#: Per-sample times of a cell entry, combined weighted by ``timed_samples``.
_TIMES = (
    "time_per_sample_s",
    "method_time_per_sample_s",
    "data_time_per_sample_s",
    "data_wait_time_per_sample_s",
    "shift_time_per_sample_s",
    "adapt_time_per_sample_s",
    "predict_time_per_sample_s",
)


class MergeError(ValueError):
    """Parts that cannot be merged into one run; the message says why."""


@dataclass(frozen=True)
class Shard:
    """Part ``index`` of ``count`` (0-based): the batches whose number is ``index`` mod
    ``count``."""

    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def as_dict(self) -> dict[str, int]:
        return {"index": self.index, "count": self.count}

    def takes(self, batch_number: int) -> bool:
        return batch_number % self.count == self.index


def parse(value: Any) -> Shard | None:
    """``"i/N"`` (0 <= i < N) as a ``Shard``; None/empty for no sharding; anything else is a
    ``ValueError`` naming the value."""
    if value is None or value == "":
        return None
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(value))
    if not m:
        raise ValueError(
            f"protocol.shard={value!r}: expected INDEX/COUNT with 0 <= INDEX < COUNT, e.g. "
            "protocol.shard=0/4 (parts 0/4 .. 3/4, combined by tta-bench merge)"
        )
    index, count = int(m.group(1)), int(m.group(2))
    if count < 1 or index >= count:
        raise ValueError(
            f"protocol.shard={value!r}: INDEX must be in 0..COUNT-1 and COUNT >= 1 "
            f"(got index {index}, count {count})"
        )
    return Shard(index, count)


def check_shardable(reset: str, suite: str, shard: Shard) -> None:
    """A ``ValueError`` unless the reset policy makes a cell's batches independent."""
    if reset not in SHARDABLE:
        raise ValueError(
            f"protocol.shard={shard}: suite {suite!r} runs reset policy {reset!r}, where the "
            "method carries its state from batch to batch (online or continual: the stream "
            "order is the protocol), so a cell cannot be split; shard only reset policies "
            f"{' or '.join(SHARDABLE)} (e.g. protocol.reset=episodic_batch), or split the "
            "run by method and seed instead (tta-bench sweep)"
        )


def stream_layout(stream: Any) -> list[dict[str, Any]]:
    """Every cell of a whole ``stream`` (before ``take``): its key, its batch numbers as
    runs ``[[first, last], ...]`` and its sample count, in stream order."""
    numbers: dict[int, list[int]] = {}
    sizes: dict[int, int] = {}
    for b in stream.batches:
        for d in sorted({int(x) for x in b.domains.tolist()}):
            numbers.setdefault(d, []).append(b.number)
            sizes[d] = sizes.get(d, 0) + int((b.domains == d).sum())
    return [
        {"shift": stream.domains[d][0], "severity": int(stream.domains[d][1]),
         "seed": int(stream.seed), "batches": batch_runs(numbers[d]), "n": sizes[d]}
        for d in numbers
    ]  # fmt: skip


def batch_runs(numbers: list[int]) -> list[list[int]]:
    """Increasing batch numbers as runs of consecutive ones: ``[0, 1, 2, 3, 7]`` ->
    ``[[0, 3], [7, 7]]``."""
    runs: list[list[int]] = []
    for b in numbers:
        if runs and runs[-1][1] + 1 == b:
            runs[-1][1] = b
        else:
            runs.append([b, b])
    return runs


def take(stream: Any, shard: Shard) -> Any:
    """``stream`` with only the batches of ``shard``."""
    from tta_bench.run.stream import Stream

    keep = tuple(b for b in stream.batches if shard.takes(b.number))
    return Stream(stream.seed, stream.domains, stream.groups, keep)


# -- merging the parts ---------------------------------------------------------------------
def _what_config(record: dict[str, Any]) -> dict[str, Any]:
    """The record's config minus what may differ between parts (WHERE_NOT_WHAT, the shard
    itself)."""
    config = {k: v for k, v in (record.get("config") or {}).items() if k not in WHERE_NOT_WHAT}
    proto = dict(config.get("protocol") or {})
    proto.pop("shard", None)
    config["protocol"] = proto
    return config


def _differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            out += _differences(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [f"{prefix.rstrip('.')} ({a!r} vs {b!r})"]


def check_parts(parts: Sequence[tuple[Path, dict[str, Any]]]) -> int:
    """Refuse parts that do not make one whole run (``MergeError`` naming the file and the
    difference); return the shard count."""
    from tta_bench.run.results import record_key

    if not parts:
        raise MergeError("no parts given")
    for path, rec in parts:
        if not rec.get("shard"):
            raise MergeError(f"{path}: not a shard part (no 'shard' in the record)")
        if not rec.get("finished"):
            raise MergeError(f"{path}: part {rec['shard']} is unfinished; run it to the end first")
    (p0, r0) = parts[0]
    count = int(r0["shard"]["count"])
    reset = r0["protocol"].get("reset")
    if reset not in SHARDABLE:
        raise MergeError(f"{p0}: reset policy {reset!r} cannot be sharded ({SHARDABLE})")
    key0 = {k: v for k, v in record_key(r0, with_weights=True).items() if k != "shard"}
    for path, rec in parts[1:]:
        key = {k: v for k, v in record_key(rec, with_weights=True).items() if k != "shard"}
        diff = _differences(key0, key)
        if diff:
            raise MergeError(f"{path} is a part of another run than {p0}: {'; '.join(diff)}")
        diff = _differences(_what_config(r0), _what_config(rec))
        if diff:
            raise MergeError(f"{path} and {p0} were run with different settings: {'; '.join(diff)}")
        if sorted(rec["seeds"]) != sorted(r0["seeds"]):
            raise MergeError(f"{path} holds seeds {rec['seeds']}, {p0} seeds {r0['seeds']}")
        if int(rec["shard"]["count"]) != count:
            raise MergeError(f"{path} is a part of {rec['shard']['count']}, {p0} of {count}")
    seen: dict[int, Path] = {}
    for path, rec in parts:
        i = int(rec["shard"]["index"])
        if i in seen:
            raise MergeError(f"shard {i}/{count} given twice: {seen[i]} and {path}")
        seen[i] = path
    missing = [f"{i}/{count}" for i in range(count) if i not in seen]
    if missing:
        raise MergeError(f"missing part(s) {', '.join(missing)} of {count}")
    for path, rec in parts:
        if "stream_layout" not in rec:
            raise MergeError(
                f"{path}: records no stream layout (a part of an older tta-bench): rerun it"
            )
        if rec["stream_layout"] != r0["stream_layout"]:
            raise MergeError(
                f"{path} and {p0} record different stream layouts: they are not parts of one stream"
            )
    return count


def record_ood_score(record: dict[str, Any]) -> str:
    """The OOD score of a results record's open-set protocol (``msp`` when closed-set)."""
    return str((record.get("protocol", {}).get("ood") or {}).get("score", "msp"))


def _combine_cell(
    key: tuple[str, int, int],
    pieces: list[tuple[Path, dict[str, Any]]],
    per_class: bool,
    ood_score: str,
    parts: dict[Path, dict[str, Any]],
    layout: dict[str, Any],
) -> tuple[dict[str, Any], Any]:
    """One cell from its pieces (one per part that ran some of its batches): the entry and
    the merged per-sample rows (``CellSamples``; None for a diverged cell). ``parts``: each
    part's record by path; ``layout``: the cell's entry of the stream layout."""
    from tta_bench.run import samples
    from tta_bench.run.accounting import finite_or_none

    shift, severity, seed = key
    cells = [c for _, c in pieces]
    n = sum(int(c["n"]) for c in cells)
    entry: dict[str, Any] = {"shift": shift, "severity": severity, "seed": seed, "n": n}
    diverged = [c["diverged"] for c in cells if c.get("diverged")]
    merged_rows = None
    if diverged:
        first = min(diverged, key=lambda d: int(d.get("batch", 0)))
        entry.update(accuracy=None, error=None, reference_accuracy=None, diverged=first)
    else:
        merged_rows = _merged_rows(key, pieces, parts, layout)
        entry.update(samples.score_rows(merged_rows, ood_score=ood_score, per_class=per_class))
    _combine_costs(entry, cells)
    return finite_or_none(entry), merged_rows


def _merged_rows(
    key: tuple[str, int, int],
    pieces: list[tuple[Path, dict[str, Any]]],
    parts: dict[Path, dict[str, Any]],
    layout: dict[str, Any],
) -> Any:
    """The cell's per-sample rows gathered from its pieces' files, in stream order
    (``CellSamples``): each file verified as its part's own, each row's batch owned by its
    part, and together every batch of the cell's ``layout`` exactly once."""
    import numpy as np

    from tta_bench.run import results, samples

    rows = []
    for path, cell in pieces:
        rec = parts[path]
        found = samples.open_cell(samples.samples_dir(path), *key)
        file = found.path
        try:
            samples.verify_cell(
                found,
                run_key=results.record_key(rec, with_weights=True),
                key=key,
                method=samples.method_label(rec),
                n=int(cell["n"]),
            )
        except ValueError as exc:
            raise MergeError(str(exc)) from exc
        piece = samples.cell_rows(found.table, key, str(file))
        _check_counts(file, cell, samples.score_rows(piece, ood_score=record_ood_score(rec)))
        shard = rec["shard"]
        foreign = sorted({int(b) for b in piece.batches if b % shard["count"] != shard["index"]})
        if foreign:
            raise MergeError(
                f"{file}: part {shard['index']}/{shard['count']} holds batch(es) {foreign[:5]} "
                "of another part (batch number mod count must be the part's index)"
            )
        rows.append(piece)
    batches = np.concatenate([r.batches for r in rows])
    order = np.argsort(batches, kind="stable")  # stream order; rows keep their batch order
    expected = [b for first, last in layout["batches"] for b in range(first, last + 1)]
    got = sorted(set(batches.tolist()))
    if got != expected or len(batches) != int(layout["n"]):
        missing = sorted(set(expected) - set(got))
        extra = sorted(set(got) - set(expected))
        raise MergeError(
            f"cell {key}: the parts hold {len(batches)} samples of batches {_runs(got)}, the "
            f"stream {layout['n']} of batches {_runs(expected)}"
            + (f"; missing batch(es) {missing[:5]}" if missing else "")
            + (f"; batch(es) not in the stream {extra[:5]}" if extra else "")
        )
    refs = [r.references for r in rows]
    return samples.CellSamples(
        shift=key[0],
        severity=key[1],
        seed=key[2],
        domain=rows[0].domain,
        logits=np.concatenate([r.logits for r in rows])[order],
        labels=np.concatenate([r.labels for r in rows])[order],
        indices=np.concatenate([r.indices for r in rows])[order],
        batches=batches[order],
        references=None if any(r is None for r in refs) else np.concatenate(refs)[order],
        own_scores=_stacked([r.own_scores for r in rows], order),
        decisions=_stacked([r.decisions for r in rows], order),
    )


def _stacked(parts: list[Any], order: Any) -> Any:
    """The parts' column in stream order, or None unless every part holds it."""
    import numpy as np

    return None if any(p is None for p in parts) else np.concatenate(parts)[order]


#: A piece's figures that are counts over its rows: exact on any machine, so a part that
#: states other values than its rows give was edited.
COUNTED = ("accuracy", "error", "reference_accuracy", "n_known", "n_ood")


def _check_counts(file: Path, cell: dict[str, Any], scored: dict[str, Any]) -> None:
    """Refuse a part whose cell entry states other counts than its rows give."""
    wrong = [
        f"{k} {cell.get(k)!r} (its rows: {scored.get(k)!r})"
        for k in COUNTED
        if (k in cell or scored.get(k) is not None) and cell.get(k) != scored.get(k)
    ]
    if wrong:
        raise MergeError(f"the part's entry of {file.name} was edited: {'; '.join(wrong)}")


def _runs(numbers: list[int]) -> str:
    """``0-3, 7`` for the sorted batch numbers ``[0, 1, 2, 3, 7]``."""
    runs = batch_runs(numbers)
    return ", ".join(f"{a}-{z}" if a != z else f"{a}" for a, z in runs) or "none"


def _combine_costs(entry: dict[str, Any], cells: list[dict[str, Any]]) -> None:
    """The cell's costs from its pieces', into ``entry``: times per timed sample and passes
    per sample weighted by their counts, the largest peak memory, FLOPs per untimed sample."""
    n = entry["n"]
    timed = sum(int(c.get("timed_samples") or 0) for c in cells)
    for name in _TIMES:
        vals = [(c.get(name), int(c.get("timed_samples") or 0)) for c in cells]
        known = [(v, t) for v, t in vals if v is not None and t]
        entry[name] = sum(v * t for v, t in known) / timed if known and timed else None
    entry["timed_samples"] = timed
    method_s = sum((c.get("method_time_per_sample_s") or 0.0) * (c.get("timed_samples") or 0)
                   for c in cells)  # fmt: skip
    data_s = sum((c.get("data_time_per_sample_s") or 0.0) * (c.get("timed_samples") or 0)
                 for c in cells)  # fmt: skip
    entry["data_wait_share"] = data_s / max(method_s + data_s, 1e-12) if timed else 0.0
    entry["samples_per_s"] = timed / max(method_s + data_s, 1e-12) if timed else None
    peaks = [c.get("peak_memory_bytes") for c in cells if c.get("peak_memory_bytes") is not None]
    entry["peak_memory_bytes"] = max(peaks) if peaks else None
    entry["peak_memory_kind"] = cells[0].get("peak_memory_kind")
    for name in ("forward_passes_per_sample", "backward_passes_per_sample"):
        entry[name] = sum(float(c.get(name) or 0.0) * int(c["n"]) for c in cells) / max(n, 1)
    entry["batches"] = sum(int(c.get("batches") or 0) for c in cells)
    entry["finished"] = max(str(c.get("finished", "")) for c in cells)
    flops = [(c["flops_per_sample"], c) for c in cells if c.get("flops_per_sample") is not None]
    if flops:
        untimed = [int(c["n"]) - int(c.get("timed_samples") or 0) for _, c in flops]
        entry["flops_per_sample"] = sum(f * u for (f, _), u in zip(flops, untimed)) / max(
            sum(untimed), 1
        )


def merge_parts(paths: Sequence[str | Path], output: str | Path | None = None) -> dict[str, Any]:
    """The record of the whole run from its N parts (see the module docstring); written to
    ``output`` atomically with its per-sample folder when given. Raises ``MergeError``."""
    from tta_bench.run import results, samples

    parts = []
    for p in paths:
        path = Path(p)
        try:
            parts.append((path, results.load_results(path)))
        except (OSError, ValueError) as exc:
            raise MergeError(f"{path}: {exc}") from exc
    parts.sort(key=lambda pr: int((pr[1].get("shard") or {}).get("index", -1)))
    count = check_parts(parts)
    first = parts[0][1]
    proto = first["protocol"]
    order = {(s, int(v)): i for i, (s, v) in enumerate(
        (s, v) for s in proto["shifts"] for v in proto["severities"])}  # fmt: skip
    pieces: dict[tuple[str, int, int], list[tuple[Path, dict[str, Any]]]] = {}
    for path, rec in parts:
        for cell in rec["cells"]:
            pieces.setdefault(results.cell_key(cell), []).append((path, cell))
    layout = {results.cell_key(c): c for c in first["stream_layout"]}
    strays = sorted(set(pieces) - set(layout), key=str)
    if strays:
        where = ", ".join(str(p) for p, _ in pieces[strays[0]])
        raise MergeError(f"cell {strays[0]} of {where} is not in the stream's layout")
    per_class = any("per_class_accuracy" in c for _, rec in parts for c in rec["cells"])
    keys = sorted(layout, key=lambda k: (k[2], order.get((k[0], k[1]), 0)))
    by_path = {path: rec for path, rec in parts}
    cells, rows = [], []
    for key in keys:
        if key not in pieces:
            raise MergeError(f"no part holds cell {key}, whose batches the stream's layout lists")
        entry, merged_rows = _combine_cell(
            key, pieces[key], per_class, record_ood_score(first), by_path, layout[key]
        )
        cells.append(entry)
        if merged_rows is not None:
            rows.append(merged_rows)
    merged = json.loads(json.dumps(first))
    merged.pop("shard", None)
    for k in ("loop", "skipped_cells", "stream_layout"):
        merged.pop(k, None)
    merged["config"].get("protocol", {}).pop("shard", None)
    merged["seeds"] = sorted({int(s) for _, r in parts for s in r["seeds"]})
    merged["cells"] = cells
    merged["summary"] = results.summarize(cells)
    merged["merged_shards"] = {"count": count, "parts": [str(p) for p, _ in parts]}
    merged["finished"] = max(r["finished"] for _, r in parts)
    merged["wall_time_s"] = sum(float(r.get("wall_time_s") or 0.0) for _, r in parts)
    bad: dict[str, list[Any]] = {}
    for _, r in parts:
        for name, entries in (r.get("skipped_images") or {}).items():
            known = bad.setdefault(name, [])
            known += [e for e in entries if e not in known]
    merged["skipped_images"] = bad
    if output is not None:
        out = Path(output)
        label = samples.method_label(first)
        run_key = results.record_key(merged, with_weights=True)
        for cell_rows in rows:  # before the results file lists the cells
            samples.write_cell(samples.samples_dir(out), label, cell_rows, 5, True, run_key=run_key)
        merged = results.ResultsFile(out).write(merged)
    return merged
