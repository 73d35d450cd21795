"""Digital and colour corruptions: brightness, contrast, saturate, jpeg_compression, pixelate
(Hendrycks & Dietterich 2019) and the seed article's colour_jitter and grayscale."""

from __future__ import annotations

import math
import warnings
from functools import lru_cache

import torch
import torch.nn.functional as F

from mura_plugin.shifts._ops import chunk_rows, rgb_to_gray
from mura_plugin.shifts._params import check_images, severity_param
from tta_bench.rng import SampleGenerator

__all__ = [
    "brightness",
    "contrast",
    "saturate",
    "jpeg_compression",
    "pixelate",
    "color_jitter",
    "grayscale",
    "rgb_to_hsv",
    "hsv_to_rgb",
    "shift_value",
    "scale_saturation",
]

CONTRAST = {
    "cifar": (0.75, 0.5, 0.4, 0.3, 0.15),
    "imagenet": (0.4, 0.3, 0.2, 0.1, 0.05),
    "digits": (0.4, 0.3, 0.2, 0.1, 0.05),
}
#: Added to HSV value.
BRIGHTNESS = {
    "cifar": (0.05, 0.1, 0.15, 0.2, 0.3),
    "imagenet": (0.1, 0.2, 0.3, 0.4, 0.5),
    "digits": (0.3, 0.45, 0.6, 0.7, 0.8),
}
#: (factor, offset) applied to HSV saturation.
SATURATE = {
    "cifar": ((0.3, 0), (0.1, 0), (1.5, 0), (2, 0.1), (2.5, 0.2)),
    "imagenet": ((0.3, 0), (0.1, 0), (2, 0), (5, 0.1), (20, 0.2)),
    "digits": ((0.3, 0), (0.1, 0), (2, 0), (5, 0.1), (20, 0.2)),
}
#: JPEG quality.
JPEG_COMPRESSION = {
    "cifar": (80, 65, 58, 50, 40),
    "imagenet": (25, 18, 15, 10, 7),
    "digits": (30, 15, 8, 4, 1),
}
#: Down-sampling factor of the side.
PIXELATE = {
    "cifar": (0.95, 0.9, 0.85, 0.75, 0.65),
    "imagenet": (0.6, 0.5, 0.4, 0.3, 0.25),
    "digits": (0.3, 0.25, 0.2, 0.15, 0.1),
}
#: Maximal relative change of (brightness, contrast, saturation) and hue shift (turns).
COLOR_JITTER = {
    "cifar": ((0.1, 0.1, 0.1, 0.02), (0.2, 0.2, 0.2, 0.04), (0.3, 0.3, 0.3, 0.06),
              (0.4, 0.4, 0.4, 0.08), (0.5, 0.5, 0.5, 0.1)),
    "imagenet": ((0.1, 0.1, 0.1, 0.02), (0.2, 0.2, 0.2, 0.04), (0.3, 0.3, 0.3, 0.06),
                 (0.4, 0.4, 0.4, 0.08), (0.5, 0.5, 0.5, 0.1)),
    "digits": ((0.2, 0.2, 0.2, 0.04), (0.4, 0.4, 0.4, 0.08), (0.6, 0.6, 0.6, 0.12),
               (0.8, 0.8, 0.8, 0.16), (0.9, 0.9, 0.9, 0.2)),
}  # fmt: skip
#: Weight of the luma image in the blend.
GRAYSCALE = {
    "cifar": (0.2, 0.4, 0.6, 0.8, 1.0),
    "imagenet": (0.2, 0.4, 0.6, 0.8, 1.0),
    "digits": (0.2, 0.4, 0.6, 0.8, 1.0),
}


# -- colour spaces ---------------------------------------------------------------------------
def rgb_to_hsv(images: torch.Tensor) -> torch.Tensor:
    """RGB ``[B, 3, H, W]`` in [0, 1] -> HSV with H in [0, 1) (turns), S and V in [0, 1]."""
    r, g, b = images.unbind(1)
    v, _ = images.max(1)
    mn, _ = images.min(1)
    delta = v - mn
    s = torch.where(v > 0, delta / v.clamp_min(1e-12), torch.zeros_like(v))
    safe = delta.clamp_min(1e-12)
    h = torch.where(
        v == r, (g - b) / safe, torch.where(v == g, 2.0 + (b - r) / safe, 4.0 + (r - g) / safe)
    )
    h = torch.where(delta > 0, (h / 6.0).remainder(1.0), torch.zeros_like(h))
    return torch.stack((h, s, v), 1)


