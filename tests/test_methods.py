"""Behaviour of the multi-view and training-free methods on the real tiny model."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from mura_plugin.methods.lora import LoRA
from mura_plugin.methods.mura import MuRA
from mura_plugin.methods.tda import TDA
from mura_plugin.methods.tpt import TPT
from mura_plugin.methods.zero import Zero
from tta_bench.model import ZeroShotClassifier
from tta_bench.registry import registry

FAST = {"views": 7}  # fewer views keep the tests fast; the defaults are checked separately


def _build(cls, classifier, seed=0, **overrides):
    torch.manual_seed(seed)
    config = dataclasses.replace(cls.Config(), **overrides)
    method = cls(copy.deepcopy(classifier), config)
    method.setup()
    return method


@pytest.fixture(scope="module")
def batch(test_images):
    images, _ = test_images
    noisy = images[:6] + 0.3 * torch.randn(
        6, *images.shape[1:], generator=torch.Generator().manual_seed(0)
    )
    return noisy.clamp(0, 1)


def test_all_methods_registered():
    names = set(registry("methods").names())
    assert {"zeroshot", "tent", "lora", "tpt", "zero", "tda", "mura"} <= names


def test_published_defaults():
    m, lora, tpt = MuRA.Config(), LoRA.Config(), TPT.Config()
    assert (m.ranks, m.blocks, m.init, m.fusion, m.router_persist) == (
        [4, 8, 16],
        1,
        "svd",
        "router",
        True,
    )
    assert (m.views, m.include_original, m.loss, m.steps, m.episodic) == (
        63,
        True,
        "weighted_entropy",
        1,
        "sample",
    )
    assert (lora.ranks, lora.blocks, lora.init, lora.targets) == (
        [16],
        3,
        "zero",
        ["attn.q", "attn.v"],
    )
    assert (lora.optimizer, lora.lr, lora.views, lora.loss) == (
        "adamw",
        5e-3,
        63,
        "weighted_entropy",
    )
    assert (tpt.ctx_init, tpt.selection, tpt.loss, tpt.lr, tpt.views) == (
        "a photo of a",
        0.1,
        "marginal_entropy",
        5e-3,
        63,
    )
    assert Zero.Config().selection == 0.3


def test_single_rank_mura_equals_lora(classifier, batch):
    lora = _build(LoRA, classifier, **FAST)
    mura = _build(
        MuRA,
        classifier,
        ranks=[16],
        blocks=3,
        targets=["attn.q", "attn.v"],
        init="zero",
        fusion="softmax",
        router_persist=False,
        **FAST,
    )
    for m in (lora, mura):
        m.reseed(3)
    out_lora, out_mura = lora.step(batch), mura.step(batch)
    assert torch.allclose(out_lora, out_mura, atol=1e-6)
    with torch.no_grad():
        assert not torch.allclose(out_lora, classifier(batch), atol=1e-4)  # it did adapt


def test_svd_init_starts_exactly_at_the_source(classifier, batch):
    mura = _build(MuRA, classifier)  # defaults: svd init, router fusion
    with torch.no_grad():
        assert torch.allclose(mura.model(batch), classifier(batch), atol=1e-4)
        params = {n for n, _ in mura.model.named_parameters()}
    assert any("lora_A" in n for n in params) and any("router" in n for n in params)


def test_router_persists_while_adapters_restore(classifier, batch):
    mura = _build(MuRA, classifier, **FAST)
    adapter = next(iter(mura.adapters.values()))
    a0, r0 = adapter.lora_A.detach().clone(), adapter.router.weight.detach().clone()
    mura.reseed(0)
    mura.step(batch[:2])
    assert torch.equal(adapter.lora_A, a0)  # adapters restored after each sample
    assert not torch.equal(adapter.router.weight, r0)  # the router carried over
    mura.reset()
    assert torch.equal(adapter.router.weight, r0)  # reset(): the state after setup()
    other = _build(MuRA, classifier, router_persist=False, **FAST)
    other.reseed(0)
    other.step(batch[:2])
    adapter = next(iter(other.adapters.values()))
    assert torch.equal(adapter.router.weight, r0)


@pytest.mark.parametrize("cls", [MuRA, LoRA, TPT])
def test_reset_then_step_equals_a_fresh_instance(cls, classifier, batch):
    fresh = _build(cls, classifier, **FAST)
    used = _build(cls, classifier, **FAST)
    used.reseed(1)
    used.step(batch)
    used.reset()
    fresh.reseed(5)
    used.reseed(5)
    assert torch.equal(fresh.step(batch), used.step(batch))


@pytest.mark.parametrize("split", [True, False])
def test_autograd_stops_at_the_deepest_block(classifier, batch, split):
    mura = _build(MuRA, classifier, **FAST)
    if not split:  # the fallback for towers that cannot be split: a detach hook
        mura._split = None
    images = batch[:1].clone().requires_grad_(True)
    with torch.enable_grad():
        inputs = mura.encode_views(images.unsqueeze(0))
        assert ("tokens" in inputs) == split
        loss, _ = mura.view_loss(inputs)
        loss.sum().backward()
    assert images.grad is None  # nothing below the adapted block joined the graph
    assert all(
        p.grad is not None for p in mura.adapters[next(iter(mura.adapters))].adapter_parameters()
    )


@pytest.mark.parametrize(
    ("cls", "overrides"),
    [
        (LoRA, {}),
        (LoRA, {"optimizer": "sgd", "lr": 0.5}),  # not scale-free like Adam: sum, not mean
        (TPT, {}),
        (MuRA, {"router_persist": False, "fusion": "softmax", "steps": 2}),
        (MuRA, {"router_persist": False, "include_original": False, "chunk_views": 10}),
    ],
)
def test_batched_episodes_equal_the_sequential_loop(classifier, batch, cls, overrides):
    """Parallel per-sample episodes (one forward/backward, summed loss, one optimiser step,
    chunked) compute exactly the per-sample adapt/predict/restore loop."""
    config = {**FAST, "chunk_views": 20, **overrides}  # 20 // 8 views: chunks of 2 samples
    parallel = _build(cls, classifier, **config)
    sequential = _build(cls, classifier, episode_batching=False, **config)
    assert parallel.batched_episodes() and not sequential.batched_episodes()
    outs = []
    for method in (parallel, sequential):
        method.reseed(4)
        outs.append(method.step(batch))
        assert method.timings["adapt"] > 0 and method.timings["predict"] > 0
        assert torch.isfinite(torch.as_tensor(method.last_loss))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(parallel.last_loss, sequential.last_loss, rtol=0, atol=1e-6)
    with torch.no_grad():
        assert not torch.allclose(outs[0], parallel.predict(batch), atol=1e-3)  # it adapted
    for p, saved in zip(parallel.params, parallel._snapshot["params"]):
        assert torch.equal(p, saved)  # shared state untouched by the episodes


def test_batched_mura_persistent_router_steps_once_per_batch(classifier, batch):
    """CRU in batched mode: adapters are per-sample episodes, the shared router takes one
    step per batch on the summed per-sample losses; the sequential loop steps per sample."""
    parallel = _build(MuRA, classifier, **FAST)
    sequential = _build(MuRA, classifier, episode_batching=False, **FAST)
    for method in (parallel, sequential):
        method.reseed(2)
        method.step(batch)
    adapter = next(iter(parallel.adapters.values()))
    state = parallel.optimizer.state[adapter.router.weight]
    assert int(state["step"]) == 1  # one router step for the whole batch
    seq_adapter = next(iter(sequential.adapters.values()))
    assert int(sequential.optimizer.state[seq_adapter.router.weight]["step"]) == len(batch)
    assert not torch.equal(adapter.router.weight, seq_adapter.router.weight)
    # a loss that couples the samples of a batch runs the exact sequential loop
    coupled = _build(MuRA, classifier, loss="info_max", **FAST)
    assert not coupled.batched_episodes()


def test_seed_sketch_config_and_episodic_modes(classifier, batch):
    seed = _build(
        MuRA,
        classifier,
        fusion="softmax",
        init="zero",
        loss="consistency",
        episodic="batch",
        views=2,
    )
    seed.reseed(0)
    out = seed.step(batch)
    assert out.shape == (6, 10) and torch.isfinite(out).all()
    online = _build(MuRA, classifier, episodic="online", **FAST)
    adapter = next(iter(online.adapters.values()))
    b0 = adapter.lora_B.detach().clone()
    online.reseed(0)
    online.step(batch)
    assert not torch.equal(adapter.lora_B, b0)  # online: kept across batches
    with pytest.raises(ValueError, match="available: sample, batch, online"):
        _build(MuRA, classifier, episodic="never")
    with pytest.raises(ValueError, match="available: softmax, router, none"):
        _build(MuRA, classifier, fusion="moe")


def test_adapt_every_predicts_without_adapting(classifier, batch):
    mura = _build(MuRA, classifier, adapt_every=2, router_persist=False, **FAST)
    mura.reseed(0)
    mura.step(batch)
    mura.reseed(1)
    with torch.no_grad():
        assert torch.allclose(mura.step(batch), classifier(batch), atol=1e-4)


def test_tpt_prompt_reproduces_the_frozen_text_head(
    classifier, default_bundle, digits_stream, batch
):
    tpt = _build(TPT, classifier, **FAST)
    single = ZeroShotClassifier(default_bundle, digits_stream.classnames, ["a photo of a {}."])
    with torch.no_grad():
        assert torch.allclose(tpt.prompt(), single.class_embeddings, atol=1e-6)
    assert tpt.prompt.n_ctx == 4
    ctx0 = tpt.prompt.ctx.detach().clone()
    tpt.reseed(0)
    out = tpt.step(batch[:2])
    assert out.shape == (2, 10)
    assert torch.equal(tpt.prompt.ctx, ctx0)  # reset per sample


def test_zero_votes_and_reduces_to_argmax_with_one_view(classifier, batch):
    one = _build(Zero, classifier, views=0)
    one.reseed(0)
    with torch.no_grad():
        assert torch.equal(one.step(batch).argmax(1), classifier(batch).argmax(1))
    many = _build(Zero, classifier, views=15)
    many.reseed(0)
    out = many.step(batch)
    probs = out.exp()
    assert torch.allclose(probs.sum(1), torch.ones(6), atol=1e-5)
    # a winner holds at least one vote of the int(16 * 0.3) = 4 kept views
    assert (probs.max(1).values >= 0.25 * (1 - 1e-3)).all()


def test_tda_caches_fill_online_and_reset_empties_them(classifier, batch):
    tda = _build(TDA, classifier, neg_entropy_upper=0.0)  # positive cache only
    with torch.no_grad():
        ref = classifier(batch[:1])
    first = tda.step(batch[:1])
    # the first sample meets a cache holding only itself: its own class gains alpha'
    alpha = 2.0 * float(classifier.logit_scale) / 100
    expected = ref[0].clone()
    expected[ref[0].argmax()] += alpha
    assert torch.allclose(first[0], expected, atol=1e-4)
    tda.step(batch)
    assert torch.isfinite(tda.pos.entropy).sum() >= 2
    tda.reset()
    assert not torch.isfinite(tda.pos.entropy).any() and not torch.isfinite(tda.neg.entropy).any()
