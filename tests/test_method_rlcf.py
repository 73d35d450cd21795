"""RLCF (mura_plugin/methods/rlcf.py): the reward / baseline / policy-gradient loss against an
independent numpy reference, the teacher really in use (a second registered model), the
real runner (defaults and TTA-VLM settings), reset and seeding."""

from __future__ import annotations

import copy
import dataclasses
import itertools

import numpy as np
import pytest
import torch
from method_runs import run_method

from mura_plugin.methods.rlcf import RLCF, RLCFConfig, clip_reward, rlcf_loss
from tta_bench.registry import registry

# -- 1. known values ---------------------------------------------------------------------


def _reference(logits, sims, k, w, baseline=True, std=False, over_views=False):
    """Per-episode loss, rewards and indices, by plain loops (numpy, float64)."""
    b, n, c = logits.shape
    losses, all_rewards, all_index = [], np.zeros((b, n, k)), np.zeros((b, n, k), dtype=int)
    for e in range(b):
        scores = np.zeros((n, k))
        for v in range(n):
            order = sorted(range(c), key=lambda j: -logits[e, v, j])[:k]
            all_index[e, v] = order
            for i, j in enumerate(order):
                scores[v, i] = max(w * sims[e, v, j], 0.0)
        rewards = scores.copy()
        if baseline:
            groups = [scores.reshape(-1)] if over_views else list(scores)
            out = []
            for g in groups:
                if len(g) > 1:
                    centred = g - g.mean()
                    if std:
                        centred = centred / (np.std(g, ddof=1) + 1e-5)
                    g = centred
                out.append(g)
            rewards = np.array(out).reshape(n, k)
        all_rewards[e] = rewards
        total = 0.0
        for v in range(n):
            logp = logits[e, v] - np.log(np.exp(logits[e, v]).sum())
            for i, j in enumerate(all_index[e, v]):
                total += rewards[v, i] * -logp[j]
        losses.append(total / (n * k))
    return np.array(losses), all_rewards, all_index


LOGITS = np.array(
    [
        [[2.0, 0.5, 1.5, -1.0], [0.1, 3.0, 0.2, 2.5]],
        [[-0.5, 0.0, 4.0, 1.0], [1.0, 0.9, -2.0, 0.8]],
    ]
)
SIMS = np.array(
    [
        [[0.30, -0.10, 0.20, 0.05], [0.10, 0.25, -0.40, 0.15]],
        [[0.02, 0.40, 0.35, -0.20], [0.33, -0.05, 0.10, 0.12]],
    ]
)


@pytest.mark.parametrize(
    "baseline,std,over_views", [(True, False, False), (False, False, False), (True, True, True)]
)
def test_reward_baseline_and_loss_match_an_independent_reference(baseline, std, over_views):
    logits = torch.tensor(LOGITS, dtype=torch.float32, requires_grad=True)
    sims = torch.tensor(SIMS, dtype=torch.float32)
    loss, rewards, index = rlcf_loss(
        logits, sims, 2, 2.5, baseline=baseline, std=std, over_views=over_views
    )
    ref_loss, ref_rewards, ref_index = _reference(
        LOGITS, SIMS, 2, 2.5, baseline=baseline, std=std, over_views=over_views
    )
    np.testing.assert_array_equal(index.numpy(), ref_index)
    np.testing.assert_allclose(rewards.numpy(), ref_rewards, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss.detach().numpy(), ref_loss, rtol=1e-5, atol=1e-6)
    # a hand-checked entry: episode 0, view 0 takes classes 0 and 2, CLIPScores 2.5 * 0.30
    # and 2.5 * 0.20, per-view baseline 0.625 -> rewards +0.125 / -0.125
    if baseline and not over_views:
        np.testing.assert_allclose(rewards[0, 0].numpy(), [0.125, -0.125], atol=1e-6)
    # REINFORCE: d loss_e / d logits = mean over n x K of r * (softmax - onehot(class))
    loss.sum().backward()
    p = np.exp(LOGITS) / np.exp(LOGITS).sum(-1, keepdims=True)
    grad = np.zeros_like(LOGITS)
    for e, v, i in itertools.product(range(2), range(2), range(2)):
        onehot = np.eye(4)[ref_index[e, v, i]]
        grad[e, v] += ref_rewards[e, v, i] * (p[e, v] - onehot) / 4
    np.testing.assert_allclose(logits.grad.numpy(), grad, rtol=1e-5, atol=1e-6)


