"""``tta-bench rescore``: every registered metric recomputed from a run's per-sample
outputs (``log_samples=logits``; ``tta_bench.run.samples``), without adapting again.

The metrics are the same functions the runner applies (``tta_bench.metrics.compute_all``)
to the same float32 logits, so a metric stored in the results file is reproduced exactly;
a metric registered after the run is computed for the first time. ``write=True`` stores
the recomputed values in the cells and the summary (atomically, under the results lock).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tta_bench import metrics
from tta_bench.run import results, samples
from tta_bench.run.shard import record_ood_score


@dataclass
class MetricCheck:
    """One metric over a run's scored cells: how many cells stored it, the largest
    difference between stored and recomputed values, and the recomputed suite mean."""

    name: str
    cells: int
    stored: int
    max_difference: float | None
    mean: float


def recompute(path: str | Path) -> tuple[dict[str, Any], dict[tuple[str, int, int], dict]]:
    """``(record, {cell key: {metric: value}})`` for every scored cell of results ``path``."""
    path = Path(path)
    record = results.load_results(path)
    folder = samples.samples_dir(path)
    if not folder.is_dir():
        raise ValueError(
            f"{path}: no per-sample folder {str(folder)!r}; rerun into a new --output with "
            "log_samples=logits to rescore"
        )
    out = {}
    for cell in record["cells"]:
        if cell.get("diverged"):
            continue  # reported, never scored
        key = results.cell_key(cell)
        table = samples.read_cell(folder, *key)
        logits, labels = samples.logits_and_labels(table, str(samples.cell_file(folder, *key)))
        if len(labels) != cell["n"]:
            raise ValueError(
                f"{path}: cell {key} holds {cell['n']} samples, its per-sample file "
                f"{len(labels)}: they are not from the same run"
            )
        import torch

        out[key] = metrics.compute_all(
            torch.from_numpy(logits), torch.from_numpy(labels), record_ood_score(record)
        )
    return record, out


def rescore(path: str | Path, write: bool = False) -> list[MetricCheck]:
    """Recompute every registered metric of results ``path`` (see the module docstring)."""
    record, values = recompute(path)
    names = sorted({m for v in values.values() for m in v})
    checks = []
    for name in names:
        diffs = [
            abs(float(c[name]) - values[results.cell_key(c)][name])
            for c in record["cells"]
            if results.cell_key(c) in values and c.get(name) is not None
        ]
        mean = sum(v[name] for v in values.values()) / len(values)
        checks.append(
            MetricCheck(name, len(values), len(diffs), max(diffs) if diffs else None, mean)
        )
    if write:
        _write(Path(path), values)
    return checks


def _write(path: Path, values: dict[tuple[str, int, int], dict]) -> None:
    from tta_bench.run.accounting import finite_or_none

    with results.results_lock(path):
        record = results.load_results(path)
        for cell in record["cells"]:
            key = results.cell_key(cell)
            if key in values:
                cell.update(finite_or_none(dict(values[key])))
        record["summary"] = results.summarize(record["cells"])
        results.write_json_atomic(path, record)
