"""``tta-bench verify`` (``tta_bench.run.verify``): cells of a results file re-run from its
record come out identical; a hand-edited cell is reported as different, naming the field; a
continual run's cell re-runs its seed's prefix; bad input is exit status 2 before anything
runs; the results file and its folder are never written; a recorded report marks the run on
the leaderboard while the file is unchanged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tta_bench.paths import file_sha256
from tta_bench.run.verify import choose_cells, compare_cell, hydra_literal
from tta_bench.run.verify_report import report_path, verified_mark

from .helpers import cli


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Small runs of an adapting method, written by ``tta-bench run``: reset per shift (two
    seeds, with per-sample files), continual and mixed domains (one seed each)."""
    from tta_bench.cli import main

    root = tmp_path_factory.mktemp("verify-runs")
    args = ("run", "--quiet", "--method", "norm_tent", "device=cpu")
    assert main([*args, "--suite", "tiny-shifts", "--output", str(root / "shifts" / "r.json"),
                 "seeds=[0,1]"]) == 0  # fmt: skip
    assert main([*args, "--suite", "tiny-continual", "--output", str(root / "cont" / "r.json"),
                 "seeds=[0]", "log_samples=false"]) == 0  # fmt: skip
    assert main([*args, "--suite", "tiny-domains", "--output", str(root / "mixed" / "r.json"),
                 "seeds=[0]", "log_samples=false"]) == 0  # fmt: skip
    return root


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"<dir>"
        for p in sorted(folder.rglob("*"))
    }


def _copy(runs: Path, tmp_path: Path, name: str = "shifts") -> Path:
    shutil.copytree(runs / name, tmp_path / name)
    return tmp_path / name / "r.json"


def _key(cell: dict) -> tuple:
    return (cell["shift"], cell["severity"], cell["seed"])


def _edit(path: Path, change) -> dict:
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record, indent=1))
    return record


def test_a_fresh_run_verifies_identical_and_nothing_is_written(runs, capsys):
    folder = runs / "shifts"
    before = _snapshot(folder)
    rc, out, err = cli(capsys, "verify", str(folder / "r.json"), "--cells", "3", "--seed", "4")
    assert rc == 0, out + err
    assert "3 of 3 cell(s) identical: identical" in out
    assert "environment: as recorded" in out
    assert "each cell runs alone" in err
    progress = [line for line in err.splitlines() if line.startswith("verify: [")]
    assert len(progress) == 3 and all(line.endswith(": identical") for line in progress)
    # the results file and its folder: the same files, byte for byte (no lock, no samples)
    assert _snapshot(folder) == before


def test_the_seed_picks_the_same_cells_from_any_order_of_the_file(runs):
    record = json.loads((runs / "shifts" / "r.json").read_text())
    picked = choose_cells(record, 3, 4)
    shuffled = {**record, "cells": list(reversed(record["cells"]))}
    assert choose_cells(shuffled, 3, 4) == picked
    assert len({_key(c) for c in picked}) == 3
    assert {_key(c) for c in choose_cells(record, 2, 4)} < {_key(c) for c in picked}
    assert choose_cells(record, 3, 5) != picked or choose_cells(record, 3, 6) != picked


def test_a_hand_edited_cell_is_reported_as_different_naming_the_field(runs, tmp_path, capsys):
    path = _copy(runs, tmp_path)
    target = choose_cells(json.loads(path.read_text()), 1, 0)[0]

    def one_more_image(record):  # a consistent edit: accuracy and error by one image
        for c in record["cells"]:
            if _key(c) == _key(target):
                c["accuracy"] = (round(c["accuracy"] * c["n"]) + 1) / c["n"]
                c["error"] = 1 - c["accuracy"]

    record = _edit(path, one_more_image)
    rc, out, err = cli(capsys, "verify", str(path), "--cells", "1", "--seed", "0")
    assert rc == 1, out + err
    edited = next(c for c in record["cells"] if _key(c) == _key(target))
    assert (
        f"DIFFERS in accuracy: recorded {json.dumps(edited['accuracy'])}, re-run "
        f"{json.dumps(target['accuracy'])}" in out
    )
    assert "0 of 1 cell(s) identical: NOT identical" in out
    assert "differs in accuracy" in err


def test_an_inconsistent_edit_is_refused_naming_the_cell_and_field(runs, tmp_path, capsys):
    path = _copy(runs, tmp_path)
    _edit(path, lambda r: r["cells"][1].update(accuracy=0.5))  # error left as it was
    rc, out, err = cli(capsys, "verify", str(path))
    assert rc == 2
    assert "cells[1]" in err and "accuracy 0.5" in err
    assert "verify: [" not in err  # nothing ran


def test_a_continual_cell_re_runs_its_seed_from_the_start(runs, capsys):
    path = runs / "cont" / "r.json"
    record = json.loads(path.read_text())
    second = _key(record["cells"][1])  # the cells are in the stream's order
    seed = next(s for s in range(50) if _key(choose_cells(record, 1, s)[0]) == second)
    rc, out, err = cli(capsys, "verify", str(path), "--cells", "1", "--seed", str(seed))
    assert rc == 0, out + err
    batches = [c["batches"] for c in record["cells"]]
    assert (
        f"so the stream runs from its start: {sum(batches[:2])} of its {sum(batches)} batches "
        f"(2 of {len(batches)} cells)" in out
    )
    assert "1 of 1 cell(s) identical" in out


