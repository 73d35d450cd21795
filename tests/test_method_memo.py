"""MEMO (mura_plugin/methods/memo.py): the marginal entropy against values written from its
definition, the padded crops against every window they may be, the BatchNorm prior against
its formula, one episode on the real tiny model against a separately written SGD step, the
per-sample reset, reset and seeds, and the reference harness's cifar10_c defaults."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from method_runs import (
    assert_params_at_snapshot,
    assert_reset_then_reseed_reproduces,
    assert_same_seeded_steps,
    build_method,
    seeded_step,
)
from torch import nn

from mura_plugin.augment import apply_augmix, augmix_draws
from mura_plugin.methods._online import nesterov_groups
from mura_plugin.methods.memo import (
    MEMO,
    _image_parameters,
    _use_batch_norm_prior,
    alpha_batch_norm,
    memo_loss,
    pad_crop_views,
)

#: Few copies, no AugMix: the tests of the episode machinery stay fast (the defaults test
#: checks the official values).
FAST = {"views": 3, "augmix": False}


def _marginal_entropy_reference(logits: list[list[list[float]]]) -> list[float]:
    """Written from the definition, in plain Python: per sample b, the softmax of every
    view v, their mean p, and -sum_c p_c ln p_c."""
    n_views, n_samples = len(logits), len(logits[0])
    out = []
    for b in range(n_samples):
        mean = [0.0] * len(logits[0][b])
        for v in range(n_views):
            z = logits[v][b]
            top = max(z)
            e = [math.exp(x - top) for x in z]
            s = sum(e)
            mean = [m + x / s / n_views for m, x in zip(mean, e)]
        out.append(-sum(p * math.log(p) for p in mean))
    return out


def test_marginal_entropy_is_the_entropy_of_the_mean_prediction():
    # two confident views that disagree: each has entropy ~0, their mean is uniform
    confident = torch.tensor([[[20.0, -20.0]], [[-20.0, 20.0]]])
    torch.testing.assert_close(memo_loss(confident), torch.tensor([math.log(2.0)]))
    # three views of two samples over five classes
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(3, 2, 5, generator=g, dtype=torch.float64)
    expected = torch.tensor(_marginal_entropy_reference(logits.tolist()), dtype=torch.float32)
    got = memo_loss(logits)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    per_view = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean(0)
    assert float((got - per_view.float()).abs().min()) > 1e-2  # not the mean per-view entropy


def test_padded_crops_are_windows_of_the_zero_padded_image():
    images = torch.arange(2 * 3 * 6 * 6, dtype=torch.float32).view(2, 3, 6, 6) + 1
    pad = 2
    views = pad_crop_views(
        images, 40, torch.Generator().manual_seed(1), padding=pad, augmix_views=False
    )
    assert views.shape == (40, 2, 3, 6, 6)
    padded = torch.nn.functional.pad(images, (pad, pad, pad, pad))
    seen = set()
    for v in range(40):
        for b in range(2):
            hits = [
                (i, j, f)
                for i in range(2 * pad + 1)
                for j in range(2 * pad + 1)
                for f in (False, True)
                if torch.equal(
                    views[v, b],
                    padded[b, :, i : i + 6, j : j + 6].flip(-1)
                    if f
                    else padded[b, :, i : i + 6, j : j + 6],
                )
            ]
            assert len(hits) == 1, (v, b)
            seen.add(hits[0])
    assert len(seen) > 25  # corners and flips vary (50 combinations in all)
    assert {f for _, _, f in seen} == {False, True}
    with_original = pad_crop_views(
        images, 2, torch.Generator().manual_seed(1), padding=pad, include_original=True
    )
    assert torch.equal(with_original[0], images)


def test_augmix_is_applied_to_the_crops_with_the_next_draws():
    g = torch.Generator().manual_seed(2)
    images = torch.rand(2, 3, 8, 8, generator=g).mul(255).round().div(255)
    first, second = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    crops = pad_crop_views(images, 3, first, padding=1, augmix_views=False)
    expected = apply_augmix(crops.flatten(0, 1), augmix_draws(6, first)).view_as(crops)
    got = pad_crop_views(images, 3, second, padding=1, augmix_views=True)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert not torch.equal(got, crops)


def test_batch_norm_prior_mixes_source_and_batch_statistics():
    g = torch.Generator().manual_seed(3)
    bn = nn.BatchNorm2d(3)
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(3, generator=g))
        bn.running_var.copy_(torch.rand(3, generator=g) + 0.5)
        bn.weight.copy_(torch.randn(3, generator=g))
        bn.bias.copy_(torch.randn(3, generator=g))
    bn.eval()
    x = (2 * torch.randn(4, 3, 5, 5, generator=g) + 1).requires_grad_(True)
    alpha = 0.25
    flat = x.detach().transpose(0, 1).reshape(3, -1)  # per channel
    n = flat.shape[1]
    mean_b = flat.sum(1) / n
    var_b = ((flat - mean_b[:, None]) ** 2).sum(1) / (n - 1)
    mean = (1 - alpha) * bn.running_mean + alpha * mean_b
    var = (1 - alpha) * bn.running_var + alpha * var_b
    scale = bn.weight.detach() / torch.sqrt(var + bn.eps)
    expected = (x.detach() - mean.view(1, 3, 1, 1)) * scale.view(1, 3, 1, 1)
    expected = expected + bn.bias.detach().view(1, 3, 1, 1)
    y = alpha_batch_norm(x, bn, alpha)
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-5)
    # the batch statistics are constants: d(sum y)/dx = weight / sqrt(var + eps)
    y.sum().backward()
    torch.testing.assert_close(x.grad, scale.view(1, 3, 1, 1).expand_as(x), rtol=0, atol=1e-6)
    # alpha 0: the source model itself
    torch.testing.assert_close(alpha_batch_norm(x, bn, 0.0), bn(x), rtol=0, atol=1e-6)
    # installed on a tower: same keys, the mixed forward
    net = nn.Sequential(nn.Identity(), copy.deepcopy(bn))
    keys = list(net.state_dict())
    assert _use_batch_norm_prior(net, alpha) == 1
    assert list(net.state_dict()) == keys
    torch.testing.assert_close(net(x), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("nesterov", "factor"), [(True, 1.9), (False, 1.0)])
def test_one_episode_is_one_sgd_step_on_the_marginal_entropy(classifier, batch, nesterov, factor):
    """The method's episode against the rule written out on a copy of the model: the
    marginal entropy of the copies' predictions, one SGD step (first Nesterov step with
    momentum 0.9 = 1.9 lr g; plain = lr g) on every image-tower parameter, the original
    image predicted by the updated tower."""
    x = batch[:1]
    method = build_method(MEMO, classifier, views=4, nesterov=nesterov)
    method.reseed(3)
    views = method.make_views(x)
    assert views.shape == (4, 1, 3, 32, 32)
    out = seeded_step(method, x, 3)

    ref = copy.deepcopy(classifier)
    params = list(ref.visual.parameters())
    for p in params:
        p.requires_grad_(True)
    mean = ref(views[:, 0]).softmax(dim=-1).mean(dim=0)
    loss = -(mean * mean.log()).sum()
    grads = torch.autograd.grad(loss, params)
    with torch.no_grad():
        for p, grad in zip(params, grads):
            p -= 0.005 * factor * grad
        expected = ref(x)
    torch.testing.assert_close(method.last_loss, loss.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-4)
    assert float((expected - classifier(x)).abs().max()) > 1e-3  # the step moved it
    assert_params_at_snapshot(method)  # the episode was undone


def test_episodes_reset_per_sample_and_the_original_is_predicted(classifier, batch):
    method = build_method(MEMO, classifier, **FAST)
    out = seeded_step(method, batch[:2], 0)
    assert out.shape == (2, classifier.num_classes)
    assert torch.isfinite(out).all()
    assert_params_at_snapshot(method)
    # sample 1 adapted alone on the copies it got in the batch predicts the same: sample
    # 0's update was undone before sample 1's episode
    alone = build_method(MEMO, classifier, **FAST)
    alone.reseed(0)
    views = alone.make_views(batch[:2])
    alone.adapt_on(views[:, 1:2])
    torch.testing.assert_close(alone.predict(batch[1:2]), out[1:2], rtol=0, atol=1e-5)
    batched = build_method(MEMO, classifier, **FAST, episodic="batch")
    assert seeded_step(batched, batch[:2], 0).shape == (2, classifier.num_classes)
    assert_params_at_snapshot(batched)


def test_reset_then_reseed_reproduces(classifier, batch):
    fresh, _, expected = assert_reset_then_reseed_reproduces(
        lambda: build_method(MEMO, classifier, **FAST), batch[:2]
    )
    assert float((expected - classifier(batch[:2])).abs().max()) > 1e-4


def test_same_seed_same_logits_other_seed_other_copies(classifier, batch):
    x = batch[:2]
    first = build_method(MEMO, classifier, **FAST)
    second = build_method(MEMO, classifier, **FAST)
    out = assert_same_seeded_steps(first, second, x, seed=4, atol=0)
    first.reset()
    assert not torch.equal(out, seeded_step(first, x, 5))


def test_parameter_sets_and_crop_rule(classifier):
    visual = classifier.visual
    names = {id(p): n for n, p in visual.named_parameters()}
    every = {names[id(p)] for p in _image_parameters(visual, "all")}
    assert every == set(names.values())
    wb = {names[id(p)] for p in _image_parameters(visual, "weight_bias")}
    assert all(n.split(".")[-1] in ("weight", "bias") for n in wb)
    assert not any("in_proj" in n or "embedding" in n for n in wb) and "proj" not in wb
    assert "transformer.resblocks.0.attn.out_proj.weight" in wb and "conv1.weight" in wb
    norm = {names[id(p)] for p in _image_parameters(visual, "norm")}
    assert norm and all(".ln_" in n or n.startswith("ln_") for n in norm)
    assert norm < wb < every
    assert _use_batch_norm_prior(copy.deepcopy(visual), 0.1) == 0  # a ViT: LayerNorm only
    method = MEMO(classifier, MEMO.Config())  # not set up: the crop rule only
    assert method.crop_kind(torch.zeros(1, 3, 32, 32)) == "pad"
    assert method.crop_kind(torch.zeros(1, 3, 64, 64)) == "resized"
    with pytest.raises(ValueError, match="momentum > 0"):
        nesterov_groups([], MEMO.Config(momentum=0.0))
    assert nesterov_groups([], MEMO.Config(optimizer="adam")) == []


def test_defaults_are_the_reference_cifar10_c_setting():
    cfg = MEMO.Config()
    expected = dict(
        views=32,  # TEST.N_AUGMENTATIONS
        include_original=False,
        augmix=True,
        crop="auto",
        padding=4,
        params="all",
        bn_alpha=0.1,  # BN.ALPHA
        loss="marginal_entropy",
        optimizer="sgd",
        lr=0.005,
        momentum=0.9,
        nesterov=True,
        weight_decay=0.0,
        steps=1,
        episodic="sample",
        precision="fp32",
        grad_scale=None,
        text_head="protocol",
    )
    for name, value in expected.items():
        assert getattr(cfg, name) == value, name
    assert MEMO.stream_kind == "episodic"
