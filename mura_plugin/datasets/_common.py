"""Shared loading rules for the hub-backed dataset factories.

Loading order for every hub-backed set: (1) ``data_dir``: local files in the published
layout (found under one of the catalogue's ``local_dirs`` below ``data_dir``, or ``data_dir``
itself), or a local HF copy (a ``save_to_disk`` directory, or parquet files of which only
those the hub's naming gives the requested split are read: ``select_split``); (2) the HF hub id
through the ``datasets`` cache, which works offline only if the set is already cached.
With neither, ``DataUnavailableError`` says what to download and where to point
``--data-dir``; nothing is written anywhere.

Class names, WordNet ids, templates, hub ids and column names come from the catalogue
(``registry.yaml``: ``datasets:`` and ``templates:``).
"""

from __future__ import annotations

import hashlib
import inspect
import os
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from tta_bench.catalog import entry
from tta_bench.data import DataInventory, DataUnavailableError

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


#: The split names ``datasets`` infers from file and folder names, with their aliases
#: (``datasets.data_files.SPLIT_KEYWORDS``); other names only from ``data/<split>-NNNNN-of-NNNNN``.
SPLIT_KEYWORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "dev", "val"),
    "test": ("test", "testing", "eval", "evaluation"),
}
_SEP = "[-._ 0-9]"  # what may border a split keyword in a name (datasets' NON_WORDS_CHARS)
_SHARDED = re.compile(r"data/(?P<split>[^/]+?)-[0-9]{5}-of-[0-9]{5}[^/]*\.[^/]*")
_SPLIT_NAME = re.compile(r"\w+(\.\w+)*")
_IN_DIR = {
    s: re.compile(f"(.*{_SEP})?({'|'.join(k)})({_SEP}.*)?") for s, k in SPLIT_KEYWORDS.items()
}
_IN_FILE = {s: re.compile(f"(.*{_SEP})?({'|'.join(k)}){_SEP}.*") for s, k in SPLIT_KEYWORDS.items()}


def _split_order(split: str) -> tuple[int, str]:
    """train, validation, test first (as ``datasets`` orders them), then by name."""
    return (list(SPLIT_KEYWORDS).index(split) if split in SPLIT_KEYWORDS else 3, split)


def canonical_split(split: str) -> str:
    """``val`` -> ``validation``, ``eval`` -> ``test``, ...; other names as they are."""
    return next((s for s, k in SPLIT_KEYWORDS.items() if split in k), split)


def _iter_parquet(root: Path) -> Iterator[Path]:
    for f in root.rglob("*.parquet"):
        if not any(part.startswith((".", "__")) for part in f.relative_to(root).parts):
            yield f


def parquet_files(root: Path) -> list[Path]:
    """The ``.parquet`` files under ``root``, sorted, without hidden or ``__*`` folders (as
    ``datasets`` globs them: ``.cache/`` of a ``huggingface-cli download`` is not data)."""
    return sorted(_iter_parquet(root))


def files_by_split(root: Path, files: Sequence[Path]) -> dict[str, list[Path]]:
    """The split each of ``files`` belongs to by the hub's naming convention, the rules
    ``datasets`` infers splits with (``datasets.data_files``), first rule that names any file
    wins: (1) ``data/<split>-NNNNN-of-NNNNN*.*`` (any split name); (2) a folder at any depth
    named for a split keyword, alone or bordered by ``-._ 0-9`` (``test/``, ``val_2/``);
    (3) a file name starting with, or bordering, a keyword (``test.parquet``,
    ``cifar10_test-00000.parquet``). Never by substring: ``trainval``, ``pretrained/`` and
    ``latest`` name no split. Files no rule names are left out; none named: ``{}``."""
    rel = {f: f.relative_to(root).as_posix() for f in files}
    sharded: dict[str, list[Path]] = {}
    for f, r in rel.items():
        m = _SHARDED.fullmatch(r)
        if m and _SPLIT_NAME.fullmatch(m["split"]):
            sharded.setdefault(m["split"], []).append(f)
    if sharded:
        return dict(sorted(sharded.items(), key=lambda kv: _split_order(kv[0])))
    for rule, match in (
        (_IN_DIR, lambda f, pat: any(pat.fullmatch(d) for d in f.relative_to(root).parts[:-1])),
        (_IN_FILE, lambda f, pat: bool(pat.fullmatch(f.name))),
    ):
        found = {s: [f for f in files if match(f, pat)] for s, pat in rule.items()}
        found = {s: fs for s, fs in found.items() if fs}
        if found:
            return found
    return {}


