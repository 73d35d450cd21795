"""Dataset factories: a synthetic labelled set (PNG bytes inside an HF ``datasets.Dataset``)
and an image folder (class subfolders of image files under ``data_dir``).

Every image is one colour per class (``COLOURS``) plus per-pixel noise, so its class can be
read off its mean colour (the ``colour_oracle`` method does): a scored accuracy of 1.0 shows
that images and labels stayed aligned through the whole pipeline.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tta_bench.data import DomainStream

COLOURS = {
    "red": (200, 40, 40),
    "green": (40, 200, 40),
    "blue": (40, 40, 200),
    "yellow": (200, 200, 40),
}
CLASSNAMES = list(COLOURS)
TEMPLATES = ["a photo of a {} square.", "a {} image."]
SPLITS = ("train", "test")
#: Brightness factor per severity of the dataset-served domains (``shift=`` given).
DOMAIN_FACTOR = {"bright": 1.15, "dark": 0.7}


def colour_image(label: int, seed: tuple[object, ...], size: tuple[int, int]) -> np.ndarray:
    """uint8 ``[H, W, 3]``: the class colour plus uniform noise in [-25, 25], drawn from
    ``seed`` (width, height = ``size``)."""
    import hashlib

    key = int.from_bytes(hashlib.blake2b(repr(seed).encode(), digest_size=8).digest(), "little")
    rng = np.random.default_rng(key)
    base = np.asarray(COLOURS[CLASSNAMES[label]], dtype=np.int16)
    noise = rng.integers(-25, 26, size=(size[1], size[0], 3), dtype=np.int16)
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def png_bytes(image: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


def check_synthetic(
    *,
    split: str = "test",
    per_class: int = 8,
    shift: str | None = None,
    names: Sequence[str] | None = None,
    **_: object,
) -> None:
    if names is not None and len(names) != len(CLASSNAMES):
        raise ValueError(f"names: one per colour class ({len(CLASSNAMES)}), got {list(names)}")
    if split not in SPLITS:
        raise ValueError(f"unknown synthetic split {split!r}; available: {', '.join(SPLITS)}")
    if per_class < 1:
        raise ValueError(f"per_class must be >= 1, got {per_class}")
    if shift is not None and shift not in DOMAIN_FACTOR:
        raise ValueError(f"unknown synthetic domain {shift!r}; available: {list(DOMAIN_FACTOR)}")


def synthetic(
    *,
    split: str = "test",
    per_class: int = 8,
    corrupt: Sequence[int] = (),
    shift: str | None = None,
    severity: int | None = None,
    names: Sequence[str] | None = None,
) -> DomainStream:
    """``per_class`` 16 px images of each of the 4 classes, class-interleaved (label of row
    ``i`` is ``i % 4``). ``corrupt``: rows whose PNG bytes are truncated (undecodable).
    ``shift``/``severity`` (a suite with ``shift_source: dataset``): the domain's own split,
    brightness scaled by ``DOMAIN_FACTOR[shift] ** severity``. ``names``: other class names
    for the same images (an out-of-distribution set that shares no class with the test
    split)."""
    import datasets

    check_synthetic(split=split, per_class=per_class, shift=shift, names=names)
    classnames = list(CLASSNAMES if names is None else names)
    n = per_class * len(CLASSNAMES)
    labels = [i % len(CLASSNAMES) for i in range(n)]
    factor = 1.0 if shift is None else DOMAIN_FACTOR[shift] ** int(severity or 1)
    rows = []
    for i, y in enumerate(labels):
        img = colour_image(y, (split, shift, severity, i), (16, 16))
        img = np.clip(img.astype(np.float64) * factor, 0, 255).astype(np.uint8)
        data = png_bytes(img)
        if i in set(corrupt):
            data = data[: len(data) // 2]
        rows.append({"bytes": data, "path": None})
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=classnames)}
    )
    ds = datasets.Dataset.from_dict({"image": rows, "label": labels}, features=features)
    domain = "" if shift is None else f"-{shift}-{severity}"
    return DomainStream(
        name=f"synthetic-{split}{domain}",
        classnames=classnames,
        templates=list(TEMPLATES),
        dataset=ds,
        fingerprint=f"testplugin-synthetic/v1/{split}/{per_class}/{shift}/{severity}/{list(corrupt)}"
        + ("" if names is None else f"/{classnames}"),
    )


synthetic.check_args = check_synthetic  # type: ignore[attr-defined]


def check_folder(*, data_dir: str | None = None) -> None:
    if data_dir is None:
        raise ValueError("the folder dataset reads class subfolders under --data-dir; none given")
    if not Path(data_dir).is_dir():
        raise ValueError(f"--data-dir {data_dir!r} is not a directory")


def folder(*, data_dir: str | None = None) -> DomainStream:
    """``data_dir/<class>/<file>``: classes are the sorted subfolder names, images every
    file inside, in sorted order (decoded and resized by the harness, not here)."""
    import datasets

    check_folder(data_dir=data_dir)
    root = Path(data_dir)
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    paths, labels = [], []
    for k, name in enumerate(classes):
        for f in sorted(p for p in (root / name).iterdir() if p.is_file()):
            paths.append(str(f))
            labels.append(k)
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=classes)}
    )
    ds = datasets.Dataset.from_dict({"image": paths, "label": labels}, features=features)
    return DomainStream(
        name=f"folder-{root.name}",
        classnames=classes,
        templates=list(TEMPLATES),
        dataset=ds,
        fingerprint=f"testplugin-folder/v1/{root.resolve()}",
    )


folder.check_args = check_folder  # type: ignore[attr-defined]
