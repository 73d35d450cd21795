"""BATCLIP: bimodal online test-time adaptation of CLIP (image and text LayerNorms).

Paper: Maharana et al., "BATCLIP: Bimodal Online Test-Time Adaptation for CLIP", ICCV 2025
(arXiv 2412.02837). Official code: https://github.com/sarthaxxxxx/BATCLIP, read at commit
ba2e3381873ef58e76a90148ee3835864349e985 (classification/methods/ours.py,
utils/losses.py, models/model.py: ZeroShotCLIP, methods/base.py, cfgs/*/ours.yaml, conf.py).

The rule, per batch and step: one forward of both towers (the class prompts are re-encoded
every step, so the text tower's LayerNorms get gradients); ``f_i`` = the image tower's
projected features *before* normalisation, ``t_c`` = the normalised class text features,
logits ``s * normalise(f_i) . t_c``, pseudo-labels ``y_i = argmax``. With the prototypes
``mu_u = mean of f_i over y_i = u`` of the U predicted classes,

    loss = mean_i H(p_i)                                       (entropy, ``loss``)
         - mean_u  mu_u . t_u                                  (``prototype_text_alignment``,
                                                                official I2TLoss)
         - sum_{u != v} (1 - cos(mu_u, mu_v))                  (``inter_class_separation``,
                                                                official InterMeanLoss)

both extra terms with weight 1 (``i2t_weight``, ``inter_weight``), then one optimiser step.
The prediction is the logits of that same forward (before the update), as in the official
``forward_and_adapt``. Adapted: the affine parameters of every LayerNorm of the CLIP model,
image tower and text tower (transformer blocks and ``ln_final``).

Official setting (defaults = cfgs/cifar10_c/ours.yaml, the closest to digits-c: 10 classes,
32 px): AdamW lr 1e-3, betas (0.9, 0.999), weight decay 0.01, 1 step per batch, batch 200
(here the protocol's batch size), ``reset_each_shift`` (online inside a corruption: this
method never resets itself; the protocol does), template "a photo of a {}." Other official
configs: CIFAR-100-C Adam (L2 weight decay 0.01) lr 5e-4; ImageNet-C AdamW lr 5e-4, wd 0.01,
batch 64 (``method.optimizer=adam method.lr=5e-4`` etc.). The official forward runs under
``torch.cuda.amp.autocast()`` (fp16) on fp32 weights: ``precision="fp16"`` (CPU: fp32).

Text head: ``text_head="official"`` encodes "a photo of a {}." per class; the default
``text_head="protocol"`` encodes every protocol template per class and ensembles them with the
protocol head's rule (normalised mean of normalised features), differentiably, so at the
first step the class features are exactly the protocol head. (The official code's multi-
template modes stack one logit column per prompt rather than per class; only its single-
template mode is well defined.)

What differs from the official code and why:
* fp16 loss scaling as officially (``GradScaler``, initial scale 1000, ``grad_scale``), on
  CUDA only; the CPU computes in float32 without scaling.
* The loss terms are computed in float32 from the (autocast) features, the prototypes by one
  scatter-add instead of a Python loop over classes (same sums, another summation order).
* The text prompts are cut after the longest end token before the text transformer (exact
  for causal text towers, see ``_clip_text.encode_text``), and the text tower's gradient is
  computed in two passes (class features without gradients, then the tower re-run in chunks
  of ``model.text_chunk_size`` prompts to push their gradient through): the same gradient
  with one chunk's activations alive, so a 1,000-class x 80-template protocol head fits;
  the text tower runs twice per step.
* LayerNorm only: the official code also adapts BatchNorm/GroupNorm layers (ResNet CLIPs,
  BatchNorm2d with batch statistics); a tower without LayerNorm is a ValueError here.

Cost per batch: one image forward + backward (tent's cost in the original setting) plus the
text tower over C x T prompts twice (without gradients, then with, see above).

Measured effect: docs/methods.md#batclip.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from mura_plugin.methods._clip_text import (
    ensemble_features,
    names_per_chunk,
    prompt_tokens,
)
from mura_plugin.methods._norm import text_layer_norm_parameters, vision_layer_norm_parameters
from tta_bench.bounds import bounded, one_of
from tta_bench.method import PRECISIONS, GradientConfig, GradientMethod
from tta_bench.model import ZeroShotClassifier

__all__ = [
    "BATCLIP",
    "BATCLIPConfig",
    "BATCLIP_TEMPLATE",
    "class_prototypes",
    "inter_class_separation",
    "prototype_text_alignment",
]

#: The official prompt (cfgs/*/ours.yaml: PROMPT_TEMPLATE).
BATCLIP_TEMPLATE = "a photo of a {}."


@dataclass
class BATCLIPConfig(GradientConfig):
    loss: str = "entropy"  # the per-sample term (official: softmax entropy)
    optimizer: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.01
    steps: int = 1
    i2t_weight: float = bounded(1.0, ge=0)  # prototype-text alignment (subtracted)
    inter_weight: float = bounded(1.0, ge=0)  # inter-class separation (subtracted)
    text_head: str = one_of("protocol", ("protocol", "official"))  # official: ("a photo of a {}.")
    # The official forward runs under fp16 autocast on CUDA with GradScaler(init_scale=1000);
    # CPU: fp32, no scaling.
    precision: str = one_of("fp16", PRECISIONS)
    grad_scale: Optional[float] = 1000.0


def class_prototypes(
    features: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(classes [U], prototypes [U, D])``: the predicted classes in ascending order and the
    mean of ``features [B, D]`` over the samples of each (float32, differentiable)."""
    classes, inverse, counts = torch.unique(
        labels, sorted=True, return_inverse=True, return_counts=True
    )
    f = features.float()
    sums = torch.zeros(len(classes), f.shape[1], dtype=f.dtype, device=f.device)
    sums = sums.index_add(0, inverse, f)
    return classes, sums / counts.unsqueeze(1).to(f.dtype)


