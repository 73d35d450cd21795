"""TCA (mura_plugin/methods/tca.py): the token plan, ranking, coreset averaging, a whole
condensation block and the reservoir against numpy references written here; the FLOPs the
harness's counter sees; a real step on the tiny ViT, reset and seeds; refusals."""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch
from method_runs import (
    assert_reset_then_reseed_reproduces,
    build_method,
    run_method,
    scored_cell,
    seeded_step,
)
from scipy.special import erf

from mura_plugin.methods.tca import (
    TCA,
    Reservoir,
    Split,
    _condense_block,
    check_vit,
    coreset_average,
    default_drop_layers,
    eviction_scores,
    layer_weights,
    official_templates,
    rank_tokens,
    token_plan,
)


def test_token_plan_by_hand():
    # ViT-B/16 at the official rate: 197 -> 143 -> 104 -> 77 (blocks 3, 6, 9)
    plan = token_plan(197, 12, [3, 6, 9], 0.1, 4)
    assert [i for i, s in enumerate(plan) if s is not None] == [3, 6, 9]
    assert plan[3] == Split(137, 40, 19)  # left 177, m 20
    assert plan[6] == Split(98, 30, 14)  # 143 tokens: left 128, m 15
    assert plan[9] == Split(71, 22, 10)  # 104 tokens: left 93, m 11
    # the tiny ViT (16 patches): m = 2 at 0.1 saves nothing; 0.3 leaves no valid split later
    assert token_plan(17, 4, [1, 2, 3], 0.1, 4)[1:] == [Split(11, 4, 1)] * 3
    assert token_plan(17, 4, [1, 2, 3], 0.3, 4) == [None, Split(2, 10, 4), None, None]
    assert default_drop_layers(12) == [3, 6, 9] == default_drop_layers(24)
    assert default_drop_layers(4) == [1, 2, 3]


def test_rank_tokens_against_numpy():
    rng = np.random.default_rng(0)
    attn = rng.random((3, 16)).astype(np.float32)
    attn[1, 4] = attn[1, 9]  # a tie: the lower index ranks first
    split = Split(5, 8, 3)
    keep, cluster, rest = rank_tokens(torch.tensor(attn), split)
    order = np.argsort(-attn, axis=1, kind="stable")
    np.testing.assert_array_equal(keep.numpy(), order[:, :5])
    np.testing.assert_array_equal(cluster.numpy(), order[:, 5:13])
    np.testing.assert_array_equal(rest.numpy(), order[:, 13:])


def _np_coreset(t, k, start):
    """The official k-center greedy + inverse-distance cluster averaging, in numpy."""
    centres = [start]
    near = np.linalg.norm(t - t[start], axis=1)
    for _ in range(k - 1):
        centres.append(int(np.argmax(near)))
        near = np.minimum(near, np.linalg.norm(t - t[centres[-1]], axis=1))
    c = t[centres]
    assign = np.argmin(np.linalg.norm(t[:, None] - c[None], axis=-1), axis=1)
    out = np.zeros((k, t.shape[1]))
    for i in range(k):
        members = t[assign == i]
        if len(members):
            d = np.linalg.norm(members - c[i], axis=1)
            w = np.where(d == 0, 1.0, 1.0 / np.where(d == 0, 1.0, d))
            out[i] = (w[:, None] * members).sum(0) / w.sum()
    return out


def test_coreset_average_against_numpy():
    rng = np.random.default_rng(1)
    t = rng.normal(size=(2, 10, 6)).astype(np.float32)
    t[1, 7] = t[1, 2]  # a duplicate of a token: distance 0 to a centre, weight 1
    starts = torch.tensor([3, 2])
    got = coreset_average(torch.tensor(t), 4, starts).numpy()
    for b in range(2):
        np.testing.assert_allclose(got[b], _np_coreset(t[b], 4, int(starts[b])), atol=1e-5)
    # by hand: the centre itself weighs 1, a member at distance 2 weighs 1/2
    pts = torch.tensor([[[0.0, 0.0], [2.0, 0.0], [10.0, 0.0]]])
    got = coreset_average(pts, 2, torch.tensor([0]))  # centres 0 then 2 (farthest)
    torch.testing.assert_close(got[0, 0], torch.tensor([(0 * 1 + 2 * 0.5) / 1.5, 0.0]))
    torch.testing.assert_close(got[0, 1], torch.tensor([10.0, 0.0]))


