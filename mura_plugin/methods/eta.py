"""ETA: EATA's sample-efficient entropy minimisation, without the anti-forgetting term.

Paper: Niu et al., "Efficient Test-Time Model Adaptation without Forgetting", ICML 2022
(ETA = EATA without the Fisher regulariser, the paper's ablation and the official
``--algorithm eta``).
Official code: https://github.com/mr-eggplant/EATA, commit
f739b3668cc7617e9b9f1979c1a358497a3472c3 (eata.py: forward_and_adapt_eata,
update_model_probs, configure_model, collect_params; main.py: arguments, optimiser). The
ViT setting (LayerNorm parameters, learning-rate rule) is the same authors' SAR repository,
https://github.com/mr-eggplant/SAR, commit 20f6e24b17525f34503510afccedc0629b67b7c4
(main.py, eata.py), which runs EATA on ViT-B/16 and ResNet-50.

One step per batch, as officially:

1. forward; per-sample entropy ``H_i`` (the batch's prediction is this forward's logits);
2. reliable samples: ``H_i < E0`` with ``E0 = 0.4 ln C`` (official ``e_margin``
   = ``0.4 ln 1000`` on ImageNet; the coefficient is kept and C is the protocol's class
   count);
3. non-redundant samples: ``|cos(m, p_i)| < eps`` (official ``d_margin`` 0.05), ``m`` the
   moving average of the probability vectors of earlier selected samples; before ``m``
   exists (the first batch) every reliable sample is selected;
4. loss = mean over the selected samples of ``exp(E0 - H_i) * H_i`` (the official
   ``1 / exp(H - E0)``, detached); one SGD step, none when no sample is selected;
5. ``m <- mean(p_selected)`` the first time, then ``0.9 m + 0.1 mean(p_selected)``;
   unchanged when nothing is selected.

Defaults (official): SGD, momentum 0.9, no weight decay, float32, entropy threshold 0.4 ln C,
``d_margin`` 0.05, moving-average momentum 0.9, and ``lr=None`` = the official learning-rate
rule for the tower and the batch size (SAR/DeYO repositories' main.py, which also set
EATA's lr): BatchNorm/GroupNorm towers (ResNets) 0.00025 for batches of 32 or more, else
``0.00025 * 2 * bs / 64``; LayerNorm towers (ViTs) ``0.001 * bs / 64``. The EATA repository
has one setting only, ResNet-50 (BN) at batch 64 with lr 0.00025, which the rule
reproduces. The batch size is that of the first batch after ``setup()``/``reset()`` (the
protocol's batch size; a short last batch keeps it, as officially); ``resolved_lr`` says
what it gave. A given ``lr`` is used as is.

Parameters: the affine parameters of every norm layer of the vision tower (SAR repository's
EATA: BatchNorm, GroupNorm, LayerNorm; the EATA repository's ResNet-50 has BatchNorm only),
BatchNorm with test-batch statistics (official ``configure_model``).

What differs:
* ``reset()`` also clears the moving average ``m`` (the official ``reset()`` restores model
  and optimiser only, so under ``each_shift_reset`` ``m`` carries over to the next
  corruption): the method contract says reset returns to the state after ``setup()``.
  Effect: the first batch after a reset is filtered for reliability only.
* On 10 classes the official ``d_margin`` 0.05 filters far more than on ImageNet: the
  cosine between a confident prediction and a near-uniform average is about
  ``1 / sqrt(C)`` (0.32 for C = 10, 0.03 for C = 1000), so after the first batch few
  samples pass (counted on noisy digits: docs/methods.md#eta). The official value is kept
  as the default
  (``method.d_margin`` changes it; third-party CIFAR-10 configurations, e.g.
  mariodoebler/test-time-adaptation, use 0.4).
* The entropy of the filter and the loss is computed in float32 whatever the autocast
  dtype (official: float32 throughout; the default precision here is fp32 as well).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from mura_plugin.losses import view_entropy
from mura_plugin.methods._norm import masked_mean, norm_parameters, use_batch_statistics
from tta_bench.bounds import bounded, one_of
from tta_bench.method import PRECISIONS, GradientConfig, GradientMethod
from tta_bench.model import ZeroShotClassifier

__all__ = [
    "ETA",
    "ETAConfig",
    "ReliableEntropyConfig",
    "ReliableEntropyMethod",
    "TOWERS",
    "tower_kind",
    "official_sgd_lr",
    "entropy_weights",
    "select_samples",
    "update_moving_probs",
]

#: Tower kinds of the official learning-rate rule.
TOWERS = ("resnet", "vit")


def tower_kind(visual: nn.Module) -> str:
    """``resnet`` for towers with BatchNorm/GroupNorm, ``vit`` for LayerNorm-only towers
    (the two families the official code sets learning rates for)."""
    if any(isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)) for m in visual.modules()):
        return "resnet"
    if any(isinstance(m, nn.LayerNorm) for m in visual.modules()):
        return "vit"
    raise ValueError(
        f"the vision tower {type(visual).__name__} has no BatchNorm2d, GroupNorm or "
        "LayerNorm: TENT-style methods adapt norm-layer affine parameters"
    )


def official_sgd_lr(tower: str, batch_size: int, *, double_at_batch_one: bool = False) -> float:
    """The SGD learning rate the SAR/DeYO official code sets for ``batch_size``:
    ResNets 0.00025 (``0.00025 * 2 * bs / 64`` below batch 32), ViTs ``0.001 * bs / 64``;
    doubled at batch size 1 when ``double_at_batch_one`` (SAR and DeYO's ``bs1`` setting)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if tower == "resnet":
        lr = 0.00025 / 64 * batch_size * 2 if batch_size < 32 else 0.00025
    elif tower == "vit":
        lr = 0.001 / 64 * batch_size
    else:
        raise ValueError(f"unknown tower {tower!r}; available: {', '.join(TOWERS)}")
    return 2 * lr if double_at_batch_one and batch_size == 1 else lr


def entropy_weights(entropy: torch.Tensor, e_margin: float) -> torch.Tensor:
    """EATA's sample weights ``1 / exp(H - E0)`` (detached): lower entropy, more weight."""
    return torch.exp(e_margin - entropy.detach())


def select_samples(
    entropy: torch.Tensor,
    probs: torch.Tensor,
    e_margin: float,
    moving_probs: torch.Tensor | None,
    d_margin: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """EATA's two filters for ``entropy [B]`` and ``probs [B, C]``: ``(reliable, selected)``
    boolean masks ``[B]``; reliable = ``H < e_margin``, selected = reliable and
    ``|cos(moving_probs, p)| < d_margin`` (= reliable while ``moving_probs`` is None)."""
    reliable = entropy < e_margin
    if moving_probs is None:
        return reliable, reliable
    cosine = F.cosine_similarity(moving_probs.unsqueeze(0), probs, dim=1)
    return reliable, reliable & (cosine.abs() < d_margin)


def update_moving_probs(
    moving_probs: torch.Tensor | None, selected_probs: torch.Tensor, momentum: float = 0.9
) -> torch.Tensor | None:
    """EATA's moving average of probability vectors: the mean of ``selected_probs [n, C]``
    the first time, then ``momentum * m + (1 - momentum) * mean``; unchanged when n = 0."""
    if selected_probs.shape[0] == 0:
        return moving_probs
    mean = selected_probs.detach().mean(dim=0)
    if moving_probs is None:
        return mean
    return momentum * moving_probs + (1 - momentum) * mean


@dataclass
class ReliableEntropyConfig(GradientConfig):
    """What ETA/EATA, SAR and DeYO share: SGD on norm affine parameters, float32."""

    loss: str = one_of("entropy", ("entropy",))
    optimizer: str = "sgd"
    #: None = the official rule (``official_sgd_lr``) for the tower and batch size.
    lr: float | None = None
    weight_decay: float = 0.0
    momentum: float = 0.9
    steps: int = bounded(1, ge=1)
    precision: str = one_of("fp32", PRECISIONS)
    #: Reliable-entropy threshold as a fraction of ln C (E0 = e_margin * ln C).
    e_margin: float = bounded(0.4, gt=0)


class ReliableEntropyMethod(GradientMethod):
    """Base of the TENT-style SGD methods: norm-layer parameters with BatchNorm on batch
    statistics, the official learning-rate rule, ``E0``. ``compute_loss`` is the per-sample
    entropy of one forward; subclasses filter, weight and step in ``adapt``."""

    Config: ClassVar[type] = ReliableEntropyConfig
    predict_from_last_forward = True
    #: Double the rule's lr at batch size 1 (SAR and DeYO's official ``bs1`` setting).
    double_lr_at_batch_one: ClassVar[bool] = False

    def setup(self) -> None:
        cfg = self.config
        self._official_lr = cfg.lr is None
        if self._official_lr:
            if cfg.optimizer.lower() != "sgd":
                raise ValueError(
                    f"lr=None is the official SGD learning-rate rule; give method.lr for "
                    f"optimizer {cfg.optimizer!r}"
                )
            # The rule needs the batch size: the optimiser gets it at the first batch.
            self.config = dataclasses.replace(cfg, lr=0.0)
        self._lr_batch: int | None = None
        self.tower = tower_kind(self.model.visual)
        super().setup()

    @property
    def e_threshold(self) -> float:
        """``E0 = e_margin * ln C`` in nats."""
        return self.config.e_margin * math.log(self.model.num_classes)

    @property
    def resolved_lr(self) -> float | None:
        """The learning rate in use (None before the first batch under the official rule)."""
        if not self._official_lr:
            return float(self.config.lr)
        if self._lr_batch is None:
            return None
        return official_sgd_lr(
            self.tower, self._lr_batch, double_at_batch_one=self.double_lr_at_batch_one
        )

    def resolved_settings(self) -> dict[str, float | None]:
        """The learning rate the official rule chose (recorded in the results)."""
        return {"lr": self.resolved_lr}

    def apply_lr(self, batch_size: int) -> None:
        """Under the official rule, fix the batch size at the first batch after
        ``setup()``/``reset()`` and set the optimiser's learning rate from it."""
        if not self._official_lr:
            return
        if self._lr_batch is None:
            self._lr_batch = int(batch_size)
        lr = self.resolved_lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def reset(self) -> None:
        super().reset()
        self._lr_batch = None

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
        """``(entropy [B] in float32, logits [B, C])`` of one forward."""
        logits = self.model(images)
        return view_entropy(logits), logits


@dataclass
class ETAConfig(ReliableEntropyConfig):
    """The official ETA setting (EATA without the Fisher regulariser)."""

    #: Redundancy threshold on the cosine to the moving average (official d_margin).
    d_margin: float = bounded(0.05, gt=0)  # above 1: no sample is redundant
    #: Momentum of the moving average of probability vectors (official 0.9).
    probs_momentum: float = bounded(0.9, ge=0, lt=1)


class ETA(ReliableEntropyMethod):
    """Reliable, non-redundant, entropy-weighted entropy minimisation (EATA's Eqs. 3-6)."""

    Config = ETAConfig
    state_attributes = ("moving_probs",)

    def setup(self) -> None:
        self.moving_probs: torch.Tensor | None = None
        #: Samples that passed the reliability filter / both filters since setup or reset.
        self.counts = {"reliable": 0, "selected": 0}
        super().setup()

    def reset(self) -> None:
        super().reset()
        self.counts = {"reliable": 0, "selected": 0}

    def penalty(self) -> torch.Tensor | None:
        """A regulariser added to the loss (EATA's Fisher term); None for ETA."""
        return None

    def adapt(self, images: torch.Tensor) -> torch.Tensor:
        cfg, e0 = self.config, self.e_threshold
        logits = None
        for _ in range(cfg.steps):
            self.apply_lr(images.shape[0])
            with torch.enable_grad(), self.autocast():
                entropy, logits = self.compute_loss(images)
                probs = logits.detach().float().softmax(dim=-1)
                reliable, selected = select_samples(
                    entropy.detach(), probs, e0, self.moving_probs, cfg.d_margin
                )
                weighted = entropy_weights(entropy, e0) * entropy
                loss = masked_mean(weighted, selected)
                penalty = self.penalty()
                if penalty is not None:
                    loss = loss + penalty
            self.moving_probs = update_moving_probs(
                self.moving_probs, probs[selected], cfg.probs_momentum
            )
            n_selected = int(selected.sum())
            self.counts["reliable"] += int(reliable.sum())
            self.counts["selected"] += n_selected
            if n_selected:  # official: no update without a selected sample
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
            self.last_loss = loss.detach()
        return logits
