"""Per-sample outputs (``log_samples=true|logits``): one Parquet file per cell beside the
results file, so any metric can be recomputed later without adapting again
(``tta-bench rescore``, ``tta_bench.run.rescore``).

Layout: for results ``run.json`` the folder ``run.samples/`` holds
``<shift>__sev<severity>__seed<seed>.parquet``, one row per scored sample in stream order:
``method``, ``shift``, ``severity``, ``seed``, ``domain`` (the cell's dataset domain),
``position`` (the sample's place in the cell's stream), ``index`` (its row in the
dataset split), ``batch`` (the stream's batch number), ``label``, ``prediction``,
``topk_classes`` and ``topk_probs`` (softmax, the ``top_k`` most probable classes),
``reference`` (the frozen model's prediction of the sample, when the run scored the
reference), ``ood_score_own`` and ``ood_decision`` (the method's own OOD score and in/out
decision, for a method that has them: ``Method.own_ood_score``), and with
``log_samples=logits`` the full ``logits`` (float32). A file is
written atomically when its cell's group finishes, before the results file lists the cell,
so a resumed run finds the files of the cells it skips; a rerun of a cell replaces its file.

Each file carries the identity of its run and cell in its Parquet metadata (``IDENTITY``:
the run key, the cell key, the method label, the row count and the SHA-256 of the file's
data pages, ``data_digest``: every value of every row as stored, everything before the
Parquet footer that holds the identity); ``verify_cell`` refuses a file whose identity,
cell, method, rows or digest do not match the run that reads it, so ``rescore`` and
``merge`` never score another run's samples or edited rows.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tta_bench.paths import atomic_path

#: The Parquet metadata key of a file's identity (``write_cell``, ``verify_cell``).
IDENTITY = b"tta_bench.identity"
#: The version of the identity's layout.
IDENTITY_FORMAT = 1
#: ``log_samples`` values: off, top-k classes and probabilities, or those and the logits;
#: ``auto`` (the default) is ``True`` for a new output (``tta_bench.run.output``).
MODES = (False, True, "logits", "auto")
SUFFIX = ".samples"
#: The columns of a method's own OOD score and in/out decision (``Method.own_ood_score``).
OWN_SCORE, DECISION = "ood_score_own", "ood_decision"


def mode(value: Any) -> str | None:
    """``None`` (off), ``"topk"`` or ``"logits"`` of a ``log_samples`` setting; a bad value
    is a ``ValueError`` naming the options."""
    if value in (None, False, "false", "False"):
        return None
    if value in (True, "true", "True", "auto"):
        return "topk"
    if value == "logits":
        return "logits"
    raise ValueError(f"log_samples={value!r}: expected auto, false, true or logits")


def samples_dir(results: str | Path) -> Path:
    """The per-sample folder of results file ``results``: ``<stem>.samples`` beside it."""
    path = Path(results)
    return path.with_name(path.stem + SUFFIX)


def method_label(record: dict[str, Any]) -> str:
    """A run's name: its preset (``method=<preset>``) when it came from one, else its method;
    the name its per-sample files carry and the leaderboard shows."""
    return str(record.get("method_preset") or record["method"])


def cell_file(folder: Path, shift: str, severity: int, seed: int) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._+-]", "_", str(shift))
    return folder / f"{safe}__sev{int(severity)}__seed{int(seed)}.parquet"


@dataclass
class CellSamples:
    """One cell's scored samples, in stream order (``tta_bench.run.accounting.CellBook``)."""

    shift: str
    severity: int
    seed: int
    domain: str
    logits: np.ndarray  # [N, C] float32
    labels: np.ndarray  # [N] int64
    indices: np.ndarray  # [N] dataset rows
    batches: np.ndarray  # [N] stream batch numbers
    #: [N] the frozen model's predictions (None: the run scored no reference)
    references: np.ndarray | None = None
    #: [N] the method's own OOD score (``Method.own_ood_score``; None: it has none)
    own_scores: np.ndarray | None = None
    #: [N] the method's own in/out decision (True = in-distribution; None: it makes none)
    decisions: np.ndarray | None = None