def _np_block(block, x, anchor, split, centers, start):
    """One condensation block of one image ``x [N, W]`` in numpy (official semantics)."""
    p = {k: v.detach().double().numpy() for k, v in block.state_dict().items()}

    def ln(z, pre):
        mu, var = z.mean(-1, keepdims=True), z.var(-1, keepdims=True)
        return (z - mu) / np.sqrt(var + block.ln_1.eps) * p[f"{pre}.weight"] + p[f"{pre}.bias"]

    seq = x if anchor is None else np.vstack([anchor, x])
    h = ln(seq, "ln_1")
    qkv = h @ p["attn.in_proj_weight"].T + p["attn.in_proj_bias"]
    w, heads = x.shape[1], block.attn.num_heads
    d = w // heads
    outs, maps = [], []
    for i in range(heads):
        q, k, v = (qkv[:, j * w + i * d : j * w + (i + 1) * d] for j in range(3))
        s = (q * d**-0.5) @ k.T
        a = np.exp(s - s.max(1, keepdims=True))
        a /= a.sum(1, keepdims=True)
        maps.append(a)
        outs.append(a @ v)
    out = np.hstack(outs) @ p["attn.out_proj.weight"].T + p["attn.out_proj.bias"]
    a = np.stack(maps)
    if anchor is not None:
        out, a = out[1:], a[:, 1:, 1:]
    x = x + out
    cls = a[:, 0, 1:].mean(0)
    order = np.argsort(-cls, kind="stable")
    keep, clus, rest = np.split(order, [split.keep, split.keep + split.cluster])
    patches = x[1:]
    merged = _np_coreset(patches[clus], centers, start)
    fused = (patches[rest] * cls[rest][:, None]).sum(0, keepdims=True)
    y = np.vstack([x[:1], patches[keep], merged, fused])
    hid = ln(y, "ln_2") @ p["mlp.c_fc.weight"].T + p["mlp.c_fc.bias"]
    hid = 0.5 * hid * (1 + erf(hid / math.sqrt(2)))
    return y + hid @ p["mlp.c_proj.weight"].T + p["mlp.c_proj.bias"]


@pytest.mark.parametrize("with_anchor", [False, True])
def test_condensation_block_against_numpy(classifier, with_anchor):
    """Block 1 of the tiny ViT on 17 tokens at R 0.2: ranking by the class token's
    head-mean attention, 5 kept, 8 condensed into 4, 3 fused: 11 tokens out."""
    block = classifier.visual.transformer.resblocks[1]
    rng = np.random.default_rng(2)
    x = rng.normal(size=(17, 128))
    anchor = rng.normal(size=(1, 128)) if with_anchor else None
    split = token_plan(17, 4, [1], 0.2, 4)[1]
    assert split == Split(5, 8, 3)
    with torch.no_grad():
        got = _condense_block(
            block,
            torch.tensor(x, dtype=torch.float32)[None],
            split,
            None if anchor is None else torch.tensor(anchor[0], dtype=torch.float32)[None],
            4,
            torch.tensor([6]),
        )
    assert got.shape == (1, 11, 128)  # tokens really dropped
    expected = _np_block(block, x, anchor, split, 4, 6)
    np.testing.assert_allclose(got[0].numpy(), expected, rtol=1e-4, atol=1e-4)


def test_layer_weights_and_eviction_scores_against_numpy():
    for scale in (0.01, 0.1, 5.5):  # exp(100) overflows float32: computed as a softmax
        w = np.exp(np.linspace(0, 1, 12) / scale)
        np.testing.assert_allclose(layer_weights(12, scale), w / w.sum(), rtol=1e-6, atol=1e-30)
    rng = np.random.default_rng(3)
    tok = rng.normal(size=(4, 3, 5))
    ents = [0.3, 0.1, 0.7, 0.2]
    mean = tok.mean(1)
    unit = mean / np.linalg.norm(mean, axis=1, keepdims=True)
    sim = unit @ unit.T
    expected = np.array(ents) + (sim.sum(1) - np.diag(sim)) / 3
    got = eviction_scores(torch.tensor(tok, dtype=torch.float32), ents)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6)


