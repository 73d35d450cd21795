"""Domain streams and the decoded-image cache (DESIGN §5).

A dataset factory returns a ``DomainStream``: a HuggingFace ``datasets.Dataset`` with an
``image`` and a ``label`` column, plus the class names and prompt templates. The harness
decodes and resizes every image once into a uint8 array ``[N, H, W, 3]`` stored as ``.npy``
under the cache directory, keyed by a fingerprint of the data (dataset id, revision, split,
subset) and the resize recipe, and memory-maps it on later runs, so methods, seeds and runs
share one decode.

The cache is written incrementally into a temporary ``np.memmap`` ``.npy`` in the cache
directory and renamed into place only when every image is decoded: a killed decode leaves
no half-written cache entry. A corrupt or truncated image is reported by index and path;
``on_bad_image="skip"`` zeroes its row instead and lists it in ``Decoded.skipped`` (and a
sidecar ``.json``), so the runner can leave it out and record it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tta_bench.paths import atomic_path, atomic_write_text, cache_dir

RESIZE_RECIPE = "shorter-side-bicubic+center-crop/v1"
ON_BAD_IMAGE = ("fail", "skip")
#: Images per decode task: large enough to amortise Arrow reads, small enough to balance.
CHUNK = 256


class DataUnavailableError(FileNotFoundError, ValueError):
    """The data of a domain is neither under ``--data-dir`` nor in a local cache.

    A ``ValueError`` too, so the CLI reports it as bad input (exit status 2); the message
    says what to download and where to put it."""


class BadImageError(ValueError):
    """An image file that cannot be decoded (corrupt or truncated), named by index/path."""


@dataclass
class DomainStream:
    """One test domain: images + labels, and what the text head needs to classify them."""

    name: str
    classnames: list[str]
    templates: list[str]
    dataset: Any  # datasets.Dataset with columns `image` (PIL or array) and `label` (int)
    #: Stable identity of the data (hub id, revision, split, subset); keys the decoded cache.
    fingerprint: str
    #: Images already at the model's input size must not be resized or cropped again.
    native_size: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = {"image", "label"} - set(self.dataset.column_names)
        if missing:
            raise ValueError(
                f"dataset for domain {self.name!r} lacks column(s) {sorted(missing)}; "
                f"it has {self.dataset.column_names}"
            )

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def labels(self) -> np.ndarray:
        return np.asarray(self.dataset["label"], dtype=np.int64)


@dataclass
class Decoded:
    """The decoded images of a stream and the indices of images that could not be decoded
    (their rows are zeros; empty unless ``on_bad_image="skip"``)."""

    images: np.ndarray  # uint8 [N, size, size, 3]
    skipped: list[int] = field(default_factory=list)
    bad: list[dict[str, Any]] = field(default_factory=list)  # {index, path, error}
    from_cache: bool = False


def _to_rgb_array(image: Any, size: int) -> np.ndarray:
    """PIL image or array -> uint8 ``[size, size, 3]``: bicubic resize of the shorter side
    to ``size``, then a centre crop; images already ``size`` x ``size`` are left as they are."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        image = Image.fromarray(np.asarray(image))
    image = image.convert("RGB")
    w, h = image.size
    if (w, h) != (size, size):
        scale = size / min(w, h)
        nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
        image = image.resize((nw, nh), Image.BICUBIC)
        left, top = (nw - size) // 2, (nh - size) // 2
        image = image.crop((left, top, left + size, top + size))
    return np.asarray(image, dtype=np.uint8)


def _open_raw(raw: Any) -> tuple[Any, str | None]:
    """An undecoded ``datasets.Image`` value (``{"bytes", "path"}``), a PIL image or an
    array -> (an object ``_to_rgb_array`` takes, the file path for error messages)."""
    from PIL import Image

    if isinstance(raw, dict) and ("bytes" in raw or "path" in raw):
        path = raw.get("path")
        if raw.get("bytes") is not None:
            img = Image.open(io.BytesIO(raw["bytes"]))
        elif path:
            img = Image.open(path)
        else:
            raise ValueError("image entry has neither bytes nor a path")
        img.load()  # force the full decode here, so truncation is caught per image
        return img, path
    return raw, None


def cache_key(stream: DomainStream, size: int) -> str:
    blob = f"{stream.fingerprint}|n={len(stream)}|{size}|{RESIZE_RECIPE}"
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def cache_path(stream: DomainStream, size: int) -> Path:
    """Where the decoded array of ``stream`` at ``size`` px lives (it may not exist yet)."""
    return cache_dir() / "decoded" / f"{cache_key(stream, size)}.npy"


def _check_bad(stream: DomainStream, bad: list[dict[str, Any]], on_bad_image: str) -> None:
    if bad and on_bad_image == "fail":
        shown = "; ".join(
            f"index {b['index']} ({b['path'] or 'in-memory'}): {b['error']}" for b in bad[:5]
        )
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise BadImageError(
            f"domain {stream.name!r}: {len(bad)} image(s) cannot be decoded: {shown}{more}. "
            "Replace the files, or pass --on-bad-image=skip to leave them out (recorded in "
            "the results)"
        )


