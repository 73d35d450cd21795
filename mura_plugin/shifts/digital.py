"""Digital and colour corruptions: brightness, contrast, saturate, jpeg_compression, pixelate
(Hendrycks & Dietterich 2019) and the seed article's colour_jitter and grayscale."""

from __future__ import annotations

from functools import lru_cache

import torch

from mura_plugin.shifts._ops import rgb_to_gray
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
    round trip (black pixels, with S = 0, become grey ``V'``).
    """
    del generator  # deterministic
    check_images("brightness", images)
    c = severity_param("brightness", BRIGHTNESS, table, severity)
    v, _ = images.max(1, keepdim=True)
    v_new = (v + c).clamp(0.0, 1.0)
    out = torch.where(v > 0, images * (v_new / v.clamp_min(1e-12)), v_new.expand_as(images))
    return out.clamp(0.0, 1.0)


def saturate(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """HSV saturation ``S' = clip(S * a + b)``, hue and value kept (grey has hue 0: red)."""
    del generator  # deterministic
    check_images("saturate", images)
    a, b = severity_param("saturate", SATURATE, table, severity)
    rgb = _to_rgb(images)
    hsv = rgb_to_hsv(rgb)
    hsv = torch.stack((hsv[:, 0], (hsv[:, 1] * a + b).clamp(0.0, 1.0), hsv[:, 2]), 1)
    return _from_rgb(hsv_to_rgb(hsv), images.shape[1]).clamp(0.0, 1.0)


def jpeg_compression(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Real JPEG encode + decode at quality ``c`` (libjpeg via torchvision, 4:2:0 chroma
    subsampling like PIL's default) of the 8-bit image; CPU codec on any device."""
    del generator  # deterministic
    from torchvision.io import decode_jpeg, encode_jpeg

    check_images("jpeg_compression", images)
    quality = severity_param("jpeg_compression", JPEG_COMPRESSION, table, severity)
    u8 = (images.detach() * 255.0).round().clamp(0, 255).to(torch.uint8).cpu()
    encoded = encode_jpeg(list(u8), quality=int(quality))
    decoded = decode_jpeg(encoded)
    return torch.stack(decoded).to(images.device, images.dtype) / 255.0


@lru_cache(maxsize=64)
def _pil_box_coeffs(n_in: int, n_out: int) -> torch.Tensor:
    """Pillow's 8-bit BOX resampling coefficients ``[n_out, n_in]`` as fixed-point integers
    (``PRECISION_BITS = 22``), exactly as ``precompute_coeffs`` + ``normalize_coeffs_8bpc``."""
    scale = n_in / n_out
    filterscale = max(scale, 1.0)
    support = 0.5 * filterscale
    mat = torch.zeros(n_out, n_in, dtype=torch.float64)
    for xx in range(n_out):
        center = (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), n_in)
        xs = torch.arange(xmin, xmax, dtype=torch.float64)
        t = (xs - center + 0.5) / filterscale
        w = ((t > -0.5) & (t <= 0.5)).double()
        if w.sum() > 0:
            w = w / w.sum()
        mat[xx, xmin:xmax] = torch.floor(w * (1 << 22) + 0.5)
    return mat


def _pil_resize(u8: torch.Tensor, out_h: int, out_w: int) -> torch.Tensor:
    """Pillow ``resize(..., BOX)`` of 8-bit values held in float64 ``[B, C, H, W]``:
    horizontal pass, rounding to 8 bits, vertical pass, rounding (Pillow's order)."""
    h, w = u8.shape[-2:]
    half = float(1 << 21)

    def rnd(v: torch.Tensor) -> torch.Tensor:
        return torch.floor((v + half) / float(1 << 22)).clamp(0, 255)

    if out_w != w:
        u8 = rnd(torch.matmul(u8, _pil_box_coeffs(w, out_w).to(u8.device).t()))
    if out_h != h:
        u8 = rnd(torch.matmul(_pil_box_coeffs(h, out_h).to(u8.device), u8))
    return u8


def pixelate(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Box-filter the 8-bit image down to ``int(side * c)`` and back up (Pillow BOX both ways;
    upward BOX is nearest-neighbour)."""
    del generator  # deterministic
    check_images("pixelate", images)
    c = severity_param("pixelate", PIXELATE, table, severity)
    h, w = images.shape[-2:]
    u8 = (images.detach() * 255.0).round().clamp(0, 255).double()
    small = _pil_resize(u8, max(1, int(h * c)), max(1, int(w * c)))
    return (_pil_resize(small, h, w) / 255.0).to(images.dtype)


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
