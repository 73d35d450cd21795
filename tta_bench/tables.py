"""Tables rendered from results only (tabulate): the shift-wise accuracy table and the cost
table of one run. Values are accuracies in percent; with several seeds a cell reads
``mean ± std``."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from tabulate import tabulate

FORMATS = {
    "github": "github",
    "markdown": "github",
    "latex": "latex_booktabs",
    "csv": "csv",
    "html": "html",
    "plain": "simple",
}


def _fmt(values: list[float], digits: int = 1) -> str:
    if not values:
        return "-"
    mean = 100 * statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {100 * statistics.stdev(values):.{digits}f}"


def _render(rows: list[list[Any]], headers: list[str], fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown table format {fmt!r}; available: {', '.join(FORMATS)}")
    if fmt == "csv":
        import csv
        import io

        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(headers)
        writer.writerows(rows)
        return buf.getvalue().rstrip("\n")
    return tabulate(rows, headers=headers, tablefmt=FORMATS[fmt], disable_numparse=True)


def _per_seed_means(cells: list[dict[str, Any]], key: str) -> list[float]:
    by_seed: dict[int, list[float]] = defaultdict(list)
    for c in cells:
        if c.get(key) is not None:
            by_seed[c["seed"]].append(c[key])
    return [statistics.fmean(v) for _, v in sorted(by_seed.items())]


def shift_table(record: dict[str, Any], fmt: str = "plain") -> str:
    """Rows: shifts in protocol order, then the mean; columns: severities, mean, and the
    zero-shot reference with the delta when the run scored it."""
    cells = record["cells"]
    shifts = list(dict.fromkeys(c["shift"] for c in cells))
    severities = sorted({c["severity"] for c in cells})
    has_ref = record["method"] != "zeroshot" and all(
        c.get("reference_accuracy") is not None for c in cells
    )
    headers = ["shift", *[f"sev {s}" for s in severities], "mean"]
    if has_ref:
        headers += ["zero-shot", "Δ"]
    rows = []
    for shift in [*shifts, None]:
        sel = [c for c in cells if shift is None or c["shift"] == shift]
        row: list[Any] = [shift or "mean"]
        for s in severities:
            row.append(_fmt(_per_seed_means([c for c in sel if c["severity"] == s], "accuracy")))
        acc = _per_seed_means(sel, "accuracy")
        row.append(_fmt(acc))
        if has_ref:
            ref = _per_seed_means(sel, "reference_accuracy")
            row.append(_fmt(ref))
            row.append(f"{100 * (statistics.fmean(acc) - statistics.fmean(ref)):+.1f}")
        rows.append(row)
    return _render(rows, headers, fmt)


def cost_table(record: dict[str, Any], fmt: str = "plain") -> str:
    """Time per sample (split data / method), data-wait share, peak memory, parameters and
    passes per sample, averaged over cells."""
    cells = record["cells"]

    def mean(key: str) -> float:
        return statistics.fmean(float(c[key]) for c in cells)

    params = record.get("parameters") or {}
    headers = [
        "method",
        "ms/sample",
        "method ms",
        "data ms",
        "data wait",
        "peak MB",
        "trainable params",
        "fwd/sample",
        "bwd/sample",
    ]
    row = [
        record["method"],
        f"{1e3 * mean('time_per_sample_s'):.2f}",
        f"{1e3 * mean('method_time_per_sample_s'):.2f}",
        f"{1e3 * mean('data_time_per_sample_s'):.2f}",
        f"{100 * mean('data_wait_share'):.0f}%",
        f"{max(c['peak_memory_bytes'] for c in cells) / 2**20:.1f}",
        f"{params.get('trainable', 0):,}",
        f"{mean('forward_passes_per_sample'):.1f}",
        f"{mean('backward_passes_per_sample'):.1f}",
    ]
    return _render([row], headers, fmt)
