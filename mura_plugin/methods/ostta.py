"""OSTTA: open-set test-time adaptation by entropy minimisation on the samples whose confidence
the adapted model raises over the original model.

Paper: Lee, Das, Choo, Choi, "Towards Open-Set Test-Time Adaptation Utilizing the Wisdom of
Crowds in Entropy Minimization", ICCV 2023, https://arxiv.org/abs/2308.06879.
Code read: the authors released none that this work could find (no repository of theirs is in
the stored snapshots, and the paper pages stored here link none). The public implementation
is the one the UniEnt authors ship beside their own method and run on CIFAR-10-C with
SVHN-C as the unknown classes, which stands in for it here.
Official code: https://github.com/gaozhengqing/UniEnt, read at commit
af7faa8c674b61f0ce3741a6e265fd202d8a6656 (not the OSTTA authors'; MIT; cifar/ostta.py:
OSTTA, forward_and_adapt, softmax_entropy, softmax_mean_entropy, collect_params,
configure_model; cifar/main.py: arguments, optimiser, the continual CIFAR-10-C + SVHN-C
loop; cifar/run.sh: the runs).
Also read, for its CLIP port: MarcLafon/cliptta, commit
f4221f4f2b3bfbd220f8836411bbd3774758933d (ttavlm/methods/ostta.py, ttavlm/configuration.py,
ttavlm/methods/__init__.py).

Which code the defaults follow: UniEnt's cifar/ (criterion ``ent``, the plain OSTTA rule) on
CIFAR-10-C, because the digits suites are, like CIFAR-10-C, 10-class 32 px corruption sets
and because the CLIP port changes the selection rule itself (a margin of 0.4 that its own
configuration marks "not in official implementation"); the port's choices are listed below.

Per batch and step, as in UniEnt's ``forward_and_adapt`` (criterion ``ent``):

1. the original model (the parameters as after ``setup()``, frozen) predicts the batch:
   ``p0 = softmax(f_0(x))``, ``y0 = argmax p0``, ``c0 = max p0`` (computed once per batch:
   it does not depend on the step);
2. the adapted model predicts the batch: ``p = softmax(f(x))`` (these logits are the
   batch's prediction, before the update, as officially); the confidence gain
   ``g = p[y0] - c0``;
3. kept samples: ``g >= margin`` (official: ``>= 0``, margin 0); the dropped ones are the
   samples whose confidence entropy minimisation failed to raise (the "wisdom of crowds");
4. loss = mean entropy of the kept samples minus ``diversity_weight`` times the entropy
   of the batch's mean prediction (UniEnt's ``alpha[0]``, over every sample); one Adam step.

Own OOD score: the confidence gain ``g`` of the returned forward (higher = kept = judged
known), the quantity the method uses to separate samples. UniEnt's evaluation scores
open-set detection with the energy (logsumexp of the logits) and CLIPTTA's with the maximum
softmax of a forward after the update; the harness computes the maximum softmax itself.
Right after ``setup()``/``reset()`` the adapted and original models agree, so the first
batch's gains are all 0 (every sample kept, as officially).

Defaults (UniEnt's cifar/main.py): Adam lr 1e-3 (betas 0.9, 0.999), no weight decay, one step
per batch, float32, ``diversity_weight`` 0.5 (its ``--alpha`` default; run.sh also runs 1.0,
0.2 and 0.1), ``margin`` 0. Parameters: the affine parameters of every norm layer of the
image tower, BatchNorm normalising with test-batch statistics (official ``configure_model`` /
``collect_params``: BatchNorm2d of its WideResNet; the original model is a copy made after
``configure_model``, so it too uses batch statistics); on CLIP ViTs the LayerNorm affine
parameters, as the TENT family here (docs/methods.md). The text tower is frozen.

What differs and why:
* Parameters: LayerNorm affine on CLIP ViTs (UniEnt adapts BatchNorm2d only; a ViT has none).
* The original model is the snapshot of the adapted tensors run through the same modules
  (``torch.func.functional_call``), not a deep copy of the network: the same function. In a
  step its forward runs with those tensors requiring gradient (the graph is dropped at
  once), as the official ``model0``'s does, so it takes the adapted forward's kernels and
  the first batch's gains are exactly 0 (torch's MultiheadAttention fast path, used only
  without gradient, differs by about 1e-6 in the logits and would drop samples at random).
* No kept sample: the entropy term is 0 with zero gradient and only the diversity term
  moves the model (official: the mean of an empty tensor is NaN, which turns every adapted
  parameter into NaN at the Adam step; CLIPTTA falls back to the mean over all samples).
* The diversity term is the entropy of the mean softmax with ``log`` clamped at 1e-12
  (official: no clamp, so an exactly zero mean probability gives NaN).
* Batches: the protocol's (digits-open: 64 with half unknown, mixed); UniEnt's are 100
  known + 100 unknown images, the known ones first.
* CLIPTTA's CLIP port (not followed): margin 0.4, diversity weight 0.1, fall-back to all
  samples when none is kept, logits scaled by a fixed 100 instead of the model's own logit
  scale, prediction and maximum-softmax score from a second forward after the update.
* The entropy and the confidences are computed in float32 whatever the autocast dtype
  (official: float32 throughout; the default precision here is fp32 as well).

Measured effect: not measured (docs/methods.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from torch.func import functional_call

from mura_plugin.losses import view_entropy
from mura_plugin.methods._norm import masked_mean, norm_parameters, use_batch_statistics
from tta_bench.bounds import bounded, one_of
from tta_bench.method import PRECISIONS, GradientConfig, GradientMethod
from tta_bench.model import ZeroShotClassifier

__all__ = [
    "OSTTA",
    "OSTTAConfig",
    "confidence_gain",
    "mean_prediction_entropy",
    "ostta_objective",
]


@dataclass
class OSTTAConfig(GradientConfig):
    """UniEnt's OSTTA setting on CIFAR-10-C (cifar/main.py, criterion ``ent``)."""

    optimizer: str = "adam"
    lr: float = 1e-3
    weight_decay: float = 0.0
    steps: int = bounded(1, ge=1)
    precision: str = one_of("fp32", PRECISIONS)
    #: Weight of the entropy of the batch's mean prediction, subtracted from the loss
    #: (UniEnt's ``alpha[0]``; 0 = the selection rule alone).
    diversity_weight: float = bounded(0.5, ge=0)
    #: A sample is kept when its confidence gain is at least this (official 0; CLIPTTA 0.4).
    margin: float = bounded(0.0, ge=-1, le=1)


