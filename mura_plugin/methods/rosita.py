"""ROSITA: open-world single-image test-time adaptation of CLIP (feature banks + ReDUCe).

Paper: Sreenivas and Biswas, "Efficient Open Set Single Image Test Time Adaptation of Vision
Language Models", TMLR 2025 (the official README's title; arXiv 2406.00481, first titled
"Effectiveness of Vision Language Models for Open-world Single Image Test Time
Adaptation"). Official code:
https://github.com/manogna-s/ROSITA, read at commit
b92440717a77f855f7311789e9ab09133ce04970 (MIT licence; methods/rosita.py, utils/clip_tta_utils.py:
``compute_os_variance``, ``get_ln_params``, ``get_classifiers``; models/clip.py:
``CustomCLIP_CLIP``; owtta.py: arguments, views, seeding; utils/data_utils.py:
``AugMixAugmenter``, ``get_preaugment``, the mixed ID/OOD loader; clip/model.py:
``build_model``; scripts/run.sh). The defaults follow this repository (it runs CLIP
itself; MarcLafon/cliptta, read for CLIPTTA, has no ROSITA).

The rule, per test image x, one at a time (the official stream has batch size 1):

1. encode x and one augmented view of it (RandomResizedCrop + horizontal flip); cosines
   ``c = f T^T`` of the normalised features with the normalised class text features; the
   OOD score is ``u = max_k c_k`` of x (higher = more ID), its pseudo-label ``y = argmax``;
2. ``u`` joins a queue of the last ``n_scores`` (512) scores; the threshold ``tau`` is the
   value of the grid 0, 0.01, ..., 0.99 minimising the weighted within-class variance of
   the queue split at ``tau`` (Otsu's criterion; splits with an empty side excluded; the
   first minimum), ``mu0``/``mu1`` the mean score below / at-or-above ``tau`` (when every
   split is excluded, ``tau = 0``, ``mu0 = 0``, ``mu1 = 1`` as officially);
3. x is judged ID (desired) when ``u >= tau``; a strong ID sample (``u >= tau`` and
   ``u > mu1``) enters the ID feature bank (its last ``k_p x C`` features), a strong OOD one
   (``u < tau`` and ``u < mu0``) the OOD bank (its last ``ood_bank`` features);
4. loss: pseudo-label cross-entropy on x and its view for a strong ID sample (on the raw
   cosines, temperature 1, as officially), plus ``alpha`` x ReDUCe once both banks hold
   more than ``k_p`` features and x is strong ID or strong OOD: with P the bank of x's
   side and N the other, ``mean_j (-s_j + log sum_{n in top-k_n} exp(s_n))`` over the
   ``k_p`` most similar entries j of P (cosine ``s``), an ID sample's positives counted
   only where their pseudo-label under the head equals ``y`` (the others count 0);
5. one SGD step (lr 1e-3, no momentum) on the image tower's LayerNorm affine parameters
   when a loss term applies; then x is predicted by the updated model.

The model, optimiser state, score queue and both banks carry along the stream until the
protocol resets (``stream_kind = "online"``). A protocol batch is processed image by image
in its order, exactly as that many single-image steps (views drawn once per batch).

Official setting (defaults: owtta.py's argument defaults, which scripts/run.sh does not
change for any dataset, CIFAR-10 included): ``n_scores`` 512, ``ood_bank`` (N_s) 64,
``k_p`` = ``k_n`` = 5, ``alpha`` 0.5, both losses on, SGD lr 1e-3, LayerNorm parameters of
the image tower (``get_ln_params``), the CoOp-style prompt "a photo of a {}." (a single
template: ``text_head="official"``). The official model keeps CLIP's float32 weights for
the adaptation forward (``convert_weights`` is commented out): ``precision="fp32"``.

Own OOD score: ``u``, the max cosine of the image under the model *before* its own update,
the score the official AUROC/FPR95 use; the own decision is ``u >= tau`` (its ID/OOD
classifier, whose accuracies are the official ACC_D / ACC_U).

What differs from the official code and why:
* Text head: ``text_head="protocol"`` (default) uses the protocol's head.
* The view is cut from the model-size image (torchvision's crop boxes, one bilinear
  ``grid_sample``, ``mura_plugin.augment``) on the method's generator, not PIL crops of the
  raw image; the clean image is the model-size image (officially Resize + CenterCrop 224).
* The official final prediction runs under fp16 autocast; here under ``precision`` (fp32
  by default), as is the adaptation; prediction logits use the model's logit scale
  (officially x100 before a softmax: the same argmax for CLIP).
* ReDUCe takes ``min(k_n, bank size)`` negatives (officially ``topk`` fails when ``k_n``
  exceeds the bank; never with the defaults, whose condition ensures > ``k_p`` = ``k_n``).
* Scores are float32 values kept in float64 for the threshold search, as the official
  numpy code does; the variances are computed vectorised (numpy's ``np.var`` sums
  pairwise: last-bit rounding only).

Cost per image: one forward + backward of two views (image and view) and one prediction
forward, against TDA's one forward: ROSITA is not ``light``.

Measured effect: not measured (docs/methods.md#rosita).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from mura_plugin.augment import random_resized_crops
from mura_plugin.methods._norm import vision_layer_norm_parameters
from mura_plugin.methods._score_split import THRESHOLD_GRID, Split, score_threshold
from mura_plugin.methods._text_heads import SINGLE_PROMPT, TEXT_HEADS, class_head
from tta_bench.bounds import bounded, one_of
from tta_bench.method import OPTIMIZERS, PRECISIONS, GradientMethod
from tta_bench.model import ZeroShotClassifier

__all__ = [
    "ROSITA",
    "ROSITAConfig",
    "Split",
    "THRESHOLD_GRID",
    "reduce_loss",
    "score_threshold",
]


@dataclass
class ROSITAConfig:
    n_scores: int = bounded(512, ge=1)  # N_scores: the score queue the threshold is fitted on
    ood_bank: int = bounded(64, ge=1)  # N_s: the strong-OOD feature bank
    k_p: int = bounded(5, ge=1)  # positives per ReDUCe term; the ID bank holds k_p x C
    k_n: int = bounded(5, ge=1)  # negatives per ReDUCe term
    alpha: float = bounded(0.5, ge=0)  # weight of ReDUCe
    pl_loss: bool = True  # pseudo-label cross-entropy on strong ID samples (--loss_pl)
    reduce_loss: bool = True  # ReDUCe (--loss_simclr)
    optimizer: str = one_of("sgd", OPTIMIZERS)
    lr: float = bounded(1e-3, gt=0)
    momentum: float = bounded(0.0, ge=0, le=1)  # SGD only (torch's default 0, as officially)
    weight_decay: float = bounded(0.0, ge=0)
    text_head: str = one_of("protocol", TEXT_HEADS)  # official: "a photo of a {}."
    precision: str = one_of("fp32", PRECISIONS)  # the official adaptation runs float32


def _float32(split: Split) -> Split:
    """``split`` rounded to float32: the official decisions compare a float32 score tensor
    with these numpy floats, which torch casts to the tensor's float32."""
    return Split(*(float(torch.tensor(v, dtype=torch.float32)) for v in split))


