"""Feeding the stream: a ``torch.utils.data.DataLoader`` over the decoded uint8 cache.

One loader item is one whole batch of the stream (``batch_size=None``: the batching is the
protocol's, done by ``tta_bench.run.stream``), gathered from a decoded array or decoded on
demand (``tta_bench.data`` sources) in a worker process, pinned when the device is CUDA,
and handed over in stream order. The main process moves it to the device once and applies
the shift there.

Determinism: nothing random happens in a worker. All randomness that touches a sample is
drawn on the main side from generators keyed by ``(seed, shift, severity, index)``
(``tta_bench.rng``), so results are identical for every ``num_workers``. Workers are still
seeded (``worker_init_fn``) from the run seed and their worker id, so that any CPU-side
code a plugin adds is reproducible for a given worker count.
"""

from __future__ import annotations

import functools
import os
import random
import signal
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from tta_bench.rng import stable_seed
from tta_bench.run.stream import Batch


@dataclass(frozen=True)
class LoaderSettings:
    """Resolved DataLoader settings (no ``None`` left)."""

    num_workers: int
    pin_memory: bool
    prefetch_factor: int | None
    persistent_workers: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_num_workers(device: torch.device, decoding: bool = False) -> int:
    """On the CPU: 0 when batches are gathered from a decoded array (workers would compete
    with the model for the same cores for a memory copy), and when images are decoded on
    demand (``decoding``) one worker per two cores, at least one, so decoding overlaps the
    model. On an accelerator: up to 8 processes (one per two cores) when decoding, up to 4
    for a gather."""
    cores = os.cpu_count() or 2
    if device.type == "cpu":
        return max(1, cores // 2) if decoding else 0
    return max(1, min(8 if decoding else 4, cores // 2))


def resolve_settings(config: Any, device: torch.device, decoding: bool = False) -> LoaderSettings:
    """Fill the ``None`` (auto) fields of a ``loader:`` config for ``device``.

    ``config`` has ``num_workers``, ``pin_memory``, ``prefetch_factor`` and
    ``persistent_workers`` attributes or keys (``None`` = choose). Raises ``ValueError`` for
    negative worker counts or a prefetch factor without workers.
    """

    def get(name: str) -> Any:
        if config is None:
            return None
        return config.get(name) if isinstance(config, dict) else getattr(config, name, None)

    workers = get("num_workers")
    workers = default_num_workers(device, decoding) if workers is None else int(workers)
    if workers < 0:
        raise ValueError(f"loader.num_workers must be >= 0, got {workers}")
    pin = get("pin_memory")
    pin = device.type == "cuda" if pin is None else bool(pin) and device.type == "cuda"
    prefetch = get("prefetch_factor")
    if prefetch is not None and workers == 0:
        raise ValueError(
            f"loader.prefetch_factor={prefetch} needs loader.num_workers > 0 (it is 0)"
        )
    if workers > 0:
        prefetch = 2 if prefetch is None else int(prefetch)
    persistent = get("persistent_workers")
    # The runner iterates its one loader once per run, so keeping workers alive between
    # epochs buys nothing by default; the switch is there for callers that iterate again.
    persistent = False if persistent is None else bool(persistent) and workers > 0
    return LoaderSettings(workers, pin, prefetch, persistent)


class StreamBatches(torch.utils.data.Dataset):
    """Map-style dataset: item ``k`` is batch ``k`` of ``batches``.

    ``sources[a]`` serves the images of one split (``tta_bench.data``: a decoded array, or
    on-demand decoding); ``source_of_domain[d]`` names the source of domain ``d``;
    ``labels_of_domain[d]`` its labels ``[N]``. An item is ``{"images": uint8 [k, H, W, 3],
    "labels": int64 [k], "kept": int64 [k], "bad": [...], "number": int}``: ``kept`` are the
    batch rows whose images could be decoded (all of them unless bad images are skipped).
    """

    def __init__(
        self,
        batches: Sequence[Batch],
        sources: Sequence[Any],
        source_of_domain: Sequence[int],
        labels_of_domain: Sequence[np.ndarray],
    ):
        self.batches = list(batches)
        #: Set by the main process around an in-process read of a batch whose images it
        #: has already (the shifted-image cache): the item then holds no images.
        self.labels_only = False
        self.sources = list(sources)
        self.source_of_domain = np.asarray(source_of_domain, dtype=np.int64)
        self.labels_of_domain = list(labels_of_domain)

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, k: int) -> dict[str, Any]:
        batch = self.batches[k]
        d = batch.single_domain()
        if self.labels_only:
            images, kept, bad = None, np.arange(len(batch)), []
            labels = self._labels(batch, kept)
        elif d is not None:
            got = self.sources[self.source_of_domain[d]].fetch(batch.indices)
            images, kept, bad = got.images, got.kept, got.bad
            labels = self.labels_of_domain[d][batch.indices[kept]]
        else:  # a mixed batch: rows come from several domains (maybe several sources)
            rows_src = self.source_of_domain[batch.domains]
            parts, bad = [], []
            for a in np.unique(rows_src):
                rows = np.flatnonzero(rows_src == a)
                got = self.sources[a].fetch(batch.indices[rows])
                parts.append((rows[got.kept], got.images))
                bad += got.bad
            kept = np.sort(np.concatenate([r for r, _ in parts]))
            first = parts[0][1]
            images = np.empty((len(kept), *first.shape[1:]), dtype=first.dtype)
            where = {int(r): i for i, r in enumerate(kept)}
            for rows, imgs in parts:
                images[[where[int(r)] for r in rows]] = imgs
            labels = self._labels(batch, kept)
        return {
            "images": None if images is None else torch.from_numpy(images),
            "labels": torch.from_numpy(np.asarray(labels, dtype=np.int64)),
            "kept": torch.from_numpy(np.asarray(kept, dtype=np.int64)),
            "bad": bad,
            "number": batch.number,
        }

    def _labels(self, batch: Batch, kept: np.ndarray) -> np.ndarray:
        """The labels of rows ``kept`` of ``batch``, domain by domain."""
        domains, indices = batch.domains[kept], batch.indices[kept]
        labels = np.empty(len(kept), dtype=np.int64)
        for dom in np.unique(domains):
            sel = domains == dom
            labels[sel] = self.labels_of_domain[dom][indices[sel]]
        return labels


def _worker_init(seed: int, worker_id: int) -> None:
    _leave_signals_to_the_main_process()
    s = stable_seed("loader-worker", seed, worker_id)
    torch.manual_seed(s)
    np.random.seed(s % 2**32)
    random.seed(s)


def _leave_signals_to_the_main_process() -> None:
    """In a worker, ignore every signal the main process handles in Python (a forked worker
    inherits those handlers). A scheduler signals every process of a job: under SLURM,
    submitit's preemption handler (SIGUSR2: checkpoint, requeue, exit) ran in the worker
    too, checkpointed a second time over the main process's temporary file and failed the
    task instead of requeueing it. The main process handles the signal; its workers end
    with it. Ctrl-C (Python's own SIGINT handler) is left as it is."""
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.SIG_IGN)


def _identity(item: Any) -> Any:
    return item


class InProcessBatches:
    """``dataset``'s items in order, read in this process: what a DataLoader with no workers
    and no pinning yields, without its per-item machinery (iterator state, profiler
    annotation, fetcher), ~0.1 ms per batch, which shows with a tiny model."""

    def __init__(self, dataset: StreamBatches):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self.dataset[k] for k in range(len(self.dataset)))


def make_loader(
    dataset: StreamBatches, settings: LoaderSettings, seed: int = 0
) -> torch.utils.data.DataLoader | InProcessBatches:
    """A DataLoader yielding ``dataset``'s batches in order with ``settings`` (with no
    workers and no pinning, the same items through ``InProcessBatches``)."""
    if settings.num_workers == 0 and not settings.pin_memory:
        return InProcessBatches(dataset)
    kwargs: dict[str, Any] = {}
    if settings.num_workers > 0:
        kwargs.update(
            prefetch_factor=settings.prefetch_factor,
            persistent_workers=settings.persistent_workers,
            worker_init_fn=functools.partial(_worker_init, seed),
        )
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=None,
        shuffle=False,
        num_workers=settings.num_workers,
        pin_memory=settings.pin_memory,
        collate_fn=_identity,
        **kwargs,
    )
