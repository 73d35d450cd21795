"""Noise corruptions (Hendrycks & Dietterich 2019, ImageNet-C / CIFAR-10-C).

Every draw is made per sample from the ``SampleGenerator`` (on the CPU, then moved), so a
sample's noise does not depend on the batch it is in.
"""

from __future__ import annotations

import torch

from mura_plugin.shifts._ops import chunk_rows
from mura_plugin.shifts._params import check_images, severity_param
from tta_bench.rng import SampleGenerator

__all__ = ["gaussian_noise", "shot_noise", "impulse_noise", "speckle_noise"]

GAUSSIAN_NOISE = {
    "cifar": (0.04, 0.06, 0.08, 0.09, 0.10),
    "imagenet": (0.08, 0.12, 0.18, 0.26, 0.38),
    "digits": (0.3, 0.45, 0.6, 0.7, 0.8),
}
#: Photon counts per unit intensity (lower = noisier).
SHOT_NOISE = {
    "cifar": (500, 250, 100, 75, 50),
    "imagenet": (60, 25, 12, 5, 3),
    "digits": (4, 2, 1.2, 0.8, 0.5),
}
#: Fraction of values replaced by salt or pepper (skimage ``random_noise(mode='s&p')``).
IMPULSE_NOISE = {
    "cifar": (0.01, 0.02, 0.03, 0.05, 0.07),
    "imagenet": (0.03, 0.06, 0.09, 0.17, 0.27),
    "digits": (0.1, 0.2, 0.3, 0.4, 0.5),
}
SPECKLE_NOISE = {
    "cifar": (0.06, 0.1, 0.12, 0.16, 0.2),
    "imagenet": (0.15, 0.2, 0.35, 0.45, 0.6),
    "digits": (0.6, 1.0, 1.5, 2.0, 3.0),
}


def gaussian_noise(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Add N(0, c^2) noise per value and clip to [0, 1]."""
    check_images("gaussian_noise", images)
    c = severity_param("gaussian_noise", GAUSSIAN_NOISE, table, severity)
    noise = generator.normal(*images.shape[1:]).to(images.device, images.dtype)
    return (images + c * noise).clamp(0.0, 1.0)


def shot_noise(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Poisson (photon) noise: ``Poisson(x * c) / c``, clipped."""
    check_images("shot_noise", images)
    c = float(severity_param("shot_noise", SHOT_NOISE, table, severity))
    counts = generator.poisson(images.detach().float().cpu() * c)
    return (counts.to(images.device, images.dtype) / c).clamp(0.0, 1.0)


def impulse_noise(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Salt-and-pepper: each value becomes 0 or 1 (equally likely) with probability ``c``.

    One uniform draw ``u`` per value decides both: salt if ``u < c / 2``, pepper if
    ``c / 2 <= u < c`` (the same joint law as separate hit and salt draws)."""
    check_images("impulse_noise", images)
    c = severity_param("impulse_noise", IMPULSE_NOISE, table, severity)
    out = torch.empty_like(images)
    step = chunk_rows(images)
    draws = torch.empty(min(step, images.shape[0]), *images.shape[1:])
    for s in range(0, images.shape[0], step):
        n = min(step, images.shape[0] - s)
        for j, g in enumerate(generator.generators[s : s + n]):
            torch.rand(images.shape[1:], generator=g, out=draws[j])
        u = draws[:n].to(images.device)
        chunk = out[s : s + n]
        chunk.copy_(images[s : s + n])
        chunk.masked_fill_(u < c, 0.0).masked_fill_(u < c / 2, 1.0)
    return out


def speckle_noise(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Multiplicative noise ``x + x * N(0, c^2)``, clipped."""
    check_images("speckle_noise", images)
    c = severity_param("speckle_noise", SPECKLE_NOISE, table, severity)
    noise = generator.normal(*images.shape[1:]).to(images.device, images.dtype)
    return (images + images * c * noise).clamp(0.0, 1.0)
