"""Machine-readable tables (``tta-bench table --format json|csv``): numbers, not formatted
strings. The long table has one row per method x model x shift x severity x seed (a
cell); the summary has one row per run with its interval bounds as columns. Rates are
fractions (accuracy 0.571, not "57.1"), times in seconds, memory in bytes.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from typing import Any

from tta_bench.report import stats, tables
from tta_bench.report.columns import column, shown, table_columns

#: Cell fields copied into the long table, in this order, after the cell key.
CELL_FIELDS = (
    "n",
    "accuracy",
    "error",
    "reference_accuracy",
    "time_per_sample_s",
    "method_time_per_sample_s",
    "data_time_per_sample_s",
    "peak_memory_bytes",
    "forward_passes_per_sample",
    "backward_passes_per_sample",
)


def long_rows(records: Sequence[dict[str, Any]], labels: Sequence[str]) -> list[dict[str, Any]]:
    """One row per cell of every record: the cell key, then ``CELL_FIELDS`` and every
    metric the cells hold (None where a cell has no value, e.g. a diverged one)."""
    metric_names = [c.name for c in table_columns(c for r in records for c in r["cells"])]
    rows = []
    for label, rec in zip(labels, records):
        for c in rec["cells"]:
            row: dict[str, Any] = {
                "method": label,
                "method_name": rec["method"],
                "model": rec["model"]["name"],
                "protocol_id": rec["protocol"]["id"],
                "shift": c["shift"],
                "severity": c["severity"],
                "seed": c["seed"],
                "diverged": bool(c.get("diverged")),
            }
            row.update({k: c.get(k) for k in (*CELL_FIELDS, *metric_names)})
            for name in metric_names:  # NLL/ECE of scores that are not logits mean nothing
                if not shown(column(name), rec):
                    row[name] = None
            rows.append(row)
    return rows


def summary_rows(
    records: Sequence[dict[str, Any]],
    labels: Sequence[str],
    baseline: str | None = tables.REFERENCE,
    test: str = "t",
) -> list[dict[str, Any]]:
    """One row per run: accuracy mean, std and 95% interval over seeds, the paired
    difference to ``baseline`` with its interval and p-value, each metric's mean, the mean
    time per sample and the peak memory (None where undefined)."""
    base_rec, base_label = tables.resolve_baseline(records, baseline)
    metric_names = [c.name for c in table_columns(c for r in records for c in r["cells"])]
    out = []
    for label, rec in zip(labels, records):
        acc = stats.suite_estimate(rec)
        cmp = None
        if base_label is not None and not stats.diverged_cells(rec):
            cmp = tables.compare_to_baseline(rec, base_rec, baseline, test)
        summary = rec.get("summary") or {}
        row: dict[str, Any] = {
            "method": label,
            "method_name": rec["method"],
            "model": rec["model"]["name"],
            "protocol_id": rec["protocol"]["id"],
            "seeds": len({c["seed"] for c in rec["cells"]}),
            "diverged_cells": len(stats.diverged_cells(rec)),
            "accuracy": None if acc is None else acc.mean,
            "accuracy_std": None if acc is None else acc.std,
            "accuracy_ci_low": None if acc is None else acc.ci_low,
            "accuracy_ci_high": None if acc is None else acc.ci_high,
            "baseline": base_label,
            "delta": None if cmp is None else cmp.mean_difference,
            "delta_ci_low": None if cmp is None else cmp.ci_low,
            "delta_ci_high": None if cmp is None else cmp.ci_high,
            "p_value": None if cmp is None else cmp.p_value,
        }
        for name in metric_names:
            est = stats.suite_estimate(rec, name)
            row[name] = None if est is None or not shown(column(name), rec) else est.mean
        row["scores_are_logits"] = rec.get("scores_are_logits", True) is not False
        row["time_per_sample_s"] = summary.get("mean_time_per_sample_s")
        row["peak_memory_bytes"] = summary.get("max_peak_memory_bytes")
        row["trainable_parameters"] = (rec.get("parameters") or {}).get("trainable")
        out.append(row)
    return out


def to_json(records: Sequence[dict[str, Any]], labels: Sequence[str], **kw: Any) -> str:
    """``{"suite", "protocol_id", "cells": [long rows], "summary": [summary rows]}``."""
    doc = {
        "suite": records[0].get("suite"),
        "protocol_id": records[0]["protocol"]["id"],
        "cells": long_rows(records, labels),
        "summary": summary_rows(records, labels, **kw),
    }
    return json.dumps(doc, indent=1, allow_nan=False) + "\n"


def to_csv(rows: list[dict[str, Any]]) -> str:
    """Rows as CSV with a header; None is an empty field. Numbers are written as numbers;
    text a spreadsheet would run as a formula (a method, shift or metric name starting with
    ``=``, ``+``, ``-``, ``@``, ...) gets a leading ``'`` (``tables.csv_cell``)."""
    if not rows:
        return ""
    fields = list(rows[0])
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow([tables.csv_cell(k) for k in fields])
    writer.writerows(
        [tables.csv_cell("" if r.get(k) is None else r[k]) for k in fields] for r in rows
    )
    return buf.getvalue()
