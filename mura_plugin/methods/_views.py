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
  The episodes run together in groups of the budget's chunk of images (``episode_groups``:
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
tokens entering the first adapted block). Cost accounting: view encoding, adaptation and
restores count as ``adapt``, the final prediction as ``predict``; ``last_loss`` is the mean
per-sample loss of the batch's last step.

Text heads (``text_head``, shared by every method of this plugin): ``protocol`` classifies
with the protocol's templates (``model.templates``, the zero-shot head ``zeroshot`` uses);
``official`` with the head of the method's official code (``class_head``).

Loss scaling: TPT's and TTL's official code trains under fp16 autocast with
``torch.cuda.amp.GradScaler(init_scale=1000)``, which keeps small fp16 gradients from
flushing to zero. ``LossScaler`` applies the same rule (scale the loss, unscale the
gradients, skip a step whose gradients are not finite and halve the scale, double it after
2,000 finite steps) whenever a method runs fp16 on CUDA (``grad_scale``, None = off).
torch's GradScaler decides per optimiser, so in batched episodes one overflowing sample
would skip every sample's step; ``LossScaler`` decides per episode (a skipped episode keeps
its parameters and optimiser state) and updates the scale once per episode in sample order,
as the sequential loop would. What remains different there: all samples of a batch run with
the scale of the batch's start, and with several steps a skipped episode continues with the
others' Adam step count.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mura_plugin.augment import ViewPlan, make_views, plan_views, render_views
from mura_plugin.methods._clip_text import TEXT_HEADS as TEXT_HEAD_CHOICES
from tta_bench.bounds import bounded, one_of
from tta_bench.method import (
    PRECISIONS,
    GradientConfig,
    GradientMethod,
    build_optimizer,
    effective_precision,
    release_optimizer,
)
from tta_bench.model import ZeroShotClassifier

__all__ = [
    "COPIES_WAIT",
    "EPISODIC",
    "VIEW_MEMORY_MB",
    "LazyViews",
    "SEPARABLE_LOSSES",
    "SINGLE_PROMPT",
    "TEXT_HEADS",
    "LossScaler",
    "WaitingCopies",
    "MultiViewConfig",
    "MultiViewMethod",
    "check_text_head",
    "class_head",
    "configured_views",
    "encode_flat",
    "encode_in_chunks",
    "image_chunks",
    "plan_configured",
    "view_bytes_per_image",
]

#: protocol: the protocol's templates (``model.templates``, as ``zeroshot``); official: the
#: head of the method's official code.
TEXT_HEADS = ("protocol", "official")
#: The single prompt of TPT's, TTL's and ZERO's official code ("a photo of a" + class + ".";
#: TDA's on digits). On ``digits-c`` (protocol v2, the shipped weights, seed 0, CPU) the frozen
#: zero-shot model scores 57.9% with it against 56.9% with the protocol's templates: the head
#: alone moves a method by about a point there, which is why every method starts from the
#: protocol's head by default.
SINGLE_PROMPT = ("a photo of a {}.",)

EPISODIC = ("sample", "batch", "online")

#: Default of ``view_memory_mb``: the memory the rendered views of a chunk of images may
#: take (see ``image_chunks``); a chunk is also the most images one forward/backward of
#: the adaptation covers. At 224 px the 64 views of one image take about 150 MB (600 MB
#: with AugMix) by ``view_bytes_per_image``'s estimate, so a chunk is one image, as in
#: the official code, and the peak does not grow with the batch; at 32 px a chunk holds
#: 81 images (a whole batch of 64: the views are built exactly as without a budget).
VIEW_MEMORY_MB = 256.0
#: Where the adapted copies of a batch's episode groups wait for the one step of the
#: parameters that persist across episodes (MuRA's router, ``run_episodes``): ``disk``, an
#: unlinked temporary file (under ``TMPDIR``), so that memory holds one group's copies at
#: any batch size; ``memory``, blocks ``[batch, ...]`` in memory (for MuRA 0.34 MB an image
#: on ViT-B-32); ``recompute``, nothing kept: each group's episodes run again after the
#: step (twice the adaptation's compute). The same predictions whichever (tested).
COPIES_WAIT = ("disk", "memory", "recompute")

#: Losses whose value for sample i depends on sample i's views only: batched episodes are
#: exact for them. Others (info_max's batch marginal, unknown plugin losses) run the
#: sequential loop, where each episode sees only its own sample.
SEPARABLE_LOSSES = ("entropy", "marginal_entropy", "weighted_entropy", "consistency")


