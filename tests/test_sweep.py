"""``tta-bench sweep``: a Hydra multirun app; one results file per job, merged, resumable."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tta_bench import results
from tta_bench.rescore import rescore
from tta_bench.sweep import first_job, split_seed_overrides

SMALL = ["protocol.shifts=[contrast]", "protocol.max_images=24", "protocol.batch_size=24"]


def _sweep(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "tta_bench.cli", "sweep", *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def test_seed_lists_become_one_job_per_seed():
    assert split_seed_overrides(["seeds=[0,1,2]", "method=tent,mura"]) == [
        "seeds=[0],[1],[2]",
        "method=tent,mura",
    ]
    assert split_seed_overrides(["seeds=[0,1],[2]"]) == ["seeds=[0,1],[2]"]
    assert first_job(["method=tent,mura", "seeds=[0],[1]", "suite=digits-c"]) == [
        "method=tent",
        "seeds=[0]",
        "suite=digits-c",
    ]


def test_sweep_runs_jobs_merges_and_a_rerun_does_no_work(tmp_path):
    sweep_dir = tmp_path / "sweep"
    first = _sweep(
        "--dir", str(sweep_dir), "method=zeroshot,tent", "seeds=[0,1]", *SMALL,
        "log_samples=logits",
    )  # fmt: skip
    assert first.stdout.count("(0 skipped as finished)") == 4
    runs = sorted((sweep_dir / "runs").glob("*.json"))
    assert len(runs) == 4  # one job per method x seed, each its own normal results file
    for path in runs:
        record = results.load_results(path)
        assert record["finished"] and len(record["seeds"]) == 1 and len(record["cells"]) == 1
    merged = sorted(sweep_dir.glob("*.json"))
    assert [results.load_results(p)["method"] for p in merged] == ["tent", "zeroshot"]
    for path in merged:
        record = results.load_results(path)
        assert record["seeds"] == [0, 1] and len(record["cells"]) == 2
        assert len(record["merged_from"]) == 2
        # the jobs' per-sample files gathered beside the merged file: rescore reads it
        checks = {c.name: c for c in rescore(path)}
        assert checks["accuracy"].stored == 2 and checks["accuracy"].max_difference == 0.0
    mtimes = {p: p.stat().st_mtime_ns for p in runs}

    # The same sweep again, in two joblib worker processes: every job finds its file done.
    again = _sweep(
        "--dir",
        str(sweep_dir),
        "method=zeroshot,tent",
        "seeds=[0,1]",
        *SMALL,
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
    )
    assert again.stdout.count("(1 skipped as finished)") == 4
    pids = set(re.findall(r"\[job \d+ pid (\d+)\]", again.stdout))
    assert pids and str(os.getpid()) not in pids
    assert {p: p.stat().st_mtime_ns for p in runs} == mtimes  # no job rewrote its file
    assert "joblib" in (sweep_dir / "multirun.yaml").read_text()


def test_submitit_slurm_config_composes(tmp_path):
    out = _sweep(
        "--dir",
        str(tmp_path / "slurm"),
        "--cfg",
        "hydra",
        "method=tent,mura",
        "seeds=[0,1,2]",
        "hydra/launcher=submitit_slurm",
        "hydra.launcher.partition=gpu",
        "hydra.launcher.gpus_per_node=1",
        "hydra.launcher.timeout_min=120",
    ).stdout
    assert "SlurmLauncher" in out and "partition: gpu" in out and "timeout_min: 120" in out
    assert not (tmp_path / "slurm").exists()  # --cfg runs nothing
