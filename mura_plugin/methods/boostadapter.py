"""BoostAdapter: TDA's historical caches plus boosting samples of the test image (online).

Paper: Zhang et al., "BoostAdapter: Improving Vision-Language Test-Time Adaptation via
Regional Bootstrapping", NeurIPS 2024 (https://arxiv.org/abs/2410.15430). Official code:
https://github.com/taolinzhang/BoostAdapter, read at commit
9983e1a1fdbd8587177d89a594d19458ad181a30 (runner.py, utils.py, scripts/run.sh,
configs/*.yaml, datasets/utils.py, datasets/resize_crop.py, datasets/imagenet*.py,
datasets/__init__.py; the code is TDA's, ``--mode boostadapter``).

Setting (defaults = the official code, ``scripts/run.sh``: ``--mode boostadapter --views 64``):
per test image, 64 views, the image itself and 63 RandomResizedCrop(scale 0.08-1) +
horizontal flip views without AugMix (``AugMixAugmenter(..., augmix=False)``); their CLIP
logits and normalised features.

* Query (``input``): on the corruption and cross-domain sets (the official
  ``infer_ori_image`` list: ``contrast/jpeg/pixelate/...``) the original image: its feature,
  logits, entropy, probability and prediction (``original``). On the natural shifts
  (ImageNet-A, -V2, -R, -Sketch) TDA's confident input: the ``int(64 * 0.1) = 6``
  lowest-entropy views give the mean feature (not renormalised), the mean logits, the
  entropy of the mean probability and its argmax (``confident``). Clean ImageNet is loaded
  with CLIP's single-view preprocess there: one view, no boosting samples, so BoostAdapter
  is TDA with its FIFO negative cache (``single``). ``input=official`` picks per dataset.
* Historical positive cache: TDA's, 3 shots per pseudo-class, the lowest-entropy entries
  kept (stable sort; ``_cache.EntropyCache``), one-hot values.
* Boosting samples: the ``int(64 * 0.1) = 6`` lowest-entropy of all 64 views (the original
  included) are offered, with their own prediction and entropy, to a copy of the positive
  cache with ``3 + delta`` shots per class (the same lowest-entropy rule: boosting samples
  compete with the historical entries of their class); the copy is used for this image only.
* Negative cache: 2 shots, alpha 0.117, beta 1.0, entered when entropy / log2(C) lies in
  (0.2, 0.5), values the masks ``0.03 < p < 1.0``; official BoostAdapter passes ``True`` as
  ``include_prob_map`` and leaves ``fifo=True``: it keeps the latest 2 entries per class
  (TDA keeps the lowest-entropy ones) (``neg_fifo``).
* Logits: ``clip_logits + A(f; boosted positive copy) - A(f; negative)`` with TDA's
  affinity ``A(f) = alpha * exp(-beta (1 - f K^T)) V``; order per image: positive update,
  boosted copy, negative update, logits.
* (alpha, beta, delta) per dataset (``pos_alpha``/``pos_beta``/``delta`` None), configs:
  ImageNet (2.0, 5.0, -), -A (2.0, 5.0, 3), -V2 (1.0, 8.0, 1), -R (1.0, 8.0, 3), -Sketch
  (2.363, 7.45, 1). Other sets (ImageNet-C, the digits and CIFAR suites) take ImageNet's
  (2.0, 5.0); imagenet.yaml has no delta (one view: none is needed), so ``default_delta``
  is 3, the ``--delta 3`` of scripts/run.sh (which ``runner.py`` never reads: it takes
  ``cfg['delta']``) and ImageNet-A's, whose alpha/beta are ImageNet's. The ten
  cross-domain sets have their own configs (``OFFICIAL``: e.g. Caltech101 (5, 5, 2),
  Food101 (1, 1, 3), DTD (2, 3, 0)); there the query is the original image
  (``get_cross_dataset_preprocess``: the image + 63 crop-and-flip views, no AugMix, and its
  ``infer_ori_image`` rule), as ``official_input`` gives every set but ImageNet and its
  natural shifts.
* Official head (``text_head=official``): TDA's loaders, the same here: 7 templates on
  ImageNet, -A, -V2, CLIP's 80 on -R and -Sketch, the catalogue's ``official_templates``
  on the cross-domain sets (``tda.official_templates``).

TTA-VLM (TomSheng21/tta-vlm at commit bcc735fe49cbd2ab5b683781c41c66e1d3f78589,
online_method/boostadapter.py, online_tta.py) departs from it (``tta_vlm``):

* ``input="original"``: the original image is the query on every set, ImageNet and the
  natural shifts included (always 64 views);
* ``entropy_eps=1e-5``: the entropies stored in the caches and the negative gate are
  ``-sum p log(p + 1e-5)`` (the view ranking keeps the exact entropy);
* ``default_delta=1``: its ImageNet ('I') delta, which the uncovered sets take here.

Not in ``tta_vlm``, set by the harness's option itself (``tta_bench.run.profiles``): AugMix on
its fine-grained sets (``AugMixAugmenter(..., augmix=len(dset) > 1)``: ``augmix`` follows
the catalogue's ``fine_grained``), its single prompt "a photo of a {}." (``--ctx_init
a_photo_of_a``, as the protocol's templates) and its stream of batch size 1. Its cache
values are float32 under autocast (the official: fp16).

What differs and why:

* Alphas: as TDA here, ``scale_alpha`` (default on) multiplies both alphas by
  ``logit_scale / 100`` (the official code assumes CLIP's 100).
* Precision: the official model is fp16 throughout (``clip.load``); here fp16 autocast on
  CUDA over fp32 weights, features, caches and affinities in float32; float32 on the CPU.
* Views: torchvision's RandomResizedCrop boxes on the image at the model's size, one
  batched ``grid_sample`` (augment.py), not PIL crops of the raw image (the official
  ``resize_crop.RandomResizedCrop`` is torchvision's with bilinear, antialiased resizing).
* Ranking ties: a stable sort (the official ``torch.argsort`` is not stable).
* Caches are TDA's fixed-size tensors per class (``_cache.EntropyCache``, which reproduces the
  official stable-sort eviction); the boosted copy is a tensor copy with ``delta`` more
  slots; the FIFO negative cache replaces its oldest entry.

Measured effect: docs/methods.md#boostadapter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import torch

from mura_plugin.losses import view_entropy
from mura_plugin.methods._cache import CacheFields, EntropyCache, two_caches
from mura_plugin.methods._text_heads import TEXT_HEADS, OwnHead, class_head
from mura_plugin.methods._view_budget import encode_flat, encode_in_chunks
from mura_plugin.methods._view_config import original_first
from mura_plugin.methods.tda import official_templates
from tta_bench.bounds import bounded, one_of
from tta_bench.method import PRECISIONS, Method, autocast_context

__all__ = [
    "BoostAdapter",
    "BoostAdapterConfig",
    "INPUTS",
    "boosted_cache",
    "official_input",
]

#: official: per dataset (``official_input``); single: the image alone, no boosting;
#: original: the image is the query, its views the boosting samples; confident: the mean of
#: the confident views is the query (TDA's multi-view input), the views boosting samples.
INPUTS = ("official", "single", "original", "confident")
#: Where the official query is the confident views' mean (its natural-shift loaders).
NATURAL_SHIFTS = ("imagenet_a", "imagenet_v2", "imagenet_r", "imagenet_sketch", "imagenet_ood")
#: (alpha, beta, delta) of the official configs/*.yaml (imagenet.yaml has no delta).
OFFICIAL = {
    "imagenet": (2.0, 5.0, None),
    "imagenet_a": (2.0, 5.0, 3),
    "imagenet_v2": (1.0, 8.0, 1),
    "imagenet_r": (1.0, 8.0, 3),
    "imagenet_sketch": (2.363, 7.45, 1),
    # the ten cross-domain sets (configs/<set>.yaml; fgvc.yaml for fgvc_aircraft)
    "caltech101": (5.0, 5.0, 2),
    "dtd": (2.0, 3.0, 0),
    "eurosat": (4.0, 8.0, 0),
    "fgvc_aircraft": (2.0, 2.0, 2),
    "food101": (1.0, 1.0, 3),
    "oxford_flowers": (1.0, 5.0, 0),
    "oxford_pets": (2.0, 7.0, 0),
    "stanford_cars": (1.0, 7.0, 3),
    "sun397": (2.0, 3.0, 1),
    "ucf101": (3.0, 8.0, 0),
}


def official_input(dataset: str | None) -> str:
    """The official query rule for ``dataset`` (see the module docstring)."""
    if dataset in NATURAL_SHIFTS:
        return "confident"
    if dataset == "imagenet":
        return "single"
    return "original"


@dataclass
class BoostAdapterConfig(CacheFields):
    # pos_alpha / pos_beta None: the official value for the dataset (OFFICIAL, else
    # ImageNet's)
    # extra positive slots per class for the boosting samples; None: the dataset's config
    delta: Optional[int] = bounded(None, ge=0)
    default_delta: int = bounded(3, ge=0)  # sets without an official delta
    neg_fifo: bool = True  # official BoostAdapter: the latest entries (TDA: lowest entropy)
    input: str = one_of("official", INPUTS)
    n_views: int = bounded(63, ge=1)  # besides the original (--views 64)
    # fraction of the views kept: the confident query and the boosting samples (int(V * 0.1))
    selection: float = bounded(0.1, gt=0, le=1)
    augmix: bool = False  # AugMix each view (official: crops + flips only)
    entropy_eps: float = bounded(0.0, ge=0)  # TTA-VLM's -sum p log(p + 1e-5); 0: exact
    text_head: str = one_of("protocol", TEXT_HEADS)  # protocol | official (official_templates)
    precision: str = one_of(
        "fp16", PRECISIONS
    )  # autocast on CUDA (the official code runs CLIP in fp16); CPU: fp32


def _entropy(logits: torch.Tensor, eps: float) -> torch.Tensor:
    """Entropy (nats) of ``softmax(logits)`` over the last axis: exact (``eps`` 0) or
    TTA-VLM's ``-sum p log(p + eps)``."""
    if eps == 0:
        return view_entropy(logits)
    return _prob_entropy(logits.float().softmax(dim=-1), eps)


