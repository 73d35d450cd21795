"""OGA (mura_plugin/methods/oga.py): the memory's write rule by hand; the Gaussian
estimates (class means, shared covariance, the ridge / pseudo-inverse precision and its
switch at n = 4d), the log-likelihoods and the MAP against a numpy reference; a stream on
the real tiny model against the official batch loop written out in numpy; the official
heads by catalogue name; reset, the feature path, bad values, the runner end to end."""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch
from method_runs import run_method

from mura_plugin.methods.oga import (
    OFFICIAL_TEMPLATES,
    OGA,
    GaussianMemory,
    class_means,
    gaussian_log_probs,
    official_templates,
    precision_matrix,
    shared_covariance,
)


def _build(classifier, **kw) -> OGA:
    method = OGA(copy.deepcopy(classifier), dataclasses.replace(OGA.Config(), **kw))
    method.setup()
    return method


# -- numpy reference of GaussAdapt ----------------------------------------------------------
def _np_means(mem, state, previous):
    """__update_mu: mean over *all* slots (empty ones count as 0) where >= 2 are filled."""
    mus = previous.copy()
    for k in range(mem.shape[0]):
        if state[k].sum() >= 2:
            mus[k] = (mem[k] * state[k][:, None]).sum(0) / mem.shape[1]
    return mus


def _np_precision(mem, state, mus, sig_type):
    """__update_sigma: None when no class holds 3; else the precision matrix."""
    if not (state.sum(1) > 2).any():
        return None
    rows = [
        mem[k, s] - mus[k] for k in range(mem.shape[0]) for s in range(mem.shape[1]) if state[k, s]
    ]
    x = np.array(rows)
    n, d = x.shape
    cov = np.cov(x, rowvar=False)  # centred on the rows' mean, over n - 1
    ridge = d * np.linalg.pinv((n - 1) * cov + np.trace(cov) * np.eye(d))
    if sig_type == "Ridge" or (sig_type == "RidgeMoorePenrose" and n <= 4 * d):
        return ridge
    return np.linalg.pinv(cov)


def _np_log_probs(x, mus, prec):
    return np.array([[-0.5 * (xi - m) @ prec @ (xi - m) for m in mus] for xi in x])


def _memory(k, s, d, counts, seed):
    rng = np.random.default_rng(seed)
    mem = np.zeros((k, s, d))
    state = np.zeros((k, s), dtype=bool)
    for cls, n in enumerate(counts):
        mem[cls, :n] = rng.normal(size=(n, d))
        state[cls, :n] = True
    return mem, state


@pytest.mark.parametrize(
    ("counts", "sig_type"),
    [
        ((3, 1, 2), "RidgeMoorePenrose"),  # n = 6 <= 4d = 8: the ridge
        ((4, 3, 4), "RidgeMoorePenrose"),  # n = 11 > 8: the pseudo-inverse
        ((4, 3, 4), "Ridge"),
        ((3, 0, 2), "MoorePenrose"),
    ],
)
def test_gaussian_estimates_match_numpy(counts, sig_type):
    k, s, d = 3, 4, 2
    mem, state = _memory(k, s, d, counts, seed=sum(counts))
    previous = np.random.default_rng(9).normal(size=(k, d))
    mus = _np_means(mem, state, previous)
    expected = _np_precision(mem, state, mus, sig_type)

    feats, filled = torch.tensor(mem), torch.tensor(state)
    got_mus = class_means(feats, filled, torch.tensor(previous), normalize=False)
    np.testing.assert_allclose(got_mus.numpy(), mus, rtol=1e-12, atol=1e-12)
    if counts[1] < 2:  # a class with fewer than 2 keeps its previous mean
        np.testing.assert_array_equal(got_mus[1].numpy(), previous[1])
    cov, n = shared_covariance(feats, filled, got_mus)
    assert n == sum(counts)
    np.testing.assert_allclose(cov.numpy(), np.cov(_centred(mem, state, mus), rowvar=False))
    np.testing.assert_allclose(precision_matrix(cov, n, sig_type).numpy(), expected, rtol=1e-9)
    x = np.random.default_rng(1).normal(size=(5, d))
    np.testing.assert_allclose(
        gaussian_log_probs(torch.tensor(x), got_mus, torch.tensor(expected)).numpy(),
        _np_log_probs(x, mus, expected),
        rtol=1e-10,
        atol=1e-10,
    )


