"""The views of a batch within the view memory budget (``view_memory_mb``).

A config says which views to draw (``configured_views``: crops, flips, AugMix, rotations);
the draws are made for the whole batch at once (``plan_configured``), then the views are
rendered and encoded in chunks of whole images whose rendered views fit the budget
(``image_chunks``, ``view_bytes_per_image``), so that the views, and the peak memory, do
not depend on the batch size while every output stays what the unbounded run gives
(``encode_in_chunks`` for the frozen-tower methods; ``LazyViews`` for a batch too large to
keep, encoded again group by group). ``WaitingCopies`` holds the adapted per-sample copies
of the episode groups while they wait for the step of the parameters that persist across
episodes (``COPIES_WAIT``; the episode engine, ``_episodes``, runs the groups).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any, NamedTuple

import torch

from mura_plugin.augment import ViewPlan, make_views, plan_views, render_views

__all__ = [
    "COPIES_WAIT",
    "VIEW_MEMORY_MB",
    "BatchViews",
    "LazyViews",
    "WaitingCopies",
    "batch_size",
    "cat_samples",
    "configured_views",
    "encode_flat",
    "encode_in_chunks",
    "encode_rows",
    "image_chunks",
    "nbytes",
    "plan_configured",
    "sample_rows",
    "view_bytes_per_image",
]

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


def _draw_options(cfg: Any) -> dict[str, Any]:
    """The keyword arguments of ``make_views`` / ``plan_views`` a config asks for (see
    ``configured_views``)."""
    return dict(
        include_original=cfg.include_original,
        scale=(cfg.crop_scale_min, float(getattr(cfg, "crop_scale_max", 1.0))),
        flip=cfg.flip,
        augmix_views=bool(getattr(cfg, "augmix", False)),
        rotate_degrees=float(getattr(cfg, "rotate_degrees", 0.0)),
    )


def configured_views(images: torch.Tensor, cfg: Any, generator: torch.Generator) -> torch.Tensor:
    """``[V, B, C, H, W]`` views of ``images`` as a config with ``views``,
    ``include_original``, ``crop_scale_min``, ``flip`` and (optionally) ``augmix``,
    ``crop_scale_max`` (the crop's upper area bound, default 1.0) and ``rotate_degrees``
    (a RandomAffine rotation of each crop within +-degrees, default 0: none, nothing drawn)
    asks (shared with ZERO and TDA)."""
    return make_views(images, cfg.views, generator, **_draw_options(cfg))


def plan_configured(images: torch.Tensor, cfg: Any, generator: torch.Generator) -> ViewPlan:
    """The draws of ``configured_views(images, cfg, generator)`` (``augment.plan_views``),
    made for the whole batch, so that its views can be rendered chunk by chunk."""
    b, _, h, w = images.shape
    return plan_views(b, h, w, cfg.views, generator, **_draw_options(cfg))


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


def nbytes(inputs: Any) -> int:
    """Bytes of encoded views (a tensor, or a dict of them)."""
    if isinstance(inputs, torch.Tensor):
        return inputs.numel() * inputs.element_size()
    if isinstance(inputs, dict):
        return sum(nbytes(v) for v in inputs.values())
    raise TypeError(f"cannot size: {type(inputs).__name__}")


def cat_samples(parts: list[Any]) -> Any:
    """Concatenate per-chunk ``[V, b, ...]`` structures along the sample dimension."""
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts, dim=1)
    return {k: cat_samples([p[k] for p in parts]) for k in parts[0]}


def encode_flat(encode: Any, views: torch.Tensor, chunk: int) -> torch.Tensor:
    """``encode`` of views ``[V, B, C, H, W]`` flattened view-major, ``chunk`` views per
    call, reshaped to ``[V, B, ...]`` (the frozen towers' chunked forward)."""
    v, b = views.shape[:2]
    flat = views.flatten(0, 1)
    out = torch.cat([encode(flat[i : i + chunk]) for i in range(0, v * b, chunk)])
    return out.view(v, b, *out.shape[1:])


def encode_rows(
    encode: Any, images: torch.Tensor, plan: ViewPlan, rows: slice | None = None
) -> Any:
    """``encode`` of the views ``plan`` draws for images ``rows`` (None: the whole batch),
    rendered now."""
    if rows is None:
        return encode(render_views(images, plan))
    return encode(render_views(images[rows], plan.rows(rows)))


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
            return encode_rows(encode, images, plan, rows)

    with timed():
        plan = plan_configured(images, cfg, generator)
    chunks = image_chunks(images.shape[0], view_bytes_per_image(images, plan), budget_mb)
    if len(chunks) == 1:
        whole = encoded(None)
        return whole if reduce is None else reduce(whole)
    if reduce is None:
        return cat_samples([encoded(rows) for rows in chunks])
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
    ``rows(r)`` renders and encodes (``encode``: the method's ``encode_views``) the views of
    samples ``r`` from the batch's plan each time it is asked (the same values every
    time), ``original(r)`` encodes the originals only (view 0, when included). ``chunks``:
    the chunks of samples the budget allows."""

    def __init__(self, encode: Any, images: torch.Tensor, plan: ViewPlan, chunks: list[slice]):
        self.encode, self.images, self.plan, self.chunks = encode, images, plan, chunks

    @torch.no_grad()
    def rows(self, rows: slice) -> Any:
        return encode_rows(self.encode, self.images, self.plan, rows)

    @torch.no_grad()
    def original(self, rows: slice) -> Any:
        return self.encode(self.images[rows].unsqueeze(0))


class BatchViews(NamedTuple):
    """A batch's encoded views (``MultiViewMethod.view_inputs``): ``encoded``, what the
    method's ``encode_views`` gives (``[V, B, ...]`` tensors, dicts of them, or a
    ``LazyViews``), and ``chunk_images``, the images per chunk the view memory budget
    allows (``image_chunks``)."""

    encoded: Any
    chunk_images: int


def batch_size(inputs: Any) -> int:
    """Samples in ``inputs`` (``[V, B, ...]`` tensors, dicts of them, ``LazyViews``)."""
    if isinstance(inputs, torch.Tensor):
        return inputs.shape[1]
    if isinstance(inputs, LazyViews):
        return inputs.images.shape[0]
    return batch_size(next(iter(inputs.values())))


def sample_rows(inputs: Any, rows: slice) -> Any:
    """Samples ``rows`` of batch-major-second structures (``[V, B, ...]`` tensors, dicts)."""
    if isinstance(inputs, torch.Tensor):
        return inputs[:, rows]
    if isinstance(inputs, LazyViews):
        return inputs.rows(rows)
    if isinstance(inputs, dict):
        return {k: sample_rows(v, rows) for k, v in inputs.items()}
    raise TypeError(f"cannot slice per sample: {type(inputs).__name__}")
