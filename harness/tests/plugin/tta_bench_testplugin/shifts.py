"""Shift kernels: ``(images [B, C, H, W] in [0, 1], severity, *, generator) -> images``."""

from __future__ import annotations

import torch

from tta_bench.rng import SampleGenerator


def noise(images: torch.Tensor, severity: int, *, generator: SampleGenerator) -> torch.Tensor:
    """Additive Gaussian noise, sigma 0.04 per severity step, drawn per sample."""
    draws = generator.normal(*images.shape[1:]).to(images.device, images.dtype)
    return images + 0.04 * severity * draws


def dim(images: torch.Tensor, severity: int, *, generator: SampleGenerator) -> torch.Tensor:
    """Darken by 12% per severity step (deterministic: draws nothing)."""
    return images * (1.0 - 0.12 * severity)
