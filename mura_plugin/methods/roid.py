"""ROID: certainty- and diversity-weighted self-training with weight ensembling and prior
correction.

Paper: Marsden, Döbler, Yang, "Universal Test-time Adaptation through Weight Ensembling,
Diversity Weighting, and Prior Correction", WACV 2024, https://arxiv.org/abs/2306.00650.
Official code: https://github.com/mariodoebler/test-time-adaptation, commit
8b2ed63255d906b6b0afaefc6ae630b9ec4bdaa1 (the authors maintain this harness; it is also
the reference harness: classification/methods/roid.py, methods/base.py, utils/losses.py
(SoftLikelihoodRatio, SymmetricCrossEntropy, Entropy), utils/misc.py (ema_update_model),
augmentations/transforms_cotta.py (get_tta_transforms), conf.py (ROID options),
cfgs/cifar10_c/roid.yaml, cfgs/imagenet_c/roid.yaml, models/model.py (ZeroShotCLIP)).

The defaults follow cfgs/cifar10_c/roid.yaml + conf.py: the default suite (digits-c) is
10 classes of 32 px images like CIFAR-10-C.

One step per batch, as officially (``forward_and_adapt`` / ``loss_calculation``):

1. forward the batch: logits ``z``, probabilities ``p = softmax(z)``;
2. weights (no gradient): diversity ``d_i = 1 - cos(pbar, p_i)`` with ``pbar`` the moving
   average of the batch-mean probabilities, min-max normalised over the batch;
   certainty ``c_i = -H(p_i)``, min-max normalised; ``w_i = exp(d_i c_i / T)``
   (T = 1/3); samples with ``d_i`` below the batch mean of ``d`` get ``w_i = 0`` and are
   left out of the consistency term;
3. ``pbar <- 0.9 pbar + 0.1 mean_i p_i`` (over the whole batch; ``pbar`` starts uniform);
4. loss = ``(sum_i w_i SLR(z_i) + sum_i w_i SCE(z_aug_i, z_i)) / N``: the soft likelihood
   ratio ``SLR(z) = -sum_c q_c log(q_c / (1 - q_c) + 1e-5)`` with ``q = clamp(p, 0, 0.99)``;
   the symmetric cross-entropy (alpha 0.5) between the kept samples' logits and those of
   one augmented copy of them (gradient through both); ``N`` the protocol's batch size
   (the official ``TEST.BATCH_SIZE``: here the size of the first batch after
   ``setup()``/``reset()``, kept for a short last batch); one Adam step;
5. weight ensembling: every adapted parameter ``theta <- 0.99 theta + 0.01 theta_source``;
6. the batch's prediction is the forward of step 1 (before the update), prior-corrected:
   ``prior = mean_i p_i``, ``s = max(1/B, 1/C) / max(prior)``,
   ``z * (prior + s) / (1 + s C)`` (the official code multiplies the logits, not the
   probabilities, by the smoothed prior).

Augmentation (official ``get_tta_transforms(img_size, padding_mode="reflect",
cotta_augs=False)``), one random draw shared by the augmented batch: clip to [0, 1]; colour
jitter in a random order of brightness U(0.6, 1.4), contrast U(0.7, 1.3), saturation
U(0.5, 1.5), hue U(-0.06, 0.06), gamma U(0.7, 1.3) (input clamped to [1e-8, 1] first);
reflect padding by half the image size; random affine (rotation U(-15, 15) degrees,
translation up to 1/16 of the padded size, rounded to whole pixels, scale U(0.9, 1.1),
bilinear, fill 0); centre crop back to the input size; horizontal flip with probability
0.5; clip to [0, 1] (no blur, no noise).

Defaults (cifar10_c/roid.yaml, conf.py): Adam lr 1e-3, betas (0.9, 0.999), no weight decay,
1 step, float32 (``MIXED_PRECISION`` False), weighting, consistency and prior correction on,
``MOMENTUM_SRC`` 0.99, ``MOMENTUM_PROBS`` 0.9, ``TEMPERATURE`` 1/3, batch 200 (the protocol
sets the batch size here). ImageNet-C (imagenet_c/roid.yaml): SGD lr 2.5e-4, momentum 0.9,
Nesterov, batch 64.

Parameters: the affine parameters of every norm layer of the vision tower; BatchNorm
normalises with test-batch statistics (official ``configure_model``/``collect_params``:
BatchNorm, LayerNorm and GroupNorm affine). On CLIP ViTs these are the image tower's
LayerNorms, as in the reference harness, whose frozen text tower (``FREEZE_TEXT_ENCODER``)
leaves only the unused ``ln_final`` besides them.

What differs:
* The augmentations use torchvision's ``transforms.v2.functional`` kernels with parameters
  drawn from the method's generator (official: torchvision v1 transforms on the global RNG):
  the same operations and ranges.
* The loss normaliser ``N`` is the first batch's size after ``setup()``/``reset()``
  (official: the configured ``TEST.BATCH_SIZE``, the same for full batches).
* A batch whose diversity (or certainty) values are all equal (e.g. a batch of one) gets
  normalised values 0 instead of the official 0/0 = NaN, which would make the parameters
  NaN: every sample is then kept with weight ``exp(0) = 1``.
* With ``use_weighting=False`` every sample is kept with weight 1 in both terms (the
  official consistency term needs the weighting's mask and fails without it).
* ``reset()`` restores parameters, optimiser and ``pbar`` (as officially) and the loss
  normaliser.
* The reference harness loads CLIP weights in fp16 (``CLIP.PRECISION``); here the model
  runs in float32 (``precision`` fp16/bf16 is CUDA autocast); weights, losses and the
  prior correction are computed in float32.
* The SGD option has no Nesterov momentum (the ImageNet-C setting uses it).
* Batches of one: the reference harness then adapts on a sliding window of the last
  ``TEST.WINDOW_LENGTH`` images; here the method sees the protocol's batches as they come.

Measured effect: docs/methods.md#roid.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import nn

from mura_plugin.methods._norm import norm_parameters, use_batch_statistics
from mura_plugin.methods._online import symmetric_cross_entropy
from mura_plugin.methods.cotta import cotta_augment
from tta_bench.bounds import bounded, one_of
from tta_bench.method import PRECISIONS, GradientConfig, GradientMethod
from tta_bench.model import ZeroShotClassifier

__all__ = [
    "ROID",
    "ROIDConfig",
    "ROIDLossConfig",
    "ROIDLossMethod",
    "ensemble_with_source_",
    "minmax",
    "prior_correction",
    "roid_augment",
    "roid_weights",
    "soft_likelihood_ratio",
    "softmax_entropy",
    "symmetric_cross_entropy",
    "update_class_probs",
]


# -- the loss terms ------------------------------------------------------------------------
def softmax_entropy(logits: torch.Tensor) -> torch.Tensor:
    """``H(softmax(z))`` per sample ``[B]``."""
    return -(logits.softmax(dim=1) * logits.log_softmax(dim=1)).sum(dim=1)


def soft_likelihood_ratio(
    logits: torch.Tensor, clip: float = 0.99, eps: float = 1e-5
) -> torch.Tensor:
    """ROID's soft likelihood ratio per sample ``[B]``:
    ``-sum_c q_c log(q_c / (1 - q_c) + eps)``, ``q = clamp(softmax(z), 0, clip)``."""
    q = logits.softmax(dim=1).clamp(0.0, clip)
    return -(q * torch.log(q / (1.0 - q) + eps)).sum(dim=1)


def minmax(values: torch.Tensor) -> torch.Tensor:
    """``(v - min) / (max - min)``; all zeros when every value is the same (the official
    0/0 would be NaN)."""
    low, high = values.min(), values.max()
    span = high - low
    if not bool(span > 0):
        return torch.zeros_like(values)
    return (values - low) / span


@torch.no_grad()
def roid_weights(
    logits: torch.Tensor, class_probs: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """ROID's certainty and diversity weights for ``logits [B, C]`` given the moving
    average of probabilities ``class_probs [C]``: ``(weights [B], keep [B])``; the samples
    not kept (normalised diversity below its batch mean) have weight 0."""
    z = logits.detach().float()
    diversity = 1.0 - F.cosine_similarity(class_probs.unsqueeze(0), z.softmax(dim=1), dim=1)
    diversity = minmax(diversity)
    keep = ~(diversity < diversity.mean())
    certainty = minmax(-softmax_entropy(z))
    weights = torch.exp(diversity * certainty / temperature)
    return torch.where(keep, weights, torch.zeros_like(weights)), keep


@torch.no_grad()
def update_class_probs(
    class_probs: torch.Tensor, probs: torch.Tensor, momentum: float
) -> torch.Tensor:
    """``momentum * pbar + (1 - momentum) * mean_i p_i`` for ``probs [B, C]``."""
    return momentum * class_probs + (1.0 - momentum) * probs.detach().float().mean(dim=0)


@torch.no_grad()
def prior_correction(logits: torch.Tensor) -> torch.Tensor:
    """ROID's output prior correction: the logits ``[B, C]`` times the smoothed batch
    prior ``(prior + s) / (1 + s C)``, ``prior`` the batch-mean softmax and
    ``s = max(1/B, 1/C) / max(prior)`` (float32)."""
    z = logits.detach().float()
    b, c = z.shape
    prior = z.softmax(dim=1).mean(dim=0)
    smooth = max(1.0 / b, 1.0 / c) / prior.max()
    return z * ((prior + smooth) / (1.0 + smooth * c))


@torch.no_grad()
def ensemble_with_source_(
    params: Sequence[torch.Tensor], source: Sequence[torch.Tensor], momentum: float
) -> None:
    """ROID's weight ensembling in place: ``theta <- m theta + (1 - m) theta_source``."""
    if momentum >= 1.0:
        return
    for p, src in zip(params, source, strict=True):
        p.copy_(momentum * p + (1.0 - momentum) * src)


