"""Tables rendered from results records only (tabulate): the shift-wise accuracy table, the
suite summary (mean ± 95% CI over seeds, paired difference against a baseline, the other
metrics) and the cost table. Accuracies and differences are in percent.

Formats: ``github`` (= ``markdown``), ``latex`` (booktabs), ``csv``, ``html``, ``plain``.
Every function is a pure function of its records, so regenerated tables are identical.
"""

from __future__ import annotations

import contextlib
import csv
import io
import math
import re
import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from tabulate import tabulate

from tta_bench.report import stats
from tta_bench.report.columns import NOT_PROBABILITIES, column, shown, table_columns

FORMATS = {
    "github": "github",
    "markdown": "github",
    "latex": "latex_booktabs",
    "csv": "csv",
    "html": "html",
    "plain": "simple",
}
MISSING = "-"
#: Characters our cells use that plain (pdf)LaTeX text mode does not typeset.
LATEX_SYMBOLS = {"±": r"$\pm$", "Δ": r"$\Delta$", "<": r"$<$"}


def _fmt(values: list[float], decimals: int = 1) -> str:
    """``mean ± std`` (sample std over seeds) in percent; the mean alone for one value."""
    if not values:
        return MISSING
    mean = 100 * statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.{decimals}f}"
    return f"{mean:.{decimals}f} ± {100 * statistics.stdev(values):.{decimals}f}"


#: First characters that make a spreadsheet read a CSV cell as a formula (OWASP, "CSV
#: injection"): such text cells get a leading single quote (``csv_cell``).
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
#: Text that is a number as the tables write one, sign first: ``-0.3``, ``+3.8 [-1.8, +9.4]``,
#: ``-1,234``, ``-`` (no value). No letters, so no function and no cell reference.
_NUMBER_TEXT = re.compile(r"[+-][0-9 .,+\-±\[\]%]*")


def csv_cell(value: Any) -> Any:
    """``value`` as a CSV cell a spreadsheet cannot run: text starting with ``=``, ``+``,
    ``-``, ``@``, tab or CR gets a leading ``'`` (method, shift, model and metric names come
    from results files a stranger may send). Numbers are never touched: non-text values,
    and text that is a finite number (``-0.3``, ``+1.5e-3``) or one of the tables' numbers
    (``+3.8 [-1.8, +9.4]``, ``-``: numerals, signs and punctuation only)."""
    if not isinstance(value, str) or not value.startswith(FORMULA_STARTS):
        return value
    with contextlib.suppress(ValueError):
        if math.isfinite(float(value)):
            return value
    if _NUMBER_TEXT.fullmatch(value):
        return value
    return "'" + value


def render(rows: list[list[Any]], headers: list[str], fmt: str) -> str:
    """One table in ``fmt`` (see ``FORMATS``); cells are rendered verbatim (no number
    parsing), so the formatting chosen here is what the reader gets; in ``csv``, text that
    a spreadsheet would run as a formula is quoted (``csv_cell``)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown table format {fmt!r}; available: {', '.join(FORMATS)}")
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow([csv_cell(h) for h in headers])
        writer.writerows([csv_cell(c) for c in row] for row in rows)
        return buf.getvalue().rstrip("\n")
    text = tabulate(rows, headers=headers, tablefmt=FORMATS[fmt], disable_numparse=True)
    if fmt == "latex":  # tabulate escapes LaTeX specials but leaves these to the encoding
        for char, macro in LATEX_SYMBOLS.items():
            text = text.replace(char, macro)
    return text


_render = render  # the name the first tables used


DIVERGED = "diverged"
#: ``baseline`` default: the catalogues' reference method (``defaults: reference``), paired
#: through each run's own reference cells when its results are not among the records.
REFERENCE = "@reference"


def baseline_name(baseline: str | None) -> str | None:
    """``baseline`` with ``REFERENCE`` resolved to the catalogues' reference method."""
    return stats.reference_method() if baseline == REFERENCE else baseline


def is_reference_run(record: dict[str, Any]) -> bool:
    """The run is of the reference method itself (its reference figures are its own)."""
    return record["method"] == stats.reference_method()


def _acc_text(cells: list[dict[str, Any]], key: str = "accuracy") -> str:
    """``mean ± std`` over seeds of ``cells``, or ``diverged`` when any of them did."""
    if any(c.get("diverged") for c in cells):
        return DIVERGED
    return _fmt(_per_seed_means(cells, key))


