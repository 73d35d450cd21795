"""The decoded-image cache, and the sources the loader reads (docs/design.md#data-pipeline).

Images of a ``tta_bench.data.DomainStream`` reach the loop through a ``Source`` per distinct split:

* ``ArraySource``: a decoded uint8 array ``[N, H, W, 3]`` (in memory, or memory-mapped from
  the decoded cache);
* ``DecodingSource``: decodes the images a batch needs when it is asked for them (in
  DataLoader workers), so the first batch reaches the model within seconds whatever the
  dataset's size, and nothing is written to disk.

* ``CachingSource``: a small split decoded into the cache the first time a batch asks for
  one of its images, then read like an ``ArraySource``.

``open_source`` picks one by the cache policy (``CACHE_POLICIES``): ``always`` decodes the
whole split once into the cache (in setup) and reads it from there; ``never`` decodes on
demand; ``auto`` (default) uses an existing cache entry, decodes small splits (up to
``AUTO_DECODE_BYTES``) into the cache when the stream first reaches them (a suite of many
small domains waits only for its first one before the first batch), where they are reused
by every method and seed, and streams large ones. Every path decodes with the same
function (``decode_one``, over ``tta_bench.run.images.decode_rgb``: every mode PIL reads as the
8-bit RGB of its 8-bit copy), so results are identical whichever policy (tested). The
cache never grows beyond its disk budget (``TTA_BENCH_CACHE_BUDGET_GB``, default
``DEFAULT_BUDGET_GB``).

Cache entries are keyed by the data's identity (the factory's fingerprint, the HF dataset
fingerprint) *and* a signature of the image files' contents (size, mtime and ctime of every
file: rewriting a file, even at the same size, invalidates the entry), plus the resize
recipe and the decoding rules' version (``tta_bench.run.images.DECODE_VERSION``). An entry
is written beside its final name and renamed when whole, under a lock: a killed decode
leaves nothing half-written, and two processes decoding the same entry do the work once.
A corrupt, truncated or undecodable image (``tta_bench.run.images``' errors) is reported by
index and path; with ``on_bad_image="skip"`` it is left out (and recorded), else the run
stops naming it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tta_bench.data import BadImageError, DomainStream
from tta_bench.paths import atomic_path, atomic_write_text, cache_dir
from tta_bench.run import images

RESIZE_RECIPE = "shorter-side-bicubic+center-crop/v1"
ON_BAD_IMAGE = ("fail", "skip")
CACHE_POLICIES = ("auto", "always", "never")
#: ``auto`` decodes a split into the cache (when the stream reaches it) up to this decoded size.
AUTO_DECODE_BYTES = 256 << 20
DEFAULT_BUDGET_GB = 50.0
BUDGET_ENV = "TTA_BENCH_CACHE_BUDGET_GB"
#: Images per decode task: large enough to amortise Arrow reads, small enough to balance.
CHUNK = 256


@dataclass
class Decoded:
    """The decoded images of a stream and the indices of images that could not be decoded
    (their rows are zeros; empty unless ``on_bad_image="skip"``)."""

    images: np.ndarray  # uint8 [N, size, size, 3]
    skipped: list[int] = field(default_factory=list)
    bad: list[dict[str, Any]] = field(default_factory=list)  # {index, path, error}
    from_cache: bool = False


def resized_size(width: int, height: int, size: int) -> tuple[int, int]:
    """The size ``to_rgb_array`` resizes a ``width x height`` image to before its centre
    crop: the shorter side to ``size`` (the service checks it against its pixel limit)."""
    if (width, height) == (size, size):
        return width, height
    scale = size / min(width, height)
    return max(size, round(width * scale)), max(size, round(height * scale))


def to_rgb_array(image: Any, size: int) -> np.ndarray:
    """PIL image or array -> uint8 ``[size, size, 3]``: decoded to 8-bit upright RGB by
    ``tta_bench.run.images.decode_rgb`` (16-bit scaled, alpha over white, EXIF orientation
    applied, ...), then a bicubic resize of the shorter side to ``size`` and a centre crop;
    images already ``size`` x ``size`` are left as they are. Raises
    ``images.ImageDecodeError`` (a ``ValueError``) for an image with no 8-bit meaning."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        arr = np.asarray(image)
        if arr.dtype == np.uint8 and arr.shape == (size, size, 3):
            return arr  # already RGB at the model's size: nothing to do
        image = Image.fromarray(arr)
    image = images.decode_rgb(image)
    w, h = image.size
    if (w, h) != (size, size):
        nw, nh = resized_size(w, h, size)
        image = image.resize((nw, nh), Image.BICUBIC)
        left, top = (nw - size) // 2, (nh - size) // 2
        image = image.crop((left, top, left + size, top + size))
    return np.asarray(image, dtype=np.uint8)


