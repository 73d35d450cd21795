"""Shared machinery of the multi-view gradient methods (TPT, TTL-style LoRA, MuRA).

``MultiViewMethod`` adapts on augmented views of each test image and predicts on the
original image after the update. Episodic granularity (``episodic``):

* ``sample``: every sample of the batch is adapted on its own views from the state kept
  between episodes, predicted, then its *episode parameters* are restored (TPT/TTL's
  per-sample reset). Views of the whole batch are drawn at once; the loop is per sample.
* ``batch``: the whole batch adapts together (one forward of V x B views), then restored.
* ``online``: like ``batch`` but nothing is restored between batches (only ``reset()``).

A subclass says which parameters are restored per episode (``episode_parameters``; the
rest, e.g. MuRA's persistent router, carry over between samples but ``reset()`` still
restores them) and implements ``view_loss``. ``encode_views`` may precompute, without
gradients, whatever the loss needs from the frozen parts (TPT: image features).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mura_plugin.augment import make_views
from tta_bench.method import GradientConfig, GradientMethod

__all__ = ["EPISODIC", "MultiViewConfig", "MultiViewMethod"]

EPISODIC = ("sample", "batch", "online")


@dataclass
class MultiViewConfig(GradientConfig):
    views: int = 63  # augmented views per image, besides the original
    include_original: bool = True
    crop_scale_min: float = 0.08  # RandomResizedCrop's default lower area bound
    flip: bool = True
    episodic: str = "sample"
    adapt_every: int = 1  # adapt on every N-th batch, predict only on the others


class MultiViewMethod(GradientMethod):
    """Adapt on views, predict on the original; see the module docstring."""

    Config = MultiViewConfig

    def setup(self) -> None:
        cfg = self.config
        if cfg.episodic not in EPISODIC:
            raise ValueError(f"unknown episodic {cfg.episodic!r}; available: {', '.join(EPISODIC)}")
        if cfg.adapt_every < 1:
            raise ValueError(f"adapt_every must be >= 1, got {cfg.adapt_every}")
        if cfg.steps < 1:
            raise ValueError(f"steps must be >= 1, got {cfg.steps}")
        if not 0.0 < cfg.crop_scale_min <= 1.0:
            raise ValueError(f"crop_scale_min must be in (0, 1], got {cfg.crop_scale_min}")
        self._batches = 0
        super().setup()
        episode = {id(p) for p in self.episode_parameters()}
        self._episode_index = [i for i, p in enumerate(self.params) if id(p) in episode]

    # -- hooks ---------------------------------------------------------------------------
    def episode_parameters(self) -> list[nn.Parameter]:
        """Parameters restored after every episode (default: all adapted parameters)."""
        return list(self.params)

    def encode_views(self, views: torch.Tensor) -> Any:
        """Per-batch, gradient-free preprocessing of ``views [V, B, C, H, W]``; the result is
        sliced along dim 1 per sample. Default: the views themselves."""
        return views

    def view_loss(self, inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss [B], logits [V, B, C])`` from ``encode_views``' output for B samples."""
        raise NotImplementedError

    def predict_episode(self, images: torch.Tensor, inputs: Any) -> torch.Tensor:
        """Logits ``[B, C]`` of ``images`` after adaptation (``inputs``: their encoded views)."""
        return self.predict(images)

    # -- GradientMethod contract ---------------------------------------------------------
    def compute_loss(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loss, logits = self.view_loss(self.encode_views(self.make_views(images)))
        return loss, logits[0]

    def extra_state(self) -> dict[str, Any]:
        return {"batches": self._batches}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self._batches = int(state["batches"])

    # -- the loop ------------------------------------------------------------------------
    def make_views(self, images: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        return make_views(
            images,
            cfg.views,
            self.generator,
            include_original=cfg.include_original,
            scale=(cfg.crop_scale_min, 1.0),
            flip=cfg.flip,
        )

    def adapt_on(self, inputs: Any) -> None:
        """``config.steps`` optimiser steps on the mean of ``view_loss(inputs)``."""
        for _ in range(self.config.steps):
            with torch.enable_grad(), self.autocast():
                loss = self.view_loss(inputs)[0].mean()
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()

    @torch.no_grad()
    def restore_episode(self) -> None:
        """Restore the episode parameters to their ``setup()`` values and forget their
        optimiser state (a fresh optimiser per episode, as in TPT/TTL)."""
        saved = self._snapshot["params"]
        for i in self._episode_index:
            p = self.params[i]
            p.copy_(saved[i])
            self.optimizer.state.pop(p, None)

    def step(self, images: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        adapt = self._batches % cfg.adapt_every == 0
        self._batches += 1
        if not adapt:
            return self.predict(images)
        with torch.no_grad():
            inputs = self.encode_views(self.make_views(images))
        if cfg.episodic != "sample":
            self.adapt_on(inputs)
            logits = self.predict_episode(images, inputs)
            if cfg.episodic == "batch":
                self.restore_episode()
            return logits
        out = []
        for i in range(images.shape[0]):
            one = _slice(inputs, i)
            self.adapt_on(one)
            out.append(self.predict_episode(images[i : i + 1], one))
            self.restore_episode()
        return torch.cat(out, dim=0)


def _slice(inputs: Any, i: int) -> Any:
    """Sample ``i`` of batch-major-second structures (``[V, B, ...]`` tensors, dicts)."""
    if isinstance(inputs, torch.Tensor):
        return inputs[:, i : i + 1]
    if isinstance(inputs, dict):
        return {k: _slice(v, i) for k, v in inputs.items()}
    raise TypeError(f"cannot slice per sample: {type(inputs).__name__}")
