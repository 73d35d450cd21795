"""BoostAdapter (mura_plugin/methods/boostadapter.py) on the real tiny model: its combined
logits on hand-made caches and its per-image steps against a separate rendering of the
official runner.py (list caches, ``update_cache`` / ``compute_cache_logits``), the rules
per dataset, a run through the real runner (defaults and TTA-VLM settings), reset and
seeding."""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch
from method_runs import run_method, seeded_step

from mura_plugin.methods._cache import EntropyCache as _Cache
from mura_plugin.methods._view_budget import configured_views
from mura_plugin.methods.boostadapter import (
    BoostAdapter,
    _FifoCache,
    _view_settings,
    boosted_cache,
    official_input,
)
from tta_bench.run.profiles import method_settings


# -- the official cache code, written separately (python lists, numpy float64) -------------
def _update(cache, pred, item, capacity, fifo):
    """runner.py's update_cache: append; FIFO keeps the latest ``capacity``, else a stable
    sort by entropy (item[1]) keeps the lowest."""
    if pred in cache:
        cache[pred].append(item)
        if fifo:
            if len(cache[pred]) > capacity:
                cache[pred] = cache[pred][1:]
        else:
            cache[pred] = sorted(cache[pred], key=lambda it: it[1])[:capacity]
    else:
        cache[pred] = [item]


def _cache_logits(feature, cache, alpha, beta, classes, mask=None):
    """runner.py's compute_cache_logits: one-hot values, or the masks of the stored
    probabilities (item[2]) for the negative cache."""
    keys, values = [], []
    for cls in sorted(cache):
        for item in cache[cls]:
            keys.append(item[0])
            if mask is None:
                values.append(np.eye(classes)[cls])
            else:
                values.append(((item[2] > mask[0]) & (item[2] < mask[1])).astype(float))
    if not keys:
        return np.zeros(classes)
    affinity = np.asarray(keys) @ feature
    return alpha * np.exp(-(beta - beta * affinity)) @ np.asarray(values)


def _unit(rng, n, d):
    x = rng.normal(size=(n, d))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _build(classifier, dataset=None, **overrides):
    model = copy.deepcopy(classifier)
    model.dataset = dataset
    method = BoostAdapter(model, dataclasses.replace(BoostAdapter.Config(), **overrides))
    method.setup()
    return method


def test_combined_logits_on_hand_made_caches(classifier):
    """3 classes in 4-d: a positive cache of 2 shots (4 offers, one eviction), 3
    boosting samples with delta 1 (one evicting a historical entry of class 0, one beaten,
    one of a class the history lacks), a FIFO negative cache of 2 shots (3 offers to one
    class). The combined logits equal the official arithmetic on the official lists."""
    rng = np.random.default_rng(0)
    c, d = 3, 4
    keys = _unit(rng, 10, d)
    feature, clip_logits = _unit(rng, 1, d)[0], np.array([1.0, 0.5, -0.25])
    hist = [(0, 0, 0.5), (0, 1, 0.25), (1, 2, 0.75), (0, 3, 0.375)]  # (class, key, entropy)
    boost = [(0, 4, 0.125), (0, 5, 0.625), (2, 6, 0.5), (0, 7, 0.3)]
    probs = [np.array([0.02, 0.9, 0.08]), np.array([0.1, 0.5, 0.4]), np.array([0.5, 0.3, 0.2])]
    neg = [(1, 8, 0.3, probs[0]), (1, 9, 0.4, probs[1]), (1, 1, 0.35, probs[2])]
    a_pos, b_pos, a_neg, b_neg, shots, delta = 2.0, 5.0, 0.117, 1.0, 2, 1

    ref_pos, ref_neg = {}, {}
    for cls, k, ent in hist:
        _update(ref_pos, cls, (keys[k], ent), shots, fifo=False)
    ref_boost = copy.deepcopy(ref_pos)
    for cls, k, ent in boost:
        _update(ref_boost, cls, (keys[k], ent), shots + delta, fifo=False)
    for cls, k, ent, p in neg:
        _update(ref_neg, cls, (keys[k], ent, p), 2, fifo=True)
    expected = (
        clip_logits
        + _cache_logits(feature, ref_boost, a_pos, b_pos, c)
        - _cache_logits(feature, ref_neg, a_neg, b_neg, c, mask=(0.03, 1.0))
    )

    method = _build(
        classifier, pos_alpha=a_pos, pos_beta=b_pos, neg_alpha=a_neg, neg_beta=b_neg,
        scale_alpha=False,
    )  # fmt: skip
    t = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    eye = torch.eye(c)
    pos = _Cache(c, shots, d, c, "cpu")
    for cls, k, ent in hist:
        pos.offer(cls, t(keys[k]), ent, eye[cls])
    method.neg = _FifoCache(c, 2, d, c, "cpu")
    for cls, k, ent, p in neg:
        method.neg.offer(cls, t(keys[k]), ent, t((p > 0.03) & (p < 1.0)))
    boosted = boosted_cache(
        pos,
        t(keys[[k for _, k, _ in boost]]),
        torch.tensor([cls for cls, _, _ in boost]),
        t([ent for _, _, ent in boost]),
        delta,
    )
    got = method.final_logits(t(feature), t(clip_logits), boosted)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-6)
    # the copy: class 0 holds keys 4, 7, 1 (key 3 evicted), class 2 key 6; the history is
    # untouched; the FIFO cache holds the latest two negatives (keys 9 and 1)
    assert sorted(np.round(ref_boost[0][i][1], 3) for i in range(3)) == [0.125, 0.25, 0.3]
    assert int(torch.isfinite(boosted.entropy).sum()) == 5
    assert int(torch.isfinite(pos.entropy).sum()) == 3
    held = method.neg.keys[1][torch.isfinite(method.neg.entropy[1])]
    order = held[:, 0].argsort()
    want = t(keys[[9, 1]])
    torch.testing.assert_close(held[order], want[want[:, 0].argsort()])
    # without the boosting samples (TDA's positive term) the logits differ: the check bites
    tda_like = method.final_logits(t(feature), t(clip_logits), pos)
    assert not torch.allclose(tda_like, got, atol=1e-3)


