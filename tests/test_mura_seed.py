"""The ``mura-seed`` preset is the seed article's sketch of MuRA, and the options it needs
(``init=default``, ``scale=none``, ``fusion=softmax_layer``, ``crop_scale_max``,
``rotate_degrees``) leave MuRA's defaults exactly as they were."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math

import pytest
import torch
from method_runs import (
    assert_batched_episodes_equal_sequential,
    assert_params_at_snapshot,
    build_method,
)
from torch import nn
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TF

from mura_plugin.adapters import MultiRankLinear, attach_adapters, vision_blocks
from mura_plugin.augment import make_views, random_rotations, rotate
from mura_plugin.methods._view_budget import configured_views
from mura_plugin.methods.mura import MuRA
from tta_bench.run.resolve import resolve_run

_build = functools.partial(build_method, MuRA)


#: The sketch, item by item (the preset's comment): every setting the preset gives.
SKETCH = {
    "ranks": [4, 8, 16],
    "init": "default",  # 1. torch's init of A and B
    "scale": "none",  # 2. no per-rank scale
    "fusion": "softmax_layer",  # 3. a softmax per adapted layer
    "targets": ["mlp.in", "mlp.out"],  # 4. beside the MLP linears
    "views": 2,  # 5. two augmented views, no original
    "include_original": False,
    "crop_scale_min": 0.7,
    "crop_scale_max": 1.0,
    "rotate_degrees": 10.0,
    "flip": False,
    "augmix": False,
    "loss": "consistency",  # 6. 3 Adam steps, 1e-3, no weight decay, negative cosine
    "optimizer": "adam",
    "lr": 1e-3,
    "weight_decay": 0.0,
    "steps": 3,
    "episodic": "batch",  # 8. predict after the steps, reset per batch
    "router_persist": False,
}


def test_the_preset_composes_to_the_sketch():
    _, spec = resolve_run(method="mura-seed")
    assert (spec.method, spec.method_preset) == ("mura", "mura-seed")
    cfg = spec.method_config
    assert {k: getattr(cfg, k) for k in SKETCH} == SKETCH
    # what the sketch does not say stays mura's
    base = MuRA.Config()
    for key in ("blocks", "alpha", "text_head", "precision", "grad_scale", "adapt_every"):
        assert getattr(cfg, key) == getattr(base, key), key
    # 7. batch 16 is the protocol's setting: the suite's 64 unless it is given
    assert spec.protocol.batch_size == 64
    _, spec16 = resolve_run(method="mura-seed", overrides=["protocol.batch_size=16"])
    assert spec16.protocol.batch_size == 16
    assert spec16.method_config == cfg


def test_the_preset_adapts_the_mlp_linears_of_the_deepest_block(classifier, batch):
    _, spec = resolve_run(method="mura-seed")
    torch.manual_seed(0)
    seed = MuRA(copy.deepcopy(classifier), spec.method_config)
    seed.setup()
    assert list(seed.adapters) == ["block0.mlp.c_fc", "block0.mlp.c_proj"]
    assert seed.merge_logits.shape == (2, 3)
    before = [p.detach().clone() for p in seed.params]
    seed.reseed(0)
    out = seed.step(batch)
    assert out.shape == (4, 10) and torch.isfinite(out).all()
    assert all(torch.equal(p, b) for p, b in zip(seed.params, before))  # reset per batch
    with torch.no_grad():  # the adapted prediction is not the source's
        assert not torch.allclose(out, classifier(batch), atol=1e-3)


def test_default_init_is_torch_linear_init_of_a_and_b():
    """init=default: A_k [r_k, in] and B_k [out, r_k] drawn as nn.Linear draws its weight
    (kaiming_uniform_(a=sqrt(5)): uniform in +-1/sqrt(fan_in), std bound/sqrt(3)), so B is
    not zero and the layer does not start at the source."""
    torch.manual_seed(0)
    base = nn.Linear(256, 192)
    layer = MultiRankLinear(base, [4, 8, 16], alpha=32.0)
    layer.init_default()
    assert layer.frozen_weight is None
    start = 0
    for r in (4, 8, 16):
        rows = slice(start, start + r)
        for block, fan_in in ((layer.lora_A[rows], 256), (layer.lora_B[:, rows], r)):
            bound = 1 / math.sqrt(fan_in)
            block = block.detach()
            assert block.abs().max() <= bound
            assert block.abs().max() > 0.95 * bound  # fills the interval
            n = block.numel()
            std = bound / math.sqrt(3)
            assert abs(block.std().item() - std) < 5 * std / math.sqrt(2 * n)
        start += r
    assert layer.lora_B.abs().min() > 0
    # the same draws as nn.Linear's weights of those shapes, component by component
    torch.manual_seed(1)
    layer.init_default()
    torch.manual_seed(1)
    start = 0
    for r in (4, 8, 16):
        a, b = nn.Linear(256, r, bias=False), nn.Linear(r, 192, bias=False)
        torch.testing.assert_close(layer.lora_A[start : start + r], a.weight, rtol=0, atol=0)
        torch.testing.assert_close(layer.lora_B[:, start : start + r], b.weight, rtol=0, atol=0)
        start += r
    x = torch.randn(5, 256)
    assert not torch.allclose(layer(x), base(x), atol=1e-3)


def test_default_init_does_not_start_at_the_source(classifier, batch):
    mura = _build(classifier, init="default", fusion="softmax_layer", targets=["mlp.in"])
    with torch.no_grad():
        assert not torch.allclose(mura.predict(batch), classifier(batch), atol=1e-3)
    with pytest.raises(ValueError, match="available: zero, svd, default"):
        _build(classifier, init="kaiming")


def test_scale_none_gives_unit_scales(classifier):
    torch.manual_seed(0)
    base = nn.Linear(12, 10)
    layer = MultiRankLinear(base, [2, 3], alpha=32.0, scale="none")
    assert torch.equal(layer.rank_scale, torch.ones(5))
    with torch.no_grad():
        layer.lora_B.normal_()
    w = torch.tensor([0.3, 0.7])
    layer.set_weights(w)
    x = torch.randn(4, 12)
    a, b = layer.lora_A, layer.lora_B
    ref = base(x) + w[0] * x @ a[:2].t() @ b[:, :2].t() + w[1] * x @ a[2:].t() @ b[:, 2:].t()
    torch.testing.assert_close(layer(x), ref, rtol=0, atol=1e-5)
    default = MultiRankLinear(base, [2, 3], alpha=32.0)  # unchanged: alpha / r
    assert torch.equal(default.rank_scale, torch.tensor([16.0, 16, 32 / 3, 32 / 3, 32 / 3]))
    mura = _build(classifier, scale="none", init="default", views=2)
    assert all(
        torch.equal(a.rank_scale, torch.ones_like(a.rank_scale)) for a in mura.adapters.values()
    )
    with pytest.raises(ValueError, match="available: alpha_over_rank, none"):
        _build(classifier, scale="sqrt")


def test_softmax_layer_gives_each_adapted_layer_its_own_weights(classifier, batch):
    mura = _build(
        classifier,
        fusion="softmax_layer",
        init="default",
        scale="none",
        targets=["mlp.in", "mlp.out"],
        loss="consistency",
        views=2,
        include_original=False,
        optimizer="adam",
        lr=1e-3,
        episodic="online",
    )
    adapters = list(mura.adapters.values())
    assert mura.merge_logits.shape == (len(adapters), 3) == (2, 3)
    with torch.no_grad():
        mura.merge_logits.copy_(torch.tensor([[0.0, 1.0, 2.0], [1.0, -1.0, 0.0]]))
    mura._set_fusion()
    for layer, adapter in enumerate(adapters):
        torch.testing.assert_close(adapter.weights, mura.merge_logits[layer].softmax(-1))
    # each row's gradient comes from its own layer only: with layer 1's B = 0 its
    # components contribute nothing, so its logits get no gradient while layer 0's do
    with torch.no_grad():
        adapters[1].lora_B.zero_()
    mura.reseed(0)
    inputs = mura.encode_views(mura.make_views(batch))
    with torch.enable_grad():
        mura.view_loss(inputs)[0].mean().backward()
    grad = mura.merge_logits.grad
    assert grad[0].abs().max() > 0 and torch.equal(grad[1], torch.zeros(3))
    # after a step (online: kept), the two layers' weights moved independently (SGD: the
    # step is the gradient itself, where Adam's first step would be +-lr for every element)
    fresh = _build(
        classifier,
        fusion="softmax_layer",
        init="default",
        scale="none",
        loss="consistency",
        views=2,
        include_original=False,
        episodic="online",
        targets=["mlp.in", "mlp.out"],
        optimizer="sgd",
        lr=1.0,
    )
    fresh.reseed(0)
    fresh.step(batch)
    logits = fresh.merge_logits.detach()
    assert (logits != 0).all()  # both layers' logits moved ...
    assert not torch.allclose(logits[0], logits[1], atol=1e-6)  # ... each its own way
    # the global softmax is still one [K] shared by every layer
    shared = _build(classifier, fusion="softmax", targets=["mlp.in", "mlp.out"], views=2)
    assert shared.merge_logits.shape == (3,)


@pytest.mark.parametrize(
    "overrides",
    [
        {  # the sketch's settings, per sample instead of per batch
            "fusion": "softmax_layer",
            "init": "default",
            "scale": "none",
            "targets": ["mlp.in", "mlp.out"],
            "loss": "consistency",
            "views": 2,
            "include_original": False,
            "crop_scale_min": 0.7,
            "rotate_degrees": 10.0,
            "flip": False,
            "optimizer": "adam",
            "lr": 1e-3,
            "weight_decay": 0.0,
            "steps": 3,
            "chunk_views": 4,  # chunks of 2 samples
        },
        {"fusion": "softmax_layer", "views": 7, "steps": 2, "chunk_views": 20},
    ],
)
def test_softmax_layer_batched_episodes_equal_the_sequential_loop(classifier, batch, overrides):
    """Per-layer fusion logits get one copy per sample ([n, L, K]) in batched episodes: the
    parallel episodes compute exactly the per-sample adapt/predict/restore loop."""
    config = {"episodic": "sample", "router_persist": False, **overrides}
    parallel, _, out = assert_batched_episodes_equal_sequential(
        functools.partial(_build, classifier, **config), batch, loss_atol=1e-6
    )
    with torch.no_grad():
        assert not torch.allclose(out, parallel.predict(batch), atol=1e-3)  # it adapted
    assert_params_at_snapshot(parallel)  # shared state untouched by the episodes
    assert parallel._episode_merge is None  # copies dropped


# -- views -------------------------------------------------------------------------------


def test_rotate_is_torchvision_rotate_with_zero_fill():
    """Known values: a quarter turn of a square image is rot90 (counter-clockwise, taps on
    pixel centres); any angle, square or not, is torchvision's bilinear ``rotate`` with
    ``fill=0`` (RandomAffine's default fill) within float32 interpolation error."""
    x = torch.arange(16.0).view(1, 1, 4, 4)
    torch.testing.assert_close(
        rotate(x, torch.tensor([90.0])), torch.rot90(x, 1, dims=(-2, -1)), rtol=0, atol=1e-5
    )
    torch.testing.assert_close(rotate(x, torch.tensor([0.0])), x, rtol=0, atol=1e-6)
    g = torch.Generator().manual_seed(0)
    for h, w in ((8, 8), (6, 10), (32, 32)):
        images = torch.rand(4, 3, h, w, generator=g)
        angles = torch.tensor([7.3, -10.0, 3.0, 45.0])
        ref = torch.stack(
            [
                TF.rotate(img, float(a), InterpolationMode.BILINEAR, fill=0)
                for img, a in zip(images, angles)
            ]
        )
        torch.testing.assert_close(rotate(images, angles), ref, rtol=0, atol=1e-5)
    turned = rotate(torch.ones(1, 1, 9, 9), torch.tensor([45.0]))
    assert turned[0, 0, 0, 0] == 0 and turned[0, 0, 4, 4] == 1  # zero fill outside


def test_random_rotations_draw_from_the_generator():
    images = torch.rand(50, 3, 8, 8)
    g = torch.Generator().manual_seed(3)
    out = random_rotations(images, 10.0, g)
    angles = torch.empty(50, dtype=torch.float64).uniform_(
        -10.0, 10.0, generator=torch.Generator().manual_seed(3)
    )
    assert angles.abs().max() <= 10 and angles.min() < 0 < angles.max()
    torch.testing.assert_close(out, rotate(images, angles), rtol=0, atol=0)
    again = random_rotations(images, 10.0, torch.Generator().manual_seed(3))
    assert torch.equal(out, again)  # seeded


def test_view_options_crop_then_rotate(batch):
    """``rotate_degrees``: the crops (same draws as without it) rotated by angles drawn after
    them; ``crop_scale_max`` is the crops' upper area bound; the defaults draw as before."""
    cfg = dataclasses.replace(
        MuRA.Config(),
        views=3,
        include_original=False,
        crop_scale_min=0.7,
        crop_scale_max=0.9,
        rotate_degrees=10.0,
        flip=False,
    )
    views = configured_views(batch, cfg, torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    crops = make_views(batch, 3, g, include_original=False, scale=(0.7, 0.9), flip=False)
    rotated = random_rotations(crops.flatten(0, 1), 10.0, g).view_as(crops)
    torch.testing.assert_close(views, rotated, rtol=0, atol=0)
    assert views.shape == (3, 4, 3, 32, 32)
    # defaults: exactly the views before these options existed (no extra draws)
    base = MuRA.Config()
    assert (base.crop_scale_max, base.rotate_degrees) == (1.0, 0.0)
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    ours = configured_views(batch, dataclasses.replace(base, views=5), g1)
    before = make_views(batch, 5, g2, include_original=True, scale=(0.08, 1.0), flip=True)
    assert torch.equal(ours, before)
    assert torch.equal(torch.rand(3, generator=g1), torch.rand(3, generator=g2))


def test_view_option_bounds(classifier):
    with pytest.raises(ValueError, match="crop_scale_max"):
        _build(classifier, crop_scale_min=0.7, crop_scale_max=0.5, views=2)


# -- MuRA's defaults are unchanged -----------------------------------------------------------


def _logits(text: str) -> torch.Tensor:
    """Captured logits written as text: one image a line of whitespace-separated numbers,
    a blank line between batches. A tensor [batches, images, classes]."""
    return torch.tensor(
        [
            [[float(v) for v in row.split()] for row in batch.strip().splitlines()]
            for batch in text.strip().split("\n\n")
        ]
    )


#: ``MuRA.Config()`` (router, SVD init, 63 views + original, weighted entropy) on ``batch``,
#: built after ``torch.manual_seed(0)``, logits of ``reseed(0); step`` then ``reseed(1); step``
#: (the router persists across the two batches), captured with the code before the options
#: of the seed sketch were added (float32, 2 threads).
DEFAULT_LOGITS = _logits(
    """
    -4.40304 10.77985 2.14362 -2.84478 5.21845 -3.46941 1.02797 -0.97402 1.05751 -0.49868
    0.33477 5.70137 -1.90622 -3.32446 6.77490 -2.02998 3.59133 -4.60863 1.17020 2.14737
    0.08229 0.29010 -1.92351 2.95984 -5.09741 0.02565 1.65386 -0.78106 11.38557 2.47288
    -1.56393 6.48280 0.14208 -2.37571 3.51774 -2.11088 9.45617 -1.29439 4.44024 -6.44057

    -4.43015 10.76650 2.10094 -2.85301 5.19753 -3.42365 1.00951 -0.95507 1.21390 -0.45250
    0.37177 5.58402 -1.97435 -3.38880 6.82936 -1.95128 3.55515 -4.61526 1.16185 2.21194
    0.08591 0.21663 -1.96227 2.94217 -5.08519 0.08979 1.66361 -0.76502 11.38682 2.46182
    -1.55333 6.38100 0.06325 -2.41722 3.52131 -2.00296 9.50955 -1.30925 4.58259 -6.43871
    """
)
#: The old seed-sketch-by-config (global softmax, B = 0 init, 2 views, consistency, Adam 1e-3,
#: 1 step, reset per batch).
OLD_SEED_SKETCH = {
    "fusion": "softmax",
    "init": "zero",
    "loss": "consistency",
    "episodic": "batch",
    "views": 2,
    "include_original": False,
    "optimizer": "adam",
    "lr": 1e-3,
    "weight_decay": 0.0,
    "router_persist": False,
}
#: ``OLD_SEED_SKETCH`` the same way, first batch: the global softmax is unchanged.
GLOBAL_SOFTMAX_LOGITS = _logits(
    """
    -4.40620 10.71869 2.04839 -2.94156 5.28782 -3.38185 1.06581 -0.98672 1.22833 -0.46323
    0.32137 5.76551 -1.89279 -3.29905 6.74893 -2.04661 3.63184 -4.59948 1.20341 2.11918
    0.06796 0.35934 -1.91233 2.97751 -5.09737 -0.01640 1.62445 -0.77997 11.38093 2.52696
    -1.66185 6.61457 0.23690 -2.32718 3.50399 -2.20394 9.32609 -1.21398 4.39486 -6.40395
    """
)[0]


def test_mura_defaults_are_unchanged(classifier, batch):
    cfg = MuRA.Config()
    assert (cfg.init, cfg.scale, cfg.fusion, cfg.targets) == (
        "svd",
        "alpha_over_rank",
        "router",
        ["attn.q", "attn.v"],
    )
    assert (cfg.crop_scale_min, cfg.crop_scale_max, cfg.rotate_degrees, cfg.flip) == (
        0.08,
        1.0,
        0.0,
        True,
    )
    mura = _build(classifier)
    for b, want in enumerate(DEFAULT_LOGITS):
        mura.reseed(b)
        torch.testing.assert_close(mura.step(batch), want, rtol=0, atol=1e-4)
    old_seed = _build(classifier, **OLD_SEED_SKETCH)
    old_seed.reseed(0)
    out = old_seed.step(batch)
    torch.testing.assert_close(out, GLOBAL_SOFTMAX_LOGITS, rtol=0, atol=1e-4)


def test_attach_adapters_default_init_and_scale_on_the_model(classifier):
    visual = copy.deepcopy(classifier.visual)
    torch.manual_seed(0)
    adapters = attach_adapters(
        vision_blocks(visual)[-1:],
        ["mlp.in", "mlp.out"],
        [4, 8],
        32.0,
        init="default",
        scale="none",
    )
    assert sorted(adapters) == ["block0.mlp.c_fc", "block0.mlp.c_proj"]
    for adapter in adapters.values():
        assert adapter.lora_B.abs().min() > 0
        assert torch.equal(adapter.rank_scale, torch.ones(12))
