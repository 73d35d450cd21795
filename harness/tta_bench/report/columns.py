"""How tables show metrics: a metric's column (label, scale, decimals, order) comes from its
catalogue entry, and the columns of a table are the metrics its cells hold, so a newly
registered metric reaches the summary, ``tta-bench table`` and the leaderboard without
editing them. Imports no torch: tables are read from results files only.

A metric that reads the softmax of a method's outputs as its predicted probabilities
(likelihood, calibration) means nothing for a method whose outputs are scores
(``Method.scores_are_logits`` False, recorded in its results): tables print
``NOT_PROBABILITIES`` there instead of the number (``shown``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

#: The metric every table shows in its own column (with its interval), not among the others.
PRIMARY = "accuracy"
#: The built-in metrics of predicted probabilities (the softmax of a method's outputs); a
#: metric's catalogue entry may say so itself (``table: {probabilistic: true}``).
PROBABILITY_METRICS = ("nll", "ece", "ece20")
#: What a table prints for such a metric of a method whose outputs are scores, not logits.
NOT_PROBABILITIES = "n/a"


@dataclass(frozen=True)
class MetricColumn:
    """How tables show a metric: its column ``label``, the ``scale`` its mean is multiplied
    by (100 for a fraction shown in percent) and the ``decimals`` printed; from the
    metric's catalogue entry (``table: {label, scale, decimals, order}``), else its name,
    1 and 3. ``probabilistic``: the metric reads the outputs as predicted probabilities."""

    name: str
    label: str
    scale: float = 1.0
    decimals: int = 3
    order: int = 100
    probabilistic: bool = False

    def format(self, value: float) -> str:
        return f"{self.scale * value:.{self.decimals}f}"


def column(name: str) -> MetricColumn:
    """The ``MetricColumn`` of metric ``name`` (catalogue metadata; reads YAML only)."""
    from tta_bench import catalog

    meta = catalog.entry("metrics", name).get("table") or {}
    return MetricColumn(
        name=name,
        label=str(meta.get("label", name)),
        scale=float(meta.get("scale", 1.0)),
        decimals=int(meta.get("decimals", 3)),
        order=int(meta.get("order", 100)),
        probabilistic=bool(meta.get("probabilistic", name in PROBABILITY_METRICS)),
    )


def scores_are_logits(record: dict[str, Any]) -> bool:
    """Whether ``record``'s method returns logits of a probability model (its results'
    ``scores_are_logits``; files written before it was recorded: True)."""
    return record.get("scores_are_logits", True) is not False


def shown(col: MetricColumn, record: dict[str, Any]) -> bool:
    """Whether tables print ``col``'s figure for ``record``: every metric but a
    probabilistic one of a method whose outputs are scores (``NOT_PROBABILITIES``)."""
    return not col.probabilistic or scores_are_logits(record)


def metric_names() -> list[str]:
    """Every metric installed or described in a catalogue, by name (no import of the
    metric functions, so reading tables imports no plugin code)."""
    from tta_bench import catalog
    from tta_bench.registry import registry

    # in-process metrics (``register_metric``) exist only once that module was imported
    metrics = sys.modules.get("tta_bench.metrics")
    local = getattr(metrics, "METRICS", {})
    return sorted({*registry("metrics").names(), *catalog.catalog()["metrics"], *local})


def table_columns(cells: Iterable[dict[str, Any]]) -> list[MetricColumn]:
    """The columns of the metrics other than ``PRIMARY`` that ``cells`` hold, in catalogue
    order (``table.order``), then by name: what the summary tables, the leaderboard and
    a results file's summary show, so a newly registered metric reaches them all."""
    present = {k for c in cells for k, v in c.items() if isinstance(v, (int, float))}
    names = [n for n in metric_names() if n != PRIMARY and n in present]
    return sorted((column(n) for n in names), key=lambda c: (c.order, c.name))