def _prob_entropy(probs: torch.Tensor, eps: float) -> torch.Tensor:
    """TTA-VLM's ``-sum p log(p + eps)`` of probabilities ``[..., C]``."""
    return -(probs * torch.log(probs + eps)).sum(dim=-1)


def boosted_cache(
    pos: EntropyCache, keys: torch.Tensor, preds: torch.Tensor, ents: torch.Tensor, delta: int
) -> EntropyCache:
    """A copy of the historical positive cache with ``delta`` more slots per class, offered
    the boosting samples (``keys [k, D]``, predictions ``[k]``, entropies ``[k]``) in order:
    the official ``deepcopy(pos_cache)`` + ``update_cache(..., shot_capacity + delta,
    fifo=False)``. ``pos`` is not changed."""
    c, shots, d = pos.keys.shape
    out = EntropyCache(c, shots + delta, d, pos.values.shape[-1], pos.keys.device)
    out.keys[:, :shots] = pos.keys
    out.entropy[:, :shots] = pos.entropy
    out.values[:, :shots] = pos.values
    out.stamp[:, :shots] = pos.stamp
    out.inserted = pos.inserted
    eye = torch.eye(c, device=pos.keys.device)
    for key, pred, ent in zip(keys, preds.tolist(), ents.tolist()):
        out.offer(int(pred), key, float(ent), eye[int(pred)])
    return out


