"""The shifted-image cache: a synthetic domain's corrupted images, computed once, then read.

A corrupted image is a pure function of the decoded image, the shift kernel's code, the
shift, the severity, the noise seed (``Protocol.noise_seed``: per sample,
``tta_bench.rng.SampleGenerator``), the severity table and the device kind. Every method of
a suite, every resumed or repeated run, and every suite whose stream reaches the same
samples of a domain under the same seed (a suite and its continual or class-sorted twins)
therefore corrupts the same images again. Here the first run that reaches a domain
corrupts all of that domain's samples in its stream at once (in sorted index order, a
protocol batch at a time), writes them to ``<cache>/shifted/<key>.npy`` (float32
``[N, C, H, W]``, beside its final name and renamed when whole, under a lock), and every
batch of that domain, in this run and later ones, is gathered from the entry.

The values are those the loop would compute: every registered kernel corrupts a row the same
whatever else is in its batch (a sample's noise comes from its own generator; tested per
kernel, at 32 and 224 px, in ``harness/tests/test_shifted_cache.py`` and the plugin's
kernel tests), so a row computed in the entry's order equals the row of the stream's batch,
bit for bit (tested end to end: the tensors a method receives, with the cache off, cold and
warm, on single-domain and mixed batches and a composite shift).

The key holds everything the values depend on: the decoded split's cache key (its data,
content signature, size, resize and decoding rules), the sorted indices, the shift (a
composite's two parts), the severity, the noise seed, the severity table, the SHA-256 of the
kernel's code (every ``.py`` and ``.json`` file of the package that defines it, and of the
harness modules that apply it), the torch version and CPU capability, and ``VERSION``. A
change to any of them is a new entry; old ones are removed with ``tta-bench cache clear``
and count against the cache's disk budget (``TTA_BENCH_CACHE_BUDGET_GB``) like decoded
splits.

Under the run's ``shift_cache`` setting: ``never`` corrupts every batch in the loop (nothing
written);
``auto`` (default) caches a domain on the CPU when its entry takes at most
``AUTO_BYTES`` and fits the budget; ``always`` caches every domain (on any device) and
fails with the budget's error when it does not fit. Only splits read from a decoded array
with no unreadable image are cached (a streamed split, ``cache=never`` among them, is
corrupted in the loop).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tta_bench.buffers import MIN_BYTES, batch_buffer
from tta_bench.paths import atomic_path, atomic_write_text, cache_dir
from tta_bench.run import cache as decoded
from tta_bench.run.stream import subset

#: Bumped when the entry's layout or the rules of this module change.
VERSION = 1
#: The run setting ``shift_cache``.
POLICIES = ("auto", "always", "never")
#: ``auto`` caches a domain whose entry takes at most this many bytes.
AUTO_BYTES = 256 << 20
#: Harness modules whose code a corrupted image depends on besides the kernel's package.
_HARNESS_MODULES = ("tta_bench.run.composite", "tta_bench.rng", "tta_bench.data")

_CODE_HASHES: dict[str, str] = {}


def _package_files(module_name: str) -> list[Path]:
    """The ``.py`` and ``.json`` files of the package that holds ``module_name`` (the module's
    own file when it is top-level)."""
    module = sys.modules.get(module_name) or importlib.import_module(module_name)
    file = getattr(module, "__file__", None)
    if not file:
        return []
    folder = Path(file).parent
    if "." not in module_name and Path(file).name != "__init__.py":
        return [Path(file)]
    return sorted(p for p in folder.iterdir() if p.suffix in (".py", ".json") and p.is_file())


def code_hash(module_name: str) -> str:
    """SHA-256 (24 hex characters) of the files of ``module_name``'s package, once per process."""
    if module_name not in _CODE_HASHES:
        h = hashlib.sha256()
        for path in _package_files(module_name):
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        _CODE_HASHES[module_name] = h.hexdigest()[:24]
    return _CODE_HASHES[module_name]


def kernel_code(kernel: Any) -> str:
    """The code identity of a shift kernel: its package's files (both parts of a composite
    shift), and the harness modules that apply it."""
    parts = [getattr(kernel, "first", None), getattr(kernel, "second", None)]
    kernels = [k for k in parts if k is not None] or [kernel]
    modules = sorted({getattr(k, "__module__", "") or "" for k in kernels} | set(_HARNESS_MODULES))
    return "|".join(f"{m}={code_hash(m)}" for m in modules if m)


