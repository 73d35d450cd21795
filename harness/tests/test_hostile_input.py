"""Careless or hostile input refused before it costs anything, and tables that never
compute from inconsistent files (each case was observed to pass silently before)."""

from __future__ import annotations

import copy
import json

import pytest

import tta_bench

from .helpers import GOLDEN, cli


def test_an_unwritable_cache_directory_is_refused_at_start(capsys, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder", encoding="utf-8")
    monkeypatch.setenv("TTA_BENCH_CACHE", str(blocker / "cache"))
    rc, _, err = cli(capsys, "run", "--quiet", "--output", str(tmp_path / "r.json"), "seeds=[0]")
    assert rc == 2
    assert f"cache directory {str(blocker / 'cache')!r} is not writable" in err
    assert not (tmp_path / "r.json").exists()


def test_a_data_dir_that_nothing_reads_is_reported(capsys, tmp_path):
    rc, _, err = cli(
        capsys, "run", "--quiet", "--data-dir", str(tmp_path), "--cfg", "seeds=[0]"
    )  # fmt: skip
    assert rc == 0
    assert f"--data-dir {str(tmp_path)!r} is ignored: suite 'tiny-shifts'" in err
    rc, _, err = cli(capsys, "run", "--quiet", "--cfg", "seeds=[0]")
    assert "is ignored" not in err


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"seeds": [1.7]}, "seeds must be a list of non-negative integers; got [1.7]"),
        ({"seeds": "01"}, "seeds must be a list of integers, e.g. [0, 1, 2]; got '01'"),
        ({"seeds": 0}, "seeds must be a list of integers"),
        ({"seeds": [True]}, "seeds must be a list of non-negative integers"),
        ({"seeds": [-1]}, "seeds must be a list of non-negative integers"),
        ({"method": 123}, "method must be a registered method's name"),
        ({"suite": ""}, "suite must be a registered suite's name"),
        ({"overrides": "method.lr=1"}, "overrides must be a list of 'key=value' strings"),
        ({"overrides": ["lr"]}, "overrides must be 'key=value' strings; got ['lr']"),
        ({"method": "norm_tnet"}, "unknown method 'norm_tnet'"),
    ],
)
def test_the_python_api_checks_its_arguments_types(kwargs, expected):
    with pytest.raises(ValueError) as info:  # unknown names too: a ValueError, as documented
        tta_bench.evaluate(**kwargs)
    assert expected in str(info.value)


def _golden() -> dict:
    return json.loads((GOLDEN / "golden_tent.json").read_text(encoding="utf-8"))


def _table(capsys, tmp_path, record) -> tuple[int, str]:
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(record), encoding="utf-8")
    rc, _, err = cli(capsys, "table", str(path))
    return rc, err


def test_a_duplicated_cell_is_refused_naming_it(capsys, tmp_path):
    record = _golden()
    record["cells"].append(copy.deepcopy(record["cells"][0]))
    rc, err = _table(capsys, tmp_path, record)
    c = record["cells"][0]
    assert rc == 2
    assert (
        f"cells[{len(record['cells']) - 1}] (shift {c['shift']}, severity {c['severity']}, "
        f"seed {c['seed']}) repeats cells[0]: a duplicated cell" in err
    )


def test_an_accuracy_that_no_longer_matches_its_counts_is_refused(capsys, tmp_path):
    record = _golden()
    record["cells"][1]["accuracy"] += 0.01  # edited by hand: no longer 1 - error
    rc, err = _table(capsys, tmp_path, record)
    assert rc == 2 and "cells[1]" in err and "do not add to 1" in err
    record = _golden()
    cell = record["cells"][1]
    cell["accuracy"] += 0.3 / cell["n"]  # consistent with error, but no count of n images
    cell["error"] = 1.0 - cell["accuracy"]
    rc, err = _table(capsys, tmp_path, record)
    assert rc == 2 and f"is no count of its {cell['n']} images" in err


def test_a_second_seed_merged_into_the_file_prints_what_is_on_disk(capsys, tmp_path):
    out = str(tmp_path / "r.json")
    assert cli(capsys, "run", "--quiet", "--output", out, "seeds=[0]")[0] == 0
    rc, text, _ = cli(capsys, "run", "--quiet", "--output", out, "seeds=[1]")
    assert rc == 0
    assert "seeds [0, 1]: accuracy (%)" in text
    assert "one seed: no interval" not in text
    assert json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))["seeds"] == [0, 1]
