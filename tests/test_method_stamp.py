"""STAMP (mura_plugin/methods/stamp.py): the stable memory against a hand-worked sequence
and a reference written here from the rule (a long random stream with ties), the filter
(entropy with its 1e-5, the view average, the consistency and entropy masks), the
self-weighted memory loss against a float64 reference of the official formula (gradients
through the weights included), the cosine schedule against torch's, one real SAM update on
the tiny ViT against a recomputation, reset, seeds and bad values."""

from __future__ import annotations

import copy
import dataclasses
import math
import random

import numpy as np
import pytest
import torch
from method_runs import assert_same_seeded_steps, build_method

from mura_plugin.methods.sar import sar_parameters
from mura_plugin.methods.stamp import (
    STAMP,
    StableMemory,
    STAMPConfig,
    cosine_lr,
    mean_view_log_probs,
    memory_loss,
    reliable_mask,
    stamp_entropy,
)


# -- the memory ----------------------------------------------------------------------------
def test_memory_on_a_hand_made_sequence():
    """Capacity 3, 3 classes. Counts move only when the memory is read; eviction takes the
    oldest item of the non-empty class with the largest moving count."""
    g = torch.Generator().manual_seed(0)
    memory = StableMemory(3, 3)
    memory.add(["a", "b", "c"], [0, 0, 1], g)
    assert memory.read() == ["a", "b", "c"] and len(memory) == 3
    torch.testing.assert_close(memory.counts, torch.tensor([0.2, 0.1, 0.0]))
    memory.add(["d"], [2], g)  # class 0 has the largest count: its oldest (a) goes
    memory.add(["e"], [1], g)  # counts still (0.2, 0.1, 0): b goes
    assert memory.classes == [[], ["c", "e"], ["d"]] and len(memory) == 3
    assert memory.read() == ["c", "e", "d"]
    torch.testing.assert_close(memory.counts, torch.tensor([0.18, 0.29, 0.1]))
    memory.add(["f"], [0], g)  # class 0 is empty now: class 1 (0.29) loses c
    assert memory.read() == ["f", "e", "d"]
    memory.add(["h"], [1], g)  # counts (0.262, 0.361, 0.19): class 1 loses e
    assert memory.classes == [["f"], ["h"], ["d"]]


def test_memory_ties_draw_from_the_generator():
    """Equal counts (before any read: all 0) tie; the class is drawn uniformly among the
    tied non-empty ones."""
    picks = set()
    for seed in range(20):
        memory = StableMemory(2, 3)
        g = torch.Generator().manual_seed(seed)
        memory.add(["a", "b", "c"], [0, 2, 1], g)
        assert memory.eviction_candidates() == [1, 2] or len(memory) == 2
        picks.add(tuple(len(items) for items in memory.classes))
    assert picks == {(1, 1, 0), (0, 1, 1)}  # a (class 0) or b (class 2) went, each sometimes


def _reference_memory(events, capacity, num_classes, seed):
    """The RBM rule written here: a flat list of (class, arrival, item); counts as Python
    floats rounded to float32 after each update (the official tensor); a tie is resolved
    with the same generator draw."""
    g = torch.Generator().manual_seed(seed)
    stored: list[tuple[int, int, object]] = []
    counts = np.zeros(num_classes, dtype=np.float32)
    reads = []
    for t, (kind, payload) in enumerate(events):
        if kind == "read":
            ordered = sorted(stored, key=lambda s: (s[0], s[1]))
            reads.append([s[2] for s in ordered])
            for c in range(num_classes):
                size = sum(1 for s in stored if s[0] == c)
                counts[c] = np.float32(0.9 * float(counts[c]) + 0.1 * size)
            continue
        item, label = payload
        if len(stored) >= capacity:
            present = sorted({s[0] for s in stored})
            top = max([0.0] + [float(counts[c]) for c in present])
            tied = [c for c in present if float(counts[c]) == top]
            victim_class = tied[int(torch.randint(len(tied), (1,), generator=g))]
            oldest = min((s for s in stored if s[0] == victim_class), key=lambda s: s[1])
            stored.remove(oldest)
        stored.append((label, t, item))
    return reads