class _FifoCache(EntropyCache):
    """A cache that keeps the latest ``shots`` entries per class (the official
    ``update_cache(..., fifo=True)``): a free slot, else the oldest entry's."""

    def offer(self, cls: int, key: torch.Tensor, ent: float, value: torch.Tensor) -> None:
        free = ~torch.isfinite(self.entropy[cls])
        slot = int(free.int().argmax()) if bool(free.any()) else int(self.stamp[cls].argmin())
        self.keys[cls, slot] = key
        self.entropy[cls, slot] = ent
        self.values[cls, slot] = value
        self.stamp[cls, slot] = self.inserted
        self.inserted += 1
        self.changed(cls)


class BoostAdapter(OwnHead, Method):
    Config = BoostAdapterConfig
    resolved = ("input", "pos_alpha", "pos_beta", "delta")
    stream_kind = "online"
    adapts = False  # caches live in the method; the shared model is never changed

    def setup(self) -> None:
        cfg = self.config
        dataset = self.model.dataset
        self.input = official_input(dataset) if cfg.input == "official" else cfg.input
        alpha, beta, delta = OFFICIAL.get(dataset or "", OFFICIAL["imagenet"])
        self.pos_alpha = alpha if cfg.pos_alpha is None else cfg.pos_alpha
        self.pos_beta = beta if cfg.pos_beta is None else cfg.pos_beta
        if cfg.delta is not None:
            delta = cfg.delta
        self.delta = cfg.default_delta if delta is None else delta
        # the method's own head: the shared model is never changed (adapts = False)
        self.head = class_head(self.model, cfg.text_head, official_templates(dataset))
        self.reset()

    def reset(self) -> None:
        negative = _FifoCache if self.config.neg_fifo else EntropyCache
        self.pos, self.neg = two_caches(self.head, self.config, self.device, negative)

    def _encode(self, images: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        with autocast_context(cfg.precision, self.device):
            feats = torch.cat(
                [
                    self.model.encode_image(images[i : i + cfg.chunk_views])
                    for i in range(0, len(images), cfg.chunk_views)
                ]
            )
        feats = feats.float()
        return feats / feats.norm(dim=-1, keepdim=True)

    def _inputs(self, images: torch.Tensor):
        """Per image: query feature ``[B, D]``, logits ``[B, C]``, entropy ``[B]`` (nats),
        probabilities ``[B, C]``; and the boosting samples: features ``[k, B, D]``,
        predictions ``[k, B]``, entropies ``[k, B]`` (``k = int(V * selection)`` of the
        ``V`` views; None for ``input=single``)."""
        cfg, eps = self.config, self.config.entropy_eps
        scale = self.model.logit_scale
        head = self.head.float()
        if self.input == "single":
            feats = self._encode(images)
            logits = (scale * feats @ head.t()).float()
            return feats, logits, _entropy(logits, eps), logits.softmax(dim=-1), None
        settings = _view_settings(cfg)

        def encode(views: torch.Tensor) -> torch.Tensor:
            return encode_flat(self._encode, views, len(views.flatten(0, 1)))

        feats = encode_in_chunks(images, settings, self.generator, encode, cfg.view_memory_mb)
        v = feats.shape[0]
        logits = (scale * feats @ head.t()).float()  # [V, B, C]
        order = view_entropy(logits).argsort(dim=0, stable=True)  # [V, B], exact entropy
        if self.input == "original":
            q_feat, q_logits = feats[0], logits[0]
            q_ent, q_probs = _entropy(q_logits, eps), q_logits.softmax(dim=-1)
        else:
            k = max(1, int(v * cfg.selection))
            chosen = order[:k]
            kept = logits.gather(0, chosen[..., None].expand(-1, -1, logits.shape[-1]))
            q_feat = feats.gather(0, chosen[..., None].expand(-1, -1, feats.shape[-1])).mean(0)
            q_logits = kept.mean(dim=0)
            q_probs = kept.softmax(dim=-1).mean(dim=0)
            if eps:
                q_ent = _prob_entropy(q_probs, eps)
            else:  # the official avg_entropy, in log space
                log_mean = kept.log_softmax(dim=-1).logsumexp(dim=0) - math.log(k)
                q_ent = -(log_mean.exp() * log_mean).sum(dim=-1)
        kb = int(v * cfg.selection)  # the official int(): no boosting below 10 views
        chosen = order[:kb]
        b_feats = feats.gather(0, chosen[..., None].expand(-1, -1, feats.shape[-1]))
        b_logits = logits.gather(0, chosen[..., None].expand(-1, -1, logits.shape[-1]))
        boost = (b_feats, b_logits.argmax(dim=-1), _entropy(b_logits, eps))
        return q_feat, q_logits, q_ent, q_probs, boost

    def final_logits(
        self, feature: torch.Tensor, logits: torch.Tensor, positive: EntropyCache
    ) -> torch.Tensor:
        """``logits + A(feature; positive) - A(feature; self.neg)`` for one image."""
        cfg = self.config
        ratio = float(self.model.logit_scale) / 100.0 if cfg.scale_alpha else 1.0
        out = logits.clone()
        out += positive.logits(feature, self.pos_alpha * ratio, self.pos_beta)
        out -= self.neg.logits(feature, cfg.neg_alpha * ratio, cfg.neg_beta)
        return out

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """The realtime track's prediction while busy: the image alone (no views, no
        boosting) corrected by the historical caches as they stand, offering nothing."""
        feats = self._encode(images)
        logits = (self.model.logit_scale * feats @ self.head.float().t()).float()
        return torch.stack([self.final_logits(f, logits[i], self.pos) for i, f in enumerate(feats)])

    @torch.no_grad()
    def step(self, images: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        feats, logits, ent, probs, boost = self._inputs(images)
        c = logits.shape[-1]
        prop = ent / math.log2(c)  # the official normalisation (nats over log2)
        eye = torch.eye(c, device=logits.device)
        out = []
        for i in range(images.shape[0]):
            pred = int(logits[i].argmax())
            self.pos.offer(pred, feats[i], float(ent[i]), eye[pred])
            positive = self.pos
            if boost is not None and boost[0].shape[0] > 0:
                positive = boosted_cache(
                    self.pos, boost[0][:, i], boost[1][:, i], boost[2][:, i], self.delta
                )
            if cfg.neg_entropy_lower < float(prop[i]) < cfg.neg_entropy_upper:
                mask = (probs[i] > cfg.neg_mask_lower) & (probs[i] < cfg.neg_mask_upper)
                self.neg.offer(pred, feats[i], float(ent[i]), mask.float())
            out.append(self.final_logits(feats[i], logits[i], positive))
        return torch.stack(out)


def _view_settings(cfg: BoostAdapterConfig) -> SimpleNamespace:
    """``configured_views``' fields (the original always first)."""
    return original_first(cfg, cfg.n_views, cfg.augmix)
