"""SAR: sharpness-aware and reliable entropy minimisation with model recovery.

Paper: Niu et al., "Towards Stable Test-Time Adaptation in Dynamic Wild World", ICLR 2023.
Official code: https://github.com/mr-eggplant/SAR, commit
20f6e24b17525f34503510afccedc0629b67b7c4 (sar.py: forward_and_adapt_sar, update_ema,
collect_params, configure_model; sam.py: SAM; main.py: arguments, learning rates).

One step per batch, as officially:

1. forward (the batch's prediction), entropy ``H_i``; reliable: ``H_i < E0``,
   ``E0 = 0.4 ln C`` (official ``0.4 ln 1000``); loss ``mean(H_reliable)``, backward;
2. SAM ascent: every adapted parameter moves by ``rho * g / (||g|| + 1e-12)`` (``||g||``
   the L2 norm over all adapted gradients; rho 0.05, non-adaptive SAM);
3. second forward at the perturbed point; of the first step's reliable samples, those still
   below ``E0`` give the loss; its value updates the moving average
   ``ema <- 0.9 ema + 0.1 loss`` (first value as is; an empty selection leaves it);
4. back to the unperturbed parameters and one SGD step with the perturbed point's gradient;
   a step with no reliable sample has zero gradient (momentum still moves, as officially);
5. model recovery: when ``ema < 0.2`` the parameters and the optimiser return to the state
   after ``setup()``; the moving average is kept (the official ``reset()`` clears it, and
   ``SAR.forward`` sets it again on the next line), so the model keeps recovering on the
   following batches while the average stays under the threshold. A reset by the protocol
   clears it (the official ``reset()``). The official ``reset_constant_em`` argument is
   ignored by its code, which compares with the literal 0.2; here it is
   ``reset_threshold`` (default 0.2).

Defaults (official): SGD, momentum 0.9, no weight decay, float32, rho 0.05, and
``lr=None`` = main.py's rule: ViT ``0.001 * bs / 64`` (0.001 at batch 64), ResNet 0.00025
(``0.00025 * 2 * bs / 64`` below batch 32), doubled at batch size 1 (the ``bs1``
setting); the batch size is the first batch's after ``setup()``/``reset()``.

Which norm layers adapt (official ``collect_params``): all BatchNorm/GroupNorm/LayerNorm
affine parameters except those of the top blocks: ``layer4`` of ResNets and ``blocks.9``
to ``blocks.11`` plus the final ``norm`` of timm's 12-block ViT-B. Mapped to CLIP towers:
the deepest quarter of the blocks (``exclude_top`` 0.25, rounded; 3 of 12 on ViT-B/16,
1 of the tiny model's 4) of ``transformer.resblocks`` and ``ln_post`` (CLIP's final norm,
where timm's ``norm`` sits; ``ln_pre``, which timm's ViT-B lacks, is a bottom layer and
adapts); ``layer4`` (1 of 4 stages) of CLIP's ModifiedResNet; ``trunk.blocks`` /
``trunk.norm`` / ``trunk.layer4`` of timm-backed towers.

What differs:
* SAM is written out (ascent, restore, base SGD step) rather than the official SAM
  optimiser wrapper; the same arithmetic.
* With no reliable sample in the first pass the second forward is skipped: its loss would
  be an empty mean (zero gradients, no ``ema`` update), so the result is the same.

Measured effect: docs/methods.md#sar.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mura_plugin.methods._norm import masked_mean, top_excluded_norm_parameters
from mura_plugin.methods.eta import ReliableEntropyConfig, ReliableEntropyMethod
from tta_bench.bounds import bounded
from tta_bench.model import ZeroShotClassifier

__all__ = [
    "SAR",
    "SARConfig",
    "sam_ascent",
    "sam_restore",
    "sar_parameters",
    "update_loss_ema",
]


@dataclass
class SARConfig(ReliableEntropyConfig):
    """The official SAR setting."""

    #: SAM neighbourhood radius.
    rho: float = bounded(0.05, ge=0)
    #: Model recovery: reset when the moving average of the loss falls below this.
    reset_threshold: float = 0.2
    #: Momentum of the loss's moving average (official 0.9).
    ema_momentum: float = bounded(0.9, ge=0, lt=1)
    #: Fraction of the deepest blocks (ViT) / stages (ResNet) whose norms stay frozen.
    exclude_top: float = bounded(0.25, ge=0, le=1)
    #: Keep the tower's final norm (CLIP ``ln_post``, timm ``norm``) frozen too.
    exclude_final_norm: bool = True


@torch.no_grad()
def sam_ascent(params: Sequence[torch.Tensor], rho: float) -> list[torch.Tensor]:
    """SAM's first step: move every parameter with a gradient by ``rho * g / (||g|| +
    1e-12)``, ``||g||`` the L2 norm over all gradients. Returns the values before the move
    (for ``sam_restore``)."""
    saved = [p.detach().clone() for p in params]
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return saved
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    scale = rho / (norm + 1e-12)
    for p in params:
        if p.grad is not None:
            p.add_(p.grad * scale.to(p.dtype))
    return saved


@torch.no_grad()
def sam_restore(params: Sequence[torch.Tensor], saved: Sequence[torch.Tensor]) -> None:
    """SAM's return to the unperturbed parameters before the base optimiser's step."""
    for p, value in zip(params, saved, strict=True):
        p.copy_(value)


def update_loss_ema(ema: float | None, value: float, momentum: float = 0.9) -> float:
    """SAR's moving average of the loss: ``value`` first, then ``m * ema + (1 - m) * value``."""
    if ema is None:
        return float(value)
    return momentum * ema + (1 - momentum) * float(value)


