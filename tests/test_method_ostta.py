"""OSTTA (mura_plugin/methods/ostta.py): the confidence-gain filter and the loss against
hand-computed values and a numpy reference, the first and a later step on the real tiny ViT
against a recomputation with a frozen copy of the original model, the empty selection,
predict, reset, seeds, the own OOD score and the config's checks."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from method_runs import (
    assert_params_at_snapshot,
    assert_reset_then_reseed_reproduces,
    assert_same_seeded_steps,
    build_method,
)
from torch import nn

from mura_plugin.methods.ostta import (
    OSTTA,
    confidence_gain,
    mean_prediction_entropy,
    ostta_objective,
)


# -- the filter and the loss ---------------------------------------------------------------
def _np_softmax(z):
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _np_objective(logits, source_probs, margin, weight):
    """The official ``forward_and_adapt`` (criterion ``ent``) in numpy."""
    p = _np_softmax(logits)
    y0 = source_probs.argmax(axis=1)  # first index on ties, as torch.max
    gain = p[np.arange(len(p)), y0] - source_probs.max(axis=1)
    kept = gain >= margin
    entropy = -(p * np.log(p)).sum(axis=1)
    mean = p.mean(axis=0)
    loss = (entropy[kept].mean() if kept.any() else 0.0) + weight * (mean * np.log(mean)).sum()
    return loss, kept, gain


LOGITS = np.array([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
SOURCE = np.array([[0.5, 0.3, 0.2], [0.2, 0.7, 0.1], [0.4, 0.4, 0.2]])  # row 3: a tie


def test_confidence_gain_known_values():
    """Worked by hand: softmax(2, 0, -1)[0] = e^2 / (e^2 + 1 + e^-1) = 0.84379; softmax(0, 1,
    0)[1] = e / (e + 2) = 0.57612; softmax(1, 1, 0)[0] = e / (2e + 1) = 0.42232 (the source's
    tie goes to class 0)."""
    probs = torch.tensor(LOGITS).softmax(dim=1)
    gain = confidence_gain(probs, torch.tensor(SOURCE))
    expected = torch.tensor([0.84379 - 0.5, 0.57612 - 0.7, 0.42232 - 0.4], dtype=gain.dtype)
    torch.testing.assert_close(gain, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("margin", "weight", "kept"),
    [(0.0, 0.5, [True, False, True]), (0.05, 0.0, [True, False, False]), (1.0, 0.5, [False] * 3)],
)
def test_objective_matches_the_official_rule(margin, weight, kept):
    logits = torch.tensor(LOGITS, dtype=torch.float32, requires_grad=True)
    loss, mask, gain = ostta_objective(logits, torch.tensor(SOURCE), margin, weight)
    ref_loss, ref_kept, ref_gain = _np_objective(LOGITS, SOURCE, margin, weight)
    assert mask.tolist() == ref_kept.tolist() == kept
    np.testing.assert_allclose(gain.numpy(), ref_gain, rtol=0, atol=1e-6)
    np.testing.assert_allclose(float(loss.detach()), ref_loss, rtol=0, atol=1e-6)
    loss.backward()  # the filter is a constant: a gradient flows through the kept rows only
    dropped = ~mask
    if weight == 0.0 and dropped.any():
        assert torch.all(logits.grad[dropped] == 0)


def test_mean_prediction_entropy_known_value():
    uniform = torch.zeros(2, 4)
    torch.testing.assert_close(mean_prediction_entropy(uniform), torch.tensor(np.log(4.0)).float())
    one_hot = torch.tensor([[50.0, 0.0], [50.0, 0.0]])
    assert float(mean_prediction_entropy(one_hot)) < 1e-12  # clamped log: no NaN at p = 0


# -- the method on the real tiny ViT -------------------------------------------------------
def test_defaults_are_the_official_values():
    cfg = OSTTA.Config()
    assert (cfg.optimizer, cfg.lr, cfg.weight_decay, cfg.steps, cfg.precision) == (
        "adam", 1e-3, 0.0, 1, "fp32"
    )  # fmt: skip
    assert (cfg.diversity_weight, cfg.margin) == (0.5, 0.0)
    assert OSTTA.adapts and OSTTA.stream_kind is None and OSTTA.scores_are_logits
    assert OSTTA.own_ood_score


def _norm_params(model):
    return [
        p for m in model.visual.modules() if isinstance(m, nn.LayerNorm) for p in (m.weight, m.bias)
    ]


def _reference_step(adapted, original, images, lr, margin=0.0, weight=0.5):
    """One SGD step of the official rule on ``adapted`` (a classifier copy), the original
    model ``original`` frozen but, as the official ``model0`` (a copy of the configured model
    run under ``enable_grad``), with trainable norm parameters, so both forwards take the same
    kernels: (logits before the step, gain, kept, loss, new parameters)."""
    params = _norm_params(adapted)
    original = copy.deepcopy(original)  # as the official model0: norm parameters trainable
    with torch.enable_grad():
        for p in params + _norm_params(original):
            p.requires_grad_(True)
        source = original(images).detach().softmax(dim=1)
        logits = adapted(images)
        p_a = logits.softmax(dim=1)
        y0 = source.argmax(dim=1)
        gain = p_a.detach()[torch.arange(len(y0)), y0] - source.max(dim=1).values
        kept = gain >= margin
        log_p = logits.log_softmax(dim=1)
        entropy = -(log_p.exp() * log_p).sum(dim=1)
        mean = p_a.mean(dim=0)
        term = entropy[kept].mean() if kept.any() else logits.sum() * 0
        loss = term + weight * torch.special.xlogy(mean, mean).sum()
        grads = torch.autograd.grad(loss, params)
    new = [p.detach() - lr * g for p, g in zip(params, grads)]
    return logits.detach(), gain, kept, loss.detach(), new


def test_first_step_keeps_everything_and_is_the_reference_update(classifier, batch):
    lr = 0.5
    method = build_method(OSTTA, classifier, optimizer="sgd", momentum=0.0, lr=lr)
    assert [p.shape for p in method.params] == [p.shape for p in _norm_params(classifier)]
    logits, gain, kept, loss, new = _reference_step(
        copy.deepcopy(classifier), classifier, batch, lr
    )
    assert bool(kept.all()) and torch.all(gain == 0)
    out = method.step(batch)
    torch.testing.assert_close(out, logits, rtol=0, atol=1e-5)  # the forward before the step
    assert method.last_ood_score.shape == (4,) and torch.all(method.last_ood_score == 0)
    torch.testing.assert_close(method.last_loss, loss, rtol=0, atol=1e-6)
    for p, expected in zip(method.params, new):
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6)
    assert method.counts == {"seen": 4, "kept": 4}
    assert any(not torch.equal(p, s) for p, s in zip(method.params, method._snapshot["params"]))


def test_later_step_filters_by_the_gain_over_the_original_model(classifier, noisy_images):
    """After one large step the adapted model loses confidence on some samples: those are
    dropped, the rest give the entropy term; the gain is the own OOD score."""
    lr = 2.0
    method = build_method(OSTTA, classifier, optimizer="sgd", momentum=0.0, lr=lr)
    method.step(noisy_images)
    adapted = copy.deepcopy(method.model)
    logits, gain, kept, loss, new = _reference_step(adapted, classifier, noisy_images, lr)
    assert 0 < int(kept.sum()) < len(kept)  # the filter bites both ways on this batch
    out = method.step(noisy_images)
    torch.testing.assert_close(out, logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(method.last_ood_score, gain, rtol=0, atol=1e-6)
    torch.testing.assert_close(method.last_loss, loss, rtol=0, atol=1e-5)
    for p, expected in zip(method.params, new):
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-5)
    assert method.counts == {"seen": 12, "kept": 6 + int(kept.sum())}


def test_no_kept_sample_and_no_diversity_leaves_the_model(classifier, batch):
    """margin 1 keeps nothing (a gain is below 1 - c0 < 1): the entropy term is 0 with zero
    gradient (officially NaN), so with no diversity term Adam does not move."""
    method = build_method(OSTTA, classifier, margin=1.0, diversity_weight=0.0)
    method.step(batch)
    assert method.counts["kept"] == 0 and float(method.last_loss) == 0.0
    assert_params_at_snapshot(method)


def test_predict_scores_without_adapting(classifier, batch):
    method = build_method(OSTTA, classifier, lr=0.05)
    method.step(batch)
    before = [p.detach().clone() for p in method.params]
    out = method.predict(batch)
    assert all(torch.equal(p, b) for p, b in zip(method.params, before))
    with torch.no_grad():
        expected = method.model(batch)
        source = classifier(batch).softmax(dim=1)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    gain = confidence_gain(expected.softmax(dim=1), source)
    torch.testing.assert_close(method.last_ood_score, gain, rtol=0, atol=1e-6)
    assert method.last_ood_score.shape == (4,) and not method.last_ood_score.requires_grad


def test_reset_and_seeds(classifier, batch):
    build = lambda: build_method(OSTTA, classifier, lr=0.05)  # noqa: E731
    fresh, used, _ = assert_reset_then_reseed_reproduces(build, batch)
    assert used.counts == fresh.counts == {"seen": 4, "kept": 4}
    used.reset()
    assert_params_at_snapshot(used)
    assert not used.optimizer.state and used.counts == {"seen": 0, "kept": 0}
    first, second = build(), build()
    out = assert_same_seeded_steps(first, second, batch, seed=3, atol=0)
    assert out.shape == (4, classifier.num_classes) and torch.isfinite(out).all()
    again = assert_same_seeded_steps(first, second, batch, seed=3, atol=0)
    assert not torch.equal(out, again)  # the model moved between the two steps


@pytest.mark.parametrize(
    ("field", "value"), [("diversity_weight", -0.1), ("margin", 1.5), ("lr", 0.0), ("steps", 0)]
)
def test_bad_config_values_are_refused(classifier, field, value):
    config = dataclasses.replace(OSTTA.Config(), **{field: value})
    with pytest.raises(ValueError, match=field):
        OSTTA(copy.deepcopy(classifier), config)
