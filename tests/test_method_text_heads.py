"""One text head per protocol: every method starts from the protocol's templates (the
zero-shot head); ``text_head=official`` is the head of the method's official code."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from mura_plugin.methods.lora import LoRA
from mura_plugin.methods.mura import MuRA
from mura_plugin.methods.tda import IMAGENET_7, TDA
from mura_plugin.methods.tpt import TPT, PromptTextEncoder
from mura_plugin.methods.zero import Zero
from mura_plugin.methods.zeroshot import ZeroShot
from tta_bench.text_head import resolve_templates

METHODS = [LoRA, MuRA, TPT, Zero, TDA]
# TPT encodes its prompts itself (sequence cut after the end token, its own template
# mean): the same computation as encode_text, to float32 rounding of unit vectors
ATOL = {TPT: 1e-6}


def _build(cls, classifier, dataset=None, share=False, **overrides):
    model = classifier if share else copy.deepcopy(classifier)
    model.dataset = dataset
    fast = {} if cls is TDA else {"views": 3}  # TDA's views is a mode (official|single|multi)
    method = cls(model, dataclasses.replace(cls.Config(), **{**fast, **overrides}))
    torch.manual_seed(0)
    method.setup()
    return method


@pytest.fixture(scope="module")
def images(test_images):
    return test_images[0][:6]


@pytest.mark.parametrize("cls", METHODS)
def test_protocol_head_is_the_zero_shot_head(cls, classifier):
    method = _build(cls, classifier)
    torch.testing.assert_close(
        method.class_embeddings(), classifier.class_embeddings, rtol=0, atol=ATOL.get(cls, 0)
    )


@pytest.mark.parametrize("cls", METHODS)
def test_official_head_is_the_official_codes_prompt(cls, classifier):
    """TPT, TTL (and MuRA, built on TTL) and ZERO: "a photo of a {}."; TDA on a dataset its
    official code has no loader for: the same single prompt."""
    method = _build(cls, classifier, text_head="official")
    single = classifier.encode_templates(["a photo of a {}."])
    head = method.class_embeddings()
    torch.testing.assert_close(head, single, rtol=0, atol=ATOL.get(cls, 0))
    assert float((head - classifier.class_embeddings).abs().max()) > 1e-2


@pytest.mark.parametrize(
    ("dataset", "templates"),
    [
        ("imagenet_a", list(IMAGENET_7)),
        ("imagenet_v2", list(IMAGENET_7)),
        ("imagenet", list(IMAGENET_7)),
        ("imagenet_r", resolve_templates("clip-imagenet-80")),
        ("imagenet_sketch", resolve_templates("clip-imagenet-80")),
    ],
)
def test_tda_official_head_follows_its_dataset_loader(classifier, dataset, templates):
    """TDA's loaders: 7 templates for ImageNet, -A, -V2; CLIP's 80 for -R and -Sketch."""
    tda = _build(TDA, classifier, dataset=dataset, text_head="official", views="single")
    assert len(templates) in (7, 80)
    torch.testing.assert_close(
        tda.class_embeddings(), classifier.encode_templates(templates), rtol=0, atol=0
    )


@pytest.mark.parametrize("cls", [Zero, TDA])
def test_training_free_methods_leave_the_shared_model_alone(cls, classifier, images):
    """adapts = False: the runner shares the model with the reference scoring, so an
    official head is the method's own tensor and the model's head is never replaced."""
    model = copy.deepcopy(classifier)
    before = model.class_embeddings.clone()
    method = _build(cls, model, share=True, text_head="official")
    method.reseed(0)
    method.step(images)
    assert method.model is model
    assert torch.equal(model.class_embeddings, before)
    assert model.templates == classifier.templates


def test_tpt_without_steps_is_the_zero_shot_classifier(classifier, images):
    """One learnable context per protocol template, initialised from the template's text:
    before any step TPT's logits are the zero-shot logits (float32 rounding of
    logit_scale ~13 times unit-vector products)."""
    tpt = _build(TPT, classifier, steps=0)
    zeroshot = ZeroShot(classifier)
    tpt.reseed(0)
    out = tpt.step(images)
    torch.testing.assert_close(out, zeroshot.step(images), rtol=0, atol=2e-5)


def test_tpt_contexts_are_the_templates_text_before_the_class(classifier):
    """Digits' templates: the context of each is its text before "{}" (5, 2, 2 and 6 tokens:
    "a photo of the digit", "a handwritten", "the number", "a blurry photo of the digit")."""
    tpt = _build(TPT, classifier)
    assert classifier.templates == [
        "a photo of the digit {}.",
        "a handwritten {}.",
        "the number {}.",
        "a blurry photo of the digit {}.",
    ]
    assert tpt.prompt.n_ctx == [5, 2, 2, 6]
    assert tpt.prompt.ctx.shape == (15, classifier.clip.token_embedding.weight.shape[1])
    emb = classifier.clip.token_embedding
    tokens = classifier.tokenizer(["a handwritten"])[0, 1:3]
    torch.testing.assert_close(tpt.prompt.ctx[5:7].detach(), emb(tokens), rtol=0, atol=0)
    official = _build(TPT, classifier, text_head="official")
    assert official.prompt.n_ctx == [4]  # TPT's "a photo of a"


def test_tpt_rejects_templates_it_cannot_split(classifier):
    model = copy.deepcopy(classifier)
    with pytest.raises(ValueError, match="exactly one"):
        PromptTextEncoder(model, ["a photo of {} and {}."])
    with pytest.raises(ValueError, match="no template has text before the class name"):
        PromptTextEncoder(model, ["{}."])
    with pytest.raises(ValueError, match="not a prefix"), pytest.warns(UserWarning):
        # the class name joins the last word ("azero": tokens the tiny model never saw)
        PromptTextEncoder(model, ["a photo of a{}."])


@pytest.mark.parametrize("cls", METHODS)
def test_unknown_text_head_is_an_error(cls, classifier):
    with pytest.raises(ValueError, match="available: protocol, official"):
        _build(cls, classifier, text_head="clip")
