"""The batched per-sample episodes of ``MultiViewMethod`` (``episodic=sample`` with
``episode_batching``; see ``_episodes``): each sample of a group gets its own copy of the
episode parameters, one forward/backward covers the group's views, and one optimiser step
on the sum of the per-sample losses updates every copy from its own loss only. The groups
follow the view memory budget's chunks (``_budget_groups``); parameters that persist
across episodes (MuRA's router) take one step per batch from every group's gradient, the
groups' adapted copies waiting for it (``WaitingCopies``) or their episodes running again
after it (``_replay_episodes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mura_plugin.methods._loss_scaler import step_rows
from mura_plugin.methods._view_budget import COPIES_WAIT, BatchViews, WaitingCopies, sample_rows
from tta_bench.method import build_optimizer, release_optimizer

__all__ = ["SEPARABLE_LOSSES", "BatchedEpisodes"]

#: Losses whose value for sample i depends on sample i's views only: batched episodes are
#: exact for them. Others (info_max's batch marginal, unknown plugin losses) run the
#: sequential loop, where each episode sees only its own sample.
SEPARABLE_LOSSES = ("entropy", "marginal_entropy", "weighted_entropy", "consistency")


@dataclass
class _GroupRun:
    """A batch's episodes run group by group (``run_episodes``): the images, their encoded
    views, the groups, the samples per forward/backward, whether the shared parameters'
    one step waits for every group (``defer``) and where the adapted copies wait then
    (None: nowhere, the episodes run again after the step)."""

    images: torch.Tensor
    inputs: Any
    groups: list[slice]
    per_chunk: int
    defer: bool
    waiting: WaitingCopies | None


class BatchedEpisodes:
    """The batched-episode loop of ``MultiViewMethod`` (a mixin: it uses the method's
    ``config``, ``params``, ``optimizer``, ``loss_scaler``, ``_episode_index``, ``timed``,
    ``autocast``, ``view_loss``, ``predict_episode``, ``_predict_chunks``,
    ``_predict_inputs`` and ``_step_shared``). A method that supports it implements the
    hooks below."""

    # -- hooks ---------------------------------------------------------------------------
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

    def episode_groups(self, n: int) -> list[slice] | None:
        """The groups of samples whose episodes must run together, one group after the
        other, where the budget's groups (``_budget_groups``, None) do not do: one group
        (the whole batch) when shared parameters take several steps between episodes (the
        router of MuRA with ``steps > 1``: each step needs every sample's gradient)."""
        if self.has_persistent_parameters() and self.config.steps > 1:
            return [slice(0, n)]
        return None

    # -- the loop ------------------------------------------------------------------------
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

    def _shared_parameters(self) -> list[torch.Tensor]:
        """The adapted parameters that persist across episodes (not ``_episode_index``)."""
        episode = set(self._episode_index)
        return [p for i, p in enumerate(self.params) if i not in episode]

    def _episode_chunk(self, chunk_images: int) -> int:
        """Samples per forward/backward of batched episodes: ``chunk_views`` worth of
        views, and no more than ``chunk_images``, the budget's (``view_inputs``)."""
        cfg = self.config
        views = cfg.views + int(cfg.include_original)
        return min(max(1, cfg.chunk_views // views), chunk_images)

    def _budget_groups(self, n: int, chunk_images: int) -> list[slice]:
        """The groups of samples whose episodes run together, one group after the other:
        the budget's chunks of ``chunk_images`` images (``view_inputs``), rounded to whole
        forward chunks (``_episode_chunk``), so that the per-sample adapter copies, their
        gradients and optimiser state do not grow with the batch."""
        per_chunk = self._episode_chunk(chunk_images)
        size = max(per_chunk, chunk_images // per_chunk * per_chunk)
        return [slice(s, min(n, s + size)) for s in range(0, n, size)]

    def _episode_backward(self, inputs: Any, n: int, per_chunk: int) -> torch.Tensor:
        """Forward/backward of ``n`` parallel episodes over chunks of ``per_chunk`` whole
        samples (``_episode_chunk``): sample i's copy gets sample i's gradient only, shared
        parameters the sum. Returns the per-sample losses (detached)."""
        losses = []
        for start in range(0, n, per_chunk):
            rows = slice(start, min(n, start + per_chunk))
            self.loss_rows = start
            with torch.enable_grad(), self.autocast():
                self.select_episodes(rows)
                per_sample = self.view_loss(sample_rows(inputs, rows))[0]
            (per_sample.sum() * self.loss_scaler.scale).backward()
            losses.append(per_sample.detach())
        self.select_episodes(slice(0, n))
        self.loss_rows = None
        return torch.cat(losses)

    def adapt_episodes(
        self, inputs: Any, n: int, *, per_chunk: int, defer_shared: bool = False
    ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """``config.steps`` steps of ``n`` parallel episodes (see the module docstring); the
        per-sample copies stay active for ``predict_episode`` until ``end_episodes()``.
        Each step runs forward/backward over chunks of ``per_chunk`` whole samples
        (``_episode_chunk``) and accumulates the gradients of the summed per-sample losses
        before stepping. With ``defer_shared`` (one step, persistent parameters,
        ``run_episodes``' groups) only the copies step: the shared parameters' gradients
        are left to accumulate over the groups, and their unscaling, step and the scaler's
        update are the caller's. Returns the copies, the last step's per-episode skips and
        per-sample losses."""
        cfg = self.config
        copies = self.begin_episodes(n)
        episode_opt = build_optimizer(copies, cfg)  # fresh state per episode
        persistent = self.has_persistent_parameters() and not defer_shared
        for index in range(cfg.steps):
            self.step_index = index
            episode_opt.zero_grad(set_to_none=True)
            if not defer_shared:
                self.optimizer.zero_grad(set_to_none=True)
            losses = self._episode_backward(inputs, n, per_chunk)
            skipped = self.loss_scaler.unscale(copies, episodes=n)
            if persistent:
                shared = self.loss_scaler.unscale(self.params)
                skipped = skipped | shared
            step_rows(episode_opt, copies, skip=skipped)
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

    def run_episodes(self, images: torch.Tensor, views: BatchViews) -> torch.Tensor:
        """Logits of the batch's per-sample episodes, run in parallel group by group
        (``episode_groups``, else ``_budget_groups``): a group adapts, is predicted and
        drops its copies before the next one starts. Shared parameters that persist across
        episodes (one step per batch on the summed per-sample losses) step once all groups
        have added their gradients, and each group is predicted after that step, as in one
        whole-batch group; until then the groups' adapted copies (values only) wait where
        ``copies_wait()`` says: in a temporary file (the default: memory holds one group's
        copies at any batch size), in memory, or nowhere, each group's episodes then
        running again after the step from the shared values they first saw
        (``_replay_episodes``: twice the adaptation's compute). The same computation as
        ``adapt_episodes`` on the whole batch, whichever."""
        inputs, chunk_images = views
        n = images.shape[0]
        groups = self.episode_groups(n) or self._budget_groups(n, chunk_images)
        per_chunk = self._episode_chunk(chunk_images)
        if len(groups) == 1:
            try:
                with self.timed("adapt"):
                    self.adapt_episodes(inputs, n, per_chunk=per_chunk)
                with self.timed("predict"):
                    return self._predict_chunks(images, views, episodes=True)
            finally:
                self.end_episodes()
        defer = self.has_persistent_parameters()  # then one step (``episode_groups``)
        where = self.copies_wait() if defer else "recompute"
        waiting = None if where == "recompute" else WaitingCopies(where, n)
        run = _GroupRun(images, inputs, groups, per_chunk, defer, waiting)
        try:
            return self._run_groups(run)
        finally:
            if waiting is not None:
                #: bytes the last batch's copies took where they waited (benchmarks)
                self.copies_waited = (where, waiting.nbytes)
                waiting.close()

    def _run_groups(self, run: _GroupRun) -> torch.Tensor:
        """``run_episodes`` over several groups (see there): every group adapts, and is
        predicted at once unless the shared parameters' step is deferred (``run.defer``);
        then that step follows and each group is predicted after it (``_restored_group``)."""
        if run.defer:
            self.optimizer.zero_grad(set_to_none=True)
            shared = self._shared_parameters()
            before = [p.detach().clone() for p in shared]
        n = run.images.shape[0]
        skips = torch.zeros(n, dtype=torch.bool, device=self.device)
        out, losses = self._adapt_groups(run, skips)
        if run.defer:
            with self.timed("adapt"):
                stepped = self._step_shared(skips)  # a skipped step keeps the copies as set
            replay = None
            if stepped and run.waiting is None:
                replay = (shared, before, [p.detach().clone() for p in shared])
            source = run.waiting if stepped else None
            for rows in run.groups:
                try:
                    part = self._restored_group(run, rows, source, replay)
                    with self.timed("predict"):
                        logits = self.predict_episode(run.images[rows], part)
                        out = _into(out, rows, n, logits)
                finally:
                    self.end_episodes()
                    part = None
        self.last_loss = None if losses is None else losses.mean()
        assert out is not None  # groups is never empty
        return out

    def _adapt_groups(
        self, run: _GroupRun, skips: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The groups' adaptation in ``_run_groups``: each group is predicted at once, or,
        with ``run.defer``, its skipped episodes are marked in ``skips`` and its adapted
        copies wait (``run.waiting``). Returns the logits (None with ``run.defer``) and the
        per-sample losses, in blocks ``[n, ...]``."""
        # per-sample results in blocks allocated once, not a small tensor per group: the
        # small blocks that outlive a group would otherwise pin the heap above the next
        # group's transient memory, and the step's peak would creep with the batch
        n = run.images.shape[0]
        out: torch.Tensor | None = None
        losses: torch.Tensor | None = None
        for rows in run.groups:
            part = sample_rows(run.inputs, rows)  # a LazyViews renders the group's views once
            try:
                with self.timed("adapt"):
                    copies, skipped, last = self.adapt_episodes(
                        part,
                        rows.stop - rows.start,
                        per_chunk=run.per_chunk,
                        defer_shared=run.defer,
                    )
                losses = _into(losses, rows, n, last)
                if run.defer:
                    skips[rows] = skipped
                    if run.waiting is not None:
                        run.waiting.put(rows, copies)
                else:
                    with self.timed("predict"):
                        out = _into(out, rows, n, self.predict_episode(run.images[rows], part))
            finally:
                self.end_episodes()
                # nothing of this group is alive while the next one's views are built
                part = copies = None
        return out, losses

    def _restored_group(
        self,
        run: _GroupRun,
        rows: slice,
        waiting: WaitingCopies | None,
        replay: tuple[list[torch.Tensor], ...] | None,
    ) -> Any:
        """Group ``rows``' adapted copies active again after the shared parameters' step,
        and its inputs for ``predict_episode``: with ``replay`` (the shared parameters,
        their values before and after the step) its episodes run again
        (``_replay_episodes``); else its copies are read back from ``waiting`` (None: the
        step was skipped, the copies stay as ``begin_episodes`` sets them)."""
        g = rows.stop - rows.start
        if replay is not None:
            part = sample_rows(run.inputs, rows)
            with self.timed("adapt"):
                self._replay_episodes(part, g, run.per_chunk, *replay)
            return part
        with self.timed("predict"):
            copies = self.begin_episodes(g)
            if waiting is not None:
                waiting.get(rows, copies)
        return self._predict_inputs(run.inputs, rows)

    def _replay_episodes(
        self,
        inputs: Any,
        n: int,
        per_chunk: int,
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
            self.adapt_episodes(inputs, n, per_chunk=per_chunk, defer_shared=True)
        finally:
            with torch.no_grad():
                for p, value, grad in zip(shared, after, grads):
                    p.copy_(value)
                    p.grad = grad


def _into(block: torch.Tensor | None, rows: slice, n: int, part: torch.Tensor) -> torch.Tensor:
    """``part`` written into rows ``rows`` of a ``[n, ...]`` block (made on first use)."""
    if block is None:
        block = part.new_empty((n, *part.shape[1:]))
    block[rows] = part
    return block
