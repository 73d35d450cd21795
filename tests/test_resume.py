"""Resume: a killed run loses at most the cells in flight, its files always parse, and a
rerun skips finished cells (per cell, or per seed for the stateful protocols)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from method_runs import digits_c_spec
from processes import run_on_one_thread

from tta_bench.run import results, runner
from tta_bench.run.protocol import load_protocol
from tta_bench.run.resume import ResumeMismatchError
from tta_bench.run.spec import RunSpec

SMALL = ["protocol.max_images=24", "protocol.batch_size=24"]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "tta_bench.cli", "run", "--quiet", *args]


def _key(c: dict) -> tuple:
    return (c["shift"], c["severity"], c["seed"])


@pytest.mark.slow
def test_sigkill_mid_run_then_resume(tmp_path, capsys):
    out = tmp_path / "run.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = _cli("--output", str(out), "seeds=[0,1,2]", *SMALL)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    reads = 0
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists():
                record = json.loads(out.read_text())  # every read parses: atomic writes
                reads += 1
                if len(record["cells"]) >= 2:
                    break
            time.sleep(0.02)
        assert proc.poll() is None, "the run finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL and reads > 0
    for f in tmp_path.iterdir():  # nothing truncated: every results file parses
        if f.suffix == ".json":
            results.load_results(f)
    at_kill = results.load_results(out)
    assert "finished" not in at_kill
    n_kill = len(at_kill["cells"])
    suite = load_protocol("digits-c")
    total = 3 * len(suite.shifts) * len(suite.severities)
    assert 2 <= n_kill < total

    # The resumed run and a rerun of the finished one: in this process (only the killed run
    # needs an interpreter of its own; what the resumed one knows comes from the file).
    args = ("--quiet", "--output", str(out), "seeds=[0,1,2]", *SMALL)
    capsys.readouterr()
    run_on_one_thread(*args)
    assert f"resume: skipped {n_kill} finished cell(s)" in capsys.readouterr().out
    final = results.load_results(out)
    assert final["finished"] and final["skipped_cells"] == n_kill
    keys = [_key(c) for c in final["cells"]]
    assert len(keys) == len(set(keys)) == total  # nothing lost, nothing twice
    assert final["cells"][:n_kill] == at_kill["cells"]  # finished cells kept as they were
    assert not list(tmp_path.glob(".*.tmp"))  # the killed write's temporary is cleaned up

    # A rerun of the finished run does no work: the file is not even rewritten.
    mtime = out.stat().st_mtime_ns
    run_on_one_thread(*args)
    assert f"skipped {total} finished" in capsys.readouterr().out
    assert out.stat().st_mtime_ns == mtime


def _spec(method: str, reset: str, seeds: list[int]) -> RunSpec:
    protocol = {"reset": reset, "shifts": ["contrast", "gaussian_blur"], "max_images": 48}
    return digits_c_spec(method, seeds, protocol)


def test_stateful_protocol_resumes_per_seed(tmp_path, default_bundle):
    """Continual cells depend on the cells before them: a partial seed is run again whole."""
    out = tmp_path / "continual.json"
    full = runner.run(_spec("tent", "continual", [0, 1]), out)
    assert len(full["cells"]) == 4
    partial = dict(full)
    partial.pop("finished")
    partial["cells"] = full["cells"][:3]  # seed 0 whole, seed 1 half done (killed)
    results.write_json_atomic(out, partial)
    resumed = runner.run(_spec("tent", "continual", [0, 1]), out)
    assert resumed["skipped_cells"] == 2  # seed 0 only; seed 1 is redone from its start
    acc = {_key(c): c["accuracy"] for c in resumed["cells"]}
    assert acc == {_key(c): c["accuracy"] for c in full["cells"]}
    assert resumed["cells"][:2] == full["cells"][:2]


def test_independent_cells_resume_per_cell(tmp_path, default_bundle):
    out = tmp_path / "rs.json"
    full = runner.run(_spec("tent", "reset_each_shift", [0]), out)
    partial = {**full, "cells": full["cells"][1:]}  # the first cell lost
    partial.pop("finished")
    results.write_json_atomic(out, partial)
    resumed = runner.run(_spec("tent", "reset_each_shift", [0]), out)
    assert resumed["skipped_cells"] == 1
    assert {_key(c): c["accuracy"] for c in resumed["cells"]} == {
        _key(c): c["accuracy"] for c in full["cells"]
    }


def test_resume_refuses_a_different_run(tmp_path, default_bundle):
    out = tmp_path / "r.json"
    runner.run(_spec("zeroshot", "reset_each_shift", [0]), out)
    before = out.read_bytes()
    with pytest.raises(ResumeMismatchError, match="different run"):
        runner.run(_spec("tent", "reset_each_shift", [0]), out)
    assert out.read_bytes() == before
    fresh = runner.run(_spec("zeroshot", "reset_each_shift", [0]), out)  # same run: no work
    assert fresh["skipped_cells"] == 2
    Path(out).write_text("{truncated")
    with pytest.raises(ValueError):
        runner.run(_spec("zeroshot", "reset_each_shift", [0]), out)
