"""The declared schema of a results file (JSON Schema, checked with ``jsonschema``).

Every results file that ``table``, ``leaderboard``, resume or a sweep merge reads is
validated first; a file that does not conform is refused with the path of the first bad
field (``cells[3].accuracy: 'abc' is not of type 'number'``), never half-read. The schema
version is ``tta_bench.SCHEMA_VERSION``.
"""

from __future__ import annotations

from typing import Any

from tta_bench._version import SCHEMA_VERSION

_FRACTION = {"type": "number", "minimum": 0, "maximum": 1}
_FRACTION_OR_NULL = {"type": ["number", "null"], "minimum": 0, "maximum": 1}
_SECONDS = {"type": ["number", "null"], "minimum": 0}

CELL: dict[str, Any] = {
    "type": "object",
    "required": ["shift", "severity", "seed", "n", "accuracy", "error"],
    "properties": {
        "shift": {"type": "string", "minLength": 1},
        "severity": {"type": "integer", "minimum": 1, "maximum": 5},
        "seed": {"type": "integer"},
        "n": {"type": "integer", "minimum": 0},
        "accuracy": _FRACTION_OR_NULL,
        "error": _FRACTION_OR_NULL,
        "reference_accuracy": _FRACTION_OR_NULL,
        "ece": _FRACTION_OR_NULL,
        "nll": {"type": ["number", "null"], "minimum": 0},
        "time_per_sample_s": _SECONDS,
        "method_time_per_sample_s": _SECONDS,
        "data_time_per_sample_s": _SECONDS,
        "peak_memory_bytes": {"type": "integer", "minimum": 0},
        # the realtime track (tta_bench.run.realtime): samples adapted on, of those seen
        "realtime": {
            "type": "object",
            "required": ["adapted_samples", "samples"],
            "properties": {
                "adapted_samples": {"type": "integer", "minimum": 0},
                "samples": {"type": "integer", "minimum": 0},
            },
        },
        "diverged": {
            "type": "object",
            "required": ["batch", "reason"],
            "properties": {"batch": {"type": "integer"}, "reason": {"type": "string"}},
        },
    },
    # A cell without an accuracy is a diverged one, and says so.
    "if": {"properties": {"accuracy": {"type": "null"}}},
    "then": {"required": ["diverged"]},
}

RESULTS: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "tta-bench results file",
    "type": "object",
    "required": [
        "schema_version",
        "method",
        "method_config",
        "model",
        "suite",
        "protocol",
        "seeds",
        "provenance",
        "cells",
        "summary",
    ],
    "properties": {
        "schema_version": {"const": SCHEMA_VERSION},
        "method": {"type": "string", "minLength": 1},
        "method_config": {"type": "object"},
        "method_config_hash": {"type": "string"},
        "model": {
            "type": "object",
            "required": ["name", "weights", "state_sha256"],
            "properties": {
                "name": {"type": "string"},
                "weights": {"type": "string"},
                "weights_sha256": {"type": ["string", "null"]},
                "state_sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
                "args": {"type": ["object", "null"]},
            },
        },
        "suite": {"type": "string"},
        "protocol": {
            "type": "object",
            "required": ["id", "shifts", "severities"],
            "properties": {
                "id": {"type": "string"},
                "shifts": {"type": "array", "items": {"type": "string"}},
                "severities": {"type": "array", "items": {"type": "integer"}},
            },
        },
        "seeds": {"type": "array", "items": {"type": "integer"}},
        "provenance": {"type": "object", "required": ["plugins"]},
        "cells": {"type": "array", "items": CELL},
        "summary": {"type": "object"},
    },
}


class ResultsFormatError(ValueError):
    """A results file that does not follow the declared schema."""


def _where(path: Any) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def validate(data: Any, source: str) -> None:
    """Raise ``ResultsFormatError`` naming the first bad field of ``data`` (from ``source``)."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import best_match

    if isinstance(data, dict) and data.get("schema_version") != SCHEMA_VERSION:
        raise ResultsFormatError(
            f"{source}: results schema_version {data.get('schema_version')!r} is not supported "
            f"(this tta-bench reads {SCHEMA_VERSION}); regenerate it with this version"
        )
    error = best_match(Draft202012Validator(RESULTS).iter_errors(data))
    if error is not None:
        raise ResultsFormatError(f"{source}: {_where(error.absolute_path)}: {error.message}")
    check_cells(data["cells"], source)


#: How far a stored rate may be from a count over ``n`` (float rounding of ``k / n``).
RATE_TOLERANCE = 1e-6


def check_cells(cells: list[dict[str, Any]], source: str) -> None:
    """Cells a table may compute from: each (shift, severity, seed) once, and each scored
    cell's accuracy, error and reference accuracy counts over its ``n`` images (an
    open-set cell's: its ``n_known`` in-distribution images) (accuracy + error = 1;
    accuracy x n a whole number of images). ``ResultsFormatError`` names the
    cell otherwise: an edited or merged-by-hand file is refused, never averaged."""
    seen: dict[tuple[Any, Any, Any], int] = {}
    for i, c in enumerate(cells):
        key = (c["shift"], c["severity"], c["seed"])
        where = f"{source}: cells[{i}] (shift {key[0]}, severity {key[1]}, seed {key[2]})"
        if key in seen:
            raise ResultsFormatError(f"{where} repeats cells[{seen[key]}]: a duplicated cell")
        seen[key] = i
        n, acc = c.get("n"), c.get("accuracy")
        if c.get("diverged") or acc is None or not n:
            continue
        err = c.get("error")
        if err is not None and abs(acc + err - 1.0) > RATE_TOLERANCE:
            raise ResultsFormatError(f"{where}: accuracy {acc} and error {err} do not add to 1")
        # an open-set cell's rates count its in-distribution rows (``n_known``)
        known = c.get("n_known") or n
        for name in ("accuracy", "reference_accuracy"):
            rate = c.get(name)
            if rate is not None and abs(rate * known - round(rate * known)) > RATE_TOLERANCE * n:
                raise ResultsFormatError(
                    f"{where}: {name} {rate} is no count of its {known} "
                    f"{'in-distribution ' if known != n else ''}images ({rate * known:.4f})"
                )
