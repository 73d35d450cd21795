"""CMF: continual momentum filtering, a Kalman filter over the adapted parameters.

Paper: Lee & Chang, "Continual Momentum Filtering on Parameter Space for Online Test-time
Adaptation", ICLR 2024, https://openreview.net/forum?id=BllUWdpIOA.
Official code: https://github.com/j-pong/CMF, commit
7edc1d73ef33e5d3053debe5b51031a2b3ef0814 (methods/cmf.py: CMF.bayesian_filtering,
moments, target_generalization_loss; methods/base.py: print_amount_trainable_params;
conf.py: CMF options; cfgs/imagenet_c/cmf.yaml). Reference harness:
https://github.com/mariodoebler/test-time-adaptation at commit 8b2ed63
(classification/methods/cmf.py, a port of the official file; conf.py; cfgs/cifar10_c/cmf.yaml,
cfgs/imagenet_c/cmf.yaml).

The defaults follow the reference harness's cfgs/cifar10_c/cmf.yaml + conf.py: the
official repository has ImageNet-scale settings only (ImageNet-C, -R, -Sketch, D109) and
runs the model in fp16, while the default suite here (digits-c) is 10 classes of 32 px
images like CIFAR-10-C. The filter constants (ALPHA, GAMMA, Q, TYPE) and the loss are the
same in both.

One step per batch. The loss, its optimiser step and the prediction are ROID's
(mura_plugin/methods/roid.py: certainty and diversity weights with ``MOMENTUM_PROBS`` 0.9
and ``TEMPERATURE`` 1/3, soft likelihood ratio + symmetric cross-entropy to one augmented
copy, normalised by the protocol's batch size; the batch's prediction is the forward before
the update times the smoothed batch prior). ROID's weight ensembling with the source is
replaced by the filter, run after each optimiser step on every adapted parameter, with a
hidden model ``h`` (starts at the source ``theta_0``) and a scalar variance ``P`` (starts
at 0):

1. predict: ``h <- alpha h + (1 - alpha) theta_0``; ``P <- alpha^2 P + q``;
2. update: with ``r = 1 - q``, the gain ``beta = r / (P + r)`` (= 1 - Kalman gain),
   raised to 0.89 when below it and set to 1 when at least 0.9999;
   ``P <- beta P``; ``h <- beta h + (1 - beta) theta`` (``theta`` the model just updated
   by the optimiser);
3. ensemble: ``theta <- gamma theta + (1 - gamma) h`` (``filter_type="lp"``, the default;
   ``"op"`` merges the predicted ``h`` of step 1 instead).

``q = Q * n / 38400`` with ``n`` the number of adapted parameters (the official rule; 38400
is ViT-B/16's LayerNorm parameter count), ``resolved_settings`` records it as
``process_noise``.

Defaults (cifar10_c/cmf.yaml, conf.py): Adam lr 1e-3, betas (0.9, 0.999), no weight decay,
1 step, float32, ALPHA 0.99, GAMMA 0.99, Q 0.005, TYPE "lp", ROID's weighting, consistency
and prior correction on, batch 200 (the protocol sets the batch size here). ImageNet-C
(both repositories' imagenet_c/cmf.yaml): SGD lr 2.5e-4, momentum 0.9, Nesterov, batch 64.

Parameters: as ROID, the affine parameters of every norm layer of the vision tower
(BatchNorm with test-batch statistics); on CLIP ViTs the image tower's LayerNorms.

What differs:
* Everything ROID's header lists for the shared loss and prediction (torchvision v2
  augmentation kernels on the method's generator, the loss normaliser from the first batch,
  no NaN on a batch of equal weights, float32 instead of the reference's fp16 CLIP weights,
  no Nesterov SGD).
* ``filter_type="op"``: both codes pass the hidden model object that step 2 has already
  updated (the predict step returns the same object), so their "op" equals "lp"; here
  "op" merges the prediction of step 1, as the names say. The default "lp" is unaffected.
* ``reset()`` also returns ``P`` to 0 (officially it keeps its value across resets while
  the models return to the source): the method contract says reset returns to the state
  after ``setup()``. ``P`` converges within tens of steps, so only the first batches after
  a reset see a different gain.
* The official repository runs the whole model and the filter's parameters in fp16
  (``model.half()``; the reference harness: float32); here float32, fp16/bf16 only as CUDA
  autocast.
* ``n`` counts the vision tower's norm parameters (the reference harness's CLIP count
  also includes the unused text ``ln_final``).
* The filter only touches the adapted parameters; officially the hidden model's every
  parameter is filtered, but the others stay equal to the source (source, hidden and
  model agree on them), so the result is the same.

Measured effect: docs/methods.md#cmf.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mura_plugin.methods.roid import ROIDLossConfig, ROIDLossMethod
from tta_bench.bounds import bounded, one_of

__all__ = ["CMF", "CMFConfig", "FILTER_TYPES", "kalman_gain", "momentum_filter_"]

#: "lp": ensemble with the updated hidden model (official default); "op": with its prediction.
FILTER_TYPES = ("lp", "op")
#: The official normaliser of the process noise: ViT-B/16's LayerNorm parameter count.
REFERENCE_PARAMETER_COUNT = 38400


def kalman_gain(variance: float, q: float) -> float:
    """The official clipped ``beta = r / (variance + r)``, ``r = 1 - q``, of a predicted
    ``variance``: at least 0.89, and 1 when at least 0.9999."""
    r = 1.0 - q
    beta = r / (variance + r)
    beta = max(beta, 0.89)
    return 1.0 if beta >= 0.9999 else beta


@torch.no_grad()
def momentum_filter_(
    params: Sequence[torch.Tensor],
    hidden: Sequence[torch.Tensor],
    source: Sequence[torch.Tensor],
    variance: float,
    *,
    alpha: float,
    gamma: float,
    q: float,
    filter_type: str = "lp",
) -> tuple[float, float]:
    """One CMF filter step in place on ``params`` (the model just updated) and ``hidden``
    (the hidden model), anchored at ``source``; returns ``(new variance, beta)``."""
    if filter_type not in FILTER_TYPES:
        raise ValueError(f"unknown filter_type {filter_type!r}; available: {FILTER_TYPES}")
    predicted = [alpha * h + (1.0 - alpha) * s for h, s in zip(hidden, source, strict=True)]
    variance = alpha**2 * variance + q
    beta = kalman_gain(variance, q)
    variance = beta * variance
    for h, pred, p in zip(hidden, predicted, params, strict=True):
        h.copy_(beta * pred + (1.0 - beta) * p)
    merge = hidden if filter_type == "lp" else predicted
    if gamma < 1.0:
        for p, m in zip(params, merge, strict=True):
            p.copy_(gamma * p + (1.0 - gamma) * m)
    return variance, beta


@dataclass
class CMFConfig(ROIDLossConfig):
    """The reference harness's CMF setting (cfgs/cifar10_c/cmf.yaml + conf.py)."""

    #: Prediction momentum toward the source (ALPHA).
    alpha: float = bounded(0.99, ge=0, le=1)
    #: Ensembling momentum of the model with the hidden model (GAMMA).
    gamma: float = bounded(0.99, ge=0, le=1)
    #: Process noise per 38400 adapted parameters (Q); q = Q * n / 38400.
    q: float = bounded(0.005, ge=0, lt=1)
    #: What the model is ensembled with (TYPE): the updated ("lp") or predicted ("op") hidden
    #: model.
    filter_type: str = one_of("lp", FILTER_TYPES)


