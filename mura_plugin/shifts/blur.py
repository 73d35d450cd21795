"""Blur corruptions (Hendrycks & Dietterich 2019, ImageNet-C / CIFAR-10-C)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mura_plugin.shifts._params import check_images, severity_param
from tta_bench.rng import SampleGenerator

__all__ = ["gaussian_blur", "gaussian_filter"]

GAUSSIAN_BLUR = {
    "cifar": (0.4, 0.6, 0.7, 0.8, 1.0),
    "imagenet": (1.0, 2.0, 3.0, 4.0, 6.0),
    "digits": (2.0, 3.0, 4.0, 5.0, 6.0),
}


def gaussian_filter(images: torch.Tensor, sigma: float, truncate: float = 4.0) -> torch.Tensor:
    """Separable Gaussian filter with edge replication (skimage's ``mode='nearest'``)."""
    radius = max(1, int(truncate * sigma + 0.5))
    x = torch.arange(-radius, radius + 1, device=images.device, dtype=images.dtype)
    k = torch.exp(-0.5 * (x / sigma) ** 2)
    k = k / k.sum()
    c = images.shape[1]
    out = F.pad(images, (radius, radius, 0, 0), mode="replicate")
    out = F.conv2d(out, k.view(1, 1, 1, -1).expand(c, 1, 1, -1), groups=c)
    out = F.pad(out, (0, 0, radius, radius), mode="replicate")
    return F.conv2d(out, k.view(1, 1, -1, 1).expand(c, 1, -1, 1), groups=c)


def gaussian_blur(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Gaussian blur with standard deviation ``c`` pixels."""
    del generator  # deterministic
    check_images("gaussian_blur", images)
    sigma = severity_param("gaussian_blur", GAUSSIAN_BLUR, table, severity)
    if not math.isfinite(sigma) or sigma <= 0:
        raise ValueError(f"gaussian_blur: sigma must be positive, got {sigma}")
    return gaussian_filter(images, sigma).clamp(0.0, 1.0)