def _open_raw(raw: Any, body: bytes | None = None) -> tuple[Any, str | None]:
    """An undecoded ``datasets.Image`` value (``{"bytes", "path"}``), a PIL image or an
    array -> (an object ``to_rgb_array`` takes, the file path for error messages). A file
    is fully decoded here (``images.decode_rgb``), so truncation is caught per image;
    ``body``: its bytes when the caller has read them already."""
    if isinstance(raw, dict) and ("bytes" in raw or "path" in raw):
        path = raw.get("path")
        body = body if body is not None else raw.get("bytes")
        if body is not None:
            return images.decode_rgb(body, name=path or "in-memory image"), path
        if path:
            return images.decode_rgb(path), path
        raise ValueError("image entry has neither bytes nor a path")
    return raw, None


def content_signature(stream: DomainStream) -> str:
    """A cheap signature of the images' contents: for image files, the (path, size,
    mtime_ns, ctime_ns) of each (ctime changes with every write and cannot be set back by
    the user, so a file rewritten at the same size changes it); for images stored inside
    the dataset's own files (parquet, arrow), the HF dataset fingerprint, which ``datasets``
    derives from those files. Computed once per stream object."""
    cached = getattr(stream, "_content_signature", None)
    if cached is not None:
        return cached
    import datasets
    import pyarrow.compute as pc

    ds = stream.dataset
    h = hashlib.sha256(str(getattr(ds, "_fingerprint", "")).encode())
    if isinstance(ds.features.get("image"), datasets.Image):
        # Arrow columns, not rows: the bytes of embedded images are never read here.
        col = ds.select_columns(["image"]).with_format("arrow")[:]["image"]
        paths = pc.struct_field(col, "path").to_pylist()
        files = pc.is_null(pc.struct_field(col, "bytes")).to_pylist()
        for path, is_file in zip(paths, files):
            if not (is_file and path):
                continue
            try:
                st = os.stat(path)
                h.update(f"{path}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns};".encode())
            except OSError:
                h.update(f"{path}|missing;".encode())
    signature = h.hexdigest()[:16]
    stream._content_signature = signature  # type: ignore[attr-defined]
    return signature


def decoded_bytes(stream: DomainStream, size: int) -> int:
    """What ``stream`` takes decoded at ``size`` px: uint8 ``[N, size, size, 3]``."""
    return len(stream) * size * size * 3


def cache_key(stream: DomainStream, size: int) -> str:
    blob = (
        f"{stream.fingerprint}|n={len(stream)}|{size}|{RESIZE_RECIPE}|{images.DECODE_VERSION}|"
        f"content={content_signature(stream)}"
    )
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


def _check_stored_size(stream: DomainStream, size: int) -> None:
    if stream.native_size is not None and stream.native_size != size:
        raise ValueError(
            f"domain {stream.name!r} is stored at {stream.native_size}px and must not be "
            f"resized, but the model expects {size}px; use a model with that input size"
        )


def _native_array(stream: DomainStream, size: int) -> np.ndarray | None:
    """The images as stored, when they are a uint8 array column already at ``size`` px
    (e.g. CIFAR-10-C's ``.npy``): nothing to decode, nothing to cache."""
    if not _array_feature(stream):
        return None
    n = len(stream)
    arr = _numpy_images(stream.dataset)[0:n]["image"]  # one bulk read
    if arr.dtype == np.uint8 and arr.shape == (n, size, size, 3):
        return np.asarray(arr)
    return None


