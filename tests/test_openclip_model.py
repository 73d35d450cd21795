"""The openclip model factory: random weights only when asked for, local checkpoints,
clear errors offline, and the cheap argument check the CLI runs before any setup."""

from __future__ import annotations

import inspect

import pytest
import torch

from mura_plugin.models.openclip import ModelUnavailableError, check_args, openclip


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    return openclip(arch="ViT-S-32", image_size=32, allow_random=True)


def test_random_weights_preprocessing_from_config(small):
    assert small.preprocess.image_size == 32 and small.weights == "random-init"
    assert small.preprocess.mean == pytest.approx((0.48145466, 0.4578275, 0.40821073))
    assert small.tokenizer(["a photo of a cat."]).shape == (1, 77)
    with torch.no_grad():
        f = small.clip.encode_image(torch.zeros(2, 3, 32, 32))
    assert f.shape == (2, 384)


def test_random_weights_only_when_asked_for():
    """Without a tag or a checkpoint a suite would evaluate a random-init model."""
    with pytest.raises(
        ValueError,
        match=r"ViT-S-32: no weights.*model\.pretrained=<tag> \(for ViT-S-32: .*"
        r"model\.checkpoint=<file>.*model\.allow_random=true",
    ):
        openclip(arch="ViT-S-32", image_size=32)


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


def test_check_args_validates_without_building(tmp_path):
    assert openclip.check_args is check_args
    params = inspect.signature(openclip).parameters
    assert inspect.signature(check_args).parameters.keys() == params.keys()
    assert all(p.kind == p.KEYWORD_ONLY for p in params.values())
    # the CLI passes every model field, None included
    defaults = {k: p.default for k, p in params.items()}
    with pytest.raises(ValueError, match="model.allow_random=true"):
        check_args(**defaults)
    assert check_args(**{**defaults, "allow_random": True}) is None
    assert check_args(arch="ViT-B-32", pretrained="openai") is None  # no weights are needed
    with pytest.raises(ValueError, match="did you mean ViT-B-32"):
        check_args(arch="ViT-B-23", allow_random=True)
    with pytest.raises(ValueError, match="unknown pretrained tag 'opnai'.*openai"):
        check_args(arch="ViT-B-32", pretrained="opnai")
    with pytest.raises(ValueError, match="image_size can only be overridden"):
        check_args(arch="ViT-B-32", pretrained="openai", image_size=32)
    with pytest.raises(ModelUnavailableError, match="nope.pt.*does not exist"):
        check_args(arch="ViT-S-32", checkpoint=str(tmp_path / "nope.pt"))
    # the checkpoint is not read: a file that is no state dict passes the check, and
    # building the model names it
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a state dict")
    assert check_args(arch="ViT-S-32", checkpoint=str(junk)) is None
    with pytest.raises(ValueError, match=r"junk\.pt' does not load into open_clip ViT-S-32"):
        openclip(arch="ViT-S-32", checkpoint=str(junk))
