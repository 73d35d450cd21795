"""Shared fixtures: the real default model (pretrained once per machine, cached) and the
real digits data. No mocks of our own code."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def digits_stream():
    from tta_bench.registry import registry

    return registry("datasets").get("digits")(split="test")


@pytest.fixture(scope="session")
def default_bundle():
    """The pretrained tiny-clip-digits bundle (trained on first use, then cached)."""
    from tta_bench.registry import registry

    return registry("models").get("tiny-clip-digits")()


@pytest.fixture(scope="session")
def classifier(default_bundle, digits_stream):
    from tta_bench.model import ZeroShotClassifier

    return ZeroShotClassifier(default_bundle, digits_stream.classnames, digits_stream.templates)


@pytest.fixture(scope="session")
def test_images(digits_stream):
    """Clean digits test images [N, 3, 32, 32] in [0, 1] and labels [N]."""
    import torch

    from mura_plugin.datasets.digits import digits_arrays

    x, y = digits_arrays("test")
    return torch.from_numpy(x).permute(0, 3, 1, 2).float() / 255.0, torch.from_numpy(y)


@pytest.fixture(scope="session")
def noisy_images(test_images):
    """The first 6 test digits with Gaussian noise (sigma 0.3, generator seed 0), clamped
    to [0, 1]: the batch the method tests adapt on. Noise is drawn row after row, so its
    first k rows are the batch of k such images."""
    import torch

    images, _ = test_images
    noisy = images[:6] + 0.3 * torch.randn(
        6, *images.shape[1:], generator=torch.Generator().manual_seed(0)
    )
    return noisy.clamp(0, 1)


@pytest.fixture(scope="module")
def batch(noisy_images):
    """The first 4 of ``noisy_images``: the batch the method tests adapt on (a test module
    with another ``batch`` fixture of its own uses that one)."""
    return noisy_images[:4]


@pytest.fixture()
def tmp_cache(tmp_path, monkeypatch):
    """An empty tta-bench cache directory for tests of caching itself."""
    monkeypatch.setenv("TTA_BENCH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture()
def pil_loads(monkeypatch):
    """The sizes of the images PIL decodes (``ImageFile.load``) during the test, in order:
    a check that must refuse from the header alone leaves it empty."""
    from PIL import ImageFile

    loaded: list[tuple[int, int]] = []
    real_load = ImageFile.ImageFile.load

    def spy(self):
        loaded.append(self.size)
        return real_load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", spy)
    return loaded
