"""MCP / MCP++ (mura_plugin/methods/mcp.py): the confident-view selection, the align-cache
rule and the positive/negative loss by hand; whole streams of MCP and MCP++ against the
official per-image loop written out here with Python lists (numpy for MCP, torch float64
autograd for MCP++'s residual step) on the real tiny model; the per-dataset table and its
names; reset, seeds, the feature path, bad values, the runner end to end."""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from method_runs import run_method

from mura_plugin.methods._cache import EntropyCache
from mura_plugin.methods.mcp import (
    CONFIG_FILES,
    MCP,
    SETTINGS,
    confident_views,
    offer_align,
    pos_to_neg,
)


def _build(classifier, **kw) -> MCP:
    method = MCP(copy.deepcopy(classifier), dataclasses.replace(MCP.Config(), **kw))
    method.setup()
    return method


# -- pieces by hand -------------------------------------------------------------------------
def test_confident_views_by_hand():
    probs = torch.tensor(
        [[0.5, 0.3, 0.2], [0.9, 0.05, 0.05], [0.1, 0.8, 0.1], [0.34, 0.33, 0.33]]
    ).double()
    p_bar, label, ent = confident_views(probs, 2)
    # entropies with +1e-6: view 1 (0.39) and view 2 (0.64) are the two lowest
    expected = (probs[1] + probs[2]) / 2
    torch.testing.assert_close(p_bar, expected)
    assert label == 0  # (0.5, 0.425, 0.075)
    assert ent == pytest.approx(float(-(expected * expected.log()).sum()), rel=1e-9)


def test_align_cache_takes_a_free_slot_then_needs_lower_entropy_and_nearer():
    cache = EntropyCache(classes=2, shots=2, dim=2, value_dim=1, device="cpu")
    center = torch.tensor([1.0, 0.0])
    offer_align(cache, 1, torch.tensor([0.0, 1.0]), 0.9, center)  # free slot: any distance
    offer_align(cache, 1, torch.tensor([0.0, -1.0]), 0.9, center)
    assert cache.entropy[1].tolist() == pytest.approx([0.9, 0.9])
    # full: lower entropy but farther from the centre than the entry it would evict
    offer_align(cache, 1, torch.tensor([-1.0, 0.0]), 0.1, center)
    assert cache.keys[1].tolist() == [[0.0, 1.0], [0.0, -1.0]]
    # nearer but not lower in entropy
    offer_align(cache, 1, torch.tensor([1.0, 0.1]), 0.9, center)
    assert cache.keys[1].tolist() == [[0.0, 1.0], [0.0, -1.0]]
    # lower and nearer: replaces the last of the tied highest-entropy entries (slot 1)
    offer_align(cache, 1, torch.tensor([0.9, 0.1]), 0.2, center)
    torch.testing.assert_close(cache.keys[1], torch.tensor([[0.0, 1.0], [0.9, 0.1]]))
    assert cache.entropy[1].tolist() == pytest.approx([0.9, 0.2])
    assert not torch.isfinite(cache.entropy[0]).any()  # the other class untouched


def test_pos_to_neg_against_numpy():
    keys = torch.tensor([[1.0, 0.0, 0.0], [0.6, 0.8, 0.0]])
    negatives = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]])  # class 1: no negatives
    cos0 = 0.5 / math.sqrt(0.5)
    expected = -(math.log(1 - cos0 + 1e-7) + math.log(1 - 0.0 + 1e-7)) / 2
    assert float(pos_to_neg(keys, negatives)) == pytest.approx(expected, rel=1e-6)


# -- the official loop, written out ---------------------------------------------------------
def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _entropy(z):
    p = _softmax(z)
    return float(-(p * np.log(p)).sum())


