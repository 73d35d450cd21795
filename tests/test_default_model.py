"""The embedded default: the digits split and the tiny CLIP the project pretrained itself
and ships as a weights file (the same model on every machine)."""

from __future__ import annotations

import hashlib
import json
import warnings

import numpy as np
import pytest
import torch

from mura_plugin.datasets.digits import digits_arrays
from mura_plugin.models import tiny_clip
from mura_plugin.models.tiny_clip import (
    SHIPPED_WEIGHTS,
    TinyClipRecipe,
    load_shipped,
    pretrain,
    save_shippable,
    trained_token_ids,
)


def test_digits_split_is_fixed_stratified_and_disjoint():
    xtr, ytr = digits_arrays("train")
    xte, yte = digits_arrays("test")
    assert xtr.shape == (1437, 32, 32, 3) and xte.shape == (360, 32, 32, 3)
    assert xte.dtype == np.uint8
    assert np.bincount(yte).min() >= 35  # stratified: every class ~36 times
    train_rows = {r.tobytes() for r in xtr}
    assert sum(r.tobytes() in train_rows for r in xte) < 5  # (a few true duplicates exist)


def test_digits_stream_is_a_hf_dataset(digits_stream):
    import datasets

    assert isinstance(digits_stream.dataset, datasets.Dataset)
    assert len(digits_stream) == 360 and digits_stream.classnames[3] == "three"
    assert digits_stream.dataset.features["label"].names == digits_stream.classnames


def test_clean_zero_shot_accuracy_is_at_least_95_percent(classifier, test_images):
    x, y = test_images
    with torch.no_grad():
        acc = (classifier(x).argmax(dim=1) == y).float().mean().item()
    assert acc >= 0.95, acc


def test_the_default_model_is_the_shipped_file_and_records_its_hash(default_bundle):
    digest = hashlib.sha256(SHIPPED_WEIGHTS.read_bytes()).hexdigest()
    assert default_bundle.weights_sha256 == digest
    assert SHIPPED_WEIGHTS.stat().st_size < 8 << 20  # a few MB, not the 12 MB fp32 table


def test_each_default_model_is_its_own_copy_of_the_shipped_values():
    """The file is loaded once per process; each bundle gets tensors of its own with the
    file's values, so a change to one model reaches no other."""
    first, second = tiny_clip.tiny_clip_digits(), tiny_clip.tiny_clip_digits()
    fresh, _ = tiny_clip.load_shipped(SHIPPED_WEIGHTS)
    a, b, want = (m.state_dict() for m in (first.clip, second.clip, fresh))
    assert list(a) == list(want) == list(b)
    for key, value in want.items():
        assert torch.equal(a[key], value) and torch.equal(b[key], value), key
        assert a[key].data_ptr() != b[key].data_ptr(), key
    assert not first.clip.training
    flags = [p.requires_grad for p in fresh.parameters()]
    assert [p.requires_grad for p in first.clip.parameters()] == flags
    with torch.no_grad():
        first.clip.token_embedding.weight.add_(1.0)
    third = tiny_clip.tiny_clip_digits()
    assert torch.equal(third.clip.token_embedding.weight, want["token_embedding.weight"])


def test_loading_the_default_model_never_pretrains(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("the default model must load, not train")

    monkeypatch.setattr(tiny_clip, "pretrain", refuse)
    bundle = tiny_clip.tiny_clip_digits()
    assert bundle.name == "tiny-clip-digits"


def test_shipped_file_round_trips_every_trained_tensor(tmp_path):
    recipe = TinyClipRecipe(epochs=1, vision_layers=1, text_layers=1)
    torch.manual_seed(0)
    model = tiny_clip.build_tiny_clip(recipe)
    path = tmp_path / "w.safetensors"
    digest = save_shippable(model, path, recipe)
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    loaded, got_recipe = load_shipped(path)
    assert got_recipe == recipe
    ids = trained_token_ids()
    for (k, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        if k == "token_embedding.weight":
            assert torch.equal(a[ids], b[ids])
            untrained = torch.ones(len(a), dtype=torch.bool)
            untrained[ids] = False
            assert not b[untrained].any()  # untrained rows are zeros
        else:
            assert torch.equal(a, b), k
    # the same tensors give the same bytes (the hash is a function of the weights)
    assert save_shippable(model, tmp_path / "again.safetensors", recipe) == digest


@pytest.mark.slow
def test_pretraining_is_deterministic_on_one_thread():
    # one epoch of a narrower model: the same training loop, a sixth of the arithmetic
    recipe = TinyClipRecipe(
        epochs=1, vision_layers=1, text_layers=1, vision_width=32, text_width=32, embed_dim=32
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        first = pretrain(recipe, progress=False).state_dict()
        second = pretrain(recipe, progress=False).state_dict()
    finally:
        torch.set_num_threads(threads)
    for k in first:
        assert torch.equal(first[k], second[k]), k


def test_prompts_with_untrained_tokens_are_warned_about(default_bundle):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        default_bundle.tokenizer(["a photo of the digit three."])  # trained tokens: silent
    with pytest.warns(UserWarning, match="untrained token"):
        default_bundle.tokenizer(["a spaceship made of cheese."])


def test_the_shipped_recipe_is_the_default_recipe():
    from safetensors import safe_open

    with safe_open(str(SHIPPED_WEIGHTS), framework="pt") as fh:
        recipe = json.loads(fh.metadata()["tiny-clip-digits"])["recipe"]
    assert TinyClipRecipe(**recipe) == TinyClipRecipe()


def test_recipe_fingerprint_tracks_every_field():
    base = TinyClipRecipe()
    assert base.fingerprint() == TinyClipRecipe().fingerprint()
    assert base.fingerprint() != TinyClipRecipe(epochs=base.epochs + 1).fingerprint()
    assert base.fingerprint() != TinyClipRecipe(seed=1).fingerprint()


def test_a_copied_classifier_owns_every_tensor_and_shares_only_the_tokenizer(
    classifier, test_images
):
    """What every method instance is built on (the runner, the adapters, ``tta-bench
    check``, the tests): ``copy.deepcopy`` of the classifier. Its tensors and module tree
    are its own; the stateless tokenizer is shared, since copying its BPE tables cost
    about a second per instance; a tensor the caller's memo maps stays shared."""
    import copy

    x = test_images[0][:4]
    with torch.no_grad():
        before = classifier(x)
    twin = copy.deepcopy(classifier)
    assert twin.tokenizer is classifier.tokenizer
    assert twin.clip is not classifier.clip and twin.visual is not classifier.visual
    ours, theirs = classifier.state_dict(), twin.state_dict()
    assert list(ours) == list(theirs)
    for key, value in ours.items():
        assert theirs[key].data_ptr() != value.data_ptr(), key
        assert torch.equal(theirs[key], value), key
    with torch.no_grad():
        assert torch.equal(twin(x), before)
        next(twin.visual.parameters()).add_(1.0)  # the copy adapts; the original does not
        assert not torch.equal(twin(x), before) and torch.equal(classifier(x), before)
    assert torch.equal(twin.tokenizer(["a photo of 3"]), classifier.tokenizer(["a photo of 3"]))
    frozen = classifier.class_embeddings
    third = copy.deepcopy(classifier, memo={id(frozen): frozen})
    assert third.class_embeddings is frozen and third.tokenizer is classifier.tokenizer