@pytest.mark.parametrize(("capacity", "num_classes"), [(64, 10), (5, 3)])
def test_memory_on_a_random_stream_matches_the_reference(capacity, num_classes):
    rng = random.Random(capacity)
    events = []
    for i in range(600):
        events.append(("add", (i, rng.randrange(num_classes))))
        if rng.random() < 0.15:
            events.append(("read", None))
    expected = _reference_memory(events, capacity, num_classes, seed=1)
    memory, g, reads = StableMemory(capacity, num_classes), torch.Generator().manual_seed(1), []
    for kind, payload in events:
        if kind == "read":
            reads.append(memory.read())
        else:
            memory.add([payload[0]], [payload[1]], g)
    assert reads == expected and len(reads) > 50 and len(memory) == capacity


def test_memory_state_round_trip():
    memory, g = StableMemory(4, 2), torch.Generator().manual_seed(0)
    memory.add(["x", "y"], [0, 1], g)
    memory.read()
    other = StableMemory(4, 2)
    other.load_state(memory.state())
    memory.add(["z"], [1], g)
    memory.read()
    assert other.classes == [["x"], ["y"]] and len(other) == 2
    torch.testing.assert_close(other.counts, torch.tensor([0.1, 0.1]))


# -- the filter, the loss, the schedule ---------------------------------------------------
def test_filter_known_values():
    views = torch.tensor([[[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]], [[0.0, 1.0, 0.0], [5.0, 0.0, 0.0]]])
    log_p = mean_view_log_probs(views)
    mean = views.softmax(dim=-1).mean(dim=0)
    torch.testing.assert_close(log_p.exp(), mean)
    h = stamp_entropy(log_p)
    expected = -(mean.double() * torch.log(mean.double() + 1e-5)).sum(dim=-1)
    torch.testing.assert_close(h.double(), expected, rtol=0, atol=1e-6)
    entropy = torch.tensor([0.1, 0.5, 0.2, 0.3])
    current, source = torch.tensor([1, 2, 0, 4]), torch.tensor([1, 2, 3, 4])
    assert reliable_mask(entropy, 0.25, current, None).tolist() == [True, False, True, False]
    assert reliable_mask(entropy, 0.35, current, source).tolist() == [True, False, False, True]


def test_memory_loss_is_the_official_formula():
    """``mean(H * (1/exp(H)) / sum(1/exp(H)) * 64)``, the weights differentiated too."""
    logits = torch.tensor([[2.0, 0.5, -1.0], [0.1, 0.2, 0.3], [3.0, -2.0, 0.0]]).double()
    ours = logits.clone().float().requires_grad_(True)
    ref = logits.clone().requires_grad_(True)
    h = -(ref.softmax(1) * ref.log_softmax(1)).sum(1)
    inv = 1 / torch.exp(h)
    expected = (h * (inv / inv.sum() * 64)).mean()
    loss = memory_loss(ours, 64.0)
    torch.testing.assert_close(loss.double(), expected, rtol=0, atol=1e-5)
    (g_ours,) = torch.autograd.grad(loss, ours)
    (g_ref,) = torch.autograd.grad(expected, ref, retain_graph=True)
    torch.testing.assert_close(g_ours.double(), g_ref, rtol=0, atol=1e-5)
    detached = (h * (inv / inv.sum() * 64).detach()).mean()
    (g_detached,) = torch.autograd.grad(detached, ref)
    assert not torch.allclose(g_detached, g_ref, atol=1e-3)  # the weights' path matters


def test_cosine_schedule_is_torchs_cosine_annealing():
    p = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([p], lr=0.1)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 150)
    for k in range(400):  # beyond t_max it is periodic
        assert abs(optimizer.param_groups[0]["lr"] - cosine_lr(0.1, k, 150)) < 1e-9
        optimizer.step()
        scheduler.step()
    assert cosine_lr(0.1, 150, 150) == pytest.approx(0.0, abs=1e-12)


