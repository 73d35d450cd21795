"""Views as the official code draws them: torchvision's RandomResizedCrop boxes, the resize of
each box, and the official AugMix operations (compared with PIL, which the official code runs)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image
from scipy.stats import ks_2samp
from torchvision import transforms
from torchvision.transforms.v2 import functional as TF

from mura_plugin.augment import AUGMIX_OPS, augmix, crop_boxes, make_views, random_resized_crops
from mura_plugin.augmix import pil_reference_op

DRAWS = 4000


def _torchvision_boxes(height: int, width: int, scale, ratio, n: int) -> np.ndarray:
    torch.manual_seed(0)
    image = torch.zeros(3, height, width)
    return np.array(
        [transforms.RandomResizedCrop.get_params(image, scale, ratio) for _ in range(n)], float
    )


@pytest.mark.parametrize(
    ("height", "width", "scale"),
    [
        (32, 32, (0.08, 1.0)),  # the default: ~14% of first attempts do not fit
        (24, 48, (0.08, 1.0)),  # a wide image
        (32, 32, (0.8, 1.0)),  # most first attempts fail: redraws matter
    ],
)
def test_crop_boxes_follow_torchvision_random_resized_crop(height, width, scale):
    """Area fraction, aspect ratio and box centre have torchvision's distributions (two-sample
    KS test at the 0.1% level; both samples are discrete, which only makes KS conservative),
    and the mean area fraction agrees within 5 standard errors of the difference."""
    ratio = (3 / 4, 4 / 3)
    tv = _torchvision_boxes(height, width, scale, ratio, DRAWS)  # (top, left, h, w)
    top, left, h, w = (
        t.double().numpy()
        for t in crop_boxes(DRAWS, height, width, torch.Generator().manual_seed(1), scale=scale)
    )
    ours = np.stack([top, left, h, w], axis=1)
    assert ((ours[:, 0] >= 0) & (ours[:, 0] + ours[:, 2] <= height)).all()
    assert ((ours[:, 1] >= 0) & (ours[:, 1] + ours[:, 3] <= width)).all()

    def stats(boxes):
        area = boxes[:, 2] * boxes[:, 3] / (height * width)
        aspect = boxes[:, 3] / boxes[:, 2]
        centre_x = (boxes[:, 1] + boxes[:, 3] / 2) / width
        centre_y = (boxes[:, 0] + boxes[:, 2] / 2) / height
        return area, aspect, centre_x, centre_y

    for a, b in zip(stats(ours), stats(tv)):
        assert ks_2samp(a, b).pvalue > 1e-3
    area_ours, area_tv = stats(ours)[0], stats(tv)[0]
    se = math.sqrt(area_ours.var() / DRAWS + area_tv.var() / DRAWS)
    assert abs(area_ours.mean() - area_tv.mean()) < 5 * se


def test_crop_fallback_is_torchvisions_clamped_centre_crop():
    """When no attempt fits (a 2:1 image, area >= 0.7: every box is too tall), both fall back
    to the same centre crop with the aspect ratio clamped to 4:3."""
    scale = (0.7, 1.0)
    tv = _torchvision_boxes(24, 48, scale, (3 / 4, 4 / 3), 50)
    assert (tv == [0, 8, 24, 32]).all()
    boxes = torch.stack(crop_boxes(50, 24, 48, torch.Generator().manual_seed(0), scale=scale))
    assert (boxes.t() == torch.tensor([0, 8, 24, 32])).all()


def test_crops_resize_the_drawn_box_bilinearly():
    """Each view is its box resized to the image size (torchvision's resized_crop, bilinear):
    equal wherever the bilinear taps stay inside the box, i.e. away from the box's edges."""
    images = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    views = random_resized_crops(images, 4, torch.Generator().manual_seed(5))
    boxes = crop_boxes(12, 32, 32, torch.Generator().manual_seed(5))  # the same first draws
    compared = 0
    for n in range(12):
        v, b = divmod(n, 3)
        top, left, h, w = (int(t[n]) for t in boxes)
        ref = TF.resized_crop(images[b], top, left, h, w, [32, 32], antialias=False)
        # source coordinate of output pixel o: (o + 0.5) * size / 32 - 0.5 (within the box)
        o = torch.arange(32, dtype=torch.float64)
        ok_x = ((o + 0.5) * w / 32 - 0.5 >= 0) & ((o + 0.5) * w / 32 - 0.5 <= w - 1)
        ok_y = ((o + 0.5) * h / 32 - 0.5 >= 0) & ((o + 0.5) * h / 32 - 0.5 <= h - 1)
        inside = ok_y[:, None] & ok_x[None, :]
        # float32 bilinear: a few ulps of values in [0, 1]
        torch.testing.assert_close(views[v, b][:, inside], ref[:, inside], rtol=0, atol=1e-5)
        compared += int(inside.sum())
    assert compared > 12 * 32 * 32 * 0.8


def test_flip_mirrors_about_half_of_the_views():
    image = torch.linspace(0, 1, 32).view(1, 1, 1, 32).expand(1, 3, 32, 32).contiguous()
    views = random_resized_crops(image, 400, torch.Generator().manual_seed(0), flip=True)
    slope = views[:, 0, 0, 16, -1] - views[:, 0, 0, 16, 0]  # a horizontal ramp: sign = flip
    share = float((slope < 0).float().mean())
    assert abs(share - 0.5) < 4 * math.sqrt(0.25 / 400)


@pytest.mark.parametrize("name", list(AUGMIX_OPS))
def test_augmix_operations_equal_pil(name):
    """Every operation gives PIL's 8-bit result exactly, at severity-1 levels and at larger
    ones (up to 10, so that rotations, shears and shifts are large), on full-range and on
    low-contrast images (where autocontrast and equalize act)."""
    rng = np.random.default_rng(0)
    for trial in range(24):
        pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
        if trial % 3 == 0:
            pixels = (pixels // 16 + 100).astype(np.uint8)
        level = float(rng.uniform(0.1, 1.0 if trial % 2 else 10.0))
        negative = bool(rng.uniform() > 0.5)
        ref = np.array(pil_reference_op(name, Image.fromarray(pixels), level, negative))
        x = torch.from_numpy(pixels).permute(2, 0, 1)[None].float()
        out = AUGMIX_OPS[name](
            x, torch.tensor([level], dtype=torch.float64), torch.tensor([negative])
        )
        assert torch.equal(out[0].permute(1, 2, 0), torch.from_numpy(ref).float()), (
            level,
            negative,
        )


def _official_augmix(pixels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The official ``augmix(image, preprocess, augmentations, severity=1)`` on an already
    cropped 8-bit image, in [0, 1] (ToTensor; the normalisation is affine and commutes)."""
    image = Image.fromarray(pixels)
    w = np.float32(rng.dirichlet([1.0, 1.0, 1.0]))
    m = np.float32(rng.beta(1.0, 1.0))
    mix = np.zeros(pixels.shape, np.float32)
    for i in range(3):
        chain = image.copy()
        for _ in range(rng.integers(1, 4)):
            name = list(AUGMIX_OPS)[rng.integers(len(AUGMIX_OPS))]
            chain = pil_reference_op(name, chain, rng.uniform(0.1, 1.0), rng.uniform() > 0.5)
        mix += w[i] * np.asarray(chain, np.float32) / 255
    return m * pixels.astype(np.float32) / 255 + (1 - m) * mix


def test_augmix_has_the_official_distribution(test_images):
    """Over many views of real digits, how far AugMix moves an image (mean absolute change)
    and how much of it changes follow the official pipeline's distributions (KS, 0.1%)."""
    images = test_images[0][:20]
    pixels = (images * 255).round().byte().permute(0, 2, 3, 1).numpy()
    rng = np.random.default_rng(0)
    reps = 30
    ref = np.stack([_official_augmix(p, rng) for p in pixels for _ in range(reps)])
    source = images.repeat_interleave(reps, dim=0)
    ours = augmix(source, torch.Generator().manual_seed(0)).permute(0, 2, 3, 1).numpy()
    base = source.permute(0, 2, 3, 1).numpy()
    for stat in (
        lambda v: np.abs(v - base).mean(axis=(1, 2, 3)),
        lambda v: (np.abs(v - base) > 1 / 255).mean(axis=(1, 2, 3)),
    ):
        assert ks_2samp(stat(ours), stat(ref)).pvalue > 1e-3
    assert torch.equal(
        torch.from_numpy(ours), augmix(source, torch.Generator().manual_seed(0)).permute(0, 2, 3, 1)
    )


def test_make_views_layout():
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    views = make_views(images, 5, torch.Generator().manual_seed(0), augmix_views=True)
    assert views.shape == (6, 2, 3, 32, 32)
    assert torch.equal(views[0], images)  # the original first
    assert views.min() >= 0 and views.max() <= 1
    with pytest.raises(ValueError, match="need at least one view"):
        make_views(images, 0, torch.Generator(), include_original=False)


@pytest.mark.parametrize(("size", "n", "channels"), [(32, 300, 3), (48, 40, 3), (32, 60, 1)])
def test_pil_chains_equal_the_batched_chains(size, n, channels):
    """The CPU path (each chain's operations through PIL) gives the batched operations'
    chains value for value, including chains of several operations, low-contrast images
    (autocontrast and equalize act), large levels and grayscale images."""
    from mura_plugin import augmix as am

    g = torch.Generator().manual_seed(size + channels)
    images = torch.rand(n, channels, size, size, generator=g)
    images[::3] = images[::3] * 0.2 + 0.4
    x8 = (images * 255).round().clamp(0, 255)
    for severity in (1.0, 10.0):
        draws = am.augmix_draws(n, torch.Generator().manual_seed(size), severity=severity)
        assert torch.equal(am._pil_chains(x8.clone(), draws), am._tensor_chains(x8.clone(), draws))
