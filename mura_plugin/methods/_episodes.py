"""The episode engine of the multi-view gradient methods (TPT, TTL-style LoRA, MuRA).

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
  The episodes run together in groups of the budget's chunk of images (``_budget_groups``:
  one image at 224 px, a whole batch of 64 at 32 px), so the per-sample copies, their
  gradients and optimiser state do not grow with the batch; persistent parameters then
  collect every group's gradient before their one step, and each group's adapted copies
  (values only) wait for it to be predicted (``run_episodes``; in a temporary file by
  default, ``COPIES_WAIT``). With fp16 loss scaling a
  group starts from the scale the groups before it left, as in the sequential loop.
  ``episode_batching=false`` keeps the sequential loop for exactness studies.
* ``batch``: the whole batch adapts together (one forward of V x B views), then restored.
* ``online``: like ``batch`` but nothing is restored between batches (only ``reset()``).

A subclass says which parameters are restored per episode (``episode_parameters``; the
rest, e.g. MuRA's persistent router, carry over between samples but ``reset()`` still
restores them) and implements ``view_loss``. ``encode_views`` may precompute, without
gradients, whatever the loss needs from the frozen parts (TPT: image features; MuRA: the
tokens entering the first adapted block). ``view_inputs`` gives a batch's encoded views
with the budget's chunk of images (``BatchViews``); the loop passes that chunk to every
step that works chunk by chunk. Cost accounting: view encoding, adaptation and restores
count as ``adapt``, the final prediction as ``predict``; ``last_loss`` is the mean
per-sample loss of the batch's last step.

The views and their memory budget are ``_view_budget``'s, the text heads ``_text_heads``',
the per-episode loss scaling (fp16) ``_loss_scaler``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mura_plugin.augment import ViewPlan
from mura_plugin.methods._episode_groups import SEPARABLE_LOSSES, BatchedEpisodes
from mura_plugin.methods._loss_scaler import LossScaler
from mura_plugin.methods._text_heads import TEXT_HEADS
from mura_plugin.methods._view_budget import (
    BatchViews,
    LazyViews,
    batch_size,
    cat_samples,
    configured_views,
    encode_rows,
    image_chunks,
    nbytes,
    plan_configured,
    sample_rows,
    view_bytes_per_image,
)
from mura_plugin.methods._view_config import ViewFields
from tta_bench.bounds import bounded, one_of
from tta_bench.method import (
    PRECISIONS,
    GradientConfig,
    GradientMethod,
    effective_precision,
)

__all__ = [
    "EPISODIC",
    "SEPARABLE_LOSSES",
    "MultiViewConfig",
    "MultiViewMethod",
]

EPISODIC = ("sample", "batch", "online")


@dataclass
class MultiViewConfig(GradientConfig, ViewFields):
    views: int = bounded(63, ge=0)  # augmented views per image, besides the original
    include_original: bool = True
    episodic: str = one_of("sample", EPISODIC)
    #: optimiser steps per episode; 0: no adaptation (the views' prediction alone)
    steps: int = bounded(1, ge=0)
    adapt_every: int = bounded(1, ge=1)  # adapt on every N-th batch, predict only on the others
    episode_batching: bool = True  # episodic=sample: all episodes of a batch in parallel
    augmix: bool = False  # AugMix each crop (TPT/TTL: on for their fine-grained sets only)
    # protocol | official (see _text_heads)
    text_head: str = one_of("protocol", TEXT_HEADS)
    # TPT/TTL's official code runs CLIP under fp16 autocast on CUDA (CPU: float32) ...
    precision: str = one_of("fp16", PRECISIONS)
    # ... with GradScaler(init_scale=1000): the initial loss scale for fp16 (None: none),
    # applied per episode by ``LossScaler``
    grad_scale: float | None = 1000.0


class MultiViewMethod(BatchedEpisodes, GradientMethod):
    """Adapt on views, predict on the original; see the module docstring."""

    Config = MultiViewConfig
    #: Whether ``predict_episode`` reads view 0 (the original) of its inputs only, when
    #: the original is included: batches kept as ``LazyViews`` then encode only that.
    predict_reads_original = False

    def setup(self) -> None:
        cfg = self.config
        self._batches = 0
        #: The first sample of the chunk ``view_loss`` is called on (None: the whole batch
        #: or one episode), for losses that keep per-sample choices across steps (TPT).
        self.loss_rows: int | None = None
        #: The optimisation step running (0 = the first of an episode), for losses whose
        #: later steps reuse what the first one decided (TPT's confident views).
        self.step_index = 0
        fp16 = effective_precision(cfg.precision, self.device) == "fp16"
        self.loss_scaler = LossScaler(cfg.grad_scale or 0.0, enabled=fp16)
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
        return {"batches": self._batches, "loss_scaler": self.loss_scaler.state()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self._batches = int(state["batches"])
        self.loss_scaler.load_state(state["loss_scaler"])

    def _new_scaler(self) -> None:
        """No ``torch.amp.GradScaler``: these loops scale per episode (``loss_scaler``)."""
        return None

    # -- the views -----------------------------------------------------------------------
    def view_settings(self) -> Any:
        """The view fields ``configured_views`` reads (default: the config)."""
        return self.config

    def make_views(self, images: torch.Tensor) -> torch.Tensor:
        return configured_views(images, self.view_settings(), self.generator)

    def plan_views(self, images: torch.Tensor) -> ViewPlan:
        """The draws of ``make_views(images)``."""
        return plan_configured(images, self.view_settings(), self.generator)

    def view_inputs(self, images: torch.Tensor) -> BatchViews:
        """``encode_views(make_views(images))``, built within ``config.view_memory_mb``: the
        views are drawn for the whole batch, then rendered and encoded in chunks of whole
        images (``image_chunks``), with the chunk's size (``BatchViews``). When the loss
        treats samples separately, the encoded views of a batch of several chunks are not
        kept (a ``LazyViews`` renders and encodes a group's views when the loop asks for
        them, the same values each time) if the per-sample episodes ask for each group
        once (``episodic=sample``: memory then stays flat in the batch) or if the encoded
        chunks together would take more than a quarter of the budget (MuRA's tokens at
        224 px)."""
        plan = self.plan_views(images)
        per_image = view_bytes_per_image(images, plan)
        chunks = image_chunks(images.shape[0], per_image, self.config.view_memory_mb)
        encoded = self._encode_chunks(images, plan, chunks)
        return BatchViews(encoded, chunks[0].stop - chunks[0].start)

    def _encode_chunks(self, images: torch.Tensor, plan: ViewPlan, chunks: list[slice]) -> Any:
        """``view_inputs``' encoded views of ``images`` drawn by ``plan``: whole, chunk by
        chunk and concatenated, or a ``LazyViews`` (see there)."""
        cfg = self.config
        n = images.shape[0]
        encode = self.encode_views
        if len(chunks) == 1:
            return encode_rows(encode, images, plan)
        if cfg.episodic == "sample" and cfg.loss in SEPARABLE_LOSSES:
            return LazyViews(encode, images, plan, chunks)
        first = encode_rows(encode, images, plan, chunks[0])
        per_image = nbytes(first) / (chunks[0].stop - chunks[0].start)
        if per_image * n > cfg.view_memory_mb * 2**20 / 4 and cfg.loss in SEPARABLE_LOSSES:
            return LazyViews(encode, images, plan, chunks)
        rest = [encode_rows(encode, images, plan, r) for r in chunks[1:]]
        return cat_samples([first, *rest])

    def _predict_inputs(self, inputs: Any, rows: slice) -> Any:
        """What ``predict_episode`` needs of samples ``rows`` of ``inputs``."""
        lazy = isinstance(inputs, LazyViews)
        if lazy and self.predict_reads_original and self.config.include_original:
            return inputs.original(rows)
        return sample_rows(inputs, rows)

    def _predict_chunks(
        self, images: torch.Tensor, views: BatchViews, episodes: bool
    ) -> torch.Tensor:
        """``predict_episode`` of the batch, chunk by chunk of the budget's images (selecting
        those samples' episode copies when ``episodes``): with per-sample prompts, TPT's
        prediction runs the text tower on every sample's class prompts at once."""
        inputs = views.encoded
        n = images.shape[0]
        if isinstance(inputs, LazyViews):
            chunks = inputs.chunks
        else:
            size = views.chunk_images
            chunks = [slice(s, min(n, s + size)) for s in range(0, n, size)]
        if len(chunks) == 1:
            return self.predict_episode(images, inputs)
        out = []
        for rows in chunks:
            if episodes:
                self.select_episodes(rows)
            out.append(self.predict_episode(images[rows], self._predict_inputs(inputs, rows)))
        if episodes:
            self.select_episodes(slice(0, images.shape[0]))
        return torch.cat(out, dim=0)

    # -- whole-batch and sequential adaptation -------------------------------------------
    def adapt_on(self, inputs: Any, chunk_images: int = 1) -> None:
        """``config.steps`` optimiser steps on the mean of ``view_loss(inputs)`` (loss
        scaled as GradScaler does when ``self.loss_scaler`` is enabled). A separable loss
        runs over chunks of ``chunk_images`` samples (``view_inputs``' chunk; default one
        at a time) whose gradients accumulate."""
        for index in range(self.config.steps):
            self.step_index = index
            self.optimizer.zero_grad(set_to_none=True)
            n = batch_size(inputs)
            if self.config.loss in SEPARABLE_LOSSES and n > chunk_images:
                loss = self._chunked_mean_backward(inputs, n, chunk_images)
            else:
                with torch.enable_grad(), self.autocast():
                    per_sample = self.view_loss(inputs)[0]
                    loss = per_sample.mean()
                (loss * self.loss_scaler.scale).backward()
            self._step_shared()
            self.last_loss = loss.detach()

    def _chunked_mean_backward(self, inputs: Any, n: int, chunk_images: int) -> torch.Tensor:
        """Backward of the (scaled) batch mean of ``view_loss(inputs)``, accumulated over
        chunks of ``chunk_images`` samples; returns the mean (detached)."""
        losses = []
        for start in range(0, n, chunk_images):
            rows = slice(start, min(n, start + chunk_images))
            self.loss_rows = start
            with torch.enable_grad(), self.autocast():
                per_sample = self.view_loss(sample_rows(inputs, rows))[0]
            (per_sample.sum() / n * self.loss_scaler.scale).backward()
            losses.append(per_sample.detach())
        loss = torch.cat(losses).mean()
        self.loss_rows = None
        return loss

    def _step_shared(self, skips: torch.Tensor | None = None) -> bool:
        """Unscale the gradients of ``self.params``, step them unless one is not finite,
        and update the loss scale (once per entry of ``skips | that skip``, the episodes'
        skips when given). Returns whether the step was taken."""
        shared = self.loss_scaler.unscale(self.params)
        stepped = not bool(shared.any())
        if stepped:
            self.optimizer.step()
        self.loss_scaler.update(shared if skips is None else skips | shared)
        return stepped

    @torch.no_grad()
    def restore_episode(self) -> None:
        """Restore the episode parameters to their ``setup()`` values and forget their
        optimiser state (a fresh optimiser per episode, as in TPT/TTL)."""
        saved = self._snapshot["params"]
        for i in self._episode_index:
            p = self.params[i]
            p.copy_(saved[i])
            self.optimizer.state.pop(p, None)

    def _sequential_episodes(self, images: torch.Tensor, inputs: Any) -> torch.Tensor:
        """The per-sample loop: adapt on one sample's views, predict it, restore."""
        out, losses = [], []
        for i in range(images.shape[0]):
            one = sample_rows(inputs, slice(i, i + 1))
            with self.timed("adapt"):
                self.adapt_on(one)
                losses.append(self.last_loss)
            with self.timed("predict"):
                out.append(self.predict_episode(images[i : i + 1], one))  # one: encoded
            with self.timed("adapt"):
                self.restore_episode()
        self.last_loss = torch.stack(losses).mean()
        return torch.cat(out, dim=0)

    # -- the step --------------------------------------------------------------------------
    def step(self, images: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        adapt = cfg.steps > 0 and self._batches % cfg.adapt_every == 0
        self._batches += 1
        if not adapt:
            with self.timed("predict"):
                return self.predict(images)
        with self.timed("adapt"), torch.no_grad():
            views = self.view_inputs(images)
        if cfg.episodic != "sample":
            with self.timed("adapt"):
                self.adapt_on(views.encoded, views.chunk_images)
            with self.timed("predict"):
                logits = self._predict_chunks(images, views, episodes=False)
            if cfg.episodic == "batch":
                with self.timed("adapt"):
                    self.restore_episode()
            return logits
        if self.batched_episodes():
            return self.run_episodes(images, views)
        return self._sequential_episodes(images, views.encoded)
