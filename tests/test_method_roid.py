"""ROID (mura_plugin/methods/roid.py): the loss terms, weights and prior correction against
references written here from the official formulas, one step on the real tiny model against
a loss and gradient computed here, the weight ensembling, the augmentation, reset, seeds
and the reference harness's defaults."""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch
from method_runs import assert_params_at_snapshot, assert_reset_then_reseed_reproduces, build_method
from torch import nn

from mura_plugin.methods.roid import (
    ROID,
    ROIDConfig,
    minmax,
    prior_correction,
    roid_augment,
    roid_weights,
    soft_likelihood_ratio,
    symmetric_cross_entropy,
    update_class_probs,
)


# -- references written from the official formulas -----------------------------------------
def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _np_slr(z: np.ndarray) -> np.ndarray:
    q = np.clip(_softmax(z), 0.0, 0.99)
    return -(q * np.log(q / (1 - q) + 1e-5)).sum(axis=1)


def _np_sce(x: np.ndarray, ref: np.ndarray) -> np.ndarray:
    px, pr = _softmax(x), _softmax(ref)
    return -0.5 * (pr * np.log(px)).sum(axis=1) - 0.5 * (px * np.log(pr)).sum(axis=1)


def _np_weights(z: np.ndarray, ema: np.ndarray, temperature: float):
    p = _softmax(z)
    cos = (p @ ema) / (np.linalg.norm(p, axis=1) * np.linalg.norm(ema))
    div = 1 - cos
    div = (div - div.min()) / (div.max() - div.min())
    masked = div < div.mean()
    cert = (p * np.log(p)).sum(axis=1)  # = -entropy
    cert = (cert - cert.min()) / (cert.max() - cert.min())
    w = np.exp(div * cert / temperature)
    w[masked] = 0.0
    return w, ~masked


def _np_prior_correction(z: np.ndarray) -> np.ndarray:
    b, c = z.shape
    prior = _softmax(z).mean(axis=0)
    s = max(1 / b, 1 / c) / prior.max()
    return z * (prior + s) / (1 + s * c)


LOGITS = np.array(
    [[2.0, 0.5, -1.0], [0.1, 0.2, 0.0], [-1.0, 3.0, 0.5], [9.0, 0.0, -2.0], [0.0, 0.0, 1.5]]
)


# -- the loss terms --------------------------------------------------------------------------
def test_soft_likelihood_ratio_and_symmetric_cross_entropy_known_values():
    z = torch.tensor(LOGITS, dtype=torch.float64)
    assert _softmax(LOGITS)[3].max() > 0.99  # row 3 exercises the 0.99 clip
    np.testing.assert_allclose(soft_likelihood_ratio(z).numpy(), _np_slr(LOGITS), rtol=1e-12)
    other = LOGITS[::-1].copy() * 0.7
    got = symmetric_cross_entropy(z, torch.tensor(other, dtype=torch.float64)).numpy()
    np.testing.assert_allclose(got, _np_sce(LOGITS, other), rtol=1e-12)
    # by hand: two classes, p = (0.5, 0.5): -2 x 0.5 log(1 + 1e-5)
    got = float(soft_likelihood_ratio(torch.zeros(1, 2, dtype=torch.float64)))
    assert got == pytest.approx(-math.log(1 + 1e-5), rel=1e-9)


def test_certainty_diversity_weights_known_values():
    ema = np.array([0.5, 0.3, 0.2])
    z = torch.tensor(LOGITS, dtype=torch.float32)
    weights, keep = roid_weights(z, torch.tensor(ema, dtype=torch.float32), 1 / 3)
    expected_w, expected_keep = _np_weights(LOGITS, ema, 1 / 3)
    assert keep.tolist() == expected_keep.tolist()
    assert 0 < int(keep.sum()) < len(keep)  # the mask is not trivial here
    np.testing.assert_allclose(weights.numpy(), expected_w, rtol=1e-5, atol=1e-6)
    assert weights.max() > 2.0  # exp(d c / T) reaches well above 1
    # the moving average of the batch-mean probabilities
    got = update_class_probs(torch.tensor(ema), torch.tensor(_softmax(LOGITS)), 0.9)
    np.testing.assert_allclose(got.numpy(), 0.9 * ema + 0.1 * _softmax(LOGITS).mean(axis=0))


