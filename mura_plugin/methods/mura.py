"""MuRA: Multi-Rank Adaptation at test time.

Paper: "MuRA: Multi-Rank Adaptation for test-time adaptation of vision-language models",
ICLR 2026 submission (OpenReview); no official code is public, so this follows the
published description (PROTOCOLS.md "Method settings"):
* several low-rank components of *different ranks* (``ranks``, default 4, 8, 16) beside
  the frozen linear layers of the deepest vision block only (``blocks=1``);
* SVD-based orthogonal initialisation (MROD): component k takes its own slice of the frozen
  weight's singular vectors and the frozen path is compensated, so the model starts exactly
  at the source (``init=svd``; ``zero`` is the LoRA init);
* a soft token-level router mixing the components (UCF, ``fusion=router``): one small
  zero-initialised linear per adapted layer, per-token softmax weights over components;
* the router persists across samples (CRU, ``router_persist``) while the adapters reset
  after every sample (``episodic=sample``);
* 63 augmented views + the original in one batched forward, entropy-weighted loss
  (``weighted_entropy``), 1 AdamW step; the prediction is made on the original image
  after the update.
The seed article's sketch is reachable by config: ``method.fusion=softmax method.init=zero
method.loss=consistency`` (global softmax(merge_logits) fusion, B = 0 init, negative
cosine similarity of view features); ``episodic=batch`` is its per-batch reset.

What is assumed where the description is silent (and why):
* projections adapted: ``attn.q`` and ``attn.v`` (TTL's choice, so that MuRA with one rank
  and fixed weight *is* TTL's LoRA: the ablation isolates multi-rank/fusion/init/depth);
* augmentation, optimiser and learning rate are TTL/TPT's (RandomResizedCrop + flip,
  AdamW 5e-3, weight decay 0.01 = torch's AdamW default used by their code);
* scaling ``alpha / r_k`` with ``alpha = 16`` (scale 1 for the rank-16 component);
* the singular-vector slices are taken from the top, in the order of ``ranks``.
Cost: autograd never goes below the first adapted block (its input is detached), so the
backward pass covers only the adapted block(s); the frozen earlier blocks build no graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mura_plugin.adapters import INITS, MultiRankLinear, attach_adapters, vision_blocks
from mura_plugin.methods._views import MultiViewConfig, MultiViewMethod
from tta_bench.model import ZeroShotClassifier

__all__ = ["MuRA", "MuRAConfig", "FUSIONS"]

#: softmax: learned global weights over components; router: per-token learned weights;
#: none: every component with weight 1 (plain LoRA when there is one component).
FUSIONS = ("softmax", "router", "none")


@dataclass
class MuRAConfig(MultiViewConfig):
    ranks: list[int] = field(default_factory=lambda: [4, 8, 16])
    blocks: int = 1  # adapt the deepest N vision blocks
    targets: list[str] = field(default_factory=lambda: ["attn.q", "attn.v"])
    alpha: float = 16.0  # component k is scaled by alpha / rank_k
    init: str = "svd"
    fusion: str = "router"
    router_persist: bool = True
    loss: str = "weighted_entropy"
    optimizer: str = "adamw"
    lr: float = 5e-3
    weight_decay: float = 0.01
    steps: int = 1


def _detach_inputs(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)


class MuRA(MultiViewMethod):
    Config = MuRAConfig

    def configure(self, model: ZeroShotClassifier) -> None:
        cfg = self.config
        if cfg.fusion not in FUSIONS:
            raise ValueError(f"unknown fusion {cfg.fusion!r}; available: {', '.join(FUSIONS)}")
        if cfg.init not in INITS:
            raise ValueError(f"unknown init {cfg.init!r}; available: {', '.join(INITS)}")
        blocks = vision_blocks(model.visual)
        if not 1 <= cfg.blocks <= len(blocks):
            raise ValueError(f"blocks must be in 1..{len(blocks)}, got {cfg.blocks}")
        adapted = blocks[-cfg.blocks :]
        k = len(cfg.ranks)
        init_weights = torch.full((k,), 1.0 / k if cfg.fusion != "none" else 1.0)
        self.adapters: dict[str, MultiRankLinear] = attach_adapters(
            adapted,
            cfg.targets,
            cfg.ranks,
            cfg.alpha,
            init=cfg.init,
            router=cfg.fusion == "router",
            init_weights=init_weights,
        )
        self.merge_logits = (
            nn.Parameter(torch.zeros(k, device=model.mean.device))
            if cfg.fusion == "softmax"
            else None
        )
        # Autograd stops at the first adapted block: backward covers only adapted blocks.
        self._hook = adapted[0].register_forward_pre_hook(_detach_inputs)

    def collect_params(self, model: ZeroShotClassifier) -> list[nn.Parameter]:
        params: list[nn.Parameter] = [] if self.merge_logits is None else [self.merge_logits]
        for adapter in self.adapters.values():
            params += adapter.adapter_parameters() + adapter.router_parameters()
        return params

    def episode_parameters(self) -> list[nn.Parameter]:
        """Adapters (and global fusion weights) reset per episode; the router persists
        across episodes when ``router_persist`` (restored only by ``reset()``)."""
        if self.config.router_persist:
            keep = {id(p) for a in self.adapters.values() for p in a.router_parameters()}
            return [p for p in self.params if id(p) not in keep]
        return list(self.params)

    def _set_fusion(self) -> None:
        weights = None if self.merge_logits is None else self.merge_logits.softmax(dim=0)
        for adapter in self.adapters.values():
            adapter.set_weights(weights)

    def view_loss(self, views: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._set_fusion()
        v, b = views.shape[:2]
        feats = self.model.encode_image(views.flatten(0, 1))
        logits = self.model.logits_from_features(feats)
        feats, logits = feats.view(v, b, -1), logits.view(v, b, -1)
        return self.loss_fn(logits, features=feats), logits

    def predict(self, images: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self._set_fusion()
        return super().predict(images)