def select_split(root: Path, files: Sequence[Path], split: str | None, what: str) -> list[Path]:
    """The files of ``split`` among ``files`` (all under the folder ``root``), by
    ``files_by_split``. ``split=None``: all files if they name at most one split, else an
    error; a split no file is named for is an error listing the files and named splits."""
    by_split = files_by_split(root, files)
    named = sorted({f for fs in by_split.values() for f in fs})

    def found() -> str:
        shown = ", ".join(f.relative_to(root).as_posix() for f in files[:8])
        more = f" and {len(files) - 8} more" if len(files) > 8 else ""
        counts = ", ".join(
            f"{s} ({len(fs)} file{'s' * (len(fs) != 1)})" for s, fs in by_split.items()
        )
        return f"splits identified: {counts or 'none'}; files found ({len(files)}): {shown}{more}"

    if split is None:
        if not by_split or (len(by_split) == 1 and len(named) == len(files)):
            return list(files)
        raise DataUnavailableError(
            f"{what}: {root} holds files of several splits ({', '.join(by_split)}) or files "
            f"named for no split; choose one with split=<name> ({found()})"
        )
    aliases = "; ".join(f"{s}: {', '.join(k)}" for s, k in SPLIT_KEYWORDS.items())
    want = canonical_split(split)
    chosen = [fs for s, fs in by_split.items() if canonical_split(s) == want]
    if not chosen:
        raise DataUnavailableError(
            f"{what}: no parquet file under {root} is named for split {split!r} ({found()}). "
            f"Name them by the hub convention: data/{split}-00000-of-00001.parquet, "
            f"{split}/*.parquet or {split}.parquet (at any depth; {split}-*.parquet or "
            f"*_{split}.parquet too); split aliases: {aliases}"
        )
    picked = sorted({f for fs in chosen for f in fs})
    twice = [f for f in picked if sum(f in fs for fs in by_split.values()) > 1]
    if twice:
        raise DataUnavailableError(
            f"{what}: {twice[0].relative_to(root).as_posix()} is named for several splits "
            f"({', '.join(s for s, fs in by_split.items() if twice[0] in fs)}); rename it"
        )
    return picked


def is_hf_copy(path: Path) -> bool:
    """A ``save_to_disk`` directory (of a Dataset or DatasetDict) or a tree of parquet files."""
    return (
        (path / "state.json").exists()
        or (path / "dataset_dict.json").exists()
        or next(_iter_parquet(path), None) is not None
    )


def load_hf_copy(path: Path, split: str | None, what: str) -> tuple[Any, list[Path]]:
    """``(dataset, files)`` of a local HF copy: ``save_to_disk`` output (a DatasetDict's
    ``split``; a Dataset saved from another split is an error) or the parquet files of
    ``split`` by the hub's naming (``select_split``); ``files``: the files read (for
    fingerprints and provenance)."""
    import datasets

    if (path / "state.json").exists() or (path / "dataset_dict.json").exists():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataUnavailableError(
                    f"{what}: local copy {path} has splits {list(ds)}, not {split!r}"
                )
            return ds[split], sorted(Path(f["filename"]) for f in ds[split].cache_files)
        # A saved Dataset records its split; "train" is also what every Dataset.from_* and
        # .select() records by default, so only another split's name is proof of a mix-up.
        saved = str(ds.split) if ds.split is not None else None
        if split and saved and canonical_split(saved) != canonical_split(split):
            msg = f"{what}: local copy {path} is the saved split {saved!r}, not {split!r}"
            if canonical_split(saved) != "train":
                raise DataUnavailableError(msg)
            warnings.warn(
                f"{msg} (or a Dataset built locally, which records 'train' by default): "
                "check that it holds the right split",
                stacklevel=3,
            )
        return ds, sorted(Path(f["filename"]) for f in ds.cache_files)
    files = select_split(path, parquet_files(path), split, what)
    return datasets.Dataset.from_parquet([str(f) for f in files]), files


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


def is_broken_link(path: Path) -> bool:
    """Whether ``path`` is a symbolic link that leads to nothing: dangling (its target, or
    a link further along, does not exist) or in a loop."""
    return os.path.islink(path) and not os.path.exists(path)


