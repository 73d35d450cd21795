"""The leaderboard's per-sample comparisons: when ranked runs wrote per-sample files
(``log_samples=true``), each run's difference to the baseline over the very samples both
scored (block bootstrap interval over stream batches, McNemar's p), those p-values adjusted
(Benjamini-Hochberg), the tiers and the minimum detectable effect (``report.paired``). A
comparison with a run that wrote none falls back to the seed-level paired t test
(``stats.paired_comparison``), and the table marks it.
``sample_analysis`` computes them once per board; the markdown leaderboard, the page and
the forest plot show the same numbers (``report.collect`` re-exports what it had).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from dataclasses import dataclass
from typing import Any

from tta_bench.report import stats, tables
from tta_bench.run.samples import samples_dir

#: ``report.collect.Leaderboard`` (not imported: collect imports this module).
Leaderboard = Any


@dataclass(frozen=True)
class SampleAnalysis:
    """The per-sample comparisons of a leaderboard (``report.paired``), one item per run in
    rank order: ``versus``, its difference to the baseline (block bootstrap interval over
    stream batches, McNemar's p; None: not compared); ``q``, those p-values adjusted
    (Benjamini-Hochberg); ``tier`` (``paired.tiers`` on McNemar's p). ``n`` samples over
    ``seeds`` seeds per comparison; the minimum detectable effect at power 0.8 and
    level 0.05 at the median ``discordance`` of the comparisons (with the baseline, or
    those of the tiers when there is none), by samples (``mde``) and by batches."""

    versus: list[stats.PairedComparison | None]
    q: list[float | None]
    tier: list[int]
    n: int
    seeds: int
    discordance: float
    mde: float
    block_mde: float | None
    #: The runs without per-sample files (their comparisons are seed-level), by label, and
    #: their rows.
    seed_level: tuple[str, ...] = ()
    seed_rows: tuple[int, ...] = ()


def sample_analysis(board: Leaderboard, baseline: str | None) -> SampleAnalysis | str | None:
    """The board's ``SampleAnalysis`` when every ranked run wrote per-sample files that
    verify; None when none of them did (the seed-level comparison, nothing to say); else
    why not (a missing folder, a file that is not the run's own: the leaderboard falls
    back to the seed-level comparison and says why). Computed once per board."""
    key = tables.baseline_name(baseline)
    if key not in board.analyses:
        board.analyses[key] = _sample_analysis(board, baseline)
    return board.analyses[key]


def _sample_analysis(board: Leaderboard, baseline: str | None) -> SampleAnalysis | str | None:
    have = [samples_dir(e.path).is_dir() for e in board.entries]
    if not any(have):
        return None
    try:
        return _analyse_samples(board, baseline, have)
    except ValueError as exc:  # a file that is not its run's own, streams that differ
        root = str(board.entries[0].path.parent)
        return str(exc).replace(root + os.sep, "").replace(root, ".")


def _analyse_samples(board: Leaderboard, baseline: str | None, have: list[bool]) -> SampleAnalysis:
    from tta_bench.report import paired

    records = [e.record for e in board.entries]
    base_rec, label = tables.resolve_baseline(records, baseline)
    rows = [paired.read_run(e.record, e.path) if h else None for e, h in zip(board.entries, have)]
    base = next((i for i, r in enumerate(records) if r is base_rec), None)
    found: dict[tuple[int, int | None], tuple[Any, Any]] = {}

    def per_sample(i: int, j: int | None) -> bool:
        """Whether run ``i`` and run ``j`` (None: ``i``'s own reference) pair per sample."""
        return rows[i] is not None and (j is None or rows[j] is not None)

    def pair(i: int, j: int | None) -> tuple[Any, Any]:
        """Run ``i`` against run ``j`` (None: its own reference) and McNemar's test."""
        if (i, j) not in found:
            other = (None, None) if j is None else (records[j], rows[j])
            pairs = paired.pair_rows(records[i], rows[i], *other)
            found[(i, j)] = (pairs, paired.mcnemar(pairs))
        return found[(i, j)]

    versus: list[stats.PairedComparison | None] = []
    for i, entry in enumerate(board.entries):
        if tables.pairing_record(entry.record, base_rec, baseline) is None:
            versus.append(None)
            continue
        if not per_sample(i, base):  # no per-sample files on one side: the seed-level test
            pairing = tables.pairing_record(entry.record, base_rec, baseline)
            versus.append(stats.paired_comparison(entry.record, pairing, test="t"))
            continue
        pairs, test = pair(i, base)
        boot = paired.bootstrap(pairs, "batch")
        versus.append(
            stats.PairedComparison(
                method=entry.label,
                baseline=str(label),
                key="accuracy",
                unit="batch",
                test="block bootstrap",
                n_pairs=pairs.n,
                mean_difference=boot.difference,
                ci_low=boot.ci_low,
                ci_high=boot.ci_high,
                p_value=test.p_value,  # McNemar's
            )
        )
    compared = list(found.values())

    def vs(leader: int, other: int) -> tuple[float, float | None]:
        if not per_sample(other, leader):
            seed = stats.paired_comparison(records[other], records[leader], test="t")
            return seed.mean_difference, seed.p_value
        test = pair(other, leader)[1]
        return test.difference, test.p_value

    tier = paired.tiers(list(range(len(records))), vs)
    analysis = _with_mde(
        versus,
        paired.benjamini_hochberg([c.p_value if c else None for c in versus]),
        [tier[i] for i in range(len(records))],
        compared or list(found.values()),
    )
    lacking = tuple(i for i, h in enumerate(have) if not h)
    labels = tuple(board.entries[i].label for i in lacking)
    return dataclasses.replace(analysis, seed_level=labels, seed_rows=lacking)


def _with_mde(
    versus: list[stats.PairedComparison | None],
    q: list[float | None],
    tier: list[int],
    compared: list[tuple[Any, Any]],
) -> SampleAnalysis:
    """The analysis with the minimum detectable effect over the ``compared`` pairs."""
    from tta_bench.report import paired

    if not compared:  # one run, no baseline: nothing was compared
        return SampleAnalysis(versus, q, tier, 0, 0, 0.0, float("nan"), None)
    n = min(p.n for p, _ in compared)
    seeds = min(len(p.seeds) for p, _ in compared)
    discordance = statistics.median(t.discordance for _, t in compared)
    blocks = [b for p, _ in compared if (b := paired.block_minimum_detectable_effect(p))]
    return SampleAnalysis(
        versus,
        q,
        tier,
        n,
        seeds,
        discordance,
        paired.minimum_detectable_effect(n, discordance),
        statistics.median(blocks) if blocks else None,
    )


def _sample_columns(
    head: list[str], rows: list[list[Any]], analysis: SampleAnalysis
) -> tuple[list[str], list[list[Any]]]:
    """The summary table with Δ and p per sample, and ``q (BH)`` and ``tier`` after them
    (``tier`` alone after the accuracy when there is no baseline)."""
    delta = next((i for i, h in enumerate(head) if h.startswith("Δ")), None)
    after = delta + 2 if delta is not None else head.index("accuracy % (95% CI)") + 1
    extra = (["q (BH)"] if delta is not None else []) + ["tier"]
    out = []
    for i, (row, cmp, q, tier) in enumerate(zip(rows, analysis.versus, analysis.q, analysis.tier)):
        row = list(row)
        added = [str(tier)]
        if delta is not None:
            mark = SEED_MARK if i in analysis.seed_rows and cmp is not None else ""
            row[delta : delta + 2] = [
                tables._delta(cmp) + mark,
                tables._p(cmp.p_value if cmp else None),
            ]
            added.insert(0, tables._p(q))
        out.append(row[:after] + added + row[after:])
    return head[:after] + extra + head[after:], out


#: The mark of a Δ compared at the seed level on a per-sample board.
SEED_MARK = " (seeds)"


def _sample_notes(analysis: SampleAnalysis, with_baseline: bool) -> list[str]:
    """The per-sample lines: the FDR control, the tiers and the minimum detectable effect."""
    notes = []
    if analysis.seed_level:
        notes.append(
            f"Runs without per-sample files ({', '.join(analysis.seed_level)}) are compared "
            f"at the seed level (paired t over seeds, marked{SEED_MARK}), in the "
            "Benjamini-Hochberg adjustment and the tiers too; their intervals are wider."
        )
    if with_baseline:
        notes.append(
            "q (BH): the p-values of all comparisons with the baseline adjusted by "
            "Benjamini-Hochberg; calling the differences with q < 0.05 real keeps the "
            "expected share of false ones among them (the false discovery rate) at 5% or "
            "below."
        )
    notes.append(
        "Tier: tier 1 is the best-ranked run and every run not significantly worse than it "
        "(McNemar per sample, Benjamini-Hochberg adjusted over the tier's comparisons, "
        "q < 0.05); tier 2 does the same for the rest, and so on: the runs of one tier "
        "cannot be told apart from its best at this suite's sample size."
    )
    if analysis.n:
        per_seed = analysis.n // max(analysis.seeds, 1)
        block = (
            ""
            if analysis.block_mde is None
            else f", {100 * analysis.block_mde:.2f} points allowing for dependence within "
            "stream batches"
        )
        notes.append(
            f"Minimum detectable effect: with {per_seed:,} samples per seed x "
            f"{analysis.seeds} seeds, a paired test at level 0.05 finds a difference of "
            f"{100 * analysis.mde:.2f} points with power 0.8 at the observed median "
            f"discordance of {100 * analysis.discordance:.1f}% (McNemar, normal "
            f"approximation){block}; smaller true differences are likely to go unseen."
        )
    return notes
