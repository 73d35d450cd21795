"""Recycled batch buffers: a large CPU tensor reused from one batch to the next.

torch allocates CPU tensors with the C library's ``malloc`` and keeps no cache of its own
on the CPU. glibc serves a block above its mmap threshold (which adapts upwards to at most
32 MiB) with a fresh mapping and unmaps it when it is freed, so a batch of 64 images at
224 px (38.5 MB of float32) that a shift kernel returns is new memory every time, and the
kernel pays a page fault per 4 KiB page on first touch: about three times the cost of
writing the batch once (measured in ``docs/speed.md``). Instead of changing ``malloc``'s
thresholds for the whole process, the code that writes such batches (the shift kernels,
``tta_bench.data.to_float_images``, the shifted-image cache) asks ``batch_buffer`` for its
output and scratch tensors.

``batch_buffer(shape, dtype)`` is ``torch.empty(shape, dtype=dtype)`` (the values are
unset), from a small pool when a tensor of that shape, dtype and inference mode is free
there: no tensor shares its storage (no view, no reference to it but the pool's) and it
neither requires a gradient nor holds one. A method that keeps a batch (a memory bank) or a
view of it keeps it from the pool: the next request gets a new tensor. Tensors below
``MIN_BYTES`` come from ``torch.empty`` (glibc reuses such blocks itself). The pool holds
at most ``MAX_BYTES`` of free tensors, least recently used first out; ``release()``
empties it.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from typing import Any

import torch

#: Smaller requests are ``torch.empty``: glibc's heap serves and reuses them.
MIN_BYTES = 1 << 20
#: The pool keeps at most this many bytes of tensors: the buffers of 224 px shift kernels
#: on a batch of 64 (one kernel may ask for several shapes); at 256 MiB they evicted each
#: other (measured in docs/speed.md#corruption-kernels).
MAX_BYTES = 512 << 20

_lock = threading.Lock()
_pool: OrderedDict[tuple[Any, ...], list[torch.Tensor]] = OrderedDict()
_held = 0
_stats = {"reused": 0, "new": 0}
_FREE: tuple[int, int] | None = None


def _counts_at(slots: list[torch.Tensor], i: int) -> tuple[int, int]:
    """(Python references to ``slots[i]``, users of its storage), counted without a name
    bound to the tensor (so that the count does not depend on the caller's frame)."""
    return (
        sys.getrefcount(slots[i]),
        torch._C._storage_Use_Count(slots[i].untyped_storage()._cdata),
    )


def _free_counts() -> tuple[int, int]:
    """The counts of a tensor nothing but a pool list refers to (calibrated once)."""
    global _FREE
    if _FREE is None:
        _FREE = _counts_at([torch.empty(1)], 0)
    return _FREE


def _is_free_at(slots: list[torch.Tensor], i: int) -> bool:
    return (
        _counts_at(slots, i) == _free_counts()
        and not slots[i].requires_grad
        and slots[i].grad is None
    )


def batch_buffer(
    shape: tuple[int, ...] | torch.Size,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    memory_format: torch.memory_format = torch.contiguous_format,
) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` and ``dtype`` on ``device``: recycled from the
    pool on the CPU when one is free (module docstring), else new (and pooled)."""
    global _held
    shape = tuple(int(s) for s in shape)
    device = torch.device(device)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    usable = (
        device.type == "cpu" and nbytes >= MIN_BYTES and hasattr(torch._C, "_storage_Use_Count")
    )
    if not usable:
        return torch.empty(shape, dtype=dtype, device=device, memory_format=memory_format)
    key = (shape, dtype, memory_format, torch.is_inference_mode_enabled())
    with _lock:
        slots = _pool.get(key)
        if slots is not None:
            _pool.move_to_end(key)
            for i in range(len(slots)):
                if _is_free_at(slots, i):
                    _stats["reused"] += 1
                    return slots[i]
            for i in reversed(range(len(slots))):  # a method made one a leaf: drop it
                if slots[i].requires_grad or slots[i].grad is not None:
                    del slots[i]
                    _held -= nbytes
        out = torch.empty(shape, dtype=dtype, device=device, memory_format=memory_format)
        _stats["new"] += 1
        if nbytes <= MAX_BYTES:
            _pool.setdefault(key, []).append(out)
            _held += nbytes
            _evict()
        return out


def buffer_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``batch_buffer`` of ``t``'s shape and device (and dtype, unless given): the
    recycled counterpart of ``torch.empty_like``."""
    return batch_buffer(t.shape, t.dtype if dtype is None else dtype, t.device)


def _evict() -> None:
    """Drop the least recently asked-for tensors while the pool holds over ``MAX_BYTES``."""
    global _held
    while _held > MAX_BYTES and _pool:
        key, slots = next(iter(_pool.items()))
        t = slots.pop(0)
        _held -= t.numel() * t.element_size()
        if not slots:
            del _pool[key]


def release() -> None:
    """Drop every pooled tensor (tensors in use stay with their users)."""
    global _held
    with _lock:
        _pool.clear()
        _held = 0


def stats() -> dict[str, int]:
    """``{"reused", "new", "held_bytes"}`` since the process started (benchmarks)."""
    with _lock:
        return {**_stats, "held_bytes": _held}


def describe() -> str:
    """One line on where batch-sized CPU tensors come from (benchmarks print it)."""
    return (
        "allocator: the C library's, as the process has it (no process-wide policy); "
        f"batch buffers recycled by tta_bench.buffers (up to {MAX_BYTES >> 20} MiB)"
    )
