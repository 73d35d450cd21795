"""Loss scaling per episode for the multi-view methods' fp16 steps.

TPT's and TTL's official code trains under fp16 autocast with
``torch.cuda.amp.GradScaler(init_scale=1000)``, which keeps small fp16 gradients from
flushing to zero. ``LossScaler`` applies the same rule (scale the loss, unscale the
gradients, skip a step whose gradients are not finite and halve the scale, double it after
2,000 finite steps) whenever a method runs fp16 on CUDA (``grad_scale``, None = off).
torch's GradScaler decides per optimiser, so in batched episodes one overflowing sample
would skip every sample's step; ``LossScaler`` decides per episode (a skipped episode keeps
its parameters and optimiser state: ``step_rows``) and updates the scale once per episode
in sample order, as the sequential loop would. What remains different there: all samples
of a batch run with the scale of the batch's start, and with several steps a skipped
episode continues with the others' Adam step count.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["LossScaler", "step_rows"]


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


@torch.no_grad()
def step_rows(optimizer: torch.optim.Optimizer, copies: list[torch.Tensor], skip: torch.Tensor):
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
