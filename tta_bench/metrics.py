"""Per-cell metrics computed by the runner from the cell's logits and labels (labels never
reach the method). A metric is ``fn(logits [N, C] float, labels [N] int64) -> float``;
plugins add metrics through ``register_metric``."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Metric = Callable[[torch.Tensor, torch.Tensor], float]


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return int((logits.argmax(dim=1) == labels).sum()) / max(len(labels), 1)


def nll(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean negative log-likelihood of the true class (nats)."""
    return float(F.cross_entropy(logits.float(), labels))


METRICS: dict[str, Metric] = {"accuracy": accuracy, "nll": nll}


def register_metric(name: str, fn: Metric) -> None:
    if name in METRICS:
        raise ValueError(f"metric {name!r} is already registered ({METRICS[name]!r})")
    METRICS[name] = fn


def compute_all(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    return {name: fn(logits, labels) for name, fn in METRICS.items()}
