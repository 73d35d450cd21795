"""ROSITA (mura_plugin/methods/rosita.py): the threshold rule against a numpy transcription
of the official search and hand values, the feature-bank insert/FIFO rules and the ID
decisions over a long stream against an independent reference, ReDUCe against hand values,
one single-image update on the real tiny ViT against an autograd recomputation, the batch
as a sequence of single-image steps, reset, seeds and the config checks."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from method_runs import (
    assert_params_at_snapshot,
    assert_reset_then_reseed_reproduces,
    assert_same_seeded_steps,
    build_method,
)

from mura_plugin.augment import random_resized_crops
from mura_plugin.methods.rosita import (
    ROSITA,
    THRESHOLD_GRID,
    ROSITAConfig,
    reduce_loss,
    score_threshold,
)


# -- an independent transcription of the official threshold search --------------------------
def _reference_split(queue: list[float]) -> tuple[float, float, float]:
    scores = np.array(queue, dtype=np.float64)
    grid = np.arange(0, 1, 0.01)
    criteria = []
    for th in grid:
        upper = scores >= th
        w1 = upper.sum() / scores.size
        if w1 in (0.0, 1.0):
            criteria.append(np.inf)
            continue
        criteria.append((1 - w1) * np.var(scores[~upper]) + w1 * np.var(scores[upper]))
    best = grid[int(np.argmin(criteria))]
    upper = scores >= best
    if upper.all() or not upper.any():
        return float(best), 0.0, 1.0
    return float(best), float(scores[~upper].mean()), float(scores[upper].mean())


def _reference_stream(scores, n_scores, ood_bank, id_bank):
    """The official per-image bookkeeping: (decisions, ID bank ids, OOD bank ids)."""
    queue, bank_id, bank_ood, decisions = [], [], [], []
    for i, s in enumerate(scores):
        queue = (queue + [s])[-n_scores:]
        th, mu0, mu1 = _reference_split(queue)
        t = torch.tensor([s], dtype=torch.float32)  # official: a float32 tensor vs numpy
        is_id = bool(t >= th)
        if is_id and bool(t > mu1):
            bank_id = (bank_id + [i])[-id_bank:]
        if not is_id and bool(t < mu0):
            bank_ood = (bank_ood + [i])[-ood_bank:]
        decisions.append(is_id)
    return decisions, bank_id, bank_ood


def _bimodal(n: int, seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    ident = rng.random(n) < 0.5
    s = np.where(ident, rng.normal(0.72, 0.06, n), rng.normal(0.4, 0.08, n)).clip(0, 0.999)
    return [float(v) for v in s.astype(np.float32)]


def _f64(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# -- the threshold -------------------------------------------------------------------------
def test_grid_is_numpy_arange():
    assert THRESHOLD_GRID.tolist() == np.arange(0, 1, 0.01).tolist()


def test_threshold_hand_values():
    # two scores: every grid value in (0.2, 0.8] splits them with zero variance; the first
    assert score_threshold(_f64([0.2, 0.8])) == (21 * 0.01, 0.2, 0.8)
    # {0.1, 0.2} | {0.8}: variance 0.0025 x 2/3 beats {0.1} | {0.2, 0.8}: 0.09 x 2/3
    tau, mu0, mu1 = score_threshold(_f64([0.2, 0.8, 0.1]))
    assert (tau, mu1) == (21 * 0.01, 0.8) and mu0 == pytest.approx(0.15)
    # no split has two non-empty sides: the official fallback
    assert score_threshold(_f64([0.5])) == (0.0, 0.0, 1.0)
    assert score_threshold(_f64([0.5, 0.5, 0.5])) == (0.0, 0.0, 1.0)
    assert score_threshold(torch.tensor([], dtype=torch.float64)) == (0.0, 0.0, 1.0)


@pytest.mark.parametrize(("n", "seed"), [(3, 0), (40, 1), (512, 2)])
def test_threshold_matches_the_official_search(n, seed):
    queue = _bimodal(n, seed)
    tau, mu0, mu1 = score_threshold(torch.tensor(queue, dtype=torch.float64))
    ref = _reference_split(queue)
    assert tau == ref[0]
    assert (mu0, mu1) == pytest.approx(ref[1:], rel=1e-12)


# -- the banks -----------------------------------------------------------------------------
def test_bank_rules_on_a_hand_made_sequence(classifier):
    method = build_method(ROSITA, classifier, ood_bank=2)
    dim = method.head.shape[1]

    def tag(i):
        return torch.full((dim,), float(i))

    # 0.2: fallback split (0, 0, 1): judged ID, not strong; 0.8: split 0.21 / 0.2 / 0.8,
    # ID but not above mu1 (equal); 0.1: split 0.21 / 0.15 / 0.8: strong OOD; 0.9: split
    # 0.21 / 0.15 / 0.85: strong ID; 0.05 and 0.06: strong OOD, the OOD bank keeps 2
    expected_id = [True, True, False, True, False, False]
    for i, s in enumerate([0.2, 0.8, 0.1, 0.9, 0.05, 0.06]):
        is_id, _ = method.observe(float(np.float32(s)), tag(i))
        assert is_id == expected_id[i]
    assert method.bank_id[:, 0].tolist() == [3.0]
    assert method.bank_ood[:, 0].tolist() == [4.0, 5.0]
    assert method.queue.shape == (6,)


def test_banks_and_decisions_match_the_reference_on_a_long_stream(classifier):
    n_scores, ood_bank, k_p = 50, 7, 2
    method = build_method(ROSITA, classifier, n_scores=n_scores, ood_bank=ood_bank, k_p=k_p)
    id_bank = k_p * classifier.num_classes
    scores = _bimodal(300, 5)
    dim = method.head.shape[1]
    decisions = [method.observe(s, torch.full((dim,), float(i)))[0] for i, s in enumerate(scores)]
    ref_decisions, ref_id, ref_ood = _reference_stream(scores, n_scores, ood_bank, id_bank)
    assert decisions == ref_decisions
    assert method.bank_id[:, 0].long().tolist() == ref_id and len(ref_id) == id_bank
    assert method.bank_ood[:, 0].long().tolist() == ref_ood and len(ref_ood) == ood_bank
    assert len(method.queue) == n_scores


# -- ReDUCe --------------------------------------------------------------------------------
def test_reduce_loss_hand_values():
    f = torch.tensor([1.0, 0.0, 0.0])
    positives = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.6, 0.8, 0.0]])
    negatives = torch.tensor([[0.8, 0.6, 0.0], [0.0, 0.0, 1.0], [-1.0, 0.0, 0.0]]) * 2.0
    lse = math.log(math.exp(0.8) + math.exp(0.0))  # the 2 nearest negatives (renormalised)
    assert float(reduce_loss(f, positives, negatives, 2, 2)) == pytest.approx(
        ((-1.0 + lse) + (-0.6 + lse)) / 2
    )
    # the mask zeroes the second positive (index 2), the mean still over k_p = 2
    loss = reduce_loss(f, positives, negatives, 2, 2, lambda idx: idx == 1)
    assert float(loss) == pytest.approx((-1.0 + lse) / 2)
    # k_n beyond the bank: all of it
    lse3 = math.log(math.exp(0.8) + 1.0 + math.exp(-1.0))
    assert float(reduce_loss(f, positives, negatives, 1, 9)) == pytest.approx(-1.0 + lse3)


# -- the method on the tiny model ----------------------------------------------------------
def test_step_shapes_scores_and_decisions(classifier, noisy_images):
    method = build_method(ROSITA, classifier)
    out = method.step(noisy_images)
    assert out.shape == (6, classifier.num_classes) and torch.isfinite(out).all()
    assert method.last_ood_score.shape == (6,) and method.last_ood_decision.shape == (6,)
    assert method.last_ood_decision.dtype == torch.bool
    with torch.no_grad():
        first = (classifier.encode_image(noisy_images[:1]) @ classifier.class_embeddings.t()).max()
    assert float(method.last_ood_score[0]) == pytest.approx(float(first), abs=1e-6)
    assert method.last_ood_score.tolist() == method.queue.tolist()  # each image's own score
    assert method.last_ood_decision[0]  # the fallback split (tau 0) judges the first ID
    scores = method.predict(noisy_images)
    assert scores.shape == out.shape and method.last_ood_score.shape == (6,)


def test_batch_is_a_sequence_of_single_image_steps(classifier, noisy_images):
    batched = build_method(ROSITA, classifier)
    single = build_method(ROSITA, classifier)
    batched.reseed(7)
    out = batched.step(noisy_images)
    views = random_resized_crops(noisy_images, 1, torch.Generator().manual_seed(7), flip=True)[0]
    rows = []
    for i in range(6):
        single.step_one(noisy_images[i : i + 1], views[i : i + 1])
        rows.append(single._logits(noisy_images[i : i + 1]))
    assert torch.equal(out, torch.cat(rows))


def test_one_update_matches_an_autograd_recomputation(classifier, test_images, noisy_images):
    """A strong ID image with both banks ready: pseudo-label CE on the image and its view
    plus 0.5 x masked ReDUCe, one SGD step (lr 1e-3) on the vision LayerNorms; recomputed
    on a copy of the model with the formulas written here."""
    method = build_method(ROSITA, classifier)
    images = test_images[0]
    with torch.no_grad():
        bank = classifier.encode_image(torch.cat([images[6:13], noisy_images]))
    method.bank_id, method.bank_ood = bank[:7].clone(), bank[7:].clone()
    method.queue = torch.tensor([0.1] * 10 + [0.5] * 10, dtype=torch.float64)
    image = images[:1]
    view = random_resized_crops(image, 1, torch.Generator().manual_seed(0), flip=True)[0]

    ref = copy.deepcopy(classifier)
    params = [
        p for m in ref.visual.modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters()
    ]
    for p in params:
        p.requires_grad_(True)
    head = classifier.class_embeddings
    feats = ref.encode_image(torch.cat([image, view]))
    cos = feats @ head.t()
    label = cos[0].argmax().reshape(1)
    top = float(cos[0].detach().max())
    assert top > (5.0 + top) / 11  # strong ID: above mu1
    loss = F.cross_entropy(cos[:1], label) + F.cross_entropy(cos[1:], label)
    positives = torch.cat([bank[:7], feats[:1].detach()])  # the image joins its bank first
    sim_pos, idx = (feats[0] @ positives.t()).topk(5)
    mask = (positives[idx] @ head.t()).argmax(dim=-1) == label
    lse = torch.log(torch.exp((feats[0] @ bank[7:].t()).topk(5).values).sum())
    loss = loss + 0.5 * ((-sim_pos + lse) * mask).mean()
    assert 0 < int(mask.sum()) < 5  # both masked and counted positives
    grads = torch.autograd.grad(loss, params)

    score, is_id = method.step_one(image, view)
    assert is_id and score == pytest.approx(top, abs=1e-6)
    assert float(method.last_loss) == pytest.approx(loss.item(), abs=1e-6)
    for p, g, q in zip(method.params, grads, params):
        torch.testing.assert_close(p, q.detach() - 1e-3 * g, rtol=0, atol=1e-7)


def test_reset_restores_queue_banks_and_parameters(classifier, noisy_images):
    def build():
        return build_method(ROSITA, classifier)

    _, used, _ = assert_reset_then_reseed_reproduces(build, noisy_images)
    used.reset()
    assert_params_at_snapshot(used)
    assert len(used.queue) == 0 and len(used.bank_id) == 0 and len(used.bank_ood) == 0


def test_same_seed_same_output(classifier, noisy_images):
    a, b = build_method(ROSITA, classifier), build_method(ROSITA, classifier)
    assert_same_seeded_steps(a, b, noisy_images, seed=2, atol=0)
    assert torch.equal(a.last_ood_score, b.last_ood_score)


def test_bad_config_values_are_refused(classifier):
    with pytest.raises(ValueError, match=r"method\.k_p=0 is out of range"):
        ROSITA(classifier, ROSITAConfig(k_p=0))
    with pytest.raises(ValueError, match=r"unknown method\.text_head='clip'"):
        ROSITA(classifier, ROSITAConfig(text_head="clip"))
    with pytest.raises(ValueError, match=r"method\.lr=0\.0 is out of range"):
        ROSITA(classifier, ROSITAConfig(lr=0.0))
