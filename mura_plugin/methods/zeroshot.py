"""Zero-shot CLIP: the frozen source model with its prompt-ensemble text head.

Paper: Radford et al., "Learning Transferable Visual Models From Natural Language
Supervision", ICML 2021. Official code: https://github.com/openai/CLIP.
Differences: none; this is the reference row of every table. Its head is the protocol's
(``model.templates``): every other method's ``text_head=protocol`` starts from it.
"""

from __future__ import annotations

import torch

from tta_bench.method import Method

__all__ = ["ZeroShot"]


class ZeroShot(Method):
    """No adaptation: ``step`` is a no-grad forward."""

    is_reference = True  # the frozen model every run is compared with
    light = True  # one forward per sample: sweeps pack its jobs several to a task

    @torch.no_grad()
    def step(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images).float()

    def features_only(self) -> bool:
        return True  # float32 always: ``model(images)`` is its features' logits

    @torch.no_grad()
    def step_features(self, features: torch.Tensor) -> torch.Tensor:
        return self.model.logits_from_features(features).float()
