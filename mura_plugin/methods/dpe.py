"""DPE: dual (textual and visual) prototypes evolving along the test stream (online).

Paper: Zhang et al., "Dual Prototype Evolving for Test-Time Generalization of
Vision-Language Models", NeurIPS 2024, https://arxiv.org/abs/2410.12790. Official code:
https://github.com/zhangce01/DPE-CLIP, read at commit
fecae5a50d7dc39fb944221be390201a56948416 (main_dpe.py: ``run_test_dpe``, ``update_cache``,
``cache_key_value``, ``compute_cache_logits``, ``TextResidue``, ``PositiveCacheResidue``,
``InfoNCELoss``; utils.py: ``get_clip_logits``, ``get_entropy``, ``avg_entropy``,
``clip_classifier``, ``get_preprocess``, ``build_test_data_loader``, ``get_config_file``;
configs/*.yaml; datasets/utils.py: ``AugMixAugmenter``, ``augmix``, ``get_preaugment``;
datasets/imagenet*.py templates; scripts/run_*_benchmark_vit.sh) and the ``info_nce``
package it imports (RElbers/info-nce-pytorch: without negatives, cross-entropy of
``normalize(q) @ normalize(k)^T / temperature`` against the diagonal). TTA-VLM's
implementation read too: https://github.com/TomSheng21/tta-vlm at commit
bcc735fe49cbd2ab5b683781c41c66e1d3f78589 (online_method/dpe.py, online_tta.py,
data/datautils.py).

Per test image, in stream order (batch size 1 in the official loop), with ``T`` the
textual prototypes (initially the zero-shot head) and ``s`` the logit scale:

1. fresh residuals: ``R_t = 0 [C, D]`` on the text, ``W = normalize(T + R_t)``; CLIP logits
   ``s * f . W`` (``get_clip_logits``): with views, the ``int(V * 0.1)`` lowest-entropy
   views give the mean feature ``x`` (not renormalised), the mean logits, the entropy of
   their mean probability and the pseudo-label (argmax of the mean logits); a single image
   gives its feature, logits and softmax entropy. The logits keep their graph to ``R_t``;
2. visual prototypes: ``(x, entropy / log2 C)`` enters the pseudo-class's priority queue of
   ``shots`` 3 (TDA's rule: a free slot, else replaces the highest-entropy entry if lower;
   ``_cache.EntropyCache``); the prototype of each class in the cache is the mean of its entries,
   with a fresh residual ``R_v = 0 [K, D]``: ``P = normalize(mean + R_v)``;
3. one AdamW step (eps 1e-3, weight decay 0.1; ``lr_text`` on ``R_t``, ``lr_image`` on
   ``R_v``) on ``H(softmax(clip + alpha exp(-beta (1 - x . P)) onehot)) + align *
   InfoNCE(P, W[classes in the cache])`` (temperature 0.01);
4. prediction with the updated residuals: the original image's logits ``s * f0 . W`` plus
   ``alpha exp(-beta (1 - f0 . P)) onehot`` (on ImageNet-A: the confident views' mean, as
   ``get_clip_logits(images)`` there);
5. textual prototype evolution: if that prediction's entropy / log2 C < 0.1, ``T <- T n /
   (n + 1) + W / (n + 1)`` with ``n`` the count of such updates so far (the initial head
   counts as one; ``T`` is not renormalised, ``W`` is). The residuals are then dropped.

Setting (defaults = the official configs/*.yaml, chosen per dataset as
``get_config_file``; ``alpha``/``beta``/``lr_text``/``lr_image``/``align`` None take them
from ``SETTINGS``, ImageNet's on sets it has no config for): ``shot_capacity`` 3, one step
(``steps = 1``, "set to 1 in default"), threshold 0.1. Views (``views=official``): on
ImageNet and its variants (``get_preprocess``: I/A/V/R/S; here also ImageNet-C and the
mixed ``imagenet_ood`` stream) the image + 63 AugMix views (``RandomResizedCrop(224)``,
scale 0.08-1, + flip, then AugMix: ``augmix=True`` always there); on every other set the
image alone (its loaders pass CLIP's own preprocess). Official head
(``text_head=official``): the templates of its loaders (7 on ImageNet, -A, -V2; CLIP's 80
on -R and -Sketch; on the cross-domain sets TDA's but on StanfordCars its own two
(``dpe_templates``)) plus CuPL's GPT-3
descriptions; the CuPL files are not shipped: ``prompts`` names such a JSON file
``{classname: [description, ...]}`` (any head + descriptions, ``_dmn_dpe_prompts``); None
(default) uses the templates alone. Prototypes, queues and the update count persist
across batches (online); ``reset()`` restores the head and empties the queues. The
residuals are the method's own transient tensors: the shared model is never changed
(``adapts = False``). fp16 autocast on CUDA (the official ``clip.load`` runs fp16).

What differs and why:
* The official code multiplies by a hard-coded 100 (CLIP's logit scale), to which its
  alphas are tuned; here the model's own scale ``s`` and, with ``scale_alpha`` (default
  on), ``alpha * s / 100``: the final logits are the official ones times ``s / 100``. Their
  entropy, and so which samples update ``T`` (threshold 0.1), depends on ``s`` (the tiny
  digits model's is about 13).
* Precision: the official residuals are fp16 parameters (AdamW in fp16) under autocast over
  the fp16 model; here the image tower runs under fp16 autocast on CUDA and everything
  after it (prototypes, residuals, AdamW) in float32; float32 on the CPU.
* Views: torchvision's RandomResizedCrop boxes on the image at the model's size, one
  batched ``grid_sample`` and the official AugMix on tensors (augment.py), not PIL
  transforms of the raw image; all views of a batch are encoded together (no gradient
  into the image tower: the official backpropagates into CLIP's weights too, then never
  uses those gradients), then the samples adapt one by one in stream order.
* ``steps > 1`` (not the default): the official reuses the first step's CLIP logits (and
  their graph) in later steps; here they are recomputed from the current ``R_t``. The
  official builds a new AdamW per step; so does this code.
* A prototype is the sum of its entries divided by their count (the official adds
  ``entry / count``): equal up to float rounding. Ties in the queue follow ``_cache.EntropyCache``.
* ``int(V * selection)`` is at least 1.
* Sets the official code does not cover use the nearest rule: ImageNet-C and
  ``imagenet_ood`` as ImageNet (views, ImageNet's config); other sets (digits, CIFAR) as
  its non-ImageNet sets (the image alone) with ImageNet's config and the single-prompt
  head.

TTA-VLM (``tta_vlm``): the image + 63 views on every set (``views=multi``), AugMix on its
fine-grained sets only (``augmix=len(set_id) > 1``; the option itself sets ``augmix`` from
the catalogue's ``fine_grained``, so it is not in ``tta_vlm``); its first CLIP logits are
computed without gradient, so ``R_t`` learns from the alignment term alone
(``entropy_through_text=False``); the queue's entropy is that of the softmax of the mean
logits (``+1e-5``; ``cache_entropy=mean_logit``). Not modelled: its SUN397 align
0.0002 (official 0.2: a per-dataset value the option cannot set; ``method.align=0.0002``
gives it on ``sun397``) and, on ImageNet-A, its prediction from the
pre-update confident features with views re-selected under the updated head.

Measured effect: docs/methods.md#dpe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from mura_plugin.losses import view_entropy
from mura_plugin.methods._cache import EntropyCache
from mura_plugin.methods._dmn_dpe_prompts import method_head
from mura_plugin.methods._text_heads import TEXT_HEADS
from mura_plugin.methods._view_budget import encode_flat, encode_in_chunks
from mura_plugin.methods._view_config import ViewFields, original_first
from mura_plugin.methods.tda import MULTI_VIEW_SETS, VIEWS, official_templates
from tta_bench.bounds import bounded, one_of
from tta_bench.method import (
    PRECISIONS,
    Method,
    autocast_context,
    release_optimizer,
)

__all__ = ["DPE", "DPEConfig", "MULTI_VIEW", "SETTINGS", "info_nce", "prototypes"]

#: Where the official code feeds the image + 63 AugMix views (``get_preprocess``): ImageNet
#: and its variants (TDA's natural-shift sets plus ImageNet itself and ImageNet-C).
MULTI_VIEW = ("imagenet", "imagenet_c") + tuple(MULTI_VIEW_SETS)
#: configs/*.yaml: (alpha, beta, lr text, lr image, align) per dataset (the ImageNet family
#: by the harness's names, the others by their config file names); ImageNet's elsewhere.
SETTINGS = {
    "imagenet": (6.0, 5.0, 6e-4, 6e-4, 0.5),
    "imagenet_a": (6.0, 5.0, 3e-4, 3e-4, 2.5),
    "imagenet_v2": (3.0, 8.0, 5e-4, 5e-4, 0.5),
    "imagenet_r": (3.0, 8.0, 6e-4, 6e-4, 0.0),
    "imagenet_sketch": (7.0, 7.45, 6e-4, 6e-4, 0.2),
    "caltech101": (15.0, 5.0, 6e-4, 6e-4, 0.2),
    "dtd": (6.0, 3.0, 6e-4, 6e-4, 0.2),
    "eurosat": (3.0, 8.0, 5e-5, 5e-5, 0.2),
    "fgvc_aircraft": (6.0, 2.0, 6e-4, 6e-4, 0.2),  # configs/fgvc.yaml
    "food101": (3.0, 1.0, 2e-4, 2e-4, 0.2),
    "oxford_flowers": (2.5, 5.0, 1e-4, 1e-4, 0.2),
    "oxford_pets": (4.0, 7.0, 5e-5, 5e-5, 0.2),
    "stanford_cars": (3.0, 7.0, 1e-4, 1e-4, 1.5),
    "sun397": (6.0, 3.0, 2e-4, 2e-4, 0.2),
    "ucf101": (9.0, 8.0, 4e-4, 4e-4, 0.2),
}
#: Where DPE's own loaders' templates differ from TDA's (``tda.official_templates``):
#: datasets/stanford_cars.py.
OFFICIAL_TEMPLATES = {
    "stanford_cars": (
        "a photo of a {}.",
        "A {} featuring a wide range of color options for easy selection.",
    ),
}
#: official: on the views on ImageNet-A only (``dataset_name == 'A'``); original | views.
PREDICT_VIEWS = ("official", "original", "views")
CACHE_ENTROPIES = ("mean_prob", "mean_logit")


def dpe_templates(dataset: str | None) -> list[str]:
    """The official head of DPE's loaders for ``dataset``: TDA's (``tda.official_templates``)
    but where ``OFFICIAL_TEMPLATES`` names its own."""
    if dataset in OFFICIAL_TEMPLATES:
        return list(OFFICIAL_TEMPLATES[dataset])
    return official_templates(dataset)


@dataclass
class DPEConfig(ViewFields):
    shots: int = bounded(3, ge=1)  # shot_capacity
    # None: the official value for the dataset (SETTINGS)
    alpha: Optional[float] = bounded(None, ge=0)
    beta: Optional[float] = bounded(None, ge=0)
    lr_text: Optional[float] = bounded(None, ge=0)
    lr_image: Optional[float] = bounded(None, ge=0)
    align: Optional[float] = bounded(None, ge=0)
    steps: int = bounded(1, ge=0)
    eps: float = bounded(1e-3, gt=0)  # AdamW
    weight_decay: float = bounded(0.1, ge=0)  # AdamW
    temperature: float = bounded(0.01, gt=0)  # InfoNCE
    update_entropy: float = bounded(0.1, ge=0)  # textual update below this entropy / log2 C
    # the entropy term's gradient reaches the text residual (official) or not (TTA-VLM)
    entropy_through_text: bool = True
    # the queue's entropy: of the confident views' mean probability (official) | of the
    # softmax of their mean logits (TTA-VLM)
    cache_entropy: str = one_of("mean_prob", CACHE_ENTROPIES)
    scale_alpha: bool = True  # alpha is tuned for logit scale 100: rescale to the model's
    views: str = one_of("official", VIEWS)  # official | single | multi
    predict_views: str = one_of("official", PREDICT_VIEWS)
    n_views: int = bounded(63, ge=0)
    selection: float = bounded(0.1, gt=0, le=1)
    augmix: bool = True  # AugMix the views (official: always, where it uses views)
    text_head: str = one_of("protocol", TEXT_HEADS)  # protocol | official
    prompts: Optional[str] = None  # JSON {classname: [description, ...]} added to the head
    precision: str = one_of("fp16", PRECISIONS)  # autocast on CUDA; CPU: fp32


def info_nce(query: torch.Tensor, keys: torch.Tensor, temperature: float) -> torch.Tensor:
    """The ``info_nce`` package without negative keys: rows normalised, cross-entropy of
    ``query @ keys^T / temperature`` against the diagonal (the i-th key is the i-th query's
    positive, the others its negatives), averaged."""
    q, k = F.normalize(query, dim=-1), F.normalize(keys, dim=-1)
    target = torch.arange(q.shape[0], device=q.device)
    return F.cross_entropy(q @ k.t() / temperature, target)


def prototypes(cache: EntropyCache) -> tuple[torch.Tensor, torch.Tensor]:
    """``(classes [K], mean keys [K, D])``: the classes with entries in ``cache``
    (ascending, as the official ``sorted(cache.keys())``) and the mean of their entries."""
    valid = torch.isfinite(cache.entropy)
    classes = valid.any(dim=1).nonzero().flatten()
    sums = (cache.keys * valid[..., None]).sum(dim=1)
    return classes, sums[classes] / valid.sum(dim=1)[classes, None]


def _entropy_of_mean_prob(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the mean softmax of ``logits [k, C]`` (the official ``avg_entropy``)."""
    log_mean = logits.log_softmax(dim=-1).logsumexp(dim=0) - math.log(logits.shape[0])
    log_mean = log_mean.clamp_min(torch.finfo(log_mean.dtype).min)
    return -(log_mean.exp() * log_mean).sum()


