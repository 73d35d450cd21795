"""Tiny on-disk datasets in the published layouts, built inside tests (no downloads)."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mura_plugin.datasets.cifar import CORRUPTIONS  # the pinned order, one source


def cifar_c(
    root: Path, n: int = 6, corruptions: Sequence[str] = CORRUPTIONS, name: str = "CIFAR-10-C"
) -> Path:
    """``<root>/<name>/<corruption>.npy`` uint8 [5n, 32, 32, 3] and ``labels.npy`` [5n].
    Every pixel of severity s, image i holds ``10 * s + i`` so row slicing is checkable."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    labels = np.arange(n) % 10
    for k, c in enumerate(corruptions):
        arr = np.zeros((5 * n, 32, 32, 3), dtype=np.uint8)
        for s in range(5):
            for i in range(n):
                arr[s * n + i] = 10 * (s + 1) + i + k
        np.save(d / f"{c}.npy", arr)
    np.save(d / "labels.npy", np.tile(labels, 5).astype(np.int64))
    return d


def jpeg(path: Path, size: tuple[int, int] = (40, 48), value: int = 128) -> Path:
    """A solid-colour RGB JPEG of ``size`` (width, height)."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (value, 255 - value, value // 2)).save(path, quality=95)
    return path


def tree(
    root: Path,
    folders: Sequence[str],
    per_folder: int = 2,
    size: tuple[int, int] = (40, 48),
    ext: str = ".JPEG",
) -> list[Path]:
    """``root/<folder>/img<i><ext>`` for each folder."""
    out = []
    for k, f in enumerate(folders):
        for i in range(per_folder):
            out.append(jpeg(root / f / f"img{i}{ext}", size, value=(40 * k + 10 * i) % 256))
    return out


def hf_parquet(
    path: Path,
    labels: Sequence[int],
    value: int = 128,
    image_column: str = "image",
    label_column: str = "label",
    extra: dict[str, Sequence[int]] | None = None,
) -> Path:
    """A parquet file as the hub stores it (written by ``datasets``: an ``Image`` column of
    PNG bytes plus int label columns). Every pixel of every image holds ``value``, so the
    split a stream drew its images from is checkable after decoding."""
    import io

    import datasets
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (value, value, value)).save(buf, format="PNG")
    png = buf.getvalue()
    columns: dict[str, list] = {
        image_column: [{"bytes": png, "path": None} for _ in labels],
        label_column: [int(y) for y in labels],
    }
    features = {image_column: datasets.Image(), label_column: datasets.Value("int64")}
    for name, values in (extra or {}).items():
        columns[name] = [int(v) for v in values]
        features[name] = datasets.Value("int64")
    path.parent.mkdir(parents=True, exist_ok=True)
    ds = datasets.Dataset.from_dict(columns, features=datasets.Features(features))
    ds.to_parquet(str(path))
    return path


def coop_layout(root: Path, name: str, labels: Sequence[int] = (0, 2, 1, 2)) -> dict:
    """``name``'s published CoOp layout under ``root`` (``<folder>/<image dir>/...`` and its
    split file, or FGVC-Aircraft's ``variants.txt`` + ``images_variant_<split>.txt``): one
    small JPEG per listed test label, in the listed (unsorted) order, plus one train and one
    val image. Returns ``{"test": [(relative path, label, class name)], "folder": Path}``."""
    import json

    from tta_bench.catalog import entry

    meta = entry("datasets", name)
    names = list(meta["classnames"])
    folder = root / meta["local_dirs"][0]
    image_dir = folder / meta["image_dir"]
    splits: dict[str, list] = {"train": [], "val": [], "test": []}
    wanted = {"train": [labels[0]], "val": [labels[-1]], "test": list(labels)}
    k = 0
    for split, labs in wanted.items():
        for i, y in enumerate(labs):
            cname = names[y]
            if meta["layout"] == "aircraft_variants":
                rel = f"{1000000 + k}.jpg"
            else:
                sub = f"cars_{split}" if name == "stanford_cars" else cname.replace(" ", "_")
                rel = f"{sub}/{split}_{i:03d}.jpg"
            jpeg(image_dir / rel, value=(37 * k + 11) % 256)
            splits[split].append([rel, y, cname])
            k += 1
    if meta["layout"] == "aircraft_variants":
        (folder / "variants.txt").write_text("\n".join(names) + "\n")
        for split, items in splits.items():
            lines = [f"{rel[:-4]} {cname}" for rel, _, cname in items]
            (folder / f"images_variant_{split}.txt").write_text("\n".join(lines) + "\n")
    else:
        (folder / meta["split_file"]).write_text(json.dumps(splits))
    return {"test": [tuple(t) for t in splits["test"]], "folder": folder, "image_dir": image_dir}


DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def digits_folder(root: Path, classes: Sequence[str] = DIGIT_NAMES, per_class: int = 2) -> Path:
    """``root/<digit name>/<i>.png``: scikit-learn's digits of ``classes`` (names of
    ``DIGIT_NAMES``, the default model's own classes) as 32 px RGB PNGs, ``per_class`` each."""
    from PIL import Image
    from sklearn.datasets import load_digits

    bunch = load_digits()
    for name in classes:
        k = DIGIT_NAMES.index(name)
        (root / name).mkdir(parents=True, exist_ok=True)
        for i, row in enumerate(np.flatnonzero(bunch.target == k)[:per_class]):
            pixels = (bunch.images[row] / 16.0 * 255.0).round().astype(np.uint8)
            image = Image.fromarray(pixels).resize((32, 32), Image.BICUBIC).convert("RGB")
            image.save(root / name / f"{i}.png")
    return root


def bilevel_png(path: Path, width: int, height: int) -> Path:
    """A valid all-black bilevel PNG: 12000 x 12000 is ~20 KB on disk, 144 megapixels."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + body))
        return struct.pack(">I", len(body)) + kind + body + crc

    packer = zlib.compressobj(9)
    row = b"\x00" * (1 + (width + 7) // 8)
    idat = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    )
    return path
