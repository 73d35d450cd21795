"""The data contract: a dataset factory returns a ``DomainStream`` (a HuggingFace
``datasets.Dataset`` with an ``image`` and a ``label`` column, plus the class names and
prompt templates), and shift kernels see float images made by ``to_float_images``.

How the images of a stream reach a method (the decoded-image cache, on-demand decoding,
the sources the loader reads) is the running room's: ``tta_bench.run.cache`` and
``tta_bench.run.sources`` (docs/design.md#data-pipeline).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = [
    "INVENTORY_STATUSES",
    "BadImageError",
    "DataInventory",
    "DataUnavailableError",
    "DomainStream",
    "to_float_images",
]


class DataUnavailableError(FileNotFoundError, ValueError):
    """The data of a domain is neither under ``--data-dir`` nor in a local cache.

    A ``ValueError`` too, so the CLI reports it as bad input (exit status 2); the message
    says what to download and where to put it."""


class BadImageError(ValueError):
    """An image file that cannot be decoded (corrupt or truncated), named by index/path."""


@dataclass
class DomainStream:
    """One test domain: images + labels, and what the text head needs to classify them."""

    name: str
    classnames: list[str]
    templates: list[str]
    dataset: Any  # datasets.Dataset with columns `image` (PIL or array) and `label` (int)
    #: Stable identity of the data (hub id, revision, split, subset); keys the decoded cache.
    fingerprint: str
    #: Images already at the model's input size must not be resized or cropped again.
    native_size: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    #: An open-set split (``tta_bench.run.openset.mix``): label -1 marks an out-of-distribution
    #: image, of none of the classes.
    open_set: bool = False

    def __post_init__(self) -> None:
        missing = {"image", "label"} - set(self.dataset.column_names)
        if missing:
            raise ValueError(
                f"dataset for domain {self.name!r} lacks column(s) {sorted(missing)}; "
                f"it has {self.dataset.column_names}"
            )
        labels = self.labels
        lowest = -1 if self.open_set else 0
        bad = np.flatnonzero((labels < lowest) | (labels >= len(self.classnames)))
        if len(bad):  # -1 of unlabeled splits, or more classes than names: never wrap around
            raise ValueError(
                f"domain {self.name!r}: {len(bad)} label(s) outside 0..{len(self.classnames) - 1} "
                f"(rows {bad[:5].tolist()}, values {labels[bad[:5]].tolist()}); an unlabeled "
                "split cannot be scored"
            )

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def labels(self) -> np.ndarray:
        """The rows' labels, in the dataset's row order (its indices mapping applied), read
        as one Arrow column: ``numpy.asarray(dataset["label"])`` reads the lazy column that
        recent ``datasets`` return a row at a time (~10x slower; every run reads them)."""
        column = self.dataset.with_format("arrow")["label"]
        if column.null_count:  # no label: the row-by-row read names the failure
            return np.asarray(self.dataset["label"], dtype=np.int64)
        return np.asarray(column.to_numpy(), dtype=np.int64)


#: What ``DataInventory.status`` can say of a domain's data: ``found`` (all there, as
#: published), ``partial`` (a subset: class folders empty or absent, listed files absent,
#: fewer images than published), ``mismatch`` (not the published data: folders of no class,
#: more images than published, a split file a run refuses), ``missing`` (nothing found),
#: ``bundled`` (shipped with a package: nothing to download).
INVENTORY_STATUSES = ("found", "partial", "mismatch", "missing", "bundled")


@dataclass
class DataInventory:
    """What a dataset factory's ``inventory`` (same keyword arguments as the factory) says of
    one domain's data, from folder listings, split files and array headers only (no image
    decoded): what ``tta-bench data check`` prints. ``status`` follows from the facts."""

    domain: str
    #: The folder or file the data was found at; None: not found.
    where: str | None = None
    #: Images found (None: not counted, e.g. a copy in the HF datasets cache).
    images: int | None = None
    #: Images of the domain as published (the catalogue's figure); None: not known.
    published: int | None = None
    #: Class folders holding no image (or links that lead to no folder).
    empty: list[str] = field(default_factory=list)
    #: Class folders the dataset has that are not there.
    absent: list[str] = field(default_factory=list)
    #: Folders that are no class of the dataset (a run refuses them).
    unknown: list[str] = field(default_factory=list)
    #: Files a split file lists that are not there.
    missing_files: int = 0
    #: Why a run refuses this data, or why it is not the published data.
    problems: list[str] = field(default_factory=list)
    #: The split file's identity (``name sha256:<12 hex>, N test``), where the layout has one.
    split_file: str | None = None
    #: What to download and where to put it (shown where the data is not complete).
    download: str | None = None
    bundled: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        """One of ``INVENTORY_STATUSES``."""
        if self.bundled:
            return "bundled"
        if self.where is None:
            return "missing"
        counted = self.images is not None and bool(self.published)
        if self.problems or self.unknown or (counted and self.images > self.published):
            return "mismatch"
        if (
            self.empty
            or self.absent
            or self.missing_files
            or (counted and self.images < self.published)
        ):
            return "partial"
        return "found"

    @property
    def complete(self) -> bool:
        """All the domain's data is there as published (or bundled)."""
        return self.status in ("found", "bundled")

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, **asdict(self)}


def to_float_images(images: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 ``[B, H, W, C]`` -> contiguous float ``[B, C, H, W]`` in [0, 1].

    One cast-and-transpose copy into the float batch, then the division in place: no
    byte-sized or float temporary besides the output (whose first touch is most of the
    conversion's time at 224 px). The values are those of ``x.float() / 255``.

    ``out``: a float32 ``[B, C, H, W]`` tensor (a slice of a larger batch, say) to write
    into and return instead of a new one; a kernel that converts a few images at a time
    thus gets the same values as the whole batch's conversion."""
    import torch

    from tta_bench.buffers import batch_buffer

    b, h, w, c = images.shape
    if out is None:  # recycled from batch to batch when large (tta_bench.buffers)
        out = batch_buffer((b, c, h, w), torch.float32, images.device)
    elif out.shape != (b, c, h, w) or out.dtype != torch.float32:
        raise ValueError(
            f"to_float_images: out must be float32 of shape {(b, c, h, w)}, "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    return out.copy_(images.permute(0, 3, 1, 2)).div_(255.0)