def _read_entry(stream: DomainStream, size: int, path: Path) -> Decoded | None:
    """The cache entry at ``path`` when it is whole and of the right shape, else None."""
    if not path.exists():
        return None
    try:
        arr = np.load(path, mmap_mode="r")
        meta_path = path.with_suffix(".json")
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {"bad": []}
        if arr.shape != (len(stream), size, size, 3):
            return None
        return Decoded(arr, [b["index"] for b in meta["bad"]], meta["bad"], from_cache=True)
    except (ValueError, OSError, KeyError, json.JSONDecodeError):
        return None  # unreadable entry (an older format or a disk error): decode again


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
    (an ``Array3D`` column, e.g. CIFAR-10-C) are returned without a cache entry. The entry
    is built under a lock (``<entry>.lock``): a second process asking for the same entry
    waits and then reads it instead of decoding it again."""
    if on_bad_image not in ON_BAD_IMAGE:
        raise ValueError(f"on_bad_image must be one of {ON_BAD_IMAGE}, got {on_bad_image!r}")
    _check_stored_size(stream, size)
    native = _native_array(stream, size)
    if native is not None:
        return Decoded(native)
    if not use_cache:
        out = np.empty((len(stream), size, size, 3), dtype=np.uint8)
        bad = _decode_all(stream, _raw_dataset(stream), out, size, progress, on_bad_image, workers)
        return Decoded(out, [b["index"] for b in bad], bad)
    from filelock import FileLock

    path = cache_path(stream, size)
    path.parent.mkdir(parents=True, exist_ok=True)
    found = _read_entry(stream, size, path)
    if found is None:
        with FileLock(str(path) + ".lock"):
            found = _read_entry(stream, size, path)  # another process may have built it
            if found is None:
                check_budget(decoded_bytes(stream, size), f"decoding {stream.name!r}")
                found = _decode_into_cache(stream, size, path, progress, workers)
    _check_bad(stream, found.bad, on_bad_image)
    return found


def _raw_dataset(stream: DomainStream) -> Any:
    """The dataset with undecoded images (``{"bytes", "path"}``: we decode, naming paths)
    or, for an array column, uint8 numpy images."""
    import datasets

    if _array_feature(stream):
        return _numpy_images(stream.dataset)
    return stream.dataset.cast_column("image", datasets.Image(decode=False))


def _decode_into_cache(
    stream: DomainStream, size: int, path: Path, progress: bool, workers: int | None
) -> Decoded:
    shape = (len(stream), size, size, 3)
    # Written beside its final name and renamed when whole (metadata first), so a killed
    # or failed decode leaves nothing half-written in the cache. Bad images are recorded
    # (their rows zeroed); whether they fail the run is the caller's policy.
    with atomic_path(path) as tmp:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint8, shape=shape)
        bad = _decode_all(stream, _raw_dataset(stream), out, size, progress, "skip", workers)
        out.flush()
        del out
        atomic_write_text(
            path.with_suffix(".json"),
            json.dumps(
                {
                    "name": stream.name,
                    "fingerprint": stream.fingerprint,
                    "size": size,
                    "n": len(stream),
                    "bad": bad,
                }
            ),
        )
    return Decoded(np.load(path, mmap_mode="r"), [b["index"] for b in bad], bad)


def decode_one(raw: Any, size: int) -> np.ndarray:
    """One undecoded image (``{"bytes", "path"}``, PIL image or array) as uint8
    ``[size, size, 3]``; raises ``images.ImageDecodeError`` (a ``ValueError``; ``OSError``
    too for corrupt or unreadable files) naming the file. The single decoding function of
    every path (cache or stream): ``images.decode_rgb``, then ``to_rgb_array``'s resize.

    Plain JPEGs (``images.is_plain_jpeg``: baseline 8-bit YCbCr or gray, upright) are
    decoded by torchvision's libjpeg-turbo ``decode_jpeg`` when it is installed (~1.8x
    faster than PIL on 224 px files, and the same pixels: both are libjpeg-turbo with its
    default IDCT and upsampling; tests/test_pipeline.py and harness/tests/test_images.py
    compare them); every other JPEG (progressive, CMYK, EXIF-oriented, ...) and a file it
    cannot decode go to ``decode_rgb``, which applies the rules or names the error."""
    body = _file_bytes(raw)
    if body is not None and images.is_plain_jpeg(body):
        decoded = _decode_jpeg(body)
        if decoded is not None:
            return to_rgb_array(decoded, size)
    img, _ = _open_raw(raw, body)
    return to_rgb_array(img, size)


def _file_bytes(raw: Any) -> bytes | None:
    """The file's bytes when ``raw`` is an undecoded image (read once, here), else None
    (also when the file cannot be read: ``images.decode_rgb`` then names the error)."""
    if not isinstance(raw, dict):
        return None
    body = raw.get("bytes")
    if body is None and raw.get("path"):
        try:
            with open(raw["path"], "rb") as fh:
                body = fh.read()
        except OSError:
            return None
    return body


def _decode_jpeg(data: bytes) -> np.ndarray | None:
    """``[H, W, 3]`` uint8 by torchvision's ``decode_jpeg``; None when torchvision is not
    installed or cannot decode it (PIL then decodes, or reports, the file)."""
    try:
        import torch
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError:
        return None
    # torchvision 0.29 deprecates its image codecs for torchcodec and says so on every call;
    # when they are removed the import above fails and PIL decodes instead.
    warnings.filterwarnings("ignore", message=".*image decoding and encoding capabilities")
    try:
        tensor = decode_jpeg(
            torch.frombuffer(bytearray(data), dtype=torch.uint8), ImageReadMode.RGB
        )
    except RuntimeError:
        return None
    return tensor.permute(1, 2, 0).numpy()


def _bad_entry(index: int, raw: Any, exc: BaseException) -> dict[str, Any]:
    path = raw.get("path") if isinstance(raw, dict) else None
    return {"index": int(index), "path": path, "error": f"{type(exc).__name__}: {exc}"}


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
            try:
                out[i] = decode_one(raw, size)
            except (OSError, ValueError, SyntaxError) as exc:  # PIL's decode errors
                out[i] = 0
                with lock:
                    bad.append(_bad_entry(i, raw, exc))
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


# -- disk budget -------------------------------------------------------------------------
class CacheBudgetEnvError(ValueError):
    """``TTA_BENCH_CACHE_BUDGET_GB`` is not a finite number >= 0; the message names it."""


def cache_budget_gb() -> float:
    """The decoded cache's disk budget in GiB: ``$TTA_BENCH_CACHE_BUDGET_GB``, unset or empty
    for ``DEFAULT_BUDGET_GB``. The one place the variable is read: a value that is not a
    finite number >= 0 (``abc``, ``-1``, ``nan``, ``inf``) raises ``CacheBudgetEnvError`` (a
    ``ValueError``) naming the variable and the value; the commands that read the cache
    (``run``, ``profile``, ``sweep``, ``env``, ``cache``) call it before building anything."""
    raw = os.environ.get(BUDGET_ENV)
    if not raw:
        return DEFAULT_BUDGET_GB
    try:
        gb = float(raw)
    except ValueError:
        gb = math.nan
    if not math.isfinite(gb) or gb < 0:
        raise CacheBudgetEnvError(
            f"{BUDGET_ENV}={raw!r}: expected a finite number of gigabytes >= 0 (e.g. 50 or "
            f"0.5), or unset it for the default ({DEFAULT_BUDGET_GB:g})"
        )
    return gb


def cache_budget_bytes() -> int:
    """The decoded cache's disk budget in bytes (``cache_budget_gb``; its errors)."""
    return int(cache_budget_gb() * (1 << 30))