# -- the method on the real tiny ViT -------------------------------------------------------
def test_defaults_are_the_official_cifar10c_values():
    cfg = STAMP.Config()
    assert (cfg.optimizer, cfg.lr, cfg.momentum, cfg.weight_decay, cfg.steps) == (
        "sgd", 0.1, 0.0, 0.0, 1
    )  # fmt: skip
    assert (cfg.alpha, cfg.memory_size, cfg.views, cfg.rho, cfg.t_max) == (0.25, 64, 15, 0.05, 150)
    assert cfg.consistency_filter and cfg.exclude_final_norm and cfg.exclude_top == 0.25
    assert (cfg.precision, cfg.noise_std, cfg.loss) == ("fp32", 0.005, None)
    assert STAMP.own_ood_score and STAMP.adapts


def test_one_update_is_the_paper_update(classifier, batch):
    """No views and alpha 1 (threshold ln C): at the source model every sample is reliable
    and consistent, so the memory holds the batch class by class; one SAM update at the
    schedule's first rate: ascent by rho g / ||g||, gradient there, SGD step from the
    unperturbed point. The prediction is the source's, before the update."""
    lr, rho = 0.5, 0.05
    method = build_method(STAMP, classifier, views=0, alpha=1.0, lr=lr, rho=rho)
    reference = copy.deepcopy(classifier)
    params = sar_parameters(reference, method.config, "stamp")
    assert [p.shape for p in params] == [p.shape for p in method.params]
    with torch.no_grad():
        logits = reference(batch)
    labels = logits.argmax(dim=1).tolist()
    memory = batch[sorted(range(4), key=lambda i: (labels[i], i))]
    with torch.enable_grad():
        for p in params:
            p.requires_grad_(True)
        first = memory_loss(reference(memory), 64.0)
        g1 = torch.autograd.grad(first, params)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in g1]))
        with torch.no_grad():
            for p, g in zip(params, g1):
                p.add_(rho * g / (norm + 1e-12))
        g2 = torch.autograd.grad(memory_loss(reference(memory), 64.0), params)
    method.reseed(0)
    out = method.step(batch)
    torch.testing.assert_close(out, logits.log_softmax(dim=1), rtol=0, atol=1e-5)
    h = -(out.exp() * torch.log(out.exp() + 1e-5)).sum(dim=1)
    torch.testing.assert_close(method.last_ood_score, -h, rtol=0, atol=1e-6)
    assert method.counts == {"seen": 4, "stored": 4} and method.updates == 1
    assert torch.equal(torch.stack(method.memory.read()), memory)
    torch.testing.assert_close(method.last_loss, first.detach(), rtol=0, atol=1e-6)
    for p, p0, g in zip(method.params, method._snapshot["params"], g2):
        torch.testing.assert_close(p.detach(), p0 - lr * g, rtol=0, atol=5e-6)
    assert any(float(g.abs().max()) > 1e-4 for g in g2)  # the update moved something


def test_default_step_filters_and_scores(classifier, noisy_images):
    """Defaults (15 views, alpha 0.25): at the source model every sample is consistent, so
    exactly those under the entropy threshold are stored, and the memory update runs; alpha 1
    stores and updates every batch; the consistency filter refuses samples once the
    model's argmax leaves the source's."""
    method = build_method(STAMP, classifier)
    method.reseed(0)
    out = method.step(noisy_images)
    assert out.shape == (6, classifier.num_classes) and torch.isfinite(out).all()
    torch.testing.assert_close(out.exp().sum(dim=1), torch.ones(6))
    assert method.last_ood_score.shape == (6,) and torch.isfinite(method.last_ood_score).all()
    reliable = int((-method.last_ood_score < method.margin).sum())
    assert method.counts["stored"] == reliable == len(method.memory) < 6
    assert method.updates == int(reliable > 0)
    loose = build_method(STAMP, classifier, alpha=1.0, views=2, lr=5.0)
    for seed in range(3):
        loose.reseed(seed)
        loose.step(noisy_images)
    assert loose.updates == 3 and 6 <= loose.counts["stored"] == len(loose.memory) <= 18
    torch.testing.assert_close(loose.source_logits(noisy_images), classifier(noisy_images))