def test_negative_similarities_score_zero_and_a_group_of_one_keeps_its_reward():
    sims = torch.tensor([[[-0.3, 0.2, 0.1]]])
    index = torch.tensor([[[0, 1]]])
    np.testing.assert_allclose(clip_reward(sims, index, baseline=False).numpy(), [[[0.0, 0.5]]])
    np.testing.assert_allclose(clip_reward(sims, index).numpy(), [[[-0.25, 0.25]]])
    one = torch.tensor([[[1]]])
    np.testing.assert_allclose(clip_reward(sims, one).numpy(), [[[0.5]]])  # no baseline


# -- helpers for the method ----------------------------------------------------------------

FAST = dict(views=15, steps=2)


def _method(classifier, seed=0, **overrides) -> RLCF:
    method = RLCF(copy.deepcopy(classifier), RLCFConfig(**{**FAST, **overrides}))
    torch.manual_seed(seed)
    method.setup()
    return method


@pytest.fixture(scope="module")
def shifted(test_images):
    x, _ = test_images
    mean = x[:6].mean(dim=(1, 2, 3), keepdim=True)
    return (x[:6] - mean) * 0.3 + mean


def _tiny_variant(name: str, noise: float):
    """A second model factory: the shipped tiny CLIP under another name, its image tower
    perturbed by seeded noise (``noise`` = 0: the same weights)."""

    def factory():
        bundle = registry("models").get("tiny-clip-digits")()
        if noise:
            gen = torch.Generator().manual_seed(123)
            with torch.no_grad():
                for p in bundle.clip.visual.parameters():
                    p.add_(noise * p.std().nan_to_num(0.0) * torch.randn(p.shape, generator=gen))
        return dataclasses.replace(
            bundle, name=name, weights=f"test:{name}", weights_sha256="0" * 64
        )

    return factory


@pytest.fixture()
def teachers():
    names = {"tiny-clip-digits-same": 0.0, "tiny-clip-digits-other": 0.3}
    for name, noise in names.items():
        registry("models").add(name, _tiny_variant(name, noise))
    try:
        yield list(names)
    finally:
        for name in names:
            registry("models")._scan().pop(name)
            registry("models")._loaded.pop(name, None)


# -- the teacher -----------------------------------------------------------------------


def test_the_teacher_is_the_configured_model(classifier, shifted, teachers):
    same, other = teachers
    outputs = {}
    for teacher in (None, same, other):
        method = _method(classifier, teacher=teacher)
        method.reseed(5)
        logits = method.step(shifted)
        outputs[teacher] = (logits, method.last_rewards.clone(), method.resolved_settings())
    # the same weights under another name: the separate-teacher path gives what the
    # student's own tower gives
    torch.testing.assert_close(outputs[same][1], outputs[None][1], rtol=0, atol=1e-5)
    torch.testing.assert_close(outputs[same][0], outputs[None][0], rtol=0, atol=1e-4)
    # another teacher: other rewards, other adaptation
    assert not torch.allclose(outputs[other][1], outputs[None][1], atol=1e-3)
    assert not torch.allclose(outputs[other][0], outputs[None][0], atol=1e-4)
    assert outputs[None][2]["teacher"] is None
    assert outputs[None][2]["teacher_model"] == "tiny-clip-digits"
    assert outputs[other][2] == {
        "steps": 2,
        "teacher": other,
        "teacher_model": other,
        "teacher_weights": f"test:{other}",
        "teacher_weights_sha256": "0" * 64,
    }


def test_the_teacher_similarities_are_those_of_the_kept_views(classifier, shifted, teachers):
    """The teacher's similarities the loss uses are its own image features of the kept
    views against its own head, computed here independently."""
    _, other = teachers
    method = _method(classifier, teacher=other, episode_batching=False, steps=1)
    method.reseed(1)
    one = shifted[:1]
    inputs = method.encode_views(method.make_views(one))
    method.step_index = 0
    method.view_loss(inputs)
    chosen = method.selected_views[None][:, 0]
    teacher = registry("models").get(other)()
    from tta_bench.model import ZeroShotClassifier

    head = ZeroShotClassifier(teacher, classifier.classnames, classifier.templates)
    with torch.no_grad():
        expected = head(inputs["views"][chosen, 0]) / head.logit_scale
    torch.testing.assert_close(method.teacher_sims[None][:, 0], expected, rtol=0, atol=1e-5)


