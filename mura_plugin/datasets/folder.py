"""Any local dataset: an image-folder tree or parquet files.

``imagefolder``: ``<data_dir>/<class>/*.jpg``; labels follow the sorted folder names (the
HF ``imagefolder`` convention); ``classnames`` (in that order) are what the prompts say,
default: the folder names with ``_`` read as spaces.
``parquet``: files with an image column (HF ``Image`` struct or encoded bytes) and an
integer label column 0..C-1 naming ``classnames[label]``; default: the label column's own
class names, when it is an HF ``ClassLabel``.

Both run without a suite: ``tta-bench run --dataset imagefolder dataset.path=DIR`` (the
harness maps ``dataset.path`` to ``data_dir``; docs/cli.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

from mura_plugin.datasets import _common as c
from tta_bench.data import DataUnavailableError, DomainStream
from tta_bench.text_head import resolve_templates

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
    """A local image-folder tree as a ``DomainStream``: one class per sub-folder (sorted by
    name), its images every image file in it (a link that leads to no file included: a bad
    image for the run's policy). A class folder without images, or a link beside them that
    leads nowhere, is a warning that the data is partial."""
    root = _root(data_dir, "imagefolder")
    scan = c.scan_tree(root)
    folders = list(scan.images)
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
        files += scan.images[folder]
        labels += [i] * len(scan.images[folder])
    if not files:
        raise DataUnavailableError(f"imagefolder: no image files under {root}/<class>/")
    c.warn_partial(scan, "imagefolder")
    return DomainStream(
        name=name,
        classnames=names,
        templates=resolve_templates(templates or c.dataset_meta("imagefolder")["templates"]),
        dataset=c.folder_dataset(files, labels),
        fingerprint=f"imagefolder/{c.files_fingerprint(root, files)}",
        metadata={"source": str(root), "folders": folders},
    )


def _parquet_files(root: Path, split: str | None) -> tuple[Path, list[Path]]:
    """``(folder the files are relative to, files of split)``: a file named explicitly is
    used as is unless its name says it is another split; a folder's files are chosen by
    the hub's naming (``select_split``)."""
    if root.is_file():
        named = c.files_by_split(root.parent, [root])
        want = c.canonical_split(split) if split is not None else None
        if want and named and all(c.canonical_split(s) != want for s in named):
            raise DataUnavailableError(
                f"parquet: {root} is named for split {', '.join(map(repr, named))}, not {split!r}"
            )
        return root.parent, [root]
    files = c.parquet_files(root)
    if not files:
        raise DataUnavailableError(f"parquet: no .parquet files under {root}")
    return root, c.select_split(root, files, split, "parquet")


def parquet(
    *,
    data_dir: str | None = None,
    classnames: Sequence[str] | None = None,
    image_column: str = "image",
    label_column: str = "label",
    split: str | None = None,
    templates: str | Sequence[str] | None = None,
    name: str = "parquet",
) -> DomainStream:
    """Local parquet file(s) (``data_dir`` = a file or a folder of them) as a stream;
    ``split`` picks the files named for it by the hub's convention (``train-00000-of-00001``,
    ``test/``, ``validation.parquet``, ...); ``None``: all files, if they are of one split.
    ``classnames``: default the label column's ``ClassLabel`` names; without them, an error
    asking for ``classnames``."""
    import datasets

    base, files = _parquet_files(_root(data_dir, "parquet"), split)
    raw = datasets.Dataset.from_parquet([str(f) for f in files])
    if classnames is None:
        feature = raw.features.get(label_column)
        if not isinstance(feature, datasets.ClassLabel):
            raise ValueError(
                f"parquet {base}: column {label_column!r} holds no class names (not an HF "
                "ClassLabel); give classnames (dataset.classnames=[...]) in label order"
            )
        classnames = list(feature.names)
    if image_column in raw.column_names and not isinstance(
        raw.features[image_column], datasets.Image
    ):
        raw = raw.cast_column(image_column, datasets.Image())
    ds = c.normalize(
        raw,
        image_column,
        label_column,
        "index",
        num_classes=len(classnames),
        what=f"parquet {base} ({len(classnames)} class names)",
    )
    return DomainStream(
        name=name,
        classnames=list(classnames),
        templates=resolve_templates(templates or c.dataset_meta("parquet")["templates"]),
        dataset=ds,
        fingerprint=f"parquet/{c.files_fingerprint(base, files)}/{image_column}/{label_column}",
        metadata={
            "source": str(base),
            "split": split,
            "files": [f.relative_to(base).as_posix() for f in files],
        },
    )


def _imagefolder_check(a: SimpleNamespace) -> None:
    """Before any setup: ``data_dir`` has class sub-folders, as many as ``classnames``, and
    the templates are valid (no image is listed or read)."""
    root = _root(a.data_dir, "imagefolder")
    folders = c.class_folders(root) if root.is_dir() else []
    if not folders:
        raise DataUnavailableError(f"imagefolder: {root} has no class sub-folders")
    if a.classnames is not None and len(a.classnames) != len(folders):
        raise ValueError(
            f"imagefolder: {len(a.classnames)} class names for {len(folders)} folders "
            f"{folders[:10]}"
        )
    resolve_templates(a.templates or c.dataset_meta("imagefolder")["templates"])


def _parquet_check(a: SimpleNamespace) -> None:
    """Before any setup: ``data_dir`` holds parquet files of ``split`` and the templates are
    valid (no file is read)."""
    _parquet_files(_root(a.data_dir, "parquet"), a.split)
    resolve_templates(a.templates or c.dataset_meta("parquet")["templates"])


c.attach_check(imagefolder, _imagefolder_check)
c.attach_check(parquet, _parquet_check)