def prototype_text_alignment(
    features: torch.Tensor, text_features: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """Official I2TLoss: ``mean_u mu_u . t_u`` over the predicted classes u, ``mu_u`` the
    mean of the (unnormalised) image features ``[B, D]`` predicted as u, ``t_u`` the
    normalised text feature of u (``text_features [C, D]``). A scalar, to be maximised."""
    classes, protos = class_prototypes(features, labels)
    return (protos * text_features.float()[classes]).sum(dim=-1).mean()


def inter_class_separation(features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Official InterMeanLoss: ``sum_{u != v} (1 - cos(mu_u, mu_v))`` over ordered pairs of
    distinct predicted classes (0 with one class). A scalar, to be maximised."""
    _, protos = class_prototypes(features, labels)
    protos = F.normalize(protos, dim=-1)
    off_diagonal = 1 - torch.eye(len(protos), dtype=protos.dtype, device=protos.device)
    return ((1 - protos @ protos.t()) * off_diagonal).sum()


class BATCLIP(GradientMethod):
    """See the module docstring."""

    #: Encodes its prompts from the protocol's templates (``model.templates``): the
    #: per-class sentence modes of ``protocol.text_head`` are refused before a run.
    text_heads = ("templates",)

    Config = BATCLIPConfig
    predict_from_last_forward = True

    def configure(self, model: ZeroShotClassifier) -> None:
        if self.config.text_head == "official":
            self.templates = [BATCLIP_TEMPLATE]
        else:
            self.templates = list(model.templates)
        self.tokens = prompt_tokens(model, model.classnames, self.templates)
        self._classes_per_chunk = names_per_chunk(model, len(self.templates))

    def collect_params(self, model: ZeroShotClassifier) -> list[nn.Parameter]:
        return vision_layer_norm_parameters(model, "batclip") + text_layer_norm_parameters(
            model, "batclip"
        )

    # -- text side -----------------------------------------------------------------------
    def _class_chunks(self) -> list[tuple[slice, torch.Tensor]]:
        """``(classes, their prompt tokens)`` per text forward of at most
        ``model.text_chunk_size`` prompts (whole classes)."""
        n_t, step = len(self.templates), self._classes_per_chunk
        return [
            (slice(c, c + step), self.tokens[c * n_t : (c + step) * n_t])
            for c in range(0, self.model.num_classes, step)
        ]

    def class_text_features(self) -> torch.Tensor:
        """Normalised class features ``[C, D]`` from the current text tower: the template
        ensemble (normalised mean of normalised prompt features); differentiable."""
        n_t = len(self.templates)
        return torch.cat(
            [ensemble_features(self.model.clip, tokens, n_t) for _, tokens in self._class_chunks()]
        )

    def _text_backward(self, grad: torch.Tensor) -> None:
        """Accumulate into the text tower's parameters the gradient of the loss whose
        gradient with respect to the class features is ``grad [C, D]``, re-encoding the
        classes chunk by chunk: exact, with one chunk's activations alive at a time."""
        n_t = len(self.templates)
        for classes, tokens in self._class_chunks():
            with torch.enable_grad(), self.autocast():
                feats = ensemble_features(self.model.clip, tokens, n_t)
            torch.autograd.backward(feats, grad[classes].to(feats.dtype))

    # -- adaptation ----------------------------------------------------------------------
    def batch_loss(
        self, images: torch.Tensor, text: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(per-sample loss [B], logits [B, C])`` given class features ``text [C, D]``; the
        mean of the loss is the official ``entropy - i2t - inter``."""
        size = self.model.preprocess.image_size
        if tuple(images.shape[-2:]) != (size, size):
            raise ValueError(
                f"{self.model.model_name} expects {size}x{size} images, got "
                f"{tuple(images.shape[-2:])}: the data pipeline must resize to the model's size"
            )
        raw = self.model.clip.encode_image(self.model.normalize(images))  # before normalising
        logits = self.model.logit_scale * F.normalize(raw, dim=-1) @ text.t().to(raw.dtype)
        labels = logits.detach().argmax(dim=-1)
        cfg = self.config
        batch_terms = cfg.i2t_weight * prototype_text_alignment(raw, text, labels)
        batch_terms = batch_terms + cfg.inter_weight * inter_class_separation(raw, labels)
        # the batch terms are shared: subtracted from every sample, so the mean is the
        # official loss
        return self.loss_fn(logits) - batch_terms, logits

    def compute_loss(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch_loss(images, self.class_text_features())

    def adapt(self, images: torch.Tensor) -> torch.Tensor:
        """``steps`` optimiser steps on ``compute_loss``'s objective, with the text tower's
        gradient computed in two passes: class features without gradients first (a leaf
        the loss differentiates), then the text tower re-run chunk by chunk to push that
        leaf's gradient through it. Same gradients as one pass; memory bounded by a chunk
        (1,000 classes x 80 templates would not fit with all activations kept)."""
        logits = None
        for _ in range(self.config.steps):
            with torch.no_grad(), self.autocast():
                text = self.class_text_features()
            text.requires_grad_(True)
            with torch.enable_grad(), self.autocast():
                loss, logits = self.batch_loss(images, text)
                loss = loss.mean()
            self.optimizer.zero_grad(set_to_none=True)
            # fp16 loss scaling as officially: the text gradient of the second pass is taken
            # from the scaled loss, so the scaler unscales both before stepping
            self.optimizer_step(loss, after_backward=lambda t=text: self._text_backward(t.grad))
            self.last_loss = loss.detach()
        return logits

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """Logits under the current (adapted) text tower; ``step`` itself returns the logits
        of the adaptation forward, as the official code does."""
        with self.autocast():
            feats = self.model.encode_image(images)
            text = self.class_text_features()
            logits = self.model.logits_from_features(feats, text.to(feats.dtype))
        return logits.float()
