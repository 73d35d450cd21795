"""The openclip model factory: random weights, local checkpoints, clear errors offline."""

from __future__ import annotations

import pytest
import torch

from mura_plugin.models.openclip import ModelUnavailableError, openclip


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    return openclip(arch="ViT-S-32", image_size=32)


def test_random_weights_preprocessing_from_config(small):
    assert small.preprocess.image_size == 32 and small.weights == "random-init"
    assert small.preprocess.mean == pytest.approx((0.48145466, 0.4578275, 0.40821073))
    assert small.tokenizer(["a photo of a cat."]).shape == (1, 77)
    with torch.no_grad():
        f = small.clip.encode_image(torch.zeros(2, 3, 32, 32))
    assert f.shape == (2, 384)


def test_local_checkpoint_round_trip(small, tmp_path):
    path = tmp_path / "w.pt"
    torch.save(small.clip.state_dict(), path)
    with pytest.raises(ValueError, match="random weights"):
        openclip(arch="ViT-S-32", checkpoint=str(path), image_size=32)
    with pytest.raises(ModelUnavailableError, match="does not exist"):
        openclip(arch="ViT-S-32", checkpoint=str(tmp_path / "nope.pt"))


def test_bad_names():
    with pytest.raises(ValueError, match="did you mean ViT-B-32"):
        openclip(arch="ViT-B-23")
    with pytest.raises(ValueError, match="unknown pretrained tag 'opnai'.*openai"):
        openclip(arch="ViT-B-32", pretrained="opnai")
    with pytest.raises(ValueError, match="not both"):
        openclip(arch="ViT-B-32", pretrained="openai", checkpoint="x.pt")
