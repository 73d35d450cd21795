"""SoTTA (mura_plugin/methods/sotta.py): the HUS memory against a reference written here from
the paper's rule (a hand-worked sequence with scripted draws and a long random one), HLoss
against numpy, the confidence filter and one ESM update on the real tiny ViT against a
recomputation with torch's Adam, the update clock inside a batch, BatchNorm's learned
statistics on a ResNet tower, reset, seeds, the own OOD score and the config's checks."""

from __future__ import annotations

import copy
import dataclasses
import math
import random

import numpy as np
import pytest
import torch
from method_runs import assert_reset_then_reseed_reproduces, assert_same_seeded_steps, build_method

from mura_plugin.methods._norm import top_excluded_norm_parameters
from mura_plugin.methods.sotta import HUSMemory, SoTTA, hloss


# -- the memory ----------------------------------------------------------------------------
def _reference_hus(sequence, capacity, num_classes, threshold, draw):
    """HUS from the paper, independently of the method: one flat list of stored items.
    A confident newcomer (confidence >= threshold) into a full memory first removes a random
    item of a random most-populated class, or of its own class when that is one of them.
    Returns (accepted flags, ids in class-then-arrival order)."""
    stored: list[tuple] = []  # (arrival, id, class)
    accepted = []
    for t, (ident, cls, conf) in enumerate(sequence):
        if conf < threshold:
            accepted.append(False)
            continue
        if len(stored) >= capacity:
            counts = [sum(1 for s in stored if s[2] == c) for c in range(num_classes)]
            top = [c for c in range(num_classes) if counts[c] == max(counts)]
            victim_cls = cls if cls in top else top[draw(len(top))]
            members = [s for s in stored if s[2] == victim_cls]  # arrival order
            stored.remove(members[draw(len(members))])
        stored.append((t, ident, cls))
        accepted.append(True)
    return accepted, [s[1] for s in sorted(stored, key=lambda s: (s[2], s[0]))]


def _scripted(values):
    """A ``draw`` returning ``values`` in turn, recording the ``n`` each draw was asked for."""
    asked, pending = [], list(values)

    def draw(n):
        asked.append(n)
        value = pending.pop(0)
        assert 0 <= value < n
        return value

    return draw, asked


def _run_hus(sequence, capacity, num_classes, threshold, draw):
    memory = HUSMemory(capacity, num_classes, threshold)
    accepted = [memory.add(ident, cls, conf, draw) for ident, cls, conf in sequence]
    return accepted, memory.contents(), memory


HAND = [
    ("a", 0, 0.95), ("b", 0, 0.50),  # b: below the threshold 0.9, dropped
    ("c", 1, 0.90),  # exactly at the threshold: kept
    ("d", 0, 0.99), ("e", 2, 0.97),  # full (capacity 4): 0: a d | 1: c | 2: e
    ("f", 1, 0.96),  # largest {0}, 1 not in it: class 0 (draw 0 of 1), its item 1 (d) goes
    ("g", 0, 0.93),  # sizes (1, 2, 1): largest {1}: class 1 (0 of 1), its item 0 (c) goes
    ("h", 0, 0.99),  # sizes (2, 1, 1): its own class 0 is the largest: item 0 (a) goes
    ("i", 1, 0.99),  # sizes (2, 1, 1): class 0 (0 of 1), its item 1 (h) goes
    ("j", 2, 0.99),  # sizes (1, 2, 1): class 1 (0 of 1), its item 0 (f) goes
    ("k", 1, 0.95),  # sizes (1, 1, 2): class 2 (0 of 1), its item 1 (j) goes
    ("l", 0, 0.99),  # sizes (1, 2, 1): class 1 (0 of 1), its item 0 (i) goes
]  # fmt: skip
HAND_DRAWS = [0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0]
HAND_ASKED = [1, 2, 1, 2, 2, 1, 2, 1, 2, 1, 2, 1, 2]