def entry_key(
    split_key: str,
    indices: np.ndarray,
    kernel: Any,
    shift: str,
    severity: int,
    seed: int,
    table: str | None,
    device: torch.device,
) -> str:
    """The entry's name: a hash of everything its values depend on (module docstring)."""
    blob = json.dumps(
        {
            "version": VERSION,
            "split": split_key,
            "indices": hashlib.sha256(np.ascontiguousarray(indices, np.int64)).hexdigest(),
            "shift": shift,
            "severity": int(severity),
            "seed": int(seed),
            "table": table,
            "code": kernel_code(kernel),
            "torch": torch.__version__,
            "cpu": torch.backends.cpu.get_cpu_capability(),
            "device": device.type,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def entry_path(key: str) -> Path:
    return cache_dir() / "shifted" / f"{key}.npy"


def read_entry(path: Path, n: int, shape: tuple[int, ...]) -> np.ndarray | None:
    """The entry at ``path``, memory-mapped, when it is whole and of shape ``[n, *shape]``;
    None when it is missing or unreadable (it is built again)."""
    if not path.exists():
        return None
    try:
        arr = np.load(path, mmap_mode="r")
    except (ValueError, OSError):
        return None
    if arr.dtype != np.float32 or arr.shape != (n, *shape):
        return None
    return arr


class ShiftedCache:
    """The entries of one run's domains (module docstring): ``take`` serves a batch's rows
    of one domain from its entry, building the entry on the domain's first batch, or
    returns None when the domain is not cached (the loop corrupts the batch)."""

    def __init__(self, policy: str, device: torch.device):
        self.policy = policy
        self.device = device
        self.enabled = policy == "always" or (policy == "auto" and device.type == "cpu")
        self._entries: dict[tuple[int, int], tuple[np.ndarray, np.ndarray] | None] = {}
        #: Batches (or a mixed batch's domain parts) served from an entry; entries built.
        self.hits = 0
        self.built = 0

    def stats(self) -> dict[str, Any]:
        return {"policy": self.policy if self.enabled else "off", "hits": self.hits,
                "built": self.built}  # fmt: skip

    def take(
        self, inputs: Any, stream: Any, domain: int, index: np.ndarray, seed: int
    ) -> torch.Tensor | None:
        """The corrupted images of rows ``index`` of ``domain`` (an id into
        ``stream.domains``) under noise ``seed``, float32 ``[len(index), C, H, W]`` on the
        run's device; None when the domain is not cached."""
        if not self.enabled:
            return None
        slot = (int(seed), int(domain))
        if slot not in self._entries:
            self._entries[slot] = self._open(inputs, stream, domain, seed)
        found = self._entries[slot]
        if found is None:
            return None
        rows, arr = found
        pos = np.searchsorted(rows, index)
        if pos.max(initial=0) >= len(rows) or not np.array_equal(rows[pos], index):
            return None  # a row outside the entry (cannot happen for the stream's own rows)
        if len(index) * arr[0].nbytes < MIN_BYTES:  # fancy indexing: the fastest gather
            out = torch.from_numpy(arr[pos])
        else:  # a large batch: into a recycled buffer, no fresh pages to fault in
            out = batch_buffer((len(index), *arr.shape[1:]), torch.float32)
            np.take(arr, pos, axis=0, out=out.numpy())
        self.hits += 1
        return out.to(self.device)

    def _open(
        self, inputs: Any, stream: Any, domain: int, seed: int
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The domain's ``(sorted rows, entry)``, built when missing; None when the domain
        is not cached under the policy."""
        shift, severity = stream.domains[domain]
        d = (shift, severity)
        source = inputs.sources[inputs.source_of[d]]
        if getattr(source, "kind", "") != "decoded" or getattr(source, "bad", None):
            return None  # streamed, or with unreadable images left out of its batches
        # Every policy draws a domain's samples from the protocol's subset of the split:
        # the entry holds all of them, so a resumed, sharded or reordered stream reuses it.
        rows = subset(inputs.protocol, len(inputs.labels[d])).astype(np.int64)
        size = inputs.image_size
        shape = (3, size, size)
        nbytes = len(rows) * 4 * int(np.prod(shape))
        if len(rows) == 0 or (self.policy == "auto" and nbytes > AUTO_BYTES):
            return None
        split = decoded.cache_key(inputs.streams[d], size)
        kernel = inputs.kernels[shift]
        table = inputs.protocol.severity_table
        key = entry_key(split, rows, kernel, shift, severity, seed, table, self.device)
        path = entry_path(key)
        arr = read_entry(path, len(rows), shape)
        if arr is None:
            arr = self._build(inputs, source, d, rows, seed, path, nbytes)
        return None if arr is None else (rows, arr)

    def _build(
        self,
        inputs: Any,
        source: Any,
        domain: tuple[str, int],
        rows: np.ndarray,
        seed: int,
        path: Path,
        nbytes: int,
    ) -> np.ndarray | None:
        """The entry of ``rows`` of ``domain``, written under its lock (a second process
        waits, then reads it); None when ``auto`` finds the budget full or the split has
        unreadable images."""
        from filelock import FileLock

        shape = (3, inputs.image_size, inputs.image_size)
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock"):
            arr = read_entry(path, len(rows), shape)
            if arr is not None:
                return arr
            if self.policy == "auto" and not decoded.fits_budget(nbytes):
                return None
            if self.policy == "always":
                decoded.check_budget(nbytes, f"caching the shifted images of {domain}")
            try:
                self._write(inputs, source, domain, rows, seed, path)
            except _NotCached:
                return None
            self.built += 1
        return read_entry(path, len(rows), shape)

    def _write(
        self,
        inputs: Any,
        source: Any,
        domain: tuple[str, int],
        rows: np.ndarray,
        seed: int,
        path: Path,
    ) -> None:
        """Corrupt ``rows`` a protocol batch at a time, as the loop does, into ``path``
        (beside it, renamed when whole; its metadata first)."""
        shift, severity = domain
        size = inputs.image_size
        step = max(1, inputs.protocol.batch_size)
        with atomic_path(path) as tmp:
            out = np.lib.format.open_memmap(
                tmp, mode="w+", dtype=np.float32, shape=(len(rows), 3, size, size)
            )
            for s in range(0, len(rows), step):
                part = rows[s : s + step]
                fetched = source.fetch(part)
                if len(fetched.kept) != len(part):  # unreadable images: not cached
                    raise _NotCached
                x = torch.from_numpy(fetched.images).to(self.device)
                y = inputs.corrupt(x, part, shift, severity, seed)  # the loop's own step
                out[s : s + len(part)] = y.detach().cpu().numpy()
            out.flush()
            del out
            meta = {
                "name": f"{inputs.streams[domain].name} | {shift} {severity} | seed {seed}",
                "kind": "shifted",
                "n": len(rows),
                "size": size,
            }
            atomic_write_text(path.with_suffix(".json"), json.dumps(meta))


class _NotCached(Exception):
    """The split turned out to hold unreadable images: its domain is corrupted in the loop."""
