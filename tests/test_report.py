"""Leaderboards from a results directory (byte-identical regeneration, one protocol per
ranking, left-out files with reasons) and a real run end to end: cost split, FLOPs,
per-class accuracy and the per-batch log, then ``tta-bench table`` and ``leaderboard``."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tta_bench import plots, report
from tta_bench.cli import main

GOLDEN = Path(__file__).parent / "golden"


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
    if plots.available():
        expected |= {report.PLOT_SEVERITY, report.PLOT_PARETO}
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


# -- a real run, end to end --------------------------------------------------------------
@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    """tent and zeroshot on 128 images (two batches) of one shift, two seeds, all options."""
    d = tmp_path_factory.mktemp("real")
    common = [
        "--quiet",
        "seeds=[0,1]",
        "protocol.max_images=128",
        "protocol.shifts=[gaussian_noise]",
        "per_class_accuracy=true",
        "flops=true",
    ]
    for method in ("tent", "zeroshot"):
        log = d / f"{method}.jsonl"
        argv = ["run", "--method", method, "--output", str(d / f"{method}.json"), *common]
        assert main([*argv, f"batch_log={log}"]) == 0
    return d


def test_cost_split_adds_up_and_follows_the_method(real_runs):
    tent = json.loads((real_runs / "tent.json").read_text())
    zeroshot = json.loads((real_runs / "zeroshot.json").read_text())
    for record in (tent, zeroshot):
        assert record["provenance"]["torch"]
        assert record["provenance"]["precision"]["dtype"] == "float32"
        for c in record["cells"]:
            split = c["adapt_time_per_sample_s"] + c["predict_time_per_sample_s"]
            assert split == pytest.approx(c["method_time_per_sample_s"])
            assert c["flops_per_sample"] > 0
            assert c["timed_samples"] < c["n"]  # the FLOP-counted batch is left untimed
            assert len(c["per_class_accuracy"]) == 10
            assert 0 <= c["ece"] <= 1
    assert all(c["adapt_time_per_sample_s"] > 0 for c in tent["cells"])
    assert all(c["adapt_time_per_sample_s"] == 0 for c in zeroshot["cells"])
    # tent adapts (backward), so it costs more FLOPs per sample than the frozen model
    assert tent["cells"][0]["flops_per_sample"] > zeroshot["cells"][0]["flops_per_sample"]


def test_batch_log_holds_before_and_after_accuracy(real_runs):
    tent = json.loads((real_runs / "tent.json").read_text())
    lines = [json.loads(x) for x in (real_runs / "tent.jsonl").read_text().splitlines()]
    assert len(lines) == sum(c["batches"] for c in tent["cells"])
    for seed in (0, 1):
        mine = [x for x in lines if x["seed"] == seed]
        cell = next(c for c in tent["cells"] if c["seed"] == seed)
        n = sum(x["n"] for x in mine)
        after = sum(x["accuracy_after"] * x["n"] for x in mine) / n
        before = sum(x["accuracy_before"] * x["n"] for x in mine) / n
        assert after == pytest.approx(cell["accuracy"])
        assert before == pytest.approx(cell["reference_accuracy"])
    assert all(isinstance(x["loss"], float) and x["memory_bytes"] > 0 for x in lines)
    zs = [json.loads(x) for x in (real_runs / "zeroshot.jsonl").read_text().splitlines()]
    assert all(x["loss"] is None and x["accuracy_before"] == x["accuracy_after"] for x in zs)


def test_table_and_leaderboard_on_real_results(real_runs, capsys):
    files = [str(real_runs / "zeroshot.json"), str(real_runs / "tent.json")]
    assert main(["table", *files, "--format", "github"]) == 0
    out = capsys.readouterr().out
    assert "| tent" in out and "GFLOPs/sample" in out and "adapt ms" in out
    protocol = json.loads((real_runs / "tent.json").read_text())["protocol"]["id"]
    argv = ["leaderboard", str(real_runs), "--suite", "digits-c", "--protocol", protocol]
    assert main(argv) == 0
    first = (real_runs / report.LEADERBOARD_MD).read_bytes()
    assert main(argv) == 0
    assert (real_runs / report.LEADERBOARD_MD).read_bytes() == first
    assert "| 1 " in first.decode()