def _per_seed_means(cells: list[dict[str, Any]], key: str) -> list[float]:
    by_seed: dict[int, list[float]] = defaultdict(list)
    for c in cells:
        if c.get(key) is not None:
            by_seed[c["seed"]].append(c[key])
    return [statistics.fmean(v) for _, v in sorted(by_seed.items())]


def _labels(records: Sequence[dict[str, Any]], labels: Sequence[str] | None) -> list[str]:
    if labels is None:
        return [r.get("method_preset") or r["method"] for r in records]
    if len(labels) != len(records):
        raise ValueError(f"{len(labels)} labels for {len(records)} records")
    return list(labels)


def _check_one_protocol(records: Sequence[dict[str, Any]]) -> None:
    for other in records[1:]:
        stats.check_same_protocol(records[0], other)


def shift_order(records: Sequence[dict[str, Any]]) -> list[str]:
    """The shifts of ``records``' cells in the protocol's pinned order (``protocol.shifts``),
    then any others in order of appearance. The order of cells in a file is not the
    protocol's: a resumed run appends the cells it computes after the kept ones."""
    present = dict.fromkeys(c["shift"] for r in records for c in r["cells"])
    pinned = [s for r in records for s in (r.get("protocol") or {}).get("shifts") or []]
    return [s for s in dict.fromkeys(pinned) if s in present] + [
        s for s in present if s not in pinned
    ]


def shift_table(record: dict[str, Any], fmt: str = "plain") -> str:
    """One run. Rows: shifts in protocol order, then the mean; columns: severities, mean
    (``mean ± std`` over seeds), and the frozen model's reference with the delta when the
    run scored it."""
    cells = record["cells"]
    shifts = shift_order([record])
    severities = sorted({c["severity"] for c in cells})
    has_ref = not is_reference_run(record) and all(
        c.get("reference_accuracy") is not None or c.get("diverged") for c in cells
    )
    headers = ["shift", *[f"sev {s}" for s in severities], "mean"]
    if has_ref:
        headers += ["zero-shot", "Δ"]
    rows = []
    for shift in [*shifts, None]:
        sel = [c for c in cells if shift is None or c["shift"] == shift]
        row: list[Any] = [shift or "mean"]
        for s in severities:
            row.append(_acc_text([c for c in sel if c["severity"] == s]))
        row.append(_acc_text(sel))
        if has_ref:
            if any(c.get("diverged") for c in sel):
                row += [DIVERGED, DIVERGED]
            else:
                acc = _per_seed_means(sel, "accuracy")
                ref = _per_seed_means(sel, "reference_accuracy")
                row.append(_fmt(ref))
                row.append(f"{100 * (statistics.fmean(acc) - statistics.fmean(ref)):+.1f}")
        rows.append(row)
    return render(rows, headers, fmt)


def method_shift_table(
    records: Sequence[dict[str, Any]], fmt: str = "plain", labels: Sequence[str] | None = None
) -> str:
    """Several runs of one protocol. Rows: methods; columns: shifts (mean over severities)
    in protocol order, then the mean; each ``mean ± std`` over seeds, in percent."""
    headers, rows = method_shift_rows(records, labels)
    return render(rows, headers, fmt)


def method_shift_rows(
    records: Sequence[dict[str, Any]],
    labels: Sequence[str] | None = None,
    metric: str = "accuracy",
) -> tuple[list[str], list[list[Any]]]:
    """Headers and rows of the method x shift table (see ``method_shift_table``) of
    ``metric`` (a fraction, shown in percent); a probabilistic metric of a method whose
    outputs are scores reads ``NOT_PROBABILITIES`` (``columns.shown``)."""
    _check_one_protocol(records)
    names = _labels(records, labels)
    shifts = shift_order(records)
    col = column(metric)
    rows = []
    for name, rec in zip(names, records):
        row: list[Any] = [name]
        if not shown(col, rec):
            rows.append(row + [NOT_PROBABILITIES] * (len(shifts) + 1))
            continue
        for shift in shifts:
            row.append(_acc_text([c for c in rec["cells"] if c["shift"] == shift], metric))
        row.append(_acc_text(rec["cells"], metric))
        rows.append(row)
    return ["method", *shifts, "mean"], rows


#: Metrics that get a method x shift table of their own in a leaderboard, when its cells
#: hold them: calibration (both binnings) and open-set detection.
PER_SHIFT_METRICS = ("ece", "ece20", "auroc", "aupr", "fpr95")
#: Metrics only some methods have (their own OOD score and decision,
#: ``Method.own_ood_score``): a table of their own when any record holds them, the others'
#: rows left empty.
OWN_PER_SHIFT_METRICS = ("auroc_own", "fpr95_own", "acc_h")


