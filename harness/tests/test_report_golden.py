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


# -- markdown from a stranger's results files: their strings render as text -----------------
def _hostile_dir(tmp_path: Path) -> Path:
    """The golden runs with HTML, a link, a pipe and backticks in every string the markdown
    leaderboard shows: method preset, model, shift, dataset, protocol id, provenance, and
    the names and reasons of files left out."""
    d = tmp_path / "hostile"
    d.mkdir()
    proto_id = "golden@v1`<img src=x onerror=alert(2)>`"
    shift = "<img src=x onerror=alert(1)>"
    for name in ("golden_zeroshot.json", "golden_tent.json"):
        record = json.loads((GOLDEN / name).read_text())
        record["protocol"]["id"] = proto_id
        record["protocol"]["dataset"] = "<iframe src=//evil.example>"
        record["protocol"]["shifts"] = ["gaussian_noise", shift]
        for c in record["cells"]:
            c["shift"] = shift if c["shift"] == "contrast" else c["shift"]
        if record["method"] == "tent":
            record["method_preset"] = "<script>alert(1)</script>|![px](http://evil.example/p.png)"
            record["model"]["name"] = "tiny|<b onmouseover=alert(3)>"
            record["provenance"]["git_sha"] = "<svg onload=alert(4)>"
            record["provenance"]["device"]["name"] = "a\nb | <i>c</i>"
            record["created"] = "[click](javascript:alert(5))"
        (d / name).write_text(json.dumps(record))
    other = json.loads((GOLDEN / "golden_tent.json").read_text())
    other["protocol"]["id"] = "<script>alert(6)</script>"
    (d / "other.json").write_text(json.dumps(other))
    (d / "x`<img src=y onerror=alert(7)>`.json").write_text("{not json")
    return d


def test_the_markdown_leaderboard_shows_results_strings_as_text(tmp_path):
    import re

    d = _hostile_dir(tmp_path)
    report.write_leaderboard(d, "golden", with_plots=False)
    text = (d / report.LEADERBOARD_MD).read_text(encoding="utf-8")
    # no tag, comment or autolink can open outside a code span (which shows it verbatim)
    outside = re.sub(r"(`+)[^`].*?[^`]\1(?!`)", "", text)
    assert re.search(r"<[A-Za-z/!?]", outside) is None, outside
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "&lt;img src=x onerror=alert(1)&gt;" in text  # the shift, as a header
    assert "](http://evil" not in text and "](javascript:" not in text  # no link, no image
    assert "`` x`<img src=y onerror=alert(7)>`.json ``" in text  # a whole code span
    assert "Protocol `` golden@v1`<img src=x onerror=alert(2)>` ``" in text
    assert "the ranked golden@v1\\`&lt;img src=x onerror=alert(2)&gt;\\`" in text  # a reason
    for table in re.findall(r"(?:^\|.*\n)+", text, flags=re.MULTILINE):
        widths = {len(re.findall(r"(?<!\\)\|", line)) for line in table.splitlines()}
        assert len(widths) == 1, table  # a '|' in a name does not add a column
