"""TDA: training-free dynamic adapter with positive and negative caches (online).

Paper: Karmanov et al., "Efficient Test-Time Adaptation of Vision-Language Models",
CVPR 2024. Official code: https://github.com/kdiAAA/TDA (tda_runner.py, configs/).
Setting (defaults = the official ImageNet config): a positive cache of 3 shots per
pseudo-class (alpha 2.0, beta 5.0) and a negative cache of 2 shots per pseudo-class
(alpha 0.117, beta 1.0) filled only by samples whose entropy / log2(C) lies in (0.2, 0.5)
(the official normalisation), whose values are the masks ``0.03 < p < 1.0`` of their
predicted probabilities. A cache keeps, per class, the lowest-entropy samples. Per test
image: update the caches with it, then predict
``clip_logits + A_pos(f) - A_neg(f)``, ``A(f) = alpha * exp(-beta (1 - f K^T)) V``.
One view per image (the official setting for corruption and cross-domain sets).
Caches persist across batches (online) and are emptied by ``reset()``.
What differs and why: the official code assumes CLIP's logit scale of 100, to which its
alphas are tuned; here ``scale_alpha`` (default on) multiplies both alphas by
``logit_scale / 100`` so the cache terms keep their weight relative to the CLIP logits of a
model with another temperature. Caches are fixed-size tensors per class instead of lists
(same contents; sorting is irrelevant to the sum).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tta_bench.method import Method, autocast_context, check_precision

__all__ = ["TDA", "TDAConfig"]


@dataclass
class TDAConfig:
    pos_shots: int = 3
    pos_alpha: float = 2.0
    pos_beta: float = 5.0
    neg_shots: int = 2
    neg_alpha: float = 0.117
    neg_beta: float = 1.0
    neg_entropy_lower: float = 0.2
    neg_entropy_upper: float = 0.5
    neg_mask_lower: float = 0.03
    neg_mask_upper: float = 1.0
    scale_alpha: bool = True  # alphas are tuned for logit scale 100: rescale to the model's
    precision: str = "fp16"  # autocast on CUDA, as the official code runs CLIP; CPU: fp32


class _Cache:
    """Per-class slots of (feature, entropy, value); entropy inf marks an empty slot."""

    def __init__(self, classes: int, shots: int, dim: int, value_dim: int, device):
        self.keys = torch.zeros(classes, shots, dim, device=device)
        self.entropy = torch.full((classes, shots), math.inf, device=device)
        self.values = torch.zeros(classes, shots, value_dim, device=device)

    def offer(self, cls: int, key: torch.Tensor, ent: float, value: torch.Tensor) -> None:
        """Insert into a free slot, else replace the highest-entropy one if ``ent`` is lower."""
        slot = int(self.entropy[cls].argmax())
        if ent < float(self.entropy[cls, slot]):
            self.keys[cls, slot] = key
            self.entropy[cls, slot] = ent
            self.values[cls, slot] = value

    def logits(self, feature: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
        valid = torch.isfinite(self.entropy).flatten()
        if not bool(valid.any()):
            return torch.zeros(self.values.shape[-1], device=feature.device)
        keys = self.keys.flatten(0, 1)[valid]
        values = self.values.flatten(0, 1)[valid]
        affinity = keys @ feature
        return alpha * (torch.exp(-beta * (1 - affinity)) @ values)


class TDA(Method):
    Config = TDAConfig

    def setup(self) -> None:
        cfg = self.config
        check_precision(cfg.precision)
        if cfg.pos_shots < 1 or cfg.neg_shots < 1:
            raise ValueError(f"shots must be >= 1, got {cfg.pos_shots} and {cfg.neg_shots}")
        self.reset()

    def reset(self) -> None:
        c, d = self.model.class_embeddings.shape
        dev = self.device
        self.pos = _Cache(c, self.config.pos_shots, d, c, dev)
        self.neg = _Cache(c, self.config.neg_shots, d, c, dev)

    @torch.no_grad()
    def step(self, images: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        with autocast_context(cfg.precision, self.device):
            feats = self.model.encode_image(images)
        feats = feats.float()
        feats = feats / feats.norm(dim=-1, keepdim=True)
        logits = self.model.logits_from_features(feats).float()
        probs = logits.softmax(dim=-1)
        c = logits.shape[-1]
        ent = -(probs * probs.clamp_min(1e-12).log()).sum(dim=-1)
        prop = ent / math.log2(c)  # the official normalisation
        ratio = float(self.model.logit_scale) / 100.0 if cfg.scale_alpha else 1.0
        eye = torch.eye(c, device=logits.device)
        out = []
        for i in range(images.shape[0]):
            pred = int(logits[i].argmax())
            self.pos.offer(pred, feats[i], float(ent[i]), eye[pred])
            if cfg.neg_entropy_lower < float(prop[i]) < cfg.neg_entropy_upper:
                mask = (probs[i] > cfg.neg_mask_lower) & (probs[i] < cfg.neg_mask_upper)
                self.neg.offer(pred, feats[i], float(ent[i]), mask.float())
            final = logits[i].clone()
            final += self.pos.logits(feats[i], cfg.pos_alpha * ratio, cfg.pos_beta)
            final -= self.neg.logits(feats[i], cfg.neg_alpha * ratio, cfg.neg_beta)
            out.append(final)
        return torch.stack(out)
