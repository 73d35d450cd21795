"""Per-sample outputs (``log_samples=true|logits``): one Parquet file per cell beside the
results file, so any metric can be recomputed later without adapting again
(``tta-bench rescore``, ``tta_bench.run.rescore``).

Layout: for results ``run.json`` the folder ``run.samples/`` holds
``<shift>__sev<severity>__seed<seed>.parquet``, one row per scored sample in stream order:
``method``, ``shift``, ``severity``, ``seed``, ``domain`` (the cell's dataset domain),
``position`` (the sample's place in the cell's stream), ``index`` (its row in the
dataset split), ``batch`` (the stream's batch number), ``label``, ``prediction``,
``topk_classes`` and ``topk_probs`` (softmax, the ``top_k`` most probable classes), and
with ``log_samples=logits`` the full ``logits`` (float32). A file is written atomically
when its cell's group finishes, before the results file lists the cell, so a resumed run
finds the files of the cells it skips; a rerun of a cell replaces its file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tta_bench.paths import atomic_path

#: ``log_samples`` values: off, top-k classes and probabilities, or those and the logits.
MODES = (False, True, "logits")
SUFFIX = ".samples"


def mode(value: Any) -> str | None:
    """``None`` (off), ``"topk"`` or ``"logits"`` of a ``log_samples`` setting; a bad value
    is a ``ValueError`` naming the options."""
    if value in (None, False, "false", "False"):
        return None
    if value in (True, "true", "True"):
        return "topk"
    if value == "logits":
        return "logits"
    raise ValueError(f"log_samples={value!r}: expected false, true or logits")


def samples_dir(results: str | Path) -> Path:
    """The per-sample folder of results file ``results``: ``<stem>.samples`` beside it."""
    path = Path(results)
    return path.with_name(path.stem + SUFFIX)


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


def write_cell(folder: Path, method: str, cell: CellSamples, top_k: int, with_logits: bool) -> Path:
    """Write ``cell``'s rows to its Parquet file atomically (temporary file, then rename)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

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
    if with_logits:
        columns["logits"] = pa.FixedSizeListArray.from_arrays(pa.array(logits.reshape(-1)), classes)
    dest = cell_file(folder, cell.shift, cell.severity, cell.seed)
    with atomic_path(dest) as tmp:
        pq.write_table(pa.table(columns), tmp)
    return dest


def read_cell(folder: Path, shift: str, severity: int, seed: int) -> Any:
    """The cell's rows as a ``pyarrow.Table``; a missing or unreadable file is a
    ``ValueError`` naming it."""
    import pyarrow.parquet as pq

    path = cell_file(folder, shift, severity, seed)
    if not path.is_file():
        raise ValueError(f"no per-sample file {str(path)!r} for cell ({shift}, {severity}, {seed})")
    try:
        return pq.read_table(path)
    except Exception as exc:  # pyarrow's own errors (truncated or not Parquet)
        raise ValueError(f"{path}: not a readable per-sample Parquet file ({exc})") from exc


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
