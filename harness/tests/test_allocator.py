"""``reuse_large_blocks``: batch-sized CPU blocks come from the heap (reused from one batch
to the next) once a run starts, unless the user chose the allocator's settings."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="glibc's mallopt and /proc/self/maps",
)

# A child process: apply the policy (or not), then say whether a 40 MB tensor (a 224 px
# float batch of 52 images: above glibc's largest automatic mmap threshold, 32 MiB) lies
# in the brk heap, where a freed block is reused instead of unmapped.
CHILD = r"""
import json, sys, torch
from tta_bench.run.allocator import current_policy, reuse_large_blocks
before = current_policy()
state = reuse_large_blocks() if sys.argv[1] in ("tune", "worker") else None
if sys.argv[1] == "worker":  # a loader worker's initialiser, after the fork
    from tta_bench.run.loader import _worker_init
    _worker_init(0, 0)
    state = current_policy()
def in_heap(ptr):
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return True
    return False
x = torch.empty(10 << 20, dtype=torch.float32)
x.fill_(1.0)
print(json.dumps({"state": state, "in_heap": in_heap(x.data_ptr()), "before": before,
                  "again": reuse_large_blocks() if sys.argv[1] == "tune" else None}))
"""


def _child(mode: str, **env: str) -> dict:
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "TTA_BENCH_MALLOC")
    }
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_large_blocks_come_from_the_heap():
    got = _child("tune")
    assert got["state"]["policy"] == "reuse", got
    assert got["state"]["mmap_threshold"] >= 40 << 20
    assert got["in_heap"]
    assert got["again"] == got["state"]  # once per process, the same answer
    assert got["before"] == {"policy": "system", "reason": "not applied in this process"}


def test_a_loader_worker_gets_glibc_bounds_back():
    """A decoding worker forked from a run does not keep up to 512 MiB: 32 MiB blocks,
    64 MiB trim, so the 40 MB block is a fresh mapping again."""
    got = _child("worker")
    assert got["state"] == {
        "policy": "worker",
        "mmap_threshold": 32 << 20,
        "trim_threshold": 64 << 20,
    }
    assert not got["in_heap"]


def test_without_the_policy_such_a_block_is_a_fresh_mapping():
    """The check above can fail: glibc's default maps a 40 MB block outside the heap."""
    assert not _child("plain")["in_heap"]


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"TTA_BENCH_MALLOC": "system"}, "TTA_BENCH_MALLOC=system"),
        ({"MALLOC_MMAP_THRESHOLD_": "131072"}, "MALLOC_MMAP_THRESHOLD_ is set"),
        ({"MALLOC_TRIM_THRESHOLD_": "131072"}, "MALLOC_TRIM_THRESHOLD_ is set"),
        ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}, "GLIBC_TUNABLES"),
    ],
)
def test_the_users_choice_is_left_alone(env, reason):
    got = _child("tune", **env)
    assert got["state"]["policy"] == "system" and reason in got["state"]["reason"]
    assert not got["in_heap"]