def write_cell(
    folder: Path,
    method: str,
    cell: CellSamples,
    top_k: int,
    with_logits: bool,
    *,
    run_key: dict[str, Any],
) -> Path:
    """Write ``cell``'s rows to its Parquet file atomically (temporary file, then rename),
    with its identity (``run_key``: the results record's ``record_key(..., with_weights=
    True)``; the cell; ``method``; the row count and digest) in the file's metadata."""
    import pyarrow as pa

    logits = np.asarray(cell.logits, dtype=np.float32)
    n, classes = logits.shape
    shifted = logits - logits.max(axis=1, keepdims=True) if n else logits
    probs = np.exp(shifted.astype(np.float64))
    probs /= probs.sum(axis=1, keepdims=True) if n else 1.0
    k = min(int(top_k), classes)
    # ties: the lower class first, as argmax (stable sort of the negated probabilities)
    order = np.argsort(-probs, axis=1, kind="stable")[:, :k] if n else np.zeros((0, k), int)
    columns: dict[str, Any] = {
        "method": pa.array([method] * n, pa.string()),
        "shift": pa.array([cell.shift] * n, pa.string()),
        "severity": pa.array([int(cell.severity)] * n, pa.int32()),
        "seed": pa.array([int(cell.seed)] * n, pa.int64()),
        "domain": pa.array([cell.domain] * n, pa.string()),
        "position": pa.array(np.arange(n, dtype=np.int64)),
        "index": pa.array(np.asarray(cell.indices, dtype=np.int64)),
        "batch": pa.array(np.asarray(cell.batches, dtype=np.int64)),
        "label": pa.array(np.asarray(cell.labels, dtype=np.int64)),
        "prediction": pa.array(
            logits.argmax(axis=1).astype(np.int64) if n else np.zeros(0, np.int64)
        ),
        "topk_classes": pa.FixedSizeListArray.from_arrays(
            pa.array(order.reshape(-1).astype(np.int32)), k
        ),
        "topk_probs": pa.FixedSizeListArray.from_arrays(
            pa.array(np.take_along_axis(probs, order, axis=1).reshape(-1).astype(np.float32)), k
        ),
    }
    if cell.references is not None:
        columns["reference"] = pa.array(np.asarray(cell.references, dtype=np.int64))
    if cell.own_scores is not None:
        columns[OWN_SCORE] = pa.array(np.asarray(cell.own_scores, dtype=np.float32))
    if cell.decisions is not None:
        columns[DECISION] = pa.array(np.asarray(cell.decisions, dtype=bool))
    if with_logits:
        columns["logits"] = pa.FixedSizeListArray.from_arrays(pa.array(logits.reshape(-1)), classes)
    table = pa.table(columns)
    data = data_digest(_parquet_bytes(table))
    identity = {
        "format": IDENTITY_FORMAT,
        "run_key": run_key,
        "cell": [cell.shift, int(cell.severity), int(cell.seed)],
        "method": method,
        "rows": n,
        "data_sha256": data,
    }
    meta = {IDENTITY: json.dumps(identity, sort_keys=True)}
    raw = _parquet_bytes(table.replace_schema_metadata(meta))
    # the data pages do not depend on the footer's metadata
    assert data_digest(raw) == data, "Parquet data pages changed with the metadata"
    dest = cell_file(folder, cell.shift, cell.severity, cell.seed)
    with atomic_path(dest) as tmp:
        Path(tmp).write_bytes(raw)
    return dest


def _parquet_bytes(table: Any) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def data_digest(raw: bytes) -> str:
    """SHA-256 of a Parquet file's data pages: its bytes before the footer (the footer's
    length is the 4 bytes before the closing ``PAR1``). Any edit of a value, a row or a
    column changes them; the identity in the footer does not."""
    if len(raw) < 12 or raw[-4:] != b"PAR1":
        raise ValueError("not a Parquet file (no closing PAR1 marker)")
    footer = struct.unpack("<I", raw[-8:-4])[0]
    if footer + 8 > len(raw):
        raise ValueError("not a Parquet file (its footer length runs past its start)")
    return hashlib.sha256(memoryview(raw)[: len(raw) - 8 - footer]).hexdigest()


@dataclass
class CellFile:
    """A cell's per-sample file as read: its path, its rows (``pyarrow.Table``) and the
    digest of its data pages (``data_digest``)."""

    path: Path
    table: Any
    data_sha256: str


