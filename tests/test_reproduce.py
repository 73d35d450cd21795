"""The committed default-suite results reproduce here: seed 0 of ``zeroshot`` equals
``results/digits-c/zeroshot.json`` cell by cell on 1 thread, and seed 0 of the adapting
``tent`` on 2 threads is within one image per cell of ``results/digits-c/tent.json`` while
its reference accuracies (the frozen model on the same batches, as ``zeroshot`` scores
them) equal ``zeroshot``'s committed cells: the frozen model's numbers on 1 and on 2
threads. Each run is recomputed in a fresh process with an empty cache (nothing
pretrained, nothing cached from earlier tests); the zero-shot one is started by the
installed ``tta-bench`` console script.

``benchmarks/reproduce.py`` does the same for every committed method and also under AVX2
kernels; this test keeps the cheap part in the suite, so a change that moves the committed
numbers (a kernel, the default model, a method's default) fails here until ``results/`` is
regenerated."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

#: Long: run first, so that pytest-xdist's workers share them out (tests/conftest.py).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "results" / "digits-c"


def _seed0(method: str, tmp_path: Path, threads: str, *command: str) -> tuple[dict, str]:
    """``method``'s seed 0 on the default suite in a fresh process on ``threads`` threads
    with an empty cache: its record and what it printed. ``command``: how the CLI is
    started (default ``python -m tta_bench.cli``)."""
    out = tmp_path / f"{method}-{threads}.json"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": threads,
        "TTA_BENCH_CACHE": str(tmp_path / f"cache-{threads}"),
    }
    cmd = [*(command or (sys.executable, "-m", "tta_bench.cli")), "run", "--method", method]
    cmd += ["--quiet", "--output", str(out), "seeds=[0]"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout + done.stderr


def _committed(method: str) -> dict[tuple[str, int], dict]:
    record = json.loads((COMMITTED / f"{method}.json").read_text())
    return {(c["shift"], c["severity"]): c for c in record["cells"] if c["seed"] == 0}


def _assert_equal_to_zeroshot(fresh: dict, log: str, key: str) -> None:
    """``fresh``'s cells, their ``key`` (accuracy, or the reference accuracy of an adapting
    run) equal to the committed ``zeroshot`` cells', each over its 360 images."""
    want = _committed("zeroshot")
    assert "pretrain" not in log.lower()  # the default model is loaded, never trained
    assert len(fresh["cells"]) == len(want) == 15
    for cell in fresh["cells"]:
        old = want[(cell["shift"], cell["severity"])]
        assert cell[key] == old["accuracy"], (key, cell["shift"], cell["severity"])
        assert cell["n"] == old["n"] == 360


def test_zeroshot_seed0_on_one_thread_equals_the_committed_cells(tmp_path):
    """Through the installed ``tta-bench`` console script, as a user types it (the CLI's
    end-to-end test of the entry point: tests/test_cli.py)."""
    script = shutil.which("tta-bench")
    assert script, "the tta-bench console script is not installed"
    fresh, log = _seed0("zeroshot", tmp_path, "1", script)
    assert "zeroshot on digits-c" in log  # the table, printed
    _assert_equal_to_zeroshot(fresh, log, "accuracy")


def test_tent_seed0_on_two_threads_is_within_one_image_and_its_reference_equal(tmp_path):
    fresh, log = _seed0("tent", tmp_path, "2")
    want = _committed("tent")
    for cell in fresh["cells"]:
        old = want[(cell["shift"], cell["severity"])]
        assert abs(cell["accuracy"] - old["accuracy"]) * cell["n"] <= 1 + 1e-9, cell["shift"]
    _assert_equal_to_zeroshot(fresh, log, "reference_accuracy")