def test_a_mixed_stream_cell_runs_through_its_last_batch(runs, capsys):
    path = runs / "mixed" / "r.json"
    rc, out, err = cli(capsys, "verify", str(path), "--cells", "2")
    assert rc == 0, out + err
    assert "mixed_domains carries the method's state from cell to cell" in out
    assert "2 of 2 cell(s) identical" in out


def test_a_method_scheduled_over_the_stream_length_runs_its_whole_stream(runs, tmp_path, capsys):
    path = _copy(runs, tmp_path, "cont")
    record = _edit(path, lambda r: r.update(method_resolved={"stream_length": 128}))
    second = _key(record["cells"][1])
    seed = next(s for s in range(50) if _key(choose_cells(record, 1, s)[0]) == second)
    rc, out, _ = cli(capsys, "verify", str(path), "--cells", "1", "--seed", str(seed))
    total = sum(c["batches"] for c in record["cells"])
    assert f"its whole stream runs ({total} batches, {len(record['cells'])} cells)" in out
    assert "note: method_resolved: recorded {'stream_length': 128}, re-run None" in out
    assert rc == 0  # the cells themselves are identical


def test_measured_fields_are_not_compared_and_nested_ones_are_named():
    cell = {"shift": "noise", "severity": 1, "seed": 0, "n": 4, "accuracy": 0.5, "error": 0.5,
            "time_per_sample_s": 0.1, "peak_memory_bytes": 10, "finished": "then",
            "per_class_accuracy": {"red": 1.0, "blue": 0.0}}  # fmt: skip
    other = {**cell, "time_per_sample_s": 0.2, "peak_memory_bytes": 99, "finished": "now"}
    assert compare_cell(cell, other).identical
    changed = compare_cell(cell, {**other, "per_class_accuracy": {"red": 1.0, "blue": 0.5}})
    assert (changed.field, changed.recorded, changed.rerun) == ("per_class_accuracy.blue", 0.0, 0.5)
    missing = compare_cell(cell, {k: v for k, v in other.items() if k != "error"})
    assert (missing.field, missing.rerun) == ("error", "<absent>")


def test_recorded_values_pass_through_hydra_overrides_unchanged():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for value in ["a photo of a {}.", "it's, a \\ b", "ends \\", 'say "x"', "", 1e-05, -3, 0.001,
                  True, None, ["a, b", "c'd"], {"split": "test", "per_class": 3}]:  # fmt: skip
        parsed = parser.parse_overrides([f"x={hydra_literal(value)}"])[0].value()
        assert parsed == value, (value, hydra_literal(value))


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda r: r["model"].update(state_sha256="0" * 64), "model.state_sha256"),
        (lambda r: r["protocol"].update(id=r["protocol"]["id"] + "x"), "protocol.id"),
        (lambda r: r.update(method_config_hash="abc"), "method_config_hash"),
    ],
)
def test_a_run_that_cannot_be_re_created_here_is_refused(runs, tmp_path, capsys, change, field):
    path = _copy(runs, tmp_path)
    _edit(path, change)
    rc, _, err = cli(capsys, "verify", str(path))
    assert rc == 2
    assert f"tta-bench: error: {field}:" in err
    assert "verify: [" not in err


def test_bad_input_is_exit_2_before_anything_runs(runs, tmp_path, capsys):
    path = runs / "shifts" / "r.json"
    (tmp_path / "list.json").write_text("[1, 2]")
    for args, words in [
        ((str(tmp_path / "missing.json"),), "does not exist"),
        ((str(tmp_path / "list.json"),), "expected a results object"),
        ((str(path), "--cells", "0"), "--cells 0: expected 1 or more"),
        ((str(path), "--cells", "9"), "--cells 9: expected 1 to 8"),
        ((str(path), "--threads", "0"), "--threads 0"),
        ((str(path), "--device", "nodevice"), "device 'nodevice'"),
    ]:
        rc, _, err = cli(capsys, "verify", *args)
        assert rc == 2, args
        assert words in err, (args, err)
        assert "verify: [" not in err


def test_help_states_the_exit_statuses(capsys):
    with pytest.raises(SystemExit):
        cli(capsys, "verify", "--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "0 every re-run cell identical, 1 one differs, 2 bad input" in text


def test_a_recorded_report_marks_the_leaderboard_until_the_file_changes(runs, tmp_path, capsys):
    from tta_bench.report import leaderboard

    path = _copy(runs, tmp_path)
    reports = tmp_path / "reports"
    rc, out, _ = cli(capsys, "verify", str(path), "--cells", "2", "--record",
                     "--report-dir", str(reports))  # fmt: skip
    assert rc == 0
    beside = report_path(path)
    assert f"report: {beside}" in out and (reports / beside.name).is_file()
    report = json.loads(beside.read_text())
    assert report["results_sha256"] == file_sha256(path)
    assert [c["identical"] for c in report["cells"]] == [True, True]
    assert verified_mark(path)["text"] == "✓ 2/2"

    board = leaderboard.collect(path.parent, "tiny-shifts")
    assert [name for name, _ in board.left_out] == []  # the report is no results file
    md = leaderboard.leaderboard_markdown(board, images=False)
    assert "norm_tent ✓ 2/2" in md and "re-run with `tta-bench verify`" in md
    page = leaderboard.leaderboard_html(board, images=False)
    assert "✓ 2/2</span>" in page

    _edit(path, lambda r: r.update(created="edited"))  # any change: the report is stale
    assert verified_mark(path) is None
    board = leaderboard.collect(path.parent, "tiny-shifts")
    assert "✓" not in leaderboard.leaderboard_markdown(board, images=False)
