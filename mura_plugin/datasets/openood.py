"""OpenOOD v1.5's fixed out-of-distribution splits for ImageNet-1k (Zhang et al., "OpenOOD
v1.5: Enhanced Benchmark for Out-of-Distribution Detection", 2023;
github.com/Jingkang50/OpenOOD), as datasets for ``protocol.ood_dataset=openood``.

The field compares OOD detectors on these image lists, so a run on them is comparable with
published AUROC / FPR95 figures. The lists (``OPENOOD_SETS``, the catalogue's ``openood``
entry): near-OOD ``ssb_hard`` and ``ninco``; far-OOD ``inaturalist``, ``textures`` and
``openimage_o``. A user downloads, with OpenOOD's ``scripts/download/download.py`` (or by
hand from the files it names):

* the image lists ``benchmark_imglist/imagenet/test_<set>.txt`` (one ``<path> <label>``
  line per image, the path relative to ``images_largescale/``, for Textures to
  ``images_classic/``), and
* the images ``images_largescale/<set>/...`` (Textures: ``images_classic/texture/...``),

and points ``--data-dir`` (or ``dataset_args.data_dir``) at the folder that holds both
(or at a folder with an ``openood`` sub-folder holding them). Every image of a set is one
"unknown" class; the list's order is kept. A list line naming a missing file is an error
naming it; a list of another length than published is a warning (a partial download).

Nothing is downloaded at run time.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from mura_plugin.datasets import _common as c
from tta_bench.data import DataInventory, DataUnavailableError, DomainStream
from tta_bench.text_head import resolve_templates

__all__ = ["OPENOOD_SETS", "openood", "read_imglist"]

#: The ImageNet-1k OOD sets of OpenOOD v1.5: ``{set: (kind, list file, image folder)}``
#: (the list's paths are relative to the image folder; Textures is a "classic" set).
OPENOOD_SETS = {
    "ssb_hard": ("near", "test_ssb_hard.txt", "images_largescale"),
    "ninco": ("near", "test_ninco.txt", "images_largescale"),
    "inaturalist": ("far", "test_inaturalist.txt", "images_largescale"),
    "textures": ("far", "test_textures.txt", "images_classic"),
    "openimage_o": ("far", "test_openimage_o.txt", "images_largescale"),
}
LIST_DIR = Path("benchmark_imglist") / "imagenet"


def _check_name(name: str) -> str:
    if name not in OPENOOD_SETS:
        raise ValueError(
            f"openood: unknown set {name!r}; available: {', '.join(OPENOOD_SETS)} "
            "(near: ssb_hard, ninco; far: inaturalist, textures, openimage_o)"
        )
    return name


def _has_lists(path: Path) -> bool:
    return (path / LIST_DIR).is_dir()


def _root(data_dir: str | None, name: str) -> Path:
    meta = c.dataset_meta("openood")
    if data_dir is None:
        raise DataUnavailableError(
            f"openood ({name}) needs --data-dir: {c.download_hint(meta, 'openood', False)}"
        )
    root = c.find_local(data_dir, meta.get("local_dirs", []), _has_lists)
    if root is None:
        raise DataUnavailableError(
            f"openood ({name}): no {LIST_DIR}/ under {data_dir!r} (or its "
            f"{', '.join(meta.get('local_dirs', []))} sub-folder); "
            + c.download_hint(meta, "openood", False)
        )
    return root


def read_imglist(path: Path) -> list[str]:
    """The image paths of an OpenOOD image list (``<path> <label>`` per line; the label, -1
    or a class index of the set's own, is not used: every image is unknown). A line without
    a path is a ``ValueError`` naming the file and line."""
    out = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) > 2:  # a path with spaces: everything before the label
            parts = [" ".join(parts[:-1]), parts[-1]]
        rel = parts[0]
        if rel.startswith("/") or ".." in Path(rel).parts:
            raise ValueError(f"{path}:{number}: the image path {rel!r} leaves the image folder")
        out.append(rel)
    return out


def _files(root: Path, name: str) -> tuple[Path, list[Path]]:
    listing = root / LIST_DIR / OPENOOD_SETS[name][1]
    if not listing.is_file():
        raise DataUnavailableError(
            f"openood ({name}): {listing} is missing; download OpenOOD's image list "
            f"{LIST_DIR / OPENOOD_SETS[name][1]}"
        )
    images = root / OPENOOD_SETS[name][2]
    files = [images / rel for rel in read_imglist(listing)]
    return listing, files


def openood(
    *,
    name: str = "ninco",
    data_dir: str | None = None,
    templates: str | None = None,
) -> DomainStream:
    """OpenOOD v1.5's OOD set ``name`` as one "unknown" class, in its list's order."""
    _check_name(name)
    root = _root(data_dir, name)
    listing, files = _files(root, name)
    missing = [f for f in files if not f.exists()]
    if missing:
        raise DataUnavailableError(
            f"openood ({name}): {len(missing)} of the {len(files)} images of {listing} are "
            f"missing under {root / OPENOOD_SETS[name][2]}, e.g. {missing[0]}"
        )
    if not files:
        raise DataUnavailableError(f"openood ({name}): {listing} lists no image")
    published = (c.dataset_meta("openood").get("published_sizes") or {}).get(name)
    c.warn_count(f"openood ({name})", listing, len(files), published)
    return DomainStream(
        name=f"openood_{name}",
        classnames=[f"unknown ({name})"],
        templates=resolve_templates(templates or "simple"),
        dataset=c.folder_dataset(files, [0] * len(files)),
        fingerprint=f"openood/{name}/{c.files_fingerprint(root, files)}",
        metadata={"source": str(root), "set": name, "kind": OPENOOD_SETS[name][0]},
    )


def _check(a: SimpleNamespace) -> None:
    _check_name(a.name)


def _inventory(a: SimpleNamespace) -> DataInventory:
    """What ``tta-bench data check`` reports for one set: where its list is, the images it
    names that are there against the published count, and those missing."""
    _check_name(a.name)
    meta = c.dataset_meta("openood")
    published = (meta.get("published_sizes") or {}).get(a.name)
    hint = c.download_hint(meta, "openood", False)
    try:
        root = _root(a.data_dir, a.name)
        listing, files = _files(root, a.name)
    except DataUnavailableError as exc:
        return DataInventory(
            domain=f"openood_{a.name}", published=published, download=hint, notes=[str(exc)]
        )
    missing = sum(not f.exists() for f in files)
    return DataInventory(
        domain=f"openood_{a.name}",
        where=str(listing),
        images=len(files) - missing,
        published=published,
        missing_files=missing,
        download=hint if missing or (published and len(files) != published) else None,
    )


c.attach_check(openood, _check)
c.attach_inventory(openood, _inventory)