def test_reservoir_rules_by_hand():
    r = Reservoir(classes=2, size=2, layers=1, width=2, device="cpu")
    e = [torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 0.1]])]
    r.offer(0, e[0], 0.5)
    r.offer(0, e[1], 0.2)
    assert r.order[0] == [1, 0]  # sorted by entropy
    assert r.anchors() is None  # class 1 is empty
    # full: scores = entropy + similarity to the others; e[2] resembles e[0] (0.995):
    # [0.2 + 0.05, 0.5 + 0.52, 0.4 + 0.55] -> e[0] (0.5 + ...) is dropped, e[2] takes slot 0
    r.offer(0, e[2], 0.4)
    assert r.order[0] == [1, 0] and r.entropy[0] == {0: 0.4, 1: 0.2}
    torch.testing.assert_close(r.tokens[0, 0], e[2])
    r.offer(1, e[0], 0.9)
    assert r.anchors() is None
    r.offer(1, e[1], 0.9)
    anchors = r.anchors()
    torch.testing.assert_close(anchors[0], (e[1] + e[2]) / 2)
    torch.testing.assert_close(anchors[1], (e[0] + e[1]) / 2)
    # the newcomer itself scores highest: nothing changes
    before = r.tokens.clone()
    r.offer(1, torch.tensor([[0.7, 0.7]]), 5.0)
    assert torch.equal(r.tokens, before) and r.order[1] == [0, 1]


def test_reservoir_logits_against_numpy():
    rng = np.random.default_rng(4)
    r = Reservoir(classes=3, size=2, layers=3, width=4, device="cpu")
    entries = [(0, rng.normal(size=(3, 4)), 0.1), (0, rng.normal(size=(3, 4)), 0.2)]
    entries.append((2, rng.normal(size=(3, 4)), 0.3))
    for c, t, ent in entries:
        r.offer(c, torch.tensor(t, dtype=torch.float32), ent)
    q = rng.normal(size=(3, 4))
    w = layer_weights(3, 0.1)
    expected = np.zeros(3)
    for c, t, _ in entries:
        cos = (t * q).sum(1) / np.linalg.norm(t, axis=1) / np.linalg.norm(q, axis=1)
        expected[c] += 2.5 * np.exp(-(5.0 - 5.0 * (cos * w.double().numpy()).sum()))
    got = r.logits(torch.tensor(q, dtype=torch.float32), w, 2.5, 5.0)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5)


def test_official_templates():
    assert len(official_templates("imagenet")) == 80 == len(official_templates("imagenet_r"))
    ucf = official_templates("ucf101")
    assert len(ucf) == 48 and ucf[:2] == ["a photo of a person {}.", "a video of a person {}."]
    assert ucf[-1] == "a demonstration of the person practicing {}."
    assert official_templates("stanford_cars")[3] == "i love my {}!"
    assert official_templates("digits") == ["a photo of a {}."]


def _flops_per_sample(fn, n: int) -> float:
    """FLOPs per sample of ``fn()`` by the harness's counter (which turns torch's fused
    attention fast path off while it counts: its kernel is invisible to the counter)."""
    from tta_bench.run.accounting import _flop_counter

    counter = _flop_counter(True)
    with torch.no_grad(), counter:
        fn()
    return counter.get_total_flops() / n, counter.mode.get_flop_counts()


def test_the_harness_counter_sees_the_zero_shot_attention(classifier, test_images):
    """Regression: gradient-free forwards took torch's fused attention kernel, whose
    FLOPs the counter never saw, so zero-shot and the cache methods (TDA) were counted
    without attention and gradient methods with it; the counter now turns the fast path off
    while it counts, and restores it."""
    images = test_images[0][:8]
    assert torch.backends.mha.get_fastpath_enabled()
    _, counts = _flops_per_sample(lambda: classifier(images), 8)
    ops = {str(op) for per_module in counts.values() for op in per_module}
    assert any("bmm" in op or "scaled_dot_product" in op for op in ops), ops
    assert torch.backends.mha.get_fastpath_enabled()


