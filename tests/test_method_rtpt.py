"""R-TPT (mura_plugin.methods.rtpt) on the real tiny model and digits data."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest
import torch
from method_runs import (
    FAST,
    assert_batched_episodes_equal_sequential,
    assert_reset_then_reseed_reproduces,
    build_method,
    run_method,
    scored_cell,
    seeded_step,
)

from mura_plugin.methods.rtpt import RTPT, reliability_ensemble, reliability_weights
from tta_bench.run.profiles import method_settings

_build = functools.partial(build_method, RTPT)


def _weights_numpy(feats: np.ndarray, k: int, temperature: float) -> np.ndarray:
    """Reference for one sample: feats [V, D] normalised -> weights [V]."""
    v = feats.shape[0]
    scores = []
    for i in range(v):
        others = sorted((float(feats[i] @ feats[j]) for j in range(v) if j != i), reverse=True)
        scores.append(np.mean(others[: min(k, v - 1)]))
    z = np.array(scores) / temperature
    e = np.exp(z - z.max())
    return e / e.sum()


def test_reliability_weights_known_values():
    # four unit vectors in the plane at angles 0, 10, 20, 90 degrees
    angles = np.deg2rad([0.0, 10.0, 20.0, 90.0])
    f = np.stack([np.cos(angles), np.sin(angles)], axis=1)  # [V, D]
    c10, c20, c70, c80 = (math.cos(math.radians(a)) for a in (10, 20, 70, 80))
    # k = 2 nearest others: view0 (c10 + c20), view1 (c10 + c10), view2 (c10 + c20),
    # view3 (c70 + c80)
    scores = np.array([c10 + c20, 2 * c10, c10 + c20, c70 + c80]) / 2
    z = scores / 0.1
    expected = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    feats = torch.tensor(f, dtype=torch.float32)[:, None]  # [V, 1, D]
    got = reliability_weights(feats, neighbours=2, temperature=0.1)
    assert got.shape == (4, 1)
    np.testing.assert_allclose(got[:, 0].numpy(), expected, rtol=0, atol=1e-6)
    assert int(got[:, 0].argmax()) == 1  # the view between two close ones is most reliable
    # the ensemble of hand-made logits with those weights
    logits = torch.tensor([[[2.0, 0.0]], [[1.0, 1.0]], [[0.0, 3.0]], [[5.0, -5.0]]])
    ens = reliability_ensemble(logits, feats, neighbours=2, temperature=0.1)
    np.testing.assert_allclose(
        ens[0].numpy(), (expected[:, None] * logits[:, 0].numpy()).sum(0), rtol=0, atol=1e-5
    )


def test_reliability_weights_against_a_reference_on_random_views():
    rng = np.random.default_rng(1)
    raw = rng.normal(size=(30, 3, 8)).astype(np.float32)  # V=30 views, B=3 samples
    raw /= np.linalg.norm(raw, axis=-1, keepdims=True)
    got = reliability_weights(torch.from_numpy(raw))  # the official k=20, temperature 0.01
    for b in range(3):
        np.testing.assert_allclose(
            got[:, b].numpy(), _weights_numpy(raw[:, b], 20, 0.01), rtol=0, atol=1e-5
        )
    assert torch.allclose(got.sum(dim=0), torch.ones(3))
    one = reliability_weights(torch.from_numpy(raw[:1]))
    assert torch.equal(one, torch.ones(1, 3))  # a single view: weight 1


def test_step_is_the_pointwise_entropy_update_then_the_ensemble(classifier, batch):
    """Reproduce one sample's episode by hand: the 10% lowest-entropy views (at least one)
    under the initial prompt, the mean of their entropies, one AdamW step on the context,
    then the reliability-weighted logits of all views under the updated prompt."""
    method = _build(classifier, views=15)
    image = batch[:1]
    method.reseed(2)
    feats = method.encode_views(method.make_views(image))[:, 0]  # [V, D]
    ctx = method.prompt.ctx.detach().clone().requires_grad_(True)
    opt = torch.optim.AdamW([ctx], lr=5e-3, weight_decay=0.01)
    scale = float(classifier.logit_scale)
    with torch.enable_grad():
        logits = scale * feats @ method.prompt(ctx).t()  # [V, C]
        logp = logits.log_softmax(dim=-1)
        ent = -(logp.exp() * logp).sum(dim=-1)
        chosen = ent.detach().argsort()[: int(16 * 0.1)]
        ent[chosen].mean().backward()
    opt.step()
    with torch.no_grad():
        tuned = (scale * feats @ method.prompt(ctx.detach()).t()).numpy()
    w = _weights_numpy(feats.numpy(), 20, 0.01)
    expected = (w[:, None] * tuned).sum(axis=0)
    method.reseed(2)
    got = method.step(image)
    np.testing.assert_allclose(got[0].numpy(), expected, rtol=0, atol=1e-4)
    # the prompt went back to its initial state after the episode
    assert torch.equal(method.prompt.ctx, method._snapshot["params"][0])
    # and the update mattered: the ensemble under the initial prompt differs
    with torch.no_grad():
        initial = (scale * feats @ method.prompt().t()).numpy()
    assert not np.allclose((w[:, None] * initial).sum(axis=0), expected, atol=1e-4)


def test_batched_episodes_equal_the_sequential_loop(classifier, batch):
    config = {**FAST, "chunk_views": 16}
    assert_batched_episodes_equal_sequential(functools.partial(_build, classifier, **config), batch)


def test_reset_and_seed_reproduce(classifier, batch):
    build = functools.partial(_build, classifier, **FAST)
    fresh, _, a = assert_reset_then_reseed_reproduces(build, batch)
    fresh.reset()
    assert torch.equal(a, seeded_step(fresh, batch, 5))


def test_class_attributes():
    assert RTPT.stream_kind == "episodic" and RTPT.adapts and not RTPT.light
    default = RTPT.Config()
    assert (default.views, default.selection, default.lr, default.steps) == (63, 0.1, 5e-3, 1)
    assert (default.loss, default.neighbours, default.temperature) == ("entropy", 20, 0.01)
    assert (default.precision, default.grad_scale, default.augmix) == ("fp32", None, False)
    tta = dataclasses.replace(default, **method_settings("tta_vlm", "rtpt"))
    assert (tta.precision, tta.grad_scale) == ("fp16", 1000.0)


@pytest.mark.parametrize("tta_vlm", [False, True])
def test_end_to_end_through_the_runner(tmp_path, tta_vlm):
    record = run_method(tmp_path, "rtpt", tta_vlm=tta_vlm, max_images=32)
    scored_cell(record)
