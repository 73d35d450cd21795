"""RDumb: ETA with a full reset to the source model every 1000 adaptation steps.

Paper: Press, Schneider, Kümmerer, Bethge, "RDumb: A simple approach that questions our
progress in continual test-time adaptation", NeurIPS 2023, https://arxiv.org/abs/2306.05401.
Official code: https://github.com/oripress/CCC, commit
656dec36b8f5b4dbf64fe44c73a9a1326b9588ff (models/rdumb.py: RDumb.forward,
update_model_probs; models/functional.py: configure_model, collect_params, the state
copies; eval.py: batch size 64).
Reference harness: mariodoebler/test-time-adaptation, commit
8b2ed63255d906b6b0afaefc6ae630b9ec4bdaa1 (classification/cfgs/cifar10_c/rdumb.yaml =
``eata`` with ``EATA.FISHER_ALPHA 0``, ``EATA.D_MARGIN 0.4``,
``MODEL.RESET_AFTER_NUM_UPDATES 1000``; classification/methods/base.py: ``forward`` counts
``performed_updates`` and resets; classification/methods/eata.py; classification/conf.py).

Which code the defaults follow: the harness's cfgs/cifar10_c/rdumb.yaml (+ conf.py), the
10-class, 32 px setting like digits-c; the official code has one setting only, ImageNet
(CCC) with a ResNet-50. Everything of ETA applies (``mura_plugin.methods.eta``: filters,
weights, moving average, parameters = the vision tower's norm affine parameters with
BatchNorm on batch statistics); RDumb adds, after every adaptation step:

1. ``updates += 1``; the step is counted whether or not a sample was selected (official
   ``total_steps += 1`` after every forward; harness ``performed_updates += 1`` after every
   ``forward_and_adapt``, which skips the optimiser step when nothing is selected);
2. when ``updates`` is a multiple of ``reset_every``: the adapted parameters, the model's
   buffers, the optimiser (a fresh one) and ETA's moving average of probabilities (None)
   return to their state right after ``setup()``. The batch's prediction is the forward
   before the step, so the batch that triggers the reset is predicted by the adapted model
   and the next one by the source model.

Defaults (harness cifar10_c/rdumb.yaml): Adam lr 1e-3, betas (0.9, 0.999), no weight
decay, 1 step, float32, entropy threshold 0.4 ln C, ``d_margin`` 0.4, moving-average
momentum 0.9, reset every 1000 steps. The harness's imagenet_c/rdumb.yaml (and the official
code): SGD lr 0.00025, momentum 0.9 (the harness adds Nesterov by default; the official
code does not), ``d_margin`` 0.05, batch 64.

The reset interval is in adaptation steps (batches with ``steps`` 1), not in samples: the
official code resets every 1000 batches of 64 = 64,000 samples, which is our protocol's
batch 64 exactly; the harness's CIFAR-10-C batch of 200 makes its 1000 steps 200,000
samples, longer than its whole 15-domain stream of 150,000 (750 steps), so there the reset
never fires. The interval is kept in steps, as both codes count it. On digits-c (360 images
= 6 steps per domain, 90 on the 15-domain continual stream) it never fires either, so with
the defaults RDumb is ETA with the CIFAR-10 settings there.

What differs (besides ETA's differences, except that ETA's ``d_margin`` 0.05 issue does not
apply: the default here is 0.4):
* The reset happens right after the step that completes the interval (as the harness);
  the official code resets lazily at the start of the next forward. The logits of every
  batch are the same; only ``predict`` between those two batches sees the difference.
* ``steps`` > 1: each optimisation step counts (as the harness; the official code has one
  step per batch).
* ETA's learning-rate rule (``lr=None``) stays available; the default is the harness's
  fixed Adam 1e-3.
* Parameters on ViTs: the image tower's LayerNorm affine parameters (the harness's EATA
  ``configure_model`` adapts LayerNorm/GroupNorm as well; the official code adapts
  BatchNorm2d only, as its ResNet-50 has nothing else).

Measured effect: docs/methods.md#rdumb.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from mura_plugin.methods.eta import ETA, ETAConfig
from tta_bench.bounds import bounded

__all__ = ["RDumb", "RDumbConfig"]


@dataclass
class RDumbConfig(ETAConfig):
    """The harness's CIFAR-10-C RDumb setting (cfgs/cifar10_c/rdumb.yaml)."""

    optimizer: str = "adam"
    #: A fixed learning rate (None = ETA's official SGD rule).
    lr: float | None = 1e-3
    #: Redundancy threshold on the cosine to the moving average (harness D_MARGIN 0.4).
    d_margin: float = 0.4
    #: Reset to the source state after every this many adaptation steps
    #: (RESET_AFTER_NUM_UPDATES; 0 = never).
    reset_every: int = bounded(1000, ge=0)


class RDumb(ETA):
    """ETA that returns to the source model every ``reset_every`` adaptation steps."""

    Config = RDumbConfig

    def setup(self) -> None:
        #: Adaptation steps since setup/reset, selected samples or not.
        self.updates = 0
        #: Periodic resets since setup/reset.
        self.resets = 0
        super().setup()

    def reset(self) -> None:
        super().reset()
        self.updates = 0
        self.resets = 0

    def adapt(self, images: torch.Tensor) -> torch.Tensor:
        """ETA's steps one at a time, each followed by the reset rule."""
        config = self.config
        one_step = dataclasses.replace(config, steps=1)
        logits = None
        for _ in range(config.steps):
            self.config = one_step
            try:
                logits = super().adapt(images)
            finally:
                self.config = config
            self.count_update()
        return logits

    def count_update(self) -> None:
        """Count one adaptation step; at a multiple of ``reset_every`` return the
        parameters, buffers, optimiser and moving average to the source state (the
        learning rate the official rule chose and the selection counts stay)."""
        self.updates += 1
        every = self.config.reset_every
        if every > 0 and self.updates % every == 0:
            self._restore()
            if self._lr_batch is not None:
                self.apply_lr(self._lr_batch)  # the official rule's lr, on the new optimiser
            self.resets += 1
