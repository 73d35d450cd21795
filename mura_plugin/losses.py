"""Label-free test-time losses.

Contract (tta_bench.losses): ``fn(logits, **context) -> Tensor[B]``, one value per sample,
pure and differentiable. ``logits`` is ``[B, C]`` or ``[V, B, C]`` (V views of each of B
samples). Context a loss may need (e.g. ``features [V, B, D]``) comes as keywords; a loss
ignores context it does not use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["entropy", "info_max", "consistency"]


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = logits.float().log_softmax(dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def entropy(logits: torch.Tensor, **_: object) -> torch.Tensor:
    """Shannon entropy of each sample's prediction (mean over views if ``[V, B, C]``)."""
    h = _entropy(logits)
    return h.mean(dim=0) if logits.dim() == 3 else h


def info_max(logits: torch.Tensor, **_: object) -> torch.Tensor:
    """Information maximisation (SHOT, Liang et al. 2020): per-sample entropy minus the
    entropy of the batch-mean prediction. The second term is shared by the batch (added to
    every sample), so the mean loss is ``E[H(p_i)] - H(E[p_i])``: confident *and* diverse
    predictions, which keeps plain entropy minimisation from collapsing onto one class."""
    flat = logits.reshape(-1, logits.shape[-1])
    mean_p = flat.float().softmax(dim=-1).mean(dim=0)
    marginal = -(mean_p * torch.log(mean_p.clamp_min(1e-12))).sum()
    return entropy(logits) - marginal


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