@dataclass
class MultiViewConfig(GradientConfig):
    #: ``view_memory_mb`` changes no cell: left out of the run key at its default.
    hash_omit_at_default = ("view_memory_mb",)

    views: int = bounded(63, ge=0)  # augmented views per image, besides the original
    include_original: bool = True
    # RandomResizedCrop's default lower area bound
    crop_scale_min: float = bounded(0.08, gt=0, le=1)
    flip: bool = True
    episodic: str = one_of("sample", EPISODIC)
    #: optimiser steps per episode; 0: no adaptation (the views' prediction alone)
    steps: int = bounded(1, ge=0)
    adapt_every: int = bounded(1, ge=1)  # adapt on every N-th batch, predict only on the others
    episode_batching: bool = True  # episodic=sample: all episodes of a batch in parallel
    # Images per chunk of the batched forward/backward (whole samples, at least one): chunks
    # that fit the CPU caches run ~2x faster than one huge batch; gradients accumulate.
    chunk_views: int = bounded(256, ge=1)
    # The views of a batch are built and encoded in chunks of whole images whose rendered
    # views take at most this many MB (``image_chunks``); the cells do not depend on it.
    view_memory_mb: float = bounded(VIEW_MEMORY_MB, gt=0)
    augmix: bool = False  # AugMix each crop (TPT/TTL: on for their fine-grained sets only)
    # protocol | official (see the module docstring)
    text_head: str = one_of("protocol", TEXT_HEAD_CHOICES)
    # TPT/TTL's official code runs CLIP under fp16 autocast on CUDA (CPU: float32) ...
    precision: str = one_of("fp16", PRECISIONS)
    # ... with GradScaler(init_scale=1000): the initial loss scale for fp16 (None: none),
    # applied per episode by ``LossScaler``
    grad_scale: float | None = 1000.0


def check_text_head(text_head: str) -> None:
    if text_head not in TEXT_HEADS:
        raise ValueError(f"unknown text_head {text_head!r}; available: {', '.join(TEXT_HEADS)}")


def class_head(model: ZeroShotClassifier, text_head: str, official: Sequence[str]) -> torch.Tensor:
    """Class embeddings ``[C, D]`` a method classifies with: ``protocol`` = the model's own
    head (a copy of ``model.class_embeddings``, built from ``model.templates``); ``official``
    = ``model.encode_templates(official)``. The model is never changed."""
    check_text_head(text_head)
    if text_head == "protocol":
        return model.class_embeddings.detach().clone()
    return model.encode_templates(list(official)).to(model.class_embeddings)


class LossScaler:
    """Dynamic loss scaling with ``torch.amp.GradScaler``'s rule (growth 2, backoff 1/2,
    interval 2,000), deciding per episode (see the module docstring). ``scale`` is a float;
    ``enabled`` False makes every call a no-op (scale 1)."""

    growth_factor = 2.0
    backoff_factor = 0.5
    growth_interval = 2000

    def __init__(self, init_scale: float, enabled: bool):
        self.enabled = bool(enabled) and init_scale > 0
        self.scale = float(init_scale) if self.enabled else 1.0
        self.tracker = 0

    def state(self) -> dict[str, float | int]:
        return {"scale": self.scale, "tracker": self.tracker}

    def load_state(self, state: dict[str, float | int]) -> None:
        self.scale, self.tracker = float(state["scale"]), int(state["tracker"])

    def unscale(self, params: Sequence[torch.Tensor], episodes: int | None = None) -> torch.Tensor:
        """Divide the gradients of ``params`` by the scale (in place, as GradScaler: times
        the float32 reciprocal) and return which updates must be skipped: ``[episodes]``
        bool for per-episode copies ``[episodes, ...]`` (a copy's row is skipped when its
        gradient is not finite; a shared parameter with a non-finite gradient skips all),
        or ``[1]`` for plain parameters."""
        rows = 1 if episodes is None else episodes
        dev = params[0].device
        skip = torch.zeros(rows, dtype=torch.bool, device=dev)
        if not self.enabled:
            return skip
        inv = torch.tensor(1.0 / self.scale, dtype=torch.float64).float().item()
        for p in params:
            if p.grad is None:
                continue
            p.grad.mul_(inv)
            bad = ~torch.isfinite(p.grad)
            if episodes is not None and p.dim() > 0 and p.shape[0] == episodes:
                skip |= bad.flatten(1).any(dim=1)
            else:
                skip |= bad.any()
        return skip

    def update(self, skipped: torch.Tensor) -> None:
        """One GradScaler update per entry of ``skipped`` (in order)."""
        if not self.enabled:
            return
        for bad in skipped.tolist():
            if bad:
                self.scale *= self.backoff_factor
                self.tracker = 0
            else:
                self.tracker += 1
                if self.tracker == self.growth_interval:
                    self.scale *= self.growth_factor
                    self.tracker = 0


