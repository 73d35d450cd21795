"""Contract tests for every registered shift kernel (real digits images, small batches)."""

from __future__ import annotations

import itertools

import pytest
import torch

from tta_bench.registry import registry
from tta_bench.rng import SampleGenerator

SHIFTS = registry("shifts").names()
PINNED_15 = [
    "gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur",
    "motion_blur", "zoom_blur", "snow", "frost", "fog", "brightness", "contrast",
    "elastic_transform", "pixelate", "jpeg_compression",
]  # fmt: skip
EXTRAS = ["speckle_noise", "gaussian_blur", "spatter", "saturate"]
SIMPLE = ["color_jitter", "rotation", "grayscale"]


@pytest.fixture(scope="module")
def batch(test_images):
    """Six real digits, made colourful (a per-sample tint) so colour shifts act too."""
    x = test_images[0][:6].clone()
    tint = torch.linspace(0.4, 1.0, 6).view(6, 1, 1, 1) * torch.tensor([1.0, 0.7, 0.4]).view(
        1, 3, 1, 1
    )
    return (x * tint + 0.1 * (1 - x)).clamp(0, 1)


def _gen(idx, name, severity):
    return SampleGenerator.for_samples(idx, 0, name, severity)


def test_all_22_registered():
    assert sorted(SHIFTS) == sorted(PINNED_15 + EXTRAS + SIMPLE)


@pytest.mark.parametrize("name", SHIFTS)
@pytest.mark.parametrize("table", ["digits", "imagenet"])
def test_shape_range_determinism_and_batch_independence(name, table, batch):
    kernel = registry("shifts").get(name)
    idx = list(range(len(batch)))
    out = kernel(batch, 3, generator=_gen(idx, name, 3), table=table)
    assert out.shape == batch.shape and out.dtype == batch.dtype
    assert torch.isfinite(out).all() and out.min() >= 0 and out.max() <= 1
    again = kernel(batch, 3, generator=_gen(idx, name, 3), table=table)
    assert torch.equal(out, again)
    # Sample 4 alone, and inside a reordered sub-batch, is corrupted identically.
    alone = kernel(batch[4:5], 3, generator=_gen([4], name, 3), table=table)
    torch.testing.assert_close(alone, out[4:5], atol=2e-5, rtol=0)
    order = [4, 1, 2]
    sub = kernel(batch[order], 3, generator=_gen(order, name, 3), table=table)
    torch.testing.assert_close(sub, out[order], atol=2e-5, rtol=0)


@pytest.mark.parametrize("name", SHIFTS)
def test_bad_severity_and_table(name, batch):
    kernel = registry("shifts").get(name)
    gen = _gen(range(2), name, 1)
    for bad in (0, 6, 2.5):
        with pytest.raises(ValueError, match="severity"):
            kernel(batch[:2], bad, generator=gen, table="cifar")
    with pytest.raises(ValueError, match="cifar"):
        kernel(batch[:2], 1, generator=gen, table="imagenett")


@pytest.mark.parametrize("name", SHIFTS)
def test_strength_grows_with_severity(name, batch):
    """The mean absolute change from the clean batch does not shrink as severity grows
    (small slack for random draws); severity 5 changes the image more than severity 1."""
    kernel = registry("shifts").get(name)
    idx = list(range(len(batch)))
    change = []
    for s in range(1, 6):
        out = kernel(batch, s, generator=_gen(idx, name, 0), table="digits")
        change.append((out - batch).abs().mean().item())
    assert change[-1] > change[0], change
    for a, b in zip(change, change[1:]):
        assert b >= a * 0.85 - 1e-4, change


def test_spatial_rule_scales_blur_with_size(batch):
    """A 64 px image under the 32 px table is blurred by twice the sigma (documented rule):
    down-sampling it by 2 afterwards matches blurring the 32 px image directly."""
    kernel = registry("shifts").get("gaussian_blur")
    big = torch.nn.functional.interpolate(batch, scale_factor=2, mode="nearest")
    gen = _gen(range(len(batch)), "gaussian_blur", 5)
    small = kernel(batch, 5, generator=gen, table="cifar")
    large = kernel(big, 5, generator=gen, table="cifar")
    down = torch.nn.functional.avg_pool2d(large, 2)
    assert (down - small).abs().mean() < 0.02
    unscaled = torch.nn.functional.avg_pool2d(kernel(big, 1, generator=gen, table="cifar"), 2)
    assert (down - small).abs().mean() < (unscaled - small).abs().mean()


