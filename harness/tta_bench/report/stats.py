"""Statistics over seeds: mean, spread and 95% confidence intervals, and paired comparisons
against a baseline, computed from results records only (``results.load_results``).

The replicate is the seed: a suite figure is first averaged over the cells (shift x
severity) of one seed, then summarised over seeds with a Student t interval. A paired
comparison pairs a method's and a baseline's figures on the same (shift, severity, seed)
cells, so the stream, shift noise and order are identical on both sides and only the
method differs. Records from different protocols are never compared.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Pairing units of a paired comparison.
UNITS = ("seed", "cell")
#: Tests of a paired comparison.
TESTS = ("t", "bootstrap")

CellKey = tuple[str, int, int]  # (shift, severity, seed)


class ProtocolMismatchError(ValueError):
    """Two records were produced under different protocols and must not be compared."""


class ModelMismatchError(ValueError):
    """Two records were produced with different model weights and must not be compared."""


def model_hash(record: dict[str, Any]) -> str | None:
    """The SHA-256 of the loaded weights a record was produced with."""
    return (record.get("model") or {}).get("state_sha256")


@dataclass(frozen=True)
class Estimate:
    """Mean of ``n`` replicates with the sample standard deviation (``ddof=1``) and a
    two-sided Student t confidence interval; ``std`` and the interval are ``None`` with
    fewer than two replicates."""

    mean: float
    std: float | None
    n: int
    ci_low: float | None
    ci_high: float | None
    confidence: float = 0.95

    @property
    def half_width(self) -> float | None:
        if self.ci_low is None or self.ci_high is None:
            return None
        return (self.ci_high - self.ci_low) / 2


@dataclass(frozen=True)
class PairedComparison:
    """``method - baseline`` on paired units; ``p_value`` tests a zero mean difference
    (two-sided). Interval and p-value are ``None`` when they are undefined (one pair, or
    identical differences under the t test)."""

    method: str
    baseline: str
    key: str
    unit: str
    test: str
    n_pairs: int
    mean_difference: float
    ci_low: float | None
    ci_high: float | None
    p_value: float | None
    confidence: float = 0.95


def describe(values: Iterable[float], confidence: float = 0.95) -> Estimate:
    """Mean, sample std and the Student t interval ``mean ± t_{(1+c)/2, n-1} s / sqrt(n)``."""
    # ``scipy.special.stdtrit`` is what ``scipy.stats.t.ppf`` evaluates (the same values,
    # tested), without importing ``scipy.stats`` (most of a second for every command that
    # prints a summary).
    from scipy.special import stdtrit

    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("describe() needs at least one value")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    mean = statistics.fmean(vals)
    if len(vals) < 2:
        return Estimate(mean, None, len(vals), None, None, confidence)
    std = statistics.stdev(vals)
    half = float(stdtrit(len(vals) - 1, (1 + confidence) / 2)) * std / math.sqrt(len(vals))
    return Estimate(mean, std, len(vals), mean - half, mean + half, confidence)


def cell_values(record: dict[str, Any], key: str = "accuracy") -> dict[CellKey, float]:
    """``{(shift, severity, seed): value}`` of every cell that holds ``key``."""
    out: dict[CellKey, float] = {}
    for c in record["cells"]:
        if c.get(key) is not None:
            out[(str(c["shift"]), int(c["severity"]), int(c["seed"]))] = float(c[key])
    return out


def per_seed_means(values: dict[CellKey, float]) -> dict[int, float]:
    """The mean over a seed's cells, per seed (sorted by seed)."""
    by_seed: dict[int, list[float]] = defaultdict(list)
    for (_shift, _sev, seed), v in values.items():
        by_seed[seed].append(v)
    return {s: statistics.fmean(v) for s, v in sorted(by_seed.items())}


