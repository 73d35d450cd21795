"""Shared loading rules for the hub-backed dataset factories.

Loading order for every hub-backed set: (1) ``data_dir``: local files in the published
layout (found under one of the catalogue's ``local_dirs`` below ``data_dir``, or ``data_dir``
itself), or a local HF copy (``save_to_disk`` directory or parquet files); (2) the HF hub id
through the ``datasets`` cache, which works offline only if the set is already cached.
With neither, ``DataUnavailableError`` says what to download and where to point
``--data-dir``; nothing is written anywhere.

Class names, WordNet ids, templates, hub ids and column names come from the catalogue
(``registry.yaml``: ``datasets:`` and ``templates:``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from tta_bench.catalog import catalog, entry
from tta_bench.data import DataUnavailableError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".gif")
LABEL_KINDS = ("index", "imagenet_index", "wnid")


def dataset_meta(name: str) -> dict[str, Any]:
    """The catalogue entry of dataset ``name`` with ``classnames`` resolved (an entry may
    borrow them from another with ``classnames_from``; a ``wnids`` subset of ImageNet takes
    the ImageNet names of those wnids)."""
    meta = entry("datasets", name)
    if not meta:
        raise ValueError(f"dataset {name!r} has no catalogue entry in registry.yaml")
    source = meta.get("classnames_from")
    if source and "classnames" not in meta:
        base = entry("datasets", source)
        if "wnids" in meta and "wnids" in base:
            index = {w: i for i, w in enumerate(base["wnids"])}
            meta["classnames"] = [base["classnames"][index[w]] for w in meta["wnids"]]
        else:
            meta["classnames"] = list(base["classnames"])
            if "wnids" in base:
                meta["wnids"] = list(base["wnids"])
    return meta


def templates(spec: str | Sequence[str]) -> list[str]:
    """A named template set from the catalogue's ``templates:`` section, or a list as is."""
    if isinstance(spec, str):
        sets = catalog()["templates"]
        if spec not in sets:
            raise ValueError(
                f"unknown template set {spec!r}; available: {', '.join(sorted(sets))} "
                "(or give a list of format strings with one '{}')"
            )
        return list(sets[spec]["templates"])
    out = [str(t) for t in spec]
    bad = [t for t in out if "{}" not in t]
    if not out or bad:
        raise ValueError(f"prompt templates need one '{{}}' for the class name; got {bad or out}")
    return out


@lru_cache(maxsize=1)
def imagenet_wnids() -> tuple[str, ...]:
    return tuple(entry("datasets", "imagenet")["wnids"])


def find_local(
    data_dir: str | os.PathLike[str] | None,
    candidates: Sequence[str],
    check: Callable[[Path], bool],
) -> Path | None:
    """The first of ``data_dir/<candidate>`` (then ``data_dir`` itself) that passes ``check``."""
    if data_dir is None:
        return None
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise DataUnavailableError(f"--data-dir {str(root)!r} is not a directory")
    for cand in [*candidates, "."]:
        path = root / cand
        if path.is_dir() and check(path):
            return path.resolve()
    return None


def is_hf_copy(path: Path) -> bool:
    """A ``save_to_disk`` directory (of a Dataset or DatasetDict) or a tree of parquet files."""
    return (
        (path / "state.json").exists()
        or (path / "dataset_dict.json").exists()
        or next(path.rglob("*.parquet"), None) is not None
    )


def load_hf_copy(path: Path, split: str | None) -> Any:
    """Load a local HF copy: ``save_to_disk`` output or parquet files (``<split>*.parquet``
    or ``<split>/*.parquet`` when several splits are present)."""
    import datasets

    if (path / "state.json").exists() or (path / "dataset_dict.json").exists():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataUnavailableError(
                    f"local copy {path} has splits {list(ds)}, not {split!r}"
                )
            ds = ds[split]
        return ds
    files = sorted(str(p) for p in path.rglob("*.parquet"))
    if split is not None:
        named = [f for f in files if split in Path(f).relative_to(path).parts[0]]
        files = named or files
    return datasets.Dataset.from_parquet(files)