def sar_parameters(model: ZeroShotClassifier, cfg: Any, method: str) -> list[nn.Parameter]:
    """The norm affine parameters SAR and DeYO adapt (``top_excluded_norm_parameters`` with
    ``cfg.exclude_top`` and ``cfg.exclude_final_norm``); a ValueError naming ``method``
    when the vision tower has none."""
    params = top_excluded_norm_parameters(model.visual, cfg.exclude_top, cfg.exclude_final_norm)
    if not params:
        raise ValueError(f"{method} found no adaptable normalisation layers in the vision tower")
    return params


class SAR(ReliableEntropyMethod):
    """Reliable entropy minimisation with SAM and model recovery."""

    Config = SARConfig
    state_attributes = ("loss_ema",)
    double_lr_at_batch_one = True

    def setup(self) -> None:
        self.loss_ema: float | None = None
        #: Model recoveries since setup or reset.
        self.recoveries = 0
        super().setup()

    def collect_params(self, model: ZeroShotClassifier) -> list[nn.Parameter]:
        return sar_parameters(model, self.config, "sar")

    def reset(self) -> None:
        super().reset()
        self.recoveries = 0

    def adapt(self, images: torch.Tensor) -> torch.Tensor:
        logits = None
        for _ in range(self.config.steps):
            self.apply_lr(images.shape[0])
            logits = self._sam_step(images)
        return logits

    def _sam_step(self, images: torch.Tensor) -> torch.Tensor:
        cfg, e0 = self.config, self.e_threshold
        self.optimizer.zero_grad(set_to_none=True)
        with torch.enable_grad(), self.autocast():
            entropy, logits = self.compute_loss(images)
            reliable = entropy.detach() < e0
            first = masked_mean(entropy, reliable)
        first.backward()
        saved = sam_ascent(self.params, cfg.rho)
        self.optimizer.zero_grad(set_to_none=True)
        second = first.detach()
        if bool(reliable.any()):
            with torch.enable_grad(), self.autocast():
                # the whole batch, as officially: BatchNorm statistics are the batch's
                entropy2 = self.compute_loss(images)[0][reliable]
                still = entropy2.detach() < e0
                second = masked_mean(entropy2, still)
            if bool(still.any()):
                self.loss_ema = update_loss_ema(self.loss_ema, second.item(), cfg.ema_momentum)
            second.backward()
        else:  # the official empty mean: zero gradients
            for p in self.params:
                p.grad = torch.zeros_like(p)
        sam_restore(self.params, saved)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.last_loss = second.detach()
        if self.loss_ema is not None and self.loss_ema < cfg.reset_threshold:
            kept = self.loss_ema
            self._restore()  # model recovery: back to the state after setup()
            # as officially: its reset() clears the average, and the forward sets it again
            # right after (``self.ema = ema``), so it carries over and recovery repeats while
            # it stays under the threshold
            self.loss_ema = kept
            self.recoveries += 1
        return logits