def per_shift_metrics(records: Sequence[dict[str, Any]]) -> list[str]:
    """The ``PER_SHIFT_METRICS`` every record's scored cells hold, then the
    ``OWN_PER_SHIFT_METRICS`` any of them holds."""

    def held(r: dict[str, Any], name: str) -> bool:
        return any(c.get(name) is not None for c in r["cells"])

    out = [n for n in PER_SHIFT_METRICS if records and all(held(r, n) for r in records)]
    return out + [n for n in OWN_PER_SHIFT_METRICS if any(held(r, n) for r in records)]


# -- suite summary ---------------------------------------------------------------------
def _pct_ci(est: stats.Estimate | None) -> str:
    if est is None:
        return MISSING
    if est.half_width is None:
        return f"{100 * est.mean:.1f}"
    return f"{100 * est.mean:.1f} ± {100 * est.half_width:.1f}"


def _p(p: float | None) -> str:
    if p is None:
        return MISSING
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def _delta(cmp: stats.PairedComparison | None) -> str:
    if cmp is None:
        return MISSING
    text = f"{100 * cmp.mean_difference:+.1f}"
    if cmp.ci_low is not None and cmp.ci_high is not None:
        text += f" [{100 * cmp.ci_low:+.1f}, {100 * cmp.ci_high:+.1f}]"
    return text


def resolve_baseline(
    records: Sequence[dict[str, Any]], baseline: str | None
) -> tuple[dict[str, Any] | None, str | None]:
    """The baseline record among ``records`` (by method name; ``REFERENCE``: the
    catalogues' reference method) and the column label.

    When no record is the baseline and ``baseline`` is the reference method, each run's own
    reference (the frozen source model on the identical stream) is the baseline:
    ``(None, "<reference> (reference)")``. Otherwise an unknown baseline is an error that
    lists the methods present."""
    baseline = baseline_name(baseline)
    if baseline is None:
        return None, None
    found = [r for r in records if r["method"] == baseline]
    if len(found) > 1:
        raise ValueError(
            f"{len(found)} results of baseline {baseline!r}; pass one (or rank them with "
            f"'tta-bench leaderboard', which keeps one per method and config)"
        )
    if found:
        return found[0], baseline
    reference = stats.reference_method()
    if baseline == reference:
        return None, stats.reference_label()
    methods = sorted({r["method"] for r in records})
    hint = f", or use --baseline {reference} to pair with each run's reference" if reference else ""
    raise ValueError(
        f"baseline {baseline!r} is not among the results (methods: {', '.join(methods)}); "
        f"pass its results file too{hint}"
    )


def compare_to_baseline(
    record: dict[str, Any],
    baseline_record: dict[str, Any] | None,
    baseline: str | None,
    test: str = "t",
) -> stats.PairedComparison | None:
    """The paired comparison of ``record`` with the resolved baseline; None for the
    baseline itself, or when no baseline figures exist for this run."""
    other = pairing_record(record, baseline_record, baseline)
    return None if other is None else stats.paired_comparison(record, other, test=test)


def pairing_record(
    record: dict[str, Any], baseline_record: dict[str, Any] | None, baseline: str | None
) -> dict[str, Any] | None:
    """The record ``record`` is paired with (see ``compare_to_baseline``): the resolved
    baseline's, or the run's own reference cells; None where there is nothing to pair."""
    baseline = baseline_name(baseline)
    if baseline is None or record is baseline_record:
        return None
    if baseline_record is not None:
        if stats.diverged_cells(baseline_record) or stats.diverged_cells(record):
            return None  # nothing to pair: a diverged cell has no accuracy
        return baseline_record
    if is_reference_run(record) or not any(
        c.get("reference_accuracy") is not None for c in record["cells"]
    ):
        return None
    return stats.reference_record(record)


