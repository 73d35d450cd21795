"""ZS-NTTA / AdaND (mura_plugin/methods/zsntta.py) on the real tiny model: Otsu's threshold
and the detector's pseudo-labels against hand-computed values and a separate rendering of
the official search, the detector's Adam step against a numpy reference, the warm-up switch,
the batch-size-1 window, the noise injection, the feature path, reset, seeding, config
checks, and a run on digits-open through the real runner."""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch
from method_runs import assert_reset_then_reseed_reproduces, build_method, seeded_step

from mura_plugin.methods.zsntta import (
    ZSNTTA,
    noise_images,
    otsu_threshold,
    pseudo_labels,
)


def _official_otsu(scores):
    """The official search written separately: ``compute_os_variance`` per threshold of
    ``np.arange(0, 1, 0.01)`` (inf for a split with an empty class), then ``argmin``."""
    s = np.asarray(scores, dtype=np.float64)
    grid = np.arange(0, 1, 0.01)
    crit = []
    for th in grid:
        up = (s >= th).astype(float)
        w1 = up.sum() / s.size
        w0 = 1 - w1
        if w1 == 0 or w0 == 0:
            crit.append(np.inf)
            continue
        crit.append(w0 * np.var(s[up == 0]) + w1 * np.var(s[up == 1]))
    return float(grid[int(np.argmin(crit))])


def _adam_first_step(w, b, x, labels, lr, eps=1e-8):
    """The detector after one Adam step from ``(w, b)`` on the mean cross-entropy of
    ``x @ w.T + b`` to ``labels``, in numpy float64: at step 1 the bias-corrected moments
    are ``g`` and ``g**2``, so each parameter moves by ``-lr * g / (|g| + eps)``."""
    z = x @ w.T + b
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    dz = (p - np.eye(2)[labels]) / len(labels)
    gw, gb = dz.T @ x, dz.sum(axis=0)
    return w - lr * gw / (np.abs(gw) + eps), b - lr * gb / (np.abs(gb) + eps)


def _build(classifier, **overrides):
    return build_method(ZSNTTA, classifier, **overrides)


def _detector(method):
    return (
        method.detector.weight.detach().double().numpy().copy(),
        method.detector.bias.detach().double().numpy().copy(),
    )


# -- the rules -------------------------------------------------------------------------
def test_otsu_threshold_hand_values_and_the_official_search():
    # two tight groups: the first grid point above 0.1 splits them with zero variance
    assert otsu_threshold([0.1, 0.1, 0.9, 0.9]) == 0.11
    # {0.205} | {0.305, 0.805}: 2/3 * 0.0625; {0.205, 0.305} | {0.805}: 2/3 * 0.0025 (wins)
    assert otsu_threshold([0.205, 0.305, 0.805]) == 0.31
    # no valid split (one value): the official argmin of all-inf picks the first, 0.0
    assert otsu_threshold([0.5, 0.5, 0.5]) == 0.0
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(2, 600))
        s = np.concatenate([rng.beta(2, 8, n), rng.beta(8, 2, int(rng.integers(1, 300)))])
        s = s.astype(np.float32)  # the official queue holds float32 scores
        assert otsu_threshold(s) == _official_otsu(s)


def test_pseudo_labels_mark_noisy_and_injected_rows_as_noise():
    noisy = torch.tensor([False, True, False, True])
    injected = torch.tensor([False, False, True, True])
    assert pseudo_labels(noisy, injected).tolist() == [1, 0, 0, 0]


def test_one_step_zero_shot_rule_labels_and_detector_update(classifier):
    """Hand-made logits: 3 confident rows (MCM ~0.0013) and 3 flat ones (MCM 0.9); Otsu
    puts the threshold at 0.01; the injected confident row is labelled noise; the decision
    is the zero-shot rule (warm-up) and the detector takes the reference Adam step."""
    method = _build(classifier, gaussian_rate=0.0)
    c, d = method.head.shape
    confident = torch.zeros(c)
    confident[0] = 10.0
    logits = torch.stack([confident] * 3 + [torch.zeros(c)] * 3)
    feats = torch.randn(6, d, generator=torch.Generator().manual_seed(1)) * 10
    injected = torch.tensor([False, False, True, False, False, False])
    w0, b0 = _detector(method)
    score, keep = method._official_step(feats, logits, injected)
    msp = logits.softmax(dim=-1).max(dim=-1).values
    assert otsu_threshold((1 - msp).numpy()) == 0.01
    torch.testing.assert_close(score, msp)
    assert keep.tolist() == [True, True, True, False, False, False]
    labels = np.array([1, 1, 0, 0, 0, 0])
    w1, b1 = _adam_first_step(w0, b0, feats.double().numpy(), labels, method.config.lr)
    got_w, got_b = _detector(method)
    np.testing.assert_allclose(got_w, w1, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got_b, b1, rtol=0, atol=1e-6)
    assert not np.allclose(w1, w0)  # the step moved it: the check can fail
    assert method.t == 1 and len(method.mcm_queue) == 6 and len(method.det_queue) == 0


