"""An optional CPU allocator policy (glibc ``malloc``): keep freed big blocks for reuse.

A TTA run allocates the same big buffers batch after batch (a 224 px batch of 64 is 38.5 MB
of float32; each shift kernel returns a fresh one). glibc serves every block above its mmap
threshold (at most 32 MiB, often far less) with a fresh ``mmap`` and unmaps it on free, so
each batch pays the kernel's page faults and page zeroing again: on this project's CPU
machine a third of a memory-bound kernel's time at 224 px (contrast 0.55 -> 0.28 ms per
image, brightness 0.37 -> 0.24, measured by ``benchmarks/corruptions.py``). Caching
allocators (the CUDA caching allocator, jemalloc, tcmalloc) keep freed blocks for reuse;
``keep_freed_memory`` asks glibc to do the same: every block from the heap, freed memory
kept unless more than ``TRIM_THRESHOLD`` lies free at its top.

Runs leave glibc's defaults unless ``TTA_BENCH_MALLOC=keep`` is set (``from_env``): a heap
that keeps freed memory also keeps it resident, which would hide a cell's allocations from
the RSS-based peak, so under the policy ``tta_bench.cost.PeakMemory`` first hands the free
pages back (``release_free_memory``, ``malloc_trim``) and the next batches fault them in
again. That costs ~10% of a tiny model's loop on 32 px images, where the policy gains
nothing; at 224 px on the CPU it pays. ``benchmarks/corruptions.py`` always sets it for
both sides (allocator parity: the reference's per-image buffers are reused by glibc anyway).
Other C libraries (musl, macOS, Windows) are left as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

#: ``mallopt`` parameters (glibc ``malloc.h``).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
#: Free bytes at the top of the heap that glibc keeps before it trims (returns) them.
TRIM_THRESHOLD = 1 << 30
#: The environment variable that opts a run in (``keep``).
ENV = "TTA_BENCH_MALLOC"

_state = {"tuned": False}


@functools.lru_cache(maxsize=1)
def _glibc() -> ctypes.CDLL | None:
    """glibc's ``libc`` when this process runs on it, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        version = libc.gnu_get_libc_version
    except (OSError, AttributeError):  # not glibc (musl has no gnu_get_libc_version)
        return None
    version.restype = ctypes.c_char_p
    return libc


def keep_freed_memory() -> bool:
    """Make glibc keep and reuse freed big blocks in this process (idempotent). Returns
    whether the policy is in force (False on other C libraries)."""
    if _state["tuned"]:
        return True
    libc = _glibc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    _state["tuned"] = ok
    return ok


def from_env() -> bool:
    """Apply ``TTA_BENCH_MALLOC``: ``keep`` -> ``keep_freed_memory()``; ``system`` or unset
    -> glibc's defaults. Returns whether the keep policy is in force."""
    value = os.environ.get(ENV, "").strip().lower()
    if value not in ("", "system", "keep"):
        raise ValueError(f"{ENV}={value!r}: expected 'system' (the default) or 'keep'")
    if value == "keep":
        return keep_freed_memory()
    return _state["tuned"]


def release_free_memory() -> None:
    """Return the heap's free pages to the system (``malloc_trim(0)``); a no-op off glibc."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def policy() -> str:
    """``keep`` when ``keep_freed_memory`` is in force in this process, else ``system``
    (recorded in each results file's provenance)."""
    return "keep" if _state["tuned"] else "system"