def summary_rows(
    records: Sequence[dict[str, Any]],
    labels: Sequence[str] | None = None,
    baseline: str | None = REFERENCE,
    test: str = "t",
) -> tuple[list[str], list[list[Any]]]:
    """Headers and rows of the suite summary (see ``summary_table``)."""
    _check_one_protocol(records)
    names = _labels(records, labels)
    base_rec, base_label = resolve_baseline(records, baseline)
    columns = table_columns(c for r in records for c in r["cells"])
    headers = ["method", "model", "seeds", "accuracy % (95% CI)"]
    if base_label is not None:
        headers += [f"Δ vs {base_label} (95% CI)", "p"]
    headers += [col.label for col in columns]
    rows = []
    for name, rec in zip(names, records):
        bad = stats.diverged_cells(rec)
        row: list[Any] = [
            name,
            rec["model"]["name"],
            str(len({c["seed"] for c in rec["cells"]})),
            f"{DIVERGED} ({len(bad)} cells)" if bad else _pct_ci(stats.suite_estimate(rec)),
        ]
        if base_label is not None:
            cmp = None if bad else compare_to_baseline(rec, base_rec, baseline, test)
            row += [_delta(cmp), _p(cmp.p_value if cmp else None)]
        for col in columns:
            if not shown(col, rec):
                row.append(NOT_PROBABILITIES)
                continue
            est = stats.suite_estimate(rec, col.name)
            row.append(MISSING if est is None else col.format(est.mean))
        rows.append(row)
    return headers, rows


def summary_table(
    records: Sequence[dict[str, Any]],
    fmt: str = "plain",
    baseline: str | None = REFERENCE,
    test: str = "t",
    labels: Sequence[str] | None = None,
) -> str:
    """Runs of one protocol: accuracy mean ± 95% CI half-width (Student t over seeds), the
    paired difference to ``baseline`` with its interval and p-value (``test``: ``t`` or
    ``bootstrap``), and the mean of every other metric the cells hold (ECE in percent and
    NLL in nats for the built-in ones; ``tta_bench.report.columns``), NLL and ECE as
    ``NOT_PROBABILITIES`` for a method whose outputs are scores, not logits."""
    headers, rows = summary_rows(records, labels, baseline, test)
    return render(rows, headers, fmt)


# -- cost ------------------------------------------------------------------------------
def _mean_ms(cells: list[dict[str, Any]], key: str) -> str:
    vals = [float(c[key]) for c in cells if c.get(key) is not None]
    if len(vals) != len(cells) or not vals:
        return MISSING
    return f"{1e3 * statistics.fmean(vals):.3f}"


def cost_rows(
    records: Sequence[dict[str, Any]], labels: Sequence[str] | None = None
) -> tuple[list[str], list[list[Any]]]:
    """Headers and rows of the cost table (see ``cost_table``)."""
    names = _labels(records, labels)
    with_flops = any(c.get("flops_per_sample") is not None for r in records for c in r["cells"])
    headers = [
        "method",
        "ms/sample",
        "data ms",
        "adapt ms",
        "predict ms",
        "samples/s",
        "peak MB",
        "trainable params",
        "total params",
        "fwd/sample",
        "bwd/sample",
    ]
    if with_flops:
        headers.append("GFLOPs/sample")
    rows = []
    for name, rec in zip(names, records):
        cells = rec["cells"]
        params = rec.get("parameters") or {}

        def mean(key: str, cells: list[dict[str, Any]] = cells) -> float | None:
            vals = [float(c[key]) for c in cells if c.get(key) is not None]
            return statistics.fmean(vals) if vals and len(vals) == len(cells) else None

        total_s = mean("time_per_sample_s")
        row: list[Any] = [
            name,
            _mean_ms(cells, "time_per_sample_s"),
            _mean_ms(cells, "data_time_per_sample_s"),
            _mean_ms(cells, "adapt_time_per_sample_s"),
            _mean_ms(cells, "predict_time_per_sample_s"),
            MISSING if not total_s else f"{1 / total_s:.0f}",
            f"{max(int(c['peak_memory_bytes']) for c in cells) / 2**20:.1f}" if cells else MISSING,
            f"{params['trainable']:,}" if "trainable" in params else MISSING,
            f"{params['total']:,}" if "total" in params else MISSING,
        ]
        for key in ("forward_passes_per_sample", "backward_passes_per_sample"):
            value = mean(key)
            row.append(MISSING if value is None else f"{value:.1f}")
        if with_flops:
            flops = mean("flops_per_sample")
            row.append(MISSING if flops is None else f"{flops / 1e9:.3f}")
        rows.append(row)
    return headers, rows


def cost_table(
    records: dict[str, Any] | Sequence[dict[str, Any]],
    fmt: str = "plain",
    labels: Sequence[str] | None = None,
) -> str:
    """Per run, averaged over cells: time per sample in ms (total, and split into data
    wait, adaptation = forward + backward + step, and prediction), samples per second over
    the total, the peak memory of the heaviest cell (MiB), trainable and total parameters,
    image-encoder forward and backward passes per sample, and GFLOPs per sample where the
    run counted them."""
    if isinstance(records, dict):
        records = [records]
    headers, rows = cost_rows(records, labels)
    return render(rows, headers, fmt)
