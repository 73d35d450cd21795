"""MEMO: marginal entropy minimisation over augmented copies, one test image at a time.

Paper: Zhang, Levine, Finn, "MEMO: Test Time Robustness via Adaptation and Augmentation",
NeurIPS 2022 (https://arxiv.org/abs/2110.09506).
Official code: https://github.com/zhangmarvin/memo, read at commit
228b2908d271c954ef8bf19cf143ede3b2fa8e3e (cifar-10-exps/test_calls/test_adapt.py,
cifar-10-exps/utils/third_party.py, imagenet-exps/test_calls/test_adapt.py,
imagenet-exps/utils/adapt_helpers.py, train_helpers.py, third_party.py, script_test_in.py).
Reference harness: mariodoebler/test-time-adaptation at commit
8b2ed63255d906b6b0afaefc6ae630b9ec4bdaa1 (classification/methods/memo.py, methods/base.py,
methods/bn.py ``AlphaBatchNorm``, augmentations/transforms_augmix.py, augmentations/augmix_ops.py,
datasets/data_loading.py, conf.py, cfgs/cifar10_c/memo.yaml, cfgs/imagenet_c/memo.yaml).

Defaults follow the reference harness's cifar10_c setting (cfgs/cifar10_c/memo.yaml with
conf.py's defaults), the rule for every method of this plugin (digits-c is 10 classes of 32 px
images, like CIFAR-10-C): 32 AugMix copies (``TEST.N_AUGMENTATIONS``), SGD lr 0.005 with
conf.py's momentum 0.9, Nesterov, no dampening, no weight decay, 1 step, episodic per sample,
``BN.ALPHA`` 0.1, float32 (``MIXED_PRECISION`` False). The official CIFAR-10 run has the same
copies, lr and step but plain SGD (momentum 0): from a fresh optimiser Nesterov makes the
first update ``(1 + 0.9) lr g``, 1.9 times the official one; ``nesterov=false`` (or
``momentum=0``) gives the official update exactly when ``steps=1``. imagenet_c (reference):
64 copies, SGD lr 0.00025 (the official ResNet-50 setting, with BatchNorm prior strength 16;
the official RVT*-small, a vision transformer: AdamW lr 1e-5, weight decay 0.01).

The rule (per test image x, ``episodic=sample``):

1. draw ``views`` augmented copies of x: a crop (``crop``: at 32 px RandomCrop(32,
   padding 4) + horizontal flip, the official CIFAR ``preaugment`` and the reference's
   rule for 32 px CIFAR; otherwise RandomResizedCrop + flip, the official ImageNet one),
   then AugMix of the crop (3 chains of 1-3 of 9 operations at severity 1, Dirichlet(1, 1, 1)
   chain weights, Beta(1, 1) blend with the crop; augment.py);
2. with the current model, the mean of the copies' softmax predictions
   ``p = 1/B sum_b softmax(f(x_b))`` and its entropy ``H(p) = -sum_c p_c log p_c`` (the
   marginal entropy, in log space: ``losses.marginal_entropy`` over all copies);
3. ``steps`` optimiser steps on ``H(p)`` (the same copies at every step) over the adapted
   parameters: the whole image tower (official ``net.parameters()``);
4. the prediction: the original x (no augmentation) through the updated model;
5. the parameters and the optimiser state go back to their state after ``setup()``.

BatchNorm prior: the official ImageNet code normalises each BatchNorm2d with
``N/(N+1)`` source statistics plus ``1/(N+1)`` statistics of the current batch (prior strength
N = 16), the reference harness with ``(1 - alpha)`` source plus ``alpha`` test statistics
(``AlphaBatchNorm``, ``BN.ALPHA`` 0.1); the batch is the B copies while adapting and the single
image when predicting, its statistics detached (both codes compute them into buffers). Here
``bn_alpha`` does the same on BatchNorm towers (ResNet CLIPs; ``alpha = 1/(N+1)`` is the
official form). CLIP ViTs have LayerNorm only, which normalises each token by its own
statistics and keeps no source statistics: there is nothing to mix, the prior is a no-op,
and the official CIFAR model (GroupNorm) has none either.

What differs:
* Parameters: the whole image tower (``params=all``; the official adapts every parameter of
  its classifier). The text tower is frozen and the class embeddings (the CLIP classifier's
  last layer) stay fixed. The reference harness's ``collect_params`` takes the parameters
  named ``weight``/``bias`` of every module (``params=weight_bias``), which on open_clip
  ViTs leaves out the attention ``in_proj`` weights, the class and positional embeddings and
  the projection; ``params=norm`` adapts the norm-layer affine parameters only. The
  reference harness cannot run MEMO on CLIP at all (its CLIP data path builds no AugMix
  copies).
* AugMix: the plugin's (augment.py), which is the reference harness's ``augmix_ops``
  (black fill outside the image); the official MEMO operations fill rotations, shears and
  translations with grey 128 (``fillcolor=128``). Its operation list order differs (drawn
  uniformly: the same distribution).
* Crops are cut from the image at the model's size (the official ImageNet code crops the
  raw ImageNet-R/A image; ImageNet-C is already 224 px); RandomResizedCrop is resampled
  bilinearly by ``grid_sample`` (augment.py); the padded crop is exact (zero padding).
* The copies are drawn once per episode and reused by every step (the reference harness:
  drawn by the data loader); the official draws new copies at each step: the same when
  ``steps=1``.
* Head: the protocol's templates (``text_head=protocol``); MEMO has no CLIP head, so
  ``text_head=official`` is the single prompt "a photo of a {}.".
* The official marginal entropy clamps the log of the mean probability at the dtype's
  minimum; here it is computed in float32 log space (the clamp is never reached).
* The reference runs batch size 1 (each image a batch); here each sample of a protocol batch
  is its own episode, one after the other: the same computation.

Measured effect: docs/methods.md#memo.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mura_plugin.augment import apply_augmix, augmix_draws
from mura_plugin.losses import marginal_entropy
from mura_plugin.methods._episodes import MultiViewConfig, MultiViewMethod
from mura_plugin.methods._norm import norm_parameters
from mura_plugin.methods._online import nesterov_groups
from mura_plugin.methods._text_heads import SINGLE_PROMPT, class_head
from mura_plugin.methods._view_budget import BatchViews
from tta_bench.bounds import bounded, one_of
from tta_bench.model import ZeroShotClassifier

__all__ = [
    "CROPS",
    "MEMO",
    "MEMOConfig",
    "PARAMETER_SETS",
    "alpha_batch_norm",
    "memo_loss",
    "pad_crop_views",
]

#: auto: ``pad`` for 32 x 32 images (the reference's CIFAR rule), ``resized`` otherwise;
#: pad: RandomCrop(size, padding) + flip; resized: RandomResizedCrop + flip.
CROPS = ("auto", "pad", "resized")
#: all: every image-tower parameter (official); weight_bias: the parameters named weight or
#: bias of every image-tower module (reference harness); norm: norm-layer affine parameters.
PARAMETER_SETS = ("all", "weight_bias", "norm")


@dataclass
class MEMOConfig(MultiViewConfig):
    """The reference harness's cifar10_c setting (module docstring)."""

    views: int = bounded(32, ge=1)  # augmented copies per image (TEST.N_AUGMENTATIONS)
    include_original: bool = False  # True: the original image joins the loss (not MEMO)
    augmix: bool = True  # AugMix each crop
    crop: str = one_of("auto", CROPS)
    padding: int = bounded(4, ge=0)  # crop=pad: zero padding on each side
    params: str = one_of("all", PARAMETER_SETS)
    #: weight of the batch's statistics in BatchNorm layers (BN.ALPHA; official
    #: 1 / (prior_strength + 1)); LayerNorm towers have none to mix
    bn_alpha: float = bounded(0.1, ge=0, le=1)
    loss: str = "marginal_entropy"
    optimizer: str = "sgd"
    lr: float = 0.005
    momentum: float = 0.9
    nesterov: bool = True  # SGD only (conf.py OPTIM.NESTEROV)
    weight_decay: float = 0.0
    steps: int = 1
    precision: str = "fp32"
    grad_scale: float | None = None


