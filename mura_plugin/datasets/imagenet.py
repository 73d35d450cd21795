"""ImageNet validation (clean, corrupted on the fly), the pre-generated ImageNet-C folder
tree, and the natural-shift sets ImageNet-A, -R (200-class subsets), -V2 and -Sketch.

Labels are indices into the domain's own class list: 0..999 in the canonical ImageNet
order (sorted WordNet ids) for the 1000-class sets, and 0..199 in the sorted order of the
subset's wnids for -A and -R, whose class names are the ImageNet names of those wnids
(``imagenet_indices`` gives the 1000-class index of each). Local layouts:

* validation: ``val/<wnid>/*.JPEG``;  ImageNet-C: ``<corruption>/<severity>/<wnid>/*.JPEG``
  (224 px, never resized or cropped again);  -A / -R / -Sketch: ``<wnid>/*``;
* -V2: ``imagenetv2-<variant>-format-val/<class index 0..999>/*.jpeg`` (folders are class
  indices, not wnids: sorted as strings they would scramble the labels).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from mura_plugin.datasets import _common as c
from mura_plugin.datasets import _inventory as inv
from mura_plugin.datasets.cifar import CORRUPTIONS, EXTRA_CORRUPTIONS, SEVERITIES
from tta_bench.data import DataInventory, DataUnavailableError, DomainStream
from tta_bench.text_head import resolve_templates

__all__ = [
    "imagenet",
    "imagenet_c",
    "imagenet_a",
    "imagenet_r",
    "imagenet_v2",
    "imagenet_sketch",
    "imagenet_ood",
    "imagenet_indices",
]

NUM_CLASSES = 1000


def imagenet_indices(name: str) -> list[int]:
    """For each class of ``name`` (``imagenet_a`` / ``imagenet_r``), its ImageNet-1k index."""
    pos = {w: i for i, w in enumerate(c.imagenet_wnids())}
    return [pos[w] for w in c.dataset_meta(name)["wnids"]]


def _per_class_pick(files: list[Path], wnid: str, per_class: int | None) -> list[Path]:
    """A fixed, seeded choice of ``per_class`` files of one class, chosen by file name so
    that every corruption and severity of ImageNet-C uses the same images."""
    if per_class is None or per_class >= len(files):
        return files
    seed = int.from_bytes(hashlib.sha256(f"imagenet-subset/{wnid}".encode()).digest()[:8], "little")
    order = np.random.default_rng(seed).permutation(len(files))[:per_class]
    return [files[i] for i in sorted(order)]


def _wnid_tree(
    root: Path,
    wnids: Sequence[str],
    per_class: int | None = None,
    *,
    what: str,
    published: int | None = None,
) -> tuple[list[Path], list[int]]:
    """Files of ``root/<wnid>/*`` with labels = position of the wnid in ``wnids``; wnid
    folders without images, absent, or links in ``root`` that lead nowhere, and another
    number of images than ``published``, are a warning that the data is partial (``what``
    names the set)."""
    pos = {w: i for i, w in enumerate(wnids)}
    scan = c.scan_tree(root, wnids)
    if scan.unknown:
        raise ValueError(
            f"{root}: {len(scan.unknown)} folder(s) are not classes of this dataset, e.g. "
            f"{scan.unknown[:5]}; expected WordNet ids such as {wnids[0]}"
        )
    files: list[Path] = []
    labels: list[int] = []
    for folder, found in scan.images.items():
        chosen = _per_class_pick(found, folder, per_class)
        files += chosen
        labels += [pos[folder]] * len(chosen)
    if not files:
        raise DataUnavailableError(f"{root}: no image files in <wnid>/ folders")
    c.warn_partial(scan, what, published)
    return files, labels


def _has_wnid_folders(path: Path) -> bool:
    wnids = set(c.imagenet_wnids())
    folders = c.class_folders(path)
    return bool(folders) and all(f in wnids for f in folders)


def _per_class(subset: int | None) -> int | None:
    if subset is None:
        return None
    if subset < NUM_CLASSES or subset % NUM_CLASSES:
        raise ValueError(
            f"subset must be a positive multiple of {NUM_CLASSES} (images per class x 1000), "
            f"got {subset}"
        )
    return subset // NUM_CLASSES


def _stream(
    name: str,
    meta: dict[str, Any],
    ds: Any,
    fingerprint: str,
    tmpl: Any,
    *,
    native_size: int | None = None,
    **metadata: Any,
) -> DomainStream:
    return DomainStream(
        name=name,
        classnames=list(meta["classnames"]),
        templates=resolve_templates(tmpl or meta["templates"]),
        dataset=ds,
        fingerprint=fingerprint,
        native_size=native_size,
        metadata=metadata,
    )


def _hub_or_tree(
    name: str,
    data_dir: Any,
    revision: str | None,
    layout: str,
    per_class: int | None = None,
) -> tuple[Any, str, dict[str, Any]]:
    """(dataset, fingerprint, metadata) of a wnid-folder / HF-copy / hub-backed set."""
    meta = c.dataset_meta(name)
    wnids = meta["wnids"]
    local = c.find_local(
        data_dir, meta["local_dirs"], lambda p: _has_wnid_folders(p) or c.is_hf_copy(p)
    )
    published = meta.get("published_size")
    if local is not None and not c.is_hf_copy(local):
        files, labels = _wnid_tree(local, wnids, per_class, what=name, published=published)
        fp = f"{name}/tree/{c.files_fingerprint(local, files)}"
        return c.folder_dataset(files, labels), fp, {"source": str(local)}
    if per_class is not None:
        raise ValueError(f"{name}: a per-class subset needs the local folder tree ({layout})")
    split = meta.get("split")
    if local is not None:
        raw, read = c.load_hf_copy(local, split, name)
        source = str(local)
        fp = f"{name}/local/{split}/{c.files_fingerprint(local, read)}"
        metadata = {"source": source, "files": [f.relative_to(local).as_posix() for f in read]}
    elif meta.get("hub_id"):
        missing = c.unavailable_message(name, meta, data_dir, layout)
        raw = c.load_hub(meta["hub_id"], split, revision, missing)
        source = f"hf:{meta['hub_id']}@{revision or 'cached'}"
        fp, metadata = f"{name}/{source}/{split}", {"source": source}
    else:
        raise DataUnavailableError(c.unavailable_message(name, meta, data_dir, layout))
    ds = c.normalize(
        raw,
        meta.get("image_column", "image"),
        meta.get("label_column", "label"),
        meta.get("label_kind", "imagenet_index"),
        num_classes=len(wnids),
        what=f"{name} {source}",
        wnids=wnids,
    )
    c.warn_count(name, source, len(ds), published)
    return ds, f"{fp}/{len(ds)}", metadata


def imagenet(
    *,
    split: str = "validation",
    data_dir: str | None = None,
    revision: str | None = None,
    subset: int | None = None,
    templates: str | Sequence[str] | None = None,
) -> DomainStream:
    """ImageNet-1k validation (50,000 images, 1000 classes), clean; ``subset`` = a fixed
    stratified subset of that many images (a multiple of 1000; local folder tree only)."""
    if split != "validation":
        raise ValueError(f"imagenet: only the 'validation' split is a test domain; got {split!r}")
    meta = c.dataset_meta("imagenet")
    ds, fp, metadata = _hub_or_tree(
        "imagenet", data_dir, revision, "val/<wnid>/*.JPEG", _per_class(subset)
    )
    return _stream(f"imagenet-{split}", meta, ds, f"{fp}/subset={subset}", templates, **metadata)


_C_LAYOUT = "<corruption>/<severity>/<wnid>/*.JPEG"


def _imagenet_c_domain(
    shift: str | None, severity: int | None, data_dir: Any, subset: int | None
) -> tuple[dict[str, Any], Path, Path | None]:
    """``(catalogue entry, local root, domain folder)`` of one ImageNet-C domain from names
    and folder existence only; ``shift`` / ``severity`` ``None``: not checked (domain None)."""
    meta = c.dataset_meta("imagenet_c")
    known = CORRUPTIONS + EXTRA_CORRUPTIONS
    if shift is not None and shift not in known:
        raise ValueError(f"imagenet_c: unknown corruption {shift!r}; available: {', '.join(known)}")
    if severity is not None and severity not in SEVERITIES:
        raise ValueError(f"imagenet_c: severity must be one of {SEVERITIES}, got {severity!r}")
    _per_class(subset)
    layout = _C_LAYOUT

    def looks_like_c(p: Path) -> bool:
        return any((p / k / "1").is_dir() or (p / k / "5").is_dir() for k in known)

    local = c.find_local(data_dir, meta["local_dirs"], looks_like_c)
    domain = None
    if local is not None and shift is not None and severity is not None:
        domain = local / shift / str(severity)
    if local is None or (domain is not None and not domain.is_dir()):
        msg = c.unavailable_message("imagenet_c", meta, data_dir, layout)
        if local is not None:
            msg = f"imagenet_c: {domain} is missing. " + msg
        raise DataUnavailableError(msg)
    return meta, local, domain


def imagenet_c(
    *,
    shift: str,
    severity: int,
    data_dir: str | None = None,
    subset: int | None = None,
    templates: str | Sequence[str] | None = None,
) -> DomainStream:
    """One (corruption, severity) domain of the pre-generated ImageNet-C (224 px).
    ``subset``: a fixed stratified subset (5000 = 5 images per class, the same images in
    every domain); ``None`` = all 50,000."""
    if shift is None or severity is None:
        raise ValueError("imagenet_c: a domain needs shift=<corruption> and severity=<1..5>")
    meta, local, domain = _imagenet_c_domain(shift, severity, data_dir, subset)
    assert domain is not None
    what = f"imagenet_c/{shift}/{severity}"
    files, labels = _wnid_tree(
        domain, meta["wnids"], _per_class(subset), what=what, published=meta.get("published_size")
    )
    fp = f"imagenet_c/{shift}/{severity}/subset={subset}/{c.files_fingerprint(local, files)}"
    return _stream(
        f"imagenet_c/{shift}/{severity}",
        meta,
        c.folder_dataset(files, labels),
        fp,
        templates,
        native_size=int(meta["native_size"]),
        source=str(domain),
    )


def _imagenet_c_check(a: SimpleNamespace) -> None:
    """Before any setup: names, subset and templates are valid and the domain folder
    ``<corruption>/<severity>/`` exists (no image is listed or read)."""
    meta, _, _ = _imagenet_c_domain(a.shift, a.severity, a.data_dir, a.subset)
    resolve_templates(a.templates or meta["templates"])


c.attach_check(imagenet_c, _imagenet_c_check)


def _subset_set(name: str, data_dir: Any, revision: str | None, tmpl: Any) -> DomainStream:
    meta = c.dataset_meta(name)
    ds, fp, metadata = _hub_or_tree(name, data_dir, revision, "<wnid>/*.jpg (200 class folders)")
    indices = imagenet_indices(name)
    return _stream(name, meta, ds, fp, tmpl, **metadata, imagenet_indices=indices)


def imagenet_a(
    *,
    data_dir: str | None = None,
    revision: str | None = None,
    templates: str | Sequence[str] | None = None,
) -> DomainStream:
    """ImageNet-A: 7,500 natural adversarial images, 200 classes (labels 0..199)."""
    return _subset_set("imagenet_a", data_dir, revision, templates)


def imagenet_r(
    *,
    data_dir: str | None = None,
    revision: str | None = None,
    templates: str | Sequence[str] | None = None,
) -> DomainStream:
    """ImageNet-R: 30,000 renditions, 200 classes (labels 0..199)."""
    return _subset_set("imagenet_r", data_dir, revision, templates)


_V2_LAYOUT = "<class index 0..999>/*.jpeg"
#: ImageNetV2's class folders: the class indices 0..999, not wnids.
_V2_FOLDERS = tuple(str(i) for i in range(NUM_CLASSES))


def _index_folders(p: Path) -> bool:
    folders = c.class_folders(p)
    return bool(folders) and all(f.isdigit() and int(f) < NUM_CLASSES for f in folders)


def _v2_meta(variant: str) -> dict[str, Any]:
    """ImageNetV2's catalogue entry with the ``local_dirs`` of ``variant``."""
    meta = c.dataset_meta("imagenet_v2")
    if variant not in meta["variants"]:
        raise ValueError(
            f"imagenet_v2: unknown variant {variant!r}; available: {', '.join(meta['variants'])}"
        )
    return {**meta, "local_dirs": [d.format(variant=variant) for d in meta["local_dirs"]]}


def imagenet_v2(
    *,
    variant: str = "matched-frequency",
    data_dir: str | None = None,
    templates: str | Sequence[str] | None = None,
) -> DomainStream:
    """ImageNetV2 (10,000 images, 1000 classes) in its published folder layout."""
    meta = _v2_meta(variant)
    local = c.find_local(data_dir, meta["local_dirs"], _index_folders)
    if local is None:
        raise DataUnavailableError(c.unavailable_message("imagenet_v2", meta, data_dir, _V2_LAYOUT))
    scan = c.scan_tree(local, _V2_FOLDERS)
    files: list[Path] = []
    labels: list[int] = []
    for folder in sorted(scan.images, key=int):  # numeric order, not "10" < "2"
        files += scan.images[folder]
        labels += [int(folder)] * len(scan.images[folder])
    if not files:
        raise DataUnavailableError(f"imagenet_v2: no image files in {local}/<class index>/")
    c.warn_partial(scan, f"imagenet_v2-{variant}", meta.get("published_size"))
    fp = f"imagenet_v2/{variant}/{c.files_fingerprint(local, files)}"
    ds = c.folder_dataset(files, labels)
    return _stream(f"imagenet_v2-{variant}", meta, ds, fp, templates, source=str(local))


def imagenet_sketch(
    *,
    data_dir: str | None = None,
    revision: str | None = None,
    templates: str | Sequence[str] | None = None,
) -> DomainStream:
    """ImageNet-Sketch (50,889 sketches, 1000 classes)."""
    meta = c.dataset_meta("imagenet_sketch")
    ds, fp, metadata = _hub_or_tree("imagenet_sketch", data_dir, revision, "<wnid>/*.JPEG")
    return _stream("imagenet_sketch", meta, ds, fp, templates, **metadata)


_OOD = {
    "imagenet_a": imagenet_a,
    "imagenet_v2": imagenet_v2,
    "imagenet_r": imagenet_r,
    "imagenet_sketch": imagenet_sketch,
}


def imagenet_ood(
    *,
    shift: str,
    severity: int = 1,
    data_dir: str | None = None,
    templates: str | Sequence[str] | None = None,
) -> DomainStream:
    """One natural-shift domain (``shift`` = imagenet_a / imagenet_v2 / imagenet_r /
    imagenet_sketch) for suites with ``shift_source: dataset``. These domains have a single
    level, recorded as severity 1; any other severity is an error."""
    if shift not in _OOD:
        raise ValueError(f"imagenet_ood: unknown domain {shift!r}; available: {', '.join(_OOD)}")
    if severity != 1:
        raise ValueError(
            f"imagenet_ood: natural-shift domains have one level (severity 1), got {severity}"
        )
    stream = _OOD[shift](data_dir=data_dir, templates=templates)
    # the methods' per-dataset settings read it (ImageNet-V2's stream is named for its variant)
    stream.metadata["dataset"] = shift
    return stream


# -- what `tta-bench data check` reports (folder listings only) --------------------------
_LAYOUTS = {
    "imagenet": "val/<wnid>/*.JPEG",
    "imagenet_a": "<wnid>/*.jpg (200 class folders)",
    "imagenet_r": "<wnid>/*.jpg (200 class folders)",
    "imagenet_sketch": "<wnid>/*.JPEG",
}


def _set_inventory(name: str) -> Any:
    def inventory(a: SimpleNamespace) -> DataInventory:
        """The set's wnid tree (class folders empty, absent, unknown; images against the
        published size), its local HF copy (rows), or its hub dataset in the local cache."""
        meta = c.dataset_meta(name)
        published, hint = meta.get("published_size"), c.download_hint(meta, _LAYOUTS[name])
        local = c.find_local(
            a.data_dir, meta["local_dirs"], lambda p: _has_wnid_folders(p) or c.is_hf_copy(p)
        )
        if local is not None and c.is_hf_copy(local):
            return inv.hf_copy(name, local, meta.get("split"), published, hint)
        local = local or inv.named_folder(a.data_dir, meta["local_dirs"])
        if local is None:
            return inv.not_found(name, published, hint, hub_id=meta.get("hub_id"))
        return inv.tree(name, c.scan_tree(local, meta["wnids"]), published, hint)

    return inventory


def _imagenet_c_inventory(a: SimpleNamespace) -> DataInventory:
    """One ``<corruption>/<severity>/`` folder: its wnid tree against 50,000 images."""
    name = f"imagenet_c/{a.shift}/{a.severity}"
    meta = c.dataset_meta("imagenet_c")
    published = meta.get("published_size")
    hint = c.download_hint(meta, _C_LAYOUT, hf_copy=False)
    try:
        meta, _, domain = _imagenet_c_domain(a.shift, a.severity, a.data_dir, a.subset)
    except DataUnavailableError:
        return inv.not_found(name, published, hint)
    assert domain is not None
    return inv.tree(name, c.scan_tree(domain, meta["wnids"]), published, hint)


def _v2_inventory(a: SimpleNamespace) -> DataInventory:
    """The variant's class-index tree against its 10,000 images."""
    meta = _v2_meta(a.variant)
    name = f"imagenet_v2-{a.variant}"
    published = meta.get("published_size")
    hint = c.download_hint(meta, _V2_LAYOUT, hf_copy=False)
    local = c.find_local(a.data_dir, meta["local_dirs"], _index_folders)
    local = local or inv.named_folder(a.data_dir, meta["local_dirs"])
    if local is None:
        return inv.not_found(name, published, hint)
    return inv.tree(name, c.scan_tree(local, _V2_FOLDERS), published, hint)


def _ood_inventory(a: SimpleNamespace) -> DataInventory:
    """The inventory of the natural-shift set ``shift``."""
    if a.shift not in _OOD:
        raise ValueError(f"imagenet_ood: unknown domain {a.shift!r}; available: {', '.join(_OOD)}")
    return _OOD[a.shift].inventory(data_dir=a.data_dir)  # type: ignore[attr-defined]


for _name in ("imagenet", "imagenet_a", "imagenet_r", "imagenet_sketch"):
    c.attach_inventory(globals()[_name], _set_inventory(_name))
c.attach_inventory(imagenet_c, _imagenet_c_inventory)
c.attach_inventory(imagenet_v2, _v2_inventory)
c.attach_inventory(imagenet_ood, _ood_inventory)