def _listed_image(entry: os.DirEntry[str]) -> bool:
    """Whether a folder entry is listed as an image: named with an image extension, and a
    file or a link that leads to no file (dangling or in a loop; it is a bad image, left
    to the run's ``--on-bad-image`` policy, never dropped here). A folder, or a link to
    one, is not."""
    if not entry.name.lower().endswith(IMAGE_EXTENSIONS):
        return False
    try:
        if entry.is_file():
            return True
    except OSError:  # a link loop (ELOOP), a target that cannot be looked at: unreadable
        return True
    return entry.is_symlink() and is_broken_link(Path(entry.path))


def list_images(folder: Path) -> list[Path]:
    """Image files directly in ``folder``, sorted by name (deterministic order); links named
    like images that lead to no file (dangling or in a loop) are listed too: the decoder
    reports them as unreadable images, which the bad-image policy skips or fails on."""
    with os.scandir(folder) as it:
        files = [Path(e.path) for e in it if _listed_image(e)]
    return sorted(files, key=lambda p: p.name)


def _is_folder(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()
    except OSError:  # a link loop: leads to no folder
        return False


def class_folders(root: Path) -> list[str]:
    """The non-hidden sub-folders of ``root`` (links to folders included), sorted by name.
    A link that leads nowhere (dangling or in a loop) is none: ``broken_links`` names it."""
    with os.scandir(root) as it:
        return sorted(e.name for e in it if not e.name.startswith(".") and _is_folder(e))


def broken_links(root: Path) -> list[str]:
    """The non-hidden entries of ``root`` that are links leading nowhere (``is_broken_link``),
    sorted: in a class-folder tree, most likely class folders that moved."""
    with os.scandir(root) as it:
        return sorted(
            e.name
            for e in it
            if not e.name.startswith(".") and e.is_symlink() and is_broken_link(Path(e.path))
        )


@dataclass
class ClassTree:
    """The class folders of a tree ``root/<class>/<image>``: each folder's image files
    (``list_images``), the links in ``root`` that lead nowhere, and the class folders the
    dataset has (``expected``; None: any folder is a class)."""

    root: Path
    images: dict[str, list[Path]]
    broken: list[str]
    expected: tuple[str, ...] | None = None

    @property
    def count(self) -> int:
        return sum(len(files) for files in self.images.values())

    @property
    def empty(self) -> list[str]:
        """Class folders with no image file, then the links that lead to no folder."""
        named = [f for f, files in self.images.items() if not files and f not in self.unknown]
        return [*named, *(f"{b} (a symbolic link that leads to no folder)" for b in self.broken)]

    @property
    def absent(self) -> list[str]:
        """Classes of the dataset with no folder (a link that leads nowhere is empty)."""
        if self.expected is None:
            return []
        there = {*self.images, *self.broken}
        return [e for e in self.expected if e not in there]

    @property
    def unknown(self) -> list[str]:
        """Folders that are no class of the dataset."""
        if self.expected is None:
            return []
        known = set(self.expected)
        return [f for f in self.images if f not in known]


def scan_tree(root: Path, expected: Sequence[str] | None = None) -> ClassTree:
    """``root``'s class folders (``class_folders``, sorted by name) with their images."""
    images = {folder: list_images(root / folder) for folder in class_folders(root)}
    return ClassTree(root, images, broken_links(root), tuple(expected) if expected else None)


def _named(names: Sequence[str]) -> str:
    more = f" and {len(names) - 10} more" if len(names) > 10 else ""
    return ", ".join(names[:10]) + more


def partial_message(tree: ClassTree, what: str, published: int | None = None) -> str | None:
    """Why the images of ``tree`` are not the whole published set (class folders empty or
    absent, fewer or more images than ``published``), naming the folders; None: they are."""
    parts = []
    if tree.empty:
        parts.append(
            f"{len(tree.empty)} class folder(s) under {tree.root} hold no image file: "
            f"{_named(tree.empty)}"
        )
    if tree.absent:
        under = "" if tree.empty else f" under {tree.root}"
        parts.append(
            f"{len(tree.absent)} of the {len(tree.expected or ())} class folders are "
            f"missing{under}: {_named(tree.absent)}"
        )
    if published and tree.count != published:
        under = "" if parts else f" under {tree.root}"
        parts.append(f"{tree.count:,} image(s){under} where the published set has {published:,}")
    if not parts:
        return None
    return f"{what}: {'; '.join(parts)}; " + _why(
        bool(tree.empty or tree.absent) or tree.count < (published or 0)
    )


def _why(partial: bool) -> str:
    if partial:
        return (
            "the run's data is partial (those classes or images are never tested, so its "
            "scores are not those of the full set)"
        )
    return "the run's data is not the published set (another release, or files added)"


def warn_partial(tree: ClassTree, what: str, published: int | None = None) -> None:
    """One ``UserWarning`` with ``partial_message`` (``what`` names the set); nothing when
    the tree holds the whole published set. ``tta-bench data check`` lists the same."""
    message = partial_message(tree, what, published)
    if message is not None:
        # the factory's line: a split built twice (an ad-hoc suite) warns once
        warnings.warn(message, stacklevel=2)


def warn_count(what: str, where: Any, count: int, published: int | None) -> None:
    """A ``UserWarning`` when a set read whole (an HF copy, a split file's list) holds
    another number of images than the ``published`` one; nothing when it does not."""
    if published and count != published:
        warnings.warn(
            f"{what}: {count:,} image(s) in {where} where the published set has "
            f"{published:,}; {_why(count < published)}",
            stacklevel=3,
        )


def folder_dataset(files: Sequence[Path], labels: Sequence[int]) -> Any:
    """A ``datasets.Dataset`` over image files (decoded lazily) with int labels."""
    import datasets

    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    return datasets.Dataset.from_dict(
        {"image": [str(f) for f in files], "label": [int(y) for y in labels]}, features=features
    )


def files_fingerprint(root: Path, files: Sequence[Path]) -> str:
    """Identity of local files: their paths relative to ``root`` and sizes (a changed or
    replaced file changes the decoded-cache key; an unreadable one, a dangling link say,
    counts as ``unreadable``)."""
    h = hashlib.sha256(str(root).encode())
    for f in files:
        h.update(f"{f.relative_to(root)}:{_size(f)};".encode())
    return h.hexdigest()[:16]


def _size(file: Path) -> int | str:
    """The byte size of ``file``; ``"unreadable"`` for a link that leads to no file (a bad
    image the run reports; listed all the same)."""
    try:
        return file.stat().st_size
    except OSError:
        return "unreadable"


def check_labels(labels: Any, num_classes: int, what: str) -> np.ndarray:
    """``labels`` as int64, each a class index ``0 <= y < num_classes``; anything else (the
    ``-1`` of an unlabeled split, an index past the class list, non-integers) is a
    ``ValueError`` naming how many and which rows, never a wrap-around to the last class."""
    arr = np.asarray(labels)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what}: labels must be integer class indices, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False).reshape(-1)
    bad = np.flatnonzero((arr < 0) | (arr >= num_classes))
    if bad.size:
        shown = ", ".join(f"row {i}: {arr[i]}" for i in bad[:5])
        more = f" and {bad.size - 5} more" if bad.size > 5 else ""
        unlabeled = (
            "; -1 marks an unlabeled split (e.g. the hub's ImageNet-1k test split): "
            "evaluate a labeled split"
            if (arr[bad] == -1).any()
            else ""
        )
        raise ValueError(
            f"{what}: {bad.size} of {arr.size} label(s) outside 0..{num_classes - 1} "
            f"({num_classes} classes), e.g. {shown}{more}{unlabeled}"
        )
    return arr