class DPE(Method):
    Config = DPEConfig
    resolved = (
        "alpha",
        "beta",
        "lr_text",
        "lr_image",
        "align",
        "multi_view",
        "augmix",
        "predict_on_views",
    )
    stream_kind = "online"

    def setup(self) -> None:
        cfg = self.config
        dataset = self.model.dataset or ""
        alpha, beta, lr_text, lr_image, align = SETTINGS.get(dataset, SETTINGS["imagenet"])
        self.alpha = alpha if cfg.alpha is None else float(cfg.alpha)
        self.beta = beta if cfg.beta is None else float(cfg.beta)
        self.lr_text = lr_text if cfg.lr_text is None else float(cfg.lr_text)
        self.lr_image = lr_image if cfg.lr_image is None else float(cfg.lr_image)
        self.align = align if cfg.align is None else float(cfg.align)
        self.multi_view = cfg.views == "multi" or (
            cfg.views == "official" and dataset in MULTI_VIEW
        )
        self.augmix = bool(cfg.augmix)
        self.predict_on_views = self.multi_view and (
            cfg.predict_views == "views"
            or (cfg.predict_views == "official" and dataset == "imagenet_a")
        )
        # the method's own head: the shared model is never changed (adapts = False)
        self.head = method_head(
            self.model, cfg.text_head, dpe_templates(dataset or None), cfg.prompts
        ).float()
        self._one = torch.ones(1, device=self.device)
        self.reset()

    def class_embeddings(self) -> torch.Tensor:
        """The current textual prototypes ``[C, D]`` (the head at ``setup``/``reset``)."""
        return self.text_global

    def reset(self) -> None:
        c, d = self.head.shape
        self.text_global = self.head.clone()
        self.cache = EntropyCache(c, self.config.shots, d, 1, self.device)
        self.updates = 0  # the official ``num_avg``

    # -- pieces -------------------------------------------------------------------------
    def _features(self, images: torch.Tensor, reduce: Any = None) -> Any:
        """Normalised features ``[V, B, D]``: the image (first) and, multi-view, its views;
        or ``reduce`` of each chunk's (``encode_in_chunks``). Encoding counts as ``adapt``."""
        cfg = self.config

        def encode(views: torch.Tensor) -> torch.Tensor:
            with torch.no_grad(), autocast_context(cfg.precision, self.device):
                feats = encode_flat(self.model.encode_image, views, cfg.chunk_views).float()
            return feats / feats.norm(dim=-1, keepdim=True)

        if not self.multi_view:
            with self.timed("adapt"):
                feats = encode(images.unsqueeze(0))
            return feats if reduce is None else reduce(feats)
        return encode_in_chunks(
            images,
            original_first(cfg, cfg.n_views, self.augmix),
            self.generator,
            encode,
            cfg.view_memory_mb,
            reduce=reduce,
            phase=lambda: self.timed("adapt"),
        )

    def _clip_logits(
        self, feats: torch.Tensor, weights: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, float, int]:
        """``get_clip_logits`` of one image's features ``[V, D]``: ``(feature, logits [C],
        entropy (nats), pseudo-label)``; the logits keep the graph to ``weights``."""
        logits = scale * feats @ weights.t()  # [V, C]
        if feats.shape[0] == 1:
            x, mean_logits, kept = feats[0], logits[0], logits
        else:
            k = max(1, int(feats.shape[0] * self.config.selection))
            chosen = torch.argsort(view_entropy(logits.detach()))[:k]
            x, kept = feats[chosen].mean(dim=0), logits[chosen]
            mean_logits = kept.mean(dim=0)
        detached = kept.detach()
        if self.config.cache_entropy == "mean_prob":
            ent = _entropy_of_mean_prob(detached)
        else:
            p = detached.mean(dim=0).softmax(dim=-1)
            ent = -(p * torch.log(p + 1e-5)).sum()
        return x, mean_logits, float(ent), int(mean_logits.detach().argmax())

    def _cache_logits(
        self, x: torch.Tensor, keys: torch.Tensor, classes: torch.Tensor, alpha: float, c: int
    ) -> torch.Tensor:
        """``alpha * exp(-beta (1 - x . keys)) @ onehot(classes)`` ``[C]``."""
        affinity = torch.exp(-self.beta * (1.0 - keys @ x))
        onehot = F.one_hot(classes, c).to(affinity.dtype)
        return alpha * affinity @ onehot

    def adapt_sample(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One test image (features ``[V, D]``, the original first): queue update, residual
        step(s), prediction, textual update. Returns ``(logits [C], loss or None)``."""
        cfg = self.config
        scale = float(self.model.logit_scale)
        base = self.text_global
        c = base.shape[0]
        alpha = self.alpha * (scale / 100.0 if cfg.scale_alpha else 1.0)
        text_res = torch.zeros_like(base, requires_grad=True)

        def text(res: torch.Tensor) -> torch.Tensor:
            return F.normalize(base + res, dim=-1)

        def clip_part(weights: torch.Tensor):
            return self._clip_logits(
                feats, weights if cfg.entropy_through_text else weights.detach(), scale
            )

        with torch.enable_grad():
            x, clip_logits, ent, label = clip_part(text(text_res))
        self.cache.offer(label, x.detach(), ent / math.log2(c), self._one)
        classes, means = prototypes(self.cache)
        vis_res = torch.zeros_like(means, requires_grad=True)
        loss = None
        for index in range(cfg.steps):
            with torch.enable_grad():
                weights = text(text_res)
                if index > 0:
                    clip_logits = clip_part(weights)[1]
                keys = F.normalize(means + vis_res, dim=-1)
                final = clip_logits + self._cache_logits(x, keys, classes, alpha, c)
                loss = view_entropy(final)
                if self.align:
                    loss = loss + self.align * info_nce(keys, weights[classes], cfg.temperature)
            optimizer = torch.optim.AdamW(
                [
                    {"params": [text_res], "lr": self.lr_text},
                    {"params": [vis_res], "lr": self.lr_image},
                ],
                eps=cfg.eps,
                weight_decay=cfg.weight_decay,
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            release_optimizer(optimizer)
        with torch.no_grad():
            weights = text(text_res)
            keys = F.normalize(means + vis_res, dim=-1)
            if self.predict_on_views:
                query, logits, _, _ = self._clip_logits(feats, weights, scale)
            else:
                query = feats[0]
                logits = scale * query @ weights.t()
            final = logits + self._cache_logits(query, keys, classes, alpha, c)
            if float(view_entropy(final)) / math.log2(c) < cfg.update_entropy:
                self.updates += 1
                n = self.updates
                self.text_global = self.text_global * (n / (n + 1)) + weights * (1 / (n + 1))
        return final.detach(), None if loss is None else loss.detach()

    def step(self, images: torch.Tensor) -> torch.Tensor:
        """The samples of each chunk of images (the view budget's) adapt and are predicted
        in order as soon as the chunk's views are encoded."""
        losses: list[torch.Tensor] = []

        def adapt(feats: torch.Tensor) -> torch.Tensor:  # [V, b, D] -> [b, C]
            out = []
            for i in range(feats.shape[1]):
                with self.timed("adapt"):
                    logits, loss = self.adapt_sample(feats[:, i])
                out.append(logits)
                if loss is not None:
                    losses.append(loss)
            return torch.stack(out)

        logits = self._features(images, reduce=adapt)
        self.last_loss = torch.stack(losses).mean() if losses else None
        return logits.float()
