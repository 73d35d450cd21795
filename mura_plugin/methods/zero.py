"""ZERO: test-time augmentation with zero temperature (no backpropagation).

Paper: Farina et al., "Frustratingly Easy Test-Time Adaptation of Vision-Language Models",
NeurIPS 2024. Official code: https://github.com/FarinaMatteo/zero
Setting (defaults): 64 views (original + 63 random resized crops with flip), keep the 30%
most confident views (lowest entropy, TPT's confidence filter), and predict the class that
most kept views vote for (argmax of each view = softmax at zero temperature, marginalised).
What differs: views come from one batched ``grid_sample`` instead of PIL transforms; all
views of the whole batch go through the frozen tower in chunked gradient-free forwards.
Ties between vote counts are broken by the mean probability of the kept views (the
official code breaks them greedily by the same kind of score). The returned logits are
``log((1 - eps) * votes + eps * mean_probs)``: the argmax is the vote, values stay finite.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mura_plugin.losses import select_confident
from mura_plugin.methods._views import configured_views
from tta_bench.method import Method, autocast_context, check_precision

__all__ = ["Zero", "ZeroConfig"]


@dataclass
class ZeroConfig:
    views: int = 63
    include_original: bool = True
    crop_scale_min: float = 0.08
    flip: bool = True
    selection: float = 0.3  # fraction of most confident views that vote
    tie_eps: float = 1e-3
    chunk_views: int = 256  # views per forward: cache-sized chunks run ~2x faster on CPU
    precision: str = "fp16"  # autocast on CUDA, as the official code runs CLIP; CPU: fp32


class Zero(Method):
    Config = ZeroConfig

    def setup(self) -> None:
        cfg = self.config
        check_precision(cfg.precision)
        if not 0.0 < cfg.selection <= 1.0:
            raise ValueError(f"selection must be in (0, 1], got {cfg.selection}")
        if cfg.chunk_views < 1:
            raise ValueError(f"chunk_views must be >= 1, got {cfg.chunk_views}")
        if not 0.0 < cfg.tie_eps < 1.0:
            raise ValueError(f"tie_eps must be in (0, 1), got {cfg.tie_eps}")

    @torch.no_grad()
    def step(self, images: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        views = configured_views(images, cfg, self.generator)
        v, b = views.shape[:2]
        flat = views.flatten(0, 1)
        chunk = cfg.chunk_views
        with autocast_context(cfg.precision, self.device):
            logits = torch.cat([self.model(flat[i : i + chunk]) for i in range(0, v * b, chunk)])
        kept = select_confident(logits.float().view(v, b, -1), cfg.selection)  # [k, B, C]
        c = kept.shape[-1]
        votes = torch.nn.functional.one_hot(kept.argmax(dim=-1), c).float().mean(dim=0)
        mean_probs = kept.softmax(dim=-1).mean(dim=0)
        return torch.log((1 - cfg.tie_eps) * votes + cfg.tie_eps * mean_probs)
