"""Digital corruptions (Hendrycks & Dietterich 2019, ImageNet-C / CIFAR-10-C)."""

from __future__ import annotations

import torch

from mura_plugin.shifts._params import check_images, severity_param
from tta_bench.rng import SampleGenerator

__all__ = ["contrast"]

CONTRAST = {
    "cifar": (0.75, 0.5, 0.4, 0.3, 0.15),
    "imagenet": (0.4, 0.3, 0.2, 0.1, 0.05),
    "digits": (0.75, 0.5, 0.4, 0.3, 0.15),
}


def contrast(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Blend each image towards its mean intensity: ``(x - mean) * c + mean``."""
    del generator  # deterministic
    check_images("contrast", images)
    c = severity_param("contrast", CONTRAST, table, severity)
    means = images.mean(dim=(1, 2, 3), keepdim=True)
    return ((images - means) * c + means).clamp(0.0, 1.0)
