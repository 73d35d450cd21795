"""Settings for every test run from the repository root (``pytest -q -n auto``).

* torch gets at most two threads, shared out among pytest-xdist's workers (one each for two
  workers on two cores): oversubscribed cores make every torch process many times slower.
* Tests marked ``slow`` (end-to-end runs in subprocesses, the SLURM cluster) are collected
  first. pytest-xdist's ``worksteal`` mode hands the first part of the list to one worker
  and lets idle workers take the tail of a busy one's queue, so the long tests start at
  once, beside the short ones, instead of ending the run on one worker.
"""

from __future__ import annotations

import os

import pytest
import torch

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads()) // _WORKERS))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable
