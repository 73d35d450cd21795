"""CIFAR-10/100 (clean, corrupted on the fly) and the pre-generated CIFAR-10-C/100-C.

Clean sets: a local copy under ``data_dir`` (the published python pickle batches
``cifar-10-batches-py/test_batch`` / ``cifar-100-python/test``, or a ``save_to_disk`` /
parquet copy), else the HF hub id (``uoft-cs/cifar10``, ``uoft-cs/cifar100``) from the
``datasets`` cache.

-C sets: the published ``.npy`` layout (Zenodo 2535967 / 3555552): ``<corruption>.npy``
uint8 ``[50000, 32, 32, 3]`` where severity s is rows ``(s-1)*10000 .. s*10000``, and
``labels.npy`` ``[50000]``. Images are served as an ``Array3D`` column, so at 32 px they
reach the model without any decode.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from mura_plugin.datasets import _common as c
from mura_plugin.datasets import _inventory as inv
from tta_bench.data import DataInventory, DataUnavailableError, DomainStream
from tta_bench.text_head import resolve_templates

__all__ = ["cifar10", "cifar100", "cifar10_c", "cifar100_c", "CORRUPTIONS", "EXTRA_CORRUPTIONS"]

#: The 15 corruptions of the benchmark, in the pinned order, and the 4 held-out extras.
CORRUPTIONS = (
    "gaussian_noise",
    "shot_noise",
    "impulse_noise",
    "defocus_blur",
    "glass_blur",
    "motion_blur",
    "zoom_blur",
    "snow",
    "frost",
    "fog",
    "brightness",
    "contrast",
    "elastic_transform",
    "pixelate",
    "jpeg_compression",
)
EXTRA_CORRUPTIONS = ("speckle_noise", "gaussian_blur", "spatter", "saturate")
SEVERITIES = (1, 2, 3, 4, 5)
#: Per set and split: the python pickle batches (read in order) and their label key. The
#: test split is the test domain; the train split is a suite's clean source (EATA's Fisher,
#: RMT's and SANTA's labelled source), never a test domain.
_PICKLES = {
    "cifar10": {
        "test": (("test_batch",), b"labels"),
        "train": (tuple(f"data_batch_{i}" for i in range(1, 6)), b"labels"),
    },
    "cifar100": {"test": (("test",), b"fine_labels"), "train": (("train",), b"fine_labels")},
}
#: Images per split as published (Krizhevsky 2009), for the count warning.
_PUBLISHED = {"test": 10_000, "train": 50_000}


def _array_dataset(images: np.ndarray, labels: np.ndarray) -> Any:
    import datasets

    h, w = images.shape[1:3]
    features = datasets.Features(
        {
            "image": datasets.Array3D(shape=(h, w, 3), dtype="uint8"),
            "label": datasets.Value("int64"),
        }
    )
    return datasets.Dataset.from_dict(
        {"image": np.ascontiguousarray(images), "label": np.asarray(labels, dtype=np.int64)},
        features=features,
    )


def _read_pickle(path: Path, label_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as fh:
        batch = pickle.load(fh, encoding="bytes")
    images = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return images, np.asarray(batch[label_key], dtype=np.int64)


def _clean(name: str, split: str, data_dir: Any, revision: str | None, tmpl: Any) -> DomainStream:
    meta = c.dataset_meta(name)
    if split not in _PICKLES[name]:
        raise ValueError(
            f"{name}: unknown split {split!r}; available: test (the test domain), train (a "
            "suite's clean source split)"
        )
    pickle_names, label_key = _PICKLES[name][split]
    local = c.find_local(
        data_dir, meta["local_dirs"], lambda p: (p / pickle_names[0]).exists() or c.is_hf_copy(p)
    )
    num_classes = len(meta["classnames"])
    metadata: dict[str, Any] = {"split": split}
    if local is not None and (local / pickle_names[0]).exists():
        files = [local / f for f in pickle_names]
        missing_batches = [f.name for f in files if not f.exists()]
        if missing_batches:
            raise DataUnavailableError(
                f"{name} {split}: {local} lacks the pickle batches {', '.join(missing_batches)}"
            )
        parts = [_read_pickle(f, label_key) for f in files]
        images = np.concatenate([im for im, _ in parts])
        where = str(files[0]) if len(files) == 1 else f"{local} ({', '.join(pickle_names)})"
        labels = c.check_labels(np.concatenate([lb for _, lb in parts]), num_classes, where)
        ds = _array_dataset(images, labels)
        fingerprint = f"{name}/pickle/{c.files_fingerprint(local, files)}"
        source = where
        c.warn_count(name, source, len(ds), _PUBLISHED[split])
    else:
        if local is not None:
            raw, files = c.load_hf_copy(local, split, name)
            source = str(local)
            fingerprint = f"{name}/local/{split}/{c.files_fingerprint(local, files)}"
            metadata["files"] = [f.relative_to(local).as_posix() for f in files]
        else:
            missing = c.unavailable_message(
                name, meta, data_dir, f"{meta['local_dirs'][0]}/{pickle_names[0]} (python pickle)"
            )
            raw = c.load_hub(meta["hub_id"], split, revision, missing)
            source = f"hf:{meta['hub_id']}@{revision or 'cached'}"
            fingerprint = f"{name}/{source}/{split}"
        ds = c.normalize(
            raw,
            meta["image_column"],
            meta["label_column"],
            "index",
            num_classes=num_classes,
            what=f"{name} {source}",
        )
        c.warn_count(name, source, len(ds), _PUBLISHED[split])
        fingerprint += f"/{len(ds)}"
    return DomainStream(
        name=f"{name}-{split}",
        classnames=list(meta["classnames"]),
        templates=resolve_templates(tmpl or meta["templates"]),
        dataset=ds,
        fingerprint=fingerprint,
        metadata={"source": source, **metadata},
    )


def cifar10(
    *,
    split: str = "test",
    data_dir: str | None = None,
    revision: str | None = None,
    templates: str | Sequence[str] | None = None,
) -> DomainStream:
    """CIFAR-10 test split (10,000 images, 32 px) as a clean ``DomainStream``; ``split=train``
    (50,000) is the CIFAR-10-C suite's clean source split."""
    return _clean("cifar10", split, data_dir, revision, templates)


def cifar100(
    *,
    split: str = "test",
    data_dir: str | None = None,
    revision: str | None = None,
    templates: str | Sequence[str] | None = None,
) -> DomainStream:
    """CIFAR-100 test split (10,000 images, 32 px, 100 fine classes), clean; ``split=train``
    (50,000) is the CIFAR-100-C suite's clean source split."""
    return _clean("cifar100", split, data_dir, revision, templates)


def _c_layout(meta: dict[str, Any]) -> str:
    return f"{meta['local_dirs'][0]}/<corruption>.npy + labels.npy"


def _corrupted_files(
    name: str, shift: str | None, severity: int | None, data_dir: Any
) -> tuple[dict[str, Any], Path]:
    """``(catalogue entry, local folder)`` of one -C domain, from names and file existence
    only; ``shift`` / ``severity`` ``None``: not checked (``check_args`` before a run)."""
    meta = c.dataset_meta(name)
    known = CORRUPTIONS + EXTRA_CORRUPTIONS
    if shift is not None and shift not in known:
        raise ValueError(f"{name}: unknown corruption {shift!r}; available: {', '.join(known)}")
    if severity is not None and severity not in SEVERITIES:
        raise ValueError(f"{name}: severity must be one of {SEVERITIES}, got {severity!r}")
    local = c.find_local(data_dir, meta["local_dirs"], lambda p: (p / "labels.npy").exists())
    if local is None or (shift is not None and not (local / f"{shift}.npy").exists()):
        layout = _c_layout(meta)
        msg = c.unavailable_message(name, meta, data_dir, layout)
        if local is not None:
            msg = f"{name}: {local / (shift + '.npy')} is missing. " + msg
        raise DataUnavailableError(msg)
    return meta, local


def _corrupted(
    name: str, shift: str | None, severity: int | None, data_dir: Any, tmpl: Any
) -> DomainStream:
    if shift is None or severity is None:
        raise ValueError(f"{name}: a domain needs shift=<corruption> and severity=<1..5>")
    meta, local = _corrupted_files(name, shift, severity, data_dir)
    images = np.load(local / f"{shift}.npy", mmap_mode="r")
    labels = np.load(local / "labels.npy", mmap_mode="r")
    if images.ndim != 4 or images.shape[3] != 3 or images.dtype != np.uint8:
        raise ValueError(
            f"{local / (shift + '.npy')}: expected uint8 [N, H, W, 3], "
            f"got {images.dtype} {images.shape}"
        )
    if len(images) != len(labels) or len(images) % len(SEVERITIES):
        raise ValueError(
            f"{local}: {shift}.npy has {len(images)} rows and labels.npy {len(labels)}; both must "
            f"be equal and hold {len(SEVERITIES)} severities (published: 50000 = 5 x 10000)"
        )
    # every row, not only this severity's: a labels file with a bad row is bad for all
    labels = c.check_labels(labels, len(meta["classnames"]), str(local / "labels.npy"))
    per = len(images) // len(SEVERITIES)
    if per != meta["rows_per_severity"]:
        import warnings

        warnings.warn(
            f"{name}: {per} rows per severity, the published layout has "
            f"{meta['rows_per_severity']}: a subset or a different release",
            stacklevel=3,
        )
    rows = slice((severity - 1) * per, severity * per)
    ds = _array_dataset(np.asarray(images[rows]), labels[rows])
    files = [local / f"{shift}.npy", local / "labels.npy"]
    return DomainStream(
        name=f"{name}/{shift}/{severity}",
        classnames=list(meta["classnames"]),
        templates=resolve_templates(tmpl or meta["templates"]),
        dataset=ds,
        fingerprint=f"{name}/{shift}/{severity}/{c.files_fingerprint(local, files)}",
        metadata={"source": str(local), "rows": [rows.start, rows.stop]},
    )


def _corrupted_check(name: str) -> Any:
    def check(a: SimpleNamespace) -> None:
        """Before any setup: the corruption, severity and templates are known and the local
        ``<corruption>.npy`` + ``labels.npy`` exist (nothing is read)."""
        meta, _ = _corrupted_files(name, a.shift, a.severity, a.data_dir)
        resolve_templates(a.templates or meta["templates"])

    return check


def cifar10_c(
    *,
    shift: str,
    severity: int,
    data_dir: str | None = None,
    templates: str | Sequence[str] | None = None,
) -> DomainStream:
    """One (corruption, severity) domain of the pre-generated CIFAR-10-C."""
    return _corrupted("cifar10_c", shift, severity, data_dir, templates)


def cifar100_c(
    *,
    shift: str,
    severity: int,
    data_dir: str | None = None,
    templates: str | Sequence[str] | None = None,
) -> DomainStream:
    """One (corruption, severity) domain of the pre-generated CIFAR-100-C."""
    return _corrupted("cifar100_c", shift, severity, data_dir, templates)


c.attach_check(cifar10_c, _corrupted_check("cifar10_c"))
c.attach_check(cifar100_c, _corrupted_check("cifar100_c"))


def _corrupted_inventory(name: str) -> Any:
    def inventory(a: SimpleNamespace) -> DataInventory:
        """One corruption's ``.npy`` + ``labels.npy``: the rows of a severity (from the array
        headers) against the published 10,000."""
        meta = c.dataset_meta(name)
        domain, published = f"{name}/{a.shift}/{a.severity}", meta["rows_per_severity"]
        hint = c.download_hint(meta, _c_layout(meta), hf_copy=False)
        try:
            meta, local = _corrupted_files(name, a.shift, a.severity, a.data_dir)
        except DataUnavailableError:
            return inv.not_found(domain, published, hint)
        path = local / f"{a.shift}.npy"
        found = DataInventory(domain, where=str(path), published=published, download=hint)
        try:
            rows = len(np.load(path, mmap_mode="r"))
            labels = len(np.load(local / "labels.npy", mmap_mode="r"))
        except (OSError, ValueError) as exc:  # not an .npy array: a run cannot read it
            found.problems.append(f"{path} or labels.npy cannot be read: {exc}")
            return found
        if rows != labels or rows % len(SEVERITIES):
            found.problems.append(
                f"{path.name} has {rows} rows and labels.npy {labels}: both must be equal and "
                f"hold {len(SEVERITIES)} severities"
            )
        found.images = rows // len(SEVERITIES)
        return found

    return inventory


c.attach_inventory(cifar10_c, _corrupted_inventory("cifar10_c"))
c.attach_inventory(cifar100_c, _corrupted_inventory("cifar100_c"))
