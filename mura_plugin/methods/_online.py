"""What the online methods of the reference harness (mariodoebler/test-time-adaptation)
share, one job each: ``nesterov_groups``, the optimiser groups that ask torch's SGD for the
Nesterov momentum the harness's ``conf.py`` turns on by default (``build_optimizer`` has no
such option; MEMO and RPL use it), and ``symmetric_cross_entropy``, the harness's
``SymmetricCrossEntropy`` (ROID's consistency term; RMT's teacher loss on detached teacher
logits). Method files import these from here, never from each other's files."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["nesterov_groups", "symmetric_cross_entropy"]


def nesterov_groups(params: list[nn.Parameter], config: Any) -> list[Any]:
    """The optimiser's parameter groups: one group asking torch's SGD for Nesterov momentum
    when ``config`` says SGD with ``nesterov`` (the harness's conf.py default), else the
    parameters themselves."""
    if config.optimizer == "sgd" and config.nesterov:
        if config.momentum <= 0:
            raise ValueError("nesterov=true needs momentum > 0 (or set nesterov=false)")
        return [{"params": list(params), "nesterov": True}]
    return list(params)


def symmetric_cross_entropy(
    x: torch.Tensor, reference: torch.Tensor, alpha: float = 0.5
) -> torch.Tensor:
    """``-(1 - alpha) sum softmax(reference) log_softmax(x) - alpha sum softmax(x)
    log_softmax(reference)`` per sample ``[B]`` (gradient through both)."""
    forward = (reference.softmax(dim=1) * x.log_softmax(dim=1)).sum(dim=1)
    backward = (x.softmax(dim=1) * reference.log_softmax(dim=1)).sum(dim=1)
    return -(1.0 - alpha) * forward - alpha * backward
