"""Leaderboards and tables from the fixed results in ``harness/tests/golden/`` only: a
leaderboard regenerates byte-identically and matches ``golden/leaderboard.md`` (set
TTA_BENCH_UPDATE_GOLDEN=1 to rewrite it after an intended change, then read the diff), one
protocol per ranking, left-out files with reasons, superseded reruns, and the ``leaderboard``
and ``table`` commands on those files. (A real run end to end is in the plugin's
``tests/test_report.py``.)"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tta_bench.cli import main
from tta_bench.report import leaderboard as report
from tta_bench.report import plots

from .helpers import GOLDEN


@pytest.fixture()
def results_dir(tmp_path):
    """The golden runs, one of another protocol, an incomplete one and a broken file."""
    d = tmp_path / "results"
    d.mkdir()
    for name in ("golden_zeroshot.json", "golden_tent.json", "golden_tent_bs16.json"):
        shutil.copy(GOLDEN / name, d / name)
    partial = json.loads((GOLDEN / "golden_tent.json").read_text())
    partial["method_config"] = {"lr": 0.01}
    partial["cells"] = partial["cells"][:5]
    (d / "partial_tent.json").write_text(json.dumps(partial))
    (d / "broken.json").write_text("{not json")
    return d


def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.suffix != ".json"}


def test_leaderboard_regenerates_byte_identically(results_dir):
    _, written = report.write_leaderboard(results_dir, "golden")
    first = _snapshot(results_dir)
    expected = {report.LEADERBOARD_MD, report.LEADERBOARD_HTML}
    if plots.available():  # two severities, reset per shift: no stream plot
        expected |= {report.PLOT_FOREST, report.PLOT_HEATMAP, report.PLOT_SEVERITY}
        expected |= {report.PLOT_PARETO}
    assert set(first) == expected == {p.name for p in written}
    for p in written:
        p.unlink()
    report.write_leaderboard(results_dir, "golden")
    assert _snapshot(results_dir) == first


def test_leaderboard_matches_the_golden_markdown(results_dir):
    report.write_leaderboard(results_dir, "golden", with_plots=False)
    text = (results_dir / report.LEADERBOARD_MD).read_text(encoding="utf-8")
    path = GOLDEN / "leaderboard.md"
    if os.environ.get("TTA_BENCH_UPDATE_GOLDEN") == "1":
        path.write_text(text, encoding="utf-8")
    assert text == path.read_text(encoding="utf-8")


def test_leaderboard_ranks_one_protocol_and_says_what_it_left_out(results_dir):
    board = report.collect(results_dir, "golden")
    assert board.protocol_id == "golden@v1-reset_each_shift-bs8-0123456789"
    assert [e.label for e in board.entries] == ["tent", "zeroshot"]  # by accuracy
    reasons = dict(board.left_out)
    assert set(reasons) == {"broken.json", "golden_tent_bs16.json", "partial_tent.json"}
    assert (
        "protocol golden@v1-reset_each_shift-bs16-9876543210 differs"
        in reasons["golden_tent_bs16.json"]
    )
    assert reasons["partial_tent.json"] == "incomplete: 5 of 12 cells"
    assert reasons["broken.json"].startswith("unreadable")
    other = report.collect(results_dir, "golden", "golden@v1-reset_each_shift-bs16-9876543210")
    assert [e.label for e in other.entries] == ["tent"]


def test_a_duplicate_run_is_superseded(results_dir):
    shutil.copy(results_dir / "golden_tent.json", results_dir / "golden_tent_rerun.json")
    board = report.collect(results_dir, "golden")
    assert [e.path.name for e in board.entries] == [
        "golden_tent_rerun.json",
        "golden_zeroshot.json",
    ]
    assert ("golden_tent.json", "superseded by golden_tent_rerun.json") in board.left_out


def test_leaderboard_cli_prints_reasons_and_fails_cleanly(results_dir, capsys):
    assert main(["leaderboard", str(results_dir), "--suite", "golden", "--no-plots"]) == 0
    out = capsys.readouterr()
    assert "ranked 2 runs" in out.out
    assert "left out golden_tent_bs16.json: protocol" in out.err
    assert main(["leaderboard", str(results_dir), "--suite", "nope"]) == 2
    assert "no results of suite 'nope'" in capsys.readouterr().err


def test_table_cli_refuses_mixed_protocols(capsys):
    files = [str(GOLDEN / "golden_zeroshot.json"), str(GOLDEN / "golden_tent_bs16.json")]
    assert main(["table", *files]) == 2
    assert "different protocols" in capsys.readouterr().err
