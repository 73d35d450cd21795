"""Known-value tests of the label-free losses (mura_plugin.losses)."""

from __future__ import annotations

import math

import pytest
import torch

from mura_plugin import losses
from tta_bench.registry import registry

NAMES = ["entropy", "info_max", "marginal_entropy", "weighted_entropy", "consistency"]


def test_all_losses_registered():
    reg = registry("losses")
    for name in NAMES:
        assert reg.get(name) is getattr(losses, name)


def test_uniform_and_one_hot_values():
    c = 10
    uniform = torch.zeros(3, 4, c)  # [V, B, C]
    one_hot = torch.full((3, 4, c), -1e4)
    one_hot[..., 2] = 0.0
    log_c = math.log(c)
    for name in ("entropy", "marginal_entropy"):
        fn = getattr(losses, name)
        assert torch.allclose(fn(uniform), torch.full((4,), log_c))
        assert torch.allclose(fn(one_hot), torch.zeros(4), atol=1e-6)
    assert torch.allclose(
        losses.weighted_entropy(uniform), torch.full((4,), math.exp(-(log_c - 0.4)) * log_c)
    )
    assert torch.allclose(losses.weighted_entropy(one_hot), torch.zeros(4), atol=1e-6)
    # uniform: H(p_i) = H(mean p) = log C -> 0; identical one-hots: 0 - 0
    assert torch.allclose(losses.info_max(uniform), torch.zeros(4), atol=1e-6)


def test_hand_computed_entropy_and_shapes():
    # p = softmax([0, ln 3]) = [1/4, 3/4]
    logits = torch.tensor([[0.0, math.log(3.0)]])
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert losses.entropy(logits).shape == (1,)
    assert losses.entropy(logits).item() == pytest.approx(h, abs=1e-6)
    assert losses.weighted_entropy(logits).item() == pytest.approx(
        math.exp(-(h - 0.4)) * h, abs=1e-6
    )
    # info_max over a batch of two mirrored predictions: H(p_i) - H([1/2, 1/2])
    pair = torch.tensor([[0.0, math.log(3.0)], [math.log(3.0), 0.0]])
    assert torch.allclose(losses.info_max(pair), torch.full((2,), h - math.log(2)), atol=1e-6)


def test_marginal_entropy_keeps_the_confident_views():
    # views of one sample: confident on class 0, confident on class 1, uniform
    big = 50.0
    logits = torch.tensor([[[big, 0.0]], [[0.0, big]], [[0.0, 0.0]]])  # [3, 1, 2]
    # keep int(3 * 0.67) = 2 views: the two confident ones; their mean is [1/2, 1/2]
    assert losses.marginal_entropy(logits, top=0.67).item() == pytest.approx(math.log(2), 1e-5)
    # keep 1 view (the most confident one): entropy ~ 0
    assert losses.marginal_entropy(logits, top=0.1).item() == pytest.approx(0.0, abs=1e-6)
    kept = losses.select_confident(logits, 0.34)
    assert kept.shape == (1, 1, 2)
    with pytest.raises(ValueError, match="top must be"):
        losses.marginal_entropy(logits, top=0.0)


def test_weighted_entropy_coefficient_is_detached():
    logits = torch.tensor([[[0.3, -0.2, 1.0]], [[2.0, 0.1, -1.0]]], requires_grad=True)
    losses.weighted_entropy(logits).sum().backward()
    ref = logits.detach().clone().requires_grad_(True)
    h = losses.view_entropy(ref)
    coef = torch.exp(-(h.detach() - 0.4))
    (coef * h).mean(dim=0).sum().backward()
    assert torch.allclose(logits.grad, ref.grad, atol=1e-7)


def test_consistency_values_and_errors():
    f = torch.randn(1, 5, 8)
    same = torch.cat([f, f * 3.0])  # parallel features: cosine 1
    assert torch.allclose(losses.consistency(None, features=same), torch.full((5,), -1.0))
    ortho = torch.zeros(2, 1, 4)
    ortho[0, 0, 0] = 1.0
    ortho[1, 0, 1] = 1.0
    assert losses.consistency(None, features=ortho).item() == pytest.approx(0.0)
    with pytest.raises(ValueError, match="consistency needs"):
        losses.consistency(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"\[B, C\] or \[V, B, C\]"):
        losses.entropy(torch.zeros(1, 2, 3, 4))
