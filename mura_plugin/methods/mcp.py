"""MCP / MCP++: multi-cache enhanced prototypes for training-free online TTA of CLIP.

Paper: Chen, Zhai, Zhang, Shi, Li, "Multi-Cache Enhanced Prototype Learning for Test-Time
Generalization of Vision-Language Models", ICCV 2025, https://arxiv.org/abs/2508.01225.
Official code: https://github.com/CenturyChen/MCP, read at commit
f9d063f62172d173f070da2f6abacb26abd4a1de (MIT licence; mcp_runner.py: ``run_test_mcp``,
``update_cache``, ``update_align_cache``, ``update_class_center``, ``update_cache_joint``,
``shrink_cache_keys_and_values``, ``compute_cache_logits``, ``compute_cache_key_logits``,
``get_cache_pred``, ``align_neg_keys``, ``TextResidue``, ``PositiveCacheResidue``, ``main``;
utils.py: ``get_clip_logits``, ``select_confident_samples``, ``get_entropy``,
``avg_entropy``, ``loss_negative_positive``, ``InfoNCELoss``, ``clip_classifier``,
``get_preprocess``, ``get_ood_preprocess``, ``get_config_file``, ``build_test_data_loader``;
configs/*.yaml; datasets/utils.py: ``AugMixAugmenter``, ``augmix``, ``get_preaugment``;
datasets/*.py templates; scripts/*.sh). The official code runs CLIP itself (there is no
CLIPTTA port of MCP); the defaults follow it.

Per test image, in stream order (batch size 1 officially), ``W`` the head, ``s`` the logit
scale, ``f0`` the image's feature, views = the image + ``n_views`` 31 augmented views:

1. query (``get_clip_logits``): ``x = f0``, ``z = s f0 . W``, ``h`` = entropy of ``z``,
   ``y = argmax z``; on ImageNet-A (the official ``dataset_name in 'a'``) the 10% (3)
   lowest-entropy views: their mean feature (not renormalised), mean logits, the entropy of
   their mean probability. ``p_views``: mean probability of the 3 views of lowest
   ``-sum p log(p + 1e-6)`` (``select_confident_samples``), ``y_a = argmax``, ``h_a`` its
   entropy;
2. entropy cache (``pos_shots`` 10 per class, TDA's rule, ``_cache.EntropyCache``): ``(x, h)``
   under ``y``. Align cache (``align_shots`` 10): ``(f0, h_a)`` under ``y_a`` into a free
   slot; a full class replaces its highest-entropy entry only if ``h_a`` is lower *and*
   ``f0`` is closer (L2) than that entry to the class centre ``0.8 P_c + 0.2 W_c`` (``W_c``
   alone while ``c`` has no prototype);
3. joint update, for ``c`` in ``{y, y_a}``: the class memory becomes its align entries then
   its entropy entries (each in entropy order), the prototype ``P_c`` their mean (not
   renormalised);
4. negative cache (3 shots, TDA's): if ``0.2 < h / log2 C < 0.5``, ``n = z + alpha
   exp(-beta (1 - x . E)) onehot`` over the entropy cache's entries ``E``; if ``H(n) / log2
   C`` is in (0.2, 0.5), ``(x, H(n))`` enters the negative cache under ``argmax n`` with the
   mask ``0.03 < softmax(n) < 1``; if it is <= 0.2 it enters the entropy cache ("reflecting")
   under ``argmax n`` (the memory of that class sees it at its next joint update);
5. predictions: ``p_cache = softmax(z + alpha exp(-beta (1 - x . P)) - 0.117 exp(-(1 - x .
   N)) mask)``; ``p_memory``: DMN's read-out of each class's memory plus ``W_c`` with
   sharpness 5.5 (``get_cache_pred``; ``dmn.memory_readout``); output ``log((p_views + a
   p_memory + b p_cache) / (1 + a + b))``.

``variant=mcp++`` (the official ``--res True``) adds, per image: a text residual ``R_t``
(``W' = normalize(W + R_t)``, through which ``z`` is computed) and a residual ``R_v`` on the
prototypes (``P' = normalize(P + R_v)``), one AdamW step (eps 1e-3, weight decay 0.1,
``lr_text``/``lr_image`` per dataset) on ``H(z + A(P') - A_neg) + 0.5 InfoNCE(P'^T,
W'[cached]^T) + 0.2 mean(-log(1 - cos(P', N_c) + 1e-7))`` (``N_c`` the mean negative
entry of class ``c``, 0 if none); then ``p_views`` from the views under ``W'`` and
``p_cache = softmax(z + A(P'_0) - A_neg + A(P'_1) - A_neg)``: as released, the loop's
logits are not reset before the prediction, so the prototype and negative terms count
twice, with the keys before (``P'_0``) and after (``P'_1``) the step (with ``steps`` > 1,
once per step plus once; one AdamW over the steps, as officially). ``z`` is not
recomputed under ``W'``. The residuals are dropped after the image.

Setting (defaults = the official configs/*.yaml and scripts, ViT-B/16 and RN50 alike):
shots 10 + 10, negative cache 3 shots (alpha 0.117, beta 1, entropy band (0.2, 0.5), mask
(0.03, 1.0)), centre weight 0.8 (``--cen``), 31 views (``n_views=31``) drawn as
``RandomResizedCrop(scale=(0.5, 1))`` + flip, AugMix-ed on the ten cross-domain sets (not
on the ImageNet sets: ``get_ood_preprocess``); ``alpha``, ``beta``, ``lr_text``,
``lr_image`` None take ``SETTINGS`` (the official config of the catalogue's dataset, its
file named in ``CONFIG_FILES``; ImageNet's elsewhere). Caches, memories and prototypes
persist across batches (online); ``reset()`` empties them. The head is the method's own
tensor (``adapts = False``).

What differs and why:
* Fusion weights: the official code has none. It stores ``p_views``, ``p_memory`` and
  ``p_cache`` of every test image and reports the best accuracy of ``p_views + a p_memory +
  b p_cache`` over a 13 x 13 grid of (a, b) in {0.001 ... 1000} searched on the test labels.
  Here ``memory_weight = cache_weight = 1`` (the grid's middle), fixed; the output is the
  log of the normalised mixture (a log-probability, same argmax).
* Logit scale: the official code multiplies by a hard-coded 100 (clip logits, read-out,
  views); here the model's ``s`` and, with ``scale_alpha``, both alphas times ``s / 100``.
  The entropy thresholds then act on flatter predictions on a model with a small ``s``.
* MCP++ as released never evolves the text head: its update condition tests the entropy
  of the softmax of *probabilities*, which is about ``ln C / log2 C = 0.69 > 0.1`` always
  (and its counter ``num_avg`` is never initialised). Not modelled: nothing happens.
* MCP++'s InfoNCE is the official call on ``[D, K]`` tensors: the ``D`` feature dimensions
  are the samples (rows normalised over the K cached classes), as released.
* Views: torchvision's RandomResizedCrop boxes on the image at the model's size, one
  batched ``grid_sample`` and the official AugMix on tensors (augment.py), not PIL
  transforms of the raw image; all views of a chunk are encoded together, then the samples
  update the caches one by one in stream order. ``n_views=0`` (not the official setting)
  uses the image alone; then ``features_only`` holds. The official encodes ``f0`` twice
  (once with the views): the same feature, used once here.
* ``int(V * selection)`` is at least 1. Sorting ties: the caches follow ``EntropyCache``
  (the official stable list sort); the view ranking uses a stable sort (the official
  ``torch.argsort`` leaves ties unspecified).
* Precision: the official model and caches are fp16 under autocast (MCP++'s residuals and
  AdamW too); here fp16 autocast for the image tower on CUDA and float32 for everything
  after it; float32 on the CPU. ``features_only`` (``n_views=0``) also needs float32.
* ``predict`` (the realtime track's batches while busy) uses the image alone against the
  caches as they stand (``p_views`` = its own softmax, MCP++ keys without residual); the
  official code has no such path.
* Sets the official code does not cover follow the nearest rule: ImageNet-C and
  ``imagenet_ood`` as ImageNet (no AugMix, ImageNet's config), digits and CIFAR as the
  non-ImageNet sets but without AugMix unless the catalogue marks the set fine-grained
  (``dmn.official_augmix``), ImageNet's config, the single-prompt official head.
* Official head (``text_head=official``): its loaders' templates (TDA's:
  ``tda.official_templates``) plus CuPL's GPT-3 descriptions, which are not shipped:
  ``prompts`` names such a JSON file (``_dmn_dpe_prompts``; the official omits them on
  EuroSAT with ViT-B/16); None uses the templates alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from mura_plugin.losses import view_entropy
from mura_plugin.methods._cache import CacheFields, EntropyCache
from mura_plugin.methods._dmn_dpe_prompts import method_head
from mura_plugin.methods._text_heads import TEXT_HEADS, OwnHead
from mura_plugin.methods._view_budget import encode_flat, encode_in_chunks
from mura_plugin.methods._view_config import original_first
from mura_plugin.methods.dmn import memory_readout, official_augmix
from mura_plugin.methods.dpe import info_nce
from mura_plugin.methods.tda import official_templates
from tta_bench.bounds import bounded, one_of
from tta_bench.method import (
    PRECISIONS,
    Method,
    autocast_context,
    effective_precision,
    release_optimizer,
)

__all__ = [
    "CONFIG_FILES",
    "MCP",
    "MCPConfig",
    "SETTINGS",
    "VARIANTS",
    "confident_views",
    "offer_align",
    "pos_to_neg",
]

#: mcp: the caches and prototypes (``--res False``, every official script); mcp++: plus the
#: per-image text and prototype residuals (``--res True``).
VARIANTS = ("mcp", "mcp++")
#: official: the query is the image, but the confident views' mean on ImageNet-A only.
QUERY_VIEWS = ("official", "original", "views")
#: configs/*.yaml: (positive alpha, positive beta, lr text, lr image) per catalogue dataset.
SETTINGS = {
    "imagenet": (5.5, 8.0, 6e-5, 6e-5),
    "imagenet_a": (4.0, 3.0, 3e-4, 3e-4),
    "imagenet_v2": (2.5, 1.0, 8e-5, 8e-5),
    "imagenet_r": (1.0, 8.0, 8e-5, 8e-5),
    "imagenet_sketch": (2.0, 3.0, 1e-4, 1e-4),
    "caltech101": (5.0, 5.0, 8e-5, 8e-5),
    "dtd": (5.0, 7.0, 6e-4, 6e-4),
    "eurosat": (3.0, 8.0, 4e-4, 4e-4),
    "fgvc_aircraft": (4.0, 5.0, 1e-4, 1e-4),
    "food101": (1.0, 1.0, 2e-4, 2e-4),
    "oxford_flowers": (1.0, 8.0, 8e-4, 8e-4),
    "oxford_pets": (2.0, 7.0, 4e-4, 4e-4),
    "stanford_cars": (3.0, 4.0, 1e-4, 1e-4),
    "sun397": (1.0, 2.0, 3e-4, 3e-4),
    "ucf101": (1.0, 7.0, 8e-4, 8e-4),
}
#: The official config file of each catalogue dataset (``get_config_file``: the CLI's
#: I/A/V/R/S are imagenet.yaml and imagenet_<letter>.yaml).
CONFIG_FILES = {
    "imagenet": "imagenet.yaml",  # I
    "imagenet_a": "imagenet_a.yaml",  # A
    "imagenet_v2": "imagenet_v.yaml",  # V
    "imagenet_r": "imagenet_r.yaml",  # R
    "imagenet_sketch": "imagenet_s.yaml",  # S
    "caltech101": "caltech101.yaml",
    "dtd": "dtd.yaml",
    "eurosat": "eurosat.yaml",
    "fgvc_aircraft": "aircraft.yaml",
    "food101": "food101.yaml",
    "oxford_flowers": "oxford_flowers.yaml",
    "oxford_pets": "oxford_pets.yaml",
    "stanford_cars": "stanford_cars.yaml",
    "sun397": "sun397.yaml",
    "ucf101": "ucf101.yaml",
}


@dataclass
class MCPConfig(CacheFields):
    variant: str = one_of("mcp", VARIANTS)  # official --res False | True
    # TDA's cache fields with MCP's values: pos_* = the entropy cache (and the prototypes'
    # alpha/beta; None: SETTINGS), neg_* = the negative cache
    pos_shots: int = bounded(10, ge=1)  # entropy_shot
    neg_shots: int = bounded(3, ge=1)
    align_shots: int = bounded(10, ge=1)  # align_shot
    center: float = bounded(0.8, ge=0, le=1)  # --cen: prototype weight in the align centre
    readout_beta: float = bounded(5.5, ge=0)  # get_cache_pred's sharpness
    # output = log((p_views + memory_weight p_memory + cache_weight p_cache) / sum)
    memory_weight: float = bounded(1.0, ge=0)
    cache_weight: float = bounded(1.0, ge=0)
    # MCP++ (None: SETTINGS)
    lr_text: Optional[float] = bounded(None, ge=0)
    lr_image: Optional[float] = bounded(None, ge=0)
    steps: int = bounded(1, ge=0)  # --tta_steps
    eps: float = bounded(1e-3, gt=0)  # AdamW
    weight_decay: float = bounded(0.1, ge=0)  # AdamW
    temperature: float = bounded(0.01, gt=0)  # InfoNCE
    align_weight: float = bounded(0.5, ge=0)  # lamda
    pos2neg_weight: float = bounded(0.2, ge=0)  # gamma
    # views: the image + n_views (0: the image alone)
    n_views: int = bounded(31, ge=0)
    selection: float = bounded(0.1, gt=0, le=1)
    augmix: Optional[bool] = None  # None: the official rule (not on the ImageNet sets)
    crop_scale_min: float = bounded(0.5, gt=0, le=1)  # get_preaugment: scale=(0.5, 1)
    query_views: str = one_of("official", QUERY_VIEWS)
    text_head: str = one_of("protocol", TEXT_HEADS)  # protocol | official
    prompts: Optional[str] = None  # JSON {classname: [description, ...]} added to the head
    precision: str = one_of("fp16", PRECISIONS)  # autocast on CUDA; CPU: fp32


def confident_views(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, int, float]:
    """``select_confident_samples`` of one image's view probabilities ``[V, C]``: the mean
    probability of the ``k`` views of lowest ``-sum p log(p + 1e-6)``, its argmax and its
    entropy (``log`` of ``p`` clamped at 1e-8)."""
    ranking = -(probs * torch.log(probs + 1e-6)).sum(dim=-1)
    chosen = torch.argsort(ranking, stable=True)[:k]
    p_bar = probs[chosen].mean(dim=0)
    ent = -(p_bar * p_bar.clamp_min(1e-8).log()).sum()
    return p_bar, int(p_bar.argmax()), float(ent)


def offer_align(
    cache: EntropyCache, cls: int, feature: torch.Tensor, ent: float, center: torch.Tensor
) -> None:
    """``update_align_cache``: a free slot takes the entry; a full class replaces the entry
    it would evict (highest entropy, ``EntropyCache.evictable``) only if ``ent`` is lower
    and ``feature`` is nearer (L2) to ``center`` than that entry."""
    slot = cache.evictable(cls)
    worst = float(cache.entropy[cls, slot])
    if math.isfinite(worst):
        if not ent < worst:
            return
        if not float((feature - center).norm()) < float((cache.keys[cls, slot] - center).norm()):
            return
    cache.offer(cls, feature, ent, cache.values.new_ones(1))


def pos_to_neg(keys: torch.Tensor, negatives: torch.Tensor) -> torch.Tensor:
    """``loss_negative_positive``: mean of ``-log(1 - cos(key_c, negative_c) + 1e-7)``."""
    cos = F.cosine_similarity(keys, negatives, dim=1)
    return -torch.log(1 - cos + 1e-7).mean()


def _ordered_keys(cache: EntropyCache, cls: int) -> torch.Tensor:
    """The keys of class ``cls``'s filled slots in the official list order (entropy, then
    insertion)."""
    ents, stamps = cache.entropy[cls].tolist(), cache.stamp[cls].tolist()
    slots = sorted((e, t, i) for i, (e, t) in enumerate(zip(ents, stamps)) if math.isfinite(e))
    return cache.keys[cls, [i for _, _, i in slots]]


class MCP(OwnHead, Method):
    Config = MCPConfig
    resolved = ("alpha", "beta", "lr_text", "lr_image", "augmix", "query_on_views")
    stream_kind = "online"

    def setup(self) -> None:
        cfg = self.config
        dataset = self.model.dataset or ""
        alpha, beta, lr_text, lr_image = SETTINGS.get(dataset, SETTINGS["imagenet"])
        self.alpha = alpha if cfg.pos_alpha is None else float(cfg.pos_alpha)
        self.beta = beta if cfg.pos_beta is None else float(cfg.pos_beta)
        self.lr_text = lr_text if cfg.lr_text is None else float(cfg.lr_text)
        self.lr_image = lr_image if cfg.lr_image is None else float(cfg.lr_image)
        self.augmix = official_augmix(dataset) if cfg.augmix is None else bool(cfg.augmix)
        self.query_on_views = cfg.n_views > 0 and (
            cfg.query_views == "views"
            or (cfg.query_views == "official" and dataset == "imagenet_a")
        )
        # the method's own head: the shared model is never changed (adapts = False)
        self.head = method_head(
            self.model, cfg.text_head, official_templates(dataset or None), cfg.prompts
        ).float()
        self.reset()

    def reset(self) -> None:
        cfg = self.config
        c, d = self.head.shape
        dev = self.device
        self.eye = torch.eye(c, device=dev)
        self.entropy_cache = EntropyCache(c, cfg.pos_shots, d, c, dev)
        self.align_cache = EntropyCache(c, cfg.align_shots, d, 1, dev)
        self.neg_cache = EntropyCache(c, cfg.neg_shots, d, c, dev)
        self.memory = torch.zeros(c, cfg.pos_shots + cfg.align_shots, d, device=dev)
        self.memory_filled = torch.zeros(c, self.memory.shape[1], dtype=torch.bool, device=dev)
        self.protos = torch.zeros(c, d, device=dev)
        self.active = torch.zeros(c, dtype=torch.bool, device=dev)

    # -- the caches ------------------------------------------------------------------------
    def _alphas(self) -> tuple[float, float]:
        ratio = float(self.model.logit_scale) / 100.0 if self.config.scale_alpha else 1.0
        return self.alpha * ratio, self.config.neg_alpha * ratio

    def _joint(self, classes: set[int]) -> None:
        """``update_cache_joint``: each class's memory = its align then entropy entries, its
        prototype their mean."""
        for cls in sorted(classes):
            rows = torch.cat(
                [_ordered_keys(self.align_cache, cls), _ordered_keys(self.entropy_cache, cls)]
            )[: self.memory.shape[1]]
            n = rows.shape[0]
            self.memory[cls].zero_()
            self.memory[cls, :n] = rows
            self.memory_filled[cls] = torch.arange(self.memory.shape[1], device=rows.device) < n
            if n:
                self.protos[cls] = rows.mean(dim=0)
                self.active[cls] = True

    def _update(self, x, z, h, y, f0, y_align, h_align) -> None:
        """Steps 2-4 for one image (everything detached)."""
        cfg = self.config
        c = z.shape[0]
        pos_alpha, _ = self._alphas()
        self.entropy_cache.offer(y, x, h, self.eye[y])
        if self.active[y_align]:
            center = cfg.center * self.protos[y_align] + (1 - cfg.center) * self.head[y_align]
        else:
            center = self.head[y_align]
        offer_align(self.align_cache, y_align, f0, h_align, center)
        self._joint({y, y_align})
        lower, upper = cfg.neg_entropy_lower, cfg.neg_entropy_upper
        if not lower < h / math.log2(c) < upper:
            return
        corrected = z + self.entropy_cache.logits(x, pos_alpha, self.beta)
        ent = float(view_entropy(corrected))
        label = int(corrected.argmax())
        if lower < ent / math.log2(c) < upper:
            p = corrected.softmax(dim=-1)
            mask = ((p > cfg.neg_mask_lower) & (p < cfg.neg_mask_upper)).float()
            self.neg_cache.offer(label, x, ent, mask)
        elif ent / math.log2(c) <= lower:
            self.entropy_cache.offer(label, x, ent, self.eye[label])

    def _cache_logits(self, x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``A(keys) - A_neg``: the prototype term over the cached classes minus the
        negative cache's."""
        pos_alpha, neg_alpha = self._alphas()
        out = x.new_zeros(self.head.shape[0])
        if keys.shape[0]:
            affinity = torch.exp(-self.beta * torch.rsub(keys @ x, 1))
            out = out.index_add(0, self.active.nonzero().flatten(), pos_alpha * affinity)
        return out - self.neg_cache.logits(x, neg_alpha, self.config.neg_beta)

    def _mix(self, p_views: torch.Tensor, p_cache: torch.Tensor, f0: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        scale = float(self.model.logit_scale)
        p_memory = memory_readout(
            self.memory, self.memory_filled, self.head, f0, cfg.readout_beta, scale
        )
        total = 1.0 + cfg.memory_weight + cfg.cache_weight
        mixed = (p_views + cfg.memory_weight * p_memory + cfg.cache_weight * p_cache) / total
        return mixed.clamp_min(torch.finfo(mixed.dtype).tiny).log()

    # -- one image -------------------------------------------------------------------------
    def _query(self, feats: torch.Tensor, logits: torch.Tensor, k: int):
        """``get_clip_logits``: query ``x``, logits ``z`` (graph kept), entropy, label."""
        if not self.query_on_views or feats.shape[0] == 1:
            z = logits[0]
            return feats[0], z, float(view_entropy(z.detach())), int(z.detach().argmax())
        chosen = torch.argsort(view_entropy(logits.detach()), stable=True)[:k]
        kept = logits[chosen]
        log_mean = kept.detach().log_softmax(dim=-1).logsumexp(dim=0) - math.log(k)
        ent = float(-(log_mean.exp() * log_mean).sum())
        z = kept.mean(dim=0)
        return feats[chosen].mean(dim=0), z, ent, int(z.detach().argmax())

    def adapt_sample(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One image's normalised features ``[V, D]`` (the original first): update, predict.
        Returns ``(logits [C], MCP++ loss or None)``."""
        cfg = self.config
        scale = float(self.model.logit_scale)
        k = max(1, int(feats.shape[0] * cfg.selection))
        plus = cfg.variant == "mcp++"
        text_res = torch.zeros_like(self.head, requires_grad=plus)
        with torch.set_grad_enabled(plus):
            weights = F.normalize(self.head + text_res, dim=-1) if plus else self.head
            logits = scale * feats @ weights.t()
            x, z, h, y = self._query(feats, logits, k)
        p_views, y_align, h_align = confident_views(logits.detach().softmax(dim=-1), k)
        with torch.no_grad():
            self._update(x.detach(), z.detach(), h, y, feats[0], y_align, h_align)
        if not plus:
            with torch.no_grad():
                p_cache = (z + self._cache_logits(x, self.protos[self.active])).softmax(dim=-1)
                return self._mix(p_views, p_cache, feats[0]), None
        return self._residual_step(feats, x.detach(), z, text_res, k)

    def _residual_step(self, feats, x, z, text_res, k):
        """MCP++: the residual AdamW step(s) and the prediction after them."""
        cfg = self.config
        scale = float(self.model.logit_scale)
        classes = self.active.nonzero().flatten()
        base = self.protos[classes]
        negatives = self._negative_means(classes)
        vis_res = torch.zeros_like(base, requires_grad=True)
        optimizer = torch.optim.AdamW(
            [
                {"params": [text_res], "lr": self.lr_text},
                {"params": [vis_res], "lr": self.lr_image},
            ],
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
        )
        final, loss = z, None
        for j in range(cfg.steps):
            with torch.enable_grad():
                weights = F.normalize(self.head + text_res, dim=-1)
                keys = F.normalize(base + vis_res, dim=-1)
                final = final + self._cache_logits(x, keys)  # accumulates, as released
                loss = view_entropy(final)
                if classes.numel():
                    loss = loss + cfg.align_weight * info_nce(
                        keys.t(), weights[classes].t(), cfg.temperature
                    )
                    loss = loss + cfg.pos2neg_weight * pos_to_neg(keys, negatives)
            optimizer.zero_grad()
            loss.backward(retain_graph=j < cfg.steps - 1)
            optimizer.step()
        release_optimizer(optimizer)
        with torch.no_grad():
            weights = F.normalize(self.head + text_res, dim=-1)
            p_views = confident_views((scale * feats @ weights.t()).softmax(dim=-1), k)[0]
            keys = F.normalize(base + vis_res, dim=-1)
            p_cache = (final.detach() + self._cache_logits(x, keys)).softmax(dim=-1)
            out = self._mix(p_views, p_cache, feats[0])
        return out, None if loss is None else loss.detach()

    def _negative_means(self, classes: torch.Tensor) -> torch.Tensor:
        """``align_neg_keys``: per class, the mean of its negative entries (0 if none)."""
        cache = self.neg_cache
        valid = torch.isfinite(cache.entropy[classes])  # [K, shots]
        sums = (cache.keys[classes] * valid[..., None]).sum(dim=1)
        return sums / valid.sum(dim=1, keepdim=True).clamp_min(1)

    # -- the Method interface --------------------------------------------------------------
    def _features(self, images: torch.Tensor, reduce: Any) -> torch.Tensor:
        """``reduce`` of the normalised features ``[V, b, D]`` of each chunk of images (the
        image first, then its views; ``encode_in_chunks``). Encoding counts as ``adapt``."""
        cfg = self.config

        def encode(views: torch.Tensor) -> torch.Tensor:
            with torch.no_grad(), autocast_context(cfg.precision, self.device):
                feats = encode_flat(self.model.encode_image, views, cfg.chunk_views).float()
            return feats / feats.norm(dim=-1, keepdim=True)

        if cfg.n_views == 0:
            with self.timed("adapt"), torch.no_grad(), autocast_context(cfg.precision, self.device):
                feats = self.model.encode_image(images).float()
            return reduce((feats / feats.norm(dim=-1, keepdim=True))[None])
        return encode_in_chunks(
            images,
            original_first(cfg, cfg.n_views, self.augmix),
            self.generator,
            encode,
            cfg.view_memory_mb,
            reduce=reduce,
            phase=lambda: self.timed("adapt"),
        )

    def _run(self, feats: torch.Tensor) -> torch.Tensor:
        """Each image of ``[V, b, D]`` in stream order; sets ``last_loss``."""
        out, losses = [], []
        for i in range(feats.shape[1]):
            with self.timed("adapt"):
                logits, loss = self.adapt_sample(feats[:, i])
            out.append(logits)
            if loss is not None:
                losses.append(loss)
        self.last_loss = torch.stack(losses).mean() if losses else None
        return torch.stack(out)

    def step(self, images: torch.Tensor) -> torch.Tensor:
        """The images of each chunk (the view budget's) update and are predicted in stream
        order as soon as the chunk's views are encoded."""
        return self._features(images, self._run).float()

    def features_only(self) -> bool:
        return (
            self.config.n_views == 0
            and effective_precision(self.config.precision, self.device) == "fp32"
        )

    def step_features(self, features: torch.Tensor) -> torch.Tensor:
        feats = features.float()
        return self._run((feats / feats.norm(dim=-1, keepdim=True))[None]).float()

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """The realtime track's prediction while busy: the image alone against the caches
        and memories as they stand, writing nothing."""
        cfg = self.config
        with autocast_context(cfg.precision, self.device):
            feats = self.model.encode_image(images).float()
        feats = feats / feats.norm(dim=-1, keepdim=True)
        logits = float(self.model.logit_scale) * feats @ self.head.t()
        keys = self.protos[self.active]
        if cfg.variant == "mcp++":
            keys = F.normalize(keys, dim=-1)
        out = []
        for f, z in zip(feats, logits):
            p_cache = (z + self._cache_logits(f, keys)).softmax(dim=-1)
            out.append(self._mix(z.softmax(dim=-1), p_cache, f))
        return torch.stack(out)