def configured_views(images: torch.Tensor, cfg: Any, generator: torch.Generator) -> torch.Tensor:
    """``[V, B, C, H, W]`` views of ``images`` as a config with ``views``,
    ``include_original``, ``crop_scale_min``, ``flip`` and (optionally) ``augmix``,
    ``crop_scale_max`` (the crop's upper area bound, default 1.0) and ``rotate_degrees``
    (a RandomAffine rotation of each crop within +-degrees, default 0: none, nothing drawn)
    asks (shared with ZERO and TDA)."""
    return make_views(
        images,
        cfg.views,
        generator,
        include_original=cfg.include_original,
        scale=(cfg.crop_scale_min, float(getattr(cfg, "crop_scale_max", 1.0))),
        flip=cfg.flip,
        augmix_views=bool(getattr(cfg, "augmix", False)),
        rotate_degrees=float(getattr(cfg, "rotate_degrees", 0.0)),
    )


def plan_configured(images: torch.Tensor, cfg: Any, generator: torch.Generator) -> ViewPlan:
    """The draws of ``configured_views(images, cfg, generator)`` (``augment.plan_views``),
    made for the whole batch, so that its views can be rendered chunk by chunk."""
    b, _, h, w = images.shape
    return plan_views(
        b,
        h,
        w,
        cfg.views,
        generator,
        include_original=cfg.include_original,
        scale=(cfg.crop_scale_min, float(getattr(cfg, "crop_scale_max", 1.0))),
        flip=cfg.flip,
        augmix_views=bool(getattr(cfg, "augmix", False)),
        rotate_degrees=float(getattr(cfg, "rotate_degrees", 0.0)),
    )


def view_bytes_per_image(images: torch.Tensor, plan: ViewPlan) -> int:
    """Estimated memory alive while one image's views are rendered by ``plan``: per view,
    the pixels times 4 (the crop, its sampling grid, the concatenated output), 3 more with
    a rotation (the coverage channel and its grid), 12 more with AugMix (the 8-bit copy, 3
    chains and their mix). The estimate, not a measurement: ``benchmarks/method_cost.py``
    measures the peak."""
    c, h, w = images.shape[1:]
    pixels = c * h * w * images.element_size()
    factor = 4 + 3 * (plan.angles is not None) + 12 * (plan.augmix is not None)
    return plan.views * pixels * factor


def image_chunks(n: int, per_image: int, budget_mb: float) -> list[slice]:
    """Chunks of whole images (at least one each) of ``n`` images, each taking at most
    ``budget_mb`` MB at ``per_image`` bytes an image."""
    size = max(1, int(budget_mb * 2**20 // max(1, per_image)))
    return [slice(s, min(n, s + size)) for s in range(0, n, size)]


def _nbytes(inputs: Any) -> int:
    if isinstance(inputs, torch.Tensor):
        return inputs.numel() * inputs.element_size()
    if isinstance(inputs, dict):
        return sum(_nbytes(v) for v in inputs.values())
    raise TypeError(f"cannot size: {type(inputs).__name__}")


def _cat(parts: list[Any]) -> Any:
    """Concatenate per-chunk ``[V, b, ...]`` structures along the sample dimension."""
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts, dim=1)
    return {k: _cat([p[k] for p in parts]) for k in parts[0]}


def encode_flat(encode: Any, views: torch.Tensor, chunk: int) -> torch.Tensor:
    """``encode`` of views ``[V, B, C, H, W]`` flattened view-major, ``chunk`` views per
    call, reshaped to ``[V, B, ...]`` (the frozen towers' chunked forward)."""
    v, b = views.shape[:2]
    flat = views.flatten(0, 1)
    out = torch.cat([encode(flat[i : i + chunk]) for i in range(0, v * b, chunk)])
    return out.view(v, b, *out.shape[1:])


def encode_in_chunks(
    images: torch.Tensor,
    cfg: Any,
    generator: torch.Generator,
    encode: Any,
    budget_mb: float,
    reduce: Any = None,
    phase: Any = None,
) -> Any:
    """``encode(views)`` of the views ``configured_views(images, cfg, generator)`` would
    give, built and encoded in chunks of whole images within ``budget_mb``
    (``image_chunks``), the chunks' outputs (``[V, b, ...]`` tensors or dicts of them)
    concatenated along the sample dimension. The draws are made for the whole batch
    first, so the views do not depend on the chunking; ``encode`` must treat every view
    on its own (a frozen tower, per-view features or logits). With ``reduce``, each
    chunk's encoded views are reduced to per-sample outputs at once (``reduce(encoded)``:
    a ``[b, ...]`` tensor or a tuple of them, concatenated along dim 0), so that no more
    than a chunk's encoded views are alive at any batch size; ``reduce`` must treat every
    sample on its own, or in sample order when it keeps state across samples. ``phase``:
    a context manager factory the drawing, rendering and encoding run under (a method's
    ``lambda: self.timed("adapt")``), ``reduce`` outside it."""
    timed = phase or contextlib.nullcontext

    def encoded(rows: slice | None) -> Any:
        with timed():
            if rows is None:
                return encode(render_views(images, plan))
            return encode(render_views(images[rows], plan.rows(rows)))

    with timed():
        plan = plan_configured(images, cfg, generator)
    chunks = image_chunks(images.shape[0], view_bytes_per_image(images, plan), budget_mb)
    if len(chunks) == 1:
        whole = encoded(None)
        return whole if reduce is None else reduce(whole)
    if reduce is None:
        return _cat([encoded(rows) for rows in chunks])
    parts = [reduce(encoded(rows)) for rows in chunks]
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts, dim=0)
    return tuple(torch.cat(column, dim=0) for column in zip(*parts))