def memo_loss(logits: torch.Tensor) -> torch.Tensor:
    """MEMO's objective: the entropy of each sample's prediction averaged over all of its
    copies, ``logits [V, B, C] -> [B]`` (float32)."""
    return marginal_entropy(logits, top=1.0)


def pad_crop_views(
    images: torch.Tensor,
    n_views: int,
    generator: torch.Generator,
    *,
    padding: int = 4,
    flip: bool = True,
    augmix_views: bool = True,
    include_original: bool = False,
) -> torch.Tensor:
    """``[V, B, C, H, W]`` views of ``images [B, C, H, W]``: torchvision's
    ``RandomCrop(H x W, padding)`` (zero padding; top-left corner uniform over the
    ``(2 padding + 1)^2`` positions) then ``RandomHorizontalFlip`` (when ``flip``), then
    AugMix (when ``augmix_views``), view-major (view v of sample b is draw ``v * B + b``),
    the original first when ``include_original``. Draws in order: the corners, the flips,
    the AugMix draws."""
    b, c, h, w = images.shape
    n = n_views * b
    parts = [images.unsqueeze(0)] if include_original else []
    if n == 0:
        return torch.cat(parts, dim=0)
    top = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
    left = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
    mirror = torch.rand(n, generator=generator) < 0.5 if flip else torch.zeros(n, dtype=torch.bool)
    draws = augmix_draws(n, generator) if augmix_views else None
    dev = images.device
    padded = F.pad(images, (padding, padding, padding, padding))
    rows = (top[:, None] + torch.arange(h)).to(dev)  # [n, H]
    cols = (left[:, None] + torch.arange(w)).to(dev)  # [n, W]
    sample = (torch.arange(n) % b).to(dev)
    crops = padded[sample[:, None, None], :, rows[:, :, None], cols[:, None, :]]  # [n, H, W, C]
    crops = crops.permute(0, 3, 1, 2)
    crops = torch.where(mirror.to(dev)[:, None, None, None], crops.flip(-1), crops).contiguous()
    if draws is not None:
        crops = apply_augmix(crops, draws)
    parts.append(crops.view(n_views, b, c, h, w))
    return torch.cat(parts, dim=0)


