"""A real run of the real plugin end to end (tent and zeroshot on the default model and
digits): cost split, FLOPs, per-class accuracy and the per-batch log, then ``tta-bench
table`` and ``leaderboard`` on its results. The leaderboard/table tests on fixed results
(golden files) are the harness's: ``harness/tests/test_report_golden.py``."""

from __future__ import annotations

import json

import pytest

from tta_bench.cli import main
from tta_bench.report import leaderboard as report


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
