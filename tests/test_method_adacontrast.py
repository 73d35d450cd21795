"""AdaContrast (mura_plugin/methods/adacontrast.py): the kNN soft-voting refinement, the
class-aware instance loss, the diversity term, the queue and the bank against references
written here; the batched augmentations against torchvision's kernels; one step on the real
tiny model (key-encoder EMA timing, queue, bank, refinement switch), reset, seeds and the
defaults."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torchvision.transforms.v2.functional as TF
from method_runs import assert_reset_then_reseed_reproduces, assert_same_seeded_steps

from mura_plugin.methods.adacontrast import (
    AdaContrast,
    adjust_hue,
    class_aware_mask,
    color_jitter,
    diversity_loss,
    enqueue,
    gaussian_blur,
    instance_logits,
    instance_loss,
    soft_knn_refine,
    strong_view,
    update_bank,
    weak_view,
)


def _build(classifier, **overrides):
    torch.manual_seed(0)
    method = AdaContrast(
        copy.deepcopy(classifier), dataclasses.replace(AdaContrast.Config(), **overrides)
    )
    method.setup()
    return method


def test_defaults_are_the_reference_cifar10_c_setting():
    cfg = AdaContrast.Config()
    assert (cfg.optimizer, cfg.lr, cfg.momentum, cfg.weight_decay) == ("sgd", 2e-4, 0.9, 1e-4)
    assert cfg.nesterov and cfg.steps == 1 and cfg.precision == "fp32" and cfg.loss is None
    assert (cfg.queue_size, cfg.key_momentum, cfg.temperature) == (16384, 0.999, 0.07)
    assert (cfg.contrast_type, cfg.ce_sup_type) == ("class_aware", "weak_strong")
    assert (cfg.refine, cfg.dist_type, cfg.num_neighbors) == ("nearest_neighbors", "cosine", 10)
    assert cfg.refine_after == 1024 and (cfg.alpha, cfg.beta, cfg.eta) == (1.0, 1.0, 1.0)
    assert AdaContrast.stream_kind is None and not AdaContrast.needs_source_labels


def _unit(degrees: float, norm: float = 1.0) -> list[float]:
    return [norm * math.cos(math.radians(degrees)), norm * math.sin(math.radians(degrees))]


def _knn_reference(query, bank, probs, k, cosine=True):
    """Brute force in Python: sort the bank by distance, average the k nearest rows."""
    out = []
    for q in query:
        dists = []
        for j, b in enumerate(bank):
            if cosine:
                dot = sum(x * y for x, y in zip(q, b))
                d = 1 - dot / (math.hypot(*q) * math.hypot(*b))
            else:
                d = math.dist(q, b)
            dists.append((d, j))
        nearest = [j for _, j in sorted(dists)[:k]]
        out.append([sum(probs[j][c] for j in nearest) / k for c in range(len(probs[0]))])
    return out


def test_soft_knn_refinement_known_values():
    bank = [_unit(0), _unit(30, 3.0), _unit(90), _unit(180), _unit(270)]
    probs = [[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.0, 0.0, 1.0], [0.2, 0.2, 0.6], [0.1, 0.1, 0.8]]
    query = [_unit(10), _unit(200, 0.5)]
    labels, refined = soft_knn_refine(
        torch.tensor(query), torch.tensor(bank), torch.tensor(probs), 2, "cosine"
    )
    # 10 deg: nearest 0 and 30 deg (the long one: cosine ignores the norm) -> (0.4, 0.4, 0.2);
    # 200 deg: nearest 180 and 270 deg -> (0.15, 0.15, 0.7)
    expected = [[0.4, 0.4, 0.2], [0.15, 0.15, 0.7]]
    torch.testing.assert_close(refined, torch.tensor(expected), rtol=0, atol=1e-6)
    assert labels.tolist()[1] == 2
    for k, cosine in ((3, True), (2, False), (5, True)):
        _, got = soft_knn_refine(
            torch.tensor(query),
            torch.tensor(bank),
            torch.tensor(probs),
            k,
            "cosine" if cosine else "euclidean",
        )
        want = _knn_reference(query, bank, probs, k, cosine)
        torch.testing.assert_close(got, torch.tensor(want), rtol=0, atol=1e-6)
    # Euclidean: the long 30-degree vector is far from the 10-degree unit query
    _, got = soft_knn_refine(
        torch.tensor(query[:1]), torch.tensor(bank), torch.tensor(probs), 2, "euclidean"
    )
    torch.testing.assert_close(got, torch.tensor([[0.35, 0.1, 0.55]]), rtol=0, atol=1e-6)


def test_class_aware_mask_and_instance_loss_known_values():
    q = torch.tensor([_unit(0), _unit(60)])
    k = torch.tensor([_unit(20), _unit(90)])
    queue = torch.tensor([_unit(45), _unit(180), _unit(10), _unit(100)]).t()  # [D, K]
    queue_labels = torch.tensor([1, 0, 1, 2])
    pseudo = torch.tensor([1, 2])
    mask = class_aware_mask(pseudo, queue_labels)
    assert mask.tolist() == [[True, False, True, False, True], [True, True, True, True, False]]
    t = 0.07
    logits = instance_logits(q, k, queue, t)
    got = instance_loss(logits, pseudo, queue_labels)
    total = 0.0
    for i in range(2):
        pos = sum(a * b for a, b in zip(q[i].tolist(), k[i].tolist())) / t
        terms = [pos]
        for j in range(4):
            if queue_labels[j] != pseudo[i]:
                terms.append(sum(a * b for a, b in zip(q[i].tolist(), queue[:, j].tolist())) / t)
        total += -pos + math.log(sum(math.exp(x) for x in terms))
    assert float(got) == pytest.approx(total / 2, rel=1e-5)
    plain = instance_loss(logits)  # contrast_type "all": every queued key is a negative
    assert float(plain) > float(got)


def test_diversity_loss_known_value():
    logits = torch.tensor([[0.75, 0.25], [0.25, 0.75]]).log()  # marginal (0.5, 0.5)
    assert float(diversity_loss(logits)) == pytest.approx(math.log(0.5), abs=1e-6)
    skewed = torch.tensor([[0.9, 0.1], [0.7, 0.3]]).log()  # marginal (0.8, 0.2)
    assert float(diversity_loss(skewed)) == pytest.approx(
        0.8 * math.log(0.8) + 0.2 * math.log(0.2), abs=1e-6
    )


def test_queue_and_bank_fifo():
    queue, labels = torch.zeros(1, 5), torch.full((5,), -1)
    queue, labels, ptr = enqueue(
        queue, labels, 3, torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([1, 2, 3])
    )
    assert queue.tolist() == [[3.0, 0.0, 0.0, 1.0, 2.0]] and labels.tolist() == [3, -1, -1, 1, 2]
    assert ptr == 1
    # more keys than slots: a sequential write from slot 2, the last write wins
    keys = torch.arange(7.0).view(7, 1)
    queue, labels, ptr = enqueue(
        torch.zeros(1, 5), torch.zeros(5, dtype=torch.long), 2, keys, torch.arange(7)
    )
    assert queue.tolist() == [[3.0, 4.0, 5.0, 6.0, 2.0]] and ptr == 4
    feats, probs, ptr = torch.zeros(0, 1), torch.zeros(0, 1), 0
    trace = []
    for step in range(4):
        new = torch.tensor([[10.0 * step], [10.0 * step + 1]])
        feats, probs, ptr = update_bank(feats, probs, ptr, new, new, size=5)
        trace.append((feats.flatten().tolist(), ptr))
    assert trace == [
        ([0.0, 1.0], 0),
        ([0.0, 1.0, 10.0, 11.0], 2),
        ([0.0, 1.0, 10.0, 11.0, 20.0, 21.0], 4),  # grown past the size: then overwritten
        ([0.0, 1.0, 10.0, 11.0, 30.0, 31.0], 0),
    ]


def test_batched_colour_ops_are_torchvisions():
    images = torch.rand(6, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    shifts = torch.tensor([-0.1, -0.03, 0.0, 0.02, 0.07, 0.1])
    expected = torch.stack([TF.adjust_hue(x, float(s)) for x, s in zip(images, shifts)])
    torch.testing.assert_close(adjust_hue(images, shifts), expected, rtol=0, atol=1e-5)
    # the jitter: the same draws, applied image by image with torchvision's kernels
    g = torch.Generator().manual_seed(4)
    order = torch.rand(6, 4, generator=g).argsort(dim=1)
    factors = [torch.empty(6).uniform_(0.6, 1.4, generator=g) for _ in range(3)]
    hue = torch.empty(6).uniform_(-0.1, 0.1, generator=g)
    ops = (TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue)
    want = []
    for i, x in enumerate(images):
        values = [float(f[i]) for f in factors] + [float(hue[i])]
        for op in order[i].tolist():
            x = ops[op](x, values[op])
        want.append(x)
    got = color_jitter(images, torch.Generator().manual_seed(4))
    torch.testing.assert_close(got, torch.stack(want), rtol=0, atol=1e-5)


def test_blur_and_views():
    impulse = torch.zeros(1, 3, 32, 32)
    impulse[0, :, 16, 16] = 1.0
    w = [math.exp(-0.5 * x * x) for x in range(-6, 7)]
    w = [v / sum(w) for v in w]
    out = gaussian_blur(impulse, torch.tensor([1.0]))
    assert float(out[0, 1, 16, 16]) == pytest.approx(w[6] ** 2, rel=1e-5)
    assert float(out[0, 0, 14, 19]) == pytest.approx(w[4] * w[9], rel=1e-5)
    flat = gaussian_blur(torch.full((2, 3, 8, 8), 0.4), torch.tensor([0.1, 2.0]))
    torch.testing.assert_close(flat, torch.full_like(flat, 0.4))
    x = torch.rand(8, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    a = strong_view(x, torch.Generator().manual_seed(2))
    assert torch.equal(a, strong_view(x, torch.Generator().manual_seed(2)))
    assert not torch.equal(a, strong_view(x, torch.Generator().manual_seed(3)))
    assert a.shape == x.shape and float(a.min()) >= 0.0 and float(a.max()) <= 1.0
    weak = weak_view(x, torch.Generator().manual_seed(2))
    for v, img in zip(weak, x):
        assert torch.equal(v, img) or torch.equal(v, img.flip(-1))


def test_a_step_on_the_tiny_model(classifier, batch):
    method = _build(classifier, lr=0.05, queue_size=64)
    assert method.optimizer.param_groups[0]["nesterov"]
    queue0 = method.queue.clone()
    assert method.queue.shape == (classifier.class_embeddings.shape[1], 64)
    torch.testing.assert_close(method.queue.norm(dim=0), torch.ones(64))
    source = [p.detach().clone() for p in method.params]
    method.reseed(0)
    out = method.step(batch)
    torch.testing.assert_close(out, method.predict(batch), rtol=0, atol=0)
    assert (method.queue_ptr, method.seen, method.bank_features.shape[0]) == (4, 4, 4)
    assert not torch.equal(method.queue[:, :4], queue0[:, :4])
    assert torch.equal(method.queue[:, 4:], queue0[:, 4:])
    torch.testing.assert_close(method.bank_probs.sum(dim=1), torch.ones(4))
    # the key encoder moved before the gradient step: after one step it is still the source
    for key, src in zip(method.key_params, source):
        torch.testing.assert_close(key, src, rtol=0, atol=1e-6)
    after_one = [p.detach().clone() for p in method.params]
    assert any(not torch.equal(a, s) for a, s in zip(after_one, source))
    method.reseed(1)
    method.step(batch)
    for key, src, p1 in zip(method.key_params, source, after_one):
        torch.testing.assert_close(key, 0.999 * src + 0.001 * p1, rtol=0, atol=1e-6)
    assert method.queue_ptr == 8 and method.bank_features.shape[0] == 8


def test_pseudo_labels_switch_to_the_bank_after_refine_after(classifier, batch):
    method = _build(classifier, refine_after=4, num_neighbors=3)
    feats, logits = torch.randn(5, 64), torch.randn(5, 10)
    assert torch.equal(method.pseudo_labels(feats, logits), logits.argmax(dim=1))
    assert method.seen == 5  # counted until the threshold
    method.reseed(0)
    method.step(batch)  # refined: the bank holds 4 entries now
    expected, _ = soft_knn_refine(feats, method.bank_features, method.bank_probs, 3)
    assert torch.equal(method.pseudo_labels(feats, logits), expected)
    assert method.seen == 5
    plain = _build(classifier, refine="none", refine_after=0)
    assert torch.equal(plain.pseudo_labels(feats, logits), logits.argmax(dim=1))


def test_reset_returns_to_the_setup_state(classifier, batch):
    fresh, used, _ = assert_reset_then_reseed_reproduces(
        lambda: _build(classifier, lr=0.05, queue_size=64), batch
    )
    used.reset()
    assert torch.equal(used.queue, fresh._snapshot["extra"]["queue"])
    assert (used.queue_ptr, used.seen, used.bank_features.shape[0]) == (0, 0, 0)
    assert all(torch.equal(k, p) for k, p in zip(used.key_params, used.params))


def test_same_seed_same_logits(classifier, batch):
    a, b = _build(classifier, lr=0.05, queue_size=64), _build(classifier, lr=0.05, queue_size=64)
    out = assert_same_seeded_steps(a, b, batch, seed=2, loss_atol=0.0)
    assert out.shape == (4, classifier.num_classes) and bool(torch.isfinite(out).all())
    assert torch.equal(a.queue, b.queue)
