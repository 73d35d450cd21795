"""``tta-bench rescore``: every registered metric recomputed from a run's per-sample
outputs (``log_samples=logits``; ``tta_bench.run.samples``), without adapting again.

The metrics are the same functions the runner applies (``tta_bench.metrics.compute_all``,
through ``samples.score_rows``) to the same float32 logits, so a metric stored in the
results file is reproduced exactly; a metric registered after the run is computed for the
first time. Every cell file must be the run's own (``samples.verify_cell``: its identity,
cell, method, row count and the digest of its data pages), or nothing is scored.

``write=True`` stores every recomputed figure (the metrics, ``error``, the reference
accuracy when its rows were logged) in the cells and the summary, under the results lock:
the new record is checked against the results schema first (a record readers would refuse
is never written), the previous file is kept beside it as ``<name>.bak``, and the new one
replaces it atomically.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tta_bench.run import results, samples
from tta_bench.run.shard import record_ood_score

#: Figures ``samples.score_rows`` derives beside the registered metrics.
DERIVED = ("error", "reference_accuracy", "n_known", "n_ood", "per_class_accuracy")


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
    """``(record, {cell key: {figure: value}})`` for every scored cell of results ``path``,
    each cell's rows verified to be the run's own first (``ValueError`` naming the file)."""
    path = Path(path)
    record = results.load_results(path)
    folder = samples.samples_dir(path)
    if not folder.is_dir():
        raise ValueError(
            f"{path}: no per-sample folder {str(folder)!r}; rerun into a new --output with "
            "log_samples=logits to rescore"
        )
    run_key = results.record_key(record, with_weights=True)
    label, ood_score = samples.method_label(record), record_ood_score(record)
    out = {}
    for cell in record["cells"]:
        if cell.get("diverged"):
            continue  # reported, never scored
        key = results.cell_key(cell)
        found = samples.open_cell(folder, *key)
        samples.verify_cell(found, run_key=run_key, key=key, method=label, n=cell["n"])
        rows = samples.cell_rows(found.table, key, str(found.path))
        out[key] = samples.score_rows(
            rows, ood_score=ood_score, per_class="per_class_accuracy" in cell
        )
    return record, out


def rescore(path: str | Path, write: bool = False) -> list[MetricCheck]:
    """Recompute every registered metric of results ``path`` (see the module docstring)."""
    record, values = recompute(path)
    names = sorted({m for v in values.values() for m in v if m not in DERIVED})
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
        write_rescored(Path(path), values)
    return checks


def backup_path(path: str | Path) -> Path:
    """Where ``write=True`` keeps the previous results file: ``<name>.bak`` beside it (not
    ``*.json``, so a leaderboard over the folder never reads it as a run)."""
    path = Path(path)
    return path.with_name(path.name + ".bak")


def write_rescored(path: Path, values: dict[tuple[str, int, int], dict]) -> Path:
    """Store ``values`` in results ``path`` (see the module docstring); returns the backup."""
    from tta_bench.run.accounting import finite_or_none
    from tta_bench.run.schema import validate

    with results.results_lock(path):
        record = results.load_results(path)
        for cell in record["cells"]:
            key = results.cell_key(cell)
            if key in values:
                new = dict(values[key])
                if new.get("reference_accuracy") is None:  # not logged: keep the stored one
                    new.pop("reference_accuracy", None)
                cell.update(finite_or_none(new))
        record["summary"] = results.summarize(record["cells"])
        validate(record, f"{path} (rescored, not written)")
        backup = backup_path(path)
        shutil.copy2(path, backup)
        results.write_json_atomic(path, record)
    return backup
