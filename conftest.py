"""Settings for every test run from the repository root (``pytest -q -n auto``).

* torch gets at most two threads, shared out among pytest-xdist's workers (one each for two
  workers on two cores): oversubscribed cores make every torch process many times slower.
  It is set where tests run (each worker, or the one process of ``-n 0``); pytest-xdist's
  controller only hands out tests and never imports torch, so the workers start sooner
  (by torch's import).
* Bytecode is written even where ``PYTHONDONTWRITEBYTECODE`` is set (as on some CI and
  sandbox machines): the suite starts dozens of interpreters (CLI runs, sweeps, SLURM
  tasks) and each pytest-xdist worker rewrites every test module's asserts; without
  ``__pycache__`` (git-ignored) each of them compiles the harness, the plugin and the tests
  again.
* The interpreters the tests start wait for work without spinning
  (``OMP_WAIT_POLICY=PASSIVE`` unless set): a torch process on two threads beside a busy
  pytest-xdist worker otherwise spins its idle OpenMP thread on the core the worker needs.
  It changes how threads wait, never what they compute.
* The figures behind both: docs/speed.md, "What falls short", the test suite.
* Tests marked ``slow`` (end-to-end runs in subprocesses, the SLURM cluster) are collected
  first. pytest-xdist's ``worksteal`` mode hands the first part of the list to one worker
  and lets idle workers take the tail of a busy one's queue, so the long tests start at
  once, beside the short ones, instead of ending the run on one worker.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # the interpreters the tests start, too
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read as each one loads OpenMP


def _runs_tests(config: pytest.Config) -> bool:
    """Whether this process runs tests: a pytest-xdist worker, or a run without workers
    (``-n 0``, or pytest-xdist absent); not the controller of a distributed run."""
    if hasattr(config, "workerinput"):
        return True
    return (getattr(config.option, "numprocesses", None) or 0) == 0


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """Before any test module is collected (collection imports torch anyway in a process
    that runs tests): torch's thread count, shared out among the workers."""
    if not _runs_tests(session.config):
        return
    import torch

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, min(2, torch.get_num_threads()) // workers))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable
