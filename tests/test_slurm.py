"""Sweeps on a real scheduler: a single-node SLURM cluster (tools/slurm-cluster.sh) runs
`tta-bench sweep hydra/launcher=submitit_slurm` as array jobs; a task is preempted and
requeued; one episodic cell is split over 2 array tasks and merged.

The cluster is the one ``SLURM_CONF`` names (``.ci/run`` starts it), or one these tests
start under a temporary directory when the packages are installed and we are root; where
neither is possible every test here is skipped with the reason."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from processes import on_sys_path, run_on_one_thread, sweep_on_one_thread

from tta_bench.report import leaderboard as report
from tta_bench.run import results

#: Long: run first, so that pytest-xdist's workers share them out (tests/conftest.py).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "slurm-cluster.sh"
#: A task's cells: small, so each array task runs for seconds.
SMALL = ["protocol.shifts=[contrast,fog]", "protocol.max_images=24", "protocol.batch_size=24"]
#: Every task gets one CPU and a wall-time limit long enough that submitit reads the
#: signal of a test as a preemption (below 80% of the limit), not as a timeout.
ON_SLURM = [
    "hydra/launcher=submitit_slurm",
    "hydra.launcher.cpus_per_task=1",
    "hydra.launcher.timeout_min=60",
]
#: What a cell computes (never its timings): these must be equal, bit for bit.
SCORES = (
    *("shift", "severity", "seed", "n", "accuracy", "nll", "ece", "error"),
    *("reference_accuracy", "forward_passes_per_sample", "backward_passes_per_sample"),
)


def _sinfo_ok(env: dict[str, str]) -> bool:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                             text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and any(
        s in out.stdout for s in ("idle", "mixed", "allocated", "completing")
    )


def _unavailable(reason: str) -> None:
    """Skip, naming the reason; where the cluster must be there (``.ci/run`` sets
    ``TTA_BENCH_REQUIRE_SLURM=1``), fail instead."""
    if os.environ.get("TTA_BENCH_REQUIRE_SLURM") == "1":
        pytest.fail(f"TTA_BENCH_REQUIRE_SLURM=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The environment of a running cluster (``SLURM_CONF`` set), or a skip with why."""
    env = dict(os.environ)
    if env.get("SLURM_CONF") and _sinfo_ok(env):
        yield env
        return
    if shutil.which("sbatch") is None:
        _unavailable(
            "no SLURM client (sbatch): apt-get install slurmctld slurmd munge slurm-client"
        )
    if os.geteuid() != 0:
        _unavailable("starting the test cluster's daemons needs root (no systemd here)")
    folder = tmp_path_factory.mktemp("slurm")
    start = subprocess.run(["bash", str(SCRIPT), "start", str(folder)], capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    if start.returncode != 0:
        _unavailable(f"the test cluster did not start: {start.stderr.strip()[-500:]}")
    env["SLURM_CONF"] = str(folder / "slurm.conf")
    try:
        yield env
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", str(folder)], timeout=60)


def _start_cli(env: dict[str, str], *args: str) -> subprocess.Popen:
    """``tta-bench ARGS`` started in a new interpreter on one thread, its output (stdout and
    stderr) captured as text."""
    cmd = [sys.executable, "-m", "tta_bench.cli", *args]
    return subprocess.Popen(cmd, env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def _reap(proc: subprocess.Popen, timeout: int = 300) -> None:
    """Wait for a process a fixture started (up to ``timeout`` seconds, then kill it), so
    that none of its cluster work outlives the tests."""
    if proc.poll() is None:
        try:
            proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


@contextlib.contextmanager
def _cli_meanwhile(env: dict[str, str], *args: str, timeout: int = 300) -> Iterator[None]:
    """``tta-bench ARGS`` in a new interpreter on one thread while the body runs (the test's
    local reference: the command mostly waits on the scheduler and its tasks); then waits
    for it and asserts that it succeeded. An error in the body kills it."""
    proc = _start_cli(env, *args)
    try:
        yield
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-6000:]


def _scores(record: dict) -> list[dict]:
    return [{k: c.get(k) for k in SCORES} for c in record["cells"]]


def _merged(sweep_dir: Path) -> dict[str, dict]:
    return {
        results.load_results(p)["method"]: results.load_results(p)
        for p in sorted(sweep_dir.glob("*.json"))
    }


def _array_tasks(sweep_dir: Path) -> list[str]:
    """The array tasks submitit made (its folders ``<array job id>_<task index>``)."""
    folder = sweep_dir / ".submitit"
    return sorted(
        p.name for p in folder.iterdir() if p.is_dir() and re.fullmatch(r"\d+_\d+", p.name)
    )


def _job_logs(sweep_dir: Path) -> str:
    return "\n".join(p.read_text() for p in sorted((sweep_dir / ".submitit").rglob("*_log.*")))


def test_an_array_sweep_ranks_as_the_same_sweep_run_locally(cluster, preempted_sweep, tmp_path):
    # ``preempted_sweep``: started now, so that its sleeping task and the thread that
    # interrupts it run while this test computes; the preemption test checks it.
    grid = ["method=zeroshot,tda,tent", "seeds=[0,1]", *SMALL]
    on = tmp_path / "slurm"
    here = tmp_path / "local"
    with _cli_meanwhile(cluster, "sweep", "--dir", str(on), *grid, *ON_SLURM):
        sweep_on_one_thread("--dir", str(here), *grid)  # Hydra's basic launcher, in process
    # one array: tent's 2 jobs alone, zeroshot's and tda's 4 light jobs packed into 1 task
    tasks = _array_tasks(on)
    arrays = {t.split("_")[0] for t in tasks}
    assert len(arrays) == 1 and len(tasks) == 3, tasks
    logs = _job_logs(on)
    assert logs.count("(packed, ") == 4  # each packed job's line, from its task's log
    assert logs.count("Starting with JobEnvironment(job_id=") == 3  # run by SLURM tasks
    cluster_runs, local_runs = _merged(on), _merged(here)
    assert sorted(cluster_runs) == ["tda", "tent", "zeroshot"]
    for method, record in cluster_runs.items():
        assert record["seeds"] == [0, 1] and len(record["cells"]) == 4
        assert _scores(record) == _scores(local_runs[method]), method
    # the leaderboards of the two folders: the same entries in the same order, same numbers
    pid = next(iter(cluster_runs.values()))["protocol"]["id"]
    boards = [report.collect(d, "digits-c", protocol_id=pid) for d in (on, here)]
    assert [e.label for e in boards[0].entries] == [e.label for e in boards[1].entries]
    for a, b in zip(*(board.entries for board in boards)):
        assert a.record["summary"]["mean_accuracy"] == b.record["summary"]["mean_accuracy"]
        assert a.record["summary"]["accuracy_ci95"] == b.record["summary"]["accuracy_ci95"]
        assert _scores(a.record) == _scores(b.record)


def _squeue(env: dict[str, str]) -> list[tuple[str, str, str]]:
    out = subprocess.run(["squeue", "-h", "-o", "%i|%T|%r"], env=env, capture_output=True,
                         text=True, timeout=30).stdout  # fmt: skip
    return [tuple(line.split("|")) for line in out.splitlines() if line.strip()]  # type: ignore[misc]


def _wait(predicate, what: str, timeout: float = 120.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def _cells_in(path: Path) -> int:
    try:
        return len(json.loads(path.read_text())["cells"])
    except (OSError, ValueError, KeyError):
        return 0


def _release_when_requeued(env: dict[str, str], job: str) -> None:
    """A requeued job waits two minutes before it may start again (SLURM's begin time);
    the test lets it start at once."""
    _wait(lambda: any(j == job and s == "PENDING" for j, s, _ in _squeue(env)), "the requeue")
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, check=True)


def _job_of(sweep_dir: Path, env: dict[str, str]) -> str | None:
    """The running task of the sweep's one job, as squeue names it (``<id>`` or
    ``<id>_0``): the job submitit made for this sweep (its folder ``.submitit/<id>``), never
    another test's job on the same cluster."""
    folder = sweep_dir / ".submitit"
    if not folder.is_dir():
        return None
    ids = {p.name for p in folder.iterdir() if p.is_dir() and p.name.isdigit()}
    for j, state, _ in _squeue(env):
        if state == "RUNNING" and j.split("_")[0] in ids:
            return j
    return None


#: The harness's own test plugin (``harness/tests/plugin``, found through ``PYTHONPATH``):
#: its ``sleepy`` method is its frozen tiny classifier with a sleep per batch. The
#: preemption test needs cells long enough to be interrupted; with a real method a cell
#: lasts as long as its arithmetic, which the test would pay for three times (the
#: interrupted tasks and the reference run), while requeueing and resuming are the same
#: whatever the method computes.
TEST_PLUGIN = ROOT / "harness" / "tests" / "plugin"
TEST_PLUGINS = "tta-bench,tta-bench-testplugin"
#: 6 cells (2 shifts x 3 severities) of 4 batches: 1.6 s of sleep a cell, so a requeued
#: task is killed (SIGTERM, which submitit ignores, then SIGKILL after the test cluster's
#: KillWait of 2 s) before it could finish its remaining cells.
SLEEPY = ["method=sleepy", "seeds=[0]", "protocol.severities=[1,2,3]"]
SLEEPY_CELLS = 6
SLEEP = "method.seconds=0.4"


#: The episodic cell the last test splits over two array tasks.
EPISODIC = ["method=mura", "seeds=[0]", "protocol.reset=episodic_batch",
            "protocol.shifts=[contrast]", "protocol.max_images=20",
            "protocol.batch_size=5"]  # fmt: skip


@pytest.fixture(scope="module")
def episodic_sweep(cluster, tmp_path_factory):
    """``(sweep folder, process)``: the sweep of the episodic test, its cell in two parts,
    started on the cluster when a test of this module first asks for it. The preemption
    test does (it waits for the interruptions of its sleeping task, which leaves a CPU to
    the two parts' tasks); the episodic test waits for it and checks it.
    Where that test did not run (``-k``, or another worker took it), the sweep is waited for
    at the module's end, so that none of its tasks outlives the tests."""
    sweep_dir = tmp_path_factory.mktemp("episodic") / "sweep"
    proc = _start_cli(cluster, "sweep", "--dir", str(sweep_dir), "--shards", "2", *EPISODIC,
                      *ON_SLURM)  # fmt: skip
    try:
        yield sweep_dir, proc
    finally:
        _reap(proc)


@dataclasses.dataclass
class _Preempted:
    """The preemption test's sweep and the thread that interrupts its task twice."""

    sweep_dir: Path
    env: dict[str, str]
    proc: subprocess.Popen
    interrupted_at: list[int] = dataclasses.field(default_factory=list)
    failure: list[BaseException] = dataclasses.field(default_factory=list)
    driver: threading.Thread | None = None

    def interrupt_twice(self) -> None:
        """1. the scheduler's preemption signal (submitit checkpoints and requeues the
        task), once it finished a first cell; 2. an operator's requeue (the task is killed:
        SIGTERM, then SIGKILL) once the rerun finished a cell. Run on a thread; what fails
        is kept for the test to raise."""
        runs = self.sweep_dir / "runs"
        try:
            part = _wait(lambda: next(iter(runs.glob("*.json")), None), "results")
            job = _wait(lambda: _job_of(self.sweep_dir, self.env), "the sweep's job")
            _wait(lambda: 1 <= _cells_in(part) <= SLEEPY_CELLS - 4, "a first finished cell")
            subprocess.run(["scancel", "--signal=USR2", job], env=self.env, check=True)
            self.interrupted_at.append(_cells_in(part))
            _release_when_requeued(self.env, job)
            _wait(lambda: _cells_in(part) > self.interrupted_at[0], "a cell of the rerun",
                  timeout=60)  # fmt: skip
            assert _cells_in(part) <= SLEEPY_CELLS - 3, "the rerun ran too fast to be interrupted"
            subprocess.run(["scontrol", "requeue", job], env=self.env, check=True)
            self.interrupted_at.append(_cells_in(part))
            _release_when_requeued(self.env, job)
        except BaseException as e:  # noqa: BLE001 - raised again by the test
            self.failure.append(e)


@pytest.fixture(scope="module")
def preempted_sweep(cluster, tmp_path_factory):
    """The preemption test's sweep of the sleepy method, started on the cluster when a test
    of this module first asks for it, with the thread that interrupts its task twice
    (``_Preempted.interrupt_twice``). The array test asks first: the sleeping task and the
    waits run while it computes, instead of holding this worker idle. Where the
    preemption test did not run (``-k``, or another worker took it), the sweep is waited
    for at the module's end, so that none of its tasks outlives the tests."""
    tmp = tmp_path_factory.mktemp("preempted")
    path = os.pathsep.join(p for p in (str(TEST_PLUGIN), cluster.get("PYTHONPATH")) if p)
    env = {
        **cluster,
        "PYTHONPATH": path,
        "TTA_BENCH_PLUGINS": TEST_PLUGINS,
        "TTA_BENCH_CACHE": str(tmp / "cache"),
    }
    sweep_dir = tmp / "sweep"
    proc = _start_cli(env, "sweep", "--dir", str(sweep_dir), *SLEEPY, SLEEP, *ON_SLURM)
    state = _Preempted(sweep_dir, env, proc)
    state.driver = threading.Thread(target=state.interrupt_twice, daemon=True)
    state.driver.start()
    try:
        yield state
    finally:
        state.driver.join(timeout=300)
        _reap(proc)


def test_a_preempted_and_a_requeued_task_lose_nothing(preempted_sweep, episodic_sweep, tmp_path):
    state, sweep_dir = preempted_sweep, preempted_sweep.sweep_dir
    state.driver.join(timeout=300)
    assert not state.driver.is_alive(), "the interruptions did not finish"
    if state.failure:
        raise state.failure[0]
    try:
        out, _ = state.proc.communicate(timeout=300)
    finally:
        if state.proc.poll() is None:
            state.proc.kill()
    interrupted_at = state.interrupted_at
    assert state.proc.returncode == 0, out[-3000:]
    logs = _job_logs(sweep_dir)
    assert "this job is preempted" in logs  # submitit read the signal as a preemption
    assert logs.count("Starting with JobEnvironment(job_id=") >= 3  # ran three times
    # the last run skipped every cell the interrupted runs had finished
    skipped = [int(s) for s in re.findall(r"\((\d+) skipped as finished\)", logs)]
    assert skipped and skipped[-1] >= interrupted_at[-1] >= 1, (skipped, interrupted_at)
    merged = results.load_results(next(sweep_dir.glob("*.json")))
    assert merged["method"] == "sleepy" and len(merged["cells"]) == SLEEPY_CELLS
    # the same run, uninterrupted, in this process (no sleep: it computes the same cells)
    alone = tmp_path / "alone.json"
    here = {"TTA_BENCH_PLUGINS": TEST_PLUGINS, "TTA_BENCH_CACHE": str(tmp_path / "cache")}
    with on_sys_path(TEST_PLUGIN, here):  # this process on the test plugin alone
        run_on_one_thread(*SLEEPY, "method.seconds=0", "progress=false", "--quiet",
                          "--output", str(alone))  # fmt: skip
    assert _scores(merged) == _scores(results.load_results(alone))


def test_one_episodic_cell_split_over_two_array_tasks_equals_the_whole(episodic_sweep, tmp_path):
    # two parts, run side by side on the test cluster's two CPUs (any count merges alike:
    # harness/tests/test_derived_integrity.py checks the layouts in process)
    sweep_dir, proc = episodic_sweep
    whole = tmp_path / "whole.json"
    run_on_one_thread(*EPISODIC, "progress=false", "--quiet", "--output", str(whole))
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-6000:]
    assert len(_array_tasks(sweep_dir)) == 2
    parts = sorted((sweep_dir / "runs").glob("*_shard*of2.json"))
    assert len(parts) == 2 and all(results.load_results(p)["shard"]["count"] == 2 for p in parts)
    merged = results.load_results(next(sweep_dir.glob("*.json")))
    assert "shard" not in merged and merged["merged_from"]
    unsharded = results.load_results(whole)
    assert merged["protocol"]["id"] == unsharded["protocol"]["id"]
    assert _scores(merged) == _scores(unsharded)
    assert merged["cells"][0]["n"] == 20 and merged["cells"][0]["batches"] == 4
