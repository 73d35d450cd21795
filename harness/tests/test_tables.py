"""Tables from results only: the fixed results in harness/tests/golden/ render to fixed
tables in every format (set TTA_BENCH_UPDATE_GOLDEN=1 to rewrite the golden files after an
intended change, then read the diff)."""

from __future__ import annotations

import copy
import json
import os

import pytest

from tta_bench.report import leaderboard as report
from tta_bench.report import stats, tables

from .helpers import GOLDEN

RESULTS = [GOLDEN / "golden_zeroshot.json", GOLDEN / "golden_tent.json"]
SUFFIX = {"github": "md", "latex": "tex", "csv-formatted": "csv", "html": "html", "plain": "txt"}


def _check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("TTA_BENCH_UPDATE_GOLDEN") == "1":
        path.write_text(text, encoding="utf-8")
    assert text == path.read_text(encoding="utf-8"), f"{name} changed"


@pytest.mark.parametrize("fmt", list(SUFFIX))
def test_two_runs_render_to_the_golden_tables(fmt):
    _check_golden(f"table.{SUFFIX[fmt]}", report.render_tables(RESULTS, fmt))


def test_one_run_renders_shift_by_severity():
    text = report.render_tables([GOLDEN / "golden_tent.json"], "github")
    _check_golden("table_single.md", text)
    assert "| sev 3" in text and "| sev 5" in text


def test_summary_shows_ci_delta_p_and_ece():
    records = report.load_many(RESULTS)
    headers, rows = tables.summary_rows(records)
    row = dict(zip(headers, rows[1]))
    assert row["method"] == "tent"
    assert row["accuracy % (95% CI)"] == "48.8 ± 5.6"
    assert row["Δ vs zeroshot (95% CI)"] == "+3.8 [-1.8, +9.4]"
    assert row["p"] == "0.099"
    assert row["ECE %"] == "12.5"
    assert dict(zip(headers, rows[0]))["Δ vs zeroshot (95% CI)"] == "-"  # the baseline itself


def test_without_a_zeroshot_file_each_run_pairs_with_its_reference():
    records = report.load_many(RESULTS[1:])
    headers, rows = tables.summary_rows(records)
    assert "Δ vs zeroshot (reference) (95% CI)" in headers
    assert rows[0][headers.index("Δ vs zeroshot (reference) (95% CI)")] == "+3.8 [-1.8, +9.4]"


def test_an_absent_baseline_lists_the_methods():
    with pytest.raises(ValueError, match="methods: tent, zeroshot"):
        report.render_tables(RESULTS, "github", baseline="lora")


def test_cost_table_splits_time_three_ways():
    records = report.load_many(RESULTS)
    headers, rows = tables.cost_rows(records)
    tent = dict(zip(headers, rows[1]))
    assert (tent["data ms"], tent["adapt ms"], tent["predict ms"]) == ("0.100", "0.800", "0.000")
    assert tent["ms/sample"] == "0.900"
    assert (tent["peak MB"], tent["trainable params"]) == ("3.0", "2,560")
    assert (tent["fwd/sample"], tent["bwd/sample"]) == ("1.0", "1.0")


def test_results_without_the_split_render_a_dash():
    old = copy.deepcopy(json.loads(RESULTS[1].read_text()))
    for c in old["cells"]:
        del c["adapt_time_per_sample_s"], c["predict_time_per_sample_s"]
    headers, rows = tables.cost_rows([old])
    row = dict(zip(headers, rows[0]))
    assert (row["adapt ms"], row["predict ms"], row["data ms"]) == ("-", "-", "0.100")


def test_different_protocols_are_refused():
    with pytest.raises(stats.ProtocolMismatchError, match="different protocols"):
        report.render_tables([RESULTS[0], GOLDEN / "golden_tent_bs16.json"], "github")


def test_unknown_format_lists_the_formats():
    with pytest.raises(
        ValueError, match="github, markdown, latex, html, plain, csv-formatted, json, csv"
    ):
        report.render_tables(RESULTS, "rst")


def test_shifts_follow_the_protocol_order_not_the_file_order():
    """A resumed run appends the cells it recomputes after the kept ones; tables still list
    the shifts in the protocol's pinned order."""
    record = json.loads((GOLDEN / "golden_tent.json").read_text())
    pinned = record["protocol"]["shifts"]
    assert len(pinned) >= 2
    moved = copy.deepcopy(record)
    first = [c for c in moved["cells"] if c["shift"] == pinned[0]]
    moved["cells"] = [c for c in moved["cells"] if c["shift"] != pinned[0]] + first
    assert tables.shift_order([moved]) == pinned
    for fn in (tables.shift_table, lambda r, fmt: tables.method_shift_table([r], fmt)):
        assert fn(moved, "github") == fn(record, "github")
    extra = copy.deepcopy(record)
    extra["cells"].append({**extra["cells"][0], "shift": "zz_not_in_protocol"})
    assert tables.shift_order([extra]) == [*pinned, "zz_not_in_protocol"]
