"""Blur corruptions (Hendrycks & Dietterich 2019, ImageNet-C / CIFAR-10-C).

Spatial parameters (pixels) are multiplied by ``spatial_scale`` (1 at the table's native
size, see ``mura_plugin.shifts``).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from mura_plugin.shifts._ops import (
    STACK_ELEMENTS,
    BoundedCache,
    _filter_matrix,
    draw_batch,
    fft_correlate,
    in_image_steps,
    shifted_taps,
    zoom_axis,
)
from mura_plugin.shifts._ops import gaussian_filter as _gaussian_filter
from mura_plugin.shifts._params import check_images, severity_param, severity_table, spatial_scale
from tta_bench.buffers import batch_buffer, buffer_like
from tta_bench.rng import SampleGenerator

__all__ = [
    "gaussian_blur",
    "gaussian_filter",
    "defocus_blur",
    "glass_blur",
    "motion_blur",
    "zoom_blur",
    "disk_kernel",
    "motion_filter",
]

# Severity tables, table name -> parameters of severities 1..5 (``severities.json``).
#: Gaussian standard deviation (pixels).
GAUSSIAN_BLUR = severity_table("gaussian_blur")
#: (disk radius, anti-alias sigma) in pixels.
DEFOCUS_BLUR = severity_table("defocus_blur")
#: (sigma, max displacement, iterations).
GLASS_BLUR = severity_table("glass_blur")
#: (radius, sigma) of ImageMagick's one-sided motion-blur line.
MOTION_BLUR = severity_table("motion_blur")
#: (start, stop, step) of the zoom factors (numpy ``arange``), averaged with the original.
ZOOM_BLUR = severity_table("zoom_blur")


def gaussian_filter(
    images: torch.Tensor,
    sigma: float,
    truncate: float = 4.0,
    clamp: tuple[float, float] | None = None,
) -> torch.Tensor:
    """Gaussian filter with edge replication (skimage's ``gaussian``, ``mode='nearest'``);
    ``clamp=(lo, hi)`` clips the result as it is written."""
    return _gaussian_filter(images, sigma, truncate=truncate, mode="nearest", clamp=clamp)


def gaussian_blur(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Gaussian blur with standard deviation ``c`` pixels (edges replicated)."""
    del generator  # deterministic
    check_images("gaussian_blur", images)
    sigma = severity_param("gaussian_blur", GAUSSIAN_BLUR, table, severity)
    sigma *= spatial_scale(table, images)
    if not math.isfinite(sigma) or sigma <= 0:
        raise ValueError(f"gaussian_blur: sigma must be positive, got {sigma}")
    return gaussian_filter(images, sigma, clamp=(0.0, 1.0))


def disk_kernel(
    radius: float, alias_blur: float, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """ImageNet-C's anti-aliased disk: a normalised indicator of ``x^2 + y^2 <= r^2`` on a
    grid of half-width ``max(8, r)``, then OpenCV ``GaussianBlur`` (3x3, or 5x5 above radius
    8) with sigma ``alias_blur``. Returns ``[k, k]`` float64."""
    half = 8 if radius <= 8 else int(radius)
    ksize = 3 if radius <= 8 else 5
    ax = torch.arange(-half, half + 1, device=device, dtype=torch.float64)
    disk = ((ax[:, None] ** 2 + ax[None, :] ** 2) <= radius**2).double()
    disk = disk / disk.sum()
    x = torch.arange(ksize, device=device, dtype=torch.float64) - (ksize - 1) / 2
    g = torch.exp(-(x**2) / (2 * alias_blur**2))
    m = _filter_matrix(disk.shape[0], g / g.sum(), "reflect101")
    return m @ disk @ m.t()


def defocus_blur(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Correlate with an anti-aliased disk (OpenCV ``filter2D``, reflect-101 border)."""
    del generator  # deterministic
    check_images("defocus_blur", images)
    radius, alias = severity_param("defocus_blur", DEFOCUS_BLUR, table, severity)
    scale = spatial_scale(table, images)
    kernel = disk_kernel(radius * scale, alias * scale, images.device)
    key = ("disk", radius * scale, alias * scale)
    return fft_correlate(images, kernel[None], "reflect", cache_key=key, clamp=(0.0, 1.0))


@in_image_steps
def glass_blur(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Blur, quantise to 8 bits, scramble pixels locally, blur again.

    The reference swaps pixel pairs one at a time in a raster loop (each pixel with a random
    neighbour up to ``delta`` away), which cannot be vectorised as is; here each interior
    pixel instead takes the value of a random neighbour drawn the same way, once per
    iteration, in parallel (the same local scrambling; see tests/test_shift_fidelity.py).
    """
    check_images("glass_blur", images)
    sigma, delta, iterations = severity_param("glass_blur", GLASS_BLUR, table, severity)
    scale = spatial_scale(table, images)
    sigma, delta = sigma * scale, max(1, int(round(delta * scale)))
    b, c, h, w = images.shape
    x = gaussian_filter(images, sigma).mul_(255.0).floor_().div_(255.0)
    # One 31-bit draw per pixel and iteration from the sample's generator picks the
    # displacement (see ``_glass_tables``).
    draws = batch_buffer((b, iterations, h * w), torch.int32)
    for row, g in zip(draws.unbind(0), generator.generators, strict=True):
        row.random_(generator=g)
    offsets, border, base = _glass_tables(delta, h, w, images.device)
    # Every iteration's flat source index at once (int32: half the traffic of int64): the
    # pair ``floor(k * span^2 / 2^16)`` of each draw's top 16 bits ``k``; border pixels
    # (``k + 2^16``) land in the table's second half, offset 0.
    span2 = (2 * delta) ** 2
    pick = torch.bitwise_right_shift(draws.to(images.device), 15).add_(border)
    if span2 >= 1 << 14:  # (k + 2^16) * span^2 would overflow int32
        pick = pick.long()
    pick.mul_(span2).bitwise_right_shift_(16)
    src = offsets.index_select(0, pick.view(-1)).view(b, iterations, h * w).add_(base)
    # Iteration ``it`` sets x[p] = x[src_it[p]]: the iterations compose into one index,
    # x_n[p] = x_0[src_0[src_1[...src_(n-1)[p]]]], so the pixels are moved by one gather
    # (the same values as moving them once per iteration).
    index = src[:, -1].long()
    for it in range(iterations - 2, -1, -1):
        index = torch.gather(src[:, it], 1, index).long()
    flat = x.view(b, c, h * w)
    x = torch.gather(flat, 2, index.view(b, 1, h * w).expand(b, c, h * w)).view(b, c, h, w)
    return gaussian_filter(x, sigma, clamp=(0.0, 1.0))


_GLASS_TABLES = BoundedCache(16)


def _glass_tables(
    delta: int, h: int, w: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``glass_blur``'s displacement tables for ``[h, w]`` images (cached): ``offsets
    [2 span^2]``, ``border [h * w]`` and ``base [h * w]`` (int32), ``span = 2 delta``.

    A draw's top 16 bits ``k`` select pair ``floor(k * span^2 / 2^16)`` of the ``span^2``
    (dy, dx) pairs in [-delta, delta)^2 (exactly uniform when span is a power of two, else
    biased by under span^2 / 2^16); ``offsets[pair]`` is that pair's flat source offset
    ``dy * w + dx`` (a table read instead of a slow integer division). Interior pixels stay
    inside the image after a shift of at most ``delta``, so their flat source index is
    ``base`` (their own) plus that offset, with no clamping; ``border`` adds 2^16 to ``k``
    at the other pixels, which moves their pair to the table's second half, offset 0."""

    def build() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        span = 2 * delta
        pair = torch.arange(span * span, device=device)
        dy = pair.div(span, rounding_mode="floor") - delta
        dx = pair.remainder(span) - delta
        offsets = torch.cat((dy * w + dx, dy.new_zeros(span * span))).int()
        yy = torch.arange(h, device=device).view(h, 1)
        xx = torch.arange(w, device=device).view(1, w)
        interior = (yy >= delta) & (yy < h - delta) & (xx >= delta) & (xx < w - delta)
        border = (~interior).view(h * w).int() << 16
        return offsets, border, (yy * w + xx).view(h * w).int()

    return _GLASS_TABLES.get((delta, h, w, str(device)), build)


def motion_offsets(
    radius: int, sigma: float, angles: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ImageMagick's motion-blur line: ``(weights [n], dy [B, n], dx [B, n])`` (float64,
    int64) with ``n = 2 * radius + 1`` taps, one-sided Gaussian weights ``exp(-i^2 / 2
    sigma^2)`` (normalised) at offsets ``i * (cos a, sin a)`` rounded as ImageMagick does:
    ``out[y, x] = sum weights[i] * image[y - dy[i], x - dx[i]]`` (the imagecorruptions
    re-implementation of Wand's ``motion_blur`` used by ImageNet-C)."""
    i = torch.arange(2 * radius + 1, dtype=torch.float64)
    g = torch.exp(-(i**2) / (2 * sigma**2))
    a = torch.deg2rad(angles.double().cpu())[:, None]
    dy = (-torch.ceil(i * torch.sin(a) - 0.5)).long()
    dx = (-torch.ceil(i * torch.cos(a) - 0.5)).long()
    return g / g.sum(), dy, dx


def motion_kernels(
    radius: int, sigma: float, angles: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """The motion line (``motion_offsets``) as centred correlation kernels ``[B, k, k]``,
    so the blur trails the pixel on one side."""
    g, dy, dx = motion_offsets(radius, sigma, angles)
    half = 2 * radius
    k = 2 * half + 1
    kern = torch.zeros(angles.shape[0], k * k, dtype=torch.float64)
    flat = (half - dy) * k + (half - dx)
    kern.scatter_add_(1, flat, g.expand_as(dy).contiguous())
    return kern.view(-1, k, k).to(device)


def motion_filter(
    images: torch.Tensor, radius: int, sigma: float, angles: torch.Tensor
) -> torch.Tensor:
    """Per-sample motion blur of ``images [B, C, H, W]`` at ``angles [B]`` (degrees), edges
    replicated. The line has only ``2 * radius + 1`` taps, applied directly as weighted
    shifted copies (``shifted_taps``)."""
    g, dy, dx = motion_offsets(radius, sigma, angles)
    return shifted_taps(images, dy, dx, g)


@in_image_steps
def motion_blur(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Linear motion blur at a per-sample angle drawn from U(-45, 45) degrees."""
    check_images("motion_blur", images)
    radius, sigma = severity_param("motion_blur", MOTION_BLUR, table, severity)
    scale = spatial_scale(table, images)
    angles = draw_batch(generator, "uniform", 1)[:, 0] * 90.0 - 45.0
    radius = max(1, int(round(radius * scale)))
    return motion_filter(images, radius, sigma * scale, angles).clamp_(0.0, 1.0)


def zoom_factors(table: str, severity: int) -> np.ndarray:
    start, stop, step = severity_param("zoom_blur", ZOOM_BLUR, table, severity)
    return np.arange(start, stop, step)


@lru_cache(maxsize=16)
def _zoom_grid(
    h: int, w: int, factors: tuple[float, ...], device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """``grid_sample`` grid ``[1, F * H, W, 2]`` (corner-aligned) stacking, for each zoom
    factor, the source positions of ``clipped_zoom`` (``zoom_axis``: bilinear, separable)."""
    grids = []
    for z in factors:
        y0, _, wy = zoom_axis(h, z, torch.device("cpu"))
        x0, _, wx = zoom_axis(w, z, torch.device("cpu"))
        # zoom_axis's taps are (floor, floor + 1) with weight = the fraction, so the source
        # position is i0 + w1; align_corners=True maps -1..1 onto pixel 0..n-1.
        gy = 2 * (y0.double() + wy) / max(h - 1, 1) - 1
        gx = 2 * (x0.double() + wx) / max(w - 1, 1) - 1
        grids.append(torch.stack(torch.broadcast_tensors(gx[None, :], gy[:, None]), -1))
    return torch.cat(grids, 0)[None].to(device, dtype)


@in_image_steps
def zoom_blur(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Average of the image and its centre zooms by each factor (radial blur)."""
    del generator  # deterministic
    check_images("zoom_blur", images)
    factors = tuple(float(z) for z in zoom_factors(table, severity))
    return _zoom_average(images, factors).clamp_(0.0, 1.0)


def _zoom_average(images: torch.Tensor, factors: tuple[float, ...]) -> torch.Tensor:
    """The mean of ``images [B, C, H, W]`` and its ``clipped_zoom`` by each factor.

    All zooms of a group of channels come from one ``grid_sample`` call: the batch's
    channels are its channels (``[1, B * C, H, W]``), so the bilinear weights of every
    output position are computed once and reused across channels, and the factors are
    stacked along the grid's height.
    """
    b, c, h, w = images.shape
    grid = _zoom_grid(h, w, factors, images.device, images.dtype)
    out = buffer_like(images).copy_(images)
    flat = out.view(1, b * c, h, w)
    acc = out.view(b * c, h, w)
    n = len(factors)
    # A few channels at a time bound the stack of zooms (at most STACK_ELEMENTS values).
    step = max(1, STACK_ELEMENTS // (n * h * w))
    for s in range(0, b * c, step):
        zoomed = F.grid_sample(
            flat[:, s : s + step], grid, "bilinear", "border", align_corners=True
        )
        acc[s : s + step] += zoomed[0].view(-1, n, h, w).sum(1)
    return out.div_(n + 1)