# -- the augmentation ----------------------------------------------------------------------
def roid_augment(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One augmented copy of ``images [B, 3, S, S]`` in [0, 1] (the official
    ``get_tta_transforms(..., padding_mode="reflect", cotta_augs=False)``): every random
    parameter is drawn once from ``generator`` (CPU) and shared by the batch; CoTTA's
    augmentation with reflect padding and without its blur and noise."""
    return cotta_augment(images, generator, noise_std=None, padding_mode="reflect", blur=False)


# -- the method ----------------------------------------------------------------------------
@dataclass
class ROIDLossConfig(GradientConfig):
    """What ROID and CMF share: ROID's loss and prediction (reference cifar10_c setting)."""

    loss: Optional[str] = None  # the objective is fixed: ROID's weighted SLR + consistency
    optimizer: str = "adam"
    lr: float = 1e-3
    weight_decay: float = 0.0
    steps: int = bounded(1, ge=1)
    precision: str = one_of("fp32", PRECISIONS)
    #: Certainty and diversity weighting (official USE_WEIGHTING).
    use_weighting: bool = True
    #: Symmetric cross-entropy to one augmented copy (official USE_CONSISTENCY).
    use_consistency: bool = True
    #: Smoothed batch-prior correction of the prediction (official USE_PRIOR_CORRECTION).
    use_prior_correction: bool = True
    #: Momentum of the moving average of probabilities (official MOMENTUM_PROBS).
    momentum_probs: float = bounded(0.9, ge=0, le=1)
    #: Temperature of the weights (official TEMPERATURE).
    temperature: float = bounded(1 / 3, gt=0)


class ROIDLossMethod(GradientMethod):
    """ROID's weighted loss on the vision tower's norm-layer affine parameters and its
    prior-corrected prediction; ``after_update`` says what follows each optimiser step."""

    Config: ClassVar[type] = ROIDLossConfig
    predict_from_last_forward = True
    state_attributes: ClassVar[tuple[str, ...]] = ("class_probs", "loss_batch_size")

    def setup(self) -> None:
        c = self.model.num_classes
        #: The moving average of probabilities (``pbar``), uniform at the start.
        self.class_probs = torch.full((c,), 1.0 / c, device=self.device)
        #: The loss normaliser N: the first batch's size after setup/reset.
        self.loss_batch_size: int | None = None
        super().setup()
        #: The adapted parameters' source values.
        self.source_params = [p.detach().clone() for p in self.params]

    def configure(self, model: ZeroShotClassifier) -> None:
        use_batch_statistics(model.visual)

    def collect_params(self, model: ZeroShotClassifier) -> list[nn.Parameter]:
        params = norm_parameters(model.visual)
        if not params:
            raise ValueError(
                f"{type(self).__name__.lower()} found no normalisation layers in the vision tower"
            )
        return params

    def compute_loss(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(per-sample loss [B], logits [B, C])`` whose mean over the batch is ROID's
        loss ``sum_i w_i (SLR_i + SCE_i) / N``; updates ``pbar`` (as officially)."""
        cfg = self.config
        b = images.shape[0]
        if self.loss_batch_size is None:
            self.loss_batch_size = int(b)
        logits = self.model(images)
        z = logits.float()
        if cfg.use_weighting:
            weights, keep = roid_weights(z, self.class_probs, cfg.temperature)
            self.class_probs = update_class_probs(
                self.class_probs, z.softmax(dim=1), cfg.momentum_probs
            )
        else:
            weights = torch.ones(b, device=z.device)
            keep = torch.ones(b, dtype=torch.bool, device=z.device)
        per_sample = weights * soft_likelihood_ratio(z)
        if cfg.use_consistency and bool(keep.any()):
            augmented = self.model(roid_augment(images[keep], self.generator)).float()
            consistency = weights[keep] * symmetric_cross_entropy(augmented, z[keep])
            per_sample = per_sample.index_add(0, keep.nonzero().squeeze(1), consistency)
        return per_sample * (b / self.loss_batch_size), logits

    def after_update(self) -> None:
        """What follows each optimiser step (ROID: ensembling with the source)."""

    def adapt(self, images: torch.Tensor) -> torch.Tensor:
        logits = None
        for _ in range(self.config.steps):
            with torch.enable_grad(), self.autocast():
                per_sample, logits = self.compute_loss(images)
                loss = per_sample.mean()
            self.optimizer.zero_grad(set_to_none=True)
            self.optimizer_step(loss)
            self.after_update()
            self.last_loss = loss.detach()
        return logits

    def corrected(self, logits: torch.Tensor) -> torch.Tensor:
        """The prediction from ``logits``: prior-corrected when the config says so."""
        z = logits.detach().float()
        return prior_correction(z) if self.config.use_prior_correction else z

    def step(self, images: torch.Tensor) -> torch.Tensor:
        with self.timed("adapt"):
            logits = self.adapt(images)
        with self.timed("predict"):
            return self.corrected(logits)

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """The current model's prior-corrected logits (the correction reads only this
        batch)."""
        with self.autocast():
            logits = self.model(images)
        return self.corrected(logits)

    def resolved_settings(self) -> dict[str, Any]:
        return {"loss_batch_size": self.loss_batch_size}


@dataclass
class ROIDConfig(ROIDLossConfig):
    """The reference harness's ROID setting (cfgs/cifar10_c/roid.yaml + conf.py)."""

    #: Weight-ensembling momentum: ``theta <- m theta + (1 - m) theta_source`` (MOMENTUM_SRC).
    momentum_src: float = bounded(0.99, ge=0, le=1)


class ROID(ROIDLossMethod):
    """ROID: weighted SLR + consistency, weight ensembling with the source, prior
    correction."""

    Config = ROIDConfig

    def after_update(self) -> None:
        ensemble_with_source_(self.params, self.source_params, self.config.momentum_src)
