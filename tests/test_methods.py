"""Behaviour of the multi-view and training-free methods on the real tiny model."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math

import pytest
import torch
from method_runs import (
    FAST,
    assert_batched_episodes_equal_sequential,
    assert_params_at_snapshot,
    build_method,
)

from mura_plugin.losses import view_entropy
from mura_plugin.methods._loss_scaler import LossScaler
from mura_plugin.methods.lora import LoRA
from mura_plugin.methods.mura import MuRA
from mura_plugin.methods.tda import TDA
from mura_plugin.methods.tpt import TPT
from mura_plugin.methods.zero import Zero, zero_votes
from tta_bench.registry import registry

_build = build_method


@pytest.fixture(scope="module")
def batch(noisy_images):
    return noisy_images


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
    assert (lora.ranks, lora.alpha, lora.blocks, lora.init, lora.targets) == (
        [16],
        32.0,
        3,
        "zero",
        ["attn.q", "attn.v"],
    )
    assert (lora.optimizer, lora.lr, lora.weight_decay, lora.views, lora.loss) == (
        "adamw",
        5e-3,
        0.01,
        63,
        "weighted_entropy",
    )
    assert m.alpha == lora.alpha  # one alpha per component, as TTL's lora_alpha
    assert (tpt.ctx_init, tpt.selection, tpt.loss, tpt.lr, tpt.views) == (
        "a photo of a",
        0.1,
        "marginal_entropy",
        5e-3,
        63,
    )
    assert Zero.Config().selection == 0.3
    # the official code's precision on CUDA: fp16 autocast, GradScaler(init_scale=1000)
    for cfg in (m, lora, tpt):
        assert (cfg.precision, cfg.grad_scale) == ("fp16", 1000.0)
    assert Zero.Config().precision == TDA.Config().precision == "fp16"
    for cfg in (m, lora, tpt, Zero.Config(), TDA.Config()):
        assert cfg.text_head == "protocol"


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
        lr=LoRA.Config().lr,  # the same settings: TTL's learning rate (MuRA's default is lower)
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
    build = functools.partial(_build, cls, classifier, **config)
    parallel, sequential, out = assert_batched_episodes_equal_sequential(
        build, batch, loss_atol=1e-6
    )
    for method in (parallel, sequential):
        assert method.timings["adapt"] > 0 and method.timings["predict"] > 0
        assert torch.isfinite(torch.as_tensor(method.last_loss))
    with torch.no_grad():
        assert not torch.allclose(out, parallel.predict(batch), atol=1e-3)  # it adapted
    assert_params_at_snapshot(parallel)  # shared state untouched by the episodes


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


def test_lora_first_step_has_the_official_size(classifier, batch):
    """TTL's LoRA: A ~ xavier-normal, B = 0, scale alpha / r = 32 / 16 = 2, AdamW 5e-3 with
    weight decay 0.01. From B = 0 the gradient reaches B only, and Adam's first step moves
    each entry by lr * g / (|g| + eps): |B| = lr up to eps / |g|, A only decays by
    (1 - lr wd). The layer's weight change is then dW = 2 (1 - lr wd) B A0, of norm
    ~ 2 lr ||sign(g) A0|| (about 5x the update of scale 1 with kaiming-uniform A)."""
    lora = _build(LoRA, classifier, episodic="online", **FAST)
    layer = lora.adapters["block2.attn.q_proj"]  # the deepest block's query projection
    a0 = layer.lora_A.detach().clone()
    d_in, r = layer.in_features, a0.shape[0]
    # xavier-normal std sqrt(2 / (in + r)): the sample std of 2,048 entries is within
    # 5 standard errors (std / sqrt(2n)); kaiming-uniform would give 1 / sqrt(3 in), 0.43x
    std = math.sqrt(2 / (d_in + r))
    assert abs(float(a0.std()) / std - 1) < 5 / math.sqrt(2 * a0.numel())
    assert not layer.lora_B.any()
    eye = torch.eye(d_in)
    with torch.no_grad():
        before = layer(eye) - layer.base(eye)
    assert not before.any()  # B = 0: the source
    lora.reseed(0)
    lora.step(batch[:1])
    lr, wd = 5e-3, 0.01
    a1, b1 = layer.lora_A.detach(), layer.lora_B.detach()
    torch.testing.assert_close(a1, a0 * (1 - lr * wd), rtol=0, atol=0)  # decoupled decay only
    step = b1.abs() / lr
    assert float(step.max()) <= 1 + 1e-6  # |g| / (|g| + eps) <= 1 (float32 rounding)
    assert float((step > 1 - 1e-3).float().mean()) > 0.95  # eps matters only where |g| < 1e-5
    with torch.no_grad():
        delta = (layer(eye) - layer.base(eye)).t()  # [out, in]: the weight change
    torch.testing.assert_close(delta, 2.0 * b1 @ a1, rtol=1e-5, atol=1e-7)


def test_tpt_keeps_the_confident_views_of_the_first_step(classifier, batch):
    """Official test_time_tuning: ``selected_idx`` is chosen at the first step, on the
    initial prompt, and reused by the later steps."""
    config = {"views": 15, "episodic": "online", "lr": 5e-2}
    tpt = _build(TPT, classifier, steps=2, **config)
    tpt.reseed(0)
    views = tpt.make_views(batch)
    feats = tpt.encode_views(views)
    with torch.no_grad():
        initial = view_entropy(tpt._logits(feats)).argsort(dim=0)[: int(16 * 0.1)]
    tpt.reseed(0)
    tpt.step(batch)
    assert torch.equal(tpt.selected_views[None], initial)
    # the selection would change on the prompt after one step (so the test can fail)
    once = _build(TPT, classifier, steps=1, **config)
    once.reseed(0)
    once.step(batch)
    with torch.no_grad():
        moved = view_entropy(once._logits(feats)).argsort(dim=0)[: int(16 * 0.1)]
    assert not torch.equal(moved, initial)


def test_zero_breaks_ties_as_the_official_code(batch):
    """``zero_votes`` on constructed cosines: views 0..9 are one-hot-like with decreasing
    peaks (so entropy rises with the index); k = int(10 * 0.4) = 4 views vote."""
    c = 6

    def views(classes, runner_up=None):
        cos = torch.zeros(len(classes), 1, c)
        for i, k in enumerate(classes):
            cos[i, 0, k] = 0.5 - 0.03 * i
            if runner_up is not None:
                cos[i, 0, runner_up[i]] = 0.2 - 0.01 * i
        return cos

    scale = 100.0
    # no tie: the plurality wins
    votes = zero_votes(views([2, 2, 2, 1, 0, 0, 0, 0, 0, 0]), scale, 0.4)
    assert votes.round().tolist() == [[0, 1, 3, 0, 0, 0]]
    # tie 1 vs 3 (2 votes each): the first non-voting view choosing 1 or 3 decides -> 3
    votes = zero_votes(views([1, 3, 1, 3, 5, 3, 1, 0, 0, 0]), scale, 0.4)
    assert votes.round().tolist() == [[0, 2, 0, 3, 0, 0]]
    # no non-voting view picks 1 or 3: the official fallback masks classes C - 1 - t =
    # {4, 2} of the first non-voting view and adds a vote to its argmax among the rest:
    # that view peaks at 4 (masked), its runner-up is 0
    cos = views([1, 3, 1, 3, 4, 5, 5, 5, 5, 5], runner_up=[0] * 10)
    votes = zero_votes(cos, scale, 0.4)
    assert votes.round().tolist() == [[1, 2, 0, 2, 0, 0]]
    # with every view voting there is nothing to break a tie with: counts unchanged
    votes = zero_votes(views([1, 3]), scale, 1.0)
    assert votes.round().tolist() == [[0, 1, 0, 1, 0, 0]]


def test_zero_votes_in_float16_are_soft_for_near_ties():
    """The official zero temperature is the dtype's epsilon: in float16 (~1e-3) cosines a
    few 1e-4 apart share a vote, in float32 the vote is one-hot."""
    cos = torch.tensor([[[0.3000, 0.2997, 0.0]]])  # [V=1, B=1, C=3]
    soft = zero_votes(cos.half(), 100.0, 1.0)
    hard = zero_votes(cos, 100.0, 1.0)
    assert 0.3 < float(soft[0, 1]) < 0.5 and float(hard[0, 1]) < 1e-6


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


def _official_cache(offers, shots):
    """TDA's update_cache, written separately: one list per class, the new entry appended
    (or put in the last place when it beats the last), then Python's stable sort."""
    cache: dict[int, list[tuple[int, float]]] = {}
    for cls, ident, ent in offers:
        items = cache.setdefault(cls, [])
        if len(items) < shots:
            items.append((ident, ent))
        elif ent < items[-1][1]:
            items[-1] = (ident, ent)
        items.sort(key=lambda item: item[1])
    return {c: sorted(i for i, _ in items) for c, items in cache.items()}