def test_detector_decides_after_warmup(classifier, test_images):
    """warmup_steps=1: batches 0 and 1 are decided by the zero-shot score (own score = its
    max softmax), batch 2 by the detector as it stood before the batch (own score = its ID
    probability, decision = noise probability above Otsu's threshold of its queue)."""
    images = test_images[0]
    method = _build(classifier, warmup_steps=1, gaussian_rate=0.0)
    for i in range(2):
        logits = seeded_step(method, images[16 * i : 16 * (i + 1)], i)
        torch.testing.assert_close(method.last_ood_score, logits.softmax(dim=-1).max(dim=-1).values)
    batch = images[32:48]
    before = copy.deepcopy(method.detector)
    with torch.no_grad():
        probs = before(classifier.encode_image(batch, normalize=False)).softmax(dim=-1)
    out = seeded_step(method, batch, 2)
    assert out.shape == (16, classifier.num_classes)
    torch.testing.assert_close(method.last_ood_score, probs[:, 1])
    tau = _official_otsu(probs[:, 0].numpy())
    assert method.last_ood_decision.tolist() == (probs[:, 0] <= tau).tolist()
    assert len(method.det_queue) == 16  # filled only after the warm-up


def test_detector_rule_on_hand_made_probabilities(classifier):
    """Past warm-up, a detector whose noise logit is the first feature: the rows' noise
    probabilities 0.1 and 0.115 join a queue of 50 of each; Otsu's threshold is 0.11 (the
    first grid point above 0.1), so the 0.115 row, 0.005 above it, is judged noise; the own
    score is the ID probability."""
    method = _build(classifier, gaussian_rate=0.0)
    c, d = method.head.shape
    with torch.no_grad():
        method.detector.weight.zero_()
        method.detector.weight[0, 0] = 1.0
        method.detector.bias.zero_()
    method.t = method.config.warmup_steps + 1
    method.det_queue = torch.tensor([0.1] * 50 + [0.115] * 50, dtype=torch.float64)
    p0 = torch.tensor([0.1, 0.115])
    feats = torch.zeros(2, d)
    feats[:, 0] = torch.log(p0 / (1 - p0))  # softmax([x, 0])[0] = sigmoid(x)
    score, keep = method._official_step(feats, torch.zeros(2, c), torch.zeros(2).bool())
    assert otsu_threshold(method.det_queue.numpy()) == 0.11
    torch.testing.assert_close(score, 1 - p0)
    assert keep.tolist() == [True, False]
    assert len(method.det_queue) == 102


def test_batch_size_one_path_updates_on_the_window(classifier, test_images):
    """Batch size 1, update_queue=3: no update at steps 0-2, then one Adam step at step 3
    on the window of steps 1-3 (step 0 fell out of it)."""
    images = test_images[0][:4]
    method = _build(classifier, gaussian_rate=0.0, update_queue=3)
    w0, b0 = _detector(method)
    for i in range(3):
        seeded_step(method, images[i : i + 1], i)
        np.testing.assert_array_equal(_detector(method)[0], w0)
    assert method.single_path and method.last_ood_score.shape == (1,)
    seeded_step(method, images[3:4], 3)
    with torch.no_grad():
        raw = classifier.encode_image(images, normalize=False).double().numpy()
    rows = torch.cat([f for f, _ in method.window]).double().numpy()
    np.testing.assert_allclose(rows, raw[1:], rtol=0, atol=1e-5)
    labels = torch.cat([y for _, y in method.window]).numpy()
    w1, b1 = _adam_first_step(w0, b0, rows, labels, method.config.lr)
    np.testing.assert_allclose(_detector(method)[0], w1, rtol=0, atol=1e-6)
    np.testing.assert_allclose(_detector(method)[1], b1, rtol=0, atol=1e-6)
    assert not method._past_warmup()  # warm-up spans 10 * 3 steps on this path


