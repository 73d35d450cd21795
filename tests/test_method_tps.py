"""TPS (mura_plugin.methods.tps) on hand-made prototypes and on the real tiny model and data."""

from __future__ import annotations

import functools
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from method_runs import (
    FAST,
    assert_reset_then_reseed_reproduces,
    assert_same_seeded_steps,
    build_method,
    run_method,
    scored_cell,
    seeded_step,
)

from mura_plugin.methods._view_budget import configured_views
from mura_plugin.methods.tps import (
    TPS,
    descriptor_prompt,
    marginal_entropy,
    shifted_logits,
    tta_vlm_lr,
)
from tta_bench.run.profiles import method_settings
from tta_bench.text_head import resolve_templates

_build = functools.partial(build_method, TPS)


def test_shifted_logits_known_values():
    """Hand-made prototypes (not normalised), one shift per class: the logits are
    ``s * x . normalize(normalize(P_c) + s_c)``, computed by hand in numpy."""
    p = np.array([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0]])  # normalised: e1, e2
    shift = np.array([[0.0, 1.0, 0.0], [0.0, 0.0, -1.0]])
    x = np.array([[0.6, 0.8, 0.0], [0.0, 0.0, 1.0]])  # two images (unit norm)
    t = np.array([[1.0, 1.0, 0.0], [0.0, 1.0, -1.0]]) / math.sqrt(2)  # by hand
    expected = 10.0 * x @ t.T  # [[1.4, 0.8], [0, -1]] / sqrt(2) * 10
    np.testing.assert_allclose(expected, 10 / math.sqrt(2) * np.array([[1.4, 0.8], [0, -1]]))
    as_t = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    # two episodes with the same shift: features [V=1, B=2, D]
    got = shifted_logits(as_t(x)[None], as_t(p), as_t(shift)[None].repeat(2, 1, 1), 10.0)
    np.testing.assert_allclose(got[0].numpy(), expected, rtol=0, atol=1e-5)
    # a zero shift gives the plain cosine logits; a shared shift [B, 1, D] broadcasts
    zero = shifted_logits(as_t(x)[None], as_t(p), torch.zeros(2, 1, 3), 10.0)[0]
    np.testing.assert_allclose(zero.numpy(), 10 * x @ np.eye(3)[:2].T, rtol=0, atol=1e-6)


def test_marginal_entropy_and_descriptor_prompts():
    logits = torch.tensor([[[2.0, 0.0]], [[0.0, 1.0]]])  # [K=2, B=1, C=2]
    p = torch.tensor([[2.0, 0.0], [0.0, 1.0]]).softmax(-1).mean(0).numpy()
    assert float(marginal_entropy(logits)[0]) == pytest.approx(-(p * np.log(p)).sum(), abs=1e-6)
    assert descriptor_prompt("beagle", "long, droopy ears") == "beagle, which has long, droopy ears"
    assert descriptor_prompt("pug", "a curled tail") == "pug, which is a curled tail"
    assert descriptor_prompt("pug", "athletic build") == "pug, which is athletic build"
    assert descriptor_prompt("pug", "often fawn") == "pug, which often fawn"
    assert descriptor_prompt("pug", "used for herding") == "pug, which is used for herding"
    assert descriptor_prompt("pug", "Short coat") == "pug, which has Short coat"


def test_one_step_is_adamw_on_the_confident_views_entropy(classifier, batch):
    """After one step each episode's shift is AdamW's first step ``-lr g / (|g| + eps)`` with
    ``g`` the gradient of the marginal entropy of its int(20 * 0.1) = 2 lowest-entropy views
    (weight decay acts on a zero shift: nothing), computed here separately with autograd."""
    method = _build(classifier, views=19)  # 20 views: the 2 most confident are kept
    method.reseed(3)
    views = configured_views(batch, method.config, method.generator)
    with torch.no_grad():
        feats = method.model.encode_image(views.flatten(0, 1)).view(20, 4, -1)
    got = method.adapt_shifts(feats)
    scale = float(method.model.logit_scale)
    proto = F.normalize(method.prototypes, dim=-1)
    for b in range(4):
        s = torch.zeros_like(proto, requires_grad=True)
        text = F.normalize(proto + s, dim=-1)
        logits = scale * feats[:, b] @ text.t()  # [V, C]
        logp = logits.log_softmax(-1)
        ent = -(logp.exp() * logp).sum(-1)
        kept = logp[ent.argsort()[:2]]
        mean = kept.exp().mean(0)
        (-(mean * mean.log()).sum()).backward()
        g = s.grad
        expected = -5e-3 * g / (g.abs() + 1e-8)
        torch.testing.assert_close(got[b], expected, rtol=0, atol=1e-7)
    assert got.shape == (4, classifier.num_classes, proto.shape[1])


