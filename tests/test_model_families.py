"""Every open_clip model family, built with random weights at 32 px (the digits' own size),
through the methods of each kind: the zero-shot classifier, a TENT-style one (tent), the
episodic ones (tpt, mura) and a training-free one (tda), each set up as the runner sets it
up and stepped on a batch of two real digits. Each either runs or refuses in its setup,
which the runner calls before the stream's first batch, with a ValueError (exit 2 from the
CLI) naming the family it supports. SigLIP's logit bias is in the logits the classifier
returns; a model without one returns what it always did.

One architecture per family, the smallest of each in ``open_clip.list_models()``; each is
built once for this module.
"""

from __future__ import annotations

import dataclasses
import gc
import warnings

import pytest
import torch
from processes import collections_of_new_objects_only

from mura_plugin.models.openclip import check_args, openclip
from tta_bench.model import ModelBundle, Preprocess, ZeroShotClassifier

#: Six models of up to 253M parameters built in one module: scheduled first under xdist.
pytestmark = pytest.mark.slow

#: family -> (architecture, the open_clip class of its image tower)
FAMILIES = {
    "ViT": ("ViT-S-32", "VisionTransformer"),
    "ModifiedResNet": ("RN50", "ModifiedResNet"),
    "ConvNeXt": ("convnext_tiny", "TimmModel"),
    "EVA": ("EVA02-B-16", "TimmModel"),  # timm's EVA02 trunk
    "SigLIP": ("ViT-B-16-SigLIP", "TimmModel"),  # timm's ViT trunk, sigmoid loss
    "CoCa": ("coca_ViT-B-32", "VisionTransformer"),  # attention pooling over the tokens
}
SIZE = 32

#: What refuses, and the words its error must hold: the family the method supports.
PROMPT_TUNING_CLIP_ONLY = r"supports open_clip's CLIP class.*separate text tower"
MURA_VIT_ONLY = r"mura adapts attention in the transformer blocks of a ViT image tower"
REFUSALS = {
    ("tpt", "EVA"): PROMPT_TUNING_CLIP_ONLY,
    ("tpt", "SigLIP"): PROMPT_TUNING_CLIP_ONLY,
    ("tpt", "CoCa"): PROMPT_TUNING_CLIP_ONLY,
    ("mura", "ModifiedResNet"): MURA_VIT_ONLY,
    ("mura", "ConvNeXt"): MURA_VIT_ONLY,
}
METHODS = ("zeroshot", "tent", "tpt", "mura", "tda")
#: Few views keep the multi-view methods fast here; their own tests check their defaults.
METHOD_OVERRIDES = {"tpt": {"views": 3}, "mura": {"views": 3}}


class StandInSigLIPTokenizer:
    """NOT SigLIP's tokenizer: a deterministic stand-in with its vocabulary size and context
    length (the UTF-8 bytes of a text + 1, zero-padded), for a random-weight SigLIP where
    the real one (Hugging Face ``transformers`` and its files in the local cache, the
    ``hf-text`` extra) cannot load. Only this test uses it; the factory refuses instead."""

    def __init__(self, vocab_size: int, context_length: int):
        assert vocab_size > 257
        self.context_length = context_length

    def __call__(self, texts):
        out = torch.zeros(len(texts), self.context_length, dtype=torch.long)
        for row, text in enumerate(texts):
            ids = list(text.encode())[: self.context_length]
            out[row, : len(ids)] = torch.tensor(ids) + 1
        return out


def _siglip_bundle(arch: str) -> ModelBundle:
    """The factory's bundle where SigLIP's tokenizer can load here; else its random-weight
    model (as the factory builds it) with ``StandInSigLIPTokenizer``."""
    import open_clip

    try:
        check_args(arch=arch, image_size=SIZE, allow_random=True)
    except ValueError:
        model = open_clip.create_model(arch, force_image_size=SIZE).eval()
        cfg = open_clip.get_model_preprocess_cfg(model)
        text = open_clip.get_model_config(arch)["text_cfg"]
        return ModelBundle(
            clip=model,
            tokenizer=StandInSigLIPTokenizer(text["vocab_size"], text["context_length"]),
            preprocess=Preprocess(SIZE, tuple(cfg["mean"]), tuple(cfg["std"])),
            name=f"openclip:{arch}",
            weights="random-init",
        )
    return openclip(arch=arch, image_size=SIZE, allow_random=True)


@pytest.fixture(scope="module", autouse=True)
def _collections_of_this_module():
    """The models each test frees (``gc.collect()``) are collected; the rest of the worker's
    heap is not scanned again at each of those calls. open_clip (with timm and torchvision)
    is imported first: imported later, its hundreds of thousands of objects would be new
    to every one of those collections."""
    import open_clip  # noqa: F401

    with collections_of_new_objects_only():
        yield