def cache_entries() -> list[dict[str, Any]]:
    """The cache's entries, decoded splits and shifted domains (``tta_bench.run.shifted``):
    ``{path, kind, name, bytes, images}``, largest first."""
    out = []
    files = [
        npy
        for sub in ("decoded", "shifted")
        if (cache_dir() / sub).exists()
        for npy in sorted((cache_dir() / sub).glob("*.npy"))
    ]
    for npy in files:
        meta: dict[str, Any] = {}
        with contextlib.suppress(OSError, ValueError):
            meta = json.loads(npy.with_suffix(".json").read_text())
        size = npy.stat().st_size + (
            npy.with_suffix(".json").stat().st_size if npy.with_suffix(".json").exists() else 0
        )
        out.append(
            {
                "path": str(npy),
                "kind": npy.parent.name,  # decoded | shifted
                "name": meta.get("name", "?"),
                "bytes": size,
                "images": meta.get("n"),
            }
        )
    return sorted(out, key=lambda e: -e["bytes"])


def cache_used_bytes() -> int:
    return sum(e["bytes"] for e in cache_entries())


def clear_cache(names: list[str] | None = None) -> list[dict[str, Any]]:
    """Remove decoded-cache entries (all, or those whose domain name is in ``names``);
    returns what was removed."""
    removed = []
    for e in cache_entries():
        if names is None or e["name"] in names:
            npy = Path(e["path"])
            for p in (npy, npy.with_suffix(".json"), Path(str(npy) + ".lock")):
                p.unlink(missing_ok=True)
            removed.append(e)
    return removed


def check_budget(needed: int, what: str) -> None:
    budget, used = cache_budget_bytes(), cache_used_bytes()
    if used + needed > budget:
        raise CacheBudgetError(
            f"{what} needs {needed / 2**30:.2f} GiB of decoded cache, but {used / 2**30:.2f} of "
            f"{budget / 2**30:.2f} GiB are in use ({BUDGET_ENV}); clear entries with "
            "`tta-bench cache clear`, raise the budget, or stream without caching (cache=never)"
        )


class CacheBudgetError(ValueError):
    """The decoded cache would grow beyond its disk budget."""


def fits_budget(needed: int) -> bool:
    return cache_used_bytes() + needed <= cache_budget_bytes()
