"""RoTTA (mura_plugin/methods/rotta.py): the category-balanced memory against a reference
written here from the paper's rule (hand-derived sequence and a long random one), the
timeliness weight and the robust BatchNorm against their formulas, one update on the real
tiny ViT against a recomputation, a BatchNorm tower, reset, seeds and the defaults."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
import torch.nn.functional as F
from method_runs import assert_same_seeded_steps, build_method
from torch import nn

from mura_plugin.methods.cotta import cotta_augment
from mura_plugin.methods.rotta import (
    CategoryBalancedMemory,
    RobustBatchNorm,
    RoTTA,
    _replace_batch_norms,
    timeliness_weights,
)


# -- the memory ----------------------------------------------------------------------------
def _reference_memory(sequence, capacity, num_classes, lambda_t=1.0, lambda_u=1.0):
    """CSTU written from the paper independently of the method: each stored item keeps the
    time ``t`` it arrived; at arrival ``now`` its age is ``now - t``. Returns (accepted
    flags, ids in class-then-arrival order, ages / capacity after the whole sequence)."""
    stored: list[dict] = []
    accepted = []

    def heuristic(item, now):
        age = now - item["t"]
        return lambda_t / (1 + math.exp(-age / capacity)) + lambda_u * item["u"] / math.log(
            num_classes
        )

    for now, (ident, cls, u) in enumerate(sequence):
        counts = {c: sum(1 for s in stored if s["cls"] == c) for c in range(num_classes)}
        new_score = lambda_t * 0.5 + lambda_u * u / math.log(num_classes)
        ok, pool = True, []
        if counts[cls] * num_classes < capacity and len(stored) < capacity:
            pass
        elif counts[cls] * num_classes < capacity:
            top = max(counts.values())
            pool = [s for s in stored if counts[s["cls"]] == top]
        else:
            pool = [s for s in stored if s["cls"] == cls]
        if pool:  # the highest score goes; on a tie the last in (class, arrival) order
            victim = max(pool, key=lambda s: (heuristic(s, now), s["cls"], s["t"]))
            ok = heuristic(victim, now) > new_score
            if ok:
                stored.remove(victim)
        if ok:
            stored.append({"id": ident, "cls": cls, "u": u, "t": now})
        accepted.append(ok)
    stored.sort(key=lambda s: (s["cls"], s["t"]))
    n = len(sequence)
    return accepted, [s["id"] for s in stored], [(n - s["t"]) / capacity for s in stored]


def _run_memory(sequence, capacity, num_classes, lambda_t=1.0, lambda_u=1.0):
    memory = CategoryBalancedMemory(capacity, num_classes, lambda_t, lambda_u)
    accepted = [memory.add(ident, cls, u) for ident, cls, u in sequence]
    ids, ages = memory.contents()
    return accepted, ids, ages


def test_memory_on_a_hand_made_sequence():
    """Capacity 5, 3 classes (at most 2 per class while the memory has room): own-class
    eviction (a), eviction from the fullest classes (d), a rejected newcomer (h, too
    uncertain), own-class eviction of the older item (b). Scores worked out by hand."""
    seq = [
        ("a", 0, 0.5), ("b", 0, 0.2), ("c", 0, 0.1),  # c: class 0 full, a (1.05) > c (0.59)
        ("d", 1, 0.9), ("e", 1, 0.05), ("f", 2, 0.3),  # memory full: (2, 2, 1)
        ("g", 2, 0.0),  # classes 0 and 1 fullest: d's 1.46 is the highest, > 0.5
        ("h", 1, 2.0),  # fullest 0 and 2: b's 0.95 < h's 2.32: rejected
        ("i", 0, 0.0),  # class 0 full: b (0.98) > c (0.86)
    ]  # fmt: skip
    expected = (
        [True] * 7 + [False, True],
        ["c", "i", "e", "f", "g"],
        [7 / 5, 1 / 5, 5 / 5, 4 / 5, 3 / 5],
    )
    assert _reference_memory(seq, 5, 3) == expected
    assert _run_memory(seq, 5, 3) == expected
    # a tie (no age term): the last of the tied items goes
    tie = [("p", 0, 0.5), ("q", 0, 0.5), ("r", 0, 0.1)]
    assert _run_memory(tie, 4, 2, lambda_t=0.0)[1] == ["p", "r"]
    assert _reference_memory(tie, 4, 2, lambda_t=0.0)[1] == ["p", "r"]


@pytest.mark.parametrize(("capacity", "num_classes"), [(64, 10), (7, 3)])
def test_memory_on_a_random_stream_matches_the_reference(capacity, num_classes):
    rng = random.Random(capacity)
    seq = [
        (i, rng.randrange(num_classes), rng.random() * math.log(num_classes)) for i in range(400)
    ]
    expected = _reference_memory(seq, capacity, num_classes, 1.0, 0.7)
    assert _run_memory(seq, capacity, num_classes, 1.0, 0.7) == expected
    accepted, ids, _ = expected
    assert len(ids) == capacity and sum(not a for a in accepted) > 0  # it evicts and rejects


def test_memory_state_round_trip():
    memory = CategoryBalancedMemory(4, 2, 1.0, 1.0)
    for ident, cls, u in [("x", 0, 0.2), ("y", 1, 0.4)]:
        memory.add(ident, cls, u)
    other = CategoryBalancedMemory(4, 2, 1.0, 1.0)
    other.load_state(memory.state())
    memory.add("z", 1, 0.1)
    assert other.contents() == (["x", "y"], [2 / 4, 1 / 4])


def test_timeliness_weight_known_values():
    ages = torch.tensor([0.0, 1.0, 0.5])
    expected = torch.tensor([0.5, 1 / (1 + math.e), 1 / (1 + math.exp(0.5))])
    torch.testing.assert_close(timeliness_weights(ages), expected)


# -- robust batch normalisation ------------------------------------------------------------
def test_robust_batch_norm_known_values():
    bn = nn.BatchNorm2d(3, eps=1e-5)
    with torch.no_grad():
        bn.running_mean.copy_(torch.tensor([0.5, -1.0, 2.0]))
        bn.running_var.copy_(torch.tensor([1.0, 4.0, 0.25]))
        bn.weight.copy_(torch.tensor([1.5, 0.5, -1.0]))
        bn.bias.copy_(torch.tensor([0.1, 0.0, 0.3]))
    bn.eval()
    x = torch.randn(4, 3, 2, 2, generator=torch.Generator().manual_seed(0)) * 2 + 1
    robust = RobustBatchNorm(bn, momentum=0.05)
    torch.testing.assert_close(robust(x), bn(x))  # eval: the source statistics
    robust.train()
    out = robust(x)
    mean = 0.95 * bn.running_mean + 0.05 * x.mean(dim=(0, 2, 3))
    var = 0.95 * bn.running_var + 0.05 * x.var(dim=(0, 2, 3), unbiased=False)
    shape = (1, 3, 1, 1)
    expected = (x - mean.view(shape)) / (var.view(shape) + 1e-5).sqrt()
    torch.testing.assert_close(out, expected * bn.weight.view(shape) + bn.bias.view(shape))
    torch.testing.assert_close(robust.source_mean, mean)
    torch.testing.assert_close(robust.source_var, var)
    out.sum().backward()
    assert robust.weight.grad is not None and robust.bias.grad is not None
    robust.eval()
    y = robust(x)  # eval: the stored statistics, unchanged
    torch.testing.assert_close(robust.source_mean, mean)
    assert not torch.allclose(y, bn(x))


def test_replace_batch_norms():
    module = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Sequential(nn.BatchNorm1d(2)))
    replaced = _replace_batch_norms(module, 0.1)
    assert len(replaced) == 2 and all(r.momentum == 0.1 for r in replaced)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())
    assert module[1] is replaced[0] and module[2][0] is replaced[1]


# -- the method on the real tiny ViT -------------------------------------------------------
def test_defaults_are_the_official_values():
    cfg = RoTTA.Config()
    assert (cfg.optimizer, cfg.lr, cfg.weight_decay, cfg.steps, cfg.precision) == (
        "adam", 1e-3, 0.0, 1, "fp32"
    )  # fmt: skip
    assert (cfg.memory_size, cfg.update_frequency, cfg.lambda_t, cfg.lambda_u) == (64, 64, 1, 1)
    assert (cfg.nu, cfg.alpha, cfg.noise_std) == (0.001, 0.05, 0.005)
    assert RoTTA.stream_kind is None and RoTTA.adapts


def _layer_norm_params(model):
    return [
        p for m in model.visual.modules() if isinstance(m, nn.LayerNorm) for p in (m.weight, m.bias)
    ]


def test_one_update_is_the_paper_update(classifier, batch):
    """4 samples, update every 4: the prediction is the teacher's (the source) before the
    update; the memory holds the 4 in pseudo-label order with ages 4..1; one SGD step on
    mean_i w(age_i / 64) CE(teacher(x_i), student(aug(x_i))); teacher <- 0.999 t + 0.001 s."""
    lr, seed = 0.5, 3
    method = build_method(
        RoTTA, classifier, update_frequency=4, optimizer="sgd", momentum=0.0, lr=lr
    )
    reference = copy.deepcopy(classifier)
    params = _layer_norm_params(reference)
    assert [p.shape for p in params] == [p.shape for p in method.params]
    with torch.no_grad():
        logits = reference(batch)
    labels = logits.argmax(dim=1).tolist()
    order = sorted(range(4), key=lambda i: (labels[i], i))
    memory = batch[order]
    ages = torch.tensor([4.0 - i for i in order]) / 64
    augmented = cotta_augment(memory, torch.Generator().manual_seed(seed), noise_std=0.005)
    with torch.enable_grad():
        for p in params:
            p.requires_grad_(True)
        with torch.no_grad():
            target = reference(memory).softmax(dim=1)
        ce = -(target * F.log_softmax(reference(augmented), dim=1)).sum(dim=1)
        loss = (ce / (1 + torch.exp(ages))).mean()
        grads = torch.autograd.grad(loss, params)
    method.reseed(seed)
    out = method.step(batch)
    torch.testing.assert_close(out, logits, rtol=0, atol=1e-5)
    assert method.updates == 1 and method.seen == 4
    torch.testing.assert_close(method.last_loss, loss.detach(), rtol=0, atol=1e-6)
    for name, p, p0, g in zip(method._param_names, method.params, params, grads):
        expected = p0.detach() - lr * g
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6)
        teacher = 0.999 * p0.detach() + 0.001 * expected
        torch.testing.assert_close(method.teacher[name], teacher, rtol=0, atol=1e-6)
    assert any(float((g.abs()).max()) > 1e-4 for g in grads)  # the step moved something


def test_updates_count_samples_across_batches(classifier, noisy_images):
    method = build_method(RoTTA, classifier, update_frequency=3)
    method.reseed(0)
    method.step(noisy_images[:4])  # update after sample 3, sample 4 enters afterwards
    assert (method.updates, method.seen, len(method.memory)) == (1, 4, 4)
    method.step(noisy_images[4:6])  # sample 6
    assert (method.updates, method.seen) == (2, 6)


def _state(method):
    return (
        [p.detach().clone() for p in method.params],
        {k: v.clone() for k, v in method.teacher.items()},
        method.memory.contents()[1],
        method.seen,
        method.updates,
    )


def _assert_same_state(a, b):
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    assert a[2:] == b[2:]


def test_reset_returns_to_the_setup_state(classifier, batch):
    build = lambda: build_method(RoTTA, classifier, update_frequency=2, lr=0.05, nu=0.5)  # noqa: E731
    fresh, used = build(), build()
    setup_state = _state(fresh)
    used.reseed(1)
    used.step(batch)
    assert not torch.equal(_state(used)[0][0], setup_state[0][0])
    used.reset()
    _assert_same_state(_state(used), setup_state)
    assert not used.optimizer.state and len(used.memory) == 0
    for m in (fresh, used):
        m.reseed(5)
        m.step(batch)
    _assert_same_state(_state(used), _state(fresh))
    for m in (fresh, used):
        m.reseed(6)
    torch.testing.assert_close(used.step(batch), fresh.step(batch), rtol=0, atol=0)


def test_seeds_and_the_teacher_prediction(classifier, batch):
    build = lambda: build_method(RoTTA, classifier, update_frequency=2, lr=0.05, nu=0.5)  # noqa: E731
    first, second = build(), build()
    assert_same_seeded_steps(first, second, batch, seed=2, atol=0)
    _assert_same_state(_state(first), _state(second))
    second.reset()
    second.reseed(3)
    second.step(batch)
    assert not torch.equal(_state(second)[0][0], _state(first)[0][0])  # other augmentations
    before = _state(first)
    predicted = first.predict(batch)
    _assert_same_state(_state(first), before)  # predict changes nothing
    with torch.no_grad():
        student = first.model(batch)
    assert not torch.allclose(predicted, student, atol=1e-4)  # the teacher, not the student
    torch.testing.assert_close(first.step(batch), predicted, rtol=0, atol=0)


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


def test_batchnorm_tower_gets_robust_batch_norms(bn_classifier, batch):
    method = build_method(RoTTA, bn_classifier, update_frequency=4, lr=0.01)
    robust = [m for m in method.model.visual.modules() if isinstance(m, RobustBatchNorm)]
    n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in bn_classifier.visual.modules())
    assert len(robust) == n_bn > 0 and len(method.params) == 2 * n_bn
    assert not any(isinstance(m, nn.BatchNorm2d) for m in method.model.visual.modules())
    source_means = [m.source_mean.clone() for m in robust]
    with torch.no_grad():
        expected = bn_classifier(batch)
    method.reseed(0)
    torch.testing.assert_close(method.step(batch), expected, rtol=0, atol=1e-5)  # eval BN
    names = [n for n, m in method.model.named_modules() if isinstance(m, RobustBatchNorm)]
    for name, module, src in zip(names, robust, source_means):
        teacher_mean = method.teacher[f"{name}.source_mean"]
        assert not torch.equal(module.source_mean, src)  # the student's statistics moved
        assert not torch.equal(teacher_mean, src) and not torch.equal(
            teacher_mean, module.source_mean
        )
    assert all(not m.training for m in robust)
    method.reset()
    assert all(torch.equal(m.source_mean, s) for m, s in zip(robust, source_means))
    assert all(
        torch.equal(method.teacher[f"{n}.source_mean"], s) for n, s in zip(names, source_means)
    )
