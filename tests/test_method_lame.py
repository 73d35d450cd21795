"""LAME (mura_plugin/methods/lame.py): the Laplacian fixed point against a float64 numpy
reference written from the paper's update, the three affinities against hand-built
kernels on points of the unit circle, the degenerate rbf bandwidth, a real step on the
tiny model (feature path, untouched model), reset, seeds and the reference defaults."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from method_runs import assert_reset_then_reseed_reproduces, build_method, seeded_step

from mura_plugin.methods.lame import (
    LAME,
    LAMEConfig,
    affinity_matrix,
    laplacian_assignment,
)

# -- the fixed point ----------------------------------------------------------------------


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def _reference_iterates(p: np.ndarray, w: np.ndarray, lam: float, n: int) -> np.ndarray:
    """Y_0 = softmax(log p), Y_{t+1} = softmax(log p + lam W Y_t), n updates (the bound
    optimisation of the paper's Laplacian-regularised likelihood), in float64."""
    log_p = np.log(p + 1e-10)
    y = _softmax(log_p)
    for _ in range(n):
        y = _softmax(log_p + lam * w @ y)
    return y


#: 4 samples, 3 classes: two confident samples of class 0 and 2, two ambiguous ones
#: linked to them; a non-symmetric kernel (sample 3 points at 0, not back).
PROBS = np.array([
    [0.80, 0.15, 0.05],
    [0.10, 0.20, 0.70],
    [0.40, 0.45, 0.15],
    [0.30, 0.35, 0.35],
])  # fmt: skip
KERNEL = np.array([
    [0.0, 0.0, 1.0, 0.0],
    [0.0, 0.0, 0.0, 1.0],
    [1.0, 0.0, 0.0, 0.0],
    [0.5, 1.0, 0.0, 0.0],
])  # fmt: skip


def _solve(lam: float, steps: int) -> np.ndarray:
    unary = -torch.log(torch.tensor(PROBS, dtype=torch.float32) + 1e-10)
    log_y, _ = laplacian_assignment(unary, torch.tensor(KERNEL, dtype=torch.float32), lam, steps)
    return log_y.exp().double().numpy()


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_the_first_updates_equal_the_reference(steps):
    # the stopping rule never acts before the third update
    expected = _reference_iterates(PROBS, KERNEL, 1.0, steps)
    np.testing.assert_allclose(_solve(1.0, steps), expected, rtol=0, atol=2e-7)


@pytest.mark.parametrize("lam", [1.0, 2.5])
def test_the_solve_reaches_the_fixed_point(lam):
    expected = _reference_iterates(PROBS, KERNEL, lam, 500)
    # a fixed point of the reference's map, not just some iterate
    np.testing.assert_allclose(
        _softmax(np.log(PROBS + 1e-10) + lam * KERNEL @ expected), expected, atol=1e-12
    )
    got = _solve(lam, 100)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    # the Laplacian term moved the ambiguous samples: sample 2 follows its neighbour 0
    assert PROBS[2].argmax() == 1 and got[2].argmax() == 0


def test_a_zero_lambda_returns_the_model_probabilities():
    np.testing.assert_allclose(_solve(0.0, 100), PROBS, rtol=0, atol=1e-6)


def test_the_stopping_rule_ends_early_and_runs_at_least_three_updates():
    unary = -torch.log(torch.tensor(PROBS, dtype=torch.float32) + 1e-10)
    kernel = torch.tensor(KERNEL, dtype=torch.float32)
    _, iterations = laplacian_assignment(unary, kernel, 1.0, 100)
    assert 3 <= iterations < 100
    # no Laplacian term: the energy is constant from the start, stop after the third
    assert laplacian_assignment(unary, torch.zeros(4, 4), 1.0, 100)[1] == 3


# -- the affinities -----------------------------------------------------------------------

#: Points on the unit circle (LAME normalises features); scaled copies give the same kernel.
ANGLES = np.array([0.0, 0.1, 0.35, 1.0, 2.2, 2.4])


def _points() -> tuple[torch.Tensor, np.ndarray]:
    xy = np.stack([np.cos(ANGLES), np.sin(ANGLES)], axis=1)
    scales = np.array([1.0, 3.0, 0.5, 2.0, 1.0, 7.0])[:, None]
    return torch.tensor(xy * scales, dtype=torch.float32), xy


def _chords(xy: np.ndarray) -> np.ndarray:
    diff = ANGLES[:, None] - ANGLES[None, :]
    return 2 * np.abs(np.sin(diff / 2))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_knn_affinity_marks_the_k_nearest_others(k):
    feats, xy = _points()
    d = _chords(xy)
    n = len(ANGLES)
    expected = np.zeros((n, n))
    for i in range(n):
        others = sorted((d[i, j], j) for j in range(n) if j != i)
        for _, j in others[:k]:
            expected[i, j] = 1.0
    got = affinity_matrix(feats, "knn", k).numpy()
    np.testing.assert_array_equal(got, expected)
    assert not np.array_equal(got, got.T)  # not symmetrised ...
    sym = affinity_matrix(feats, "knn", k, force_symmetry=True).numpy()
    np.testing.assert_array_equal(sym, (expected + expected.T) / 2)  # ... unless asked


@pytest.mark.parametrize("k", [2, 3, 5])
def test_rbf_bandwidth_is_the_mean_kth_distance_counting_the_sample_itself(k):
    feats, xy = _points()
    d = _chords(xy)
    sigma = np.mean([np.sort(row)[k - 1] for row in d])  # row's own 0 is the first
    expected = np.exp(-(d**2) / (2 * sigma**2))
    got = affinity_matrix(feats, "rbf", k).double().numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-6)
    assert np.all(np.diag(got) == 1.0)