def normalize(
    ds: Any,
    image_column: str,
    label_column: str,
    label_kind: str,
    *,
    num_classes: int,
    what: str,
    wnids: Sequence[str] | None = None,
) -> Any:
    """Keep the image and label columns, named ``image``/``label``, labels mapped to
    0..C-1 in the order of ``wnids`` (``label_kind``: ``index`` = already 0..C-1 with
    C = ``num_classes``; ``imagenet_index`` = 0..999 ImageNet indices; ``wnid`` = WordNet id
    strings). Labels that name no class are a ``ValueError`` (``check_labels``); ``what``
    names the source in messages."""
    for col in (image_column, label_column):
        if col not in ds.column_names:
            raise ValueError(f"{what}: column {col!r} not in the dataset; it has {ds.column_names}")
    if label_kind not in LABEL_KINDS:
        raise ValueError(f"unknown label_kind {label_kind!r}; available: {LABEL_KINDS}")
    raw = ds[label_column]
    where = f"{what} (column {label_column!r})"
    if label_kind == "index":
        labels = check_labels(raw, num_classes, where)
    else:
        if wnids is None:
            raise ValueError(f"label_kind {label_kind!r} needs the class wnids")
        pos = {w: i for i, w in enumerate(wnids)}
        if label_kind == "imagenet_index":
            all_wnids = imagenet_wnids()
            keys = [all_wnids[y] for y in check_labels(raw, len(all_wnids), where)]
        else:
            keys = raw
        unknown = sorted({k for k in keys if k not in pos})
        if unknown:
            raise ValueError(
                f"{where}: {len(unknown)} label(s) outside the class list, e.g. {unknown[:5]}"
            )
        labels = np.asarray([pos[k] for k in keys], dtype=np.int64)
    ds = ds.select_columns([image_column])
    if image_column != "image":
        ds = ds.rename_column(image_column, "image")
    return ds.add_column("label", labels.tolist())


