"""Per-sample paired statistics: two runs of one protocol and one set of weights compared on
the very samples both classified, from their per-sample files (``log_samples=true``;
``tta_bench.run.samples``), not only on their seed means.

Three seeds give a seed-level test (``stats.paired_comparison``) three pairs, so it sees
only large differences. The per-sample files hold every scored sample of every cell, and
the streams of two runs of one protocol are identical (same samples, same order, same
batches), so each sample is a pair: was it right under A, under B? ``load_pairs`` builds
those pairs (and refuses streams that differ), ``mcnemar`` tests the discordant pairs
exactly, ``bootstrap`` gives an interval by resampling samples or whole stream batches (an
adapting method's predictions within a batch are not independent: the batch bootstrap
allows for that), ``benjamini_hochberg`` controls the false discovery rate over many
comparisons, ``minimum_detectable_effect`` says how small a difference a suite can see,
and ``tiers`` groups methods that cannot be told apart. ``compare`` gathers all of them
for ``tta-bench compare``; the leaderboard's per-sample table is built from the same parts
(``report.collect.sample_analysis``).

Accuracies and differences are fractions (``0.031`` is 3.1 points), as in the results
records and ``stats``; a difference is always A - B (method - baseline). Open-set rows
(label -1) are left out, as the accuracy of a cell leaves them out.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from tta_bench.report import stats
from tta_bench.run import results, samples

#: Resampling units of ``bootstrap``: single samples, or whole stream batches.
BOOTSTRAP_UNITS = ("sample", "batch")
#: Resampled index entries per chunk of the batch bootstrap (bounds its memory).
_CHUNK = 1 << 22

CellKey = tuple[str, int, int]  # (shift, severity, seed)
T = TypeVar("T", bound=Hashable)


@dataclass(frozen=True)
class PairedSamples:
    """Every sample both runs scored, aligned: ``a_correct[i]`` and ``b_correct[i]`` say
    whether A (``method``) and B (``baseline``) classified sample ``i`` correctly, and
    ``block[i]`` is the stream batch it was in (one id per seed, shift, severity and
    batch number). ``seeds`` and ``cells``: what the pairs cover."""

    method: str
    baseline: str
    a_correct: np.ndarray
    b_correct: np.ndarray
    block: np.ndarray
    seeds: tuple[int, ...] = ()
    cells: tuple[CellKey, ...] = ()

    def __post_init__(self) -> None:
        sizes = {len(self.a_correct), len(self.b_correct), len(self.block)}
        if len(sizes) != 1:
            raise ValueError(
                f"a_correct, b_correct and block must be aligned, got lengths "
                f"{len(self.a_correct)}, {len(self.b_correct)} and {len(self.block)}"
            )

    @property
    def n(self) -> int:
        return len(self.a_correct)

    @property
    def blocks(self) -> int:
        return len(np.unique(self.block))


@dataclass(frozen=True)
class McNemarResult:
    """The exact McNemar test: ``a_only`` samples only A classified right, ``b_only`` only
    B; ``p_value`` is the two-sided binomial test of ``a_only`` out of ``a_only + b_only``
    at one half (1 when no sample is discordant)."""

    n: int
    a_only: int
    b_only: int
    difference: float
    p_value: float

    @property
    def discordance(self) -> float:
        return (self.a_only + self.b_only) / self.n if self.n else 0.0


@dataclass(frozen=True)
class BootstrapResult:
    """A bootstrap of the accuracy difference over ``n_units`` samples or batches:
    percentile interval and the two-sided shifted-null p-value."""

    unit: str
    n_units: int
    n_resamples: int
    confidence: float
    difference: float
    ci_low: float
    ci_high: float
    p_value: float


# -- reading both runs' per-sample files -------------------------------------------------
@dataclass(frozen=True)
class CellRows:
    """One cell's rows as a per-sample file holds them (stream order)."""

    index: np.ndarray
    batch: np.ndarray
    label: np.ndarray
    prediction: np.ndarray
    reference: np.ndarray | None

    @functools.cached_property
    def known(self) -> np.ndarray:
        """The rows with an accuracy: an open-set cell's unknown rows (label -1) have none."""
        return self.label >= 0

    @functools.cached_property
    def correct(self) -> np.ndarray:
        """Whether each known row's prediction is its label."""
        return (self.prediction == self.label)[self.known]

    @functools.cached_property
    def blocks(self) -> np.ndarray:
        """The known rows' stream batches, numbered 0, 1, ... (a leaderboard pairs a run
        with many others: computed once)."""
        return np.unique(self.batch[self.known], return_inverse=True)[1].reshape(-1)