def test_linear_affinity_is_the_cosine_gram_matrix():
    feats, _ = _points()
    expected = np.cos(ANGLES[:, None] - ANGLES[None, :])
    got = affinity_matrix(feats, "linear", 5).double().numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


def test_a_zero_rbf_bandwidth_takes_the_kernel_limit():
    # duplicates: every row's k-th distance is 0 (the official code divides 0 by 0)
    feats = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    same = torch.tensor([0, 0, 0, 1, 1])
    got = affinity_matrix(feats, "rbf", 2)
    torch.testing.assert_close(got, (same[:, None] == same[None, :]).float(), rtol=0, atol=0)
    one = affinity_matrix(feats[:1], "rbf", 5)
    assert torch.equal(one, torch.ones(1, 1))


# -- on the tiny model --------------------------------------------------------------------


@pytest.fixture(scope="module")
def lame_batch(noisy_images):
    return noisy_images


def test_a_step_on_the_tiny_model(classifier, lame_batch):
    method = build_method(LAME, classifier)
    before = {k: v.clone() for k, v in method.model.state_dict().items()}
    out = seeded_step(method, lame_batch, 0)
    assert out.shape == (lame_batch.shape[0], classifier.num_classes)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.exp().sum(dim=1), torch.ones(len(out)))  # log Y
    for key, value in method.model.state_dict().items():
        assert torch.equal(before[key], value), key
    with torch.no_grad():
        zero_shot = classifier(lame_batch).log_softmax(dim=-1)
    assert (out - zero_shot).abs().max() > 1e-3  # the Laplacian term acted
    # the feature path: the same logits from the cached features, bit for bit
    assert method.features_only()
    feats = classifier.encode_image(lame_batch).float()
    assert torch.equal(method.step_features(feats), out)
    # one image alone: a finite answer (rbf bandwidth 0 handled)
    assert torch.isfinite(method.step(lame_batch[:1])).all()


@pytest.mark.parametrize("affinity", ["knn", "linear"])
def test_every_affinity_steps(classifier, lame_batch, affinity):
    method = build_method(LAME, classifier, affinity=affinity, force_symmetry=True)
    out = method.step(lame_batch)
    assert torch.isfinite(out).all()


def test_reset_and_seeds(classifier, lame_batch):
    build = lambda: build_method(LAME, classifier)  # noqa: E731
    fresh, _, expected = assert_reset_then_reseed_reproduces(build, lame_batch)
    assert torch.equal(seeded_step(fresh, lame_batch, 9), expected)  # nothing random


def test_the_batch_is_one_problem(classifier, lame_batch):
    """Each sample's answer depends on the rest of its batch (the kernel couples them)."""
    method = build_method(LAME, classifier)
    whole = method.step(lame_batch)
    halves = torch.cat([method.step(lame_batch[:3]), method.step(lame_batch[3:])])
    assert not torch.allclose(whole, halves)


def test_defaults_are_the_reference_configuration():
    cfg = LAMEConfig()
    # reference conf.py LAME (= official defaults.py): AFFINITY rbf, KNN 5, FORCE_SYMMETRY
    # False; laplacian_optimization's bound_lambda 1, max_steps 100; float32
    assert (cfg.affinity, cfg.knn, cfg.force_symmetry) == ("rbf", 5, False)
    assert (cfg.bound_lambda, cfg.max_steps, cfg.precision) == (1.0, 100, "fp32")
    assert LAME.light and not LAME.adapts and LAME.stream_kind is None


def test_an_unknown_affinity_is_refused(classifier):
    with pytest.raises(ValueError, match="affinity"):
        LAME(copy.deepcopy(classifier), LAMEConfig(affinity="cosine"))