def test_tda_cache_evicts_the_entry_the_official_sorted_list_evicts_on_ties():
    from mura_plugin.methods._cache import EntropyCache as _Cache

    # ties on the highest entropy: the official list evicts the most recently inserted
    # (entropies exact in float32, as the cache stores them)
    offers = [(0, 1, 0.5), (0, 2, 0.5), (0, 3, 0.375), (0, 4, 0.5), (0, 5, 0.25),
              (0, 6, 0.375), (1, 7, 0.875), (1, 8, 0.875), (1, 9, 0.875), (1, 10, 0.125),
              (1, 11, 0.875)]  # fmt: skip
    cache = _Cache(classes=2, shots=2, dim=1, value_dim=1, device="cpu")
    for cls, ident, ent in offers:
        cache.offer(cls, torch.tensor([float(ident)]), ent, torch.zeros(1))
    ours = {
        c: sorted(int(k) for k, e in zip(cache.keys[c, :, 0], cache.entropy[c]) if math.isfinite(e))
        for c in (0, 1)
    }
    assert ours == _official_cache(offers, shots=2) == {0: [3, 5], 1: [7, 10]}


@pytest.mark.parametrize(
    ("dataset", "views", "per_image"),
    [
        ("digits", "official", 1),  # corruption / other sets: the image alone
        (None, "official", 1),  # outside a run
        ("imagenet_c", "official", 1),
        ("imagenet_a", "official", 64),  # natural shifts: original + 63 AugMix views
        ("imagenet_sketch", "official", 64),
        ("imagenet_a", "single", 1),  # forced
        ("digits", "multi", 64),
    ],
)
def test_tda_views_follow_the_dataset(classifier, batch, dataset, views, per_image):
    model = copy.deepcopy(classifier)
    model.dataset = dataset
    seen = []
    model.visual.register_forward_hook(lambda _m, args, _out: seen.append(len(args[0])))
    tda = TDA(model, dataclasses.replace(TDA.Config(), views=views))
    tda.setup()
    tda.reseed(0)
    out = tda.step(batch[:2])
    assert sum(seen) == 2 * per_image
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="available: official, single, multi"):
        TDA(model, dataclasses.replace(TDA.Config(), views="all")).setup()


