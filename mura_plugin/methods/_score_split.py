"""The score-queue threshold search ROSITA and ZS-NTTA share (both official codes carry the
same ``compute_os_variance`` search): over the grid 0, 0.01, ..., 0.99, the first threshold
minimising the within-class variance ``w0 var0 + w1 var1`` of the split ``scores >= tau``
(Otsu's criterion on a fixed grid; a split leaving a side empty excluded). CLIPTTA's
histogram Otsu (skimage's rule) is another rule and stays in ``cliptta.py``."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["THRESHOLD_GRID", "Split", "score_threshold"]

#: The official threshold grid ``np.arange(0, 1, 0.01)`` (its values are ``i * 0.01``).
THRESHOLD_GRID = torch.arange(100, dtype=torch.float64) * 0.01


class Split(NamedTuple):
    """The threshold ``tau`` of a score queue and the mean scores below / at-or-above it."""

    tau: float
    mu0: float
    mu1: float


def score_threshold(scores: torch.Tensor, grid: torch.Tensor = THRESHOLD_GRID) -> Split:
    """The official threshold of the score queue ``scores [N]``: the grid value minimising
    ``w0 var0 + w1 var1`` of the split ``scores >= tau`` (population variances, weights
    the shares; splits with an empty side excluded; the first minimum), with the means of
    both sides; ``(0, 0, 1)`` when every split is excluded (the official fallback)."""
    x = scores.detach().to(torch.float64).reshape(1, -1)
    if x.shape[1] == 0:
        return Split(0.0, 0.0, 1.0)
    g = grid.to(torch.float64).reshape(-1, 1)
    upper = (x >= g).to(torch.float64)  # [G, N]
    n = float(x.shape[1])
    n1 = upper.sum(dim=1)
    n0 = n - n1
    valid = (n1 > 0) & (n0 > 0)
    mean1 = (upper * x).sum(dim=1) / n1.clamp_min(1)
    mean0 = ((1 - upper) * x).sum(dim=1) / n0.clamp_min(1)
    var1 = (upper * (x - mean1[:, None]) ** 2).sum(dim=1) / n1.clamp_min(1)
    var0 = ((1 - upper) * (x - mean0[:, None]) ** 2).sum(dim=1) / n0.clamp_min(1)
    criterion = torch.where(valid, n0 / n * var0 + n1 / n * var1, torch.inf)
    best = int(torch.argmin(criterion))
    if not bool(valid[best]):
        return Split(float(grid[best]), 0.0, 1.0)
    return Split(float(grid[best]), float(mean0[best]), float(mean1[best]))
