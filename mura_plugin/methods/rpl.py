"""RPL: robust pseudo-labelling, generalised cross-entropy on the model's own hard labels.

Paper: Rusak, Schneider, Pachitariu, Eck, Gehler, Bringmann, Brendel, Bethge, "If your data
distribution shifts, use self-learning", TMLR 2022 (https://arxiv.org/abs/2104.12928).
Official code: https://github.com/bethgelab/robustness, read at commit
0ef82b178e3526f63d8017dc870072d611d883e9, the authors' library (robusta/selflearning/
functional.py ``gce``, nn.py, __init__.py ``adapt``; examples/selflearning/main.py); and
the online version the reference harness builds on, https://github.com/oripress/CCC at
commit 656dec36b8f5b4dbf64fe44c73a9a1326b9588ff (models/rpl.py, models/functional.py).
Reference harness: mariodoebler/test-time-adaptation at commit
8b2ed63255d906b6b0afaefc6ae630b9ec4bdaa1 (classification/methods/rpl.py, methods/base.py,
utils/losses.py ``GeneralizedCrossEntropy``, conf.py, cfgs/cifar10_c/rpl.yaml,
cfgs/imagenet_c/rpl.yaml).

Defaults follow the reference harness's cifar10_c setting (cfgs/cifar10_c/rpl.yaml with
conf.py's defaults), the rule for every method of this plugin (digits-c is 10 classes of 32 px
images, like CIFAR-10-C): Adam lr 1e-3, betas (0.9, 0.999) (``OPTIM.BETA``), no weight decay,
1 step per batch, ``q`` 0.8 (``RPL.Q``), float32 (``MIXED_PRECISION`` False). The authors' code
has no CIFAR-10 online setting: CCC runs SGD lr 5e-4, momentum 0.9 on ImageNet (batch 64), and
the reference's imagenet_c setting is that with conf.py's Nesterov momentum
(``optimizer=sgd lr=0.0005``, ``nesterov`` on by default for SGD). The cifar10_c setting's
batch is 200 (the protocol's here, 64 on digits-c).

The rule (one step per batch, as the TENT family):

1. forward the batch: logits ``f(x)``; the hard pseudo-label ``y = argmax_c f(x)_c`` (no
   gradient through it);
2. per sample the generalised cross-entropy (Zhang & Sabuncu 2018)
   ``L_q = (1 - p_y^q) / q`` with ``p = softmax(f(x))``: the cross-entropy as ``q -> 0``,
   the bounded ``1 - p_y`` at ``q = 1``, down-weighting low-confidence (likely wrong) labels;
3. one optimiser step on the batch mean over the affine parameters of every normalisation
   layer of the image tower (LayerNorm, BatchNorm, GroupNorm; reference ``collect_params``),
   BatchNorm normalising with the test batch's statistics (``configure_model``);
4. the batch's prediction is the logits of that forward (before the update), as the
   reference's ``forward_and_adapt`` returns.

Which layers: the reference harness, CCC and the authors' ``robusta.selflearning.adapt``
all adapt every normalisation layer (their ImageNet ResNets: every BatchNorm), none leaves
out the last block (the first arXiv version's abstract: "fine-tuning only few affine
parameters distributed across the network"); here likewise every one of the image tower
(the text tower is frozen). The authors' offline example (examples/selflearning/main.py: 5 epochs,
SGD lr 0.75e-3, batch 96) lists the BatchNorm parameters but hands ``model.parameters()``
to SGD with nothing frozen; it is not the online setting and is not followed.

What differs:
* CLIP ViTs have LayerNorm, not BatchNorm: the affine parameters of every LayerNorm of the
  image tower adapt (the reference harness's ``collect_params`` takes LayerNorm too); there
  are no batch statistics to use. BatchNorm towers (ResNet CLIPs) adapt BatchNorm affine
  and normalise with test-batch statistics, as the reference does. BatchNorm1d (train mode
  in the reference) is not handled: CLIP towers have none.
* The reference keeps the whole model in ``eval()`` (stochastic depth off); CLIP towers have
  no dropout or stochastic depth at test time: the same.
* The GCE is computed in float32 whatever the autocast dtype (the reference: in the
  autocast dtype under ``MIXED_PRECISION``; the default here and there is float32).
* ``nesterov`` is applied through a torch parameter group (the harness's ``build_optimizer``
  has no Nesterov option); it acts only with ``optimizer=sgd``.

Measured effect: docs/methods.md#rpl.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mura_plugin.methods._norm import norm_parameters, use_batch_statistics
from mura_plugin.methods._online import nesterov_groups
from tta_bench.bounds import bounded
from tta_bench.method import GradientConfig, GradientMethod
from tta_bench.model import ZeroShotClassifier

__all__ = ["RPL", "RPLConfig", "generalized_cross_entropy"]


@dataclass
class RPLConfig(GradientConfig):
    """The reference harness's cifar10_c setting (module docstring)."""

    q: float = bounded(0.8, gt=0, le=1)  # GCE exponent (RPL.Q)
    optimizer: str = "adam"
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.9  # SGD only (conf.py OPTIM.MOMENTUM)
    nesterov: bool = True  # SGD only (conf.py OPTIM.NESTEROV)
    steps: int = 1
    precision: str = "fp32"


def generalized_cross_entropy(
    logits: torch.Tensor, q: float, targets: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-sample GCE ``(1 - p_y^q) / q`` of ``logits [B, C]`` (float32) against ``targets``
    (default: the hard pseudo-labels ``argmax`` of the logits, without gradient)."""
    probs = logits.float().softmax(dim=1)
    if targets is None:
        targets = probs.detach().argmax(dim=1)
    p_y = probs.gather(1, targets[:, None])[:, 0]
    return (1.0 - p_y.pow(q)) / q


class RPL(GradientMethod):
    """GCE on hard pseudo-labels over the image tower's norm-layer affine parameters."""

    Config = RPLConfig
    predict_from_last_forward = True

    def configure(self, model: ZeroShotClassifier) -> None:
        use_batch_statistics(model.visual)

    def collect_params(self, model: ZeroShotClassifier) -> list[nn.Parameter]:
        params = norm_parameters(model.visual)
        if not params:
            raise ValueError("rpl found no normalisation layers in the image tower")
        return params

    def param_groups(self) -> list[Any]:
        return nesterov_groups(self.params, self.config)

    def compute_loss(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model(images)
        return generalized_cross_entropy(logits, self.config.q), logits
