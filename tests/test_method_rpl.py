"""RPL (mura_plugin/methods/rpl.py): the generalised cross-entropy against values and a
gradient written from its definition, one step on the real tiny model against a separately
written Adam (and Nesterov SGD) step on the LayerNorm affine parameters, reset and seeds,
and the reference harness's cifar10_c defaults."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from method_runs import assert_reset_then_reseed_reproduces, assert_same_seeded_steps, build_method
from torch import nn

from mura_plugin.methods.rpl import RPL, generalized_cross_entropy


def _gce_reference(logits: list[list[float]], q: float) -> list[float]:
    """Plain Python from the definition: p = softmax(z), y = argmax z, (1 - p_y^q) / q."""
    out = []
    for z in logits:
        e = [math.exp(x) for x in z]
        y = max(range(len(z)), key=lambda c: z[c])
        p = e[y] / sum(e)
        out.append((1 - p**q) / q)
    return out


def test_gce_known_values():
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 3.0], [0.5, -1.0, 0.4]])
    got = generalized_cross_entropy(logits, 0.8)
    expected = torch.tensor(_gce_reference(logits.tolist(), 0.8))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # the first by hand: p = e^2 / (e^2 + 2) = 0.786986, p^0.8 = 0.825607, GCE = 0.217991
    p = math.exp(2) / (math.exp(2) + 2)
    assert abs(float(got[0]) - (1 - p**0.8) / 0.8) < 1e-6
    assert abs(float(got[0]) - 0.2179906) < 1e-6
    # the limits: q = 1 is 1 - p_y; q -> 0 is the cross-entropy -ln p_y
    probs = logits.softmax(1).max(1).values
    torch.testing.assert_close(generalized_cross_entropy(logits, 1.0), 1 - probs)
    torch.testing.assert_close(
        generalized_cross_entropy(logits, 1e-4), -probs.log(), rtol=0, atol=1e-3
    )
    # given targets instead of the pseudo-labels
    targets = torch.tensor([1, 0, 2])
    p_t = logits.softmax(1).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(
        generalized_cross_entropy(logits, 0.5, targets), (1 - p_t.sqrt()) / 0.5
    )


def test_gce_gradient_treats_the_pseudo_label_as_a_constant():
    """d/dz (1 - p_y^q) / q = -p_y^q (e_y - p): the label is fixed, only p_y moves."""
    z = torch.tensor([[1.0, 2.0, -0.5, 0.3], [0.2, -1.0, 0.1, 0.0]], requires_grad=True)
    q = 0.8
    generalized_cross_entropy(z, q).sum().backward()
    p = z.detach().softmax(1)
    y = p.argmax(1)
    onehot = nn.functional.one_hot(y, 4).float()
    p_y = p.gather(1, y[:, None])
    torch.testing.assert_close(z.grad, -(p_y**q) * (onehot - p), rtol=0, atol=1e-6)


def _reference_step(classifier, images, optimizer: str, lr: float):
    """One update written out on a copy of the model: GCE (q 0.8) of the batch mean against
    the argmax labels, over every LayerNorm affine parameter of the image tower; Adam's
    first step is lr * g / (|g| + eps), Nesterov SGD's (momentum 0.9) is 1.9 lr g."""
    ref = copy.deepcopy(classifier)
    params = [
        p for m in ref.visual.modules() if isinstance(m, nn.LayerNorm) for p in (m.weight, m.bias)
    ]
    for p in params:
        p.requires_grad_(True)
    logits = ref(images)
    probs = logits.softmax(1)
    p_y = probs.gather(1, probs.argmax(1, keepdim=True))[:, 0]
    loss = ((1 - p_y**0.8) / 0.8).mean()
    grads = torch.autograd.grad(loss, params)
    with torch.no_grad():
        if optimizer == "adam":
            new = [p - lr * g / (g.abs() + 1e-8) for p, g in zip(params, grads)]
        else:
            new = [p - 1.9 * lr * g for p, g in zip(params, grads)]
    return logits.detach(), loss.detach(), new


@pytest.mark.parametrize(("optimizer", "lr"), [("adam", 1e-3), ("sgd", 5e-4)])
def test_one_step_on_the_real_model(classifier, batch, optimizer, lr):
    method = build_method(RPL, classifier, optimizer=optimizer, lr=lr)
    assert len(method.params) == 20  # ln_pre, 4 blocks x (ln_1, ln_2), ln_post; weight + bias
    logits, loss, new = _reference_step(classifier, batch, optimizer, lr)
    out = method.step(batch)
    # the batch is predicted by the forward that adapted (before the update)
    torch.testing.assert_close(out, logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(method.last_loss, loss, rtol=0, atol=1e-6)
    for p, expected in zip(method.params, new):
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6)
    saved = method._snapshot["params"]
    moved = max(float((p.detach() - s).abs().max()) for p, s in zip(method.params, saved))
    assert moved > 1e-5
    # the next batch sees the adapted model
    assert float((method.step(batch) - logits).abs().max()) > 1e-4


def test_reset_then_reseed_reproduces_and_seeds(classifier, batch, noisy_images):
    fresh, used, expected = assert_reset_then_reseed_reproduces(
        lambda: build_method(RPL, classifier), noisy_images
    )
    assert_same_seeded_steps(fresh, used, batch, seed=2, atol=0)


def test_only_layer_norm_affine_of_the_image_tower_adapts(classifier):
    method = build_method(RPL, classifier)
    norms = {
        id(p)
        for m in method.model.visual.modules()
        if isinstance(m, nn.LayerNorm)
        for p in (m.weight, m.bias)
    }
    assert {id(p) for p in method.params} == norms
    assert all(p.requires_grad == (id(p) in norms) for p in method.model.parameters())
    with pytest.raises(ValueError, match="momentum > 0"):
        build_method(RPL, classifier, optimizer="sgd", momentum=0.0)


def test_defaults_are_the_reference_cifar10_c_setting():
    cfg = RPL.Config()
    expected = dict(
        q=0.8,  # RPL.Q
        loss=None,
        optimizer="adam",
        lr=1e-3,
        weight_decay=0.0,
        momentum=0.9,
        nesterov=True,
        steps=1,
        precision="fp32",
        grad_scale=None,
    )
    for name, value in expected.items():
        assert getattr(cfg, name) == value, name
    assert RPL.stream_kind is None
    assert RPL.predict_from_last_forward