def _scored(record: dict[str, Any]) -> dict[CellKey, dict[str, Any]]:
    return {results.cell_key(c): c for c in record["cells"] if not c.get("diverged")}


def _rerun_hint(path: Path) -> str:
    return f"rerun {str(path)!r} with log_samples=true to compare per sample"


#: The columns a paired comparison reads of a cell file (``reference``: where logged).
PAIRED_COLUMNS = ("index", "batch", "label", "prediction", "reference")


def read_run(
    record: dict[str, Any], path: str | Path, keys: Sequence[CellKey] | None = None
) -> dict[CellKey, CellRows]:
    """The rows of the scored cells ``keys`` (default: all) of results ``path``, each file
    verified to be the run's own (``samples.verify_cell``); a missing folder or file is a
    ``ValueError`` naming it and saying to rerun with ``log_samples=true``."""
    path = Path(path)
    folder = samples.samples_dir(path)
    if not folder.is_dir():
        raise ValueError(f"{path}: no per-sample folder {str(folder)!r}; {_rerun_hint(path)}")
    cells = _scored(record)
    run_key = results.record_key(record, with_weights=True)
    label = samples.method_label(record)
    out: dict[CellKey, CellRows] = {}
    for key in cells if keys is None else keys:
        file = samples.cell_file(folder, *key)
        if not file.is_file():
            raise ValueError(f"{path}: no per-sample file {str(file)!r}; {_rerun_hint(path)}")
        found = samples.open_cell(folder, *key, columns=PAIRED_COLUMNS)
        samples.verify_cell(found, run_key=run_key, key=key, method=label, n=int(cells[key]["n"]))
        table = found.table
        out[key] = CellRows(
            index=table.column("index").to_numpy().astype(np.int64),
            batch=table.column("batch").to_numpy().astype(np.int64),
            label=table.column("label").to_numpy().astype(np.int64),
            prediction=table.column("prediction").to_numpy().astype(np.int64),
            reference=samples.references(table),
        )
    return out