def test_equal_values_keep_every_sample_with_weight_one():
    """A batch of one (or of equal predictions): the official 0/0 would be NaN."""
    assert torch.equal(minmax(torch.tensor([0.3, 0.3])), torch.zeros(2))
    weights, keep = roid_weights(torch.tensor([[1.0, 2.0, 0.0]]), torch.full((3,), 1 / 3), 1 / 3)
    assert keep.tolist() == [True] and weights.tolist() == [1.0]


def test_prior_correction_known_values():
    # by hand: B = C = 2, p = (1/4, 3/4) for both rows: s = (1/2) / (3/4) = 2/3,
    # smoothed prior = (p + 2/3) / (1 + 4/3) = (11/28, 17/28)
    z = torch.tensor([[0.0, math.log(3.0)], [0.0, math.log(3.0)]])
    expected = z * torch.tensor([11 / 28, 17 / 28])
    torch.testing.assert_close(prior_correction(z), expected, rtol=1e-6, atol=1e-7)
    got = prior_correction(torch.tensor(LOGITS, dtype=torch.float32)).numpy()
    np.testing.assert_allclose(got, _np_prior_correction(LOGITS), rtol=1e-5, atol=1e-6)


# -- the augmentation ------------------------------------------------------------------------
def test_augmentation_is_shared_by_the_batch_and_seeded(batch):
    pair = torch.cat([batch[:1], batch[:1], batch[1:2]])
    out = roid_augment(pair, torch.Generator().manual_seed(3))
    assert out.shape == pair.shape and out.min() >= 0 and out.max() <= 1
    assert torch.equal(out[0], out[1])  # one draw for the whole batch
    again = roid_augment(pair, torch.Generator().manual_seed(3))
    assert torch.equal(out, again)
    other = roid_augment(pair, torch.Generator().manual_seed(4))
    assert not torch.equal(out, other)
    assert (out - pair).abs().mean() > 0.01  # it changes the images


# -- the method on the real tiny model ---------------------------------------------------------
def _ref_weights(z: torch.Tensor, ema: torch.Tensor, temperature: float):
    w, keep = _np_weights(z.detach().double().numpy(), ema.double().numpy(), temperature)
    return torch.tensor(w, dtype=torch.float32), torch.tensor(keep)


def _ref_sce(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    px, pr = x.softmax(1), ref.softmax(1)
    return -0.5 * (pr * px.log()).sum(1) - 0.5 * (px * pr.log()).sum(1)


def _ref_slr(z: torch.Tensor) -> torch.Tensor:
    q = z.softmax(1).clamp(0, 0.99)
    return -(q * torch.log(q / (1 - q) + 1e-5)).sum(1)


def test_one_step_is_sgd_on_the_weighted_loss_and_predicts_before_it(classifier, batch):
    """Written from roid.py's ``loss_calculation``: SGD (no momentum) with
    momentum_src = 1 moves the LayerNorms by -lr x the gradient of
    ``(sum w SLR + sum_kept w SCE(aug, z)) / B``; the prediction is the forward before the
    update, prior-corrected; ``pbar`` moves to 0.9 uniform + 0.1 batch mean."""
    lr, seed = 0.05, 11
    method = build_method(ROID, classifier, optimizer="sgd", lr=lr, momentum=0.0, momentum_src=1.0)
    ref = copy.deepcopy(classifier)
    params = [
        p for m in ref.visual.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()
    ]
    for p in params:
        p.requires_grad_(True)
    z = ref(batch)
    uniform = torch.full((classifier.num_classes,), 1 / classifier.num_classes)
    w, keep = _ref_weights(z, uniform, 1 / 3)
    assert 0 < int(keep.sum()) < len(batch)
    aug = roid_augment(batch[keep], torch.Generator().manual_seed(seed))
    loss = (w * _ref_slr(z)).sum() / len(batch)
    loss = loss + (w[keep] * _ref_sce(ref(aug), z[keep])).sum() / len(batch)
    grads = torch.autograd.grad(loss, params)
    expected = [(p - lr * g).detach() for p, g in zip(params, grads)]

    method.reseed(seed)
    out = method.step(batch)
    torch.testing.assert_close(method.last_loss, loss.detach(), rtol=1e-5, atol=1e-6)
    assert len(method.params) == len(params)
    for got, want in zip(method.params, expected):
        torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(p, q) for p, q in zip(method.params, params))
    want_out = torch.tensor(_np_prior_correction(z.detach().double().numpy()), dtype=torch.float32)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    probs = z.detach().softmax(1).mean(0)
    torch.testing.assert_close(method.class_probs, 0.9 * uniform + 0.1 * probs)


