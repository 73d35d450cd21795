"""The sources the loader reads: one per distinct split of a stream, chosen by the cache
policy (``open_source``; ``tta_bench.run.cache`` explains the policies)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from tta_bench.data import DomainStream
from tta_bench.run.cache import (
    AUTO_DECODE_BYTES,
    CACHE_POLICIES,
    ON_BAD_IMAGE,
    Decoded,
    _bad_entry,
    _check_bad,
    _check_stored_size,
    _native_array,
    _raw_dataset,
    _read_entry,
    cache_path,
    decode,
    decode_one,
    decoded_bytes,
    fits_budget,
)


# -- sources -------------------------------------------------------------------------------
@dataclass
class Fetched:
    """A batch's images from one source: ``images[k]`` is row ``kept[k]`` of the request;
    ``bad`` lists the requested images that could not be decoded (left out)."""

    images: np.ndarray  # uint8 [len(kept), H, W, 3]
    kept: np.ndarray  # int64 positions into the requested indices
    bad: list[dict[str, Any]]


class ArraySource:
    """Images of one split from a decoded array (in memory or memory-mapped); the rows of
    known bad images are left out of every batch."""

    kind = "decoded"

    def __init__(self, name: str, images: np.ndarray, bad: list[dict[str, Any]] | None = None):
        self.name = name
        self.images = images
        self.bad = list(bad or [])
        self._bad_index = np.asarray(sorted(b["index"] for b in self.bad), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.images)

    def fetch(self, indices: np.ndarray) -> Fetched:
        indices = np.asarray(indices, dtype=np.int64)
        keep = ~np.isin(indices, self._bad_index) if len(self._bad_index) else None
        kept = np.arange(len(indices)) if keep is None else np.flatnonzero(keep)
        rows = indices if keep is None else indices[keep]
        return Fetched(np.ascontiguousarray(self.images[rows]), kept, [])

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        # Pickling a np.memmap copies its data; send the path and map it again instead.
        if isinstance(self.images, np.memmap) and self.images.filename:
            state["images"] = _Reopen(str(self.images.filename))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if isinstance(state["images"], _Reopen):
            state["images"] = np.load(state["images"].filename, mmap_mode="r")
        self.__dict__.update(state)


class _Reopen:
    """A memory-mapped ``.npy`` travelling to a worker as its path, not its bytes."""

    def __init__(self, filename: str):
        self.filename = filename


class _OnDemandSource:
    """What the sources that read a split when a batch asks share: the split, the image
    size, and the bad-image policy, applied in the main process (``check_bad``) to what
    ``fetch`` reports (maybe from a loader worker)."""

    def __init__(self, stream: DomainStream, size: int, on_bad_image: str = "fail"):
        if on_bad_image not in ON_BAD_IMAGE:
            raise ValueError(f"on_bad_image must be one of {ON_BAD_IMAGE}, got {on_bad_image!r}")
        self.name = stream.name
        self.size = size
        self.on_bad_image = on_bad_image
        self._stream = stream
        self.bad: list[dict[str, Any]] = []

    def __len__(self) -> int:
        return len(self._stream)

    def check_bad(self, bad: list[dict[str, Any]]) -> None:
        """Raise ``BadImageError`` for ``bad`` (reported by ``fetch``) unless skipping."""
        _check_bad(self._stream, bad, self.on_bad_image)


class DecodingSource(_OnDemandSource):
    """Images of one split decoded when a batch asks for them (``decode_one``), in
    whichever process calls ``fetch`` (DataLoader workers). Nothing is written."""

    kind = "streamed"

    def __init__(self, stream: DomainStream, size: int, on_bad_image: str = "fail"):
        super().__init__(stream, size, on_bad_image)
        self.dataset = _raw_dataset(stream)

    def fetch(self, indices: np.ndarray) -> Fetched:
        indices = np.asarray(indices, dtype=np.int64)
        raws = self.dataset[indices.tolist()]["image"]
        out = np.empty((len(indices), self.size, self.size, 3), dtype=np.uint8)
        kept, bad = [], []
        for pos, (i, raw) in enumerate(zip(indices.tolist(), raws)):
            try:
                out[len(kept)] = decode_one(raw, self.size)
                kept.append(pos)
            except (OSError, ValueError, SyntaxError) as exc:  # PIL's decode errors
                bad.append({**_bad_entry(i, raw, exc), "source": self.name})
        # Bad images are reported, not raised, here (maybe a loader worker): the main
        # process applies the on_bad_image policy, with the message the decoded path gives.
        return Fetched(out[: len(kept)], np.asarray(kept, dtype=np.int64), bad)

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)


class CachingSource(_OnDemandSource):
    """Images of one small split, decoded into the cache (``decode``: under the entry's lock,
    so concurrent workers and processes decode it once) the first time a batch asks for
    one of them, in whichever process calls ``fetch``; then read from the entry like an
    ``ArraySource``. Bad images are reported per batch, as ``DecodingSource`` does."""

    kind = "decoded"

    def __init__(self, stream: DomainStream, size: int, on_bad_image: str = "fail"):
        super().__init__(stream, size, on_bad_image)
        self._array: ArraySource | None = None

    @property
    def pending(self) -> bool:
        """Whether the split is still to be decoded (in this process)."""
        return self._array is None

    def _open(self) -> ArraySource:
        if self._array is None:
            dec = decode(self._stream, self.size, on_bad_image="skip")
            self._array = _array_source(self.name, dec)
        return self._array

    def fetch(self, indices: np.ndarray) -> Fetched:
        array = self._open()
        got = array.fetch(indices)
        asked = set(np.asarray(indices, dtype=np.int64).tolist())
        bad = [{**b, "source": self.name} for b in array.bad if b["index"] in asked]
        return Fetched(got.images, got.kept, bad)


Source = ArraySource | DecodingSource | CachingSource


def open_source(
    stream: DomainStream,
    size: int,
    *,
    cache: str = "auto",
    progress: bool = False,
    on_bad_image: str = "fail",
    pending_bytes: int = 0,
) -> Source:
    """The ``Source`` of one split under the cache policy (module docstring); a split of a
    single class is a warning (``warn_one_class``).
    ``pending_bytes``: what the run's other ``CachingSource`` splits will still write to the
    cache (``auto`` streams a split that would take the cache past its budget)."""
    if cache not in CACHE_POLICIES:
        raise ValueError(f"unknown cache policy {cache!r}; available: {', '.join(CACHE_POLICIES)}")
    if on_bad_image not in ON_BAD_IMAGE:
        raise ValueError(f"on_bad_image must be one of {ON_BAD_IMAGE}, got {on_bad_image!r}")
    warn_one_class(stream)
    _check_stored_size(stream, size)
    native = _native_array(stream, size)
    if native is not None:
        return ArraySource(stream.name, native)
    if cache == "never":
        return DecodingSource(stream, size, on_bad_image)
    needed = decoded_bytes(stream, size)
    if cache == "auto":
        found = _read_entry(stream, size, cache_path(stream, size))
        if found is None:
            if needed > AUTO_DECODE_BYTES or not fits_budget(needed + pending_bytes):
                return DecodingSource(stream, size, on_bad_image)
            return CachingSource(stream, size, on_bad_image)
    dec = decode(stream, size, progress=progress, on_bad_image=on_bad_image)
    return _array_source(stream.name, dec)


def warn_one_class(stream: DomainStream) -> None:
    """A ``UserWarning`` when ``stream`` has a single class, naming the domain and where its
    data is (``metadata["source"]``, the folder of a folder dataset): a classifier over one
    class is always right, so the run scores 100% whatever the model or method. Every
    dataset's split passes here (``open_source``), so each one gets it."""
    if len(stream.classnames) != 1:
        return
    source = stream.metadata.get("source")
    where = f" ({source})" if source else ""
    warnings.warn(
        f"domain {stream.name!r}{where} has a single class ({stream.classnames[0]!r}): a "
        "classifier over one class is always right, so its accuracy is 100% whatever the "
        "model or method, and meaningless; give the data at least two classes (for an image "
        "folder, two class sub-folders)",
        stacklevel=3,
    )


def _array_source(name: str, dec: Decoded) -> ArraySource:
    """The ``ArraySource`` of a decoded split. A small decoded array is read into memory
    once, here (setup, or a split's first batch): gathering batches from the memory map
    pays page faults inside the loop."""
    images = dec.images
    if isinstance(images, np.memmap) and images.nbytes <= IN_MEMORY_BYTES:
        images = np.array(images)
    return ArraySource(name, images, dec.bad)


#: Decoded arrays up to this size are read into memory (larger ones stay memory-mapped).
IN_MEMORY_BYTES = 64 << 20
