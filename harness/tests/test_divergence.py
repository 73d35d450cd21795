"""A method whose output turns non-finite: its cells are reported as diverged (the batch and
the reason), never scored; the run has no mean; the file stays strict JSON; tables say
"diverged"; leaderboards leave the run out and say why."""

from __future__ import annotations

import json

import pytest

from .helpers import cli, run, strict_json

BATCHES_PER_CELL = 4  # 32 images, batch size 8


@pytest.mark.parametrize(
    ("what", "reason"), [("logits", "non-finite logits"), ("loss", "non-finite loss (inf)")]
)
def test_cells_of_a_diverging_method_are_diverged_never_scored(tmp_path, what, reason):
    out = tmp_path / "r.json"
    record = run(out, "diverge", method_args={"after": 2, "what": what})
    assert len(record["cells"]) == 4
    for d, cell in enumerate(record["cells"]):
        # Each cell runs on a fresh instance: it diverges at its own third batch.
        assert cell["diverged"] == {"batch": d * BATCHES_PER_CELL + 2, "reason": reason}
        assert cell["accuracy"] is None and cell["error"] is None
        assert cell["reference_accuracy"] is None
        assert cell.get("ece") is None and cell.get("nll") is None
        assert cell["n"] == 32 and cell["batches"] == BATCHES_PER_CELL
    summary = record["summary"]
    assert summary["mean_accuracy"] is None and summary["n_diverged"] == 4
    assert "accuracy_std" not in summary and "mean_accuracy_per_seed" not in summary
    assert [c["batch"] for c in summary["diverged_cells"]] == [2, 6, 10, 14]
    text = out.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert strict_json(out) == json.loads(json.dumps(record))


def test_a_method_diverging_late_leaves_earlier_cells_scored(tmp_path):
    record = run(tmp_path / "r.json", "diverge", method_args={"after": 4})
    assert all("diverged" not in c and c["accuracy"] is not None for c in record["cells"])
    assert record["summary"]["mean_accuracy"] is not None


def test_a_continual_run_diverges_from_the_batch_on_and_keeps_earlier_cells(tmp_path):
    record = run(tmp_path / "r.json", "diverge", "tiny-continual", method_args={"after": 5})
    first, second, *later = record["cells"]  # one instance sees all 16 batches, in order
    assert "diverged" not in first and first["accuracy"] is not None and first["n"] == 32
    assert second["diverged"] == {"batch": 5, "reason": "non-finite logits"}
    assert len(later) == 2
    for cell in later:
        assert cell["accuracy"] is None and cell["n"] == 32
        # The method never ran on these cells: they must point at batch 5, where the
        # seed's state was lost (as their batch, or in their reason), not claim non-finite
        # logits at a batch of their own.
        where = cell["diverged"]
        assert where["batch"] == 5 or "batch 5" in where["reason"], where
    assert record["summary"]["mean_accuracy"] is None
    assert record["summary"]["n_diverged"] == 3


def test_the_table_shows_diverged_cells(tmp_path, capsys):
    out = tmp_path / "r.json"
    run(out, "diverge", "tiny-continual", method_args={"after": 5})
    rc, text, err = cli(capsys, "table", str(out), "--format", "plain")
    assert rc == 0, err
    noise = next(line for line in text.splitlines() if line.startswith("noise"))
    dim = next(line for line in text.splitlines() if line.startswith("dim"))
    assert "diverged" not in noise.split()[1]  # noise sev 1 was scored
    assert noise.split()[2] == "diverged"  # noise sev 3 diverged
    assert dim.split()[1:3] == ["diverged", "diverged"]
    assert "diverged (3 cells)" in text  # the summary row


def test_the_leaderboard_leaves_a_diverged_run_out_with_the_reason(tmp_path, capsys):
    board = tmp_path / "board"
    run(board / "a_zeroshot.json", "zeroshot")
    run(board / "b_diverge.json", "diverge", method_args={"after": 2})
    rc, out, err = cli(capsys, "leaderboard", str(board), "--suite", "tiny-shifts", "--no-plots")
    assert rc == 0, err
    assert "ranked 1 runs" in out
    assert "left out b_diverge.json: diverged in 4 cell(s), not ranked" in err
    assert "batch 2: non-finite logits" in err
    markdown = (board / "leaderboard.md").read_text()
    assert "| 1 " in markdown and "zeroshot" in markdown
    assert "`b_diverge.json`: diverged in 4 cell(s)" in markdown
    # With nothing else to rank, the reason is the error.
    (board / "a_zeroshot.json").unlink()
    rc, _, err = cli(capsys, "leaderboard", str(board), "--suite", "tiny-shifts", "--no-plots")
    assert rc == 2 and "diverged in 4 cell(s)" in err