class _Reference:
    """run_test_mcp's per-image body (--res False, batch size 1) with its dict-of-lists
    caches, sorted with Python's stable sort, in float64."""

    def __init__(self, text, scale, alpha, beta, shots, neg_band, cen=0.8):
        self.text, self.scale, self.cen = text, scale, cen
        self.alpha, self.beta = alpha, beta  # scale_alpha off: the official alphas
        self.neg_alpha = 0.117
        self.shots = shots  # (entropy, align, negative)
        self.lower, self.upper = neg_band
        c, d = text.shape
        self.ent, self.align, self.neg = {}, {}, {}
        self.memory = np.zeros((c, shots[0] + shots[1], d))
        self.keys = np.zeros((c, d))
        self.counts = {"neg": 0, "reflect": 0}

    @staticmethod
    def _update(cache, pred, item, cap):
        if pred in cache:
            if len(cache[pred]) < cap:
                cache[pred].append(item)
            elif item[1] < cache[pred][-1][1]:
                cache[pred][-1] = item
            cache[pred].sort(key=lambda t: t[1])
        else:
            cache[pred] = [item]

    def _align(self, pred, feat, ent):
        active = np.abs(self.keys[pred]).sum() != 0
        center = self.cen * self.keys[pred] + (1 - self.cen) * self.text[pred] if active else None
        center = self.text[pred] if center is None else center
        entries = self.align.setdefault(pred, [])
        if len(entries) < self.shots[1]:
            entries.append((feat, ent))
        elif ent < entries[-1][1] and np.linalg.norm(feat - center) < np.linalg.norm(
            entries[-1][0] - center
        ):
            entries[-1] = (feat, ent)
        entries.sort(key=lambda t: t[1])

    def _joint(self, classes):
        for cls in classes:
            rows = [f for f, _ in self.align.get(cls, [])] + [f for f, _ in self.ent.get(cls, [])]
            self.memory[cls] = 0
            self.memory[cls, : len(rows)] = rows
            self.keys[cls] = np.mean(rows, axis=0)

    def _cache(self, x, cache, alpha, beta, neg=False):
        out = np.zeros(self.text.shape[0])
        for cls in sorted(cache):
            for item in cache[cls]:
                w = alpha * math.exp(-beta * (1 - item[0] @ x))
                if neg:
                    out += w * ((item[2] > 0.03) & (item[2] < 1.0))
                else:
                    out[cls] += w
        return out

    def _readout(self, f0):
        logits = []
        for c in range(self.text.shape[0]):
            rows = [m / np.linalg.norm(m) for m in self.memory[c] if m.sum() != 0]
            rows.append(self.text[c] / np.linalg.norm(self.text[c]))
            rows = np.stack(rows)
            proto = (np.exp(-5.5 * (1 - rows @ f0))[:, None] * rows).sum(0)
            logits.append(self.scale * f0 @ proto / np.linalg.norm(proto))
        return _softmax(np.array(logits))

    def step(self, feats, k):
        c = self.text.shape[0]
        logits = self.scale * feats @ self.text.T
        probs = _softmax(logits)
        x, z = feats[0], logits[0]
        h, y = _entropy(z), int(z.argmax())
        ranking = -(probs * np.log(probs + 1e-6)).sum(1)
        p_bar = probs[np.argsort(ranking, kind="stable")[:k]].mean(0)
        y_a, h_a = int(p_bar.argmax()), float(-(p_bar * np.log(np.maximum(p_bar, 1e-8))).sum())
        self._update(self.ent, y, (x, h), self.shots[0])
        self._align(y_a, feats[0], h_a)
        self._joint({y, y_a})
        if self.lower < h / math.log2(c) < self.upper:
            n = z + self._cache(x, self.ent, self.alpha, self.beta)
            hn = _entropy(n)
            if self.lower < hn / math.log2(c) < self.upper:
                self._update(self.neg, int(n.argmax()), (x, hn, _softmax(n)), self.shots[2])
                self.counts["neg"] += 1
            elif hn / math.log2(c) <= self.lower:
                self._update(self.ent, int(n.argmax()), (x, hn), self.shots[0])
                self.counts["reflect"] += 1
        final = z.copy()
        for cls in np.flatnonzero(np.abs(self.keys).sum(1) != 0):
            final[cls] += self.alpha * math.exp(-self.beta * (1 - x @ self.keys[cls]))
        final -= self._cache(x, self.neg, self.neg_alpha, 1.0, neg=True)
        p_cache = _softmax(final)
        return np.log((p_bar + self._readout(feats[0]) + p_cache) / 3)


