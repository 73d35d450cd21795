"""Domain streams and the decoded-image cache (DESIGN §5).

A dataset factory returns a ``DomainStream``: a HuggingFace ``datasets.Dataset`` with an
``image`` and a ``label`` column, plus the class names and prompt templates. The harness
decodes and resizes every image once into a uint8 array ``[N, H, W, 3]`` stored as ``.npy``
under the cache directory, keyed by a fingerprint of the data and the resize recipe, and
memory-maps it on later runs.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tta_bench.paths import cache_dir

RESIZE_RECIPE = "shorter-side-bicubic+center-crop/v1"


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


def _to_rgb_array(image: Any, size: int) -> np.ndarray:
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


def decoded_images(
    stream: DomainStream, size: int, *, progress: bool = False, use_cache: bool = True
) -> np.ndarray:
    """All images of ``stream`` as uint8 ``[N, size, size, 3]``, decoded once and cached."""
    if stream.native_size is not None and stream.native_size != size:
        raise ValueError(
            f"domain {stream.name!r} is stored at {stream.native_size}px and must not be "
            f"resized, but the model expects {size}px; use a model with that input size"
        )
    key = hashlib.sha256(f"{stream.fingerprint}|{size}|{RESIZE_RECIPE}".encode()).hexdigest()
    path = cache_dir() / "decoded" / f"{key[:24]}.npy"
    if use_cache and path.exists():
        try:
            arr = np.load(path, mmap_mode="r")
            if arr.shape == (len(stream), size, size, 3):
                return arr
        except (ValueError, OSError):
            pass  # a truncated file from an older crash: decode again
    images = stream.dataset["image"] if len(stream) <= 4096 else None
    out = np.empty((len(stream), size, size, 3), dtype=np.uint8)
    iterator: Any = range(len(stream))
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(iterator, desc=f"decode {stream.name}", unit="img", leave=False)
    for i in iterator:
        img = images[i] if images is not None else stream.dataset[i]["image"]
        out[i] = _to_rgb_array(img, size)
    if use_cache:
        atomic_save_npy(path, out)
    return out


def atomic_save_npy(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npy.tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            np.save(fh, array)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def batches(indices: Sequence[int], batch_size: int) -> list[np.ndarray]:
    idx = np.asarray(indices)
    return [idx[i : i + batch_size] for i in range(0, len(idx), batch_size)]