def hsv_to_rgb(hsv: torch.Tensor) -> torch.Tensor:
    """Inverse of ``rgb_to_hsv``."""
    h, s, v = hsv.unbind(1)
    k = torch.tensor([5.0, 3.0, 1.0], device=hsv.device, dtype=hsv.dtype).view(1, 3, 1, 1)
    t = (k + h.unsqueeze(1) * 6.0).remainder(6.0)
    f = torch.minimum(t, 4.0 - t).clamp(0.0, 1.0)
    return v.unsqueeze(1) - v.unsqueeze(1) * s.unsqueeze(1) * f


def shift_value(rgb: torch.Tensor, c: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """RGB ``[B, C, H, W]`` in [0, 1] with HSV value ``V' = clip(V + c, 0, 1)``, hue and
    saturation kept: equal to ``hsv_to_rgb`` of the modified ``rgb_to_hsv`` without building
    H and S (RGB scales with V at fixed H and S: ``x * V' / V``; black, S = 0, becomes grey
    ``V'``). Written into ``out`` when given."""
    v = rgb.amax(1, keepdim=True)
    scale = (v + c).clamp_(0.0, 1.0)
    # A reduction is far cheaper than materialising a mask when (as usual) nothing is black.
    has_black = bool(v.amin() <= 0)
    black = (v <= 0) if has_black else None
    scale.div_(v.clamp_(min=1e-12))
    out = torch.mul(rgb, scale, out=out)
    if black is not None:
        out.masked_fill_(black.expand_as(out), min(max(c, 0.0), 1.0))
    return out.clamp_(0.0, 1.0)


def scale_saturation(
    rgb: torch.Tensor, a: float, b: float, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RGB ``[B, 3, H, W]`` in [0, 1] with HSV saturation ``S' = clip(S * a + b, 0, 1)``, hue
    and value kept: equal to the ``rgb_to_hsv`` / ``hsv_to_rgb`` round trip without building
    H (each channel is ``V - V * S * f(H)``, so ``V - (V - x) * S' / S``; grey pixels have
    hue 0, red, and get ``(V, V (1 - S'), V (1 - S'))``). Written into ``out`` when given."""
    v = rgb.amax(1, keepdim=True)
    delta = v - rgb.amin(1, keepdim=True)
    grey = (delta <= 0) if b != 0 and bool(delta.amin() <= 0) else None
    safe_v = v.clamp(min=1e-12)
    delta.clamp_(min=1e-12)
    # S' / S = clip(delta / v * a + b) * v / delta
    scale = torch.div(delta, safe_v).mul_(a).add_(b).clamp_(0.0, 1.0)
    scale.mul_(safe_v).div_(delta)
    out = torch.sub(v, rgb, out=out)
    out = torch.addcmul(v, out, scale, value=-1.0, out=out)
    if grey is not None:
        grey_gb = (v * (1.0 - min(max(b, 0.0), 1.0))).expand_as(out[:, 1:])
        mask = grey.expand_as(out[:, 1:])
        out[:, 1:] = torch.where(mask, grey_gb, out[:, 1:])
    return out.clamp_(0.0, 1.0)


def _to_rgb(images: torch.Tensor) -> torch.Tensor:
    return images.expand(-1, 3, -1, -1) if images.shape[1] == 1 else images


def _from_rgb(rgb: torch.Tensor, channels: int) -> torch.Tensor:
    return rgb_to_gray(rgb) if channels == 1 else rgb


# -- ImageNet-C digital corruptions ----------------------------------------------------------
def contrast(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Blend each channel towards its mean over the image: ``(x - mean) * c + mean``."""
    del generator  # deterministic
    check_images("contrast", images)
    c = severity_param("contrast", CONTRAST, table, severity)
    means = images.mean(dim=(2, 3), keepdim=True)
    return ((images - means) * c + means).clamp(0.0, 1.0)


def brightness(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Add ``c`` to the HSV value (clipped at 1), keeping hue and saturation.

    With hue and saturation fixed, RGB scales with V, so ``x * V' / V`` is the exact HSV
    round trip (black pixels, with S = 0, become grey ``V'``); see ``shift_value``.
    """
    del generator  # deterministic
    check_images("brightness", images)
    c = severity_param("brightness", BRIGHTNESS, table, severity)
    return _per_chunk(images, lambda x, out: shift_value(x, c, out=out))


def saturate(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """HSV saturation ``S' = clip(S * a + b)``, hue and value kept (grey has hue 0: red)."""
    del generator  # deterministic
    check_images("saturate", images)
    a, b = severity_param("saturate", SATURATE, table, severity)
    if images.shape[1] == 1:
        return rgb_to_gray(scale_saturation(_to_rgb(images), a, b))
    return _per_chunk(images, lambda x, out: scale_saturation(x, a, b, out=out))


def _per_chunk(images: torch.Tensor, fn) -> torch.Tensor:
    """Apply ``fn(chunk, out=chunk_of_result)`` to cache-sized chunks of the batch."""
    out = torch.empty_like(images)
    step = chunk_rows(images)
    for s in range(0, images.shape[0], step):
        fn(images[s : s + step], out[s : s + step])
    return out


def jpeg_compression(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Real JPEG encode + decode at quality ``c`` (libjpeg via torchvision, 4:2:0 chroma
    subsampling like PIL's default) of the 8-bit image; CPU codec on any device."""
    del generator  # deterministic
    from torchvision.io import decode_jpeg, encode_jpeg

    check_images("jpeg_compression", images)
    quality = severity_param("jpeg_compression", JPEG_COMPRESSION, table, severity)
    # Channels-last (HWC) buffers are the codec's own layout: encode and decode then copy
    # nothing and the result is written with plain contiguous copies. ``out`` is returned
    # in that memory format (same shape and values; ``.contiguous()`` gives NCHW strides).
    out = torch.empty(images.shape, dtype=images.dtype, memory_format=torch.channels_last)
    step = chunk_rows(images)
    # torchvision 0.29 deprecates its codecs in favour of torchcodec; they are still the
    # libjpeg the fidelity tests pin, so the notice is silenced here rather than per run.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        # Cache-sized chunks: the 8-bit conversion and the copy back stay in cache instead of
        # making whole-batch passes over freshly allocated memory.
        for s in range(0, images.shape[0], step):
            chunk = images[s : s + step].detach().cpu()
            u8 = chunk.mul(255.0).round_().clamp_(0, 255)
            u8 = u8.to(torch.uint8, memory_format=torch.channels_last)
            decoded = decode_jpeg(encode_jpeg(list(u8), quality=int(quality)))
            dst = out[s : s + step]
            for j, img in enumerate(decoded):
                dst[j].copy_(img)
            dst.div_(255.0)
    return out.to(images.device)


@lru_cache(maxsize=64)
def _pil_box_plan(n_in: int, n_out: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Pillow's 8-bit BOX down-sampling along one axis as ``(members [n_in, n_out],
    weight [n_out])``: output ``o`` is ``round_fixed(sum of its member pixels * weight[o])``.

    Mirrors ``precompute_coeffs`` + ``normalize_coeffs_8bpc``: every member of a window has
    the same normalised weight ``1 / count``, stored as the fixed-point integer
    ``floor(2^22 / count + 0.5)`` (``PRECISION_BITS = 22``); ``weight`` is that integer
    divided by ``2^22`` (exact in float64). ``members`` is 0/1 (float32 sums of 8-bit values
    over a window are exact integers)."""
    scale = n_in / n_out
    filterscale = max(scale, 1.0)
    support = 0.5 * filterscale
    members = torch.zeros(n_in, n_out, dtype=torch.float32)
    weight = torch.zeros(n_out, dtype=torch.float64)
    for xx in range(n_out):
        center = (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), n_in)
        xs = torch.arange(xmin, xmax, dtype=torch.float64)
        t = (xs - center + 0.5) / filterscale
        inside = (t > -0.5) & (t <= 0.5)
        count = int(inside.sum())
        if count:
            members[xmin:xmax, xx] = inside.float()
            weight[xx] = math.floor((1 << 22) / count + 0.5) / float(1 << 22)
    return members.to(device), weight.to(device)


def _pil_box_down(u8: torch.Tensor, n_out: int, dim: int) -> torch.Tensor:
    """Pillow BOX down-sampling of 8-bit values (float32 ``[..., H, W]``) along ``dim``
    (-1 or -2) to ``n_out``, rounded to 8 bits as Pillow does after each pass."""
    members, weight = _pil_box_plan(u8.shape[dim], n_out, u8.device)
    if dim == -1:
        sums = torch.matmul(u8, members)
    else:
        sums = torch.matmul(members.t(), u8)
        weight = weight[:, None]
    # (sum * k + 2^21) >> 22 with k = weight * 2^22: exact in float64 (< 2^53).
    return (sums.double() * weight + 0.5).floor_().clamp_(0, 255).float()


def pixelate(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Box-filter the 8-bit image down to ``int(side * c)`` and back up (Pillow BOX both ways:
    windows of whole pixels averaged with fixed-point weights, horizontal pass first; upward
    BOX is nearest-neighbour at pixel centres, torch's ``nearest-exact``)."""
    del generator  # deterministic
    check_images("pixelate", images)
    c = severity_param("pixelate", PIXELATE, table, severity)
    h, w = images.shape[-2:]
    oh, ow = max(1, int(h * c)), max(1, int(w * c))
    out = torch.empty_like(images)
    step = chunk_rows(images)
    for s in range(0, images.shape[0], step):
        u8 = images[s : s + step].detach().float().mul(255.0).round_().clamp_(0, 255)
        small = u8 if ow == w else _pil_box_down(u8, ow, -1)
        small = small if oh == h else _pil_box_down(small, oh, -2)
        big = F.interpolate(small, size=(h, w), mode="nearest-exact")
        out[s : s + step] = big.div_(255.0)
    return out


# -- the seed article's simple colour shifts -------------------------------------------------
def color_jitter(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Random per-sample brightness, contrast, saturation (factors in ``1 +- s``) and hue
    shift (``+- h`` turns), applied in that fixed order (torchvision ColorJitter's maths)."""
    check_images("color_jitter", images)
    sb, sc, ss, sh = severity_param("color_jitter", COLOR_JITTER, table, severity)
    u = generator.uniform(4).to(images.device, images.dtype) * 2.0 - 1.0
    fb, fc, fs = (1 + sb * u[:, 0]), (1 + sc * u[:, 1]), (1 + ss * u[:, 2])
    dh = sh * u[:, 3]
    rgb = _to_rgb(images) * fb.view(-1, 1, 1, 1)
    rgb = rgb.clamp(0.0, 1.0)
    mean = rgb_to_gray(rgb).mean(dim=(1, 2, 3), keepdim=True)
    rgb = ((rgb - mean) * fc.view(-1, 1, 1, 1) + mean).clamp(0.0, 1.0)
    gray = rgb_to_gray(rgb)
    rgb = ((rgb - gray) * fs.view(-1, 1, 1, 1) + gray).clamp(0.0, 1.0)
    hsv = rgb_to_hsv(rgb)
    hue = (hsv[:, 0] + dh.view(-1, 1, 1)).remainder(1.0)
    rgb = hsv_to_rgb(torch.stack((hue, hsv[:, 1], hsv[:, 2]), 1))
    return _from_rgb(rgb, images.shape[1]).clamp(0.0, 1.0)


def grayscale(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Blend towards the luma image with weight ``c`` (1 = fully grey)."""
    del generator  # deterministic
    check_images("grayscale", images)
    c = severity_param("grayscale", GRAYSCALE, table, severity)
    return ((1 - c) * images + c * rgb_to_gray(images)).clamp(0.0, 1.0)
