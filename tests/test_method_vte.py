"""VTE (mura_plugin/methods/vte.py): the ensemble of given view features against a numpy
reference written from the reference harness's rule (lowest-entropy share of the views,
mean feature, logits), a real step on the tiny model (the image alone is the zero-shot
classifier; the view memory budget changes nothing), reset, seeds, the reference's
prompt-ensemble head per dataset, and the reference defaults."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from method_runs import FAST, assert_reset_then_reseed_reproduces, build_method, seeded_step

from mura_plugin.methods.vte import VTE, VTEConfig, official_templates, vte_ensemble


def _reference(feats: np.ndarray, head: np.ndarray, scale: float, share: float) -> np.ndarray:
    """Per sample: logits of every view, entropy of their softmax, the int(V * share)
    (at least 1) lowest-entropy views, scale * mean of their features @ head^T."""
    v, b, _ = feats.shape
    k = max(1, int(v * share))
    out = []
    for i in range(b):
        logits = scale * feats[:, i] @ head.T
        z = logits - logits.max(axis=1, keepdims=True)
        p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
        entropy = -(p * np.log(p)).sum(axis=1)
        keep = np.argsort(entropy, kind="stable")[:k]
        out.append(scale * feats[keep, i].mean(axis=0) @ head.T)
    return np.stack(out)


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


@pytest.mark.parametrize(("views", "share"), [(10, 0.1), (10, 0.3), (64, 0.1), (3, 0.1)])
def test_ensemble_equals_the_reference(views, share):
    rng = np.random.default_rng(0)
    feats = _unit(rng.normal(size=(views, 5, 8)))
    head = _unit(rng.normal(size=(4, 8)))
    got = vte_ensemble(torch.tensor(feats, dtype=torch.float32), torch.tensor(head), 20.0, share)
    expected = _reference(feats, head, 20.0, share)
    np.testing.assert_allclose(got.double().numpy(), expected, rtol=0, atol=1e-4)
    # all views kept: the plain mean of the view logits
    everything = vte_ensemble(torch.tensor(feats, dtype=torch.float32), torch.tensor(head), 20.0, 1)
    np.testing.assert_allclose(
        everything.double().numpy(), (20.0 * feats @ head.T).mean(axis=0), rtol=0, atol=1e-4
    )


def test_a_hand_built_case_keeps_the_confident_views_not_the_original():
    """3 classes along the axes, 10 views of one image: view 0 (the original) is uncertain
    (entropy 1.01 nats), views 1 and 2 are confident for class 2 (0.001, 0.37), view 3
    leans to class 0 (0.66), the rest uniform (ln 3). share 0.2 keeps 2 views: 1 and 2,
    whose mean feature gives the output."""
    head = torch.eye(3)
    feats = torch.full((10, 1, 3), 3**-0.5)
    feats[0, 0] = torch.nn.functional.normalize(torch.tensor([0.5, 0.55, 0.6]), dim=0)
    feats[1, 0] = torch.tensor([0.0, 0.0, 1.0])
    feats[2, 0] = torch.tensor([0.0, 0.6, 0.8])
    feats[3, 0] = torch.nn.functional.normalize(torch.tensor([0.7, 0.5, 0.5]), dim=0)
    got = vte_ensemble(feats, head, 10.0, 0.2)
    expected = 10.0 * torch.tensor([[0.0, 0.3, 0.9]])  # mean of views 1 and 2, scaled
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # a mean of the kept probabilities would differ: VTE averages features (= logits)
    probs = (10.0 * feats[1:3, 0]).softmax(dim=-1).mean(dim=0)
    assert not torch.allclose(got.softmax(dim=-1)[0], probs, atol=1e-3)


# -- on the tiny model --------------------------------------------------------------------


def test_the_image_alone_is_the_zero_shot_classifier(classifier, batch):
    method = build_method(VTE, classifier, views=0)
    with torch.no_grad():
        expected = classifier(batch)
    torch.testing.assert_close(seeded_step(method, batch, 0), expected, rtol=0, atol=1e-5)


def test_a_step_on_the_tiny_model(classifier, batch):
    method = build_method(VTE, classifier, **FAST)
    before = {k: v.clone() for k, v in method.model.state_dict().items()}
    out = seeded_step(method, batch, 3)
    assert out.shape == (batch.shape[0], classifier.num_classes)
    assert torch.isfinite(out).all()
    for key, value in method.model.state_dict().items():
        assert torch.equal(before[key], value), key
    with torch.no_grad():
        assert not torch.allclose(out, classifier(batch), atol=1e-3)  # the views acted
    # the same draws rendered and encoded one image at a time: the same logits
    small = build_method(VTE, classifier, **FAST, view_memory_mb=0.01)
    torch.testing.assert_close(seeded_step(small, batch, 3), out, rtol=0, atol=1e-5)


def test_the_step_is_the_ensemble_of_the_drawn_views(classifier, batch):
    from mura_plugin.methods._view_budget import configured_views

    method = build_method(VTE, classifier, views=5, selection=0.5)
    out = seeded_step(method, batch, 11)
    generator = torch.Generator().manual_seed(11)
    views = configured_views(batch, method.config, generator)  # [6, B, C, H, W]
    with torch.no_grad():
        feats = classifier.encode_image(views.flatten(0, 1)).view(6, batch.shape[0], -1)
    expected = vte_ensemble(feats, classifier.class_embeddings, float(classifier.logit_scale), 0.5)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


def test_reset_and_seeds(classifier, batch):
    images = batch[:2]
    build = lambda: build_method(VTE, classifier, views=3)  # noqa: E731
    fresh, _, expected = assert_reset_then_reseed_reproduces(build, images)
    assert not torch.equal(seeded_step(fresh, images, 6), expected)  # other views
    assert torch.equal(seeded_step(fresh, images, 5), expected)


# -- the reference's head and defaults ----------------------------------------------------


def test_official_templates_follow_the_reference_prefix_rule():
    cifar = official_templates("cifar10_c")
    assert len(cifar) == 18 and cifar == official_templates("cifar100")
    assert cifar[:2] == ["a photo of a {}.", "a blurry photo of a {}."]
    assert cifar[-1] == "a photo of the big {}."
    caltech = official_templates("caltech101")
    assert len(caltech) == 34 and caltech[2] == "a plastic {}." and caltech[19] == "the plastic {}."
    assert official_templates("dtd")[0] == "a photo of a {} texture."
    assert official_templates("eurosat") == [
        "a centered satellite photo of {}.",
        "a centered satellite photo of a {}.",
        "a centered satellite photo of the {}.",
    ]
    assert official_templates("food101") == ["a photo of {}, a type of food."]
    assert official_templates("sun397") == ["a photo of a {}.", "a photo of the {}."]
    # no list under the prefix: CLIP's 80 ImageNet templates
    for dataset in ("imagenet_c", "imagenet_r", "digits", "oxford_pets", "ucf101", None):
        templates = official_templates(dataset)
        assert len(templates) == 80 and templates[0] == "a bad photo of a {}."


def test_the_official_head_is_the_methods_own(classifier, batch):
    method = build_method(VTE, classifier, views=0, text_head="official")
    protocol_head = classifier.class_embeddings.clone()
    assert not torch.allclose(method.head, protocol_head)
    assert torch.equal(method.model.class_embeddings, protocol_head)
    assert torch.isfinite(method.step(batch)).all()


def test_defaults_are_the_reference_configuration():
    cfg = VTEConfig()
    # cfgs/imagenet_c/vte.yaml: N_AUGMENTATIONS 64 (the image + 63 crops), TPT.SELECTION_P
    # 0.1, AugMix off outside the fine-grained sets, CLIP.PRECISION fp16 (its default)
    assert (cfg.views, cfg.include_original, cfg.selection) == (63, True, 0.1)
    assert (cfg.augmix, cfg.crop_scale_min, cfg.flip) == (False, 0.08, True)
    assert (cfg.precision, cfg.text_head) == ("fp16", "protocol")
    assert max(1, int(64 * cfg.selection)) == 6
    assert VTE.stream_kind == "episodic" and not VTE.adapts and not VTE.light
