"""Any local dataset: an image-folder tree or parquet files, class names given in config.

``imagefolder``: ``<data_dir>/<class>/*.jpg``; labels follow the sorted folder names (the
HF ``imagefolder`` convention); ``classnames`` (in that order) are what the prompts say,
default: the folder names with ``_`` read as spaces.
``parquet``: files with an image column (HF ``Image`` struct or encoded bytes) and an
integer label column 0..C-1 naming ``classnames[label]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mura_plugin.datasets import _common as c
from tta_bench.data import DataUnavailableError, DomainStream

__all__ = ["imagefolder", "parquet"]


def _root(data_dir: str | None, what: str) -> Path:
    if data_dir is None:
        raise DataUnavailableError(f"{what} needs --data-dir (or dataset_args.data_dir)")
    root = Path(data_dir).expanduser().resolve()
    if not root.exists():
        raise DataUnavailableError(f"{what}: {root} does not exist")
    return root


def imagefolder(
    *,
    data_dir: str | None = None,
    classnames: Sequence[str] | None = None,
    templates: str | Sequence[str] | None = None,
    name: str = "imagefolder",
) -> DomainStream:
    """A local image-folder tree as a ``DomainStream``."""
    root = _root(data_dir, "imagefolder")
    folders = c.class_folders(root)
    if not folders:
        raise DataUnavailableError(f"imagefolder: {root} has no class sub-folders")
    names = list(classnames) if classnames is not None else [f.replace("_", " ") for f in folders]
    if len(names) != len(folders):
        raise ValueError(
            f"imagefolder: {len(names)} class names for {len(folders)} folders {folders[:10]}"
        )
    files: list[Path] = []
    labels: list[int] = []
    for i, folder in enumerate(folders):
        found = c.list_images(root / folder)
        files += found
        labels += [i] * len(found)
    if not files:
        raise DataUnavailableError(f"imagefolder: no image files under {root}/<class>/")
    return DomainStream(
        name=name,
        classnames=names,
        templates=c.templates(templates or c.dataset_meta("imagefolder")["templates"]),
        dataset=c.folder_dataset(files, labels),
        fingerprint=f"imagefolder/{c.files_fingerprint(root, files)}",
        metadata={"source": str(root), "folders": folders},
    )


def parquet(
    *,
    data_dir: str | None = None,
    classnames: Sequence[str],
    image_column: str = "image",
    label_column: str = "label",
    split: str | None = None,
    templates: str | Sequence[str] | None = None,
    name: str = "parquet",
) -> DomainStream:
    """Local parquet file(s) (``data_dir`` = a file or a folder of them) as a stream."""
    import datasets

    root = _root(data_dir, "parquet")
    files = [root] if root.is_file() else sorted(root.rglob("*.parquet"))
    if split is not None and root.is_dir():
        files = [f for f in files if split in f.relative_to(root).parts[0]] or files
    if not files:
        raise DataUnavailableError(f"parquet: no .parquet files under {root}")
    raw = datasets.Dataset.from_parquet([str(f) for f in files])
    if not isinstance(raw.features.get(image_column), datasets.Image):
        raw = raw.cast_column(image_column, datasets.Image())
    ds = c.normalize(raw, image_column, label_column, "index")
    labels = ds["label"]
    if labels and (min(labels) < 0 or max(labels) >= len(classnames)):
        raise ValueError(
            f"parquet: labels span {min(labels)}..{max(labels)} but {len(classnames)} class names"
        )
    fp_root = root.parent if root.is_file() else root
    return DomainStream(
        name=name,
        classnames=list(classnames),
        templates=c.templates(templates or c.dataset_meta("parquet")["templates"]),
        dataset=ds,
        fingerprint=f"parquet/{c.files_fingerprint(fp_root, files)}/{image_column}/{label_column}",
        metadata={"source": str(root)},
    )