def _numpy_images(ds: Any) -> Any:
    """The image column as uint8 numpy (HF's numpy format widens integers to int64)."""
    return ds.select_columns(["image"]).with_format("numpy", dtype=np.uint8)


def _array_feature(stream: DomainStream) -> bool:
    import datasets

    feature = stream.dataset.features.get("image")
    return not isinstance(feature, datasets.Image)


def decode(
    stream: DomainStream,
    size: int,
    *,
    progress: bool = False,
    use_cache: bool = True,
    on_bad_image: str = "fail",
    workers: int | None = None,
) -> Decoded:
    """All images of ``stream`` as uint8 ``[N, size, size, 3]``, decoded once and cached.

    ``workers`` threads decode chunks of ``CHUNK`` images (default: up to 8, one per CPU);
    PIL releases the GIL while decoding and resizing. Arrays already stored at ``size`` px
    (an ``Array3D`` column, e.g. CIFAR-10-C) are returned without a cache entry."""
    if on_bad_image not in ON_BAD_IMAGE:
        raise ValueError(f"on_bad_image must be one of {ON_BAD_IMAGE}, got {on_bad_image!r}")
    if stream.native_size is not None and stream.native_size != size:
        raise ValueError(
            f"domain {stream.name!r} is stored at {stream.native_size}px and must not be "
            f"resized, but the model expects {size}px; use a model with that input size"
        )
    n = len(stream)
    array_column = _array_feature(stream)
    if array_column:
        arr = _numpy_images(stream.dataset)[0:n]["image"]  # one bulk read
        if arr.dtype == np.uint8 and arr.shape == (n, size, size, 3):
            return Decoded(np.asarray(arr))
    path = cache_path(stream, size)
    meta_path = path.with_suffix(".json")
    if use_cache and path.exists():
        try:
            arr = np.load(path, mmap_mode="r")
            meta = json.loads(meta_path.read_text()) if meta_path.exists() else {"bad": []}
            if arr.shape == (n, size, size, 3):
                _check_bad(stream, meta["bad"], on_bad_image)
                skipped = [b["index"] for b in meta["bad"]]
                return Decoded(arr, skipped, meta["bad"], from_cache=True)
        except (ValueError, OSError, KeyError, json.JSONDecodeError):
            pass  # unreadable entry (an older format or a disk error): decode again
    return _decode_into_cache(
        stream, size, path, meta_path, progress, use_cache, on_bad_image, workers
    )


def _decode_into_cache(
    stream: DomainStream,
    size: int,
    path: Path,
    meta_path: Path,
    progress: bool,
    use_cache: bool,
    on_bad_image: str,
    workers: int | None,
) -> Decoded:
    import datasets

    ds = stream.dataset
    if not _array_feature(stream):
        ds = ds.cast_column("image", datasets.Image(decode=False))  # we decode, naming paths
    else:
        ds = _numpy_images(ds)
    shape = (len(stream), size, size, 3)
    if not use_cache:
        out = np.empty(shape, dtype=np.uint8)
        bad = _decode_all(stream, ds, out, size, progress, on_bad_image, workers)
        return Decoded(out, [b["index"] for b in bad], bad)
    # Written beside its final name and renamed when whole (metadata first), so a killed
    # or failed decode leaves nothing half-written in the cache.
    with atomic_path(path) as tmp:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint8, shape=shape)
        bad = _decode_all(stream, ds, out, size, progress, on_bad_image, workers)
        out.flush()
        del out
        atomic_write_text(
            meta_path,
            json.dumps({"name": stream.name, "fingerprint": stream.fingerprint, "bad": bad}),
        )
    return Decoded(np.load(path, mmap_mode="r"), [b["index"] for b in bad], bad)


def _decode_all(
    stream: DomainStream,
    ds: Any,
    out: np.ndarray,
    size: int,
    progress: bool,
    on_bad_image: str,
    workers: int | None,
) -> list[dict[str, Any]]:
    """Decode every image of ``ds`` into ``out [N, size, size, 3]`` on a thread pool; the
    bad ones (zeroed in ``out``) are returned by index, or raise per ``on_bad_image``."""
    from tqdm.auto import tqdm

    n = len(out)
    bad: list[dict[str, Any]] = []
    lock = threading.Lock()

    def work(start: int) -> int:
        stop = min(start + CHUNK, n)
        raws = ds[start:stop]["image"]
        for offset, raw in enumerate(raws):
            i = start + offset
            path_i = raw.get("path") if isinstance(raw, dict) else None
            try:
                img, path_i = _open_raw(raw)
                out[i] = _to_rgb_array(img, size)
            except (OSError, ValueError, SyntaxError) as exc:  # PIL's decode errors
                out[i] = 0
                with lock:
                    bad.append(
                        {"index": i, "path": path_i, "error": f"{type(exc).__name__}: {exc}"}
                    )
        return stop - start

    n_workers = workers or min(8, os.cpu_count() or 1)
    bar = tqdm(total=n, desc=f"decode {stream.name}", unit="img", leave=False, disable=not progress)
    with ThreadPoolExecutor(max_workers=n_workers) as pool:
        for done in pool.map(work, range(0, n, CHUNK)):
            bar.update(done)
    bar.close()
    bad.sort(key=lambda b: b["index"])
    _check_bad(stream, bad, on_bad_image)
    return bad
