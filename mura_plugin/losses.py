"""Label-free test-time losses.

Contract (tta_bench.losses): ``fn(logits, **context) -> Tensor[B]``, one value per sample,
pure and differentiable. ``logits`` is ``[B, C]`` or ``[V, B, C]`` (V views of each of B
samples; the original image, when a method includes it, is view 0). Context a loss may need
(e.g. ``features [V, B, D]``) comes as keywords; a loss ignores context it does not use.
All values are in nats and computed in float32 whatever the input dtype (bf16 autocast).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = [
    "entropy",
    "info_max",
    "marginal_entropy",
    "weighted_entropy",
    "consistency",
    "select_confident",
    "view_entropy",
]


def view_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy of the softmax of the last axis: ``[..., C] -> [...]`` (float32)."""
    logp = logits.float().log_softmax(dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def _as_views(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() == 2:
        return logits.unsqueeze(0)
    if logits.dim() == 3:
        return logits
    raise ValueError(f"logits must be [B, C] or [V, B, C], got shape {tuple(logits.shape)}")


def select_confident(logits: torch.Tensor, top: float) -> torch.Tensor:
    """The ``max(1, int(V * top))`` lowest-entropy views of each sample (TPT's confidence
    selection): ``[V, B, C] -> [k, B, C]``, most confident first."""
    if not 0.0 < top <= 1.0:
        raise ValueError(f"top must be in (0, 1], got {top}")
    views = _as_views(logits)
    k = max(1, int(views.shape[0] * top))
    order = view_entropy(views).detach().argsort(dim=0)[:k]  # [k, B]
    return views.gather(0, order.unsqueeze(-1).expand(k, *views.shape[1:]))


def entropy(logits: torch.Tensor, **_: object) -> torch.Tensor:
    """Shannon entropy of each sample's prediction (mean over views if ``[V, B, C]``)."""
    return view_entropy(_as_views(logits)).mean(dim=0)


def info_max(logits: torch.Tensor, **_: object) -> torch.Tensor:
    """Information maximisation (SHOT, Liang et al. 2020): per-sample entropy minus the
    entropy of the batch-mean prediction. The second term is shared by the batch (added to
    every sample), so the mean loss is ``E[H(p_i)] - H(E[p_i])``: confident *and* diverse
    predictions, which keeps plain entropy minimisation from collapsing onto one class."""
    flat = logits.reshape(-1, logits.shape[-1])
    mean_p = flat.float().softmax(dim=-1).mean(dim=0)
    marginal = -(mean_p * torch.log(mean_p.clamp_min(1e-12))).sum()
    return entropy(logits) - marginal


def marginal_entropy(logits: torch.Tensor, *, top: float = 0.1, **_: object) -> torch.Tensor:
    """TPT's objective: entropy of the mean prediction of each sample's ``top`` fraction of
    lowest-entropy views (at least one). ``[B, C]`` input is one view: plain entropy."""
    kept = select_confident(logits, top).float()
    # log of the mean probability over the kept views, computed stably in log space
    log_mean = kept.log_softmax(dim=-1).logsumexp(dim=0) - math.log(kept.shape[0])
    return -(log_mean.exp() * log_mean).sum(dim=-1)


def weighted_entropy(logits: torch.Tensor, *, margin: float = 0.4, **_: object) -> torch.Tensor:
    """TTL's confidence-weighted entropy: per-view entropy ``H_v`` times the detached
    coefficient ``exp(-(H_v - margin))`` (confident views weigh more), averaged over views."""
    h = view_entropy(_as_views(logits))
    return (torch.exp(-(h.detach() - margin)) * h).mean(dim=0)


def consistency(
    logits: torch.Tensor, *, features: torch.Tensor | None = None, **_: object
) -> torch.Tensor:
    """Negative cosine similarity of the image features of augmented views of a sample,
    ``features [V >= 2, B, D]``, averaged over consecutive view pairs."""
    del logits
    if features is None or features.dim() != 3 or features.shape[0] < 2:
        shape = None if features is None else tuple(features.shape)
        raise ValueError(
            f"consistency needs features=[V >= 2, B, D] of augmented views, got {shape}"
        )
    f = F.normalize(features.float(), dim=-1)
    return -(f[:-1] * f[1:]).sum(dim=-1).mean(dim=0)