def _view_features(classifier, images, n_views, seed):
    from mura_plugin.augment import make_views

    views = make_views(images, n_views, torch.Generator().manual_seed(seed), scale=(0.5, 1.0))
    with torch.no_grad():
        f = classifier.encode_image(views.flatten(0, 1)).view(n_views + 1, len(images), -1)
    return f / f.norm(dim=-1, keepdim=True)


SMALL = dict(pos_shots=2, align_shots=1, neg_shots=1, neg_entropy_lower=0.1, scale_alpha=False)


def test_stream_equals_the_official_loop(classifier, test_images):
    """Two batches of 8 noisy digits, 3 views each, small caches so that every rule acts
    (evictions, negative entries, reflected entries), against ``_Reference``."""
    x, _ = test_images
    images = x[:16] + 0.4 * torch.randn(x[:16].shape, generator=torch.Generator().manual_seed(1))
    images = images.clamp(0, 1)
    mcp = _build(classifier, n_views=2, selection=0.5, **SMALL)
    alpha, beta = SETTINGS["imagenet"][:2]  # a set with no config of its own
    assert (mcp.alpha, mcp.beta, mcp.augmix) == (alpha, beta, False)
    text = mcp.head.double().numpy()
    scale = float(classifier.logit_scale)
    ref = _Reference(text, scale, alpha, beta, (2, 1, 1), (0.1, 0.5))
    for batch, seed in ((images[:8], 3), (images[8:], 4)):
        mcp.reseed(seed)
        got = mcp.step(batch)
        feats = _view_features(classifier, batch, 2, seed).double().numpy()
        for i in range(len(batch)):
            expected = ref.step(feats[:, i], 1)
            np.testing.assert_allclose(got[i].numpy(), expected, rtol=1e-4, atol=1e-4)
    assert ref.counts["neg"] > 0 and ref.counts["reflect"] > 0, ref.counts
    assert sum(len(v) for v in ref.align.values()) == int(mcp.align_cache.entropy.isfinite().sum())
    np.testing.assert_allclose(mcp.protos.numpy(), ref.keys, atol=1e-5)


def _plus_reference(mcp, feats, lr, k, steps=1):
    """MCP++'s residual step for one image, written out (torch float64 autograd) from the
    method's caches *after* its own update of this image: (p_views, p_cache)."""
    scale = float(mcp.model.logit_scale)
    head = mcp.head.double()
    feats = feats.double()
    alpha = mcp.alpha * scale / 100
    classes = [c for c in range(head.shape[0]) if bool(mcp.active[c])]
    base = mcp.protos.double()[classes].t()  # [D, K] as the official pos_cache_keys
    neg = []
    for c in classes:
        valid = torch.isfinite(mcp.neg_cache.entropy[c])
        rows = mcp.neg_cache.keys[c][valid].double()
        neg.append(rows.mean(0) if len(rows) else torch.zeros(head.shape[1]).double())
    neg = torch.stack(neg)
    neg_logits = mcp.neg_cache.logits(feats[0].float(), 0.117 * scale / 100, 1.0).double()
    rt = torch.zeros_like(head.t(), requires_grad=True)  # [D, C] as TextResidue
    rv = torch.zeros_like(base, requires_grad=True)
    w = F.normalize(F.normalize(head.t(), dim=0) + rt, dim=0)
    final = (scale * feats[0] @ w).clone()
    opt = torch.optim.AdamW(
        [{"params": [rt], "lr": lr}, {"params": [rv], "lr": lr}], eps=1e-3, weight_decay=0.1
    )

    def pos(keys):
        out = torch.zeros(head.shape[0], dtype=torch.float64)
        out[classes] = alpha * torch.exp(-mcp.beta * (1 - feats[0] @ keys))
        return out

    for j in range(steps):
        w = F.normalize(F.normalize(head.t(), dim=0) + rt, dim=0)
        keys = F.normalize(base + rv, dim=0)
        final = final + pos(keys) - neg_logits
        p = final.softmax(-1)
        ent = -(p * final.log_softmax(-1)).sum()
        a, b = F.normalize(keys, dim=-1), F.normalize(w[:, classes], dim=-1)  # [D, K] rows
        nce = F.cross_entropy(a @ b.t() / 0.01, torch.arange(a.shape[0]))
        p2n = -torch.log(1 - F.cosine_similarity(keys.t(), neg, dim=1) + 1e-7).mean()
        opt.zero_grad()
        (ent + 0.5 * nce + 0.2 * p2n).backward(retain_graph=j < steps - 1)
        opt.step()
    with torch.no_grad():
        w = F.normalize(F.normalize(head.t(), dim=0) + rt, dim=0)
        p_views = confident_views((scale * feats @ w).softmax(-1), k)[0]
        final = final + pos(F.normalize(base + rv, dim=0)) - neg_logits
    return p_views, final.softmax(-1)


