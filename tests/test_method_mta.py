"""MTA (mura_plugin.methods.mta) on hand-made embeddings and on the real tiny model and data."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from method_runs import (
    FAST,
    assert_reset_then_reseed_reproduces,
    build_method,
    run_method,
    scored_cell,
    seeded_step,
)

from mura_plugin.methods._view_budget import configured_views
from mura_plugin.methods.mta import MTA, mta_bandwidth, mta_solve
from tta_bench.run.profiles import method_settings

_build = functools.partial(build_method, MTA)


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _official_numpy(x, logits, lambda_y=0.2, lambda_q=4.0, max_iter=5, th=1e-6):
    """The official ``solve_mta`` for one image, written again in float64 numpy with its
    control flow (outer loop of max_iter, inner loops stopping at th or max_iter)."""
    n = x.shape[0]
    dist = np.sqrt(((x[:, None, :] - x[None, :, :]) ** 2).sum(-1))
    k = int(0.3 * (n - 1))
    h = np.sqrt(0.5 * (np.sort(dist, axis=1)[:, 1 : k + 1] ** 2).mean(axis=1))
    p = _softmax(logits)
    a = p @ p.T
    y = np.ones(n) / n
    mode = x[0]

    def kernel(m):
        return np.exp(-(np.linalg.norm(x - m, axis=1) ** 2) / (2 * h**2))

    for _ in range(max_iter):
        density = kernel(mode)
        for i in range(1, max_iter + 1):
            old = y
            y = _softmax(1 / lambda_y * (density + lambda_q * (a * y[None, :]).sum(axis=1)))
            if np.linalg.norm(old - y) < th or i >= max_iter:
                break
        for i in range(1, max_iter + 1):
            old = mode
            w = kernel(mode) * y
            mode = (w[:, None] * x).sum(0) / w.sum()
            mode = mode / np.linalg.norm(mode)
            if np.linalg.norm(old - mode) < th or i >= max_iter:
                break
    return mode, y


def _unit(rows):
    x = np.asarray(rows, dtype=np.float64)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_one_iteration_known_values():
    """One outer iteration with one inlierness and one mode update, on 5 hand-made views in
    3-d, against the update equations computed by hand in numpy."""
    x = _unit([[1, 0, 0], [0.9, 0.1, 0], [0.8, 0, 0.2], [0, 1, 0], [0.7, 0.3, 0.1]])
    logits = np.array([[3.0, 0.0], [2.5, 0.5], [2.0, 0.0], [0.0, 3.0], [1.0, 1.0]])
    # bandwidth: k = int(0.3 * 4) = 1 nearest other view
    d2 = ((x[:, None] - x[None]) ** 2).sum(-1)
    np.fill_diagonal(d2, np.inf)
    h = np.sqrt(0.5 * d2.min(axis=1))
    got_h = mta_bandwidth(torch.tensor(x, dtype=torch.float32)[None])[0]
    np.testing.assert_allclose(got_h.numpy(), h, rtol=1e-5)
    p = _softmax(logits)
    a = p @ p.T
    density = np.exp(-((x - x[0]) ** 2).sum(1) / (2 * h**2))  # mode = the original
    y = _softmax((density + 4.0 * a @ (np.ones(5) / 5)) / 0.2)
    w = np.exp(-((x - x[0]) ** 2).sum(1) / (2 * h**2)) * y
    mode = (w[:, None] * x).sum(0) / w.sum()
    mode /= np.linalg.norm(mode)
    got_mode, got_y = mta_solve(
        torch.tensor(x, dtype=torch.float32)[None],
        torch.tensor(logits, dtype=torch.float32)[None],
        max_iter=1,
    )
    np.testing.assert_allclose(got_y[0].numpy(), y, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got_mode[0].numpy(), mode, rtol=0, atol=1e-6)
    # the outlier (view 3) weighs least, and the mode leaves the original towards the rest
    assert int(np.argmin(y)) == 3 and not np.allclose(mode, x[0])


def test_batched_solve_equals_the_official_loop_per_image():
    """Episodes with different early stops, solved together, equal the official loop run
    image by image (float64 numpy)."""
    rng = np.random.default_rng(0)
    xs, ls = [], []
    for spread in (0.05, 0.3, 1.0):  # tight views converge early, loose ones later
        centre = rng.normal(size=8)
        x = _unit(centre + spread * rng.normal(size=(12, 8)))
        xs.append(x)
        ls.append(10 * x @ _unit(rng.normal(size=(4, 8))).T)
    mode, y = mta_solve(
        torch.tensor(np.stack(xs), dtype=torch.float32),
        torch.tensor(np.stack(ls), dtype=torch.float32),
    )
    for i in range(3):
        ref_mode, ref_y = _official_numpy(xs[i], ls[i])
        np.testing.assert_allclose(mode[i].numpy(), ref_mode, rtol=0, atol=2e-5)
        np.testing.assert_allclose(y[i].numpy(), ref_y, rtol=0, atol=2e-5)


def test_prediction_is_the_mode_under_the_head(classifier, batch):
    method = _build(classifier, **FAST)
    method.reseed(2)
    out = method.step(batch)
    method.reseed(2)
    v = configured_views(batch, method.config, method.generator)
    with torch.no_grad():
        feats = method.model.encode_image(v.flatten(0, 1)).view(v.shape[0], 4, -1)
        feats = feats.transpose(0, 1)
        scale = method.model.logit_scale
        mode, _ = mta_solve(feats, scale * feats @ method.head.t())
        expected = scale * mode @ method.head.t()
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
    assert out.shape == (4, classifier.num_classes) and torch.isfinite(out).all()


def test_reset_and_seed_reproduce(classifier, batch):
    build = functools.partial(_build, classifier, **FAST)
    _, _, a = assert_reset_then_reseed_reproduces(build, batch)
    assert torch.equal(a, seeded_step(build(), batch, 5))  # and a third, new one


def test_class_attributes_and_defaults(classifier):
    assert MTA.stream_kind == "episodic" and not MTA.adapts and not MTA.light
    assert method_settings("tta_vlm", "mta") == {}
    d = MTA.Config()
    assert (d.views, d.include_original, d.augmix, d.lambda_y, d.lambda_q) == (
        63,
        True,
        False,
        0.2,
        4.0,
    )
    assert (d.max_iter, d.tol, d.neighbours, d.temperature, d.precision) == (
        5,
        1e-6,
        0.3,
        1.0,
        "fp16",
    )
    with pytest.raises(ValueError):
        _build(classifier, views=1, include_original=False)
    official = _build(classifier, text_head="official", **FAST)
    torch.testing.assert_close(
        official.head, classifier.encode_templates(["a photo of a {}."]), rtol=0, atol=0
    )


@pytest.mark.parametrize("augmix", [False, True])  # True: what TTA-VLM runs on fine-grained sets
def test_end_to_end_through_the_runner(tmp_path, augmix):
    assert method_settings("tta_vlm", "mta") == {}  # TTA-VLM runs the official setting
    views = ["method.augmix=true"] if augmix else []
    record = run_method(tmp_path, "mta", *views, max_images=8 if augmix else 16)
    scored_cell(record)