def test_frost_textures_are_deterministic_and_in_range():
    from mura_plugin.shifts.weather import FROST_STATS, _frost_base

    _frost_base.cache_clear()
    first = _frost_base(0).clone()
    _frost_base.cache_clear()
    assert torch.equal(first, _frost_base(0))
    for i in range(len(FROST_STATS)):
        tex = _frost_base(i)
        assert tex.shape == (3, 512, 512) and tex.min() >= 0 and tex.max() <= 1
        mean = torch.tensor(FROST_STATS[i][0])
        assert (tex.mean(dim=(1, 2)) - mean).abs().max() < 0.03


def test_sample_generators_are_keyed_per_sample_and_built_lazily():
    """``for_samples`` seeds sample ``i`` with ``stable_seed(*key, i)`` (the pinned scheme
    every committed result depends on; ``stable_seeds`` hashes the shared prefix once), and
    a deterministic kernel that never draws leaves the generators unbuilt."""
    from tta_bench.rng import stable_seed, stable_seeds

    idx = [0, 5, 17, 1_000_003]
    for key in [(0, "fog", 5), (2, "shot_noise", 1), ()]:
        want = [stable_seed(*key, i) for i in idx]
        assert stable_seeds(key, idx) == want
        assert SampleGenerator.for_samples(idx, *key).seeds == want
    assert stable_seed(0, "fog", 5, 0) == 3837102993674096367  # the scheme itself is pinned
    gen = SampleGenerator.for_samples(range(4), 0, "contrast", 3)
    registry("shifts").get("contrast")(torch.rand(4, 3, 8, 8), 3, generator=gen)
    assert gen._generators is None
    first = gen.uniform(2)
    again = SampleGenerator.for_samples(range(4), 0, "contrast", 3).uniform(2)
    assert torch.equal(first, again) and len(gen.generators) == 4


@pytest.mark.parametrize("name", registry("shifts").names())
def test_uint8_entry_equals_the_float_kernel(name):
    """A kernel's optional ``from_uint8`` entry (the decoded cache's NHWC batch, no float
    pass) returns exactly what the kernel returns for ``u8 / 255``; ``apply_shift`` routes
    uint8 batches to it, or converts them for kernels without one."""
    from tta_bench.data import to_float_images
    from tta_bench.run.inputs import apply_shift, uint8_entry

    kernel = registry("shifts").get(name)
    u8 = torch.randint(0, 256, (3, 20, 24, 3), dtype=torch.uint8)
    u8[:, :8] = 77  # a flat region, as real images have
    x = to_float_images(u8)  # contiguous NCHW, u8 / 255
    assert torch.equal(x, u8.permute(0, 3, 1, 2).float() / 255) and x.is_contiguous()
    want = apply_shift(kernel, x, 4, _gen(range(3), name, 4), "cifar")
    got = apply_shift(kernel, u8, 4, _gen(range(3), name, 4), "cifar")
    assert got.shape == want.shape == (3, 3, 20, 24)
    assert torch.equal(got, want)
    entry = uint8_entry(kernel)
    if entry is not None:
        direct = entry(u8, 4, generator=_gen(range(3), name, 4), table="cifar")
        assert torch.equal(direct, want)
        with pytest.raises(ValueError, match=r"uint8 images \[B, H, W, C\]"):
            entry(x, 4, generator=_gen(range(3), name, 4), table="cifar")


