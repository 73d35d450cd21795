"""MuRA: Multi-Rank Adaptation at test time.

Paper: "MuRA: Multi-Rank Adaptation for test-time adaptation of vision-language models",
ICLR 2026 submission (OpenReview); no official code is public. The seed article sketches
it as parallel low-rank branches of ranks (4, 8, 16) beside frozen linear layers, fused by
softmax(merge_logits), optimised on augmented views, reset per batch.
What this implementation does (and where it departs):
* Adapters (``MultiRankLinear``) sit beside the frozen linear layers of the deepest
  ``blocks`` vision blocks, on the projections matched by ``targets``; fused attention is
  split into q/k/v/out linears first (numerically identical).
* Up-projections are zero-initialised, so the adapted model starts exactly at the source.
* Fusion ``softmax``: one learned logit per rank component, shared by all adapted layers.
* Self-supervised signal: ``views`` random resized crops of each test image (plus the
  original when ``include_original``), one batched forward; the loss comes from the loss
  registry (``info_max`` by default on batches; ``consistency`` is the seed's choice).
* Prediction is made on the original images after the update; adapters and fusion weights
  reset after every batch (``adapter_reset=batch``) or never (``never``, online).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from mura_plugin.adapters import MultiRankLinear, attach_adapters, vision_blocks
from mura_plugin.augment import random_resized_crops
from tta_bench.method import GradientConfig, GradientMethod
from tta_bench.model import ZeroShotClassifier

__all__ = ["MuRA", "MuRAConfig"]

FUSIONS = ("softmax",)
ADAPTER_RESETS = ("batch", "never")


@dataclass
class MuRAConfig(GradientConfig):
    ranks: list[int] = field(default_factory=lambda: [4, 8, 16])
    blocks: int = 1  # adapt the deepest N vision blocks
    targets: list[str] = field(
        default_factory=lambda: ["attn.q_proj", "attn.v_proj", "attn.out_proj", "mlp.*"]
    )
    alpha: float = 16.0  # component k is scaled by alpha / rank_k
    fusion: str = "softmax"
    views: int = 2  # augmented views per image
    include_original: bool = True
    crop_scale_min: float = 0.5
    loss: str = "info_max"
    optimizer: str = "adam"
    lr: float = 1e-3
    steps: int = 1
    adapter_reset: str = "batch"


class MuRA(GradientMethod):
    Config = MuRAConfig

    def configure(self, model: ZeroShotClassifier) -> None:
        cfg = self.config
        if cfg.fusion not in FUSIONS:
            raise ValueError(f"unknown fusion {cfg.fusion!r}; available: {', '.join(FUSIONS)}")
        if cfg.adapter_reset not in ADAPTER_RESETS:
            raise ValueError(
                f"unknown adapter_reset {cfg.adapter_reset!r}; available: "
                f"{', '.join(ADAPTER_RESETS)}"
            )
        if cfg.views < 1 and not cfg.include_original:
            raise ValueError("MuRA needs at least one view (views >= 1 or include_original)")
        blocks = vision_blocks(model.visual)
        if not 1 <= cfg.blocks <= len(blocks):
            raise ValueError(f"blocks must be in 1..{len(blocks)}, got {cfg.blocks}")
        self.adapters: dict[str, MultiRankLinear] = attach_adapters(
            blocks[-cfg.blocks :], cfg.targets, cfg.ranks, cfg.alpha
        )
        device = model.mean.device
        self.merge_logits = nn.Parameter(torch.zeros(len(cfg.ranks), device=device))

    def collect_params(self, model: ZeroShotClassifier) -> list[nn.Parameter]:
        params: list[nn.Parameter] = [self.merge_logits]
        for adapter in self.adapters.values():
            params += [adapter.lora_A, adapter.lora_B]
        return params

    def _set_fusion(self) -> None:
        weights = self.merge_logits.softmax(dim=0)
        for adapter in self.adapters.values():
            adapter.set_weights(weights)

    def _views(self, images: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        parts = []
        if cfg.include_original:
            parts.append(images.unsqueeze(0))
        if cfg.views > 0:
            parts.append(
                random_resized_crops(
                    images, cfg.views, self.generator, scale=(cfg.crop_scale_min, 1.0)
                )
            )
        return torch.cat(parts, dim=0)  # [V, B, C, H, W]

    def compute_loss(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._set_fusion()
        views = self._views(images)
        v, b = views.shape[:2]
        feats = self.model.encode_image(views.flatten(0, 1))
        logits = self.model.logits_from_features(feats)
        feats, logits = feats.view(v, b, -1), logits.view(v, b, -1)
        return self.loss_fn(logits, features=feats), logits[0]

    def predict(self, images: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self._set_fusion()
        return super().predict(images)

    def step(self, images: torch.Tensor) -> torch.Tensor:
        logits = super().step(images)
        if self.config.adapter_reset == "batch":
            self.reset()
        return logits
