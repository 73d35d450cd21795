"""The openclip model factory: random weights only when asked for, local checkpoints,
clear errors offline, the cheap argument check the CLI runs before any setup, and the
architectures whose text side is Hugging Face's (SigLIP): the hf-text extra and the local
tokenizer files they need, refused before anything is built where either is missing."""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch

from mura_plugin.models.openclip import (
    HF_TEXT_EXTRA,
    ModelUnavailableError,
    check_args,
    hf_text_files,
    openclip,
)


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


# -- architectures whose text side is Hugging Face's (the hf-text extra) ----------------
SIGLIP = "ViT-B-16-SigLIP"
SIGLIP_TOKENIZER = "timm/ViT-B-16-SigLIP"  # hf_tokenizer_name in open_clip's config


def test_hf_text_files_read_from_open_clip_configs():
    assert hf_text_files("ViT-B-32") == {} and hf_text_files("RN50") == {}
    assert hf_text_files(SIGLIP) == {SIGLIP_TOKENIZER: ["tokenizer_config.json"]}
    # a Hugging Face text tower: its config too
    assert hf_text_files("roberta-ViT-B-32") == {
        "roberta-base": ["tokenizer_config.json", "config.json"]
    }


@pytest.fixture()
def empty_hf_cache(tmp_path, monkeypatch):
    """An empty local HF cache (huggingface_hub reads the constant at each lookup)."""
    import huggingface_hub.constants

    cache = tmp_path / "hf"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_siglip_without_transformers_refuses_naming_the_extra(monkeypatch, empty_hf_cache):
    monkeypatch.setitem(sys.modules, "transformers", None)  # not importable
    with pytest.raises(ModelUnavailableError) as err:
        check_args(arch=SIGLIP, allow_random=True)
    text = str(err.value)
    assert f"pip install 'mura-plugin[{HF_TEXT_EXTRA}]'" in text and "transformers" in text
    assert f"{SIGLIP_TOKENIZER}: tokenizer_config.json" in text and "HF cache" in text
    # the CLIP architectures need neither
    assert check_args(arch="ViT-S-32", allow_random=True) is None


def test_siglip_tokenizer_files_must_be_in_the_local_hf_cache(monkeypatch, empty_hf_cache):
    """transformers installed (a stand-in module: the real package is not needed to decide)
    but the tokenizer not cached: refused; once its config is in the cache: accepted."""
    monkeypatch.setitem(sys.modules, "transformers", types.ModuleType("transformers"))
    with pytest.raises(ModelUnavailableError, match="not in the local HF cache") as err:
        check_args(arch=SIGLIP, allow_random=True)
    assert SIGLIP_TOKENIZER in str(err.value) and HF_TEXT_EXTRA in str(err.value)
    # the layout huggingface_hub writes: refs/main names the snapshot holding the files
    repo = empty_hf_cache / ("models--" + SIGLIP_TOKENIZER.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abc")
    (repo / "snapshots" / "0123abc").mkdir(parents=True)
    (repo / "snapshots" / "0123abc" / "tokenizer_config.json").write_text("{}")
    assert check_args(arch=SIGLIP, allow_random=True) is None


def test_cli_siglip_without_transformers_exits_2_before_building(
    tmp_path, monkeypatch, capsys, empty_hf_cache
):
    import open_clip

    from tta_bench.cli.commands import main

    def never(*args, **kwargs):
        raise AssertionError("a model was built after the arguments were refused")

    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setattr(open_clip, "create_model_and_transforms", never)
    monkeypatch.setattr(open_clip, "create_model", never)
    out = tmp_path / "r.json"
    args = ["run", "--method", "zeroshot", "--model", "openclip", f"model.arch={SIGLIP}"]
    code = main([*args, "model.allow_random=true", "--quiet", "--output", str(out)])
    assert code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert f"model openclip: openclip {SIGLIP}" in err and f"mura-plugin[{HF_TEXT_EXTRA}]" in err
    assert SIGLIP_TOKENIZER in err