def test_batched_episodes_equal_the_per_image_loop(classifier, batch):
    together = _build(classifier, chunk_episodes=4, steps=2, **FAST)
    alone = _build(classifier, chunk_episodes=1, steps=2, **FAST)
    assert_same_seeded_steps(together, alone, batch, seed=4, loss_atol=1e-6)


def test_without_steps_it_is_the_zero_shot_classifier(classifier, batch):
    method = _build(classifier, steps=0, **FAST)
    method.reseed(0)
    torch.testing.assert_close(method.step(batch), classifier(batch), rtol=0, atol=2e-5)
    official = _build(classifier, steps=0, text_head="official", **FAST)
    torch.testing.assert_close(
        official.class_embeddings(),
        classifier.encode_templates(resolve_templates("clip-imagenet-80")),
        rtol=0,
        atol=1e-6,
    )


@pytest.mark.filterwarnings("ignore:tiny-clip-digits was pretrained on the digits prompts only")
def test_descriptions_give_the_micro_pooled_prototypes(classifier, tmp_path):
    """With a prompts file: (mean of the normalised descriptor-prompt features + mean of the
    normalised template features) / 2, both unnormalised means, encoded here directly with
    ``clip.encode_text``."""
    names = classifier.classnames
    table = {c: ["a round shape", "thin strokes"] for c in names}
    path = tmp_path / "d.json"
    path.write_text(json.dumps(table))
    method = _build(classifier, prompts=str(path), **FAST)

    def mean_features(prompts):
        with torch.no_grad():
            f = classifier.clip.encode_text(classifier.tokenizer(prompts))
        return F.normalize(f.float(), dim=-1).mean(0)

    expected = torch.stack(
        [
            (
                mean_features([f"{c}, which is a round shape", f"{c}, which has thin strokes"])
                + mean_features([t.format(c) for t in classifier.templates])
            )
            / 2
            for c in names
        ]
    )
    torch.testing.assert_close(method.prototypes, expected, rtol=0, atol=1e-5)
    raw = _build(classifier, prompts=str(path), descriptor_sentence=False, **FAST)
    assert not torch.allclose(raw.prototypes, method.prototypes)
    path.write_text(json.dumps({names[0]: ["x"]}))
    with pytest.raises(ValueError, match="no descriptions"):
        _build(classifier, prompts=str(path))


def test_reset_and_seed_reproduce(classifier, batch):
    build = functools.partial(_build, classifier, **FAST)
    _, used, a = assert_reset_then_reseed_reproduces(build, batch)
    assert torch.equal(a, seeded_step(build(), batch, 5))  # and a third, new one
    assert torch.equal(used.shift, torch.zeros_like(used.shift))  # the initial shift stays


def test_class_attributes_and_defaults(classifier):
    assert TPS.stream_kind == "episodic" and not TPS.adapts and not TPS.light
    assert method_settings("tta_vlm", "tps") == {"lr": None}
    d = TPS.Config()
    assert (d.views, d.selection, d.lr, d.weight_decay, d.steps, d.per_class) == (
        63,
        0.1,
        5e-3,
        0.01,
        1,
        True,
    )
    assert (d.augmix, d.prompts, d.text_head, d.precision) == (False, None, "protocol", "fp16")
    assert tta_vlm_lr("digits") == 5e-3 and tta_vlm_lr(None) == 5e-3
    shared = _build(classifier, per_class=False, **FAST)
    assert shared.shift.shape == (1, classifier.class_embeddings.shape[1])


@pytest.mark.parametrize("tta_vlm", [False, True])
def test_end_to_end_through_the_runner(tmp_path, tta_vlm):
    record = run_method(tmp_path, "tps", tta_vlm=tta_vlm, max_images=16)
    scored_cell(record)
    assert record["method_resolved"] == {"lr": 5e-3}  # digits: TTA-VLM's ImageNet-set rate