class WaitingCopies:
    """The adapted per-sample copies of a batch's episode groups, from each group's
    adaptation until it is predicted after the persistent parameters' step
    (``run_episodes``), kept where ``where`` says (``COPIES_WAIT``: ``disk`` or
    ``memory``). ``put(rows, copies)`` stores a group's copies ``[g, ...]`` (values only),
    ``get(rows, copies)`` writes them back into fresh copies of the same shapes; the
    values come back bit for bit. ``close()`` drops them (the file is unlinked from its
    creation, so nothing stays on disk even when the process is killed)."""

    def __init__(self, where: str, n: int):
        if where not in ("disk", "memory"):
            raise ValueError(f"copies wait on disk or in memory, not {where!r}")
        self.where, self.n = where, n
        self._blocks: list[torch.Tensor] | None = None  # memory: [n, ...] per copy
        self._file: Any = None  # disk: an unlinked temporary file
        self._spans: dict[int, list[tuple[int, int]]] = {}  # rows.start -> (offset, bytes)

    @property
    def nbytes(self) -> int:
        """Bytes held: in memory, or in the file."""
        if self._blocks is not None:
            return sum(b.numel() * b.element_size() for b in self._blocks)
        return sum(size for spans in self._spans.values() for _, size in spans)

    @torch.no_grad()
    def put(self, rows: slice, copies: list[torch.Tensor]) -> None:
        if self.where == "memory":
            if self._blocks is None:  # one block per copy: the small copies do not scatter
                self._blocks = [c.new_empty((self.n, *c.shape[1:])) for c in copies]
            for store, copy in zip(self._blocks, copies):
                store[rows].copy_(copy)
            return
        if self._file is None:
            # closed by close(): it lives across calls, so no context manager
            self._file = tempfile.TemporaryFile(prefix="tta-bench-copies-")  # noqa: SIM115
        offset = self._file.seek(0, os.SEEK_END)
        spans = []
        for copy in copies:
            data = copy.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            self._file.write(memoryview(data.numpy()))
            spans.append((offset, data.numel()))
            offset += data.numel()
        self._spans[rows.start] = spans

    @torch.no_grad()
    def get(self, rows: slice, copies: list[torch.Tensor]) -> None:
        if self.where == "memory":
            for copy, store in zip(copies, self._blocks or []):
                copy.copy_(store[rows])
            return
        for copy, (offset, size) in zip(copies, self._spans[rows.start]):
            if size != copy.numel() * copy.element_size():
                raise RuntimeError(f"waiting copy of {size} bytes read into {tuple(copy.shape)}")
            data = torch.empty(size, dtype=torch.uint8)
            self._file.seek(offset)
            got = self._file.readinto(memoryview(data.numpy()))
            if got != size:
                raise OSError(f"read {got} of {size} bytes of a waiting copy back")
            copy.copy_(data.view(copy.dtype).view(copy.shape))

    def close(self) -> None:
        self._blocks = None
        self._spans.clear()
        if self._file is not None:
            self._file.close()
            self._file = None