def test_tda_multi_view_keeps_the_confident_views(classifier, batch):
    """Multi-view input (official get_clip_logits): the 10% lowest-entropy of the 64 views
    (int(64 * 0.1) = 6) give the mean logits and the cache key, their mean feature (not
    renormalised). On an empty cache the image meets only itself: its class gains
    alpha' exp(-beta (1 - |key|^2))."""
    model = copy.deepcopy(classifier)
    tda = TDA(model, dataclasses.replace(TDA.Config(), views="multi", neg_entropy_upper=0.0))
    tda.setup()
    tda.reseed(0)
    views = _tda_views(tda, batch[:1])
    with torch.no_grad():
        feats = model.encode_image(views.flatten(0, 1))
    logits = model.logits_from_features(feats).view(64, 1, -1)
    chosen = view_entropy(logits).argsort(dim=0)[:6, 0]
    expected = logits[chosen, 0].mean(dim=0)
    key = feats[chosen].mean(dim=0)
    alpha = 2.0 * float(model.logit_scale) / 100
    expected[expected.argmax()] += alpha * torch.exp(-5.0 * (1 - key @ key))
    tda.reseed(0)
    torch.testing.assert_close(tda.step(batch[:1])[0], expected, rtol=0, atol=1e-4)


def _tda_views(tda, images):
    from mura_plugin.methods._view_budget import configured_views
    from mura_plugin.methods.tda import _view_settings

    return configured_views(images, _view_settings(tda.config), tda.generator)


def test_loss_scaler_follows_grad_scaler():
    """GradScaler's rule per episode: unscale by the float32 reciprocal, skip non-finite
    rows, halve per skipped episode (in order), double after 2,000 finite steps."""
    scaler = LossScaler(1000.0, enabled=True)
    copies = torch.zeros(3, 2, requires_grad=True)
    copies.grad = torch.tensor([[1000.0, 2000.0], [float("inf"), 0.0], [3000.0, 0.0]])
    skipped = scaler.unscale([copies], episodes=3)
    assert skipped.tolist() == [False, True, False]
    torch.testing.assert_close(copies.grad[0], torch.tensor([1.0, 2.0]))
    scaler.update(skipped)
    assert (scaler.scale, scaler.tracker) == (500.0, 1)
    scaler.update(torch.zeros(1999, dtype=torch.bool))
    assert (scaler.scale, scaler.tracker) == (1000.0, 0)
    off = LossScaler(1000.0, enabled=False)
    assert off.scale == 1.0 and not off.unscale([copies], episodes=3).any()


def test_scaler_only_for_fp16_on_cuda(classifier):
    """The official GradScaler runs with fp16 autocast; the CPU computes float32, unscaled."""
    lora = _build(LoRA, classifier, **FAST)
    assert lora.config.precision == "fp16" and not lora.loss_scaler.enabled


def test_a_skipped_episode_leaves_the_other_samples_adapting(classifier, batch):
    """With loss scaling on, an episode whose gradients are not finite keeps its adapters
    (torch's GradScaler would skip the whole batch's step); the others step as usual."""
    bad = batch.clone()
    bad[1] = float("nan")
    scaled = _build(LoRA, classifier, **FAST)
    scaled.loss_scaler = LossScaler(1000.0, enabled=True)  # as on CUDA with fp16
    plain = _build(LoRA, classifier, **FAST)
    for method in (scaled, plain):
        method.reseed(4)
    out_scaled, out_plain = scaled.step(bad), plain.step(batch)
    keep = [0, 2, 3, 4, 5]
    # the same adaptation of the finite samples (scale 1000 then 1/1000: float32 rounding
    # of the gradient, which Adam's first step normalises away)
    torch.testing.assert_close(out_scaled[keep], out_plain[keep], rtol=0, atol=1e-4)
    assert scaled.loss_scaler.scale == 500.0  # one overflowing episode: one backoff
    with torch.no_grad():
        assert not torch.allclose(out_plain[keep], classifier(batch[keep]), atol=1e-3)