def _centred(mem, state, mus):
    return np.concatenate([mem[k][state[k]] - mus[k] for k in range(mem.shape[0])])


def test_normalized_means_and_the_ridge_switch_point():
    mem, state = _memory(2, 5, 2, (5, 3), seed=3)
    got = class_means(torch.tensor(mem), torch.tensor(state), torch.zeros(2, 2).double(), True)
    raw = _np_means(mem, state, np.zeros((2, 2)))
    np.testing.assert_allclose(got.numpy(), raw / np.linalg.norm(raw, axis=1, keepdims=True))
    cov = torch.tensor(np.cov(_centred(mem, state, raw), rowvar=False))
    ridge = precision_matrix(cov, 8, "RidgeMoorePenrose")  # n = 8 = 4d: still the ridge
    torch.testing.assert_close(ridge, precision_matrix(cov, 8, "Ridge"))
    torch.testing.assert_close(
        precision_matrix(cov, 9, "RidgeMoorePenrose"), torch.linalg.pinv(cov)
    )


def test_memory_fills_in_order_then_replaces_the_first_highest_entropy_slot():
    head = torch.eye(3, 2)
    mem = GaussianMemory(head, shots=3)
    assert mem.entropy[0].tolist() == pytest.approx([math.log(3)] * 3)
    assert not mem.offer(torch.ones(2), math.log(3), 0)  # not below ln K: never stored
    for i, ent in enumerate([0.5, 0.9, 0.9]):
        assert mem.offer(torch.tensor([float(i), 0.0]), ent, 0)
    assert mem.filled[0].tolist() == [True] * 3 and not mem.filled[1:].any()
    assert not mem.offer(torch.tensor([7.0, 7.0]), 0.9, 0)  # equal to the top: dropped
    assert mem.offer(torch.tensor([8.0, 8.0]), 0.2, 0)  # the first of the tied 0.9 slots
    assert mem.entropy[0].tolist() == pytest.approx([0.5, 0.2, 0.9])
    assert mem.features[0, 1].tolist() == [8.0, 8.0]
    # the means move only once a class holds 2; the precision once one holds 3
    mem.refresh("RidgeMoorePenrose", False)
    torch.testing.assert_close(mem.means[0], mem.features[0].sum(0) / 3)
    torch.testing.assert_close(mem.means[1:], head[1:])
    assert not torch.equal(mem.precision, 2 * torch.eye(2))


# -- a stream against the official batch loop -----------------------------------------------
def _np_stream(batches, text, scale, shots, tau, sig_type="RidgeMoorePenrose"):
    """runner.run's OGA loop (update the memory with the batch, then predict it) in numpy
    float64: the log of the MAP ``z`` per sample."""
    k, d = text.shape
    mem, state = np.zeros((k, shots, d)), np.zeros((k, shots), dtype=bool)
    ents = np.full((k, shots), math.log(k))
    mus, prec = text.copy(), d * np.eye(d)
    out = []
    for f in batches:
        logits = scale * f @ text.T
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        h = -(np.log(p + 1e-9) * p).sum(1)
        updated = False
        for i, label in enumerate(p.argmax(1)):
            if (h[i] < ents[label]).any():
                slot = int(np.argmax(ents[label]))
                mem[label, slot], ents[label, slot], state[label, slot] = f[i], h[i], True
                updated = True
        if updated:
            mus = _np_means(mem, state, mus)
            new = _np_precision(mem, state, mus, sig_type)
            prec = prec if new is None else new
        g = np.exp(tau * _np_log_probs(f, mus, prec))
        g /= g.sum(1, keepdims=True)
        z = p * g
        out.append(np.log(z / z.sum(1, keepdims=True)))
    return np.concatenate(out), state