class CMF(ROIDLossMethod):
    """ROID's loss with a Kalman filter over the adapted parameters."""

    Config = CMFConfig

    def setup(self) -> None:
        super().setup()
        n = sum(p.numel() for p in self.params)
        #: The official ``q = Q * n / 38400``.
        self.process_noise = self.config.q * n / REFERENCE_PARAMETER_COUNT
        if self.process_noise >= 1.0:
            raise ValueError(
                f"CMF's process noise q * n / {REFERENCE_PARAMETER_COUNT} = "
                f"{self.process_noise:g} must be below 1 ({n} adapted parameters): lower method.q"
            )
        #: The hidden model's adapted parameters (start at the source).
        self.hidden = [p.detach().clone() for p in self.params]
        self.variance = 0.0
        self.beta: float | None = None

    def after_update(self) -> None:
        cfg = self.config
        self.variance, self.beta = momentum_filter_(
            self.params,
            self.hidden,
            self.source_params,
            self.variance,
            alpha=cfg.alpha,
            gamma=cfg.gamma,
            q=self.process_noise,
            filter_type=cfg.filter_type,
        )

    def reset(self) -> None:
        super().reset()
        with self.timed("adapt"), torch.no_grad():
            for h, src in zip(self.hidden, self.source_params, strict=True):
                h.copy_(src)
        self.variance = 0.0
        self.beta = None

    def resolved_settings(self) -> dict[str, Any]:
        return {**super().resolved_settings(), "process_noise": self.process_noise}
