"""SANTA: source anchoring by self-distillation and source-prototype target alignment.

Paper: Chakrabarty, Sreenivas, Biswas, "SANTA: Source Anchoring Network and Target
Alignment for Continual Test Time Adaptation", TMLR 2023,
https://openreview.net/forum?id=V7guVYzvE4 (preprint titled "SATA", April 2023).
Official code: https://github.com/goirik-chakrabarty/test-time-adaptation, commit
93da31b8430338c077a77a44811dfd4788436f17 (the authors' fork of the reference harness:
classification/methods/santa.py, utils/losses.py (AugCrossEntropy), conf.py (SANTA,
CONTRAST), cfgs/cifar10_c/santa.yaml; the authors' repository
https://github.com/goirik-chakrabarty/SANTA, commit 99098335ae9586723dd41a5a3e6df2a5342efb87,
holds only a README pointing there). The reference harness,
https://github.com/mariodoebler/test-time-adaptation commit
8b2ed63255d906b6b0afaefc6ae630b9ec4bdaa1 (classification/methods/santa.py,
cfgs/cifar10_c/santa.yaml, cfgs/imagenet_c/santa.yaml), carries the same rule (refactored
into ``loss_calculation``, with mixed-precision support).

The defaults follow cfgs/cifar10_c/santa.yaml + conf.py (the same in both repositories):
the default suite (digits-c) is 10 classes of 32 px images like CIFAR-10-C.

Before adaptation (``setup``), from the labelled clean source images the runner hands over
(``needs_source_labels``; the protocol's declared source split, never the test stream):

1. source prototypes: the mean image feature of each class (source model; shared with RMT,
   ``mura_plugin.methods.rmt.class_prototypes``);
2. a projector ``Linear(D, 128) -> ReLU -> Linear(128, 128)`` that adapts with the model;
3. the anchor: a frozen copy of the source model (normalising with test-batch statistics
   on BatchNorm towers, the paper's "target corrected source" model).

Each test batch, one step:

4. student: features ``f`` and logits ``z`` of the batch, ``f'``/``z'`` of one augmented
   copy (CoTTA's augmentation, one draw for the batch); anchor logits ``a`` of the batch;
5. loss = ``lambda_ce_trg * mean_i L_SA,i + lambda_cont * L_con`` with the source anchoring
   term ``L_SA = -0.5 sum softmax(z) log softmax(a) - 0.5 sum softmax(z') log softmax(a)``
   (official ``AugCrossEntropy``: gradient through the student's probabilities, none
   through the anchor) and ``L_con`` RMT's prototype contrastive term (SupCon, temperature
   0.1, over the nearest source prototype, ``f`` and ``f'``; ``prototype_contrastive_loss``);
   one Adam step;
6. the batch's prediction is the student's ``z`` (before the update).

Defaults (cifar10_c/santa.yaml, conf.py): Adam lr 1e-3, betas (0.9, 0.999), no weight decay,
1 step, float32, ``LAMBDA_CE_TRG`` 1.0, ``LAMBDA_CONT`` 1.0, ``CONTRAST.TEMPERATURE`` 0.1,
``CONTRAST.PROJECTION_DIM`` 128, ``CONTRAST.MODE`` "all". ImageNet-C (imagenet_c/santa.yaml):
SGD lr 0.01, momentum 0.9, Nesterov, batch 64.

Source data (``source_size`` 2,000 images, batches of ``source_batch_size`` 64 for the
feature pass): only the prototypes use it (officially the whole source training split; on
digits-c 2,000 is the whole split of 1,437 digits; see rmt.py).

Parameters: the affine parameters of every norm layer of the image tower (official
``configure_model``: BatchNorm, LayerNorm and GroupNorm; BatchNorm on test-batch
statistics) and the projector's. On CLIP ViTs these are the image tower's LayerNorms, which
the official rule lists itself. Features: the L2-normalised image features
(``model.encode_image``), as for RMT.

What differs:
* The reference harness (and the authors' fork) has no CLIP split for SANTA
  (``split_up_model``): the image features and the text head stand in for the feature
  extractor and the classifier (as in rmt.py).
* The paper's Eq. 2 sums the two anchoring terms; the official code weighs each by 0.5
  (followed).
* Source data: ``source_size`` images instead of the whole split; a class without source
  images is left out of the nearest-prototype search (officially its prototype is NaN).
* The anchor is the source values of the adapted parameters substituted into the same
  modules (``torch.func.functional_call``) instead of a deep copy: the same forward.
* The prototypes are recomputed at every setup (the reference caches them on disk).
* Augmentations: ``cotta_augment`` (torchvision v2 kernels, the method's generator; official:
  v1 transforms on the global RNG), the same operations and ranges.
* The SGD option has no Nesterov momentum (the ImageNet-C setting uses it).

Measured effect: docs/methods.md#santa.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from mura_plugin.methods._norm import norm_parameters
from mura_plugin.methods.rmt import SourcePrototypeConfig, SourcePrototypeMethod
from tta_bench.model import ZeroShotClassifier

__all__ = ["SANTA", "SANTAConfig", "anchored_cross_entropy"]


@dataclass
class SANTAConfig(SourcePrototypeConfig):
    """The official SANTA CIFAR-10-C setting (cfgs/cifar10_c/santa.yaml + conf.py)."""


def anchored_cross_entropy(
    logits: torch.Tensor, aug_logits: torch.Tensor, anchor: torch.Tensor, alpha: float = 0.5
) -> torch.Tensor:
    """SANTA's source anchoring per sample ``[B]``: ``-(1 - alpha) sum softmax(logits)
    log softmax(anchor) - alpha sum softmax(aug_logits) log softmax(anchor)`` (float32; the
    anchor is not differentiated)."""
    log_anchor = anchor.detach().float().log_softmax(dim=1)
    plain = (logits.float().softmax(dim=1) * log_anchor).sum(dim=1)
    augmented = (aug_logits.float().softmax(dim=1) * log_anchor).sum(dim=1)
    return -(1 - alpha) * plain - alpha * augmented


class SANTA(SourcePrototypeMethod):
    """Norm-layer adaptation anchored to the source model, aligned to source prototypes."""

    Config = SANTAConfig
    method_name: ClassVar[str] = "santa"

    def model_parameters(self, model: ZeroShotClassifier) -> list[nn.Parameter]:
        params = norm_parameters(model.visual)
        if not params:
            raise ValueError("santa found no normalisation layers in the image tower")
        return params

    def setup(self) -> None:
        super().setup()
        #: The source values of the adapted model parameters: the anchor model.
        self.anchor = [p.detach().clone() for p in self.model_params]

    def compute_loss(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss per sample [B], student logits [B, C])``; the batch mean of the loss is
        the official loss."""
        cfg = self.config
        features, logits = self.student(images)
        aug_features, aug_logits = self.student(self.augment(images))
        with torch.no_grad():
            anchor = self.forward_with(self.anchor, images).float()
        loss = cfg.lambda_ce_trg * anchored_cross_entropy(logits, aug_logits, anchor)
        loss = loss + cfg.lambda_cont * self.contrastive(features, aug_features)
        return loss, logits
