"""Noise corruptions (Hendrycks & Dietterich 2019, ImageNet-C / CIFAR-10-C)."""

from __future__ import annotations

import torch

from mura_plugin.shifts._params import check_images, severity_param
from tta_bench.rng import SampleGenerator

__all__ = ["gaussian_noise"]

GAUSSIAN_NOISE = {
    "cifar": (0.04, 0.06, 0.08, 0.09, 0.10),
    "imagenet": (0.08, 0.12, 0.18, 0.26, 0.38),
    "digits": (0.3, 0.45, 0.6, 0.7, 0.8),
}


def gaussian_noise(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Add N(0, c^2) noise per pixel and clip to [0, 1]."""
    check_images("gaussian_noise", images)
    c = severity_param("gaussian_noise", GAUSSIAN_NOISE, table, severity)
    noise = generator.normal(*images.shape[1:]).to(images.device, images.dtype)
    return (images + c * noise).clamp(0.0, 1.0)
