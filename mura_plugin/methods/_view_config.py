"""The view fields of the configs of every method that builds views, declared once
(``ViewFields``), and the view settings of the methods whose original image is always
view 0 (``original_first``)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from mura_plugin.methods._view_budget import VIEW_MEMORY_MB
from tta_bench.bounds import bounded

__all__ = ["ViewFields", "original_first"]


@dataclass
class ViewFields:
    """The crop, flip and chunking fields a view-building config inherits (its own fields
    say how many views, and whether AugMix)."""

    #: ``view_memory_mb`` changes no cell: left out of the run key at its default.
    hash_omit_at_default = ("view_memory_mb",)

    # RandomResizedCrop's default lower area bound
    crop_scale_min: float = bounded(0.08, gt=0, le=1)
    flip: bool = True
    # views per forward of the image tower: chunks that fit the CPU caches run ~2x faster
    # than one huge batch (the gradient methods accumulate the chunks' gradients)
    chunk_views: int = bounded(256, ge=1)
    # The views of a batch are built and encoded in chunks of whole images whose rendered
    # views take at most this many MB (``image_chunks``); the cells do not depend on it.
    view_memory_mb: float = bounded(VIEW_MEMORY_MB, gt=0)


def original_first(cfg: Any, views: int, augmix: bool) -> SimpleNamespace:
    """``configured_views``' fields for the original (always view 0) and ``views``
    augmented views with ``cfg``'s crop and flip (``augmix``: AugMix each crop)."""
    return SimpleNamespace(
        views=views,
        include_original=True,
        crop_scale_min=cfg.crop_scale_min,
        flip=cfg.flip,
        augmix=augmix,
    )
