"""EATA: efficient anti-forgetting test-time adaptation (ETA + a Fisher regulariser).

Paper: Niu et al., "Efficient Test-Time Model Adaptation without Forgetting", ICML 2022.
Official code: https://github.com/mr-eggplant/EATA, commit
f739b3668cc7617e9b9f1979c1a358497a3472c3 (eata.py: forward_and_adapt_eata; main.py: the
Fisher computation and arguments); ViT setting from https://github.com/mr-eggplant/SAR,
commit 20f6e24b17525f34503510afccedc0629b67b7c4 (main.py). Everything of ETA (eta.py:
filters, weights, optimiser, learning-rate rule, parameters) applies; EATA adds

    loss += alpha * sum_j F_j (theta_j - theta0_j)^2          (Eq. 8/9, alpha = 2000)

``theta0`` the parameters before adaptation and ``F`` the diagonal Fisher information,
computed as main.py does before adaptation: over ``fisher_size`` (2,000) clean source images
in batches of 64 (the official loader's batch size), the gradient of the batch-mean
cross-entropy against the model's *own* predictions (argmax pseudo-labels, no labels) is
squared and averaged over batches (``F = (1/n_batches) sum_b (grad L_b)^2``; a short last
batch counts as a batch, as officially). The model is already configured (BatchNorm on
batch statistics) when the Fisher is computed, as in main.py.

Source images come through the harness hook: ``source_images_needed()`` returns
``fisher_size`` and the runner calls ``set_source(images)`` before ``setup()``; with fewer
images than that, all given images are used. Without source images ``setup()`` raises a
ValueError (use ``eta`` for EATA without the regulariser).

What differs (besides ETA's differences):
* The Fisher pass uses ``torch.autograd.grad`` instead of ``backward`` + an SGD optimiser
  used only for ``zero_grad``: the same gradients. ``--fisher_clip_by_norm`` is declared but
  never used officially, so there is no clipping here either.

Measured effect: docs/methods.md#eata.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mura_plugin.methods.eta import ETA, ETAConfig
from tta_bench.bounds import bounded

__all__ = ["EATA", "EATAConfig", "fisher_information", "fisher_penalty"]


@dataclass
class EATAConfig(ETAConfig):
    """The official EATA setting."""

    #: Trade-off beta of the Fisher regulariser (official fisher_alpha).
    fisher_alpha: float = bounded(2000.0, ge=0)
    #: Clean source images for the Fisher information (official fisher_size).
    fisher_size: int = bounded(2000, ge=1)
    #: Batch size of the Fisher pass (the official loader's, 64).
    fisher_batch_size: int = bounded(64, ge=1)


def fisher_information(
    forward: Callable[[torch.Tensor], torch.Tensor],
    params: Sequence[torch.Tensor],
    images: torch.Tensor,
    batch_size: int,
) -> list[torch.Tensor]:
    """Diagonal Fisher of ``params`` as EATA estimates it: for each batch of ``images``,
    the squared gradient of the mean cross-entropy of ``forward(batch)`` against its own
    argmax; averaged over batches. Returns one tensor per parameter (same shapes)."""
    if images.shape[0] == 0:
        raise ValueError("fisher_information needs at least one image")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    totals = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    n_batches = 0
    for batch in images.split(batch_size):
        with torch.enable_grad():
            logits = forward(batch).float()
            loss = F.cross_entropy(logits, logits.argmax(dim=1))
            grads = torch.autograd.grad(loss, list(params), allow_unused=True)
        for total, grad in zip(totals, grads):
            if grad is not None:
                total += grad.detach().float() ** 2
        n_batches += 1
    return [total / n_batches for total in totals]


def fisher_penalty(
    params: Sequence[torch.Tensor],
    fishers: Sequence[torch.Tensor],
    anchors: Sequence[torch.Tensor],
    alpha: float,
) -> torch.Tensor:
    """EATA's anti-forgetting term ``alpha * sum F * (theta - theta0)^2`` (a scalar)."""
    total = sum(
        (f * (p.float() - a) ** 2).sum() for p, f, a in zip(params, fishers, anchors, strict=True)
    )
    return alpha * total


class EATA(ETA):
    """ETA plus the Fisher regulariser estimated on clean source images."""

    Config = EATAConfig

    def source_images_needed(self) -> int:
        return int(self.config.fisher_size)

    def setup(self) -> None:
        cfg = self.config
        if self.source is None or self.source.shape[0] == 0:
            raise ValueError(
                f"eata needs {cfg.fisher_size} clean source images for its Fisher regulariser: "
                "run it on a protocol that declares a source split (the runner then calls "
                "set_source), call method.set_source(images) before setup() in Python, or "
                "use method 'eta' (EATA without the regulariser)"
            )
        super().setup()
        images = self.source[: cfg.fisher_size]

        def forward(batch: torch.Tensor) -> torch.Tensor:
            with self.autocast():
                return self.model(batch.to(self.device))

        self.fishers = fisher_information(forward, self.params, images, cfg.fisher_batch_size)
        self.anchors = [p.detach().clone().float() for p in self.params]

    def penalty(self) -> torch.Tensor:
        return fisher_penalty(self.params, self.fishers, self.anchors, self.config.fisher_alpha)
