"""Keep batch-sized CPU blocks in the process instead of handing them back to the kernel.

torch allocates CPU tensors with the C library's ``malloc`` and has no caching allocator
of its own on the CPU. glibc serves a request above its mmap threshold with a fresh
``mmap`` and unmaps it on ``free``; the threshold adapts upwards to at most 32 MiB. A batch
of 64 images at 224 px is 38.5 MB of float32, so every shift kernel's output, every
conversion and every normalised copy of such a batch is new memory whose pages the kernel
must fault in on first touch, the cost that bounded the cheap per-pixel corruptions at 224 px
(measured: docs/speed.md#corruption-kernels).

``reuse_large_blocks()`` raises glibc's mmap threshold to ``MMAP_THRESHOLD`` and its trim
threshold to ``TRIM_THRESHOLD``: blocks up to 256 MiB come from the heap, and up to 512
MiB of freed memory at the heap's top stays mapped for the next batch. The values a run
computes do not change (only where the bytes live); the cost is resident memory: freed
blocks at the heap's top (up to ``TRIM_THRESHOLD``) and the holes between live blocks
stay mapped, so a step's peak RSS is higher than under glibc's default (measured for the
multi-view methods' steps: docs/speed.md#peak-memory-and-the-batch).

Only where the batches live in ``malloc``'s memory: a run or a ``predict`` job on the CPU
(on a GPU they live in device memory, and pinned host buffers are not ``malloc``'s). A
DataLoader worker forked from such a process only decodes (its largest blocks, a batch of
8-bit images, are below glibc's own bounds), so ``bound_in_worker()`` gives it glibc's
largest automatic thresholds back (32 MiB, trim 64 MiB) instead of keeping up to 512 MiB.

It is left alone where the user chose: ``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, a ``glibc.malloc`` tunable in ``GLIBC_TUNABLES``, or
``TTA_BENCH_MALLOC=system``; and it does nothing off glibc (macOS, musl, Windows).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

#: Blocks up to this size are served from the heap and reused (a 224 px float32 batch of
#: up to 445 images).
MMAP_THRESHOLD = 256 << 20
#: Freed memory at the heap's top kept mapped for reuse.
TRIM_THRESHOLD = 512 << 20
#: Opt-out: ``TTA_BENCH_MALLOC=system`` leaves the C library's settings as they are.
OPT_OUT_ENV = "TTA_BENCH_MALLOC"

#: A loader worker's thresholds: glibc's own upper bounds for its automatic ones.
WORKER_MMAP_THRESHOLD = 32 << 20
WORKER_TRIM_THRESHOLD = 64 << 20

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3

_state: dict[str, object] | None = None


def _user_choice() -> str | None:
    """Why the allocator is the user's to set, or None."""
    if os.environ.get(OPT_OUT_ENV, "").strip().lower() == "system":
        return f"{OPT_OUT_ENV}=system"
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        if name in os.environ:
            return f"{name} is set"
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc"
    return None


def _mallopt(param: int, value: int) -> bool:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    return bool(libc.mallopt(param, value) == 1)


def current_policy() -> dict[str, object]:
    """What this process did (``reuse_large_blocks``), for a run's provenance; applies
    nothing."""
    if _state is None:
        return {"policy": "system", "reason": "not applied in this process"}
    return dict(_state)


def bound_in_worker() -> None:
    """In a loader worker forked from a process that applied ``reuse_large_blocks``:
    glibc's largest automatic thresholds instead of the parent's (see the module
    docstring). A no-op elsewhere."""
    global _state
    if _state is None or _state.get("policy") != "reuse":
        return
    if not (
        _mallopt(_M_MMAP_THRESHOLD, WORKER_MMAP_THRESHOLD)
        and _mallopt(_M_TRIM_THRESHOLD, WORKER_TRIM_THRESHOLD)
    ):
        return  # refused: the parent's settings (and what the state says) stay
    _state = {
        "policy": "worker",
        "mmap_threshold": WORKER_MMAP_THRESHOLD,
        "trim_threshold": WORKER_TRIM_THRESHOLD,
    }


def reuse_large_blocks() -> dict[str, object]:
    """Apply the thresholds once per process (see the module docstring) and return what
    was done, for a run's provenance: ``{"policy": "reuse", "mmap_threshold": ...,
    "trim_threshold": ...}`` or ``{"policy": "system", "reason": ...}``."""
    global _state
    if _state is not None:
        return dict(_state)
    reason = _user_choice()
    libc_name, _ = platform.libc_ver()
    if reason is None and libc_name != "glibc":
        reason = f"not glibc ({libc_name or 'unknown C library'})"
    if reason is None:
        try:
            # some glibc versions cap the mmap threshold at 32 MiB and return 0 above it
            if not _mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD):
                reason = "glibc refused the mmap threshold"
            elif not _mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD):
                reason = "glibc refused the trim threshold"
        except (OSError, AttributeError) as err:
            reason = f"mallopt unavailable: {err}"
    if reason is None:
        _state = {
            "policy": "reuse",
            "mmap_threshold": MMAP_THRESHOLD,
            "trim_threshold": TRIM_THRESHOLD,
        }
    else:
        _state = {"policy": "system", "reason": reason}
    return dict(_state)
