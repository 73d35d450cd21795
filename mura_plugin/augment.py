"""Batched view augmentation for multi-view methods (TPT, TTL, MuRA).

All views of all samples are produced by one ``grid_sample`` call from per-view affine
parameters drawn from the method's own ``torch.Generator`` (seeded by the runner per batch),
so the views are reproducible and cheap.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["random_resized_crops", "make_views"]


def random_resized_crops(
    images: torch.Tensor,
    n_views: int,
    generator: torch.Generator,
    *,
    scale: tuple[float, float] = (0.5, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    flip: bool = False,
) -> torch.Tensor:
    """``[V, B, C, H, W]`` random resized crops (torchvision's RandomResizedCrop sampling,
    crop clipped to the image), each resized back to ``H x W`` bilinearly."""
    b, c, h, w = images.shape
    n = n_views * b
    area = torch.empty(n).uniform_(scale[0], scale[1], generator=generator)
    log_r = torch.empty(n).uniform_(math.log(ratio[0]), math.log(ratio[1]), generator=generator)
    aspect = log_r.exp()
    cw = (area * aspect).sqrt().clamp(max=1.0)  # crop width as a fraction of the image
    ch = (area / aspect).sqrt().clamp(max=1.0)
    cx = (torch.rand(n, generator=generator) * 2 - 1) * (1 - cw)  # centre in [-1, 1] coords
    cy = (torch.rand(n, generator=generator) * 2 - 1) * (1 - ch)
    sx = cw.clone()
    if flip:
        sx = torch.where(torch.rand(n, generator=generator) < 0.5, -sx, sx)
    theta = torch.zeros(n, 2, 3)
    theta[:, 0, 0], theta[:, 0, 2] = sx, cx
    theta[:, 1, 1], theta[:, 1, 2] = ch, cy
    theta = theta.to(images.device, images.dtype)
    src = images.unsqueeze(0).expand(n_views, b, c, h, w).reshape(n, c, h, w)
    grid = F.affine_grid(theta, [n, c, h, w], align_corners=False)
    out = F.grid_sample(src, grid, mode="bilinear", padding_mode="border", align_corners=False)
    return out.view(n_views, b, c, h, w)


def make_views(
    images: torch.Tensor,
    n_views: int,
    generator: torch.Generator,
    *,
    include_original: bool = True,
    scale: tuple[float, float] = (0.08, 1.0),
    flip: bool = True,
) -> torch.Tensor:
    """``[V, B, C, H, W]``: the original images first (when ``include_original``), then
    ``n_views`` random resized crops (TPT's preprocessing: RandomResizedCrop + horizontal
    flip). At least one view is required."""
    if n_views < 0 or (n_views == 0 and not include_original):
        raise ValueError(
            f"need at least one view: n_views={n_views}, include_original={include_original}"
        )
    parts = [images.unsqueeze(0)] if include_original else []
    if n_views > 0:
        parts.append(random_resized_crops(images, n_views, generator, scale=scale, flip=flip))
    return torch.cat(parts, dim=0)