def diverged_cells(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The cells of a record that diverged (reported, never scored)."""
    return [c for c in record["cells"] if c.get("diverged")]


def suite_estimate(
    record: dict[str, Any], key: str = "accuracy", confidence: float = 0.95
) -> Estimate | None:
    """The suite figure over seeds (each seed: mean over its cells); None if no cell has
    ``key``, or if any cell diverged (a mean without it would flatter the method)."""
    if diverged_cells(record):
        return None
    per_seed = per_seed_means(cell_values(record, key))
    return describe(per_seed.values(), confidence) if per_seed else None


def cell_estimates(
    record: dict[str, Any], key: str = "accuracy", confidence: float = 0.95
) -> dict[tuple[str, int], Estimate]:
    """Per (shift, severity) cell: the estimate over seeds, in the record's cell order."""
    grouped: dict[tuple[str, int], list[float]] = {}
    for (shift, sev, _seed), v in cell_values(record, key).items():
        grouped.setdefault((shift, sev), []).append(v)
    return {k: describe(v, confidence) for k, v in grouped.items()}


def check_same_protocol(record: dict[str, Any], other: dict[str, Any]) -> None:
    """Raise ``ProtocolMismatchError`` naming both ids and the fields that differ, or
    ``ModelMismatchError`` when the two were produced with different model weights (the
    same model name with other weights is another model)."""
    a, b = record["protocol"], other["protocol"]
    if a["id"] == b["id"]:
        ha, hb = model_hash(record), model_hash(other)
        if ha != hb:
            raise ModelMismatchError(
                f"cannot compare {record['method']!r} with {other['method']!r}: their model "
                f"weights differ ({record['model']['name']} {str(ha)[:12]} vs "
                f"{other['model']['name']} {str(hb)[:12]}); rerun one with the other's weights"
            )
        return
    fields = sorted(k for k in set(a) | set(b) if k != "id" and a.get(k) != b.get(k))
    diff = "; ".join(f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in fields) or "unknown fields"
    raise ProtocolMismatchError(
        f"cannot compare {record['method']!r} ({a['id']}) with {other['method']!r} "
        f"({b['id']}): results from different protocols measure different things ({diff}); "
        f"rerun one of them under the other's protocol"
    )


def reference_method() -> str | None:
    """The catalogues' reference method (``defaults: reference``, the frozen model), or None
    when no installed catalogue names one."""
    from tta_bench import catalog

    return catalog.default_or_none("reference")


def reference_label() -> str:
    """The label of a run's own reference cells: ``<reference method> (reference)``."""
    return f"{reference_method() or 'frozen model'} (reference)"


def reference_record(record: dict[str, Any]) -> dict[str, Any]:
    """The frozen source model as a baseline record: the runner scored it on the identical
    stream of every cell (``reference_accuracy``), so it pairs exactly with the method."""
    cells = [c for c in record["cells"] if c.get("reference_accuracy") is not None]
    if not cells:
        raise ValueError(
            f"results of {record['method']!r} hold no reference accuracy (run with "
            f"reference=true, or pass a results file of the baseline method)"
        )
    return {
        **record,
        "method": reference_label(),
        "cells": [{**c, "accuracy": c["reference_accuracy"]} for c in cells],
    }


def paired_comparison(
    record: dict[str, Any],
    baseline: dict[str, Any],
    key: str = "accuracy",
    unit: str = "seed",
    test: str = "t",
    confidence: float = 0.95,
    n_resamples: int = 10_000,
    rng_seed: int = 0,
) -> PairedComparison:
    """``record - baseline`` on the cells both hold.

    ``unit="seed"``: one pair per seed (the mean over that seed's common cells), the
    replicate the seeds make independent; ``unit="cell"``: one pair per (shift, severity,
    seed). ``test="t"``: paired Student t interval and p-value (``scipy.stats.ttest_1samp``
    on the differences); ``test="bootstrap"``: percentile interval of the mean difference
    over ``n_resamples`` resamples of the pairs (fixed ``rng_seed``: reproducible), and the
    two-sided p-value of the shifted-null bootstrap ``(#{|d*-d| >= |d|} + 1) / (B + 1)``.
    The bootstrap needs many pairs: with three seeds there are only ten distinct resamples
    and its interval is far too narrow; use the t test there (or ``unit="cell"``).
    """
    if unit not in UNITS:
        raise ValueError(f"unknown pairing unit {unit!r}; available: {', '.join(UNITS)}")
    if test not in TESTS:
        raise ValueError(f"unknown test {test!r}; available: {', '.join(TESTS)}")
    check_same_protocol(record, baseline)
    mine, theirs = cell_values(record, key), cell_values(baseline, key)
    common = sorted(set(mine) & set(theirs))
    if not common:
        raise ValueError(
            f"{record['method']!r} and {baseline['method']!r} share no (shift, severity, seed) "
            f"cell with {key!r}: seeds {sorted({k[2] for k in mine})} vs "
            f"{sorted({k[2] for k in theirs})}"
        )
    if unit == "cell":
        diffs = [mine[k] - theirs[k] for k in common]
    else:
        a = per_seed_means({k: mine[k] for k in common})
        b = per_seed_means({k: theirs[k] for k in common})
        diffs = [a[s] - b[s] for s in a]
    d = np.asarray(diffs, dtype=np.float64)
    mean = float(d.mean())
    lo = hi = p = None
    if len(d) >= 2 and test == "t":
        est = describe(d, confidence)
        lo, hi = est.ci_low, est.ci_high
        if est.std:  # all-equal differences: the t statistic is undefined
            from scipy import stats as sps

            p = float(sps.ttest_1samp(d, 0.0).pvalue)
    elif len(d) >= 2:
        rng = np.random.default_rng(rng_seed)
        boot = d[rng.integers(0, len(d), size=(n_resamples, len(d)))].mean(axis=1)
        alpha = (1 - confidence) / 2
        lo, hi = (float(q) for q in np.quantile(boot, [alpha, 1 - alpha]))
        extreme = int(np.count_nonzero(np.abs(boot - mean) >= abs(mean)))
        p = (extreme + 1) / (n_resamples + 1)
    return PairedComparison(
        method=record["method"],
        baseline=baseline["method"],
        key=key,
        unit=unit,
        test=test,
        n_pairs=len(d),
        mean_difference=mean,
        ci_low=lo,
        ci_high=hi,
        p_value=p,
        confidence=confidence,
    )


#: The share of the worst replicates the Expected Tail Accuracy averages.
TAIL_FRACTION = 0.1


@dataclass(frozen=True)
class OrderSpread:
    """A figure over many stream orders (``protocol.orders``): the estimate over orders,
    the central 95% of the orders' values (``low``, ``high``: the 2.5th and 97.5th
    percentiles) and the Expected Tail Accuracy (``tail``: the mean of the worst
    ``TAIL_FRACTION`` of orders, at least one)."""

    estimate: Estimate
    low: float
    high: float
    tail: float
    tail_n: int


def tail_mean(values: Iterable[float], fraction: float = TAIL_FRACTION) -> tuple[float, int]:
    """``(mean of the lowest ceil(fraction * n) values, how many)``: the Expected Tail
    Accuracy of Fuchs et al. (OGA, 2024) when the values are per-order accuracies."""
    vals = sorted(float(v) for v in values)
    if not vals:
        raise ValueError("tail_mean() needs at least one value")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    k = max(1, math.ceil(fraction * len(vals)))
    return statistics.fmean(vals[:k]), k


def order_spread(
    record: dict[str, Any], key: str = "accuracy", confidence: float = 0.95
) -> OrderSpread | None:
    """The suite figure over the stream orders of a record whose protocol has ``orders``
    (each order: the mean over its cells); None for other records, or when a cell
    diverged or none holds ``key``."""
    if not (record.get("protocol") or {}).get("orders") or diverged_cells(record):
        return None
    per_order = list(per_seed_means(cell_values(record, key)).values())
    if not per_order:
        return None
    low, high = (float(q) for q in np.quantile(per_order, [0.025, 0.975]))
    tail, k = tail_mean(per_order)
    return OrderSpread(describe(per_order, confidence), low, high, tail, k)