def _official_steps(model, head, images, method, generator_seed):
    """runner.py ``--mode boostadapter`` with the original image as the query
    (``infer_ori_image``), per image in order, on the model's features of the same views."""
    cfg = method.config
    gen = torch.Generator().manual_seed(generator_seed)
    views = configured_views(images, _view_settings(cfg), gen)
    v, b = views.shape[:2]
    with torch.no_grad():
        feats = model.encode_image(views.flatten(0, 1)).double().view(v, b, -1).numpy()
    scale = float(model.logit_scale)
    ratio = scale / 100.0
    c = head.shape[0]
    pos, neg, out = {}, {}, []
    for i in range(b):
        f = feats[:, i]  # [V, D]
        logits = scale * f @ head.T  # [V, C]
        top = logits.max(1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(1, keepdims=True))
        ent = -(np.exp(logp) * logp).sum(1)
        pred, loss, prob = int(logits[0].argmax()), ent[0], np.exp(logp[0])
        _update(pos, pred, (f[0], loss), cfg.pos_shots, fifo=False)
        cur = copy.deepcopy(pos)
        for j in np.argsort(ent, kind="stable")[: int(v * 0.1)]:
            _update(cur, int(logits[j].argmax()), (f[j], ent[j]), cfg.pos_shots + 3, fifo=False)
        if 0.2 < loss / math.log2(c) < 0.5:
            _update(neg, pred, (f[0], loss, prob), 2, fifo=True)
        final = logits[0] + _cache_logits(f[0], cur, 2.0 * ratio, 5.0, c)
        final -= _cache_logits(f[0], neg, 0.117 * ratio, 1.0, c, mask=(0.03, 1.0))
        out.append(final)
    return np.stack(out), pos, neg


def test_steps_equal_the_official_runner(classifier, test_images):
    """Six noisy digits in one batch (per image in order): the logits of the official
    procedure on the same 64 views; the negative cache is used on the way."""
    images, _ = test_images
    noise = torch.randn(6, *images.shape[1:], generator=torch.Generator().manual_seed(1))
    x = (images[:6] + 0.35 * noise).clamp(0, 1)
    method = _build(classifier, dataset="digits")
    assert (method.input, method.delta, method.pos_alpha) == ("original", 3, 2.0)
    method.reseed(5)
    got = method.step(x)
    expected, _, neg = _official_steps(
        method.model, method.head.double().numpy(), x, method, generator_seed=5
    )
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4, atol=1e-4)
    assert neg, "no negative entry: pick other images for this test"