def test_forward_flops_fall_below_the_zero_shot_forward(classifier, test_images):
    images = test_images[0][:8]
    zero_shot, _ = _flops_per_sample(lambda: classifier(images), 8)
    tca = build_method(TCA, classifier, drop_rate=0.2)
    assert tca.token_counts == [17, 17, 11, 8, 8]
    condensed, counts = _flops_per_sample(lambda: tca.step(images), 8)
    assert condensed < zero_shot
    # the counter sees the dropped tokens: the MLPs of the condensation blocks 1-3 run on
    # 11, 8 and 8 tokens (the counter names a module called on its own by its class), the
    # MLP of block 0 on all 17
    mlp = 8 * 2 * 2 * 128 * 512
    assert sum(counts["Sequential"].values()) == mlp * (11 + 8 + 8)
    assert sum(counts["ResidualAttentionBlock.mlp"].values()) == mlp * 17
    # at the official rate the 16-patch tower keeps its 17 tokens: no saving there
    full = build_method(TCA, classifier)
    assert full.token_counts == [17] * 5
    assert _flops_per_sample(lambda: full.step(images), 8)[0] > condensed


def test_step_shapes_passes_and_anchors(classifier, test_images):
    from tta_bench.run.cost import PassCounter

    images = test_images[0][:40]
    tca = build_method(TCA, classifier)
    counter = PassCounter(tca.model.visual)
    out = seeded_step(tca, images, 0)
    counter.close()
    assert out.shape == (40, 10) and torch.isfinite(out).all()
    assert counter.forward == 40  # one condensed forward per image
    anchors = tca.reservoir.anchors()
    assert anchors is not None and anchors.shape == (10, 4, 128)  # every class has two
    assert tca.predict(images[:3]).shape == (3, 10)
    tca.reseed(0)
    feats, tokens = tca.encode(images[:3])
    assert tokens.shape == (3, 4, 128)
    tca.reseed(0)
    torch.testing.assert_close(tca.encode(images[:3])[0], feats)  # same seed, same centres
    tca.config = dataclasses.replace(tca.config, anchors=False)
    tca.reseed(0)
    assert not torch.allclose(tca.encode(images[:3])[0], feats)  # the anchors change it


def test_reset_seeds_and_update_modes(classifier, test_images):
    images = test_images[0][:6]
    fresh, used, expected = assert_reset_then_reseed_reproduces(
        lambda: build_method(TCA, classifier), images
    )
    assert torch.isfinite(expected).all()
    # no anchors within six images: the batched forward equals the one-image loop
    batched = build_method(TCA, classifier, update="batch")
    torch.testing.assert_close(seeded_step(batched, images, 5), expected, rtol=0, atol=1e-5)


def test_runs_through_the_runner(tmp_path):
    cell = scored_cell(run_method(tmp_path, "tca", max_images=16))
    assert cell["forward_passes_per_sample"] == 1.0
    assert cell["backward_passes_per_sample"] == 0.0


def test_refusals(classifier):
    with pytest.raises(ValueError, match="method.drop_rate"):
        TCA(classifier, dataclasses.replace(TCA.Config(), drop_rate=1.5))
    with pytest.raises(ValueError, match="method.update"):
        TCA(classifier, dataclasses.replace(TCA.Config(), update="stream"))
    with pytest.raises(ValueError, match="drop_layers"):
        build_method(TCA, classifier, drop_layers=[4])
    from open_clip.modified_resnet import ModifiedResNet

    resnet = copy.deepcopy(classifier)
    resnet.clip.visual = ModifiedResNet((1, 1, 1, 1), 64, heads=2, image_size=32, width=8)
    with pytest.raises(ValueError, match="tiny-clip-digits"):
        check_vit(resnet)
    with pytest.raises(ValueError, match="not one"):
        TCA(resnet).setup()