@pytest.fixture(scope="module", autouse=True)
def _no_text_head_cache():
    """Random towers' heads stay out of the user's text-head cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TTA_BENCH_TEXT_CACHE", "0")
        yield


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    """``(family, bundle)``: the family's architecture with random weights at 32 px, freed
    before the next family is built (modules hold reference cycles: gc, not refcounts)."""
    arch, _ = FAMILIES[request.param]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # timm/open_clip notes about random init
        bundle = (
            _siglip_bundle(arch)
            if request.param == "SigLIP"
            else openclip(arch=arch, image_size=SIZE, allow_random=True)
        )
    yield request.param, bundle
    del bundle
    gc.collect()


@pytest.fixture(scope="module")
def family_classifier(family, digits_stream):
    """``(family, classifier)``: the family's zero-shot classifier of the ten digits."""
    name, bundle = family
    head = digits_stream.templates[:1]
    return name, ZeroShotClassifier(bundle, digits_stream.classnames, head, "digits")


def _set_up(method: str, classifier: ZeroShotClassifier):
    """``method`` with its defaults (fewer views) set up as the runner sets it up: on its
    own copy of the classifier when it adapts (the tokenizer shared), seeded."""
    import copy

    from tta_bench.registry import registry

    cls = registry("methods").get(method)
    config = dataclasses.replace(cls.Config(), **METHOD_OVERRIDES.get(method, {}))
    model = classifier
    if cls.adapts:
        model = copy.deepcopy(classifier, memo={id(classifier.tokenizer): classifier.tokenizer})
    torch.manual_seed(0)
    instance = cls(model, config)
    instance.setup()
    return instance


def test_family_tower_is_the_one_named(family):
    name, bundle = family
    assert type(bundle.clip.visual).__name__ == FAMILIES[name][1]
    assert bundle.preprocess.image_size == SIZE and bundle.weights == "random-init"


@pytest.mark.parametrize("method", METHODS)
def test_method_runs_or_refuses_at_setup(family_classifier, method, noisy_images):
    name, classifier = family_classifier
    refusal = REFUSALS.get((method, name))
    if refusal is not None:
        with pytest.raises(ValueError, match=refusal) as err:
            _set_up(method, classifier)
        assert classifier.model_name in str(err.value)
        return
    instance = _set_up(method, classifier)
    instance.reseed(0)
    logits = instance.step(noisy_images[:2])
    assert logits.shape == (2, 10) and bool(torch.isfinite(logits).all())
    del instance
    gc.collect()  # its copy of the model (up to 1 GB for CoCa) before the next method's


def test_refusal_exits_2_from_the_cli(tmp_path, capsys):
    """The CLI path of a refusal: exit 2, the message, no results file."""
    from tta_bench.cli.commands import main

    out = tmp_path / "r.json"
    args = ["run", "--method", "mura", "--model", "openclip", "model.arch=RN50"]
    more = ["model.allow_random=true", f"model.image_size={SIZE}", "protocol.shifts=[contrast]"]
    cell = ["protocol.max_images=2", "protocol.batch_size=2", "seeds=[0]", "method.views=2"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main([*args, *more, *cell, "--quiet", "--output", str(out)])
    assert code == 2 and not out.exists()
    assert "mura adapts attention in the transformer blocks of a ViT image tower" in (
        capsys.readouterr().err
    )


# -- the logit bias ------------------------------------------------------------------------
def test_logit_bias_is_in_the_returned_logits(family, test_images):
    """SigLIP's logits are scale * cos + its bias; softmax, and so every prediction,
    entropy, NLL and ECE, cannot see a bias that is the same for every class, while the
    sigmoid (SigLIP's own match probability) does. No other family has a bias."""
    name, bundle = family
    if name != "SigLIP":
        assert getattr(bundle.clip, "logit_bias", None) is None
        return
    clf = ZeroShotClassifier(bundle, ["zero", "one", "two"], ["a photo of the digit {}."])
    bias = clf.logit_bias
    assert bias is not None and float(bias) == -10.0  # open_clip's init_logit_bias
    images = test_images[0][:4]
    with torch.no_grad():
        feats = clf.encode_image(images)
        scaled_cos = clf.logit_scale * feats @ clf.class_embeddings.t()
        logits = _set_up("zeroshot", clf).step(images)
    assert torch.equal(logits, scaled_cos + bias)
    torch.testing.assert_close(logits.softmax(-1), scaled_cos.softmax(-1))
    assert torch.equal(logits.argmax(-1), scaled_cos.argmax(-1))
    assert not torch.allclose(logits.sigmoid(), scaled_cos.sigmoid())


def test_model_without_bias_logits_unchanged(classifier, test_images):
    """The default model has no logit bias: its logits are bit for bit scale * cos, the
    formula before the bias existed (the committed results do not move)."""
    assert classifier.logit_bias is None
    with torch.no_grad():
        feats = classifier.encode_image(test_images[0][:8])
        expected = classifier.logit_scale * feats @ classifier.class_embeddings.t()
        assert torch.equal(classifier.logits_from_features(feats), expected)
        assert torch.equal(classifier(test_images[0][:8]), expected)
