"""TDA: training-free dynamic adapter with positive and negative caches (online).

Paper: Karmanov et al., "Efficient Test-Time Adaptation of Vision-Language Models",
CVPR 2024. Official code: https://github.com/kdiAAA/TDA, read at commit
e697fb0c8078cdeff93daa56bcf8860702542069 (tda_runner.py, utils.py, configs/*.yaml,
datasets/*.py, datasets/utils.py, datasets/augmix_ops.py, clip/clip.py).

Setting (defaults = the official configs): a positive cache of 3 shots per pseudo-class and
a negative cache of 2 shots per pseudo-class (alpha 0.117, beta 1.0) filled only by samples
whose entropy / log2(C) lies in (0.2, 0.5) (the official normalisation: nats over log2),
whose values are the masks ``0.03 < p < 1.0`` of their predicted probabilities. A cache
keeps, per class, the lowest-entropy samples. Per test image: update the caches with it,
then predict ``clip_logits + A_pos(f) - A_neg(f)``, ``A(f) = alpha * exp(-beta (1 - f K^T)) V``.
Per dataset, as the official code selects them (``self.model.dataset``):

* input (``views=official``): the image alone on ImageNet, its corruptions and every other
  set; on the natural shifts (ImageNet-A, -V2, -R, -Sketch: ``get_ood_preprocess``) the
  image + 63 AugMix views (RandomResizedCrop + flip, then the official AugMix, augment.py),
  of which the ``int(64 * 0.1) = 6`` lowest-entropy give the mean logits, the entropy of
  their mean probability, their mean probability, and the cache key: their mean feature,
  not renormalised (``get_clip_logits``). ``views=single|multi`` forces one input;
* positive cache (alpha, beta) (``pos_alpha`` / ``pos_beta`` None): ImageNet and -A
  (2.0, 5.0), -V2 and -R (1.0, 8.0), -Sketch (2.363, 7.45); the ten cross-domain sets
  their own configs (``POSITIVE``: Caltech101 (5, 5), DTD (2, 3), EuroSAT (4, 8), Aircraft
  (2, 2), Food101 (1, 1), Flowers (1, 5), Pets (2, 7), Cars (1, 7), SUN397 (2, 3), UCF101
  (3, 8)), each read as the image alone (CLIP's preprocess); ImageNet's elsewhere. The
  negative cache's settings are the same in every official config;
* official head (``text_head=official``): the 7-template ensemble of its ImageNet, -A and
  -V2 loaders, CLIP's 80 templates for -R and -Sketch, on the cross-domain sets its
  loaders' templates, held by the catalogue (``official_templates``: the 7 ImageNet
  templates on Caltech101, StanfordCars and SUN397, CoOp's one template on the others);
  the default ``protocol`` is the protocol's templates (CoOp's template there). The head
  is the method's own tensor: the shared model is never changed.
Caches persist across batches (online) and are emptied by ``reset()``.

What differs and why:
* The official code assumes CLIP's logit scale of 100, to which its alphas are tuned;
  ``scale_alpha`` (default on) multiplies both alphas by ``logit_scale / 100`` so the cache
  terms keep their weight relative to the CLIP logits of a model with another temperature.
* Precision: the official model is fp16 throughout (``clip.load`` converts the weights;
  cache values and affinities are half too); here fp16 autocast on CUDA over fp32 weights
  (LayerNorm, softmax and the cache arithmetic in float32), float32 on the CPU.
* Sets the official code does not cover follow the nearest rule: ImageNet-C as ImageNet
  (one view, 7 templates); the domains of the ``imagenet-ood`` suite are named by their own
  dataset (the harness gives each domain's classifier its dataset), so they follow their
  official rules; a stream named only ``imagenet_ood`` takes multi-view and the 7
  templates and ImageNet's alphas; other sets use the single prompt "a photo of a {}." as
  the official head.
* Views: torchvision's RandomResizedCrop boxes on the image at the model's size, one
  batched ``grid_sample`` (augment.py), not PIL transforms of the raw image.
* Caches are fixed-size tensors per class instead of sorted lists. The contents are the
  official ones, ties included: a full class evicts, among its highest-entropy entries,
  the most recently inserted one, as the official stable sort does (``_Cache``; tested).
  The cache logits sum the entries in slot order, not in entropy order: equal up to float
  rounding.

Measured effect (the official parameterisation, the official head): docs/methods.md#tda.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from mura_plugin.losses import view_entropy
from mura_plugin.methods._cache import CacheFields, two_caches
from mura_plugin.methods._text_heads import SINGLE_PROMPT, OwnHead, class_head
from mura_plugin.methods._text_heads import TEXT_HEADS as TEXT_HEAD_CHOICES
from mura_plugin.methods._view_budget import encode_flat, encode_in_chunks
from mura_plugin.methods._view_config import original_first
from tta_bench.bounds import bounded, one_of
from tta_bench.method import PRECISIONS, Method, autocast_context, effective_precision
from tta_bench.text_head import resolve_templates

__all__ = ["TDA", "TDAConfig", "VIEWS", "official_templates", "uses_views"]

#: official: per dataset as the official code (``multi`` on the natural-shift sets);
#: single: the image alone; multi: the image + ``n_views`` AugMix views, confident ones kept.
VIEWS = ("official", "single", "multi")
#: Where the official code (utils.py: ``get_ood_preprocess``) uses the multi-view input.
MULTI_VIEW_SETS = ("imagenet_a", "imagenet_r", "imagenet_v2", "imagenet_sketch", "imagenet_ood")
#: The 7-template ensemble of the official ImageNet, ImageNet-A and ImageNet-V2 loaders.
IMAGENET_7 = (
    "itap of a {}.",
    "a bad photo of the {}.",
    "a origami {}.",
    "a photo of the large {}.",
    "a {} in a video game.",
    "art of the {}.",
    "a photo of the small {}.",
)
#: Positive-cache (alpha, beta) of the official configs/*.yaml (imagenet.yaml elsewhere).
POSITIVE = {
    "imagenet": (2.0, 5.0),
    "imagenet_a": (2.0, 5.0),
    "imagenet_v2": (1.0, 8.0),
    "imagenet_r": (1.0, 8.0),
    "imagenet_sketch": (2.363, 7.45),
    # the ten cross-domain sets (configs/caltech101.yaml ... ucf101.yaml; fgvc.yaml)
    "caltech101": (5.0, 5.0),
    "dtd": (2.0, 3.0),
    "eurosat": (4.0, 8.0),
    "fgvc_aircraft": (2.0, 2.0),
    "food101": (1.0, 1.0),
    "oxford_flowers": (1.0, 5.0),
    "oxford_pets": (2.0, 7.0),
    "stanford_cars": (1.0, 7.0),
    "sun397": (2.0, 3.0),
    "ucf101": (3.0, 8.0),
}


def official_templates(dataset: str | None) -> list[str]:
    """The official head for ``dataset``: 7 templates on ImageNet, -A, -V2 (and -C and the
    mixed ``imagenet_ood`` suite, which the official code does not cover), CLIP's 80 on
    ImageNet-R and -Sketch, the dataset catalogue's ``official_templates`` (TDA's loaders:
    the ten cross-domain sets), else (no official loader) the single prompt."""
    if dataset in ("imagenet_r", "imagenet_sketch"):
        return resolve_templates("clip-imagenet-80")
    if dataset in ("imagenet", "imagenet_c", "imagenet_a", "imagenet_v2", "imagenet_ood"):
        return list(IMAGENET_7)
    if dataset:
        from tta_bench import catalog

        listed = catalog.entry("datasets", dataset).get("official_templates")
        if listed:
            return resolve_templates(listed)
    return list(SINGLE_PROMPT)


def uses_views(views: str, dataset: str | None) -> bool:
    """Whether ``views`` means the multi-view input on ``dataset``."""
    if views not in VIEWS:
        raise ValueError(f"unknown views {views!r}; available: {', '.join(VIEWS)}")
    return views == "multi" or (views == "official" and dataset in MULTI_VIEW_SETS)


@dataclass
class TDAConfig(CacheFields):
    # pos_alpha / pos_beta None: the official value for the dataset (POSITIVE)
    views: str = "official"  # official | single | multi (see VIEWS)
    # the multi-view input (official: original + 63 AugMix views, 10% lowest-entropy kept)
    n_views: int = bounded(63, ge=1)
    selection: float = bounded(0.1, gt=0, le=1)
    augmix: bool = True
    text_head: str = one_of(
        "protocol", TEXT_HEAD_CHOICES
    )  # protocol | official (official_templates)
    precision: str = one_of(
        "fp16", PRECISIONS
    )  # autocast on CUDA (the official code runs CLIP in fp16); CPU: fp32


class TDA(OwnHead, Method):
    Config = TDAConfig
    #: one forward of the image per sample with the defaults on the digits and corruption
    #: suites (views=official is single-view there), no backward: sweeps pack its jobs
    light = True
    stream_kind = "online"

    def setup(self) -> None:
        cfg = self.config
        dataset = self.model.dataset
        self.multi_view = uses_views(cfg.views, dataset)
        alpha, beta = POSITIVE.get(dataset or "", POSITIVE["imagenet"])
        self.pos_alpha = alpha if cfg.pos_alpha is None else cfg.pos_alpha
        self.pos_beta = beta if cfg.pos_beta is None else cfg.pos_beta
        # the method's own head: the shared model is never changed (adapts = False)
        self.head = class_head(self.model, cfg.text_head, official_templates(dataset))
        self.reset()

    def reset(self) -> None:
        self.pos, self.neg = two_caches(self.head, self.config, self.device)

    def _inputs(self, images: torch.Tensor):
        """Per image: cache key ``[B, D]``, CLIP logits ``[B, C]``, entropy ``[B]`` (nats),
        probabilities ``[B, C]`` (official ``get_clip_logits``). Multi-view: of the original
        + ``n_views`` AugMix views, the ``int(V * selection)`` lowest-entropy ones give the
        mean feature (not renormalised), the mean logits, the entropy of the mean
        probability and the mean probability."""
        cfg = self.config
        scale = self.model.logit_scale
        if not self.multi_view:
            with autocast_context(cfg.precision, self.device):
                feats = self.model.encode_image(images)
            return self._single_view(feats)

        def encode(views: torch.Tensor) -> torch.Tensor:
            with autocast_context(cfg.precision, self.device):
                return encode_flat(self.model.encode_image, views, cfg.chunk_views).float()

        def reduce(feats: torch.Tensor) -> tuple[torch.Tensor, ...]:  # [V, b, D], per sample
            v = feats.shape[0]
            logits = scale * feats @ self.head.t().float()  # [V, b, C]
            k = max(1, int(v * cfg.selection))
            chosen = view_entropy(logits).argsort(dim=0)[:k]  # [k, b]
            kept = logits.gather(0, chosen[..., None].expand(-1, -1, logits.shape[-1]))
            key = feats.gather(0, chosen[..., None].expand(-1, -1, feats.shape[-1])).mean(dim=0)
            log_mean = kept.log_softmax(dim=-1).logsumexp(dim=0) - math.log(k)
            probs = kept.softmax(dim=-1).mean(dim=0)
            return key, kept.mean(dim=0), -(log_mean.exp() * log_mean).sum(dim=-1), probs

        settings = _view_settings(cfg)
        return encode_in_chunks(
            images, settings, self.generator, encode, cfg.view_memory_mb, reduce=reduce
        )

    def _single_view(self, feats: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``_inputs`` of one view from its image features (renormalised in float32)."""
        feats = feats.float()
        feats = feats / feats.norm(dim=-1, keepdim=True)
        logits = self.model.logits_from_features(feats, self.head).float()
        return feats, logits, view_entropy(logits), logits.softmax(dim=-1)

    def features_only(self) -> bool:
        return (
            not self.multi_view
            and effective_precision(self.config.precision, self.device) == "fp32"
        )

    @torch.no_grad()
    def step_features(self, features: torch.Tensor) -> torch.Tensor:
        return self._update(*self._single_view(features))

    @torch.no_grad()
    def step(self, images: torch.Tensor) -> torch.Tensor:
        return self._update(*self._inputs(images))

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """The realtime track's prediction while busy: the single-view logits corrected by
        both caches as they stand, offering nothing to them."""
        with autocast_context(self.config.precision, self.device):
            feats, logits, _, _ = self._single_view(self.model.encode_image(images))
        cfg = self.config
        ratio = float(self.model.logit_scale) / 100.0 if cfg.scale_alpha else 1.0
        pos_alpha, neg_alpha = self.pos_alpha * ratio, cfg.neg_alpha * ratio
        return torch.stack([
            logits[i] + self.pos.logits(f, pos_alpha, self.pos_beta)
            - self.neg.logits(f, neg_alpha, cfg.neg_beta)
            for i, f in enumerate(feats)
        ])  # fmt: skip

    def _update(
        self, feats: torch.Tensor, logits: torch.Tensor, ent: torch.Tensor, probs: torch.Tensor
    ) -> torch.Tensor:
        """Offer each image to the caches in order and return its cache-corrected logits."""
        cfg = self.config
        c = logits.shape[-1]
        prop = ent / math.log2(c)  # the official normalisation
        ratio = float(self.model.logit_scale) / 100.0 if cfg.scale_alpha else 1.0
        eye = torch.eye(c, device=logits.device)
        # per-sample scalars read once for the batch (the same values as element by element)
        preds, ents, props = logits.argmax(dim=1).tolist(), ent.tolist(), prop.tolist()
        pos_alpha, neg_alpha = self.pos_alpha * ratio, cfg.neg_alpha * ratio
        rows, one_hot = feats.unbind(0), eye.unbind(0)  # views, taken once per batch
        out = []
        for i, (pred, entropy) in enumerate(zip(preds, ents)):
            self.pos.offer(pred, rows[i], entropy, one_hot[pred])
            if cfg.neg_entropy_lower < props[i] < cfg.neg_entropy_upper:
                mask = (probs[i] > cfg.neg_mask_lower) & (probs[i] < cfg.neg_mask_upper)
                self.neg.offer(pred, rows[i], entropy, mask.float())
            final = logits[i] + self.pos.logits(rows[i], pos_alpha, self.pos_beta)
            out.append(final - self.neg.logits(rows[i], neg_alpha, cfg.neg_beta))
        return torch.stack(out)


def _view_settings(cfg: TDAConfig) -> SimpleNamespace:
    """``configured_views``' fields for TDA's multi-view input (the original always first)."""
    return original_first(cfg, cfg.n_views, cfg.augmix)