def test_hus_on_a_hand_made_sequence():
    draw, asked = _scripted(HAND_DRAWS)
    accepted, ids, memory = _run_hus(HAND, 4, 3, 0.9, draw)
    assert accepted == [True, False] + [True] * 10
    assert ids == ["g", "l", "k", "e"]
    assert memory.sizes() == [2, 1, 1] and memory.counter == [6, 4, 2]  # dropped offers count
    assert asked == HAND_ASKED
    ref_draw, _ = _scripted(HAND_DRAWS)
    assert _reference_hus(HAND, 4, 3, 0.9, ref_draw) == (accepted, ids)


def test_hus_tie_between_largest_classes_draws_the_class():
    """Sizes (2, 2), capacity 4, a confident sample of class 2: the victim class is drawn
    among both largest (draw 1 of 2: class 1), then its item (draw 0 of 2)."""
    seq = [("p", 0, 1.0), ("q", 1, 1.0), ("r", 0, 1.0), ("s", 1, 1.0), ("t", 2, 1.0)]
    draw, asked = _scripted([1, 0])
    _, ids, _ = _run_hus(seq, 4, 3, 0.5, draw)
    assert ids == ["p", "r", "s", "t"] and asked == [2, 2]


def test_hus_threshold_zero_keeps_everything_and_fills_first():
    seq = [(i, 0, 0.0) for i in range(3)]  # one class: fills, then evicts from itself
    draw, asked = _scripted([2])
    accepted, ids, _ = _run_hus(seq + [(3, 0, 0.0)], 3, 2, 0.0, draw)
    assert all(accepted) and ids == [0, 1, 3] and asked == [3]


@pytest.mark.parametrize(("capacity", "num_classes"), [(64, 10), (7, 3)])
def test_hus_on_a_random_stream_matches_the_reference(capacity, num_classes):
    rng = random.Random(capacity)
    seq = [(i, rng.randrange(num_classes), rng.random()) for i in range(500)]
    got = _run_hus(seq, capacity, num_classes, 0.3, random.Random(7).randrange)
    expected = _reference_hus(seq, capacity, num_classes, 0.3, random.Random(7).randrange)
    assert got[:2] == expected
    assert len(got[1]) == capacity and not all(got[0])  # it fills, evicts and drops
    assert max(got[2].sizes()) - min(got[2].sizes()) <= 2  # near uniform over classes


def test_hus_state_round_trip():
    memory = HUSMemory(4, 2, 0.5)
    memory.add("x", 0, 0.9, lambda n: 0)
    other = HUSMemory(4, 2, 0.5)
    other.load_state(memory.state())
    memory.add("y", 1, 0.9, lambda n: 0)
    assert other.contents() == ["x"] and other.counter == [1, 0]