def test_noise_images_and_their_injection(classifier, test_images):
    gen = torch.Generator().manual_seed(0)
    for kind in ("gaussian", "uniform", "salt_and_pepper", "poisson"):
        x = noise_images(3, 8, kind, gen)
        assert x.shape == (3, 3, 8, 8)
        flat = x.flatten(1)
        assert torch.equal(flat.min(dim=1).values, torch.zeros(3))
        assert torch.equal(flat.max(dim=1).values, torch.ones(3))
        assert torch.equal(torch.round(x * 255), x * 255)  # whole bytes over 255
    method = _build(classifier)  # 0.125 noise images per real one
    assert [method._noise_count(4) for _ in range(4)] == [0, 1, 0, 1]
    method.reset()
    seeded_step(method, test_images[0][:8], 0)
    assert method.injected == 1 and len(method.mcm_queue) == 9  # 8 real + 1 noise
    assert method.last_ood_score.shape == (8,) and method.last_ood_decision.shape == (8,)


# -- contract ---------------------------------------------------------------------------
def test_real_step_shapes_reset_and_seed(classifier, test_images):
    images = test_images[0][:12]

    def build():
        return _build(classifier, warmup_steps=0)

    fresh, used, out = assert_reset_then_reseed_reproduces(build, images)
    assert out.shape == (12, classifier.num_classes) and torch.isfinite(out).all()
    # the frozen zero-shot logits on the protocol head
    torch.testing.assert_close(out, classifier(images), rtol=1e-5, atol=1e-5)
    score, keep = fresh.last_ood_score, fresh.last_ood_decision
    assert score.dtype == torch.float32 and score.shape == (12,) and torch.isfinite(score).all()
    assert keep.dtype == torch.bool and keep.shape == (12,)
    seeded_step(used, images, 9)  # past warm-up now: the detector decides
    used.reset()
    for k, v in used.detector.state_dict().items():
        assert torch.equal(v, used._initial[k])
    assert used.t == used.seen == used.injected == 0 and len(used.mcm_queue) == 0
    again = build()
    torch.testing.assert_close(seeded_step(again, images, 5), out, rtol=0, atol=0)
    torch.testing.assert_close(again.last_ood_score, score, rtol=0, atol=0)
    assert ZSNTTA.own_ood_score and not ZSNTTA.adapts and ZSNTTA.stream_kind == "online"


def test_feature_path_equals_the_image_path(classifier, test_images):
    images = test_images[0][:10]
    assert not _build(classifier).features_only()  # raw detector input: images needed
    by_image = _build(classifier, detector_features="normalized", precision="fp32")
    by_feats = _build(classifier, detector_features="normalized", precision="fp32")
    assert by_feats.features_only()
    for seed in range(3):
        out = seeded_step(by_image, images, seed)
        by_feats.reseed(seed)
        with torch.no_grad():
            feats = classifier.encode_image(images)
        torch.testing.assert_close(by_feats.step_features(feats), out, rtol=0, atol=1e-6)
        torch.testing.assert_close(
            by_feats.last_ood_score, by_image.last_ood_score, rtol=0, atol=1e-6
        )


def test_bad_config_values_are_refused(classifier):
    for field, value in [("noise_type", "pink"), ("lr", 0.0), ("threshold", "otsu")]:
        config = dataclasses.replace(ZSNTTA.Config(), **{field: value})
        with pytest.raises(ValueError, match=field):
            ZSNTTA(classifier, config)  # refused in __init__, before anything is built


def test_runs_on_digits_open_through_the_runner(tmp_path):
    """One digits-open cell (its 360 known and 360 unknown digits, batches of 32, so the
    detector decides from the 12th batch on): the runner scores the method's own score and
    decision beside the protocol's. (``protocol.max_images`` is not used: on an open-set
    suite the harness then records ``n`` for all rows and the accuracy over the known ones,
    and refuses its own file, for every method.)"""
    from tta_bench.run import runner
    from tta_bench.run.resolve import resolve_run

    overrides = ["protocol.shifts=[fog]", "seeds=[0]", "progress=false"]
    overrides += ["protocol.batch_size=32"]
    _, spec = resolve_run(method="zsntta", suite="digits-open", overrides=overrides)
    record = runner.run(spec, tmp_path / "r.json")
    [cell] = record["cells"]
    assert 0.0 <= cell["accuracy"] <= 1.0 and math.isfinite(cell["nll"])
    assert cell["n_ood"] > 0
    for key in ("auroc_own", "aupr_own", "fpr95_own", "acc_id", "acc_ood", "acc_h"):
        assert key in cell and 0.0 <= cell[key] <= 1.0, key
