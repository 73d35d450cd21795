"""Per-cell metrics computed by the runner from the cell's logits and labels (labels never
reach the method). A metric is ``fn(logits [N, C] float, labels [N] int64) -> float``.

Built in: ``accuracy`` (fraction), ``nll`` (nats), ``ece`` (15 equal-width confidence
bins, a fraction), ``ece20`` (C-TPT's 20 bins), and the open-set metrics ``auroc``, ``aupr``,
``fpr95`` (``tta_bench.run.openset``; computed only in cells that hold out-of-distribution
rows, where the others score the in-distribution rows alone), registered through the
``tta_bench.metrics`` entry-point group like any plugin's metric (each one is computed for
every cell and stored under its name); in-process metrics go through ``register_metric``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Metric = Callable[[torch.Tensor, torch.Tensor], float]

ECE_BINS = 15


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return int((logits.argmax(dim=1) == labels).sum()) / max(len(labels), 1)


def nll(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean negative log-likelihood of the true class (nats)."""
    return float(F.cross_entropy(logits.float(), labels))


def expected_calibration_error(
    logits: torch.Tensor, labels: torch.Tensor, n_bins: int = ECE_BINS
) -> float:
    """ECE (Guo et al. 2017): the confidence (max softmax probability) falls into one of
    ``n_bins`` equal-width bins ``(k/n, (k+1)/n]``; ECE = sum over bins of
    ``|bin| / N * |accuracy(bin) - mean confidence(bin)|``. A fraction in [0, 1]."""
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(
            f"expected logits [N, C] and labels [N], got {tuple(logits.shape)} and "
            f"{tuple(labels.shape)}"
        )
    if len(labels) == 0:
        return 0.0
    probs = torch.softmax(logits.double(), dim=1)
    confidence, prediction = probs.max(dim=1)
    correct = (prediction == labels).double()
    inner_edges = torch.linspace(0.0, 1.0, n_bins + 1, dtype=torch.float64)[1:-1]
    bins = torch.bucketize(confidence, inner_edges)  # (lo, hi] -> bin index
    conf_sum = torch.bincount(bins, weights=confidence, minlength=n_bins)
    acc_sum = torch.bincount(bins, weights=correct, minlength=n_bins)
    return float((conf_sum - acc_sum).abs().sum() / len(labels))


#: C-TPT's ECE: 20 equal-width bins (tpt_classification.py ``ECE_Loss(20, ...)``).
CTPT_ECE_BINS = 20


def ece_ctpt(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """ECE as C-TPT (Yoon et al., ICLR 2024) computes it, the figure TTA-VLM's calibration
    tables report: 20 equal-width bins ``(k/20, (k+1)/20]`` on the maximum softmax
    probability (its ``ECE_Loss``; a confidence of exactly 0, which a softmax never gives,
    would fall in no bin there). A fraction; C-TPT prints it times 100."""
    return expected_calibration_error(logits, labels, n_bins=CTPT_ECE_BINS)


def per_class_accuracy(
    logits: torch.Tensor, labels: torch.Tensor, num_classes: int
) -> list[float | None]:
    """Accuracy of each class ``0..num_classes-1`` (recall); None for a class absent from
    ``labels``."""
    pred = logits.argmax(dim=1)
    out: list[float | None] = []
    for k in range(num_classes):
        mask = labels == k
        n = int(mask.sum())
        out.append(int((pred[mask] == k).sum()) / n if n else None)
    return out


#: In-process metrics (tests, notebooks). The built-in ones above are registered like any
#: plugin's, through this distribution's ``tta_bench.metrics`` entry points.
METRICS: dict[str, Metric] = {}


def register_metric(name: str, fn: Metric) -> None:
    """Add an in-process metric (tests, notebooks); installed plugins use the
    ``tta_bench.metrics`` entry-point group instead."""
    if name in METRICS:
        raise ValueError(f"metric {name!r} is already registered ({METRICS[name]!r})")
    METRICS[name] = fn


def all_metrics() -> dict[str, Metric]:
    """Metrics from entry points (built-in and plugins, by name), then in-process ones."""
    from tta_bench.registry import RegistryError, registry

    plugins = registry("metrics")
    out = {name: plugins.get(name) for name in plugins.names()}
    for name, fn in METRICS.items():
        if name in out:
            origin = plugins.origin(name)
            raise RegistryError(
                f"metric {name!r} registered in-process clashes with {origin.value} from "
                f"{origin.distribution}; rename it"
            )
        out[name] = fn
    return out


def is_open_set(fn: Metric) -> bool:
    """Whether metric ``fn`` scores out-of-distribution detection (``fn.open_set``): it takes
    the whole cell, label -1 marking the OOD rows, and ``score=`` (``tta_bench.run.openset``)."""
    return bool(getattr(fn, "open_set", False))


def compute_all(
    logits: torch.Tensor, labels: torch.Tensor, ood_score: str = "msp"
) -> dict[str, float]:
    """Every metric of ``all_metrics()`` on one cell: ``{name: float}``. In an open-set cell
    (some labels -1: out-of-distribution rows) the closed-set metrics are computed on the
    in-distribution rows only and the open-set metrics (``is_open_set``) on the whole cell
    with the OOD score ``ood_score``; elsewhere the open-set metrics are left out."""
    known = labels >= 0
    open_set = not bool(known.all())
    closed = (logits[known], labels[known]) if open_set else (logits, labels)
    out = {}
    for name, fn in all_metrics().items():
        if is_open_set(fn):
            if open_set and bool(known.any()):
                out[name] = float(fn(logits, labels, score=ood_score))  # type: ignore[call-arg]
        else:
            out[name] = float(fn(*closed))
    return out