@pytest.mark.parametrize("steps", [1, 2])
def test_mcp_plus_plus_step_equals_the_written_out_residual_update(classifier, test_images, steps):
    x, _ = test_images
    lr = 1e-2  # large enough that the step moves the prediction
    mcp = _build(
        classifier, variant="mcp++", n_views=2, selection=0.5, lr_text=lr, lr_image=lr, steps=steps
    )
    mcp.reseed(0)
    mcp.step(x[:6])  # fill the caches
    image = x[6:7]
    feats = _view_features(classifier, image, 2, 9)[:, 0]
    captured = {}
    real_mix = mcp._mix

    def spy(p_views, p_cache, f0):
        captured["views"], captured["cache"] = p_views, p_cache
        return real_mix(p_views, p_cache, f0)

    mcp._mix = spy
    logits, loss = mcp.adapt_sample(feats)
    p_views, p_cache = _plus_reference(mcp, feats, lr, 1, steps)
    torch.testing.assert_close(captured["views"].double(), p_views, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(captured["cache"].double(), p_cache, rtol=1e-4, atol=1e-5)
    plain = confident_views((float(classifier.logit_scale) * feats @ mcp.head.t()).softmax(-1), 1)
    assert not torch.allclose(captured["views"], plain[0], atol=1e-6)  # the text moved
    assert loss is not None and torch.isfinite(loss) and torch.isfinite(logits).all()


# -- per-dataset settings -------------------------------------------------------------------
#: configs/<file>.yaml of the official repository: positive alpha, beta, lr text = lr image.
OFFICIAL_CONFIGS = {
    "imagenet.yaml": (5.5, 8.0, 6e-5),
    "imagenet_a.yaml": (4.0, 3.0, 3e-4),
    "imagenet_v.yaml": (2.5, 1.0, 8e-5),
    "imagenet_r.yaml": (1.0, 8.0, 8e-5),
    "imagenet_s.yaml": (2.0, 3.0, 1e-4),
    "aircraft.yaml": (4.0, 5.0, 1e-4),
    "caltech101.yaml": (5.0, 5.0, 8e-5),
    "dtd.yaml": (5.0, 7.0, 6e-4),
    "eurosat.yaml": (3.0, 8.0, 4e-4),
    "food101.yaml": (1.0, 1.0, 2e-4),
    "oxford_flowers.yaml": (1.0, 8.0, 8e-4),
    "oxford_pets.yaml": (2.0, 7.0, 4e-4),
    "stanford_cars.yaml": (3.0, 4.0, 1e-4),
    "sun397.yaml": (1.0, 2.0, 3e-4),
    "ucf101.yaml": (1.0, 7.0, 8e-4),
}


def test_every_official_config_maps_to_a_registered_dataset():
    from tta_bench.registry import registry

    names = set(registry("datasets").names())
    assert set(CONFIG_FILES) == set(SETTINGS) and set(CONFIG_FILES.values()) == set(
        OFFICIAL_CONFIGS
    )
    for dataset, file in CONFIG_FILES.items():
        assert dataset in names, dataset
        alpha, beta, lr = OFFICIAL_CONFIGS[file]
        assert SETTINGS[dataset] == (alpha, beta, lr, lr), file
    assert CONFIG_FILES["fgvc_aircraft"] == "aircraft.yaml"
    assert CONFIG_FILES["imagenet_sketch"] == "imagenet_s.yaml"


@pytest.mark.parametrize(
    ("dataset", "augmix", "on_views"),
    [("imagenet_a", False, True), ("oxford_flowers", True, False), ("digits", False, False)],
)
def test_settings_follow_the_dataset(classifier, dataset, augmix, on_views):
    model = copy.copy(classifier)
    model.dataset = dataset  # the classes are the digits'; only the rules are checked
    method = MCP(model, MCP.Config())
    method.setup()
    alpha, beta, lr_text, lr_image = SETTINGS.get(dataset, SETTINGS["imagenet"])
    assert method.resolved_settings() == {
        "alpha": alpha,
        "beta": beta,
        "lr_text": lr_text,
        "lr_image": lr_image,
        "augmix": augmix,
        "query_on_views": on_views,
    }
    override = MCP(model, dataclasses.replace(MCP.Config(), pos_alpha=0.5, lr_text=0.0))
    override.setup()
    assert (override.alpha, override.lr_text, override.beta) == (0.5, 0.0, beta)


# -- the Method contract --------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["mcp", "mcp++"])
def test_reset_returns_to_setup_and_seeds_repeat(classifier, batch, variant):
    fresh = _build(classifier, variant=variant, n_views=3)
    fresh.reseed(7)
    expected = fresh.step(batch)
    assert expected.shape == (len(batch), 10) and torch.isfinite(expected).all()
    torch.testing.assert_close(expected.exp().sum(-1), torch.ones(len(batch)))
    assert (fresh.last_loss is None) == (variant == "mcp")
    used = _build(classifier, variant=variant, n_views=3)
    used.reseed(1)
    used.step(batch)
    assert bool(used.active.any()) and torch.isfinite(used.entropy_cache.entropy).any()
    used.reset()
    assert not used.active.any() and not used.memory.any()
    assert not torch.isfinite(used.align_cache.entropy).any()
    used.reseed(7)
    assert torch.equal(used.step(batch), expected)
    other = _build(classifier, variant=variant, n_views=3)
    other.reseed(8)
    assert not torch.equal(other.step(batch), expected)  # the seed draws the views


def test_feature_path_without_views(classifier, batch):
    mcp = _build(classifier, n_views=0)
    assert mcp.features_only() and not _build(classifier).features_only()
    out = mcp.step(batch)
    replay = _build(classifier, n_views=0)
    with torch.no_grad():
        feats = classifier.encode_image(batch)
    torch.testing.assert_close(replay.step_features(feats), out, rtol=0, atol=1e-6)
    assert mcp.predict(batch).shape == out.shape


@pytest.mark.parametrize(
    ("field", "value"),
    [("variant", "mcp+"), ("center", 1.5), ("align_shots", 0), ("query_views", "all")],
)
def test_bad_values_are_refused_by_name(classifier, field, value):
    with pytest.raises(ValueError, match=field):
        MCP(classifier, dataclasses.replace(MCP.Config(), **{field: value}))


def test_runs_through_the_runner_with_its_defaults(tmp_path):
    record = run_method(tmp_path, "mcp", "method.n_views=3", max_images=16)
    [cell] = record["cells"]
    assert cell["n"] == 16 and 0.0 <= cell["accuracy"] <= 1.0
    assert math.isfinite(cell["nll"])
