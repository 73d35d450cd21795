"""Digital and colour corruptions: brightness, contrast, saturate, jpeg_compression, pixelate
(Hendrycks & Dietterich 2019) and the seed article's colour_jitter and grayscale."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F

from mura_plugin.shifts._ops import in_image_steps, rgb_to_gray
from mura_plugin.shifts._params import check_images, severity_param, severity_table
from tta_bench.buffers import batch_buffer
from tta_bench.data import to_float_images
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


def shift_value(
    rgb: torch.Tensor, c: float, *, v: torch.Tensor | None = None, inplace: bool = False
) -> torch.Tensor:
    """RGB ``[B, C, H, W]`` in [0, 1] with HSV value ``V' = clip(V + c, 0, 1)``, hue and
    saturation kept: equal to ``hsv_to_rgb`` of the modified ``rgb_to_hsv`` without building
    H and S (RGB scales with V at fixed H and S: ``x * V' / V``; black, S = 0, becomes grey
    ``V'``). Inputs below 0 are outside the contract. ``v`` is the channel maximum when the
    caller has it; ``inplace`` writes into ``rgb`` (a temporary of the caller's)."""
    if v is None:
        v = rgb.amax(1, keepdim=True)
    scale = (v + c).clamp_(0.0, 1.0)
    # A reduction is far cheaper than materialising a mask when (as usual) nothing is black.
    has_black = bool(v.amin() <= 0)
    # Black pixels are 0 in every channel, so adding the grey level there (a float 0/1
    # mask: much cheaper than a bool mask and masked_fill on CPU) sets them to it.
    black = torch.le(v, 0.0, out=torch.empty_like(v)) if has_black else None
    scale.div_(v.clamp_(min=1e-12))
    out = rgb.mul_(scale) if inplace else torch.mul(rgb, scale)
    if black is not None:
        out.add_(black, alpha=min(max(c, 0.0), 1.0))
    return out.clamp_(0.0, 1.0)


def scale_saturation(
    rgb: torch.Tensor,
    a: float,
    b: float,
    *,
    v: torch.Tensor | None = None,
    vmin: torch.Tensor | None = None,
    inplace: bool = False,
) -> torch.Tensor:
    """RGB ``[B, 3, H, W]`` in [0, 1] with HSV saturation ``S' = clip(S * a + b, 0, 1)``, hue
    and value kept: equal to the ``rgb_to_hsv`` / ``hsv_to_rgb`` round trip without building
    H (each channel is ``V - V * S * f(H)``, so ``V - (V - x) * S' / S``; grey pixels have
    hue 0, red, and get ``(V, V (1 - S'), V (1 - S'))``). ``v`` and ``vmin`` are the channel
    maximum and minimum when the caller has them; ``inplace`` writes into ``rgb``."""
    if v is None or vmin is None:
        v, vmin = rgb.amax(1, keepdim=True), rgb.amin(1, keepdim=True)
    delta = torch.sub(v, vmin)
    grey = (delta <= 0) if b != 0 and bool(delta.amin() <= 0) else None
    delta.clamp_(min=1e-12)
    if b == 0 and a >= 0:
        # S' / S = clip(S a) / S = min(a, 1 / S) = min(a, v / delta): two passes fewer.
        # Black (v = 0) gives 0 and grey a, both leaving the pixel as it is.
        scale = torch.div(v, delta, out=delta).clamp_(max=a)
    else:
        # S' / S = clip(delta / v * a + b) * v / delta
        safe_v = v.clamp(min=1e-12)
        scale = torch.div(delta, safe_v).mul_(a).add_(b).clamp_(0.0, 1.0)
        scale.mul_(safe_v).div_(delta)
    out = torch.sub(v, rgb, out=rgb if inplace else None)
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
# Severity tables, table name -> parameters of severities 1..5 (``severities.json``); the
# seed article's COLOR_JITTER and GRAYSCALE open their own section below.
#: Factor on each channel's deviation from its mean over the image.
CONTRAST = severity_table("contrast")
#: Added to HSV value.
BRIGHTNESS = severity_table("brightness")
#: (factor, offset) applied to HSV saturation.
SATURATE = severity_table("saturate")
#: JPEG quality.
JPEG_COMPRESSION = severity_table("jpeg_compression")
#: Down-sampling factor of the side.
PIXELATE = severity_table("pixelate")


@in_image_steps
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
    return shift_value(images, c)


def saturate(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """HSV saturation ``S' = clip(S * a + b)``, hue and value kept (grey has hue 0: red)."""
    del generator  # deterministic
    check_images("saturate", images)
    a, b = severity_param("saturate", SATURATE, table, severity)
    if images.shape[1] == 1:
        return rgb_to_gray(scale_saturation(_to_rgb(images), a, b))
    return scale_saturation(images, a, b)


def _check_uint8(name: str, images: torch.Tensor) -> None:
    """The ``from_uint8`` entries' input contract: uint8 ``[B, H, W, C]``, C in (1, 3)."""
    if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[-1] not in (1, 3):
        raise ValueError(
            f"{name}.from_uint8 expects uint8 images [B, H, W, C] with C in (1, 3), "
            f"got {tuple(images.shape)} {images.dtype}"
        )


#: Values of the float batch that the per-pixel ``from_uint8`` entries convert and finish
#: at a time (1 MiB: one 224 px image, a whole 32 px batch): each step's conversion,
#: channel reductions and in-place scaling run while its images are in the CPU's cache,
#: instead of one pass over the whole batch in memory per operation.
CACHE_STEP_ELEMENTS = 1 << 18


def _images_per_step(images: torch.Tensor) -> int:
    """How many images of the 8-bit ``[B, H, W, C]`` batch one ``CACHE_STEP_ELEMENTS``
    step holds (at least one)."""
    _, h, w, ch = images.shape
    return max(1, CACHE_STEP_ELEMENTS // max(1, ch * h * w))


def _per_pixel_from_uint8(
    images: torch.Tensor,
    with_min: bool,
    apply: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], object],
) -> torch.Tensor:
    """The 8-bit ``[B, H, W, 3]`` batch as float ``[B, 3, H, W]`` (the harness's
    ``to_float_images``, written into the step's slice of the output), finished by
    ``apply(x, v, vmin)`` in ``x`` (it must write there: its return value is not used), a
    few images at a time (``CACHE_STEP_ELEMENTS``): ``v`` and ``vmin`` are the step's
    channel maximum and minimum ``[b, 1, H, W]`` (``vmin`` only ``with_min``). Per-pixel
    kernels give each pixel the same value whatever the step, so the output is the whole
    batch's."""
    b, h, w, ch = images.shape
    out = batch_buffer((b, ch, h, w), torch.float32, images.device)
    step = _images_per_step(images)
    for s in range(0, b, step):
        x = to_float_images(images[s : s + step], out=out[s : s + step])
        v = x.amax(1, keepdim=True)
        apply(x, v, x.amin(1, keepdim=True) if with_min else None)
    return out


def _brightness_from_uint8(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """``brightness`` of an 8-bit ``[B, H, W, C]`` batch: the same values as ``brightness``
    on the converted batch, converted and scaled in place a few images at a time
    (``_per_pixel_from_uint8``)."""
    _check_uint8("brightness", images)
    if images.shape[-1] == 1:
        return brightness(to_float_images(images), severity, generator=generator, table=table)
    c = severity_param("brightness", BRIGHTNESS, table, severity)
    return _per_pixel_from_uint8(
        images, False, lambda x, v, _: shift_value(x, c, v=v, inplace=True)
    )


def _saturate_from_uint8(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """``saturate`` of an 8-bit ``[B, H, W, C]`` batch, as ``_brightness_from_uint8``: the
    same values as ``saturate`` on the converted batch."""
    _check_uint8("saturate", images)
    if images.shape[-1] == 1:
        return saturate(to_float_images(images), severity, generator=generator, table=table)
    a, b = severity_param("saturate", SATURATE, table, severity)
    return _per_pixel_from_uint8(
        images, True, lambda x, v, vmin: scale_saturation(x, a, b, v=v, vmin=vmin, inplace=True)
    )


brightness.from_uint8 = _brightness_from_uint8  # type: ignore[attr-defined]
saturate.from_uint8 = _saturate_from_uint8  # type: ignore[attr-defined]


#: 2^23: float32 values in [2^23, 2^24) are the integers, so adding it rounds to an integer.
_ROUND_BIAS = float(1 << 23)


@lru_cache(maxsize=2)
def _scaled_eye(c: int) -> torch.Tensor:
    """``255 I`` of size ``c`` (float32): ``x @ 255 I`` is exactly ``255 x``."""
    return torch.eye(c) * 255.0


def jpeg_compression(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Real JPEG encode + decode at quality ``c`` (libjpeg via torchvision, 4:2:0 chroma
    subsampling like PIL's default) of the 8-bit image; CPU codec on any device.

    ``jpeg_compression.from_uint8`` is the same corruption of an 8-bit ``[B, H, W, C]``
    batch (the harness's decoded format): no quantisation pass, the same result."""
    del generator  # deterministic
    check_images("jpeg_compression", images)
    quality = int(severity_param("jpeg_compression", JPEG_COMPRESSION, table, severity))
    # Channels-last (HWC) buffers are the codec's own layout: encode and decode then copy
    # nothing and the result is written with plain contiguous passes. ``out`` is returned
    # in that memory format (same shape and values; ``.contiguous()`` gives NCHW strides).
    b, c, h, w = images.shape
    out = batch_buffer(images.shape, images.dtype, memory_format=torch.channels_last)
    # 8-bit quantisation: ``255 x`` in HWC order as a batched product with ``255 I`` (a
    # GEMM transposes far faster than a strided elementwise copy), then ``+ 2^23`` rounds it
    # (half to even, as ``round``) to an integer held in the low mantissa byte; clipping to
    # 2^23 + [0, 255] is clipping to 0..255, and the int32 -> uint8 narrowing keeps that
    # byte (float -> uint8 is several times slower). For ``x = k / 255`` (an 8-bit image)
    # this gives back ``k`` exactly.
    planes = images.detach().cpu().float().reshape(b, c, h * w).transpose(1, 2)
    hwc = torch.bmm(planes, _scaled_eye(c).expand(b, c, c)).view(b, h, w, c)
    hwc.clamp_(0.0, 255.0).add_(_ROUND_BIAS)
    _to_unit(_jpeg_roundtrip(hwc.view(torch.int32).to(torch.uint8), quality), out)
    return out.to(images.device)


def _jpeg_from_uint8(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """``jpeg_compression`` of an 8-bit ``[B, H, W, C]`` batch (values 0..255; C = 1 or 3):
    float ``[B, C, H, W]`` in [0, 1] (channels-last memory), equal to
    ``jpeg_compression(images.permute(0, 3, 1, 2).float() / 255, ...)`` value for value.
    The codec takes 8-bit pixels, so this skips the float -> 8-bit pass (at 224 px about a
    third of the kernel's time)."""
    del generator  # deterministic
    _check_uint8("jpeg_compression", images)
    quality = int(severity_param("jpeg_compression", JPEG_COMPRESSION, table, severity))
    b, h, w, c = images.shape
    out = batch_buffer((b, c, h, w), memory_format=torch.channels_last)
    _to_unit(_jpeg_roundtrip(images.detach().cpu().contiguous(), quality), out)
    return out.to(images.device)


jpeg_compression.from_uint8 = _jpeg_from_uint8  # type: ignore[attr-defined]


def _jpeg_roundtrip(hwc_u8: torch.Tensor, quality: int) -> torch.Tensor:
    """Encode the uint8 ``[n, H, W, C]`` images at ``quality`` and decode them: uint8
    ``[n, H, W, C]``."""
    encode_jpeg, decode_jpeg = _codec()
    # torchvision 0.29 deprecates its codecs in favour of torchcodec; they are still the
    # libjpeg the fidelity tests pin, so the notice is silenced here rather than per run.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        encoded = encode_jpeg(list(hwc_u8.permute(0, 3, 1, 2)), quality=quality)
        decoded = decode_jpeg(encoded)
    # Decoded images are HWC underneath, as ``out``: stacked, then (``_to_unit``) a plain
    # conversion copy and an in-place float division.
    return torch.stack([img.permute(1, 2, 0) for img in decoded])


@lru_cache(maxsize=1)
def _codec() -> tuple[Any, Any]:
    """torchvision's ``(encode_jpeg, decode_jpeg)``, imported once: the import statement
    run inside a kernel call leaves an exception's traceback holding the calling frames
    (and the kernel's output buffer) until Python's collector runs, which kept the buffer
    from being recycled (``tta_bench.buffers``)."""
    from torchvision.io import decode_jpeg, encode_jpeg

    return encode_jpeg, decode_jpeg


def _to_unit(hwc: torch.Tensor, out: torch.Tensor) -> None:
    """``hwc / 255`` (uint8 ``[n, H, W, C]``) into ``out`` (``[n, C, H, W]``, channels-last
    memory): a plain conversion copy and an in-place division (uint8 operands in
    arithmetic take a slow, unvectorised path; a fused divide is ~4x slower)."""
    out.copy_(hwc.permute(0, 3, 1, 2)).div_(255.0)


#: Pillow's fixed-point precision for 8-bit resampling weights (``PRECISION_BITS``).
_PIL_BITS = 22


@lru_cache(maxsize=64)
def _pil_box_windows(n_in: int, n_out: int) -> tuple[tuple[int, int, int], ...]:
    """Pillow's 8-bit BOX down-sampling along one axis: per output ``(start, count, k)``.

    Mirrors ``precompute_coeffs`` + ``normalize_coeffs_8bpc``: output ``o`` averages the
    contiguous run of ``count`` input pixels from ``start`` (the pixels whose box offset lies
    in (-1/2, 1/2]), every member with the normalised weight ``1 / count`` stored as the
    fixed-point integer ``k = floor(2^22 / count + 0.5)``; the 8-bit result is
    ``(sum * k + 2^21) >> 22``, clipped to 0..255."""
    scale = n_in / n_out
    filterscale = max(scale, 1.0)
    support = 0.5 * filterscale
    out = []
    for xx in range(n_out):
        center = (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), n_in)
        inside = [x for x in range(xmin, xmax) if -0.5 < (x - center + 0.5) / filterscale <= 0.5]
        count = len(inside)
        k = math.floor((1 << _PIL_BITS) / count + 0.5) if count else 0
        out.append((inside[0] if count else xmin, count, k))
    return tuple(out)


def _rounding_is_exact_in_float32(windows: tuple[tuple[int, int, int], ...]) -> bool:
    """Whether ``floor(sum * (k / 2^22) + 0.5)`` in float32 (separate multiply and add, as
    the kernel computes it) equals Pillow's integer ``(sum * k + 2^21) >> 22`` for every
    possible window sum of 8-bit values, and no result exceeds 255 (so Pillow's clip is a
    no-op); checked exhaustively per (count, k)."""
    for count, k in {(c, k) for _, c, k in windows if c}:
        sums = torch.arange(255 * count + 1, dtype=torch.int64)
        exact = (sums * k + (1 << (_PIL_BITS - 1))) >> _PIL_BITS
        approx = sums.float().mul_(k / float(1 << _PIL_BITS)).add_(0.5).floor_()
        if not torch.equal(approx.long(), exact) or int(exact.max()) > 255:
            return False
    return True


class _BoxAxis:
    """Pillow's 8-bit BOX down-sampling along one axis (``_pil_box_windows``) as a sum of
    gathered slices: output ``o`` is ``sum_j x[start_o + min(j, count_o - 1)] * [j <
    count_o]`` over ``j < depth`` (the largest window), each term one ``index_select``
    along the axis (a block copy of whole rows: the callers reduce along dim 1), then the
    fixed-point normalisation (``round_8bit``). Sums of 8-bit values are exact in float32;
    so is the rounding, checked per window size (float64 otherwise)."""

    def __init__(self, n_in: int, n_out: int, device: torch.device):
        wins = _pil_box_windows(n_in, n_out)
        depth = max(c for _, c, _ in wins)
        self.idx = [
            torch.tensor([st + min(j, max(c - 1, 0)) for st, c, _ in wins], device=device)
            for j in range(depth)
        ]
        self.mask = [
            None
            if all(j < c for _, c, _ in wins)
            else torch.tensor([float(j < c) for _, c, _ in wins], device=device)
            for j in range(depth)
        ]
        self.k = torch.tensor([k / float(1 << _PIL_BITS) for _, _, k in wins], device=device)
        self.float32_exact = _rounding_is_exact_in_float32(wins)

    def down(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The 8-bit box averages of ``x [n, a, b]`` (8-bit values, float32) along ``dim``
        (1 or 2)."""
        shape = (-1, 1) if dim == 1 else (-1,)
        # Bytes are summed as float32 (a no-op for float input): exact either way.
        sums = x.index_select(dim, self.idx[0]).to(torch.float32)
        for idx, mask in zip(self.idx[1:], self.mask[1:]):
            part = x.index_select(dim, idx).to(torch.float32)
            sums = sums.add_(part) if mask is None else sums.addcmul_(part, mask.view(shape))
        k = self.k.view(shape)
        if self.float32_exact:
            return sums.mul_(k).add_(0.5).floor_()
        return sums.copy_(sums.double().mul_(k.double()).add_(0.5).floor_())


@lru_cache(maxsize=32)
def _box_axis(n_in: int, n_out: int, device: torch.device) -> _BoxAxis:
    return _BoxAxis(n_in, n_out, device)


def pixelate(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Box-filter the 8-bit image down to ``int(side * c)`` and back up (Pillow BOX both ways:
    windows of whole pixels averaged with fixed-point weights, horizontal pass first, each
    pass rounded to 8 bits; upward BOX is nearest-neighbour at pixel centres, torch's
    ``nearest-exact``). Bit-exact with Pillow on 8-bit inputs; see ``_BoxAxis``.

    ``pixelate.from_uint8`` is the same corruption of an 8-bit ``[B, H, W, C]`` batch: the
    bytes are the 8-bit image, so the quantisation pass is skipped, the same result."""
    del generator  # deterministic
    check_images("pixelate", images)
    c = severity_param("pixelate", PIXELATE, table, severity)
    b, ch, h, w = images.shape
    # Pillow's horizontal pass first, on the transposed 8-bit image (columns become rows,
    # so every window term is a block copy of rows), written into the output's memory:
    # the down-sampled image is small, and the upsampling then overwrites it.
    out = batch_buffer((b, ch, h, w), torch.float32, images.device)
    u8t = out.view(b * ch, w, h)
    torch.mul(images.detach().reshape(b * ch, h, w).transpose(1, 2), 255.0, out=u8t)
    u8t.round_().clamp_(0, 255)
    return _pixelate_bytes(u8t, c, out).to(images.dtype)


def _pixelate_from_uint8(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """``pixelate`` of an 8-bit ``[B, H, W, C]`` batch (C = 1 or 3): float ``[B, C, H, W]``,
    equal to ``pixelate(images.permute(0, 3, 1, 2).float() / 255, ...)`` value for value
    (there the quantisation gives the bytes back exactly). The bytes are transposed into
    planes ``[B * C, W, H]`` as bytes (a quarter of the float copy) and the horizontal BOX
    pass reads them as such: every window sum is of whole 8-bit values, exact in float32,
    so only the down-sampled image is float until the upsampling writes the output. A few
    images at a time (``CACHE_STEP_ELEMENTS``: one at 224 px, a whole 32 px batch), so
    that the passes run in cache; each plane is computed alone, so the output is the
    whole batch's."""
    del generator  # deterministic
    _check_uint8("pixelate", images)
    c = severity_param("pixelate", PIXELATE, table, severity)
    b, h, w, ch = images.shape
    out = batch_buffer((b, ch, h, w), torch.float32, images.device)
    step = _images_per_step(images)
    for s in range(0, b, step):
        part = images[s : s + step].detach()
        planes = part.permute(0, 3, 2, 1).contiguous().view(part.shape[0] * ch, w, h)
        _pixelate_bytes(planes, c, out[s : s + step])
    return out


pixelate.from_uint8 = _pixelate_from_uint8  # type: ignore[attr-defined]


def _pixelate_bytes(planes: torch.Tensor, c: float, out: torch.Tensor) -> torch.Tensor:
    """``pixelate`` of the 8-bit values that ``planes [B * C, W, H]`` (the image's planes
    transposed; bytes, or the same values as float) holds, written into ``out [B, C, H,
    W]`` (which may share ``planes``' memory: it is written last): the horizontal BOX pass,
    the vertical one (each rounded to 8 bits, ``_BoxAxis``), then the nearest-exact
    upsampling of ``small / 255``."""
    b, ch, h, w = out.shape
    oh, ow = max(1, int(h * c)), max(1, int(w * c))
    n = b * ch
    half = _box_axis(w, ow, out.device).down(planes, 1).transpose(1, 2).contiguous()
    small = _box_axis(h, oh, out.device).down(half, 1).div_(255.0)  # [n, oh, ow]
    # Upward BOX = nearest-exact: two index reads (columns, then rows into the output).
    rows = _nearest_exact_index(oh, h, out.device)
    cols = _nearest_exact_index(ow, w, out.device)
    torch.index_select(_select_columns(small, cols), 1, rows, out=out.view(n, h, w))
    return out


def _select_columns(small: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``small.index_select(2, cols)`` for ``small [n, a, b]``, contiguous: gathered as
    whole rows of the transposed image, then transposed back (the same values; an
    element-wise gather along the last dim is several times slower on CPU)."""
    return small.transpose(1, 2).contiguous().index_select(1, cols).transpose(1, 2).contiguous()


@lru_cache(maxsize=32)
def _nearest_exact_index(n_in: int, n_out: int, device: torch.device) -> torch.Tensor:
    """The source index of each of ``n_out`` positions under ``F.interpolate``'s
    ``nearest-exact`` resize from ``n_in`` (taken from interpolating the indices themselves,
    so it is torch's own rounding)."""
    idx = torch.arange(n_in, dtype=torch.float32).view(1, 1, n_in)
    return F.interpolate(idx, size=n_out, mode="nearest-exact").view(-1).long().to(device)


# -- the seed article's simple colour shifts -------------------------------------------------
#: Maximal relative change of (brightness, contrast, saturation) and hue shift (turns).
COLOR_JITTER = severity_table("color_jitter")
#: Weight of the luma image in the blend.
GRAYSCALE = severity_table("grayscale")


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
