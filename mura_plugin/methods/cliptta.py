"""CLIPTTA: soft contrastive test-time adaptation of CLIP, with its open-set variant (OCE).

Paper: Lafon et al., "CLIPTTA: Robust Contrastive Vision-Language Test-Time Adaptation",
NeurIPS 2025 (arXiv 2507.14312). Official code: https://github.com/MarcLafon/cliptta, read
at commit f4221f4f2b3bfbd220f8836411bbd3774758933d (ttavlm/methods/cliptta_otsu.py: the
class registered as ``cliptta``; ttavlm/methods/cliptta.py: ``cliptta_old``, which its
closed-set ImageNet scripts run; ttavlm/methods/abstract_model.py: scores, Otsu
initialisation, OCE loss, ID filter, parameters, optimiser, reset; ttavlm/memory/ccm.py;
ttavlm/lib/softmax_entropy.py, ttavlm/lib/prompts.py; ttavlm/datasets/utils.py:
``get_template``; ttavlm/configuration.py; ttavlm/main.py; ttavlm/methods/__init__.py;
ttavlm/scripts/{open_set,closed_set}/*/cliptta.sh). The defaults follow the method's own
repository, which is also the CLIP library (TTA-VLM style) the other open-set methods of
this plugin were read from: there is no second port to choose from.

The rule, per batch of B images (cosines ``c = f T^T`` of the L2-normalised image features
``f`` with the normalised class text features ``T``; ``s`` = CLIP's logit scale):

* soft contrastive loss (``use_softmax_entropy``): pseudo-label ``y_i = argmax_k c_ik``;
  the B x B logits ``s f_i . T_{y_j}`` of each image against the batch's pseudo-captions;
  loss = mean_i H(softmax_j) (the CLIP loss with the model's own soft targets; the text
  side term is the same matrix, since the text tower is frozen);
* regulariser: minus the entropy of the batch-mean prediction softmax(s c) (``beta_reg``);
* memory (``use_memory``, class-wise confident memory CCM): at the first step of a batch,
  the (kept) images enter the memory of their pseudo-class with confidence
  max softmax(c) (temperature 1); a class keeps its ``num_shots`` most confident images.
  Every step draws from the memory ``max(1, int(sample_size / C))`` images per class (all of
  a class with no more) and adds their soft contrastive loss and regulariser;
* open set (``open_set``, the official ``--use_ood_loss --detect_ood --update_alpha``):
  OOD score ``u_i = max_k log softmax(c_i)_k`` (``max_log_prob`` at temperature 1); before
  the steps of a batch the threshold ``alpha`` is set to Otsu's threshold of the batch's
  scores (skimage's rule, 256 bins), then learnt by the same optimiser; the outlier
  contrastive exposure (OCE) loss ``-(mu_in - mu_out)^2``, with ``mu_in``/``mu_out`` the
  means of ``u`` weighted by ``w = sigmoid((u - alpha) / gamma)`` and ``1 - w``; only images
  with ``u > alpha`` enter the TTA loss and the memory;
* loss = beta_tta TTA - beta_reg REG + beta_ood OCE; ``steps`` Adam steps per batch; the
  batch is predicted (and scored) by the adapted model after the last step. The model,
  optimiser and memory carry over from batch to batch until the protocol resets.

Adapted: the affine parameters of every LayerNorm of the image tower (the official
``collect_params`` over the visual encoder's norm layers), plus ``alpha`` in the open set.

Official setting (defaults = scripts/open_set/cifar10/cliptta.sh, its CIFAR-10-C command,
the closest to the digits suites: 10 classes, 32 px): 10 steps per batch, Adam lr 1e-4
(eps 1e-6, no weight decay), beta_tta 1, beta_reg 1, beta_ood 0.1 (the parser default: that
command passes none; every other open-set command passes 1.0), gamma 0.005,
OCE ``avg_contrastive``, memory of 16 shots per class, 128 sampled; batch 128 ID + 128 OOD
(here the protocol's batch). ``open_set=false`` is scripts/closed_set/cifar10/cliptta.sh's
CIFAR-10-C command: no OCE, no filter, memory of 4 shots, 40 sampled (``num_shots`` /
``sample_size`` None = the mode's official value). Template: CIFAR's ``"a photo of a {}"``
(``get_template``; ImageNet and the cross-domain sets have their own, ``official_template``).
The official CLIP is ``clip.load``'s fp16 weights with float32 LayerNorms:
``precision="fp16"`` (autocast on CUDA; the CPU runs float32).

Own OOD score: ``u`` of the adapted model after the batch's steps (higher = more ID), the
score the official code returns for its AUROC/FPR95; the own decision: ``u > alpha``, its
filter rule (open set only). The closed-set scripts return ``max_prob`` (the same ranking).

What differs from the official code and why:
* Text head: ``text_head="protocol"`` (default) classifies with the protocol's head;
  ``official`` with the official template (above).
* The logit scale is the model's own (100 for CLIP, the official fixed ``--logit_scale``
  100), in the losses and in the returned logits (officially cosines, softmaxed x100: the
  same probabilities for CLIP); the OOD temperature stays 1 (``ood_logit_scale``).
* Empty sides: a batch whose filter keeps no image (e.g. a one-image batch, where Otsu's
  threshold is the score itself) gives a TTA term of 0 (officially the mean over no rows,
  NaN, which would poison the parameters); an OCE term whose weights ``w`` or ``1 - w``
  sum to 0 is 0 (officially 0/0). An empty memory adds nothing.
* Memory: images kept as [0, 1] model-size tensors on the CPU (officially preprocessed,
  also on the CPU); ties in confidence kept in arrival order (stable sort; the official
  ``topk`` leaves their order to the kernel); draws from the method's generator.
* Otsu's threshold is computed here (numpy, skimage 0.2x's ``threshold_otsu`` rule; tested
  against skimage); the score uses ``log_softmax`` (officially ``softmax().log()``).
* Losses in float32 from the (autocast) features; no SAM, scheduler, text-tower
  adaptation or ResNet branch (all off in the official scripts).

Cost per batch: ``steps`` x (forward + backward of the batch and of up to
``num_shots x C`` memory images) + one prediction forward.

Measured effect: not measured (docs/methods.md#cliptta).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import numpy as np
import torch
from torch import nn

from mura_plugin.methods._norm import vision_layer_norm_parameters
from mura_plugin.methods._text_heads import TEXT_HEADS, class_head
from tta_bench.bounds import bounded, one_of
from tta_bench.method import OPTIMIZERS, PRECISIONS, GradientMethod
from tta_bench.model import ZeroShotClassifier

__all__ = [
    "CLIPTTA",
    "CLIPTTAConfig",
    "ClassMemory",
    "OOD_LOSSES",
    "max_log_prob",
    "official_template",
    "otsu_threshold",
    "outlier_contrastive_loss",
    "soft_contrastive_loss",
    "softmax_mean_entropy",
]

#: The official ``--loss_ood_type`` choices (abstract_model.otsu_loss).
OOD_LOSSES = ("avg_contrastive", "max_inter_var", "min_intra_var")
#: Official memory (num_shots, sample_size) per mode, CIFAR-10-C scripts.
OFFICIAL_MEMORY = {True: (16, 128), False: (4, 40)}
#: The official ``alpha`` before its first Otsu initialisation (``--alpha``).
ALPHA_INIT = 0.5
#: ``get_template(..., "default")`` of the official code, by this harness's dataset names.
OFFICIAL_TEMPLATES = {
    "imagenet": "A photo of a {}.",
    "caltech101": "A photo of a {}.",
    "stanford_cars": "A photo of a {}.",
    "dtd": "{} texture.",
    "eurosat": "A centered satellite photo of {}.",
    "fgvc_aircraft": "A photo of a {}, a type of aircraft.",
    "oxford_flowers": "A photo of a {}, a type of flower.",
    "food101": "A photo of a {}, a type of food.",
    "oxford_pets": "A photo of a {}, a type of pet.",
    "sun397": "A photo of {}.",
    "ucf101": "A photo of a person doing {}.",
}
#: CIFAR-10/100(-C), VisDA, PACS, OfficeHome (and every set the official code lacks).
CIFAR_TEMPLATE = "a photo of a {}"


def official_template(dataset: str | None) -> str:
    """The official single template for ``dataset`` (ImageNet's for every ImageNet set)."""
    name = dataset or ""
    if name.startswith("imagenet"):
        return OFFICIAL_TEMPLATES["imagenet"]
    return OFFICIAL_TEMPLATES.get(name, CIFAR_TEMPLATE)


@dataclass
class CLIPTTAConfig:
    open_set: bool = True  # OCE loss + ID filter + learnt threshold (official open-set scripts)
    steps: int = bounded(10, ge=1)  # optimiser steps per batch
    optimizer: str = one_of("adam", OPTIMIZERS)
    lr: float = bounded(1e-4, gt=0)
    weight_decay: float = bounded(0.0, ge=0)
    momentum: float = bounded(0.9, ge=0, le=1)  # SGD only
    eps: float = bounded(1e-6, gt=0)  # Adam/AdamW epsilon (official 1e-6)
    beta_tta: float = bounded(1.0, ge=0)
    beta_reg: float = bounded(1.0, ge=0)
    beta_ood: float = bounded(0.1, ge=0)
    gamma: float = bounded(0.005, gt=0)  # sigmoid temperature of the OCE weights
    ood_loss: str = one_of("avg_contrastive", OOD_LOSSES)
    update_alpha: bool = True  # learn the threshold (else Otsu of the scores at every step)
    ood_logit_scale: float = bounded(1.0, gt=0)  # temperature of the OOD / memory scores
    memory: bool = True  # class-wise confident memory (official --use_memory)
    num_shots: Optional[int] = bounded(None, ge=1)  # None: official per mode (open 16, closed 4)
    sample_size: Optional[int] = bounded(None, ge=1)  # None: official (open 128, closed 40)
    text_head: str = one_of("protocol", TEXT_HEADS)  # official: official_template(dataset)
    # clip.load's fp16 weights officially: fp16 autocast on CUDA; CPU: fp32
    precision: str = one_of("fp16", PRECISIONS)
    grad_scale: Optional[float] = bounded(None, gt=0)  # none officially


# -- the rules -----------------------------------------------------------------------------
def max_log_prob(cosines: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Official ``max_log_prob`` score ``[B]``: max_k log softmax(scale * cosines)_k."""
    return (scale * cosines).log_softmax(dim=-1).max(dim=-1).values


def softmax_mean_entropy(logits: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Official ``softmax_mean_entropy``: entropy of the batch-mean softmax, ``eps`` in the
    log. A scalar."""
    p = logits.softmax(dim=-1).mean(dim=0)
    return -(p * torch.log(p + eps)).sum()


def soft_contrastive_loss(
    features: torch.Tensor, text: torch.Tensor, scale: torch.Tensor | float
) -> torch.Tensor:
    """CLIPTTA's loss on normalised ``features [B, D]``: each image against the text features
    of the batch's pseudo-labels (``text [C, D]``, argmax of the cosines), B x B logits
    scaled by ``scale``, mean softmax entropy of the rows. 0 for an empty batch."""
    if features.shape[0] == 0:
        return features.sum() * 0.0
    pred = (features @ text.t()).argmax(dim=-1)
    logits = scale * features @ text[pred].t()
    return -(logits.softmax(dim=-1) * logits.log_softmax(dim=-1)).sum(dim=-1).mean()


def outlier_contrastive_loss(
    scores: torch.Tensor, alpha: torch.Tensor, gamma: float, kind: str = "avg_contrastive"
) -> torch.Tensor:
    """The OCE loss (official ``otsu_loss``): soft ID weights ``w = sigmoid((u - alpha) /
    gamma)``, weighted means ``mu_in``/``mu_out`` of the scores and proportions
    ``p_in``/``p_out``; ``avg_contrastive``: ``-(mu_in - mu_out)^2``; ``max_inter_var``:
    ``-p_in p_out (mu_in - mu_out)^2``; ``min_intra_var``: ``-p_out mu_out^2 - p_in mu_in^2``.
    0 when ``w`` or ``1 - w`` sums to 0."""
    if kind not in OOD_LOSSES:
        raise ValueError(f"unknown ood_loss {kind!r}; available: {', '.join(OOD_LOSSES)}")
    w = torch.sigmoid((scores - alpha) / gamma)
    w_in, w_out = w.sum(), (1 - w).sum()
    if float(w_in.detach()) == 0.0 or float(w_out.detach()) == 0.0:
        return (scores * w).sum() * 0.0
    mu_in = (w * scores).sum() / w_in
    mu_out = ((1 - w) * scores).sum() / w_out
    if kind == "max_inter_var":
        return -w.mean() * (1 - w).mean() * (mu_in - mu_out) ** 2
    if kind == "min_intra_var":
        return -(1 - w).mean() * mu_out**2 - w.mean() * mu_in**2
    return -((mu_in - mu_out) ** 2)


def otsu_threshold(scores: Any, nbins: int = 256) -> float:
    """Otsu's threshold of ``scores`` as skimage's ``threshold_otsu`` computes it: the value
    itself when all are equal; else a ``nbins`` histogram over [min, max] and the bin
    centre maximising ``w1 w2 (m1 - m2)^2`` (first maximum)."""
    x = np.asarray(scores).reshape(-1)
    if x.size == 0:
        raise ValueError("otsu_threshold needs at least one score")
    if np.all(x == x[0]):
        return float(x[0])
    counts, edges = np.histogram(x, bins=nbins, range=(np.min(x), np.max(x)))
    centers = (edges[:-1] + edges[1:]) / 2
    weight1 = np.cumsum(counts)
    weight2 = np.cumsum(counts[::-1])[::-1]
    mean1 = np.cumsum(counts * centers) / weight1
    mean2 = (np.cumsum((counts * centers)[::-1]) / weight2[::-1])[::-1]
    between = weight1[:-1] * weight2[1:] * (mean1[:-1] - mean2[1:]) ** 2
    return float(centers[int(np.argmax(between))])


class ClassMemory:
    """The official class-wise confident memory (CCM): per pseudo-class the ``num_shots``
    most confident images seen (ties: the earlier first), and a draw of
    ``max(1, int(sample_size / C))`` images per class (every image of a class that has no
    more), ``sample_size`` capped at ``num_shots * C`` as officially. Images on the CPU."""

    def __init__(self, num_classes: int, num_shots: int, sample_size: int):
        self.num_classes, self.num_shots = num_classes, num_shots
        self.sample_size = min(sample_size, num_shots * num_classes)
        self.images: list[torch.Tensor] = []
        self.confidences: list[torch.Tensor] = []
        self.clear()

    def clear(self) -> None:
        self.images = [torch.empty(0) for _ in range(self.num_classes)]
        self.confidences = [torch.empty(0) for _ in range(self.num_classes)]

    def __len__(self) -> int:
        return sum(len(c) for c in self.confidences)

    def sizes(self) -> list[int]:
        return [len(c) for c in self.confidences]

    def update(self, images: torch.Tensor, labels: torch.Tensor, confidences: torch.Tensor) -> None:
        images, labels = images.detach().cpu().float(), labels.detach().cpu()
        confidences = confidences.detach().cpu().float()
        for k in labels.unique().tolist():
            new = labels == k
            old = self.images[k] if len(self.confidences[k]) else images[:0]
            stored = torch.cat([old, images[new]])
            conf = torch.cat([self.confidences[k], confidences[new]])
            if len(conf) > self.num_shots:
                order = torch.sort(conf, descending=True, stable=True).indices[: self.num_shots]
                stored, conf = stored[order], conf[order]
            self.images[k], self.confidences[k] = stored, conf

    def sample(self, generator: torch.Generator) -> torch.Tensor | None:
        """The images drawn for one step, class by class (None when empty)."""
        per_class = max(1, int(self.sample_size / self.num_classes))
        drawn = []
        for images, conf in zip(self.images, self.confidences):
            n = len(conf)
            if n > per_class:
                drawn.append(images[torch.randperm(n, generator=generator)[:per_class]])
            elif n:
                drawn.append(images)
        return torch.cat(drawn) if drawn else None

    def state(self) -> dict[str, list[torch.Tensor]]:
        return {"images": list(self.images), "confidences": list(self.confidences)}

    def load_state(self, state: dict[str, list[torch.Tensor]]) -> None:
        self.images, self.confidences = list(state["images"]), list(state["confidences"])


# -- the method ----------------------------------------------------------------------------
class CLIPTTA(GradientMethod):
    """See the module docstring."""

    Config = CLIPTTAConfig
    predict_from_last_forward = False
    own_ood_score: ClassVar[str | None] = (
        "cliptta: max log-softmax of the image-text cosines at temperature 1 (max_log_prob), "
        "adapted model"
    )
    resolved: ClassVar[tuple[str, ...]] = ("num_shots", "sample_size")

    def setup(self) -> None:
        cfg = self.config
        shots, size = OFFICIAL_MEMORY[bool(cfg.open_set)]
        self.num_shots = shots if cfg.num_shots is None else cfg.num_shots
        self.sample_size = size if cfg.sample_size is None else cfg.sample_size
        self.head = class_head(self.model, cfg.text_head, [official_template(self.model.dataset)])
        self.alpha = nn.Parameter(torch.tensor(ALPHA_INIT, device=self.device))
        self.alpha.requires_grad_(bool(cfg.open_set and cfg.update_alpha))
        self.memory = ClassMemory(self.model.num_classes, self.num_shots, self.sample_size)
        super().setup()  # the objective is fixed: no ``loss`` field, no registered loss

    def collect_params(self, model: ZeroShotClassifier) -> list[nn.Parameter]:
        return vision_layer_norm_parameters(model, "cliptta")

    def param_groups(self) -> list[Any]:
        """The LayerNorm parameters and, when learnt, the threshold (same settings, as the
        official ``add_param_group``); Adam/AdamW with the official eps."""
        groups: list[dict[str, Any]] = [{"params": list(self.params)}]
        if self.alpha.requires_grad:
            groups.append({"params": [self.alpha]})
        if self.config.optimizer in ("adam", "adamw"):
            for group in groups:
                group["eps"] = self.config.eps
        return groups

    def extra_state(self) -> dict[str, Any]:
        return {"memory": self.memory.state()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.memory.load_state(state["memory"])

    def _restore(self) -> None:
        with torch.no_grad():
            self.alpha.fill_(ALPHA_INIT)
        super()._restore()

    # -- adaptation ----------------------------------------------------------------------
    def _features(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(normalised float32 features ``[B, D]``, cosines ``[B, C]``) of the model now."""
        with self.autocast():
            feats = self.model.encode_image(images)
        feats = feats.float()
        return feats, feats @ self.head.float().t()

    def scores(self, cosines: torch.Tensor) -> torch.Tensor:
        """The OOD score ``[B]`` (higher = more ID)."""
        return max_log_prob(cosines, self.config.ood_logit_scale)

    @torch.no_grad()
    def init_threshold(self, images: torch.Tensor) -> None:
        """Official ``init_otsu``: ``alpha`` = Otsu's threshold of the batch's scores."""
        _, cos = self._features(images)
        self.alpha.fill_(otsu_threshold(self.scores(cos).cpu().numpy()))

    def batch_loss(self, images: torch.Tensor, first: bool) -> torch.Tensor:
        """The official objective of one step (``_forward_and_adapt``): a scalar."""
        cfg = self.config
        scale = self.model.logit_scale
        head = self.head.float()
        feats, cos = self._features(images)
        reg = softmax_mean_entropy(scale * cos)
        ood = cos.sum() * 0.0
        kept_images, kept = images, feats
        if cfg.open_set:
            scores = self.scores(cos)
            ood = outlier_contrastive_loss(scores, self.alpha, cfg.gamma, cfg.ood_loss)
            if cfg.update_alpha:
                threshold = self.alpha.detach()
            else:
                threshold = torch.tensor(otsu_threshold(scores.detach().cpu().numpy()))
            keep = scores.detach() > threshold.to(scores.device)
            kept_images, kept = images[keep], feats[keep]
        tta = soft_contrastive_loss(kept, head, scale)
        if cfg.memory:
            if first and len(kept):
                kept_cos = kept.detach() @ head.t()
                conf = (cfg.ood_logit_scale * kept_cos).softmax(dim=-1).max(dim=-1)
                self.memory.update(kept_images, conf.indices, conf.values)
            drawn = self.memory.sample(self.generator)
            if drawn is not None:
                mem_feats, mem_cos = self._features(drawn.to(images.device, images.dtype))
                tta = tta + soft_contrastive_loss(mem_feats, head, scale)
                reg = reg + softmax_mean_entropy(scale * mem_cos)
        return cfg.beta_tta * tta - cfg.beta_reg * reg + cfg.beta_ood * ood

    def compute_loss(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The first step's objective (memory updated) and the logits of the model now."""
        loss = self.batch_loss(images, first=True)
        with torch.no_grad():
            feats, _ = self._features(images)
        return loss.reshape(1), self.model.logits_from_features(feats, self.head.float())

    def adapt(self, images: torch.Tensor) -> None:
        if self.config.open_set:
            self.init_threshold(images)
        for step in range(self.config.steps):
            with torch.enable_grad():
                loss = self.batch_loss(images, first=step == 0)
            self.optimizer.zero_grad(set_to_none=True)
            self.optimizer_step(loss)
            self.last_loss = loss.detach()

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """Logits of the model now; sets the own OOD score (and, in the open set, the
        filter's decision ``u > alpha``) of the batch."""
        feats, cos = self._features(images)
        scores = self.scores(cos)
        self.last_ood_score = scores.detach().float()
        self.last_ood_decision = scores > self.alpha.detach() if self.config.open_set else None
        return self.model.logits_from_features(feats, self.head.float()).float()