def load_hub(hub_id: str, split: str, revision: str | None, missing: str) -> Any:
    """Load ``hub_id`` through the ``datasets`` cache; ``missing`` is the message used when
    the set is neither cached nor reachable."""
    import datasets

    try:
        return datasets.load_dataset(hub_id, split=split, revision=revision)
    except Exception as exc:  # offline / not cached / gated: all mean "get the data first"
        raise DataUnavailableError(
            f"{missing} (the hub said: {type(exc).__name__}: {exc})"
        ) from exc


def list_images(folder: Path) -> list[Path]:
    """Image files directly in ``folder``, sorted by name (deterministic order)."""
    with os.scandir(folder) as it:
        files = [
            Path(e.path) for e in it if e.is_file() and e.name.lower().endswith(IMAGE_EXTENSIONS)
        ]
    return sorted(files, key=lambda p: p.name)


def class_folders(root: Path) -> list[str]:
    with os.scandir(root) as it:
        return sorted(e.name for e in it if e.is_dir() and not e.name.startswith("."))


def folder_dataset(files: Sequence[Path], labels: Sequence[int]) -> Any:
    """A ``datasets.Dataset`` over image files (decoded lazily) with int labels."""
    import datasets

    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    return datasets.Dataset.from_dict(
        {"image": [str(f) for f in files], "label": [int(y) for y in labels]}, features=features
    )


def files_fingerprint(root: Path, files: Sequence[Path]) -> str:
    """Identity of local files: their paths relative to ``root`` and sizes (a changed or
    replaced file changes the decoded-cache key)."""
    h = hashlib.sha256(str(root).encode())
    for f in files:
        h.update(f"{f.relative_to(root)}:{f.stat().st_size};".encode())
    return h.hexdigest()[:16]


def normalize(
    ds: Any,
    image_column: str,
    label_column: str,
    label_kind: str,
    wnids: Sequence[str] | None = None,
) -> Any:
    """Keep the image and label columns, named ``image``/``label``, labels mapped to
    0..C-1 in the order of ``wnids`` (``label_kind``: ``index`` = already 0..C-1;
    ``imagenet_index`` = 0..999 ImageNet indices; ``wnid`` = WordNet id strings)."""
    for col in (image_column, label_column):
        if col not in ds.column_names:
            raise ValueError(f"column {col!r} not in the dataset; it has {ds.column_names}")
    if label_kind not in LABEL_KINDS:
        raise ValueError(f"unknown label_kind {label_kind!r}; available: {LABEL_KINDS}")
    raw = ds[label_column]
    if label_kind == "index":
        labels = np.asarray(raw, dtype=np.int64)
    else:
        if wnids is None:
            raise ValueError(f"label_kind {label_kind!r} needs the class wnids")
        pos = {w: i for i, w in enumerate(wnids)}
        keys = [imagenet_wnids()[int(y)] for y in raw] if label_kind == "imagenet_index" else raw
        unknown = sorted({k for k in keys if k not in pos})
        if unknown:
            raise ValueError(f"{len(unknown)} label(s) outside the class list, e.g. {unknown[:5]}")
        labels = np.asarray([pos[k] for k in keys], dtype=np.int64)
    ds = ds.select_columns([image_column])
    if image_column != "image":
        ds = ds.rename_column(image_column, "image")
    return ds.add_column("label", labels.tolist())


def unavailable_message(title: str, meta: dict[str, Any], data_dir: Any, layout: str) -> str:
    """What to download and where to put it."""
    where = ", ".join(f"<data-dir>/{d}" for d in meta.get("local_dirs", [])) or "<data-dir>"
    parts = [f"{title}: no local copy found"]
    if data_dir is not None:
        parts[0] += f" under --data-dir {str(data_dir)!r}"
    else:
        parts[0] += " (no --data-dir given)"
    if meta.get("hub_id"):
        parts.append(
            f"and the HF hub dataset {meta['hub_id']!r} is not in the local datasets cache "
            "(this machine cannot download it)"
        )
    msg = " ".join(parts) + "."
    if meta.get("download"):
        msg += f" Download {meta['download']}"
        msg += f" or the hub dataset {meta['hub_id']}" if meta.get("hub_id") else ""
        msg += ";"
    elif meta.get("hub_id"):
        msg += (
            f" Download the hub dataset {meta['hub_id']} (datasets.load_dataset) on a machine "
            "with network;"
        )
    msg += (
        f" put it at one of {where} in the layout {layout} (or a save_to_disk/parquet copy) "
        "and pass --data-dir <data-dir>."
    )
    return msg
