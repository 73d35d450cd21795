"""Geometric corruptions: elastic_transform (Hendrycks & Dietterich 2019) and the seed
article's rotation. Resampling is bilinear ``grid_sample``; per-sample draws come from the
``SampleGenerator``."""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from mura_plugin.shifts._ops import draw_batch, gaussian_filter, in_image_steps
from mura_plugin.shifts._params import check_images, severity_param, severity_table, spatial_scale
from tta_bench.rng import SampleGenerator

__all__ = ["elastic_transform", "rotation"]

_I, _C = 244, 32  # ImageNet-C's code writes 244 (sic) for its 224 px images; kept verbatim.
# Severity tables, table name -> parameters of severities 1..5 (``severities.json``).
#: (displacement scale alpha, displacement smoothing sigma, affine jitter), pixels; the
#: ``cifar`` and ``imagenet`` rows are written there, as in the references, as fractions
#: of the side ``_C`` and ``_I`` (``_C * 0.08``, ...).
ELASTIC_TRANSFORM = severity_table("elastic_transform", times={"cifar": _C, "imagenet": _I})
#: Rotation angle in degrees (sign drawn per sample).
ROTATION = severity_table("rotation")


@lru_cache(maxsize=16)
def _corner_grid(h: int, w: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``affine_grid``'s corner-aligned homogeneous base grid ``[H W, 3]`` (x, y, 1)."""
    eye = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]], dtype=dtype)
    corner = F.affine_grid(eye, [1, 1, h, w], align_corners=True)
    return torch.cat((corner, torch.ones(1, h, w, 1, dtype=dtype)), -1).view(h * w, 3).to(device)


@lru_cache(maxsize=16)
def _centre_grid(h: int, w: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``affine_grid``'s pixel-centre identity grid, planar: ``[1, 2, H, W]`` (x, y)."""
    eye = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]], device=device, dtype=dtype)
    grid = F.affine_grid(eye, [1, 1, h, w], align_corners=False)
    return grid.permute(0, 3, 1, 2).contiguous()


@lru_cache(maxsize=16)
def _affine_constants(h: int, w: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pts1 [3, 2], inverse of [pts1 | 1] [3, 3], to_norm [3, 3])`` (float64): the
    control points (the reference's ``(x, y)`` pairs), OpenCV ``getAffineTransform``'s linear
    solve as a fixed matrix, and the map from pixel to ``grid_sample``'s corner-aligned
    coordinates (``2 x / (n - 1) - 1``)."""
    cy, cx = float(h // 2), float(w // 2)
    sq = float(min(h, w) // 3)
    pts1 = torch.tensor(
        [[cy + sq, cx + sq], [cy + sq, cx - sq], [cy - sq, cx - sq]], dtype=torch.float64
    )
    a = torch.cat((pts1, torch.ones(3, 1, dtype=torch.float64)), 1)
    to_norm = torch.tensor(
        [[2.0 / max(w - 1, 1), 0.0, -1.0], [0.0, 2.0 / max(h - 1, 1), -1.0], [0.0, 0.0, 1.0]],
        dtype=torch.float64,
    )
    return pts1, torch.linalg.inv(a), to_norm


def _elastic_theta(pts_noise: torch.Tensor, jitter: float, h: int, w: int) -> torch.Tensor:
    """Corner-aligned ``grid_sample`` affines ``[B, 2, 3]`` (float64), destination to
    source, of the warps taking the control points to ``pts1 + jitter * pts_noise``
    (``pts_noise [B, 3, 2]``): small closed-form products instead of batched LAPACK
    solves and inverses (equal up to float64 rounding)."""
    pts1, a_inv, to_norm = _affine_constants(h, w)
    m = (a_inv @ (pts1 + jitter * pts_noise)).transpose(1, 2)  # [B, 2, 3], source -> dest
    # [[A, t], [0, 1]]^-1 = [[A^-1, -A^-1 t], [0, 1]], with the 2x2 inverse by cofactors.
    p, q, r, s = m[:, 0, 0], m[:, 0, 1], m[:, 1, 0], m[:, 1, 1]
    inv_a = torch.stack((torch.stack((s, -q), 1), torch.stack((-r, p), 1)), 1)
    inv_a = inv_a / (p * s - q * r).view(-1, 1, 1)
    inv = torch.zeros(m.shape[0], 3, 3, dtype=m.dtype)
    inv[:, :2, :2] = inv_a
    inv[:, :2, 2:] = -(inv_a @ m[:, :, 2:])
    inv[:, 2, 2] = 1.0
    # The same map in corner-aligned coordinates: to_norm @ inv @ to_norm^-1 (diagonal
    # scale plus offset, inverted in closed form).
    from_norm = torch.zeros(3, 3, dtype=torch.float64)
    from_norm[0, 0], from_norm[1, 1], from_norm[2, 2] = 1 / to_norm[0, 0], 1 / to_norm[1, 1], 1
    from_norm[:2, 2] = -to_norm[:2, 2] / torch.diagonal(to_norm)[:2]
    return (to_norm @ inv @ from_norm)[:, :2]


@in_image_steps
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
    pts_noise = draw_batch(generator, "uniform", 3, 2, dtype=torch.float64) * 2 - 1
    fields = draw_batch(generator, "uniform", 2, h, w).to(dev, dt)

    theta = _elastic_theta(pts_noise, jitter, h, w).to(dev, dt)
    # affine_grid's values (theta times the homogeneous base grid) as one matrix product for
    # the whole batch, planar ([B, 2, H W]) and passed as a permuted view: far cheaper than
    # its batch of tiny products into an interleaved grid.
    grid = theta.reshape(b * 2, 3) @ _corner_grid(h, w, dev, dt).t()
    grid = grid.view(b, 2, h, w).permute(0, 2, 3, 1)
    warped = F.grid_sample(images, grid, "bilinear", "reflection", align_corners=True)
    if alpha == 0:
        return warped.clamp_(0.0, 1.0)
    fields = fields.mul_(2).sub_(1)
    smooth = gaussian_filter(fields, sigma, truncate=3.0, mode="reflect")
    # Pixel-centre grid ((2 x + 1) / n - 1) plus the displacement, in grid units, built
    # planar ([B, 2, H, W]: contiguous, ~9x cheaper than writing through the permutation)
    # and handed to grid_sample as a permuted view (it takes any grid strides).
    base = _centre_grid(h, w, dev, dt)
    gain = torch.tensor([2.0 * alpha / w, 2.0 * alpha / h], device=dev, dtype=dt)
    grid = torch.addcmul(base, smooth, gain.view(1, 2, 1, 1)).permute(0, 2, 3, 1)
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