def confidence_gain(probs: torch.Tensor, source_probs: torch.Tensor) -> torch.Tensor:
    """``p[y0] - max p0`` per sample: the adapted model's probability ``probs [B, C]`` of the
    original model's predicted class ``y0 = argmax source_probs`` minus the original model's
    confidence (first index on ties, as ``torch.max``)."""
    conf0, pred0 = source_probs.max(dim=1)
    return probs.gather(1, pred0.unsqueeze(1)).squeeze(1) - conf0


def mean_prediction_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the batch's mean softmax prediction (float32; ``log`` clamped at 1e-12)."""
    mean = logits.float().softmax(dim=1).mean(dim=0)
    return -(mean * torch.log(mean.clamp_min(1e-12))).sum()


def ostta_objective(
    logits: torch.Tensor, source_probs: torch.Tensor, margin: float, diversity_weight: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, kept [B] bool, gain [B])`` of one OSTTA step: ``gain`` the confidence gain of
    ``logits`` over the original model's ``source_probs``, ``kept = gain >= margin``, loss =
    mean entropy of the kept samples (0 when none) minus ``diversity_weight`` times the
    entropy of the mean prediction of every sample."""
    gain = confidence_gain(logits.detach().float().softmax(dim=1), source_probs.float())
    kept = gain >= margin
    loss = masked_mean(view_entropy(logits), kept)
    if diversity_weight:
        loss = loss - diversity_weight * mean_prediction_entropy(logits)
    return loss, kept, gain


class OSTTA(GradientMethod):
    """Entropy minimisation on the samples the adapted model is more confident about than
    the original model, with UniEnt's diversity term."""

    Config = OSTTAConfig
    predict_from_last_forward = True
    own_ood_score: ClassVar[str | None] = (
        "ostta: adapted minus original model's probability of the original model's class"
    )

    def setup(self) -> None:
        super().setup()
        names = {id(p): n for n, p in self.model.named_parameters()}
        # the snapshot's parameter copies are never written: they are the original model
        self._source = {names[id(p)]: s for p, s in zip(self.params, self._snapshot["params"])}
        #: Samples seen and kept by the filter since setup or reset.
        self.counts = {"seen": 0, "kept": 0}

    def reset(self) -> None:
        super().reset()
        self.counts = {"seen": 0, "kept": 0}

    def configure(self, model: ZeroShotClassifier) -> None:
        use_batch_statistics(model.visual)

    def collect_params(self, model: ZeroShotClassifier) -> list[nn.Parameter]:
        params = norm_parameters(model.visual)
        if not params:
            raise ValueError("ostta found no normalisation layers in the vision tower")
        return params

    def compute_loss(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Not used: OSTTA's objective is not a per-sample mean (``adapt`` computes it)."""
        raise NotImplementedError("ostta computes its objective in adapt()")

    def source_probabilities(self, images: torch.Tensor, grad_path: bool) -> torch.Tensor:
        """The original (frozen) model's softmax prediction ``[B, C]`` in float32.
        ``grad_path``: run it as the adapted model's training forward runs (its norm tensors
        requiring gradient, the graph dropped at once), as the official ``model0``, so both
        take the same kernels (torch's MultiheadAttention fast path, taken only without
        gradient, moves logits by about 1e-6); else without gradient, as ``predict``."""
        source = self._source
        grad = torch.enable_grad() if grad_path else torch.no_grad()
        if grad_path:
            source = {n: s.detach().requires_grad_(True) for n, s in source.items()}
        with grad, self.autocast():
            logits = functional_call(self.model, source, (images,))
        return logits.detach().float().softmax(dim=1)

    def adapt(self, images: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        source_probs = self.source_probabilities(images, grad_path=True)
        logits = None
        for _ in range(cfg.steps):
            with torch.enable_grad(), self.autocast():
                logits = self.model(images)
                loss, kept, gain = ostta_objective(
                    logits, source_probs, cfg.margin, cfg.diversity_weight
                )
            self.optimizer.zero_grad(set_to_none=True)
            self.optimizer_step(loss)
            self.last_loss = loss.detach()
            self.counts["seen"] += int(kept.numel())
            self.counts["kept"] += int(kept.sum())
            self.last_ood_score = gain.detach()
        return logits

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """The adapted model's logits; the own score is their confidence gain over the
        original model, as in a step (nothing changes)."""
        with self.autocast():
            logits = self.model(images).float()
        self.last_ood_score = confidence_gain(
            logits.softmax(dim=1), self.source_probabilities(images, grad_path=False)
        )
        return logits