def test_weight_ensembling_pulls_toward_the_source(classifier, batch):
    """theta <- 0.99 theta' + 0.01 theta_source after the optimiser step theta -> theta'."""
    plain = build_method(ROID, classifier, momentum_src=1.0)
    ensembled = build_method(ROID, classifier)
    for m in (plain, ensembled):
        m.reseed(2)
        m.step(batch)
    for p, q, src in zip(ensembled.params, plain.params, ensembled.source_params):
        torch.testing.assert_close(p.detach(), 0.99 * q.detach() + 0.01 * src, rtol=0, atol=1e-7)
    gap = max(float((p - q).detach().abs().max()) for p, q in zip(ensembled.params, plain.params))
    assert gap > 1e-6  # well above the tolerance


def test_loss_normaliser_is_the_first_batch_and_predict_changes_nothing(classifier, batch):
    method = build_method(ROID, classifier)
    method.reseed(0)
    method.step(batch)
    method.step(batch[:2])  # a short last batch keeps N = 4
    assert method.loss_batch_size == 4 == method.resolved_settings()["loss_batch_size"]
    state = [p.detach().clone() for p in method.params], method.class_probs.clone()
    got = method.predict(batch)
    with torch.no_grad():
        torch.testing.assert_close(got, prior_correction(method.model(batch)))
    assert all(torch.equal(p, q) for p, q in zip(method.params, state[0]))
    assert torch.equal(method.class_probs, state[1])
    raw = build_method(ROID, classifier, use_prior_correction=False, use_weighting=False)
    raw.reseed(0)
    with torch.no_grad():
        expected = raw.model(batch)
    torch.testing.assert_close(raw.step(batch), expected)
    assert math.isfinite(float(raw.last_loss))


def test_reset_and_seeds_reproduce(classifier, batch):
    def build():
        return build_method(ROID, classifier)

    fresh, used, _ = assert_reset_then_reseed_reproduces(build, batch)
    used.reset()
    assert_params_at_snapshot(used)
    assert torch.equal(used.class_probs, torch.full((10,), 0.1))
    assert used.loss_batch_size is None
    other = build()  # fresh stepped after reseed(5); another seed draws other views
    other.reseed(4)
    other.step(batch)
    assert any(not torch.equal(p, q) for p, q in zip(fresh.params, other.params))


def test_reference_defaults_and_class_attributes():
    cfg = ROIDConfig()
    expected = dict(
        loss=None, optimizer="adam", lr=1e-3, weight_decay=0.0, steps=1, precision="fp32",
        use_weighting=True, use_consistency=True, use_prior_correction=True,
        momentum_src=0.99, momentum_probs=0.9, temperature=1 / 3, grad_scale=None,
    )  # fmt: skip
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert ROID.adapts and not ROID.light and ROID.stream_kind is None
    with pytest.raises(ValueError):
        ROID(None, dataclasses.replace(cfg, momentum_src=1.5))