def reduce_loss(
    feature: torch.Tensor,
    positives: torch.Tensor,
    negatives: torch.Tensor,
    k_p: int,
    k_n: int,
    mask_fn: Any = None,
) -> torch.Tensor:
    """ReDUCe for one normalised ``feature [D]``: its ``k_p`` most similar ``positives``
    (cosine ``s_j``) against its ``min(k_n, len)`` most similar ``negatives``,
    ``mean_j m_j (-s_j + log sum_n exp(s_n))``; ``mask_fn(indices) -> [k_p]`` bools gives
    ``m`` (all ones when None). Bank entries are renormalised, as officially."""
    pos = F.normalize(positives.float(), dim=-1)
    neg = F.normalize(negatives.float(), dim=-1)
    top_pos = torch.topk(feature @ pos.t(), k=k_p)
    top_neg = torch.topk(feature @ neg.t(), k=min(k_n, len(neg))).values
    terms = -top_pos.values + torch.log(torch.exp(top_neg).sum())
    if mask_fn is not None:
        terms = terms * mask_fn(top_pos.indices).to(terms.dtype)
    return terms.mean()


class ROSITA(GradientMethod):
    """See the module docstring."""

    Config = ROSITAConfig
    stream_kind = "online"
    own_ood_score: ClassVar[str | None] = (
        "rosita: max cosine to the class text features before the image's update"
    )
    state_attributes: ClassVar[tuple[str, ...]] = ("queue", "bank_id", "bank_ood")

    def setup(self) -> None:
        self.head = class_head(self.model, self.config.text_head, SINGLE_PROMPT).float()
        self.id_bank_size = self.config.k_p * self.model.num_classes
        dim = self.head.shape[1]
        self.queue = torch.empty(0, dtype=torch.float64)
        self.bank_id = torch.empty(0, dim, device=self.device)
        self.bank_ood = torch.empty(0, dim, device=self.device)
        super().setup()

    def collect_params(self, model: ZeroShotClassifier) -> list[nn.Parameter]:
        return vision_layer_norm_parameters(model, "rosita")

    # -- the stream state ----------------------------------------------------------------
    def observe(self, score: float, feature: torch.Tensor) -> tuple[bool, Split]:
        """Push ``score`` to the queue, fit the threshold, put ``feature`` (detached) in
        the bank its strength calls for; returns (judged ID, the split)."""
        cfg = self.config
        self.queue = torch.cat([self.queue, torch.tensor([score], dtype=torch.float64)])
        self.queue = self.queue[-cfg.n_scores :]
        split = _float32(score_threshold(self.queue))
        is_id = score >= split.tau
        row = feature.detach().float().reshape(1, -1)
        if is_id and score > split.mu1:
            self.bank_id = torch.cat([self.bank_id, row])[-self.id_bank_size :]
        if not is_id and score < split.mu0:
            self.bank_ood = torch.cat([self.bank_ood, row])[-cfg.ood_bank :]
        return is_id, split

    # -- adaptation ----------------------------------------------------------------------
    def compute_loss(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One image's step on ``images = [image, its view]``: encodes both, observes the
        image's score (queue, threshold, banks) and returns (loss ``[1]``, zero without
        gradient when no term applies; the cosines ``[2, C]``). Sets ``self._seen`` to
        (score, judged ID)."""
        cfg = self.config
        with self.autocast():
            feats = self.model.encode_image(images)
        feats = feats.float()
        cos = feats @ self.head.t()
        score, label = float(cos[0].detach().max()), cos[0].detach().argmax()
        is_id, split = self.observe(score, feats[0])
        self._seen = (score, is_id)
        loss = torch.zeros((), device=feats.device)
        if cfg.pl_loss and is_id and score > split.mu1:
            target = label.reshape(1)
            loss = loss + F.cross_entropy(cos[0:1], target) + F.cross_entropy(cos[1:2], target)
        strong = score > split.mu1 or score < split.mu0
        banks_ready = min(len(self.bank_id), len(self.bank_ood)) > cfg.k_p
        if cfg.reduce_loss and banks_ready and strong:
            if is_id:

                def same_label(idx: torch.Tensor) -> torch.Tensor:
                    pos = F.normalize(self.bank_id[idx], dim=-1)
                    return (pos @ self.head.t()).argmax(dim=-1) == label

                term = reduce_loss(
                    feats[0], self.bank_id, self.bank_ood, cfg.k_p, cfg.k_n, same_label
                )
            else:
                term = reduce_loss(feats[0], self.bank_ood, self.bank_id, cfg.k_p, cfg.k_n)
            loss = loss + cfg.alpha * term
        return loss.reshape(1), cos

    def step_one(self, image: torch.Tensor, view: torch.Tensor) -> tuple[float, bool]:
        """Adapt on one image (``[1, 3, H, W]``) and its view; returns (score, judged ID)."""
        with self.timed("adapt"):
            with torch.enable_grad():
                loss, _ = self.compute_loss(torch.cat([image, view]))
            if loss.requires_grad:
                self.optimizer.zero_grad(set_to_none=True)
                self.optimizer_step(loss.sum())
            self.last_loss = loss.detach().sum()
        return self._seen

    def step(self, images: torch.Tensor) -> torch.Tensor:
        """Each image of the batch in order: its step, then its prediction by the updated
        model; the own score and decision are each image's, before its update."""
        views = random_resized_crops(images, 1, self.generator, flip=True)[0]
        logits, scores, decisions = [], [], []
        for i in range(images.shape[0]):
            score, is_id = self.step_one(images[i : i + 1], views[i : i + 1])
            with self.timed("predict"):
                logits.append(self._logits(images[i : i + 1]))
            scores.append(score)
            decisions.append(is_id)
        self.last_ood_score = torch.tensor(scores, dtype=torch.float32)
        self.last_ood_decision = torch.tensor(decisions, dtype=torch.bool)
        return torch.cat(logits)

    @torch.no_grad()
    def _logits(self, images: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            feats = self.model.encode_image(images)
        return self.model.logits_from_features(feats.float(), self.head).float()

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """The realtime track's prediction: the model now; scores and decisions against
        the current threshold, nothing observed or adapted."""
        with self.autocast():
            feats = self.model.encode_image(images)
        feats = feats.float()
        cos = feats @ self.head.t()
        scores = cos.max(dim=-1).values
        self.last_ood_score = scores.detach()
        self.last_ood_decision = scores >= _float32(score_threshold(self.queue)).tau
        return self.model.logits_from_features(feats, self.head).float()