def test_stream_equals_the_official_loop(classifier, test_images):
    x, _ = test_images
    images = x[:96] + 0.3 * torch.randn(x[:96].shape, generator=torch.Generator().manual_seed(2))
    images = images.clamp(0, 1)
    oga = _build(classifier, shots=3)
    got = torch.cat([oga.step(images[i : i + 16]) for i in range(0, 96, 16)])
    with torch.no_grad():
        feats = classifier.encode_image(images).double()
    feats = (feats / feats.norm(dim=-1, keepdim=True)).numpy()
    text = oga.head.double().numpy()
    batches = [feats[i : i + 16] for i in range(0, 96, 16)]
    expected, state = _np_stream(batches, text, float(classifier.logit_scale), 3, 0.05)
    assert (state.sum(1) > 2).any()  # the precision moved
    np.testing.assert_array_equal(oga.memory.filled.numpy(), state)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4, atol=1e-4)
    zero_shot = classifier(images).log_softmax(-1)
    assert not torch.allclose(got[-16:], zero_shot[-16:], atol=1e-3)  # the Gaussian term acts


# -- heads, contract ------------------------------------------------------------------------
def test_official_heads_are_keyed_by_registered_dataset_names(classifier):
    from tta_bench.registry import registry

    names = set(registry("datasets").names())
    assert set(OFFICIAL_TEMPLATES) <= names
    # OGA's loaders keep their data in Flower102/, its CuPL file is "flowers102": the
    # catalogue's name is the key
    assert official_templates("oxford_flowers") == ["a photo of a {}, a type of flower."]
    assert official_templates("dtd") == ["{} texture"]  # no full stop, as released
    assert official_templates("digits") == ["a photo of a {}."]
    model = copy.copy(classifier)
    model.dataset = "oxford_flowers"  # the classes are the digits'; only the head is checked
    method = OGA(model, dataclasses.replace(OGA.Config(), text_head="official"))
    method.setup()
    expected = model.encode_templates(["a photo of a {}, a type of flower."]).float()
    torch.testing.assert_close(method.class_embeddings(), expected)


def test_reset_returns_to_setup_and_outputs_repeat(classifier, noisy_images):
    fresh = _build(classifier)
    expected = fresh.step(noisy_images)
    assert expected.shape == (6, 10) and torch.isfinite(expected).all()
    torch.testing.assert_close(expected.exp().sum(-1), torch.ones(6))
    used = _build(classifier)
    used.step(noisy_images.flip(0))
    assert used.memory.filled.any()
    used.reset()
    assert not used.memory.filled.any()
    torch.testing.assert_close(used.memory.means, used.head)
    assert torch.equal(used.memory.precision, 64 * torch.eye(64))
    assert torch.equal(used.step(noisy_images), expected)
    assert used.predict(noisy_images).shape == (6, 10)


def test_feature_path_equals_the_image_path(classifier, noisy_images):
    oga = _build(classifier)
    assert oga.features_only()  # float32 on the CPU
    out = oga.step(noisy_images)
    with torch.no_grad():
        feats = classifier.encode_image(noisy_images)
    torch.testing.assert_close(_build(classifier).step_features(feats), out, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("field", "value"), [("tau", 0.0), ("shots", 0), ("sig_type", "ridge"), ("text_head", "x")]
)
def test_bad_values_are_refused_by_name(classifier, field, value):
    with pytest.raises(ValueError, match=field):
        OGA(classifier, dataclasses.replace(OGA.Config(), **{field: value}))


def test_runs_through_the_runner_with_its_defaults(tmp_path):
    record = run_method(tmp_path, "oga")
    [cell] = record["cells"]
    assert cell["n"] == 32 and 0.0 <= cell["accuracy"] <= 1.0
    assert math.isfinite(cell["nll"])
