"""Feeding the stream: a ``torch.utils.data.DataLoader`` over the decoded uint8 cache.

One loader item is one whole batch of the stream (``batch_size=None``: the batching is the
protocol's, done by ``tta_bench.stream``), gathered from the decoded ``[N, H, W, 3]``
arrays in a worker process, pinned when the device is CUDA, and handed over in stream order.
The main process moves it to the device once and applies the shift there.

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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tta_bench.rng import stable_seed
from tta_bench.stream import Batch


@dataclass(frozen=True)
class LoaderSettings:
    """Resolved DataLoader settings (no ``None`` left)."""

    num_workers: int
    pin_memory: bool
    prefetch_factor: int | None
    persistent_workers: bool

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory,
            "prefetch_factor": self.prefetch_factor,
            "persistent_workers": self.persistent_workers,
        }


def default_num_workers(device: torch.device) -> int:
    """0 on the CPU: workers would compete with the model for the same cores while the
    gather from the decoded cache is only a memory copy. On an accelerator: up to 4
    processes (one per two cores), which keeps a uint8 gather ahead of the model."""
    if device.type == "cpu":
        return 0
    return max(1, min(4, (os.cpu_count() or 2) // 2))


def resolve_settings(config: Any, device: torch.device) -> LoaderSettings:
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
    workers = default_num_workers(device) if workers is None else int(workers)
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


class _Reopen:
    """A memory-mapped ``.npy`` travelling to a worker as its path, not its bytes."""

    def __init__(self, filename: str):
        self.filename = filename


class StreamBatches(torch.utils.data.Dataset):
    """Map-style dataset: item ``k`` is batch ``k`` of ``batches``.

    ``arrays[a]`` is a decoded uint8 ``[N, H, W, 3]`` array; ``array_of_domain[d]`` names the
    array holding domain ``d``; ``labels_of_domain[d]`` its labels ``[N]``. An item is
    ``{"images": uint8 [B, H, W, 3], "labels": int64 [B], "number": int}``.
    """

    def __init__(
        self,
        batches: Sequence[Batch],
        arrays: Sequence[np.ndarray],
        array_of_domain: Sequence[int],
        labels_of_domain: Sequence[np.ndarray],
    ):
        self.batches = list(batches)
        self.arrays: list[Any] = list(arrays)
        self.array_of_domain = np.asarray(array_of_domain, dtype=np.int64)
        self.labels_of_domain = list(labels_of_domain)

    def __len__(self) -> int:
        return len(self.batches)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        # Pickling a np.memmap copies its data; send the path and map it again instead.
        state["arrays"] = [
            _Reopen(a.filename) if isinstance(a, np.memmap) and a.filename else a
            for a in self.arrays
        ]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["arrays"] = [
            np.load(a.filename, mmap_mode="r") if isinstance(a, _Reopen) else a
            for a in state["arrays"]
        ]
        self.__dict__.update(state)

    def __getitem__(self, k: int) -> dict[str, Any]:
        batch = self.batches[k]
        d = batch.single_domain()
        if d is not None:
            a = self.arrays[self.array_of_domain[d]]
            images = np.ascontiguousarray(a[np.asarray(batch.indices)])
            labels = self.labels_of_domain[d][batch.indices]
        else:  # a mixed batch: rows come from several domains (maybe several arrays)
            rows_a = self.array_of_domain[batch.domains]
            first = self.arrays[rows_a[0]]
            images = np.empty((len(batch), *first.shape[1:]), dtype=first.dtype)
            labels = np.empty(len(batch), dtype=np.int64)
            for a in np.unique(rows_a):
                sel = rows_a == a
                images[sel] = self.arrays[a][batch.indices[sel]]
            for dom in np.unique(batch.domains):
                sel = batch.domains == dom
                labels[sel] = self.labels_of_domain[dom][batch.indices[sel]]
        return {
            "images": torch.from_numpy(images),
            "labels": torch.from_numpy(np.asarray(labels, dtype=np.int64)),
            "number": batch.number,
        }


def _worker_init(seed: int, worker_id: int) -> None:
    s = stable_seed("loader-worker", seed, worker_id)
    torch.manual_seed(s)
    np.random.seed(s % 2**32)
    random.seed(s)


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