class LazyViews:
    """The encoded views of a batch too large to keep (``MultiViewMethod.view_inputs``):
    ``rows(r)`` renders and encodes the views of samples ``r`` from the batch's plan each
    time it is asked (the same values every time), ``original(r)`` encodes the originals
    only (view 0, when included). ``chunks``: the chunks of samples the budget allows."""

    def __init__(self, method: MultiViewMethod, images: torch.Tensor, plan: ViewPlan, chunks):
        self.method, self.images, self.plan, self.chunks = method, images, plan, chunks

    @torch.no_grad()
    def rows(self, rows: slice) -> Any:
        views = render_views(self.images[rows], self.plan.rows(rows))
        return self.method.encode_views(views)

    @torch.no_grad()
    def original(self, rows: slice) -> Any:
        return self.method.encode_views(self.images[rows].unsqueeze(0))


class MultiViewMethod(GradientMethod):
    """Adapt on views, predict on the original; see the module docstring."""

    Config = MultiViewConfig
    #: Whether ``predict_episode`` reads view 0 (the original) of its inputs only, when
    #: the original is included: batches kept as ``LazyViews`` then encode only that.
    predict_reads_original = False

    def setup(self) -> None:
        cfg = self.config
        self._batches = 0
        self._chunk_images = 1  # images per chunk of the last view_inputs (the budget's)
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
        return {"batches": self._batches, "loss_scaler": self.loss_scaler.state()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self._batches = int(state["batches"])
        self.loss_scaler.load_state(state["loss_scaler"])

    def _new_scaler(self) -> None:
        """No ``torch.amp.GradScaler``: these loops scale per episode (``loss_scaler``)."""
        return None

    # -- the loop ------------------------------------------------------------------------
    def view_settings(self) -> Any:
        """The view fields ``configured_views`` reads (default: the config)."""
        return self.config

    def make_views(self, images: torch.Tensor) -> torch.Tensor:
        return configured_views(images, self.view_settings(), self.generator)

    def plan_views(self, images: torch.Tensor) -> ViewPlan:
        """The draws of ``make_views(images)``."""
        return plan_configured(images, self.view_settings(), self.generator)

    def view_inputs(self, images: torch.Tensor) -> Any:
        """``encode_views(make_views(images))``, built within ``config.view_memory_mb``: the
        views are drawn for the whole batch, then rendered and encoded in chunks of whole
        images (``image_chunks``). When the loss treats samples separately, the encoded
        views of a batch of several chunks are not kept (a ``LazyViews`` renders and
        encodes a group's views when the loop asks for them, the same values each time)
        if the per-sample episodes ask for each group once (``episodic=sample``: memory
        then stays flat in the batch) or if the encoded chunks together would take more
        than a quarter of the budget (MuRA's tokens at 224 px)."""
        cfg = self.config
        plan = self.plan_views(images)
        n = images.shape[0]
        chunks = image_chunks(n, view_bytes_per_image(images, plan), cfg.view_memory_mb)
        self._chunk_images = chunks[0].stop - chunks[0].start
        if len(chunks) == 1:
            return self.encode_views(render_views(images, plan))
        if cfg.episodic == "sample" and cfg.loss in SEPARABLE_LOSSES:
            return LazyViews(self, images, plan, chunks)
        first = self.encode_views(render_views(images[chunks[0]], plan.rows(chunks[0])))
        per_image = _nbytes(first) / (chunks[0].stop - chunks[0].start)
        if per_image * n > cfg.view_memory_mb * 2**20 / 4 and cfg.loss in SEPARABLE_LOSSES:
            return LazyViews(self, images, plan, chunks)
        rest = [self.encode_views(render_views(images[r], plan.rows(r))) for r in chunks[1:]]
        return _cat([first, *rest])

    def _predict_inputs(self, inputs: Any, rows: slice) -> Any:
        """What ``predict_episode`` needs of samples ``rows`` of ``inputs``."""
        lazy = isinstance(inputs, LazyViews)
        if lazy and self.predict_reads_original and self.config.include_original:
            return inputs.original(rows)
        return _slice(inputs, rows)

    def _predict_chunks(self, images: torch.Tensor, inputs: Any, episodes: bool) -> torch.Tensor:
        """``predict_episode`` of the batch, chunk by chunk of the budget's images (selecting
        those samples' episode copies when ``episodes``): with per-sample prompts, TPT's
        prediction runs the text tower on every sample's class prompts at once."""
        n = images.shape[0]
        if isinstance(inputs, LazyViews):
            chunks = inputs.chunks
        else:
            size = self._chunk_images
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

    def adapt_on(self, inputs: Any) -> None:
        """``config.steps`` optimiser steps on the mean of ``view_loss(inputs)`` (loss
        scaled as GradScaler does when ``self.loss_scaler`` is enabled)."""
        for index in range(self.config.steps):
            self.step_index = index
            self.optimizer.zero_grad(set_to_none=True)
            n = _batch_size(inputs)
            if self.config.loss in SEPARABLE_LOSSES and n > self._chunk_images:
                # the batch mean, accumulated over the budget's chunks of samples
                losses = []
                for start in range(0, n, self._chunk_images):
                    rows = slice(start, min(n, start + self._chunk_images))
                    self.loss_rows = start
                    with torch.enable_grad(), self.autocast():
                        per_sample = self.view_loss(_slice(inputs, rows))[0]
                    (per_sample.sum() / n * self.loss_scaler.scale).backward()
                    losses.append(per_sample.detach())
                loss = torch.cat(losses).mean()
                self.loss_rows = None
            else:
                with torch.enable_grad(), self.autocast():
                    per_sample = self.view_loss(inputs)[0]
                    loss = per_sample.mean()
                (loss * self.loss_scaler.scale).backward()
            skipped = self.loss_scaler.unscale(self.params)
            if not bool(skipped.any()):
                self.optimizer.step()
            self.loss_scaler.update(skipped)
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

    def has_persistent_parameters(self) -> bool:
        """Whether some adapted parameters carry over between episodes (MuRA's router)."""
        return len(self._episode_index) < len(self.params)

    def _episode_chunk(self) -> int:
        """Samples per forward/backward of batched episodes: ``chunk_views`` worth of
        views, and no more images than the budget allows (``view_inputs``' chunks)."""
        cfg = self.config
        views = cfg.views + int(cfg.include_original)
        return min(max(1, cfg.chunk_views // views), self._chunk_images)

    def episode_groups(self, n: int) -> list[slice]:
        """The groups of samples whose episodes run together, one group after the other:
        the budget's chunks of images (``view_inputs``), rounded to whole forward chunks
        (``_episode_chunk``), so that the per-sample adapter copies, their gradients and
        optimiser state do not grow with the batch. One group (the whole batch) when
        shared parameters take several steps between episodes (the router of MuRA with
        ``steps > 1``: each step needs every sample's gradient)."""
        persistent = self.has_persistent_parameters()
        if persistent and self.config.steps > 1:
            return [slice(0, n)]
        per_chunk = self._episode_chunk()
        size = max(per_chunk, self._chunk_images // per_chunk * per_chunk)
        return [slice(s, min(n, s + size)) for s in range(0, n, size)]

    def _episode_backward(self, inputs: Any, n: int) -> torch.Tensor:
        """Forward/backward of ``n`` parallel episodes over chunks of whole samples
        (``_episode_chunk``): sample i's copy gets sample i's gradient only, shared
        parameters the sum. Returns the per-sample losses (detached)."""
        per_chunk = self._episode_chunk()
        losses = []
        for start in range(0, n, per_chunk):
            rows = slice(start, min(n, start + per_chunk))
            self.loss_rows = start
            with torch.enable_grad(), self.autocast():
                self.select_episodes(rows)
                per_sample = self.view_loss(_slice(inputs, rows))[0]
            (per_sample.sum() * self.loss_scaler.scale).backward()
            losses.append(per_sample.detach())
        self.select_episodes(slice(0, n))
        self.loss_rows = None
        return torch.cat(losses)

    def adapt_episodes(
        self, inputs: Any, n: int, *, defer_shared: bool = False
    ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """``config.steps`` steps of ``n`` parallel episodes (see the module docstring); the
        per-sample copies stay active for ``predict_episode`` until ``end_episodes()``.
        Each step runs forward/backward over chunks of whole samples (``chunk_views``) and
        accumulates the gradients of the summed per-sample losses before stepping. With
        ``defer_shared`` (one step, persistent parameters, ``run_episodes``' groups) only
        the copies step: the shared parameters' gradients are left to accumulate over the
        groups, and their unscaling, step and the scaler's update are the caller's.
        Returns the copies, the last step's per-episode skips and per-sample losses."""
        cfg = self.config
        copies = self.begin_episodes(n)
        episode_opt = build_optimizer(copies, cfg)  # fresh state per episode
        persistent = self.has_persistent_parameters() and not defer_shared
        for index in range(cfg.steps):
            self.step_index = index
            episode_opt.zero_grad(set_to_none=True)
            if not defer_shared:
                self.optimizer.zero_grad(set_to_none=True)
            losses = self._episode_backward(inputs, n)
            skipped = self.loss_scaler.unscale(copies, episodes=n)
            if persistent:
                shared = self.loss_scaler.unscale(self.params)
                skipped = skipped | shared
            _step_rows(episode_opt, copies, skip=skipped)
            if persistent and not bool(shared.any()):  # no gradient: the shared ones skip
                self.optimizer.step()
            if not defer_shared:
                self.loss_scaler.update(skipped)
            self.last_loss = losses.mean()
        release_optimizer(episode_opt)
        return copies, skipped, losses

    def copies_wait(self) -> str:
        """Where the groups' adapted copies wait for the persistent parameters' step
        (``COPIES_WAIT``): the config's ``copies_wait`` when it has one, else ``disk``."""
        where = getattr(self.config, "copies_wait", "disk")
        if where not in COPIES_WAIT:
            raise ValueError(f"unknown copies_wait {where!r}; available: {', '.join(COPIES_WAIT)}")
        return where

    def run_episodes(self, images: torch.Tensor, inputs: Any) -> torch.Tensor:
        """Logits of the batch's per-sample episodes, run in parallel group by group
        (``episode_groups``): a group adapts, is predicted and drops its copies before the
        next one starts. Shared parameters that persist across episodes (one step per batch
        on the summed per-sample losses) step once all groups have added their gradients,
        and each group is predicted after that step, as in one whole-batch group; until
        then the groups' adapted copies (values only) wait where ``copies_wait()`` says:
        in a temporary file (the default: memory holds one group's copies at any batch
        size), in memory, or nowhere, each group's episodes then running again after the
        step from the shared values they first saw (``_replay_episodes``: twice the
        adaptation's compute). The same computation as ``adapt_episodes`` on the whole
        batch, whichever."""
        n = images.shape[0]
        groups = self.episode_groups(n)
        if len(groups) == 1:
            try:
                with self.timed("adapt"):
                    self.adapt_episodes(inputs, n)
                with self.timed("predict"):
                    return self._predict_chunks(images, inputs, episodes=True)
            finally:
                self.end_episodes()
        defer = self.has_persistent_parameters()  # then one step (``episode_groups``)
        where = self.copies_wait() if defer else "recompute"
        waiting = None if where == "recompute" else WaitingCopies(where, n)
        try:
            return self._run_groups(images, inputs, groups, defer, waiting)
        finally:
            if waiting is not None:
                #: bytes the last batch's copies took where they waited (benchmarks)
                self.copies_waited = (where, waiting.nbytes)
                waiting.close()

    def _run_groups(
        self,
        images: torch.Tensor,
        inputs: Any,
        groups: list[slice],
        defer: bool,
        waiting: WaitingCopies | None,
    ) -> torch.Tensor:
        """``run_episodes`` over several groups (see there)."""
        if defer:
            self.optimizer.zero_grad(set_to_none=True)
            episode = set(self._episode_index)
            shared_params = [p for i, p in enumerate(self.params) if i not in episode]
            before = [p.detach().clone() for p in shared_params]
        # per-sample results in blocks allocated once, not a small tensor per group: the
        # small blocks that outlive a group would otherwise pin the heap above the next
        # group's transient memory, and the step's peak would creep with the batch
        n = images.shape[0]
        out: torch.Tensor | None = None
        losses: torch.Tensor | None = None
        skips = torch.zeros(n, dtype=torch.bool, device=self.device)
        for rows in groups:
            part = _slice(inputs, rows)  # a LazyViews renders the group's views once
            try:
                with self.timed("adapt"):
                    copies, skipped, last = self.adapt_episodes(
                        part, rows.stop - rows.start, defer_shared=defer
                    )
                losses = _into(losses, rows, n, last)
                if defer:
                    skips[rows] = skipped
                    if waiting is not None:
                        waiting.put(rows, copies)
                else:
                    with self.timed("predict"):
                        out = _into(out, rows, n, self.predict_episode(images[rows], part))
            finally:
                self.end_episodes()
                # nothing of this group is alive while the next one's views are built
                part = copies = None
        if defer:
            with self.timed("adapt"):
                shared = self.loss_scaler.unscale(self.params)
                stepped = not bool(shared.any())  # a skipped step keeps the copies as set
                if stepped:
                    self.optimizer.step()
                self.loss_scaler.update(skips | shared)
            replay = stepped and waiting is None
            after = [p.detach().clone() for p in shared_params] if replay else []
            for rows in groups:
                g = rows.stop - rows.start
                try:
                    if replay:
                        part = _slice(inputs, rows)
                        with self.timed("adapt"):
                            self._replay_episodes(part, g, shared_params, before, after)
                    else:
                        with self.timed("predict"):
                            copies = self.begin_episodes(g)
                            if stepped and waiting is not None:
                                waiting.get(rows, copies)
                        part = self._predict_inputs(inputs, rows)
                    with self.timed("predict"):
                        out = _into(out, rows, n, self.predict_episode(images[rows], part))
                finally:
                    self.end_episodes()
                    part = copies = None
        self.last_loss = None if losses is None else losses.mean()
        assert out is not None  # groups is never empty
        return out

    def _replay_episodes(
        self,
        inputs: Any,
        n: int,
        shared: list[torch.Tensor],
        before: list[torch.Tensor],
        after: list[torch.Tensor],
    ) -> None:
        """Run a group's episodes again with the shared parameters as they were before the
        batch's step (``before``: the same computation, so the same adapted copies), then
        set them back to ``after`` (their stepped values) and leave the copies active for
        ``predict_episode``. The shared gradients are left as the step saw them."""
        grads = [p.grad for p in shared]
        with torch.no_grad():
            for p, value in zip(shared, before):
                p.copy_(value)
                p.grad = None
        try:
            self.adapt_episodes(inputs, n, defer_shared=True)
        finally:
            with torch.no_grad():
                for p, value, grad in zip(shared, after, grads):
                    p.copy_(value)
                    p.grad = grad

    def step(self, images: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        adapt = cfg.steps > 0 and self._batches % cfg.adapt_every == 0
        self._batches += 1
        if not adapt:
            with self.timed("predict"):
                return self.predict(images)
        with self.timed("adapt"), torch.no_grad():
            inputs = self.view_inputs(images)
        if cfg.episodic != "sample":
            with self.timed("adapt"):
                self.adapt_on(inputs)
            with self.timed("predict"):
                logits = self._predict_chunks(images, inputs, episodes=False)
            if cfg.episodic == "batch":
                with self.timed("adapt"):
                    self.restore_episode()
            return logits
        if self.batched_episodes():
            return self.run_episodes(images, inputs)
        out, losses = [], []
        for i in range(images.shape[0]):
            one = _slice(inputs, slice(i, i + 1))
            with self.timed("adapt"):
                self.adapt_on(one)
                losses.append(self.last_loss)
            with self.timed("predict"):
                out.append(self.predict_episode(images[i : i + 1], one))  # one: encoded
            with self.timed("adapt"):
                self.restore_episode()
        self.last_loss = torch.stack(losses).mean()
        return torch.cat(out, dim=0)


@torch.no_grad()
def _step_rows(optimizer: torch.optim.Optimizer, copies: list[torch.Tensor], skip: torch.Tensor):
    """``optimizer.step()`` on per-episode copies ``[n, ...]``, except that the rows where
    ``skip`` is True keep their values and optimiser state (a skipped episode's step)."""
    if not bool(skip.any()):
        optimizer.step()
        return
    rows = skip.nonzero()[:, 0]
    saved = [
        (p, p[rows].clone(), {k: v[rows].clone() for k, v in _row_state(optimizer, p)})
        for p in copies
    ]
    optimizer.step()
    for p, values, state in saved:
        p[rows] = values
        for k, v in _row_state(optimizer, p):
            if k in state:
                v[rows] = state[k]
            elif v.dim() > 0:
                v[rows] = 0  # created by this step: a skipped row has none yet


def _row_state(optimizer: torch.optim.Optimizer, p: torch.Tensor):
    """The per-element state tensors of ``p`` (Adam's moments, SGD's momentum buffer)."""
    return [
        (k, v)
        for k, v in optimizer.state.get(p, {}).items()
        if isinstance(v, torch.Tensor) and v.shape == p.shape
    ]


def _into(block: torch.Tensor | None, rows: slice, n: int, part: torch.Tensor) -> torch.Tensor:
    """``part`` written into rows ``rows`` of a ``[n, ...]`` block (made on first use)."""
    if block is None:
        block = part.new_empty((n, *part.shape[1:]))
    block[rows] = part
    return block


def _batch_size(inputs: Any) -> int:
    """Samples in ``inputs`` (``[V, B, ...]`` tensors, dicts of them, ``LazyViews``)."""
    if isinstance(inputs, torch.Tensor):
        return inputs.shape[1]
    if isinstance(inputs, LazyViews):
        return inputs.images.shape[0]
    return _batch_size(next(iter(inputs.values())))


def _slice(inputs: Any, rows: slice) -> Any:
    """Samples ``rows`` of batch-major-second structures (``[V, B, ...]`` tensors, dicts)."""
    if isinstance(inputs, torch.Tensor):
        return inputs[:, rows]
    if isinstance(inputs, LazyViews):
        return inputs.rows(rows)
    if isinstance(inputs, dict):
        return {k: _slice(v, rows) for k, v in inputs.items()}
    raise TypeError(f"cannot slice per sample: {type(inputs).__name__}")