def unavailable_message(
    title: str, meta: dict[str, Any], data_dir: Any, layout: str, hf_copy: bool = True
) -> str:
    """What to download and where to put it (``hf_copy``: a save_to_disk / parquet copy is
    read too)."""
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
    return " ".join(parts) + ". " + download_hint(meta, layout, hf_copy)


def download_hint(meta: dict[str, Any], layout: str, hf_copy: bool = True) -> str:
    """The catalogue's download source of a set and where its files go under --data-dir."""
    where = ", ".join(f"<data-dir>/{d}" for d in meta.get("local_dirs", [])) or "<data-dir>"
    msg = ""
    if meta.get("download"):
        msg += f"Download {meta['download']}"
        msg += f" or the hub dataset {meta['hub_id']}" if meta.get("hub_id") else ""
        msg += "; "
    elif meta.get("hub_id"):
        msg += (
            f"Download the hub dataset {meta['hub_id']} (datasets.load_dataset) on a machine "
            "with network; "
        )
    copy = " (or a save_to_disk/parquet copy)" if hf_copy else ""
    return (
        msg
        + f"put it at one of {where} in the layout {layout}{copy} and pass --data-dir <data-dir>."
    )


def attach_check(factory: Callable[..., Any], check: Callable[[SimpleNamespace], None]) -> None:
    """Give ``factory`` its ``check_args`` (the harness calls it before any setup, with the
    factory's keyword arguments): ``check`` gets those arguments as a namespace, defaults
    applied and a required one not given as None; an unknown keyword raises ``TypeError``
    as the factory would. ``check`` raises what the factory would (``ValueError`` /
    ``DataUnavailableError``) and reads no image."""
    factory.check_args = _keyword_entry(factory, check, "check_args", None)  # type: ignore[attr-defined]


def attach_inventory(
    factory: Callable[..., Any], inventory: Callable[[SimpleNamespace], DataInventory]
) -> None:
    """Give ``factory`` its ``inventory`` (``tta-bench data check`` calls it with the
    factory's keyword arguments, as ``attach_check``'s): ``inventory`` returns the
    ``DataInventory`` of that domain from folder listings and split files, decoding no
    image, and reports what is wrong rather than raising."""
    factory.inventory = _keyword_entry(factory, inventory, "inventory", DataInventory)  # type: ignore[attr-defined]


def _keyword_entry(
    factory: Callable[..., Any], fn: Callable[[SimpleNamespace], Any], name: str, returns: Any
) -> Any:
    """``factory.<name>``: a function of ``factory``'s keywords (every default None where the
    factory has none) that calls ``fn`` with them as a namespace, defaults applied."""
    signature = inspect.signature(factory)

    def call(**kwargs: Any) -> Any:
        bound = signature.bind_partial(**kwargs)
        bound.apply_defaults()
        return fn(SimpleNamespace(**{**dict.fromkeys(signature.parameters), **bound.arguments}))

    call.__name__ = call.__qualname__ = name
    call.__doc__ = fn.__doc__
    call.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[
            p.replace(default=None) if p.default is p.empty else p
            for p in signature.parameters.values()
        ],
        return_annotation=returns,
    )
    return call