def identity(table: Any) -> dict[str, Any] | None:
    """The identity a file's metadata holds (``write_cell``); None when it holds none."""
    raw = (table.schema.metadata or {}).get(IDENTITY)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def verify_cell(
    cell: CellFile,
    *,
    run_key: dict[str, Any],
    key: tuple[str, int, int],
    method: str,
    n: int,
) -> None:
    """Refuse (``ValueError`` naming the file and what differs) a cell file that is not
    the rows of cell ``key`` of the run ``run_key`` by ``method`` with ``n`` samples: no
    identity in its metadata, another run, cell (another seed's file renamed), method or
    row count, or data pages whose digest differs from the one written with them (edited
    labels, scaled logits, a changed seed column)."""
    path, table = cell.path, cell.table
    found = identity(table)
    if found is None or found.get("format") != IDENTITY_FORMAT:
        raise ValueError(
            f"{path}: carries no identity of its run (written by another tool or an older "
            "tta-bench): it cannot be tied to this run; rerun with log_samples=logits"
        )
    wrong = [
        f"run key {k} {(found.get('run_key') or {}).get(k)!r} (the run's: {v!r})"
        for k, v in run_key.items()
        if (found.get("run_key") or {}).get(k) != v
    ]
    if list(found.get("cell") or []) != [key[0], int(key[1]), int(key[2])]:
        wrong.append(f"cell {found.get('cell')} (expected {list(key)})")
    if found.get("method") != method:
        wrong.append(f"method {found.get('method')!r} (the run's: {method!r})")
    if found.get("rows") != n or table.num_rows != n:
        wrong.append(f"{table.num_rows} rows (identity {found.get('rows')}, the cell's n {n})")
    if not wrong and cell.data_sha256 != found.get("data_sha256"):
        wrong.append("its rows differ from those written with it (data digest)")
    if wrong:
        raise ValueError(f"{path} is not cell {key} of this run: {'; '.join(wrong)}")


def open_cell(
    folder: Path, shift: str, severity: int, seed: int, columns: Sequence[str] | None = None
) -> CellFile:
    """The cell's file, read once: its rows (``columns``: only those of them the file has,
    default all) and the digest of its data pages (over the whole file, whatever is read);
    a missing or unreadable file is a ``ValueError`` naming it."""
    path = cell_file(folder, shift, severity, seed)
    if not path.is_file():
        raise ValueError(f"no per-sample file {str(path)!r} for cell ({shift}, {severity}, {seed})")
    try:
        raw = path.read_bytes()
        return CellFile(path, table_of(raw, columns), data_digest(raw))
    except Exception as exc:  # pyarrow's own errors (truncated or not Parquet)
        raise ValueError(f"{path}: not a readable per-sample Parquet file ({exc})") from exc


def table_of(raw: bytes, columns: Sequence[str] | None = None) -> Any:
    """A cell file's bytes as a ``pyarrow.Table`` (``columns``: those of them it has).
    ``ParquetFile.read``: the same table as ``read_table`` (schema metadata included)
    without the dataset layer's set-up, about half the cost on a cell file; on one thread:
    a cell file is a few KB, less than a thread pool's start costs (docs/speed.md)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(pa.BufferReader(raw))
    if columns is not None:
        names = set(parquet.schema_arrow.names)
        columns = [c for c in columns if c in names]
    return parquet.read(columns=columns, use_threads=False)


def read_cell(folder: Path, shift: str, severity: int, seed: int) -> Any:
    """The cell's rows as a ``pyarrow.Table``; a missing or unreadable file is a
    ``ValueError`` naming it."""
    return open_cell(folder, shift, severity, seed).table


def references(table: Any) -> np.ndarray | None:
    """The frozen model's predictions of a cell's rows, or None when not logged."""
    return column_or_none(table, "reference", np.int64)


def column_or_none(table: Any, name: str, dtype: Any) -> np.ndarray | None:
    """Column ``name`` of a cell's rows as a numpy array of ``dtype``, None when absent."""
    if name not in table.column_names:
        return None
    return table.column(name).to_numpy(zero_copy_only=False).astype(dtype)