def alpha_batch_norm(x: torch.Tensor, bn: nn.BatchNorm2d, alpha: float) -> torch.Tensor:
    """``bn`` normalising ``x`` with ``(1 - alpha)`` times its running (source) statistics
    plus ``alpha`` times the statistics of ``x`` (per channel, the variance unbiased as
    BatchNorm's running estimate), the latter detached: the reference harness's
    ``AlphaBatchNorm`` and the official ``prior`` BatchNorm of MEMO's ImageNet code."""
    if bn.running_mean is None or bn.running_var is None:
        raise ValueError("bn_alpha needs BatchNorm layers with running statistics")
    dims = [0, *range(2, x.dim())]
    with torch.no_grad():
        mean = x.mean(dim=dims)
        var = x.var(dim=dims, unbiased=True)
    mixed_mean = (1 - alpha) * bn.running_mean + alpha * mean
    mixed_var = (1 - alpha) * bn.running_var + alpha * var
    return F.batch_norm(x, mixed_mean, mixed_var, bn.weight, bn.bias, False, 0.0, bn.eps)


def _prior_forward(self: nn.BatchNorm2d, x: torch.Tensor) -> torch.Tensor:
    return alpha_batch_norm(x, self, self.memo_alpha)


def _use_batch_norm_prior(module: nn.Module, alpha: float) -> int:
    """Make every BatchNorm2d of ``module`` normalise by ``alpha_batch_norm`` (its own
    ``forward``, no module swapped: the state dict keeps its keys); returns how many."""
    count = 0
    for m in module.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.memo_alpha = float(alpha)
            m.forward = types.MethodType(_prior_forward, m)
            count += 1
    return count


def _image_parameters(visual: nn.Module, which: str) -> list[nn.Parameter]:
    """The image-tower parameters ``params`` names (``PARAMETER_SETS``)."""
    if which == "all":
        return list(visual.parameters())
    if which == "weight_bias":
        return [
            p
            for m in visual.modules()
            for name, p in m.named_parameters(recurse=False)
            if name in ("weight", "bias")
        ]
    if which == "norm":
        return norm_parameters(visual)
    raise ValueError(f"unknown params {which!r}; available: {', '.join(PARAMETER_SETS)}")


class MEMO(MultiViewMethod):
    """Episodic marginal entropy minimisation over AugMix copies; see the module docstring."""

    Config = MEMOConfig
    stream_kind = "episodic"  # the tower and optimiser go back to the start after every image

    def configure(self, model: ZeroShotClassifier) -> None:
        cfg = self.config
        self.head = class_head(model, cfg.text_head, SINGLE_PROMPT)
        self.bn_layers = _use_batch_norm_prior(model.visual, cfg.bn_alpha)

    def collect_params(self, model: ZeroShotClassifier) -> list[nn.Parameter]:
        params = _image_parameters(model.visual, self.config.params)
        if not params:
            raise ValueError(f"memo found no {self.config.params!r} parameters in the image tower")
        return params

    def param_groups(self) -> list[Any]:
        return nesterov_groups(self.params, self.config)

    def class_embeddings(self) -> torch.Tensor:
        """The text head this method classifies with ``[C, D]`` (``text_head``)."""
        return self.head

    # -- views ---------------------------------------------------------------------------
    def crop_kind(self, images: torch.Tensor) -> str:
        """``pad`` or ``resized`` for ``images`` (``crop=auto``: pad at 32 x 32)."""
        crop = self.config.crop
        if crop == "auto":
            return "pad" if tuple(images.shape[-2:]) == (32, 32) else "resized"
        return crop

    def make_views(self, images: torch.Tensor) -> torch.Tensor:
        if self.crop_kind(images) == "resized":
            return super().make_views(images)
        cfg = self.config
        return pad_crop_views(
            images,
            cfg.views,
            self.generator,
            padding=cfg.padding,
            flip=cfg.flip,
            augmix_views=cfg.augmix,
            include_original=cfg.include_original,
        )

    def view_inputs(self, images: torch.Tensor) -> BatchViews:
        """Resized crops: the engine's views within the view memory budget; padded crops
        (32 px): the whole batch's views at once."""
        if self.crop_kind(images) == "resized":
            return super().view_inputs(images)
        return BatchViews(self.encode_views(self.make_views(images)), images.shape[0])

    # -- loss and prediction ---------------------------------------------------------------
    def _logits(self, images: torch.Tensor) -> torch.Tensor:
        feats = self.model.encode_image(images)
        return self.model.logits_from_features(feats, self.head.to(feats.dtype))

    def view_loss(self, views: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(H(mean prediction) [B], logits [V, B, C])`` of copies ``views [V, B, ...]``,
        all of them in one forward (BatchNorm statistics over the episode's copies)."""
        v, b = views.shape[:2]
        logits = self._logits(views.flatten(0, 1)).view(v, b, -1)
        if self.config.loss == "marginal_entropy":
            return memo_loss(logits), logits
        return self.loss_fn(logits), logits

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            return self._logits(images).float()
