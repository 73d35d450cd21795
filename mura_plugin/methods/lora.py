"""Single-rank LoRA test-time adaptation in TTL's setting (the baseline MuRA must beat).

Paper: Imam et al., "Test-Time Low Rank Adaptation via Confidence Maximization for
Zero-Shot Generalization of Vision-Language Models", WACV 2025 (arXiv 2407.15913).
Official code: https://github.com/Razaimam45/TTL-Test-Time-Low-Rank-Adaptation
Setting (defaults): LoRA r = 16 on the q and v projections of the last 3 vision blocks,
B = 0 init, 64 views (63 random resized crops + flip, plus the original), loss =
per-view entropy weighted by the detached ``exp(-(H - 0.4))`` (``weighted_entropy``),
AdamW 5e-3 (torch's default weight decay 0.01), 1 step, adapters and optimiser reset after
every sample, prediction on the original image after the update.
What differs: TTL's augmentations are torchvision transforms on PIL images; here the crops
are drawn in one batched ``grid_sample`` (bilinear) on the device. The LoRA scale is
``alpha / r = 1``. Implementation: MuRA's adapter machinery with one component and fixed
weight 1 (``fusion=none``, ``init=zero``), so MuRA with ``ranks=[16]`` and the same placement
computes exactly this (tests/test_methods.py checks it). The 64 per-sample episodes of a batch
run in parallel, each with its own adapter copy, and the blocks below the adapted ones run
once per batch without gradients (see mura.py and _views.py): the same computation as the
per-sample loop, to ~1e-6 (``method.episode_batching=false`` runs the loop).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mura_plugin.methods.mura import MuRA, MuRAConfig

__all__ = ["LoRA", "LoRAConfig"]


@dataclass
class LoRAConfig(MuRAConfig):
    ranks: list[int] = field(default_factory=lambda: [16])
    blocks: int = 3
    targets: list[str] = field(default_factory=lambda: ["attn.q", "attn.v"])
    alpha: float = 16.0
    init: str = "zero"
    fusion: str = "none"
    router_persist: bool = False


class LoRA(MuRA):
    Config = LoRAConfig