def _join_order(index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows sorted by (dataset index, occurrence) and the sorted occurrence numbers: a
    sample a stream visits twice (``gradual``) pairs its first visit with the other's."""
    order = np.argsort(index, kind="stable")
    ordered = index[order]
    starts = np.r_[True, ordered[1:] != ordered[:-1]] if len(ordered) else np.zeros(0, bool)
    first = np.maximum.accumulate(np.where(starts, np.arange(len(ordered)), 0))
    return order, np.arange(len(ordered)) - first


def _in_a_order(column: np.ndarray, matched: np.ndarray | None) -> np.ndarray:
    """A column of B's rows in A's stream order (``matched``: ``_align``'s answer)."""
    return column if matched is None else column[matched]


def _align(key: CellKey, a: CellRows, b: CellRows, names: str) -> np.ndarray | None:
    """B's row of each of ``a``'s rows (in A's stream order), pairing each sample of the
    cell with itself; None when both hold the same samples in the same order (the usual
    case: row i is row i). A ``ValueError`` naming the cell when the two streams differ
    (samples, labels, batches)."""
    cell = f"cell ({key[0]}, severity {key[1]}, seed {key[2]})"
    matched = None
    if not np.array_equal(a.index, b.index):
        oa, occ_a = _join_order(a.index)
        ob, occ_b = _join_order(b.index)
        same = (
            len(oa) == len(ob)
            and np.array_equal(a.index[oa], b.index[ob])
            and np.array_equal(occ_a, occ_b)
        )
        if not same:
            raise ValueError(
                f"{names}: {cell} holds other samples in the two runs ({len(oa)} vs "
                f"{len(ob)} rows); the streams must be identical"
            )
        matched = np.empty_like(ob)
        matched[oa] = ob  # A's rows in stream order, each with B's row of the same sample
    for what, words in (("label", "labels"), ("batch", "batch numbers")):
        bad = np.flatnonzero(getattr(a, what) != _in_a_order(getattr(b, what), matched))
        if len(bad):
            raise ValueError(
                f"{names}: {cell}: {len(bad)} samples have different {words} in the two runs "
                f"(first: dataset index {int(a.index[bad[0]])}); the streams must be identical"
            )
    return matched


def _pair_runs(
    a_rows: dict[CellKey, CellRows],
    b_rows: dict[CellKey, CellRows] | None,
    method: str,
    baseline: str,
    keys: Sequence[CellKey],
) -> PairedSamples:
    """The pairs of cells ``keys``; ``b_rows`` None: B is A's own ``reference`` column.
    A's correct rows and batch numbers are computed once per cell rows (``CellRows``):
    a leaderboard pairs each run with many."""
    names = f"{method!r} vs {baseline!r}"
    a_ok, b_ok, blocks = [], [], []
    offset = 0
    for key in keys:
        a = a_rows[key]
        if b_rows is None:
            if a.reference is None:
                raise ValueError(
                    f"{names}: the per-sample files of {method!r} hold no 'reference' column "
                    "(the run scored no reference); rerun with reference=true and "
                    "log_samples=true, or pass the baseline's results file"
                )
            b_prediction = a.reference
        else:
            b = b_rows[key]
            b_prediction = _in_a_order(b.prediction, _align(key, a, b, names))
        a_ok.append(a.correct)
        b_ok.append((b_prediction == a.label)[a.known])
        blocks.append(a.blocks + offset)
        offset += int(a.blocks.max()) + 1 if len(a.blocks) else 0
    return PairedSamples(
        method=method,
        baseline=baseline,
        a_correct=np.concatenate(a_ok) if a_ok else np.zeros(0, bool),
        b_correct=np.concatenate(b_ok) if b_ok else np.zeros(0, bool),
        block=np.concatenate(blocks) if blocks else np.zeros(0, np.int64),
        seeds=tuple(sorted({k[2] for k in keys})),
        cells=tuple(keys),
    )


def _common(a_record: dict[str, Any], b_record: dict[str, Any] | None) -> list[CellKey]:
    mine = _scored(a_record)
    if b_record is None:
        common = [k for k, c in mine.items() if c.get("reference_accuracy") is not None]
        if not common:
            raise ValueError(
                f"results of {samples.method_label(a_record)!r} hold no reference accuracy "
                "(the run scored no reference): rerun with reference=true and "
                "log_samples=true, or pass the baseline's results file"
            )
        other = "its reference"
    else:
        theirs = _scored(b_record)
        common = [k for k in mine if k in theirs]
        other = repr(samples.method_label(b_record))
    if not common:
        raise ValueError(
            f"{samples.method_label(a_record)!r} and {other} share no scored (shift, "
            "severity, seed) cell"
        )
    return common


def pair_rows(
    a_record: dict[str, Any],
    a_rows: dict[CellKey, CellRows],
    b_record: dict[str, Any] | None = None,
    b_rows: dict[CellKey, CellRows] | None = None,
) -> PairedSamples:
    """``load_pairs`` of rows read already (``read_run``; a leaderboard reads each run
    once and pairs it with many): the cells both records score, both runs' rows of them."""
    method = samples.method_label(a_record)
    if b_record is None:
        return _pair_runs(a_rows, None, method, stats.reference_label(), _common(a_record, None))
    if b_rows is None:
        raise ValueError("pass b_rows with b_record (or neither: A's own reference)")
    stats.check_same_protocol(a_record, b_record)
    keys = _common(a_record, b_record)
    return _pair_runs(a_rows, b_rows, method, samples.method_label(b_record), keys)


def load_pairs(
    a_record: dict[str, Any],
    a_path: str | Path,
    b_record: dict[str, Any] | None = None,
    b_path: str | Path | None = None,
) -> PairedSamples:
    """The paired samples of run A (``a_record`` read from ``a_path``) and run B on the
    scored cells both hold, from their verified per-sample files, joined on (shift,
    severity, seed, dataset index). Different protocols or weights are refused
    (``stats.check_same_protocol``), and so is any sample whose label or batch differs
    between the two (the streams must be identical). ``b_record`` None: B is the frozen
    model's prediction of each sample on A's own stream (the files' ``reference``)."""
    if (b_record is None) != (b_path is None):
        raise ValueError("pass both b_record and b_path, or neither (A's own reference)")
    if b_record is None or b_path is None:
        return pair_rows(a_record, read_run(a_record, a_path, _common(a_record, None)))
    stats.check_same_protocol(a_record, b_record)
    keys = _common(a_record, b_record)
    a_rows, b_rows = read_run(a_record, a_path, keys), read_run(b_record, b_path, keys)
    return pair_rows(a_record, a_rows, b_record, b_rows)


# -- tests -------------------------------------------------------------------------------
def _check_nonempty(pairs: PairedSamples) -> None:
    if pairs.n == 0:
        raise ValueError(f"{pairs.method!r} vs {pairs.baseline!r}: no paired samples")


def mcnemar(pairs: PairedSamples) -> McNemarResult:
    """Exact McNemar test of ``pairs``: two-sided binomial test of the discordant counts
    (``scipy.stats.binomtest``)."""
    from scipy import stats as sps

    _check_nonempty(pairs)
    a_only = int(np.count_nonzero(pairs.a_correct & ~pairs.b_correct))
    b_only = int(np.count_nonzero(~pairs.a_correct & pairs.b_correct))
    discordant = a_only + b_only
    p = 1.0 if discordant == 0 else float(sps.binomtest(a_only, discordant, 0.5).pvalue)
    return McNemarResult(pairs.n, a_only, b_only, (a_only - b_only) / pairs.n, min(p, 1.0))


def _check_resampling(n_resamples: int, confidence: float) -> None:
    if isinstance(n_resamples, bool) or not isinstance(n_resamples, int) or n_resamples < 1:
        raise ValueError(f"n_resamples must be a positive integer, got {n_resamples!r}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")


def bootstrap(
    pairs: PairedSamples,
    unit: str = "sample",
    n_resamples: int = 10_000,
    confidence: float = 0.95,
    rng_seed: int = 0,
) -> BootstrapResult:
    """Percentile interval of the accuracy difference and the two-sided p-value of the
    shifted-null bootstrap ``(#{|d* - d| >= |d|} + 1) / (B + 1)`` (as
    ``stats.paired_comparison``), reproducible for one ``rng_seed``.

    ``unit="sample"`` resamples samples: a difference is -1, 0 or +1, so a resample is a
    multinomial draw of those three counts (exact, and fast at any n). ``unit="batch"``
    resamples whole stream batches (a block bootstrap: an adapting method's predictions
    within a batch depend on each other); a resample's difference is its summed
    differences over its summed sample count."""
    if unit not in BOOTSTRAP_UNITS:
        raise ValueError(
            f"unknown bootstrap unit {unit!r}; available: {', '.join(BOOTSTRAP_UNITS)}"
        )
    _check_resampling(n_resamples, confidence)
    _check_nonempty(pairs)
    rng = np.random.default_rng(rng_seed)
    diff = pairs.a_correct.astype(np.int64) - pairs.b_correct.astype(np.int64)
    n, total = pairs.n, int(diff.sum())
    if unit == "sample":
        up, down = int(np.count_nonzero(diff > 0)), int(np.count_nonzero(diff < 0))
        counts = rng.multinomial(n, [up / n, down / n, 1 - (up + down) / n], size=n_resamples)
        sums = counts[:, 0] - counts[:, 1]
        boot = sums / n
        extreme = int(np.count_nonzero(np.abs(sums - total) >= abs(total)))
        n_units = n
    else:
        _, block = np.unique(pairs.block, return_inverse=True)
        sizes = np.bincount(block).astype(np.float64)
        block_sums = np.bincount(block, weights=diff).astype(np.float64)
        n_units = len(sizes)
        boot = np.empty(n_resamples)
        step = max(1, _CHUNK // n_units)
        for start in range(0, n_resamples, step):
            pick = rng.integers(0, n_units, size=(min(step, n_resamples - start), n_units))
            boot[start : start + len(pick)] = block_sums[pick].sum(1) / sizes[pick].sum(1)
        mean = total / n
        extreme = int(np.count_nonzero(np.abs(boot - mean) >= abs(mean) - 1e-12))
    alpha = (1 - confidence) / 2
    lo, hi = (float(q) for q in np.quantile(boot, [alpha, 1 - alpha]))
    p = (extreme + 1) / (n_resamples + 1)
    return BootstrapResult(unit, n_units, n_resamples, confidence, total / n, lo, hi, p)


def benjamini_hochberg(pvalues: Sequence[float | None]) -> list[float | None]:
    """Benjamini-Hochberg adjusted p-values (``scipy.stats.false_discovery_control``): the
    comparisons with ``q < alpha`` keep the expected share of false discoveries among them
    at ``alpha`` or below. ``None`` entries (no test) stay ``None`` and are not counted."""
    from scipy import stats as sps

    present = [i for i, p in enumerate(pvalues) if p is not None]
    out: list[float | None] = [None] * len(pvalues)
    for i in present:
        p = pvalues[i]
        if not (isinstance(p, int | float) and 0 <= p <= 1):
            raise ValueError(f"p-value {p!r} (position {i}) is not in [0, 1]")
    if present:
        found = sps.false_discovery_control([float(pvalues[i]) for i in present], method="bh")
        for i, q in zip(present, np.atleast_1d(found)):
            out[i] = float(q)
    return out


def _z_sum(alpha: float, power: float) -> float:
    from scipy import stats as sps

    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    if not 0 < power < 1:
        raise ValueError(f"power must be in (0, 1), got {power!r}")
    return float(sps.norm.ppf(1 - alpha / 2) + sps.norm.ppf(power))


def minimum_detectable_effect(
    n: int, discordance: float, alpha: float = 0.05, power: float = 0.8
) -> float:
    """The smallest accuracy difference a paired test on ``n`` samples, of which the
    fraction ``discordance`` is right under one run only, finds with probability ``power``
    at two-sided level ``alpha``: ``(z_{1-alpha/2} + z_{power}) * sqrt(discordance / n)``.
    The normal approximation to McNemar's test: the per-sample difference is -1, 0 or +1
    and, near no difference, its variance is the discordant fraction. The exact test is
    a little more conservative (about 0.79 power at 0.8)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if not 0 <= discordance <= 1:
        raise ValueError(f"discordance must be in [0, 1], got {discordance!r}")
    return _z_sum(alpha, power) * math.sqrt(discordance / n)


def block_minimum_detectable_effect(
    pairs: PairedSamples, alpha: float = 0.05, power: float = 0.8
) -> float | None:
    """``minimum_detectable_effect`` allowing for dependence within stream batches:
    ``(z_{1-alpha/2} + z_{power})`` times the standard error of the difference from the
    spread of the per-batch differences (the linearised ratio estimator over J batches:
    ``sqrt(J / (J - 1) * sum_j (s_j - d m_j)^2) / n``, ``s_j`` a batch's summed
    differences, ``m_j`` its size; with equal batches the standard deviation of the batch
    means over ``sqrt(J)``). None with fewer than two batches."""
    _check_nonempty(pairs)
    _, block = np.unique(pairs.block, return_inverse=True)
    diff = pairs.a_correct.astype(np.float64) - pairs.b_correct.astype(np.float64)
    sizes = np.bincount(block).astype(np.float64)
    if len(sizes) < 2:
        return None
    resid = np.bincount(block, weights=diff) - diff.mean() * sizes
    se = math.sqrt(len(sizes) / (len(sizes) - 1) * float((resid**2).sum())) / pairs.n
    return _z_sum(alpha, power) * se


# -- many methods ------------------------------------------------------------------------
def tiers(
    order: Sequence[T],
    versus: Callable[[T, T], tuple[float, float | None]],
    alpha: float = 0.05,
) -> dict[T, int]:
    """Tiers of methods that cannot be told apart from the best among them.

    ``order``: the methods, best-ranked first; ``versus(leader, other)``: ``other``'s
    difference to ``leader`` (other - leader) and the p-value of that difference (None:
    untestable). The rule: the best-ranked method leads tier 1; the p-values of every
    other method against it are Benjamini-Hochberg adjusted together, and each method not
    significantly worse than the leader (``q >= alpha``, a difference that is not
    negative, or no p-value) joins tier 1. The rest are ranked the same way against the
    best of them, as tier 2, and so on, until every method has a tier."""
    names = list(order)
    if len(set(names)) != len(names):
        raise ValueError(f"tiers need distinct names, got {names!r}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    out: dict[T, int] = {}
    tier, remaining = 1, names
    while remaining:
        leader, others = remaining[0], remaining[1:]
        found = [versus(leader, other) for other in others]
        adjusted = benjamini_hochberg([p for _, p in found])
        out[leader] = tier
        worse = []
        for other, (difference, _), q in zip(others, found, adjusted):
            if q is not None and q < alpha and difference < 0:
                worse.append(other)
            else:
                out[other] = tier
        tier, remaining = tier + 1, worse
    return out


def _seed_means(record: dict[str, Any], keys: Sequence[CellKey]) -> float:
    """The suite accuracy over cells ``keys``: per seed the mean over its cells, then the
    mean over seeds (``stats.per_seed_means``)."""
    values = stats.cell_values(record)
    return statistics.fmean(stats.per_seed_means({k: values[k] for k in keys}).values())


def compare(
    a_record: dict[str, Any],
    a_path: str | Path,
    b_record: dict[str, Any] | None = None,
    b_path: str | Path | None = None,
    *,
    confidence: float = 0.95,
    n_resamples: int = 10_000,
    rng_seed: int = 0,
    alpha: float = 0.05,
    power: float = 0.8,
) -> dict[str, Any]:
    """Everything ``tta-bench compare`` prints about A - B (B None: A's own reference), as
    plain JSON-able values (fractions): both suite accuracies over the cells both hold,
    the seed-level paired t (``stats.paired_comparison``), the exact McNemar test, the
    sample and the batch (block) bootstrap, and the minimum detectable effects."""
    _check_resampling(n_resamples, confidence)
    _z_sum(alpha, power)
    pairs = load_pairs(a_record, a_path, b_record, b_path)
    base_record = stats.reference_record(a_record) if b_record is None else b_record
    seed = stats.paired_comparison(a_record, base_record, "accuracy", "seed", "t", confidence)
    test = mcnemar(pairs)
    boots = {
        unit: asdict(bootstrap(pairs, unit, n_resamples, confidence, rng_seed))
        for unit in BOOTSTRAP_UNITS
    }
    accuracy = {"method": _seed_means(a_record, pairs.cells)}
    accuracy["baseline"] = _seed_means(base_record, pairs.cells)
    return {
        "method": pairs.method,
        "baseline": pairs.baseline,
        "protocol_id": a_record["protocol"]["id"],
        "seeds": list(pairs.seeds),
        "cells": len(pairs.cells),
        "n": pairs.n,
        "batches": pairs.blocks,
        "confidence": confidence,
        "accuracy": accuracy,
        "difference": accuracy["method"] - accuracy["baseline"],
        "seed_t": {
            "n_pairs": seed.n_pairs,
            "difference": seed.mean_difference,
            "ci_low": seed.ci_low,
            "ci_high": seed.ci_high,
            "p_value": seed.p_value,
        },
        "mcnemar": {**asdict(test), "discordance": test.discordance},
        "bootstrap_sample": boots["sample"],
        "bootstrap_batch": boots["batch"],
        "mde": {
            "alpha": alpha,
            "power": power,
            "discordance": test.discordance,
            "sample": minimum_detectable_effect(pairs.n, test.discordance, alpha, power),
            "batch": block_minimum_detectable_effect(pairs, alpha, power),
        },
    }