def test_consistency_filter_refuses_changed_predictions(classifier, noisy_images):
    """After the norms move, a sample enters the memory only if the current argmax is the
    source's (alpha 1: the entropy threshold ln C passes every sample)."""
    for consistency in (True, False):
        method = build_method(STAMP, classifier, alpha=1.0, views=0, consistency_filter=consistency)
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            for p in method.params:
                p.add_(0.5 * torch.randn(p.shape, generator=g))
            current = method.model(noisy_images).argmax(dim=1)
        source = classifier(noisy_images).argmax(dim=1)
        agree = int((current == source).sum())
        assert 0 < agree < 6  # the perturbation changed some predictions, not all
        method.reseed(0)
        method.step(noisy_images)
        assert method.counts["stored"] == (agree if consistency else 6)


def _state(method):
    return (
        [p.detach().clone() for p in method.params],
        method.memory.read(),
        method.memory.counts.clone(),
        method.updates,
    )


def test_reset_seeds_and_predict(classifier, batch):
    build = lambda: build_method(STAMP, classifier, alpha=1.0, views=2, lr=1.0)  # noqa: E731
    fresh, used = build(), build()
    used.reseed(1)
    used.step(batch)
    assert used.updates == 1 and len(used.memory) == 4
    used.reset()
    assert len(used.memory) == 0 and used.updates == 0 and not used.optimizer.state
    assert all(torch.equal(p, q) for p, q in zip(used.params, fresh.params))
    assert torch.equal(used.memory.counts, torch.zeros(classifier.num_classes))
    assert_same_seeded_steps(fresh, used, batch, seed=5, atol=0)
    torch.testing.assert_close(fresh.last_ood_score, used.last_ood_score, rtol=0, atol=0)
    a, b = _state(fresh), _state(used)
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and a[3] == b[3]
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    before = _state(fresh)
    fresh.reseed(7)
    predicted = fresh.predict(batch)
    after = _state(fresh)  # predict changes nothing
    assert all(torch.equal(x, y) for x, y in zip(before[0], after[0])) and len(after[1]) == 4
    assert predicted.shape == (4, classifier.num_classes)
    assert fresh.last_ood_score.shape == (4,)
    fresh.reseed(8)
    assert not torch.equal(fresh.predict(batch), predicted)  # other views


@pytest.mark.parametrize(
    ("field", "value"),
    [("alpha", 0.0), ("views", -1), ("memory_size", 0), ("steps", 2), ("t_max", 0), ("lr", -1.0)],
)
def test_bad_values_are_refused(classifier, field, value):
    config = dataclasses.replace(STAMPConfig(), **{field: value})
    with pytest.raises(ValueError, match=f"method.{field}"):
        STAMP(classifier, config)


def test_a_loss_is_refused(classifier):
    method = STAMP(copy.deepcopy(classifier), STAMPConfig(loss="entropy"))
    with pytest.raises(ValueError, match="method.loss must be null"):
        method.setup()


def test_margin_is_alpha_ln_c(classifier):
    method = build_method(STAMP, classifier, alpha=0.4)
    assert method.margin == pytest.approx(0.4 * math.log(classifier.num_classes))


def test_batchnorm_tower_runs_and_resets(classifier, batch):
    """A CLIP ResNet (BatchNorm, test-batch statistics): the norms outside ``layer4``
    adapt, and reset returns to the start."""
    from open_clip.modified_resnet import ModifiedResNet

    torch.manual_seed(0)
    model = copy.deepcopy(classifier)
    model.clip.visual = ModifiedResNet(
        layers=(1, 1, 1, 1), output_dim=64, heads=2, image_size=32, width=8
    ).requires_grad_(False)
    method = build_method(STAMP, model, alpha=1.0, views=1, lr=0.5)
    layer4 = {id(p) for p in model.clip.visual.layer4.parameters()}
    assert method.params and not any(id(p) in layer4 for p in method.params)
    method.reseed(0)
    method.step(batch)
    assert method.updates == 1
    assert not all(torch.equal(p, s) for p, s in zip(method.params, method._snapshot["params"]))
    method.reset()
    assert all(torch.equal(p, s) for p, s in zip(method.params, method._snapshot["params"]))
