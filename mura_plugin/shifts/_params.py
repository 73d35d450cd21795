"""Severity parameter tables: reading them (``severities.json``), looking a value up, with
errors that list the options, and the rule that adapts spatial parameters to image sizes
other than a table's native size."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from importlib.resources import files
from typing import Any

import torch

TABLES = ("cifar", "imagenet", "digits")

#: The image side (pixels) each table's spatial parameters were written for.
TABLE_SIZE = {"cifar": 32, "imagenet": 224, "digits": 32}

#: The data file holding every kernel's severity tables, beside this module.
SEVERITIES_FILE = "severities.json"


def _tuples(value: Any) -> Any:
    """JSON lists as tuples, nested ones too (numbers stay as parsed: int or float)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


@lru_cache(maxsize=1)
def _severities() -> dict[str, dict[str, tuple[Any, ...]]]:
    """Every shift's tables from ``SEVERITIES_FILE`` (read once): shift -> table -> the
    parameters of severities 1..5, with the table names ``TABLES`` in that order."""
    text = files(__package__).joinpath(SEVERITIES_FILE).read_text(encoding="utf-8")
    shifts = json.loads(text)["tables"]
    for shift, tables in shifts.items():
        if tuple(tables) != TABLES or any(len(v) != 5 for v in tables.values()):
            raise ValueError(
                f"{SEVERITIES_FILE}: shift {shift!r} needs tables {TABLES} of five severities"
            )
    return {shift: {t: _tuples(v) for t, v in tables.items()} for shift, tables in shifts.items()}


def severity_table(
    shift: str, *, times: Mapping[str, int | float] | None = None
) -> dict[str, tuple[Any, ...]]:
    """A new dict ``table -> (severity 1 .. severity 5 parameters)`` of ``shift``'s tables in
    ``SEVERITIES_FILE`` (a kernel module's constant, e.g. ``noise.GAUSSIAN_NOISE``; a fresh
    dict per call, so changing one, as ``benchmarks/calibrate_digits.py`` does, changes no
    other). ``times={table: side}`` multiplies every parameter of those tables'
    rows by ``side`` (``side * value``), for tables written as fractions of an image side."""
    tables = dict(_severities()[shift])
    for table, side in (times or {}).items():
        tables[table] = tuple(tuple(side * v for v in row) for row in tables[table])
    return tables


def severity_param(
    name: str, tables: Mapping[str, Sequence[Any]], table: str, severity: int
) -> Any:
    """``tables[table][severity - 1]``; a ``ValueError`` naming the options otherwise."""
    if table not in tables:
        raise ValueError(
            f"shift {name!r} has no severity table {table!r}; available: {', '.join(tables)}"
        )
    if isinstance(severity, bool) or not isinstance(severity, int):
        raise ValueError(f"shift {name!r}: severity must be an int in 1..5, got {severity!r}")
    if not 1 <= severity <= len(tables[table]):
        raise ValueError(f"shift {name!r}: severity must be in 1..5, got {severity!r}")
    return tables[table][severity - 1]


def check_images(name: str, images: torch.Tensor) -> None:
    """Reject anything but a float ``[B, C, H, W]`` batch with 1 or 3 channels."""
    if images.dim() != 4 or images.shape[1] not in (1, 3) or not images.is_floating_point():
        raise ValueError(
            f"shift {name!r} expects float images [B, C, H, W] in [0, 1], got "
            f"{tuple(images.shape)} {images.dtype}"
        )


def spatial_scale(table: str, images: torch.Tensor) -> float:
    """Factor applied to a table's spatial parameters (pixels) for this image size.

    ``min(H, W) / TABLE_SIZE[table]``: 1.0 at the table's native size (so the table is used
    verbatim), e.g. 2.0 for 64 px images under the ``cifar`` table.
    """
    if table not in TABLE_SIZE:
        raise ValueError(f"unknown severity table {table!r}; available: {', '.join(TABLE_SIZE)}")
    return min(images.shape[-2:]) / TABLE_SIZE[table]
