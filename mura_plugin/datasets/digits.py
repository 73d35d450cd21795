"""The embedded default dataset: scikit-learn's bundled handwritten digits (1,797 real 8x8
images, Alpaydin & Kaynak 1998), upscaled to 32x32 RGB, with a fixed stratified
train/test split. Ships with scikit-learn, so it works offline."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from tta_bench.catalog import entry
from tta_bench.data import DomainStream

__all__ = ["digits", "digits_arrays"]

SPLITS = ("train", "test")
IMAGE_SIZE = 32
TEST_FRACTION = 0.2
SPLIT_SEED = 0


@lru_cache(maxsize=4)
def digits_arrays(split: str) -> tuple[np.ndarray, np.ndarray]:
    """``(images uint8 [N, 32, 32, 3], labels int64 [N])`` of one split."""
    if split not in SPLITS:
        raise ValueError(f"unknown digits split {split!r}; available: {', '.join(SPLITS)}")
    from PIL import Image

    flat, target = _load_digits()
    raw = (flat.reshape(-1, 8, 8) / 16.0 * 255.0).round().clip(0, 255).astype(np.uint8)
    test_idx = np.asarray(_split()["test"], dtype=np.int64)
    chosen = test_idx if split == "test" else np.setdiff1d(np.arange(len(raw)), test_idx)
    up = np.stack(
        [
            np.asarray(Image.fromarray(raw[i]).resize((IMAGE_SIZE, IMAGE_SIZE), Image.BICUBIC))
            for i in chosen
        ]
    )
    rgb = np.repeat(up[..., None], 3, axis=-1)
    return rgb, target[chosen].astype(np.int64)


def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    """``(data [1797, 64] float64, target [1797] int64)``: the values of scikit-learn's
    ``load_digits()``, read from the same bundled file the same way (``np.loadtxt`` of
    ``datasets/data/digits.csv.gz``) without importing ``sklearn.datasets`` (about a second
    per process; tested equal)."""
    import gzip
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the digits dataset ships with scikit-learn: pip install scikit-learn")
    path = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, mode="rt", encoding="utf-8") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1], data[:, -1].astype(int)


@lru_cache(maxsize=1)
def _split() -> dict:
    """The stored split (``digits_split.json``: scikit-learn's stratified
    ``train_test_split`` with ``TEST_FRACTION`` and ``SPLIT_SEED``; tested against it)."""
    import json
    from pathlib import Path

    return json.loads((Path(__file__).with_name("digits_split.json")).read_text())


def _check_classes(classes: Sequence[int] | None) -> list[int] | None:
    if classes is None:
        return None
    chosen = list(classes)
    bad = [c for c in chosen if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= 9]
    if not chosen or bad or len(set(chosen)) != len(chosen):
        raise ValueError(
            f"digits: classes must be distinct digits 0-9, at least one, got {list(classes)!r}"
        )
    return chosen


@lru_cache(maxsize=8)
def _dataset(split: str, chosen: tuple[int, ...] | None, classnames: tuple[str, ...]) -> Any:
    """The HF ``datasets.Dataset`` of a split (of the ``chosen`` digits, relabelled), built
    once per process: building it encodes every image as PNG, and the runs, adapters and
    tests of the default suite ask for it again and again (docs/speed.md). The callers
    share it: what the harness does with a stream's dataset (``select``, ``cast_column``,
    ``with_format``) returns new ones and leaves it as it is."""
    import datasets

    images, labels = digits_arrays(split)
    if chosen is not None:
        keep = np.flatnonzero(np.isin(labels, chosen))
        relabel = {c: i for i, c in enumerate(chosen)}
        images = images[keep]
        labels = np.asarray([relabel[int(y)] for y in labels[keep]], dtype=np.int64)
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=list(classnames))}
    )
    return datasets.Dataset.from_dict(
        {"image": list(images), "label": labels.tolist()}, features=features
    )


def digits(*, split: str = "test", classes: Sequence[int] | None = None) -> DomainStream:
    """The digits split as a ``DomainStream`` (HF ``datasets.Dataset`` with image/label).
    ``classes``: keep only the images of these digits, relabelled 0..k-1 in the given order
    (the class names follow: ``classes=[0, 1, 2, 3, 4]`` is the five-class ``zero..four``);
    an open-set suite's known classes, or its unknown ones as the OOD set."""
    chosen = _check_classes(classes)
    meta = entry("datasets", "digits")
    classnames = list(meta["classnames"])
    fingerprint = f"sklearn-digits/v1/{split}/{IMAGE_SIZE}px/split-seed{SPLIT_SEED}"
    if chosen is not None:
        classnames = [classnames[c] for c in chosen]
        fingerprint += f"/classes={','.join(map(str, chosen))}"
    ds = _dataset(split, None if chosen is None else tuple(chosen), tuple(classnames))
    return DomainStream(
        name=f"digits-{split}",
        classnames=classnames,
        templates=list(meta["templates"]),
        dataset=ds,
        fingerprint=fingerprint,
        metadata={
            "source": "sklearn.datasets.load_digits",
            "split": split,
            **({"classes": chosen} if chosen is not None else {}),
        },
    )
