"""Severity parameter tables: looking a value up, with errors that list the options, and the
rule that adapts spatial parameters to image sizes other than a table's native size."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

TABLES = ("cifar", "imagenet", "digits")

#: The image side (pixels) each table's spatial parameters were written for.
TABLE_SIZE = {"cifar": 32, "imagenet": 224, "digits": 32}


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
