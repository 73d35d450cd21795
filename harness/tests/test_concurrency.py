"""Two runs writing one results file at the same time lose nothing; a lock held too long is a
clear error; a live writer's temporary file is never taken for a killed run's."""

from __future__ import annotations

import subprocess

import pytest
import torch
from filelock import FileLock

from tta_bench.run import results, resume

from .helpers import cli, run, scores, strict_json, subprocess_env, tta_bench_cmd


@pytest.mark.slow
def test_two_concurrent_runs_of_other_seeds_keep_both_seeds(tmp_path):
    out = tmp_path / "shared" / "r.json"
    env = subprocess_env(OMP_NUM_THREADS=str(torch.get_num_threads()))
    procs = [
        subprocess.Popen(
            tta_bench_cmd(
                "run", "--method", "sleepy", "--output", str(out), "--quiet",
                "device=cpu", "method.seconds=0.02", f"seeds=[{seed}]",
            ),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (0, 1)
    ]  # fmt: skip
    try:
        done = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, done):
        assert p.returncode == 0, err
    record = strict_json(out)
    keys = set(scores(record))
    assert {seed for _, _, seed in keys} == {0, 1}
    assert len(record["cells"]) == len(keys) == 8
    assert record["seeds"] == [0, 1]
    assert record["summary"]["n_cells"] == 8
    assert not list(out.parent.glob(".r.json.*.tmp"))


def test_a_lock_held_by_another_process_too_long_is_a_clear_error(tmp_path, monkeypatch, capsys):
    out = tmp_path / "r.json"
    monkeypatch.setattr(results, "LOCK_TIMEOUT_S", 0.3)
    with FileLock(str(out) + ".lock"):
        rc, _, err = cli(
            capsys, "run", "--method", "zeroshot", "--output", str(out), "--quiet", "device=cpu"
        )
    assert rc == 1
    assert "is locked by another process" in err and str(out) + ".lock" in err
    assert "nothing was written" in err
    assert not out.exists()


def test_a_writer_waits_for_the_lock_and_merges_what_the_other_wrote(tmp_path):
    out = tmp_path / "r.json"
    seed0 = run(out, "zeroshot", seeds=[0])
    seed1 = run(tmp_path / "other.json", "zeroshot", seeds=[1])
    merged = results.ResultsFile(out).write(seed1)  # another run's record of the same key
    assert set(scores(merged)) == set(scores(seed0)) | set(scores(seed1))
    assert merged["seeds"] == [0, 1]
    assert strict_json(out)["summary"]["n_cells"] == 8


def test_a_record_of_another_run_is_never_merged_into_the_file(tmp_path):
    out = tmp_path / "r.json"
    run(out, "zeroshot")
    other = run(tmp_path / "other.json", "colour_oracle")
    with pytest.raises(ValueError, match="holds another run"):
        results.ResultsFile(out).write(other)
    assert strict_json(out)["method"] == "zeroshot"


def test_setup_never_deletes_the_temporary_file_of_a_live_writer(tmp_path):
    out = tmp_path / "r.json"
    record = run(out, "zeroshot")
    live = tmp_path / ".r.json.live1234.tmp"  # what atomic_path names a write in progress
    with FileLock(str(out) + ".lock"):  # held by its writer while the file is written
        live.write_text("{")
        resume.previous_record(out, record, resume=True)
        assert live.exists(), "a second run's setup deleted a live writer's temporary file"
    resume.previous_record(out, record, resume=True)  # no writer holds the lock: stale
    assert not live.exists()
