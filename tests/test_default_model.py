"""The embedded default: the digits split and the tiny CLIP the project pretrains itself."""

from __future__ import annotations

import numpy as np
import torch

from mura_plugin.datasets.digits import digits_arrays
from mura_plugin.models.tiny_clip import TinyClipRecipe, _cache_path, load_or_pretrain


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


def test_pretraining_is_deterministic_and_cached(tmp_cache):
    recipe = TinyClipRecipe(epochs=1, vision_layers=1, text_layers=1)
    first = load_or_pretrain(recipe, progress=False)
    path = _cache_path(recipe)
    assert path.exists() and path.is_relative_to(tmp_cache)
    stamp = path.stat().st_mtime_ns
    again = load_or_pretrain(recipe, progress=False)  # from the cache, no training
    assert path.stat().st_mtime_ns == stamp
    path.unlink()
    retrained = load_or_pretrain(recipe, progress=False)
    for (k, a), b, c in zip(
        first.state_dict().items(), again.state_dict().values(), retrained.state_dict().values()
    ):
        assert torch.equal(a, b) and torch.equal(a, c), k


def test_a_truncated_cache_file_is_retrained_not_trusted(tmp_cache):
    recipe = TinyClipRecipe(epochs=1, vision_layers=1, text_layers=1)
    path = _cache_path(recipe)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x80\x02truncated")
    model = load_or_pretrain(recipe, progress=False)
    assert sum(p.numel() for p in model.parameters()) > 0
    assert torch.load(path, weights_only=True)  # replaced by a valid checkpoint


def test_recipe_fingerprint_tracks_every_field():
    base = TinyClipRecipe()
    assert base.fingerprint() == TinyClipRecipe().fingerprint()
    assert base.fingerprint() != TinyClipRecipe(epochs=base.epochs + 1).fingerprint()
    assert base.fingerprint() != TinyClipRecipe(seed=1).fingerprint()
