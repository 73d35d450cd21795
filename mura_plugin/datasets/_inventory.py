"""What the dataset modules' ``inventory`` functions share (``tta-bench data check``): the
``DataInventory`` of a class-folder tree, of a local HF copy, of a set found nowhere; a
split file's identity; whether a hub dataset is in the local HF caches. Everything here
reads folder listings, file headers and split files only, never an image.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mura_plugin.datasets import _common as c
from tta_bench.data import DataInventory, DataUnavailableError
from tta_bench.paths import file_sha256

__all__ = [
    "file_digest",
    "hf_copy",
    "hub_cache",
    "named_folder",
    "not_found",
    "tree",
]


def file_digest(path: Path) -> str:
    """``sha256:<first 12 hex digits>`` of the file's bytes: the version of a split file."""
    return f"sha256:{file_sha256(path)[:12]}"


def tree(domain: str, scan: c.ClassTree, published: int | None, download: str) -> DataInventory:
    """A class-folder tree's inventory: images counted, class folders empty, absent and
    unknown named; a tree with no image at all is missing (a run finds no data there)."""
    if scan.count == 0:
        return not_found(domain, published, download, f"{scan.root} holds no image file")
    unknown = scan.unknown
    problems = []
    if unknown:
        problems.append(
            f"{len(unknown)} folder(s) under {scan.root} are no class of {domain}, e.g. "
            f"{', '.join(unknown[:5])}: a run refuses the tree"
        )
    return DataInventory(
        domain,
        where=str(scan.root),
        images=scan.count,
        published=published,
        empty=scan.empty,
        absent=scan.absent,
        unknown=unknown,
        problems=problems,
        download=download,
    )


def named_folder(data_dir: Any, local_dirs: Sequence[str]) -> Path | None:
    """The first ``data_dir/<local dir>`` folder that exists, for a set whose loader did not
    recognise it (its folders are not the set's classes): the inventory says why."""
    if data_dir is None:
        return None
    for name in local_dirs:
        path = Path(data_dir).expanduser() / name
        if path.is_dir():
            return path.resolve()
    return None


def hf_copy(
    domain: str, path: Path, split: str | None, published: int | None, download: str
) -> DataInventory:
    """A local HF copy's inventory: the rows of ``split`` from the parquet files' footers or
    the ``save_to_disk`` metadata (no image read)."""
    found = DataInventory(domain, where=str(path), published=published, download=download)
    try:
        found.images = _hf_copy_rows(path, split, domain)
    except (ValueError, OSError) as exc:  # DataUnavailableError is both
        found.problems.append(str(exc))
    found.notes.append(f"a local HF copy (split {split})" if split else "a local HF copy")
    return found


def _hf_copy_rows(path: Path, split: str | None, what: str) -> int:
    if (path / "state.json").exists() or (path / "dataset_dict.json").exists():
        import datasets

        ds = datasets.load_from_disk(str(path))  # memory-mapped: nothing decoded
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataUnavailableError(f"{path} has splits {list(ds)}, not {split!r}")
            return len(ds[split])
        return len(ds)
    import pyarrow.parquet as pq

    files = c.select_split(path, c.parquet_files(path), split, what)
    return sum(pq.ParquetFile(f).metadata.num_rows for f in files)


def hub_cache(hub_id: str | None) -> Path | None:
    """The folder of ``hub_id`` in the local HF caches (the hub's files, or the ``datasets``
    cache's prepared copy), where a run loads it from without --data-dir; None: neither."""
    if not hub_id:
        return None
    import datasets.config
    from huggingface_hub import constants

    for folder in (
        Path(constants.HF_HUB_CACHE) / f"datasets--{hub_id.replace('/', '--')}",
        Path(datasets.config.HF_DATASETS_CACHE) / hub_id.replace("/", "___"),
    ):
        if folder.is_dir():
            return folder
    return None


def not_found(
    domain: str, published: int | None, download: str, *notes: str, hub_id: str | None = None
) -> DataInventory:
    """A domain found neither under --data-dir nor (``hub_id``) in the local HF caches; a
    hub dataset that is cached is found there (not counted)."""
    cached = hub_cache(hub_id)
    if cached is not None:
        return DataInventory(
            domain,
            where=str(cached),
            published=published,
            notes=[*notes, f"the HF hub dataset {hub_id} from the local cache (not counted)"],
        )
    return DataInventory(domain, published=published, download=download, notes=list(notes))
