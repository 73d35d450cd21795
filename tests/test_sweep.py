"""``tta-bench sweep``: a Hydra multirun app; one results file per job, merged, resumable."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from processes import run_on_one_thread, sweep_on_one_thread

from tta_bench.registry import registry
from tta_bench.run import results, sweep
from tta_bench.run.rescore import rescore
from tta_bench.run.sweep import first_job, split_seed_overrides

#: Long: run first, so that pytest-xdist's workers share them out (tests/conftest.py).
pytestmark = pytest.mark.slow

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


@pytest.mark.parametrize(
    ("overrides", "methods", "models"),
    [
        (["method=zeroshot,tent", "seeds=[0],[1]"], ["zeroshot", "tent"], ["tiny-clip-digits"]),
        (["method=choice(tent-digits,mura)", "model=tiny-clip-digits"], ["tent", "mura"],
         ["tiny-clip-digits"]),  # a preset: its method
        (["seeds=[0]"], ["zeroshot"], ["tiny-clip-digits"]),  # the catalogue's defaults
        (["method=glob(t*)"], None, ["tiny-clip-digits"]),  # a glob picks among all
        (["~method"], None, ["tiny-clip-digits"]),
    ],
)  # fmt: skip
def test_a_sweep_stores_the_configs_of_the_methods_it_names(overrides, methods, models,
                                                            monkeypatch):  # fmt: skip
    """Storing a method's config imports its module (torch, torchvision, the plugin's
    modules): a sweep stores those its overrides name, all of them only for an open
    choice."""
    stored = []
    monkeypatch.setattr("tta_bench.config._register", lambda m, d: stored.append((m, d)))
    sweep.register_configs(overrides)
    assert stored == [(methods or registry("methods").names(), models)]


def test_sweep_runs_jobs_merges_and_a_rerun_does_no_work(tmp_path):
    sweep_dir = tmp_path / "sweep"
    first = sweep_on_one_thread(
        "--dir", str(sweep_dir), "method=zeroshot,tent", "seeds=[0,1]", *SMALL,
        "log_samples=logits",
    )  # fmt: skip
    assert first.count("(0 skipped as finished)") == 4
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

    # The same sweep again, from its own process in two joblib worker processes: every job
    # finds its file done.
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
    out = sweep_on_one_thread(
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
    )
    assert "SlurmLauncher" in out and "partition: gpu" in out and "timeout_min: 120" in out
    assert not (tmp_path / "slurm").exists()  # --cfg runs nothing


def test_light_jobs_are_packed_into_one_task_with_the_same_results(tmp_path):
    grid = ["method=zeroshot,tda,tent", "seeds=[0,1]", *SMALL]
    packed = sweep_on_one_thread("--dir", str(tmp_path / "packed"), *grid)
    alone = sweep_on_one_thread("--dir", str(tmp_path / "alone"), "--pack", "1", *grid)
    # zeroshot's and tda's 4 jobs run in job 0; tent's 2 jobs each alone
    lines = re.findall(r"\[job (\d+) pid \d+\] (\S+) seeds \[(\d)\].*?(\(packed, \d of \d\))?"
                       r" -> ", packed)  # fmt: skip
    assert sorted((job, m) for job, m, _, _ in lines) == [
        ("0", "tda"), ("0", "tda"), ("0", "zeroshot"), ("0", "zeroshot"), ("1", "tent"),
        ("2", "tent")]  # fmt: skip
    assert packed.count("(packed, ") == 4 and "(packed, " not in alone
    plan = json.loads((tmp_path / "packed" / "jobs" / "packs.json").read_text())
    assert len(plan) == 1 and len(next(iter(plan.values()))) == 3
    for a, b in zip(sorted((tmp_path / "packed").glob("*.json")),
                    sorted((tmp_path / "alone").glob("*.json"))):  # fmt: skip
        ra, rb = results.load_results(a), results.load_results(b)
        assert a.name == b.name and ra["seeds"] == rb["seeds"] == [0, 1]
        assert [c["accuracy"] for c in ra["cells"]] == [c["accuracy"] for c in rb["cells"]]
        assert ra["config"] == rb["config"]  # a packed job's record is the job's own


def test_a_sharded_sweep_merges_its_parts_into_the_whole_cell(tmp_path):
    grid = ["method=tent", "seeds=[0]", "protocol.reset=episodic_batch",
            "protocol.shifts=[contrast]", "protocol.max_images=24",
            "protocol.batch_size=4"]  # fmt: skip
    out = sweep_on_one_thread("--dir", str(tmp_path / "s"), "--shards", "3", *grid)
    assert out.count("[job ") == 3
    parts = sorted((tmp_path / "s" / "runs").glob("*_shard*of3.json"))
    assert len(parts) == 3
    merged = results.load_results(next((tmp_path / "s").glob("*.json")))
    run_on_one_thread(*grid, "progress=false", "--quiet", "--output", str(tmp_path / "w.json"))
    unsharded = results.load_results(tmp_path / "w.json")
    keys = ("n", "accuracy", "nll", "ece", "batches")
    assert [{k: c[k] for k in keys} for c in merged["cells"]] == [
        {k: c[k] for k in keys} for c in unsharded["cells"]
    ]


def test_a_sharded_sweep_with_more_parts_than_batches_merges(tmp_path):
    # before: the parts that got no batch ended in a traceback on every rerun, never merged
    grid = ["method=tent", "seeds=[0]", "protocol.reset=episodic_batch",
            "protocol.shifts=[contrast]", "protocol.max_images=4",
            "protocol.batch_size=4"]  # fmt: skip
    out = sweep_on_one_thread("--dir", str(tmp_path / "s"), "--shards", "4", *grid)
    assert out.count("got no batch of the stream") == 3
    merged = results.load_results(next((tmp_path / "s").glob("*.json")))
    assert [(c["shift"], c["n"]) for c in merged["cells"]] == [("contrast", 4)]


def _sweep_rc(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tta_bench.cli", "sweep", *args]
    return subprocess.run(cmd, env=env or dict(os.environ), capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_a_cluster_launcher_without_sbatch_or_an_unknown_one_exits_2(tmp_path):
    bare = {**os.environ, "PATH": os.path.dirname(sys.executable)}  # no sbatch on it
    done = _sweep_rc("--dir", str(tmp_path / "x"), "method=tent", "hydra/launcher=submitit_slurm",
                     env=bare)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "'sbatch', which is not on the PATH" in done.stderr and "joblib" in done.stderr
    done = _sweep_rc("--dir", str(tmp_path / "x"), "method=tent", "hydra/launcher=pbs")
    assert done.returncode == 2 and "available: basic, joblib, submitit_local" in done.stderr
    done = _sweep_rc("--dir", str(tmp_path / "x"), "--shards", "1", "method=tent")
    assert done.returncode == 2 and "--shards 1" in done.stderr
    assert not (tmp_path / "x").exists()  # refused before anything was written


def test_a_launcher_whose_extra_is_missing_says_how_to_install_it(monkeypatch):
    import importlib.util

    from tta_bench.run import sweep

    real = importlib.util.find_spec

    def without_submitit(name, *args):
        return None if name.startswith("hydra_plugins.hydra_submitit") else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_submitit)
    with pytest.raises(ValueError, match=r"pip install 'tta-bench\[sweep\]'"):
        sweep.check_launcher(["hydra/launcher=submitit_slurm"])
    assert sweep.check_launcher(["hydra/launcher=joblib"]) == "joblib"
    assert sweep.check_launcher([]) == "basic"


def test_slurm_sweeps_requeue_after_a_timeout_unless_told_otherwise():
    from tta_bench.run import sweep

    assert sweep.launcher_defaults(["hydra/launcher=submitit_slurm"]) == [
        "hydra.launcher.max_num_timeout=3"
    ]
    given = ["hydra/launcher=submitit_slurm", "hydra.launcher.max_num_timeout=0"]
    assert sweep.launcher_defaults(given) == []
    assert sweep.launcher_defaults(["hydra/launcher=joblib"]) == []