@pytest.mark.parametrize("images_per_step", [None, 1, 3], ids=["whole", "step1", "step3"])
@pytest.mark.parametrize("name", ["brightness", "saturate", "pixelate"])
def test_uint8_entries_equal_the_kernel(name, images_per_step, monkeypatch):
    """Per-pixel kernels convert and finish the 8-bit batch in place a few images at a time
    (forced here to one and three of four), pixelate takes the bytes as its 8-bit image:
    the output is still the kernel's on the converted batch, bit for bit, at every table
    and severity (black and grey pixels in some images only; one channel; a strided
    batch)."""
    from mura_plugin.shifts import digital
    from tta_bench.data import to_float_images

    if images_per_step is not None:
        monkeypatch.setattr(digital, "CACHE_STEP_ELEMENTS", images_per_step * 3 * 10 * 12)

    kernel = registry("shifts").get(name)
    u8 = torch.randint(0, 256, (4, 10, 12, 3), dtype=torch.uint8)
    u8[1, :3] = 0  # black
    u8[2, :3] = 90  # grey
    for images in (u8, u8[..., :1].contiguous(), u8[:, ::2]):
        for table, sev in itertools.product(("cifar", "imagenet", "digits"), range(1, 6)):
            want = kernel(to_float_images(images), sev, generator=None, table=table)
            got = kernel.from_uint8(images, sev, generator=None, table=table)
            assert got.is_contiguous()
            assert torch.equal(got, want)


STEPPED = [
    "shot_noise", "glass_blur", "motion_blur", "contrast", "spatter",
    "zoom_blur", "snow", "frost", "elastic_transform",
]  # fmt: skip


def test_stepped_kernels_are_the_ones_declared():
    """The kernels run a few images at a time are exactly ``STEPPED`` (a new one is added to
    the test below)."""
    shifts = registry("shifts")
    assert sorted(n for n in SHIFTS if hasattr(shifts.get(n), "__wrapped__")) == sorted(STEPPED)


@pytest.mark.parametrize("name", STEPPED)
@pytest.mark.parametrize("table", ["digits", "imagenet"])
def test_image_steps_give_the_whole_batch_output(name, table, batch, monkeypatch):
    """With steps forced to one image and to four (of six), a stepped kernel's output is
    its whole-batch output, bit for bit: each image keeps its own generator."""
    from mura_plugin.shifts import _ops

    kernel = registry("shifts").get(name)
    idx = list(range(len(batch)))
    want = kernel.__wrapped__(batch, 3, generator=_gen(idx, name, 3), table=table)
    assert torch.equal(kernel(batch, 3, generator=_gen(idx, name, 3), table=table), want)
    per = batch[0].numel()
    for images_per_step in (1, 4):
        monkeypatch.setattr(_ops, "STACK_ELEMENTS", images_per_step * per)
        got = kernel(batch, 3, generator=_gen(idx, name, 3), table=table)
        assert torch.equal(got, want), images_per_step


def test_generator_subset_draws_what_the_batch_draws():
    """``SampleGenerator.subset`` shares the samples' generators: drawing a batch in two
    parts gives the whole batch's draws."""
    whole = _gen(range(5), "x", 1).uniform(7)
    gen = _gen(range(5), "x", 1)
    parts = torch.cat([gen.subset(0, 2).uniform(7), gen.subset(2, 5).uniform(7)])
    assert torch.equal(parts, whole)
    assert gen.subset(1, 3).seeds == _gen(range(5), "x", 1).seeds[1:3]


def test_jpeg_offers_the_uint8_entry():
    from tta_bench.run.inputs import uint8_entry

    assert uint8_entry(registry("shifts").get("jpeg_compression")) is not None
    assert uint8_entry(registry("shifts").get("contrast")) is None


def test_pooled_generators_draw_what_fresh_ones_draw():
    """The runner's ``GeneratorPool`` reuses generators across batches: a reused generator
    reseeded for a sample draws exactly what a new one would, and a released
    ``SampleGenerator`` refuses to draw."""
    from tta_bench.rng import GeneratorPool

    pool = GeneratorPool()
    kernel = registry("shifts").get("shot_noise")
    x = torch.rand(5, 3, 16, 16)
    first = SampleGenerator.for_samples(range(5), 0, "shot_noise", 2, pool=pool)
    kernel(x, 2, generator=first)
    first.uniform(3)  # leave the generators mid-stream
    first.release()
    with pytest.raises(RuntimeError, match="after release"):
        first.uniform(1)
    reused = SampleGenerator.for_samples(range(5), 0, "shot_noise", 2, pool=pool)
    fresh = SampleGenerator.for_samples(range(5), 0, "shot_noise", 2)
    assert torch.equal(kernel(x, 2, generator=reused), kernel(x, 2, generator=fresh))
    assert torch.equal(reused.normal(7), fresh.normal(7))
