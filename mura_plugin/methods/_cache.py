"""The per-class feature cache of TDA, shared with DPE and BoostAdapter: a fixed number of
slots per class holding (feature, entropy, value), the lowest-entropy entries kept, with
the official code's tie and eviction order (see ``EntropyCache``); and the fields of TDA's
two caches that BoostAdapter's config declares too (``CacheFields``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from mura_plugin.methods._view_config import ViewFields
from tta_bench.bounds import bounded

__all__ = ["CacheFields", "EntropyCache", "two_caches"]


@dataclass
class CacheFields(ViewFields):
    """TDA's positive and negative cache settings (its official defaults), inherited by the
    configs of the methods that keep its two caches (TDA, BoostAdapter)."""

    pos_shots: int = bounded(3, ge=1)
    # None: the official value for the dataset (the method's own table)
    pos_alpha: float | None = bounded(None, ge=0)
    pos_beta: float | None = bounded(None, ge=0)
    neg_shots: int = bounded(2, ge=1)
    neg_alpha: float = bounded(0.117, ge=0)
    neg_beta: float = bounded(1.0, ge=0)
    neg_entropy_lower: float = bounded(0.2, ge=0, le=1)
    neg_entropy_upper: float = bounded(0.5, ge=0, le=1)
    neg_mask_lower: float = bounded(0.03, ge=0, le=1)
    neg_mask_upper: float = bounded(1.0, ge=0, le=1)
    scale_alpha: bool = True  # alphas are tuned for logit scale 100: rescale to the model's


class EntropyCache:
    """Per-class slots of (feature, entropy, value); entropy inf marks an empty slot.

    The official cache is a list per class kept sorted by entropy with Python's stable sort,
    a new entry appended (or put in the last place) before sorting: among equal entropies
    the older entry comes first, and a full class evicts its last entry, the most recently
    inserted of its highest-entropy ones. ``stamp`` (insertion order) reproduces that."""

    def __init__(self, classes: int, shots: int, dim: int, value_dim: int, device):
        self.keys = torch.zeros(classes, shots, dim, device=device)
        self.entropy = torch.full((classes, shots), math.inf, device=device)
        self.values = torch.zeros(classes, shots, value_dim, device=device)
        self.stamp = torch.full((classes, shots), -1, dtype=torch.long, device=device)
        self.inserted = 0
        # Derived state, kept until the cache changes (``changed``): the slot each class
        # would evict with its entropy, and the keys and values of the filled slots. They
        # spare a stream of offers and lookups most of its small tensor operations; the
        # arithmetic on the values is the same.
        self._slot: dict[int, tuple[int, float]] = {}
        self._filled: tuple[int, torch.Tensor | None, torch.Tensor | None] | None = None

    def changed(self, cls: int) -> None:
        """Forget the derived state after a write to class ``cls``'s slots (a subclass that
        writes the slots itself calls it)."""
        self._slot.pop(cls, None)
        self._filled = None

    def evictable(self, cls: int) -> int:
        """The slot a new entry of class ``cls`` would take: a free one, else the most
        recently inserted of the highest-entropy entries (the official list's last)."""
        return self._evictable(cls)[0]

    def _evictable(self, cls: int) -> tuple[int, float]:
        got = self._slot.get(cls)
        if got is None:
            ent = self.entropy[cls]
            top = ent.max()
            tied = torch.nonzero(ent == top).flatten()
            slot = int(tied[self.stamp[cls, tied].argmax()])
            got = self._slot[cls] = (slot, float(ent[slot]))
        return got

    def offer(self, cls: int, key: torch.Tensor, ent: float, value: torch.Tensor) -> None:
        """Insert into a free slot, else replace the highest-entropy one if ``ent`` is lower
        (ties: ``evictable``)."""
        slot, worst = self._evictable(cls)
        if ent < worst:
            self.keys[cls, slot] = key
            self.entropy[cls, slot] = ent
            self.values[cls, slot] = value
            self.stamp[cls, slot] = self.inserted
            self.inserted += 1
            self.changed(cls)

    def logits(self, feature: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
        filled = self._filled
        if filled is None or filled[0] != self.inserted:
            valid = torch.isfinite(self.entropy).flatten()
            if bool(valid.any()):
                keys = self.keys.flatten(0, 1)[valid]
                filled = (self.inserted, keys, self.values.flatten(0, 1)[valid])
            else:
                filled = (self.inserted, None, None)
            self._filled = filled
        _, keys, values = filled
        if keys is None or values is None:
            return self.values.new_zeros(self.values.shape[-1])
        affinity = keys @ feature
        # torch.rsub(a, 1) is 1 - a, without the Python operator's wrapper
        return alpha * (torch.exp(-beta * torch.rsub(affinity, 1)) @ values)


def two_caches(
    head: torch.Tensor, config: CacheFields, device: Any, negative: type = EntropyCache
) -> tuple[EntropyCache, Any]:
    """TDA's empty positive and negative caches for the classes of ``head [C, D]``
    (``config.pos_shots`` / ``neg_shots`` slots per class, a value of C per entry);
    ``negative``: the negative cache's class."""
    c, d = head.shape
    return (
        EntropyCache(c, config.pos_shots, d, c, device),
        negative(c, config.neg_shots, d, c, device),
    )
