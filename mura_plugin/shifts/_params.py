"""Severity parameter tables: looking a value up, with errors that list the options."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

TABLES = ("cifar", "imagenet", "digits")


def severity_param(
    name: str, tables: Mapping[str, Sequence[Any]], table: str, severity: int
) -> Any:
    if table not in tables:
        raise ValueError(
            f"shift {name!r} has no severity table {table!r}; available: {', '.join(tables)}"
        )
    if not 1 <= int(severity) <= len(tables[table]):
        raise ValueError(f"shift {name!r}: severity must be in 1..5, got {severity!r}")
    return tables[table][int(severity) - 1]


def check_images(name: str, images: torch.Tensor) -> None:
    if images.dim() != 4 or images.shape[1] not in (1, 3) or not images.is_floating_point():
        raise ValueError(
            f"shift {name!r} expects float images [B, C, H, W] in [0, 1], got "
            f"{tuple(images.shape)} {images.dtype}"
        )