def test_sample_k_beyond_the_classes_is_refused(classifier):
    with pytest.raises(ValueError, match="sample_k"):
        _method(classifier, sample_k=11)


# -- 2. the real runner ------------------------------------------------------------------


def test_runs_through_the_runner_with_its_defaults(tmp_path):
    record = run_method(tmp_path, "rlcf")
    cells = record["cells"]
    assert cells and all(0.0 <= c["accuracy"] <= 1.0 for c in cells)
    assert all(c["n"] > 0 for c in cells)
    assert record["method_resolved"]["teacher"] is None
    assert record["method_resolved"]["steps"] == 3  # digits is not a fine-grained set


def test_runs_under_the_tta_vlm_settings(tmp_path):
    record = run_method(tmp_path, "rlcf", tta_vlm=True, max_images=8)  # one image a step
    cells = record["cells"]
    assert cells and all(0.0 <= c["accuracy"] <= 1.0 for c in cells)


def test_the_logits_are_finite_and_adaptation_changes_them(classifier, shifted):
    method = _method(classifier)
    method.reseed(0)
    adapted = method.step(shifted)
    assert adapted.shape == (6, 10) and torch.isfinite(adapted).all()
    assert torch.isfinite(method.last_loss)
    frozen = _method(classifier, steps=0)
    frozen.reseed(0)
    assert not torch.allclose(adapted, frozen.step(shifted))


def test_fine_grained_sets_take_the_fine_grained_scripts_5_steps(classifier, shifted):
    """rlcf-prompt-fine.sh runs 5 steps on the fine-grained sets (rlcf-prompt.sh: 3 on the
    ImageNet sets); TTA-VLM runs 3 everywhere. A set the catalogue marks fine-grained (DTD)
    adapts exactly as an explicit 5-step run does, the digits as a 3-step one."""
    from tta_bench.run.profiles import method_settings

    def build(dataset, **overrides):
        model = copy.deepcopy(classifier)
        model.dataset = dataset  # the classes are the digits'; only the rule is checked
        method = RLCF(model, RLCFConfig(views=15, **overrides))
        torch.manual_seed(0)
        method.setup()
        return method

    on_dtd = build("dtd")
    assert on_dtd.config.steps == 5 and on_dtd.resolved_settings()["steps"] == 5
    assert build("digits").config.steps == 3 and build(None).config.steps == 3
    assert build("dtd", steps_fine_grained=None).config.steps == 3
    tta = method_settings("tta_vlm", "rlcf")
    assert tta["steps_fine_grained"] is None and build("dtd", **tta).config.steps == 3
    outputs = {}
    for name, method in [("dtd", on_dtd), ("five", build("digits", steps=5)),
                         ("three", build("digits"))]:  # fmt: skip
        method.reseed(4)
        outputs[name] = method.step(shifted)
    torch.testing.assert_close(outputs["dtd"], outputs["five"], rtol=0, atol=0)
    assert not torch.allclose(outputs["dtd"], outputs["three"], atol=1e-5)


# -- 3. reset and seeds ------------------------------------------------------------------


def test_reset_returns_to_the_state_after_setup(classifier, shifted, teachers):
    _, other = teachers
    fresh = _method(classifier, teacher=other)
    fresh.reseed(7)
    expected = fresh.step(shifted)
    used = _method(classifier, teacher=other)
    for seed in (1, 2):
        used.reseed(seed)
        used.step(shifted.flip(0))
    used.reset()
    used.reseed(7)
    torch.testing.assert_close(used.step(shifted), expected, rtol=0, atol=1e-5)


def test_same_seed_same_logits_and_batched_equals_sequential(classifier, shifted):
    outs = []
    for batching in (True, True, False):
        method = _method(classifier, episode_batching=batching)
        method.reseed(3)
        outs.append(method.step(shifted))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    torch.testing.assert_close(outs[0], outs[2], rtol=0, atol=1e-4)
