"""The data contract: a dataset factory returns a ``DomainStream`` (a HuggingFace
``datasets.Dataset`` with an ``image`` and a ``label`` column, plus the class names and
prompt templates), and shift kernels see float images made by ``to_float_images``.

How the images of a stream reach a method (the decoded-image cache, on-demand decoding,
the sources the loader reads) is the running room's: ``tta_bench.run.cache`` and
``tta_bench.run.sources`` (docs/design.md#data-pipeline).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["BadImageError", "DataUnavailableError", "DomainStream", "to_float_images"]


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
        return np.asarray(self.dataset["label"], dtype=np.int64)


def to_float_images(images: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 ``[B, H, W, C]`` -> contiguous float ``[B, C, H, W]`` in [0, 1].

    One cast-and-transpose copy into the float batch, then the division in place: no
    byte-sized or float temporary besides the output (whose first touch is most of the
    conversion's time at 224 px). The values are those of ``x.float() / 255``.

    ``out``: a float32 ``[B, C, H, W]`` tensor (a slice of a larger batch, say) to write
    into and return instead of a new one; a kernel that converts a few images at a time
    thus gets the same values as the whole batch's conversion."""
    import torch

    b, h, w, c = images.shape
    if out is None:
        out = torch.empty((b, c, h, w), device=images.device, dtype=torch.float32)
    elif out.shape != (b, c, h, w) or out.dtype != torch.float32:
        raise ValueError(
            f"to_float_images: out must be float32 of shape {(b, c, h, w)}, "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    return out.copy_(images.permute(0, 3, 1, 2)).div_(255.0)