@pytest.mark.parametrize(
    ("dataset", "input_", "per_image", "alpha_beta_delta"),
    [
        ("digits", "original", 64, (2.0, 5.0, 3)),
        ("imagenet_c", "original", 64, (2.0, 5.0, 3)),
        ("imagenet", "single", 1, (2.0, 5.0, 3)),
        ("imagenet_a", "confident", 64, (2.0, 5.0, 3)),
        ("imagenet_v2", "confident", 64, (1.0, 8.0, 1)),
        ("imagenet_r", "confident", 64, (1.0, 8.0, 3)),
        ("imagenet_sketch", "confident", 64, (2.363, 7.45, 1)),
    ],
)
def test_rules_follow_the_dataset(classifier, test_images, dataset, input_, per_image,
                                  alpha_beta_delta):  # fmt: skip
    assert official_input(dataset) == input_
    model = copy.deepcopy(classifier)
    model.dataset = dataset
    seen = []
    model.visual.register_forward_hook(lambda _m, args, _out: seen.append(len(args[0])))
    method = BoostAdapter(model, BoostAdapter.Config())
    method.setup()
    assert (method.pos_alpha, method.pos_beta, method.delta) == alpha_beta_delta
    method.reseed(0)
    out = method.step(test_images[0][:2])
    assert sum(seen) == 2 * per_image
    assert out.shape == (2, 10) and torch.isfinite(out).all()


def test_tta_vlm_settings(classifier):
    from tta_bench.run.profiles import method_rule

    settings = method_settings("tta_vlm", "boostadapter")
    assert settings == {"input": "original", "entropy_eps": 1e-5, "default_delta": 1}
    config, applied = method_rule("boostadapter", BoostAdapter.Config(), "tta_vlm")("dtd")
    assert applied == {**settings, "augmix": True}  # AugMix: fine-grained sets
    digits = _build(classifier, dataset="digits", **settings)
    assert (digits.input, digits.delta, digits.config.entropy_eps) == ("original", 1, 1e-5)
    inet = _build(classifier, dataset="imagenet_a", **settings)
    assert (inet.input, inet.delta) == ("original", 3)
    assert _build(classifier, dataset="imagenet", **settings).delta == 1
    assert not BoostAdapter.light and not BoostAdapter.adapts
    assert BoostAdapter.stream_kind == "online"
    with pytest.raises(ValueError, match="available: official, single, original, confident"):
        _build(classifier, input="all")


def test_reset_returns_to_setup_and_seeding_is_deterministic(classifier, test_images):
    images = test_images[0]
    expected = seeded_step(_build(classifier, dataset="digits"), images[:4], 7)
    used = _build(classifier, dataset="digits")
    for seed in (1, 2):
        seeded_step(used, images[4 * seed : 4 * seed + 4], seed)
    assert torch.isfinite(used.pos.entropy).any()
    used.reset()
    assert not torch.isfinite(used.pos.entropy).any()
    assert not torch.isfinite(used.neg.entropy).any()
    torch.testing.assert_close(seeded_step(used, images[:4], 7), expected, rtol=0, atol=0)


@pytest.mark.parametrize("tta_vlm", [False, True])
def test_runs_through_the_runner(tmp_path, tta_vlm):
    record = run_method(tmp_path, "boostadapter", tta_vlm=tta_vlm)
    if tta_vlm:  # the harness's TTA-VLM option: single prompt, batch 1, tta_vlm values
        assert record["config"]["profile_applied"]["protocol.batch_size"] == 1
    [cell] = record["cells"]
    assert cell["n"] == 32 and 0.0 <= cell["accuracy"] <= 1.0
    assert math.isfinite(cell["nll"])
    assert record["method_resolved"]["delta"] == (1 if tta_vlm else 3)


def test_text_heads(classifier):
    method = _build(classifier)
    torch.testing.assert_close(method.class_embeddings(), classifier.class_embeddings)
    official = _build(classifier, text_head="official")  # no official loader: one prompt
    single = classifier.encode_templates(["a photo of a {}."])
    torch.testing.assert_close(official.class_embeddings(), single, rtol=0, atol=0)
