"""GTTA (mura_plugin/methods/gtta.py): the confidence filter, the prediction matching and
the mixup against hand-derived values, one whole step against a step written here from the
reference's forward_and_adapt, the source epochs, reset, seeds and the defaults."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from method_runs import assert_reset_then_reseed_reproduces, assert_same_seeded_steps

from mura_plugin.methods.gtta import (
    GTTA,
    confident_pseudo_labels,
    match_test_images,
    mixup,
    self_training_loss,
)


def _source(n: int, labels: bool = False):
    """The first ``n`` digits training images (the protocol's clean source split) and,
    with ``labels``, their labels."""
    from mura_plugin.datasets.digits import digits_arrays

    x, y = digits_arrays("train")
    images = torch.from_numpy(x[:n]).permute(0, 3, 1, 2).float() / 255.0
    return (images, torch.from_numpy(y[:n]).long()) if labels else images


def _build(classifier, n_source: int = 4, **overrides):
    method = GTTA(copy.deepcopy(classifier), dataclasses.replace(GTTA.Config(), **overrides))
    assert method.needs_source_labels
    method.set_source(*_source(min(n_source, method.source_images_needed()), labels=True))
    torch.manual_seed(0)
    method.setup()
    return method


def test_defaults_are_the_official_cifar10_c_setting():
    cfg = GTTA.Config()
    assert (cfg.optimizer, cfg.lr, cfg.weight_decay, cfg.steps) == ("adam", 1e-5, 0.0, 1)
    assert cfg.precision == "fp32" and cfg.loss is None
    assert cfg.lambda_mixup == pytest.approx(1 / 3)
    assert cfg.source_size == 10000
    assert GTTA.stream_kind is None and GTTA.needs_source_labels


def test_confidence_filter_known_values():
    probs = torch.tensor([[0.9, 0.05, 0.05], [0.5, 0.3, 0.2], [0.1, 0.85, 0.05], [0.2, 0.2, 0.6]])
    # confidences 0.9, 0.5, 0.85, 0.6 (mean 0.7125); from 0.5: avg = 0.45 + 0.07125 = 0.52125,
    # threshold sqrt(0.52125) = 0.72198: rows 0 and 2 stay
    labels, avg = confident_pseudo_labels(probs.log(), torch.tensor(0.5))
    assert labels.tolist() == [0, -1, 1, -1]
    assert float(avg) == pytest.approx(0.52125, abs=1e-6)
    # from the reference's 0.9: avg = 0.88125, threshold 0.93875: nothing stays
    labels, avg = confident_pseudo_labels(probs.log(), torch.tensor(0.9))
    assert labels.tolist() == [-1, -1, -1, -1] and float(avg) == pytest.approx(0.88125)
    assert math.sqrt(0.88125) > 0.9


def test_matching_and_mixup_known_values():
    test = torch.tensor([[0.8, 0.1, 0.1], [0.1, 0.8, 0.1], [0.1, 0.1, 0.8]])
    source = torch.tensor([[0.2, 0.7, 0.1], [0.6, 0.1, 0.3]])
    # dot products: row 0 -> (0.24, 0.59, 0.17), row 1 -> (0.52, 0.17, 0.31)
    matched = match_test_images(source.log(), test.log())
    assert matched.tolist() == [1, 0]
    src_images = torch.tensor([[0.0, 0.3], [0.6, 0.9]]).view(2, 1, 1, 2)
    test_images = torch.tensor([[0.9, 0.0], [0.3, 0.6], [1.0, 1.0]]).view(3, 1, 1, 2)
    mixed = mixup(src_images, test_images[matched], 1 / 3)
    expected = torch.tensor([[0.1, 0.4], [0.7, 0.6]]).view(2, 1, 1, 2)  # 1/3 test + 2/3 source
    torch.testing.assert_close(mixed, expected, rtol=0, atol=1e-6)


def test_self_training_loss_is_the_mean_over_kept_samples():
    logits = torch.randn(5, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    labels = torch.tensor([2, -1, 0, -1, 3])
    expected = F.cross_entropy(logits, labels, ignore_index=-1)
    torch.testing.assert_close(self_training_loss(logits, labels).mean(), expected)
    none = self_training_loss(logits, torch.full((5,), -1))
    none.mean().backward()
    assert float(none.detach().abs().sum()) == 0.0 and float(logits.grad.abs().sum()) == 0.0


def _reference_step(classifier, images, source, labels, lr):
    """One step written from the reference's ``forward_and_adapt`` (plain SGD over the image
    tower, no style transfer)."""
    model = copy.deepcopy(classifier)
    params = list(model.visual.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.SGD(params, lr=lr)
    with torch.no_grad():
        out = model(images)
        conf, pseudo = out.softmax(1).max(1)
        avg = 0.9 * torch.tensor(0.9) + 0.1 * conf.mean()
        pseudo[conf < avg.sqrt()] = -1
        sim = model(source).softmax(1) @ out.softmax(1).t()
        mixed = images[sim.argmax(1)] / 3 + source * 2 / 3
    F.cross_entropy(model(mixed), labels).backward()
    opt.step()
    opt.zero_grad()
    out = model(images)
    F.cross_entropy(out, pseudo, ignore_index=-1).backward()
    opt.step()
    return out.detach(), params, pseudo, avg


def test_a_step_is_the_reference_step(classifier, batch):
    # SGD: Adam's first step turns gradients that are 0 up to rounding (the attention's key
    # bias) into +-lr, so the order of a sum would decide them
    method = _build(classifier, optimizer="sgd", momentum=0.0, lr=0.05)
    source, labels = method.source, method.source_labels
    expected, ref_params, pseudo, avg = _reference_step(classifier, batch, source, labels, 0.05)
    assert 0 < int((pseudo >= 0).sum()) < 4  # the filter keeps some, not all
    method.reseed(0)
    out = method.step(batch)
    # the method takes the source batch in another order: the same mean loss
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-4)
    assert torch.equal(method.pseudo_labels, pseudo)
    torch.testing.assert_close(method.avg_conf, avg)
    moved = 0.0
    for p, ref, src in zip(method.params, ref_params, classifier.visual.parameters()):
        torch.testing.assert_close(p, ref, rtol=0, atol=1e-5)
        moved = max(moved, float((p.detach() - src).abs().max()))
    assert moved > 1e-4


def test_source_batches_walk_shuffled_epochs(classifier):
    method = _build(classifier, n_source=6)
    method.reseed(3)
    first, _ = method.next_source_batch(4)
    second, _ = method.next_source_batch(4)  # the epoch's short end
    third, _ = method.next_source_batch(4)  # a new permutation
    assert (first.shape[0], second.shape[0], third.shape[0]) == (4, 2, 4)
    seen = torch.cat([first, second]).flatten(1)
    assert torch.unique(seen, dim=0).shape[0] == 6  # every source image once per epoch


def test_needs_labelled_source_images(classifier):
    method = GTTA(copy.deepcopy(classifier))
    with pytest.raises(ValueError, match="labelled clean source images"):
        method.setup()
    method = GTTA(copy.deepcopy(classifier))
    method.set_source(_source(4))  # images without labels
    with pytest.raises(ValueError, match="labelled clean source images"):
        method.setup()


def test_reset_returns_to_the_setup_state(classifier, batch):
    fresh, used, _ = assert_reset_then_reseed_reproduces(
        lambda: _build(classifier, n_source=6, lr=1e-3), batch
    )
    assert float(used.avg_conf) != 0.9  # moved by the step after the reset
    used.reset()
    assert float(used.avg_conf) == pytest.approx(0.9) and used.source_order is None
    assert all(torch.equal(p, s) for p, s in zip(used.params, used._snapshot["params"]))


def test_same_seed_same_logits_and_another_seed_another_source_batch(classifier, batch):
    a, b = _build(classifier, n_source=8, lr=1e-3), _build(classifier, n_source=8, lr=1e-3)
    out = assert_same_seeded_steps(a, b, batch, seed=2, loss_atol=0.0)
    assert out.shape == (4, classifier.num_classes) and bool(torch.isfinite(out).all())
    c = _build(classifier, n_source=8, lr=1e-3)
    c.reseed(9)
    c.step(batch)
    assert not torch.equal(c.source_order, a.source_order)


def test_validate_hands_a_labelled_source_method_its_labels(capsys):
    """``tta-bench validate method gtta``: the contract checks build a method that
    ``needs_source_labels`` with labelled source images, and every check passes (the
    validator's source once failed for want of ``torch`` in its scope)."""
    from tta_bench.cli import main

    rc = main(["validate", "method", "gtta"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "FAIL" not in out and "ok: 9 passed" in out