# -- the loss ------------------------------------------------------------------------------
def test_hloss_known_values():
    logits = np.array([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
    for temperature in (1.0, 2.0):
        z = logits / temperature
        q = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
        expected = (-(q * np.log(q + 1e-6)).sum(axis=1)).mean()
        got = hloss(torch.tensor(logits, dtype=torch.float32), temperature)
        np.testing.assert_allclose(float(got), expected, rtol=0, atol=1e-6)
    uniform = hloss(torch.zeros(1, 10))  # ln 10 less the epsilon's share
    np.testing.assert_allclose(float(uniform), -math.log(0.1 + 1e-6), rtol=0, atol=1e-6)


# -- the method on the real tiny ViT -------------------------------------------------------
def test_defaults_are_the_official_values():
    cfg = SoTTA.Config()
    assert (cfg.optimizer, cfg.lr, cfg.weight_decay, cfg.steps, cfg.precision) == (
        "adam", 1e-3, 5e-4, 1, "fp32"
    )  # fmt: skip
    assert (cfg.memory_size, cfg.update_every, cfg.high_threshold) == (64, 64, 0.99)
    assert (cfg.memory_batch_size, cfg.temperature, cfg.rho, cfg.bn_momentum) == (
        128, 1.0, 0.05, 0.2
    )  # fmt: skip
    assert (cfg.exclude_top, cfg.exclude_final_norm) == (0.25, True)
    assert SoTTA.adapts and SoTTA.stream_kind == "online" and SoTTA.own_ood_score


def test_parameters_leave_the_top_blocks_frozen(classifier):
    method = build_method(SoTTA, classifier)
    expected = top_excluded_norm_parameters(method.model.visual, 0.25, True)
    assert [id(p) for p in method.params] == [id(p) for p in expected]
    blocks = method.model.visual.transformer.resblocks
    top = {id(p) for p in blocks[-1].parameters()} | {
        id(p) for p in method.model.visual.ln_post.parameters()
    }
    assert not top & {id(p) for p in method.params} and len(method.params) > 0


def test_the_confidence_filter_fills_the_memory(classifier, noisy_images):
    """No update (update_every 100): the memory holds exactly the samples whose maximum
    softmax reaches the threshold, class by class in stream order; the own OOD score is that
    maximum softmax."""
    with torch.no_grad():
        probs = classifier(noisy_images).softmax(dim=1)
    conf, labels = probs.max(dim=1)
    threshold = float(conf.median())
    method = build_method(SoTTA, classifier, update_every=100, high_threshold=threshold)
    out = method.step(noisy_images)
    torch.testing.assert_close(out.softmax(dim=1), probs, rtol=0, atol=1e-6)
    torch.testing.assert_close(method.last_ood_score, conf, rtol=0, atol=1e-6)
    assert method.last_ood_score.shape == (6,)
    keep = [i for i in sorted(range(6), key=lambda i: (int(labels[i]), i)) if conf[i] >= threshold]
    stored = method.memory.contents()
    assert 0 < len(keep) < 6 and len(stored) == len(keep)
    for image, i in zip(stored, keep):
        assert torch.equal(image, noisy_images[i])
    assert method.updates == 0 and method.seen == 6 and sum(method.memory.counter) == 6


def _reference_esm(model, images, lr, rho, weight_decay):
    """One ESM step written out with torch's Adam: HLoss, ascent rho g / ||g||, HLoss at the
    perturbed point, Adam from the unperturbed point with that gradient."""
    params = top_excluded_norm_parameters(model.visual, 0.25, True)
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)

    def loss_and_grads():
        q = model(images).softmax(dim=1)
        loss = (-(q * torch.log(q + 1e-6)).sum(dim=1)).mean()
        return loss, torch.autograd.grad(loss, params)

    with torch.enable_grad():
        first, grads = loss_and_grads()
        norm = torch.sqrt(sum((g**2).sum() for g in grads))
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.add_(rho * g / (norm + 1e-12))
        _, grads2 = loss_and_grads()
    with torch.no_grad():
        for p, s, g in zip(params, saved, grads2):
            p.copy_(s)
            p.grad = g.clone()
    optimizer.step()
    return first.detach(), [p.detach() for p in params]


def test_one_update_is_the_esm_step(classifier, batch):
    lr, rho = 0.01, 0.5
    method = build_method(SoTTA, classifier, update_every=4, high_threshold=0.0, lr=lr, rho=rho)
    reference = copy.deepcopy(classifier)
    with torch.no_grad():
        source = reference(batch)
    first, expected = _reference_esm(reference, batch, lr, rho, 5e-4)
    method.reseed(0)
    out = method.step(batch)
    torch.testing.assert_close(out, source, rtol=0, atol=1e-5)  # predicted before the update
    assert (method.updates, method.seen, len(method.memory)) == (1, 4, 4)
    torch.testing.assert_close(method.last_loss, first, rtol=0, atol=1e-6)
    for p, e in zip(method.params, expected):
        torch.testing.assert_close(p.detach(), e, rtol=0, atol=1e-6)
    moved = [not torch.equal(p, s) for p, s in zip(method.params, method._snapshot["params"])]
    assert all(moved)


def test_the_update_clock_runs_inside_a_batch(classifier, noisy_images):
    """update_every 3 over a batch of 4: the first three are predicted by the source model,
    the update follows the third, the fourth is predicted (and offered) by the updated one."""
    method = build_method(SoTTA, classifier, update_every=3, high_threshold=0.0, lr=0.05)
    images = noisy_images[:4]
    with torch.no_grad():
        source = classifier(images)
    method.reseed(0)
    out = method.step(images)
    assert (method.updates, method.seen, len(method.memory)) == (1, 4, 4)
    torch.testing.assert_close(out[:3], source[:3], rtol=0, atol=1e-5)
    torch.testing.assert_close(out[3:], method.predict(images[3:]), rtol=0, atol=0)
    assert not torch.allclose(out[3:], source[3:], atol=1e-3)
    method.step(noisy_images[4:6])  # sample 6 completes the next interval
    assert (method.updates, method.seen) == (2, 6)


def _state(method):
    return (
        [p.detach().clone() for p in method.params],
        [x.clone() for x in method.memory.contents()],
        list(method.memory.counter),
        method.seen,
        method.updates,
    )


def _same(a, b):
    return (
        all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
        and len(a[1]) == len(b[1])
        and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
        and a[2:] == b[2:]
    )


def test_reset_and_seeds(classifier, batch):
    build = lambda: build_method(SoTTA, classifier, update_every=2, high_threshold=0.0, lr=0.05)  # noqa: E731
    fresh, used, out = assert_reset_then_reseed_reproduces(build, batch)
    assert out.shape == (4, classifier.num_classes) and torch.isfinite(out).all()
    assert _same(_state(used), _state(fresh))
    used.reset()
    setup_state = _state(build())
    assert _same(_state(used), setup_state) and not used.optimizer.state
    first, second = build(), build()
    assert_same_seeded_steps(first, second, batch, seed=2, atol=0)
    assert _same(_state(first), _state(second))
    again = assert_same_seeded_steps(first, second, batch, seed=2, atol=0)
    assert not torch.equal(out, again)


@pytest.mark.parametrize(
    ("field", "value"),
    [("memory_size", 0), ("high_threshold", 1.5), ("update_every", 0), ("rho", -0.1)],
)
def test_bad_config_values_are_refused(classifier, field, value):
    config = dataclasses.replace(SoTTA.Config(), **{field: value})
    with pytest.raises(ValueError, match=field):
        SoTTA(copy.deepcopy(classifier), config)


# -- a BatchNorm tower ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def bn_classifier(classifier):
    """The tiny classifier's text head on a small random CLIP ResNet (ModifiedResNet,
    BatchNorm), its running statistics set by a few train-mode passes."""
    from open_clip.modified_resnet import ModifiedResNet

    torch.manual_seed(0)
    model = copy.deepcopy(classifier)
    tower = ModifiedResNet(layers=(1, 1, 1, 1), output_dim=64, heads=2, image_size=32, width=8)
    tower.train()
    with torch.no_grad():
        for _ in range(3):
            tower(torch.randn(8, 3, 32, 32))
    tower.eval().requires_grad_(False)
    model.clip.visual = tower
    return model


def test_batchnorm_learned_statistics(bn_classifier, batch):
    """Eval-mode prediction with the running statistics; the update's two train-mode forwards
    move the stem's first BatchNorm (whose input no adapted parameter changes) to
    ``0.8^2 m + (1 - 0.8^2) batch_mean``; reset restores them; layer4 stays frozen."""
    method = build_method(SoTTA, bn_classifier, update_every=4, high_threshold=0.0, lr=0.01)
    bn1 = method.model.visual.bn1
    old = bn1.running_mean.clone()
    assert bn1.momentum == 0.2 and not bn1.training
    assert not {id(p) for p in method.model.visual.layer4.parameters()} & {
        id(p) for p in method.params
    }
    with torch.no_grad():
        expected = bn_classifier(batch)
        stem = bn_classifier.visual.conv1(bn_classifier.normalize(batch)).mean(dim=(0, 2, 3))
    method.reseed(0)
    torch.testing.assert_close(method.step(batch), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(bn1.running_mean, 0.64 * old + 0.36 * stem, rtol=0, atol=1e-5)
    assert method._batch_norms and not any(m.training for m in method._batch_norms)
    method.reset()
    assert torch.equal(bn1.running_mean, old)
