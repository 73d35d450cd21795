"""Measured cost of a cell: wall time split by phase, peak memory, passes per sample.

Everything here is measured during the run, never estimated: time with
``time.perf_counter`` (after a device synchronise), peak memory with
``torch.cuda.max_memory_allocated`` (reset per cell) on CUDA and as the growth of the
process's resident set size on the CPU (the kernel's high-water mark on Linux, a sampling
thread elsewhere).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch import nn

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    try:
        # One pread of /proc/self/statm (one syscall; its text is regenerated per read).
        fd = os.open("/proc/self/statm", os.O_RDONLY)
        try:
            pages = int(os.pread(fd, 256, 0).split()[1])
        finally:
            os.close(fd)
        return pages * _PAGE_SIZE
    except (OSError, ValueError, AttributeError):  # not Linux: the high-water mark instead
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_high_water_mark() -> bool:
    """Reset the kernel's resident-set high-water mark (``VmHWM``) of this process.

    Linux >= 4.0 resets it when ``5`` is written to ``/proc/self/clear_refs``. Returns False
    where that is not possible (other systems, restricted ``/proc``)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return _high_water_mark() is not None
    except OSError:
        return False


def _high_water_mark() -> int | None:
    """``VmHWM`` of this process in bytes, or None when ``/proc`` does not report it."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


class PeakMemory:
    """Peak memory while the context is open: CUDA allocator peak, or CPU RSS growth.

    On the CPU the growth is ``peak RSS - RSS at entry``. On Linux the peak is the kernel's
    own high-water mark, reset at entry: exact, and free (no thread competes with the
    model's intra-op threads). Elsewhere a background thread samples the RSS every
    ``interval_s``. Contexts must not nest on the CPU: entering one resets the mark the
    outer one reads.
    """

    # 50 ms, not finer: on a small CPU a frequently waking sampler preempts the intra-op
    # threads and slowed the ViT-B-32 pipeline benchmark measurably (ratio 0.81 -> 0.84).
    def __init__(self, device: torch.device, interval_s: float = 0.05):
        self.device = device
        self.interval_s = interval_s
        self.peak_bytes = 0
        self.kind = "cuda_max_allocated" if device.type == "cuda" else "cpu_rss_growth"
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        self._base = rss_bytes()
        self._max = self._base
        if _reset_high_water_mark():
            return self
        self._stop = threading.Event()

        def poll() -> None:
            while not self._stop.wait(self.interval_s):
                self._max = max(self._max, rss_bytes())

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            return
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        else:
            self._max = max(self._max, _high_water_mark() or 0)
        self._max = max(self._max, rss_bytes())
        self.peak_bytes = int(self._max - self._base)


class PhaseTimer:
    """Accumulates wall time per named phase (``data``, ``method``, ...)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] += time.perf_counter() - start


class PassCounter:
    """Counts images through the image encoder, and how many of them carried gradients."""

    def __init__(self, module: nn.Module):
        self.forward = 0
        self.backward = 0

        def hook(_module: nn.Module, args: tuple, output: object) -> None:
            x = args[0] if args else None
            n = int(x.shape[0]) if isinstance(x, torch.Tensor) and x.dim() > 0 else 0
            self.forward += n
            if isinstance(output, torch.Tensor) and output.requires_grad:
                self.backward += n

        self._handle = module.register_forward_hook(hook)

    def close(self) -> None:
        self._handle.remove()
