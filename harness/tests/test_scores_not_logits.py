"""A method whose outputs are scores, not logits of a probability model
(``Method.scores_are_logits`` False): its results record it, and the summary, the
per-shift calibration tables and the leaderboard print ``n/a`` for its NLL and
ECE instead of a number, while its accuracy and every other method's figures stay. A
results file written before the flag existed reads as logits."""

from __future__ import annotations

import copy
import json
import shutil

import pytest

from tta_bench.report import leaderboard as report
from tta_bench.report import tables
from tta_bench.report.columns import NOT_PROBABILITIES, column, scores_are_logits
from tta_bench.run import results

from .helpers import GOLDEN, run

RESULTS = [GOLDEN / "golden_zeroshot.json", GOLDEN / "golden_tent.json"]


def _records(tent_scores_are_logits: bool | None) -> list[dict]:
    """The golden zero-shot and tent records; tent's flag set (None: left absent)."""
    records = report.load_many(RESULTS)
    if tent_scores_are_logits is not None:
        records[1] = copy.deepcopy(records[1])
        records[1]["scores_are_logits"] = tent_scores_are_logits
    return records


def test_only_the_probability_metrics_are_probabilistic():
    assert column("nll").probabilistic and column("ece").probabilistic
    assert column("ece20").probabilistic
    assert not column("accuracy").probabilistic and not column("auroc").probabilistic


def test_the_summary_prints_no_nll_or_ece_for_scores():
    headers, rows = tables.summary_rows(_records(False))
    zeroshot, tent = (dict(zip(headers, r)) for r in rows)
    assert tent["ECE %"] == tent["NLL"] == NOT_PROBABILITIES
    assert tent["accuracy % (95% CI)"] == "48.8 ± 5.6"  # accuracy reads only the argmax
    assert tent["Δ vs zeroshot (95% CI)"] == "+3.8 [-1.8, +9.4]"
    assert NOT_PROBABILITIES not in (zeroshot["ECE %"], zeroshot["NLL"])
    # the same records, tent's outputs logits (said, or a file from before the flag)
    for flag in (True, None):
        headers, rows = tables.summary_rows(_records(flag))
        tent = dict(zip(headers, rows[1]))
        assert tent["ECE %"] == "12.5" and tent["NLL"] == "2.000"


def test_the_per_shift_calibration_table_says_so_row_by_row():
    records = _records(False)
    head, rows = tables.method_shift_rows(records, metric="ece")
    assert rows[1] == ["tent", *[NOT_PROBABILITIES] * (len(head) - 1)]
    assert NOT_PROBABILITIES not in rows[0]
    head, rows = tables.method_shift_rows(records)  # accuracy: a number for both
    assert all(NOT_PROBABILITIES not in r for r in rows)


def test_the_leaderboard_prints_n_a_for_the_scores_method(tmp_path):
    for path in RESULTS:
        shutil.copy(path, tmp_path / path.name)
    tent = tmp_path / RESULTS[1].name
    data = json.loads(tent.read_text(encoding="utf-8"))
    data["scores_are_logits"] = False
    tent.write_text(json.dumps(data), encoding="utf-8")
    board = report.collect(tmp_path, "golden")
    text = report.leaderboard_markdown(board, images=False)
    row = next(line for line in text.splitlines() if line.startswith("| 1 ") and "tent" in line)
    assert row.count(NOT_PROBABILITIES) == 2  # ECE % and NLL
    other = next(line for line in text.splitlines() if line.startswith("| 2 "))
    assert "zeroshot" in other and NOT_PROBABILITIES not in other


@pytest.fixture()
def scores_method():
    """``scores``: the test plugin's zero-shot method declaring that its outputs are scores
    (registered in this process only)."""
    from tta_bench.registry import registry, reset_registries

    zeroshot = registry("methods").get("zeroshot")
    scores = type("Scores", (zeroshot,), {"scores_are_logits": False, "is_reference": False})
    registry("methods").add("scores", scores)
    yield "scores"
    reset_registries()


def test_a_run_records_the_flag_and_its_table_says_n_a(tmp_path, scores_method):
    out = tmp_path / "scores.json"
    record = run(out, scores_method, protocol={"max_images": 8})
    assert record["scores_are_logits"] is False
    loaded = results.load_results(out)  # the schema admits it
    assert scores_are_logits(loaded) is False
    assert all(c.get("nll") is not None for c in loaded["cells"])  # still measured
    headers, rows = tables.summary_rows([loaded])
    row = dict(zip(headers, rows[0]))
    assert row["NLL"] == row["ECE %"] == NOT_PROBABILITIES
    plain = run(tmp_path / "zeroshot.json", "zeroshot", protocol={"max_images": 8})
    assert plain["scores_are_logits"] is True


def test_the_exports_leave_nll_and_ece_of_scores_empty():
    from tta_bench.report import export

    records = _records(False)
    zeroshot, tent = export.summary_rows(records, ["zeroshot", "tent"])
    assert tent["nll"] is None and tent["ece"] is None and tent["accuracy"] is not None
    assert tent["scores_are_logits"] is False and zeroshot["scores_are_logits"] is True
    assert zeroshot["nll"] is not None
    rows = export.long_rows(records, ["zeroshot", "tent"])
    assert all(r["nll"] is None for r in rows if r["method"] == "tent")
    assert all(r["nll"] is not None for r in rows if r["method"] == "zeroshot")