def logits_and_labels(table: Any, path: str = "") -> tuple[np.ndarray, np.ndarray]:
    """``(logits [N, C] float32, labels [N] int64)`` of a cell's rows; a file written with
    ``log_samples=true`` (top-k only) is a ``ValueError``: recomputing needs the logits."""
    if "logits" not in table.column_names:
        raise ValueError(
            f"{path or 'the per-sample file'} holds the top-k classes only; recomputing "
            "metrics needs the full logits: run with log_samples=logits"
        )
    column = table.column("logits").combine_chunks()
    width = column.type.list_size
    logits = column.flatten().to_numpy(zero_copy_only=False).reshape(-1, width)
    labels = table.column("label").to_numpy().astype(np.int64)
    return np.array(logits, dtype=np.float32), labels  # a writable copy (torch.from_numpy)


def score(
    logits: Any,
    labels: Any,
    references: Any = None,
    *,
    ood_score: str = "msp",
    per_class: bool = False,
    own_scores: Any = None,
    decisions: Any = None,
) -> dict[str, Any]:
    """Every derived figure of a cell from its rows (float32 ``logits [N, C]`` and int64
    ``labels [N]`` tensors, in stream order): each registered metric
    (``metrics.compute_all``), ``error`` over the in-distribution rows,
    ``reference_accuracy`` from the frozen model's predictions ``references [N]`` (None:
    not scored), ``n_known`` / ``n_ood`` for an open-set cell, ``per_class_accuracy`` on
    request; in an open-set cell also the open-set metrics of the method's own OOD score
    ``own_scores [N]`` and the accuracies of its decision ``decisions [N]``
    (``openset.own_metrics``, ``openset.decision_metrics``) when given. The runner scores
    its cells with it, and ``rescore`` and ``merge`` rescore them from their per-sample
    files with it."""
    import torch

    from tta_bench import metrics

    n = len(labels)
    entry: dict[str, Any] = dict(metrics.compute_all(logits, labels, ood_score))
    n_known = int((labels >= 0).sum())  # an open-set cell's OOD rows are labelled -1
    known = max(n_known, 1)
    entry["error"] = 1.0 - int((logits.argmax(dim=1) == labels).sum()) / known
    entry["reference_accuracy"] = (
        None if references is None else int((torch.as_tensor(references) == labels).sum()) / known
    )
    if n_known != n:  # open-set: the closed-set metrics score the known rows
        entry.update(n_known=n_known, n_ood=n - n_known)
        if n_known:
            from tta_bench.run import openset

            y = np.asarray(labels)
            if own_scores is not None:
                entry.update(openset.own_metrics(y, own_scores))
            if decisions is not None:
                entry.update(openset.decision_metrics(np.asarray(logits), y, decisions))
    if per_class:
        entry["per_class_accuracy"] = metrics.per_class_accuracy(logits, labels, logits.shape[1])
    return entry


def score_rows(
    rows: CellSamples, *, ood_score: str = "msp", per_class: bool = False
) -> dict[str, Any]:
    """``score`` of a cell's per-sample rows (``CellSamples``)."""
    import torch

    return score(
        torch.from_numpy(np.ascontiguousarray(rows.logits, dtype=np.float32)),
        torch.from_numpy(np.ascontiguousarray(rows.labels, dtype=np.int64)),
        rows.references,
        ood_score=ood_score,
        per_class=per_class,
        own_scores=rows.own_scores,
        decisions=rows.decisions,
    )


def cell_rows(table: Any, key: tuple[str, int, int], path: str = "") -> CellSamples:
    """A cell file's rows (``read_cell``) as ``CellSamples``; it must hold the logits."""
    logits, labels = logits_and_labels(table, path)
    n = len(labels)
    return CellSamples(
        shift=key[0],
        severity=int(key[1]),
        seed=int(key[2]),
        domain=table.column("domain")[0].as_py() if n else str(key[0]),
        logits=logits,
        labels=labels,
        indices=table.column("index").to_numpy().astype(np.int64),
        batches=table.column("batch").to_numpy().astype(np.int64),
        references=references(table),
        own_scores=column_or_none(table, OWN_SCORE, np.float32),
        decisions=column_or_none(table, DECISION, bool),
    )
