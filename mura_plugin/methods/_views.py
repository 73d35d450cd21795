"""Shared machinery of the multi-view gradient methods (TPT, TTL-style LoRA, MuRA).

``MultiViewMethod`` adapts on augmented views of each test image and predicts on the
original image after the update. Episodic granularity (``episodic``):

* ``sample``: every sample of the batch is adapted on its own views from the state kept
  between episodes, predicted, then its *episode parameters* are restored (TPT/TTL's
  per-sample reset). Views of the whole batch are drawn at once. With
  ``episode_batching`` (default) and a method that supports it, the B episodes of a batch
  run together: each sample gets its own copy of the episode parameters (``begin_episodes``),
  one forward/backward covers all V x B views, and one optimiser step on the *sum* of the
  per-sample losses updates every copy from its own loss only. Adam/AdamW/SGD and weight
  decay act element-wise and a fresh optimiser serves each episode, so this is the
  sequential per-sample loop computed in parallel (tests/test_methods.py checks it).
  Parameters that persist across episodes (MuRA's router) are the exception: they get one
  step per batch from the summed per-sample losses instead of one per sample (see mura.py).
  ``episode_batching=false`` keeps the sequential loop for exactness studies.
* ``batch``: the whole batch adapts together (one forward of V x B views), then restored.
* ``online``: like ``batch`` but nothing is restored between batches (only ``reset()``).

A subclass says which parameters are restored per episode (``episode_parameters``; the
rest, e.g. MuRA's persistent router, carry over between samples but ``reset()`` still
restores them) and implements ``view_loss``. ``encode_views`` may precompute, without
gradients, whatever the loss needs from the frozen parts (TPT: image features; MuRA: the
tokens entering the first adapted block). Cost accounting: view encoding, adaptation and
restores count as ``adapt``, the final prediction as ``predict``; ``last_loss`` is the mean
per-sample loss of the batch's last step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mura_plugin.augment import make_views
from tta_bench.method import GradientConfig, GradientMethod, build_optimizer

__all__ = ["EPISODIC", "SEPARABLE_LOSSES", "MultiViewConfig", "MultiViewMethod"]

EPISODIC = ("sample", "batch", "online")

#: Losses whose value for sample i depends on sample i's views only: batched episodes are
#: exact for them. Others (info_max's batch marginal, unknown plugin losses) run the
#: sequential loop, where each episode sees only its own sample.
SEPARABLE_LOSSES = ("entropy", "marginal_entropy", "weighted_entropy", "consistency")


@dataclass
class MultiViewConfig(GradientConfig):
    views: int = 63  # augmented views per image, besides the original
    include_original: bool = True
    crop_scale_min: float = 0.08  # RandomResizedCrop's default lower area bound
    flip: bool = True
    episodic: str = "sample"
    adapt_every: int = 1  # adapt on every N-th batch, predict only on the others
    episode_batching: bool = True  # episodic=sample: all episodes of a batch in parallel
    # Images per chunk of the batched forward/backward (whole samples, at least one): chunks
    # that fit the CPU caches run ~2x faster than one huge batch; gradients accumulate.
    chunk_views: int = 256
    # TPT/TTL's official code runs CLIP under fp16 autocast on CUDA (CPU: float32).
    precision: str = "fp16"


def configured_views(images: torch.Tensor, cfg: Any, generator: torch.Generator) -> torch.Tensor:
    """``[V, B, C, H, W]`` views of ``images`` as a config with ``views``,
    ``include_original``, ``crop_scale_min`` and ``flip`` asks (shared with ZERO)."""
    return make_views(
        images,
        cfg.views,
        generator,
        include_original=cfg.include_original,
        scale=(cfg.crop_scale_min, 1.0),
        flip=cfg.flip,
    )


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
        if cfg.chunk_views < 1:
            raise ValueError(f"chunk_views must be >= 1, got {cfg.chunk_views}")
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

    def supports_episode_batching(self) -> bool:
        """Whether ``begin_episodes`` is implemented for the current configuration."""
        return False

    def begin_episodes(self, n: int) -> list[torch.Tensor]:
        """Give each of ``n`` samples its own copy of every episode parameter (leaf tensors
        ``[n, *shape]`` initialised from the current values, returned for the optimiser) and
        make ``view_loss`` / ``predict_episode`` use copy i for sample i."""
        raise NotImplementedError

    def select_episodes(self, rows: slice) -> None:
        """Make ``view_loss`` use the copies of samples ``rows`` only (its inputs are then
        those samples' views); ``slice(0, n)`` selects all again."""
        raise NotImplementedError

    def end_episodes(self) -> None:
        """Drop the per-sample copies: the shared parameters are in use again."""
        raise NotImplementedError

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
        return configured_views(images, self.config, self.generator)

    def adapt_on(self, inputs: Any) -> None:
        """``config.steps`` optimiser steps on the mean of ``view_loss(inputs)``."""
        for _ in range(self.config.steps):
            with torch.enable_grad(), self.autocast():
                per_sample = self.view_loss(inputs)[0]
                loss = per_sample.mean()
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.last_loss = loss.detach()

    @torch.no_grad()
    def restore_episode(self) -> None:
        """Restore the episode parameters to their ``setup()`` values and forget their
        optimiser state (a fresh optimiser per episode, as in TPT/TTL)."""
        saved = self._snapshot["params"]
        for i in self._episode_index:
            p = self.params[i]
            p.copy_(saved[i])
            self.optimizer.state.pop(p, None)

    def batched_episodes(self) -> bool:
        """True when this batch's per-sample episodes run in parallel."""
        cfg = self.config
        return (
            cfg.episodic == "sample"
            and cfg.episode_batching
            and cfg.loss in SEPARABLE_LOSSES
            and self.supports_episode_batching()
        )

    def adapt_episodes(self, inputs: Any, n: int) -> None:
        """``config.steps`` steps of ``n`` parallel episodes (see the module docstring); the
        per-sample copies stay active for ``predict_episode`` until ``end_episodes()``.
        Each step runs forward/backward over chunks of whole samples (``chunk_views``) and
        accumulates the gradients of the summed per-sample losses before stepping."""
        cfg = self.config
        copies = self.begin_episodes(n)
        episode_opt = build_optimizer(copies, cfg)  # fresh state per episode
        persistent = len(self._episode_index) < len(self.params)
        views = cfg.views + int(cfg.include_original)
        per_chunk = max(1, cfg.chunk_views // views)
        for _ in range(cfg.steps):
            episode_opt.zero_grad(set_to_none=True)
            self.optimizer.zero_grad(set_to_none=True)
            losses = []
            for start in range(0, n, per_chunk):
                rows = slice(start, min(n, start + per_chunk))
                with torch.enable_grad(), self.autocast():
                    self.select_episodes(rows)
                    per_sample = self.view_loss(_slice(inputs, rows))[0]
                # sample i's copy gets sample i's gradient only; shared ones get the sum
                per_sample.sum().backward()
                losses.append(per_sample.detach())
            self.select_episodes(slice(0, n))
            episode_opt.step()
            if persistent:  # the shared episode parameters have no gradient: skipped
                self.optimizer.step()
            self.last_loss = torch.cat(losses).mean()

    def step(self, images: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        adapt = self._batches % cfg.adapt_every == 0
        self._batches += 1
        if not adapt:
            with self.timed("predict"):
                return self.predict(images)
        with self.timed("adapt"), torch.no_grad():
            inputs = self.encode_views(self.make_views(images))
        if cfg.episodic != "sample":
            with self.timed("adapt"):
                self.adapt_on(inputs)
            with self.timed("predict"):
                logits = self.predict_episode(images, inputs)
            if cfg.episodic == "batch":
                with self.timed("adapt"):
                    self.restore_episode()
            return logits
        if self.batched_episodes():
            try:
                with self.timed("adapt"):
                    self.adapt_episodes(inputs, images.shape[0])
                with self.timed("predict"):
                    return self.predict_episode(images, inputs)
            finally:
                self.end_episodes()
        out, losses = [], []
        for i in range(images.shape[0]):
            one = _slice(inputs, slice(i, i + 1))
            with self.timed("adapt"):
                self.adapt_on(one)
                losses.append(self.last_loss)
            with self.timed("predict"):
                out.append(self.predict_episode(images[i : i + 1], one))
            with self.timed("adapt"):
                self.restore_episode()
        self.last_loss = torch.stack(losses).mean()
        return torch.cat(out, dim=0)


def _slice(inputs: Any, rows: slice) -> Any:
    """Samples ``rows`` of batch-major-second structures (``[V, B, ...]`` tensors, dicts)."""
    if isinstance(inputs, torch.Tensor):
        return inputs[:, rows]
    if isinstance(inputs, dict):
        return {k: _slice(v, rows) for k, v in inputs.items()}
    raise TypeError(f"cannot slice per sample: {type(inputs).__name__}")
