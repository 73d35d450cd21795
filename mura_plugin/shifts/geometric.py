"""Geometric corruptions: elastic_transform (Hendrycks & Dietterich 2019) and the seed
article's rotation. Resampling is bilinear ``grid_sample``; per-sample draws come from the
``SampleGenerator``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mura_plugin.shifts._ops import gaussian_filter
from mura_plugin.shifts._params import check_images, severity_param, spatial_scale
from tta_bench.rng import SampleGenerator

__all__ = ["elastic_transform", "rotation"]

_I, _C = 244, 32  # ImageNet-C's code writes 244 (sic) for its 224 px images; kept verbatim.
#: (displacement scale alpha, displacement smoothing sigma, affine jitter), pixels.
ELASTIC_TRANSFORM = {
    "cifar": (
        (_C * 0, _C * 0, _C * 0.08),
        (_C * 0.05, _C * 0.2, _C * 0.07),
        (_C * 0.08, _C * 0.06, _C * 0.06),
        (_C * 0.1, _C * 0.04, _C * 0.05),
        (_C * 0.1, _C * 0.03, _C * 0.03),
    ),
    "imagenet": (
        (_I * 2, _I * 0.7, _I * 0.1),
        (_I * 2, _I * 0.08, _I * 0.2),
        (_I * 0.05, _I * 0.01, _I * 0.02),
        (_I * 0.07, _I * 0.01, _I * 0.02),
        (_I * 0.12, _I * 0.01, _I * 0.02),
    ),
    "digits": (
        (_C * 0.12, _C * 0.1, _C * 0.08),
        (_C * 0.24, _C * 0.08, _C * 0.1),
        (_C * 0.36, _C * 0.07, _C * 0.12),
        (_C * 0.48, _C * 0.06, _C * 0.14),
        (_C * 0.6, _C * 0.05, _C * 0.16),
    ),
}
#: Rotation angle in degrees (sign drawn per sample).
ROTATION = {
    "cifar": (6.0, 12.0, 18.0, 24.0, 30.0),
    "imagenet": (6.0, 12.0, 18.0, 24.0, 30.0),
    "digits": (15.0, 30.0, 45.0, 60.0, 75.0),
}


def elastic_transform(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """A random affine warp (three control points jittered by ``U(-a, a)``, OpenCV
    ``warpAffine`` with reflect-101 border) followed by a smooth random displacement field
    (``U(-1, 1)`` per pixel, Gaussian-smoothed with ``sigma``, truncate 3, times ``alpha``;
    scipy ``map_coordinates`` order 1 with half-sample reflection)."""
    check_images("elastic_transform", images)
    alpha, sigma, jitter = severity_param("elastic_transform", ELASTIC_TRANSFORM, table, severity)
    scale = spatial_scale(table, images)
    alpha, sigma, jitter = alpha * scale, sigma * scale, jitter * scale
    b, c, h, w = images.shape
    dev, dt = images.device, images.dtype
    pts_noise = generator.uniform(3, 2, dtype=torch.float64).cpu() * 2 - 1
    fields = generator.uniform(2, h, w).to(dev, dt) * 2 - 1

    # Affine from three control points around the centre (OpenCV getAffineTransform).
    cy, cx = float(h // 2), float(w // 2)
    sq = float(min(h, w) // 3)
    pts1 = torch.tensor([[cy + sq, cx + sq], [cy + sq, cx - sq], [cy - sq, cx - sq]])
    pts1 = pts1.double()
    pts2 = pts1 + jitter * pts_noise
    ones = torch.ones(3, 1, dtype=torch.float64)
    a = torch.cat((pts1, ones), 1)  # [3, 3]; the reference's points are (x, y) pairs
    m = torch.linalg.solve(a.expand(b, 3, 3), pts2).transpose(1, 2)  # [B, 2, 3]
    full = torch.cat((m, torch.tensor([0.0, 0.0, 1.0]).double().expand(b, 1, 3)), 1)
    inv = torch.linalg.inv(full)  # destination -> source, pixel coordinates
    # The same map in grid_sample's corner-aligned coordinates (2 x / (n - 1) - 1), so one
    # affine_grid call builds the whole sampling grid.
    to_norm = torch.tensor(
        [[2.0 / max(w - 1, 1), 0.0, -1.0], [0.0, 2.0 / max(h - 1, 1), -1.0], [0.0, 0.0, 1.0]],
        dtype=torch.float64,
    )
    theta = (to_norm @ inv @ torch.linalg.inv(to_norm))[:, :2].to(dev, dt)
    grid = F.affine_grid(theta, [b, c, h, w], align_corners=True)
    warped = F.grid_sample(images, grid, "bilinear", "reflection", align_corners=True)
    if alpha == 0:
        return warped.clamp_(0.0, 1.0)
    smooth = gaussian_filter(fields, sigma, truncate=3.0, mode="reflect")
    # Pixel-centre grid ((2 x + 1) / n - 1) plus the displacement, scaled to grid units.
    eye = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], device=dev, dtype=dt)
    base = F.affine_grid(eye[None], [1, 1, h, w], align_corners=False)
    gain = torch.tensor([2.0 * alpha / w, 2.0 * alpha / h], device=dev, dtype=dt)
    grid = torch.addcmul(base, smooth.permute(0, 2, 3, 1), gain)
    out = F.grid_sample(warped, grid, "bilinear", "reflection", align_corners=False)
    return out.clamp_(0.0, 1.0)


def rotation(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Rotate about the centre by ``+-c`` degrees (sign per sample), bilinear, black fill."""
    check_images("rotation", images)
    deg = severity_param("rotation", ROTATION, table, severity)
    sign = torch.where(generator.uniform(1)[:, 0] < 0.5, -1.0, 1.0).to(images.device)
    theta = torch.deg2rad(deg * sign).to(images.dtype)
    cos, sin = theta.cos(), theta.sin()
    zero = torch.zeros_like(cos)
    h, w = images.shape[-2:]
    # affine_grid works in normalised coordinates; correct for the aspect ratio.
    mat = torch.stack(
        (torch.stack((cos, -sin * h / w, zero), 1), torch.stack((sin * w / h, cos, zero), 1)), 1
    )
    grid = F.affine_grid(mat, list(images.shape), align_corners=False)
    out = F.grid_sample(images, grid, "bilinear", "zeros", align_corners=False)
    return out.clamp(0.0, 1.0)
