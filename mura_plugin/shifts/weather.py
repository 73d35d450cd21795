"""Weather corruptions: fog, snow, frost and spatter (Hendrycks & Dietterich 2019).

Random fields (plasma fractals, snow grain, liquid layers, frost crops) are drawn per sample
from the ``SampleGenerator``. Frost textures are synthesised deterministically (no image
files are read or downloaded).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from mura_plugin.shifts._ops import (
    _filter_matrix,
    apply_separable,
    clipped_zoom,
    draw_batch,
    gather_windows,
    gaussian_filter,
    in_image_steps,
    rgb_to_gray,
)
from mura_plugin.shifts._params import check_images, severity_param, spatial_scale
from mura_plugin.shifts.blur import motion_filter
from tta_bench.rng import SampleGenerator

__all__ = ["fog", "snow", "frost", "spatter", "plasma_fractal", "frost_texture"]

#: (fog strength, plasma-fractal wibble decay).
FOG = {
    "cifar": ((0.2, 3), (0.5, 3), (0.75, 2.5), (1, 2), (1.5, 1.75)),
    "imagenet": ((1.5, 2), (2.0, 2), (2.5, 1.7), (2.5, 1.5), (3.0, 1.4)),
    "digits": ((0.645, 2.5), (0.845, 2.5), (0.952, 2.5), (1.15, 2.35), (1.38, 2.12)),
}
#: (grain mean, grain std, grain zoom, threshold, blur radius, blur sigma, image weight).
SNOW = {
    "cifar": (
        (0.1, 0.2, 1, 0.6, 8, 3, 0.95),
        (0.1, 0.2, 1, 0.5, 10, 4, 0.9),
        (0.15, 0.3, 1.75, 0.55, 10, 4, 0.9),
        (0.25, 0.3, 2.25, 0.6, 12, 6, 0.85),
        (0.3, 0.3, 1.25, 0.65, 14, 12, 0.8),
    ),
    "imagenet": (
        (0.1, 0.3, 3, 0.5, 10, 4, 0.8),
        (0.2, 0.3, 2, 0.5, 12, 4, 0.7),
        (0.55, 0.3, 4, 0.9, 12, 8, 0.7),
        (0.55, 0.3, 4.5, 0.85, 12, 8, 0.65),
        (0.55, 0.3, 2.5, 0.85, 12, 12, 0.55),
    ),
    "digits": (
        (0.038, 0.3, 1.0, 0.5, 8, 3, 0.811),
        (0.105, 0.3, 1.0, 0.5, 8, 3, 0.795),
        (0.144, 0.3, 1.0, 0.5, 9, 3, 0.756),
        (0.266, 0.3, 1.16, 0.5, 10, 4, 0.634),
        (0.282, 0.3, 1.2, 0.5, 10, 4, 0.618),
    ),
}
#: (image weight, frost weight).
FROST = {
    "cifar": ((1, 0.2), (1, 0.3), (0.9, 0.4), (0.85, 0.4), (0.75, 0.45)),
    "imagenet": ((1, 0.4), (0.8, 0.6), (0.7, 0.7), (0.65, 0.7), (0.6, 0.75)),
    "digits": ((0.854, 0.366), (0.819, 0.451), (0.787, 0.513), (0.731, 0.569), (0.673, 0.627)),
}
#: Frost texture pixels per image pixel at the table's native size: ImageNet-C crops the
#: photographs at full resolution, CIFAR-10-C first shrinks them by 0.2.
FROST_ZOOM = {"cifar": 0.2, "imagenet": 1.0, "digits": 0.2}
#: (liquid mean, liquid std, liquid blur sigma, threshold, strength or mud blur, mode) with
#: mode 0 = water, 1 = mud.
SPATTER = {
    "cifar": (
        (0.62, 0.1, 0.7, 0.7, 0.5, 0),
        (0.65, 0.1, 0.8, 0.7, 0.5, 0),
        (0.65, 0.3, 1, 0.69, 0.5, 0),
        (0.65, 0.1, 0.7, 0.69, 0.6, 1),
        (0.65, 0.1, 0.5, 0.68, 0.6, 1),
    ),
    "imagenet": (
        (0.65, 0.3, 4, 0.69, 0.6, 0),
        (0.65, 0.3, 3, 0.68, 0.6, 0),
        (0.65, 0.3, 2, 0.68, 0.5, 0),
        (0.65, 0.3, 1, 0.65, 1.5, 1),
        (0.67, 0.4, 1, 0.65, 1.5, 1),
    ),
    "digits": (
        (0.67, 0.4, 0.7, 0.726, 0.6, 1),
        (0.67, 0.4, 0.7, 0.698, 0.6, 1),
        (0.67, 0.4, 0.7, 0.678, 0.6, 1),
        (0.67, 0.4, 0.7, 0.649, 0.6, 1),
        (0.67, 0.4, 0.7, 0.622, 0.6, 1),
    ),
}


# -- fog -------------------------------------------------------------------------------------
#: ``plasma_fractal``'s passes: ``(first slot, count, centre, taps [count, 4])``.
PlasmaPass = tuple[int, int, bool, torch.Tensor]


@lru_cache(maxsize=8)
def _plasma_plan(mapsize: int) -> tuple[tuple[PlasmaPass, ...], torch.Tensor]:
    """``plasma_fractal``'s schedule for a ``mapsize`` map, in slot order: the fractal is
    built in a ``[mapsize^2, B]`` buffer whose row ``s`` is the ``s``-th value created
    (slot 0 is the zero corner; slot ``1 + d`` consumes uniform ``d``), so each pass
    writes one contiguous block of rows.

    Returns the passes ``(first slot, count, centre, taps)``, ``taps [count, 4]`` the slots
    of the four neighbours each new value averages (``centre``: square centres, summed
    ``(t0 + t2) + (t1 + t3)``; otherwise edge midpoints, ``((t0 + t1) + t2) + t3``: the
    reference's summation orders), and ``slot [mapsize, mapsize]`` (int64), each map
    position's row. Cached: never modify the tensors."""
    slot = torch.full((mapsize, mapsize), -1, dtype=torch.long)
    slot[0, 0] = 0
    passes = []
    used, step = 1, mapsize
    while step >= 2:
        half, k = step // 2, mapsize // step
        # Neighbours with wrap-around, as the reference's ``np.roll``s.
        ul = slot[0::step, 0::step]
        down, right = ul.roll(-1, 0), ul.roll(-1, 1)
        taps = torch.stack((ul, right, down, down.roll(-1, 1)), -1).view(-1, 4)
        slot[half::step, half::step] = torch.arange(used, used + k * k).view(k, k)
        passes.append((used, k * k, True, taps))
        used += k * k
        dr = slot[half::step, half::step]
        left = torch.stack((dr, dr.roll(1, 0), ul, ul.roll(-1, 1)), -1).view(-1, 4)
        top = torch.stack((dr, dr.roll(1, 1), ul, ul.roll(-1, 0)), -1).view(-1, 4)
        slot[0::step, half::step] = torch.arange(used, used + k * k).view(k, k)
        slot[half::step, 0::step] = torch.arange(used + k * k, used + 2 * k * k).view(k, k)
        passes.append((used, 2 * k * k, False, torch.cat((left, top))))
        used += 2 * k * k
        step //= 2
    return tuple(passes), slot


@lru_cache(maxsize=16)
def _plasma_wibbles(mapsize: int, decay: float) -> torch.Tensor:
    """``[mapsize^2 - 1]`` float32: the ``wibble`` each uniform is scaled by (100, divided
    by ``decay`` per level; a level creates ``3 k^2`` values on its ``k x k`` grid)."""
    values, wibble, k = [], 100.0, 1
    while k < mapsize:
        values.append(torch.full((3 * k * k,), wibble, dtype=torch.float32))
        wibble /= decay
        k *= 2
    return torch.cat(values)


def _plasma_slots(generator: SampleGenerator, mapsize: int, decay: float) -> torch.Tensor:
    """The plasma fractals in ``_plasma_plan``'s slot order, ``[mapsize^2, B]`` in [0, 1]."""
    passes, _ = _plasma_plan(mapsize)
    b = len(generator)
    draws = draw_batch(generator, "uniform", mapsize * mapsize - 1)
    # wibble * U(-wibble, wibble) for every value at once, with the reference's roundings:
    # ``wibble * (u * 2 * wibble - wibble)`` (``u * 2 * wibble`` is ``u * (2 * wibble)``
    # exactly: doubling is exact).
    wibble = _plasma_wibbles(mapsize, float(decay))
    noise = draws.mul_(wibble * 2.0).sub_(wibble).mul_(wibble)
    slots = torch.empty(mapsize * mapsize, b)
    slots[0] = 0.0
    slots[1:].copy_(noise.t())  # a 2-D transpose: torch's blocked copy
    for first, count, centre, taps in passes:
        near = slots.index_select(0, taps.view(-1)).view(count, 4, b)
        if centre:
            pairs = near[:, 0:2] + near[:, 2:4]
            total = torch.add(pairs[:, 0], pairs[:, 1])
        else:
            total = near[:, 0] + near[:, 1]
            total.add_(near[:, 2]).add_(near[:, 3])
        # noise + total / 4 (a division by 4 is exact, as is the product by 0.25).
        slots[first : first + count].add_(total, alpha=0.25)
    slots.sub_(slots.amin(0, keepdim=True))
    return slots.div_(slots.amax(0, keepdim=True))


def plasma_fractal(
    generator: SampleGenerator, mapsize: int, decay: float, *, crop: tuple[int, int] | None = None
) -> torch.Tensor:
    """Diamond-square plasma fractals ``[B, mapsize, mapsize]`` in [0, 1] (float32, CPU),
    ImageNet-C's ``plasma_fractal``: midpoints get the mean of their neighbours plus
    ``wibble * U(-wibble, wibble)``, with ``wibble`` starting at 100 and divided by ``decay``
    per level. Each sample's uniforms (``mapsize^2 - 1`` of them) come from one draw of its
    own generator, consumed level by level. ``crop=(h, w)`` returns only the top-left
    ``[B, h, w]`` (normalised over the whole map, as a crop of the full result).

    All samples are built at once, level by level, with the reference's float32 operations
    in its order (the same values, bit for bit): each level's square centres, then its edge
    midpoints, each as one gather of their four neighbours and three adds in a buffer
    ordered by creation (see ``_plasma_plan``), a few ops per level instead of a few dozen
    on tiny strided slices."""
    if mapsize < 1 or mapsize & (mapsize - 1):
        raise ValueError(f"plasma_fractal: mapsize must be a power of two, got {mapsize}")
    h, w = (mapsize, mapsize) if crop is None else crop
    if not (0 < h <= mapsize and 0 < w <= mapsize):
        raise ValueError(f"plasma_fractal: crop {crop} must lie inside {mapsize}x{mapsize}")
    slots = _plasma_slots(generator, mapsize, decay)
    _, slot = _plasma_plan(mapsize)
    picked = slots.index_select(0, slot[:h, :w].reshape(-1))
    out = torch.empty(len(generator), h * w)
    return out.copy_(picked.t()).view(-1, h, w)  # a 2-D transpose: torch's blocked copy


def fog_blend(images: torch.Tensor, pattern: torch.Tensor, strength: float) -> torch.Tensor:
    """Add ``strength * pattern [B, H, W]`` and rescale by ``max / (max + strength)``."""
    max_val = images.amax(dim=(1, 2, 3), keepdim=True)
    x = torch.add(images, pattern.unsqueeze(1).to(images), alpha=strength)
    # One per-sample factor: no full-size division.
    return x.mul_(max_val / (max_val + strength)).clamp_(0.0, 1.0)


def fog(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Fog: a plasma fractal (smallest power-of-two map covering the image) added to the
    image, contrast-compressed so the maximum is preserved."""
    check_images("fog", images)
    strength, decay = severity_param("fog", FOG, table, severity)
    h, w = images.shape[-2:]
    size = 1 << max(1, (max(h, w) - 1).bit_length())
    pattern = plasma_fractal(generator, size, decay, crop=(h, w))
    return fog_blend(images, pattern.to(images.device), strength)


# -- snow ------------------------------------------------------------------------------------
def snow(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Snow: thresholded, zoomed Gaussian grain motion-blurred at U(-135, -45) degrees, added
    twice (and rotated by 180 degrees) to a brightened, greyed image."""
    check_images("snow", images)
    mean, std, zoom, thresh, radius, sigma, keep = severity_param("snow", SNOW, table, severity)
    scale = spatial_scale(table, images)
    h, w = images.shape[-2:]
    grain = draw_batch(generator, "normal", 1, h, w).to(images.device, images.dtype)
    grain.mul_(std).add_(mean)
    angles = draw_batch(generator, "uniform", 1)[:, 0] * 90.0 - 135.0
    factor = max(1.0, zoom * scale)
    radius = max(1, int(round(radius * scale)))
    grain = clipped_zoom(grain, factor)
    grain = grain * _mask(torch.ge, grain, thresh)  # below the threshold: 0
    # The reference round-trips the layer through 8-bit images around ImageMagick's blur.
    grain = grain.clamp_(0.0, 1.0).mul_(255.0).floor_().div_(255.0)
    layer = motion_filter(grain, radius, sigma * scale, angles)
    layer = layer.mul_(255.0).round_().clamp_(0, 255).div_(255.0)
    layer = layer.add_(torch.flip(layer, dims=(-2, -1)))
    # keep * x + (1 - keep) * max(x, 1.5 gray + 0.5), as one lerp from the brightened image.
    if images.shape[1] == 3:
        bright = images[:, 0:1] * (0.299 * 1.5)
        bright.add_(images[:, 1:2], alpha=0.587 * 1.5).add_(images[:, 2:3], alpha=0.114 * 1.5)
    else:
        bright = rgb_to_gray(images) * 1.5
    bright = torch.maximum(images, bright.add_(0.5))
    return bright.lerp_(images, keep).add_(layer).clamp_(0.0, 1.0)


# -- frost -----------------------------------------------------------------------------------
#: Per-channel (mean, std) of the five ImageNet-C frost photographs the reference samples
#: from (measured on the images shipped with corrupt-tta); the synthetic textures match them.
FROST_STATS = (
    ((0.305, 0.585, 0.650), (0.106, 0.065, 0.060)),
    ((0.787, 0.805, 0.841), (0.084, 0.087, 0.089)),
    ((0.787, 0.805, 0.841), (0.084, 0.087, 0.089)),
    ((0.540, 0.599, 0.648), (0.112, 0.112, 0.117)),
    ((0.441, 0.484, 0.528), (0.174, 0.170, 0.163)),
)
FROST_BASE = 512


@lru_cache(maxsize=8)
def _frost_base(index: int) -> torch.Tensor:
    """A ``[3, 512, 512]`` synthetic frost texture in [0, 1] (CPU, deterministic).

    Ice on glass: a 1/f cloudy base plus thin bright crystal needles (random walks with
    branching directions) and a fine sparkle, standardised, then tinted to the measured
    per-channel statistics of reference frost photograph ``index``.
    """
    n = FROST_BASE
    g = torch.Generator().manual_seed(7919 * (index + 1))
    # 1/f^1.5 noise: a soft, cloudy layer of condensation.
    fy = torch.fft.fftfreq(n).view(n, 1)
    fx = torch.fft.rfftfreq(n).view(1, -1)
    radius = (fx**2 + fy**2).sqrt().clamp_min(1.0 / n)
    spec = torch.complex(
        torch.randn(n, n // 2 + 1, generator=g), torch.randn(n, n // 2 + 1, generator=g)
    )
    cloud = torch.fft.irfft2(spec / radius**1.5, s=(n, n))
    cloud = (cloud - cloud.mean()) / cloud.std()
    # Crystal needles: random walks, each step deposited bilinearly.
    walkers, steps = 900, 90
    pos = torch.rand(walkers, 2, generator=g) * n
    heading = torch.rand(walkers, generator=g) * 2 * torch.pi
    acc = torch.zeros(n * n)
    for _ in range(steps):
        heading = heading + 0.25 * torch.randn(walkers, generator=g)
        pos = (pos + torch.stack((heading.cos(), heading.sin()), 1)).remainder(n)
        iy, ix = pos[:, 0].long() % n, pos[:, 1].long() % n
        acc.index_add_(0, iy * n + ix, torch.ones(walkers))
    needles = acc.view(n, n).clamp(max=3.0)
    m = _filter_matrix(n, torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64), "reflect")
    needles = apply_separable(needles.double(), m, m).float()
    needles = (needles - needles.mean()) / needles.std()
    sparkle = torch.randn(n, n, generator=g)
    z = 0.6 * cloud + 0.7 * needles + 0.25 * sparkle
    z = (z - z.mean()) / z.std()
    mean, std = (torch.tensor(v).view(3, 1, 1) for v in FROST_STATS[index])
    return (mean + std * z).clamp(0.0, 1.0)


def frost_texture(index: int, zoom: float, min_side: int) -> torch.Tensor:
    """Texture ``index`` resampled by ``zoom`` (area-averaged), at least ``min_side`` wide."""
    base = _frost_base(index)
    side = max(min_side, int(round(FROST_BASE * zoom)))
    if side == FROST_BASE:
        return base
    return F.interpolate(base[None], size=(side, side), mode="bilinear", antialias=True)[0]


@lru_cache(maxsize=8)
def _frost_stack(
    zoom: float, min_side: int, channels: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """All ``frost_texture``s at one scale, ``[5, channels, S, S]`` (grey for 1 channel)."""
    tex = torch.stack([frost_texture(i, zoom, min_side) for i in range(len(FROST_STATS))])
    if channels == 1:
        tex = rgb_to_gray(tex)
    return tex.to(device, dtype).contiguous()


def frost(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """``clip(a * x + b * texture_crop)``: one of five synthetic frost textures per sample,
    randomly cropped (texture scale as the table's reference; see ``FROST_ZOOM``)."""
    check_images("frost", images)
    a, b = severity_param("frost", FROST, table, severity)
    c, h, w = images.shape[1:]
    zoom = FROST_ZOOM[table] * spatial_scale(table, images)
    draws = generator.uniform(3)
    tex = _frost_stack(zoom, max(h, w), c, images.device, images.dtype)
    # The same float32 arithmetic as indexing a Python list with int(u * n).
    idx = (draws[:, 0] * len(FROST_STATS)).long()
    top = (draws[:, 1] * (tex.shape[2] - h + 1)).long()
    left = (draws[:, 2] * (tex.shape[3] - w + 1)).long()
    crops = gather_windows(tex, idx, top, left, h, w)
    return torch.add(crops.mul_(b), images, alpha=a).clamp_(0.0, 1.0)


# -- spatter ---------------------------------------------------------------------------------
def _sum3(x: torch.Tensor, dim: int, weights: tuple[float, float, float]) -> torch.Tensor:
    """``w0 * x[i] + w1 * x[i + 1] + w2 * x[i + 2]`` along ``dim`` (output 2 shorter)."""
    n = x.shape[dim]
    out = x.narrow(dim, 0, n - 2) * weights[0]
    if weights[1]:
        out.add_(x.narrow(dim, 1, n - 2), alpha=weights[1])
    return out.add_(x.narrow(dim, 2, n - 2), alpha=weights[2])


def _box3(x: torch.Tensor) -> torch.Tensor:
    """OpenCV ``blur(x, (3, 3))`` (reflect-101 border) of ``[B, 1, H, W]``, separably."""
    p = F.pad(x, (1, 1, 1, 1), mode="reflect")
    return _sum3(_sum3(p, -1, (1.0, 1.0, 1.0)), -2, (1.0, 1.0, 1.0)).div_(9.0)


def _mask(op, a: torch.Tensor, b: torch.Tensor | float) -> torch.Tensor:
    """``op(a, b)`` (a torch comparison) as a 0/1 tensor of ``a``'s (numeric) dtype: on CPU,
    comparisons into numeric outputs and arithmetic on them run several times faster than
    with bool tensors (and ``torch.where`` is slower still)."""
    return op(a, b, out=torch.empty(a.shape, dtype=a.dtype, device=a.device))


def _dilate3(x: torch.Tensor) -> torch.Tensor:
    """3x3 dilation of a float 0/1 ``[B, 1, H, W]`` (zero border), separably: in-place
    maxima with each shifted neighbour on a copy (no padded buffer to fill; ``max_pool2d``
    is far slower on CPU)."""
    row = x.clone()
    torch.maximum(row[..., 1:], x[..., :-1], out=row[..., 1:])
    torch.maximum(row[..., :-1], x[..., 1:], out=row[..., :-1])
    out = row.clone()
    torch.maximum(out[..., 1:, :], row[..., :-1, :], out=out[..., 1:, :])
    torch.maximum(out[..., :-1, :], row[..., 1:, :], out=out[..., :-1, :])
    return out


def _canny(u8: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """OpenCV-style Canny edges of 8-bit values ``[B, 1, H, W]`` (float) as a 0/1 map
    (int16): 3x3 Sobel (replicated border), L1 magnitude, non-maximum suppression along
    the quantised gradient direction, hysteresis by 8-connected growth from strong into
    weak pixels (see ``_hysteresis``). Equal to ``cv2.Canny`` (tests).

    Everything is exact in int16 (gradients of 8-bit values stay within +-2040), which
    halves the memory traffic of float32; masks are 0/1 numbers and selections
    arithmetic (see ``_mask``)."""
    p = F.pad(u8, (1, 1, 1, 1), mode="replicate").to(torch.int16)
    # Separable Sobel: derivative [-1, 0, 1] along one axis, smoothing [1, 2, 1] along the other.
    d = p[..., 2:] - p[..., :-2]
    gx = torch.add(d[..., :-2, :], d[..., 2:, :]).add_(d[..., 1:-1, :], alpha=2)
    sm = torch.add(p[..., :-2], p[..., 2:]).add_(p[..., 1:-1], alpha=2)
    gy = sm[..., 2:, :] - sm[..., :-2, :]
    ax, ay = gx.abs(), gy.abs()
    mag = ax + ay
    mp = F.pad(mag, (1, 1, 1, 1))

    def nb(dy: int, dx: int) -> torch.Tensor:
        h, w = mag.shape[-2:]
        return mp[..., 1 + dy : 1 + dy + h, 1 + dx : 1 + dx + w]

    # Direction tests in float32 (the integers are exact there; tan 22.5 is irrational).
    tan22, tan67 = 0.4142135623730951, 2.414213562373095
    horiz = _mask(torch.lt, ay, ax * tan22)
    vert = _mask(torch.gt, ay, ax * tan67)  # exclusive with horiz
    # Magnitudes are integers, so ``mag >= n`` is ``mag > n - 1``: each direction's test
    # is ``mag`` above the larger of its two (adjusted) neighbours; the direction's bound is
    # selected first (arithmetic selects), so one comparison decides every pixel.
    bound_h = torch.maximum(nb(0, -1), nb(0, 1) - 1)
    bound_v = torch.maximum(nb(-1, 0), nb(1, 0) - 1)
    bound = torch.maximum(nb(-1, -1), nb(1, 1))  # gx * gy >= 0
    neg = torch.maximum(nb(-1, 1), nb(1, -1)).sub_(bound)  # gx * gy < 0, relative
    # gx * gy < 0 as opposite sign bits (the product overflows int16); where either is 0
    # the pixel is horizontal or vertical (or has no gradient), so the choice is unused.
    bound.addcmul_(_mask(torch.lt, gx.bitwise_xor_(gy), 0), neg)
    bound.addcmul_(horiz, bound_h.sub_(bound)).addcmul_(vert, bound_v.sub_(bound))
    weak = _mask(torch.gt, mag, bound.clamp_(min=int(low)))
    strong = weak * _mask(torch.gt, mag, high)
    return _hysteresis(weak, strong)


#: ``_hysteresis`` follows candidate pixels one by one up to this fraction of all pixels
#: (usually a few hundred per image pair); above it, whole-image dilations are cheaper.
SPARSE_HYSTERESIS = 1.0 / 64


def _hysteresis(weak: torch.Tensor, strong: torch.Tensor) -> torch.Tensor:
    """Canny's hysteresis on 0/1 maps ``[B, 1, H, W]`` (``strong`` within ``weak``):
    ``strong`` grown by 8-connected steps into ``weak`` pixels until nothing changes.

    Only the weak-but-not-strong pixels can change, and they are usually few: their
    positions are listed once and each round reads their 8 neighbours in a zero-bordered
    copy of the edge map and switches on the ones touching an edge (all at once, as one
    dilation step would). Many candidates fall back to whole-image dilations."""
    candidates = weak - strong
    cand = _nonzero_positions(candidates)
    if cand.numel() == 0:
        return strong
    if cand.numel() > candidates.numel() * SPARSE_HYSTERESIS:
        edges, count = strong, strong.sum()
        for _ in range(weak[0].numel()):  # the longest possible path
            # Growth only adds pixels, so an unchanged count means nothing changed.
            edges = _dilate3(edges).mul_(weak)
            grown_count = edges.sum()
            if bool(grown_count == count):
                break
            count = grown_count
        return edges
    b, _, h, w = strong.shape
    hp, wp = h + 2, w + 2
    grid = F.pad(strong, (1, 1, 1, 1))
    flat = grid.view(-1)
    img, rem = cand // (h * w), cand % (h * w)
    pos = img * (hp * wp) + (rem // w + 1) * wp + rem % w + 1
    offsets = torch.tensor(
        [-wp - 1, -wp, -wp + 1, -1, 1, wp - 1, wp, wp + 1], device=strong.device
    ).view(1, 8)
    while pos.numel():
        hit = flat[pos.view(-1, 1) + offsets].amax(1) > 0
        if not bool(hit.any()):
            break
        flat[pos[hit]] = 1
        pos = pos[~hit]
    return grid[..., 1:-1, 1:-1]


def _nonzero_positions(mask: torch.Tensor) -> torch.Tensor:
    """Flat positions of the non-zero entries of ``mask`` (rows of 128 values screened by
    their maximum first: a full-size ``nonzero`` is slow on CPU)."""
    flat = mask.reshape(-1)
    width = 128 if flat.numel() % 128 == 0 else flat.numel()
    rows = flat.view(-1, width).amax(1).nonzero().squeeze(1)
    sub = flat.view(-1, width).index_select(0, rows).nonzero()
    return rows[sub[:, 0]] * width + sub[:, 1]


def _edge_distance(edges: torch.Tensor, cap: int) -> torch.Tensor:
    """Euclidean distance to the nearest edge pixel, truncated at ``cap`` (``[B, 1, H, W]``):
    exact within the cap. Column distances by min-plus doubling (offsets 1, 2, 4, ...:
    their sums reach every distance up to the cap at its exact cost), then the minimum of
    ``col(x + dx)^2 + dx^2`` over column offsets, in int16."""
    b, _, h, w = edges.shape
    far = cap + 1
    # Column pass in a buffer with ``cap`` rows of ``far`` above and below the image, so
    # every shifted read is a plain slice (no padding per step).
    colp = torch.full((b, 1, h + 2 * cap, w), far, dtype=torch.int16, device=edges.device)
    col = colp[..., cap : cap + h, :]
    col.copy_(torch.mul(edges, -far).add_(far))
    s = 1
    while s <= cap:
        step = torch.minimum(
            colp[..., cap - s : cap - s + h, :], colp[..., cap + s : cap + s + h, :]
        )
        torch.minimum(col, step.add_(s), out=col)
        s *= 2
    col.clamp_(max=far)
    # Row pass likewise, on squared column distances with ``cap`` columns of ``far^2``.
    sqp = torch.full((b, 1, h, w + 2 * cap), far * far, dtype=torch.int16, device=edges.device)
    best = sqp[..., cap : cap + w]
    torch.mul(col, col, out=best)
    best = best.clone()
    # Offset ``cap`` itself is skipped: it can only offer distances >= cap, which the
    # truncation turns into cap, as it does every distance still above cap without it.
    for dx in range(1, cap):
        # No pixel can improve any more (checked now and then: the check is a full pass).
        if dx % 4 == 1 and dx * dx >= int(best.max()):
            break
        cand = torch.minimum(sqp[..., cap + dx : cap + dx + w], sqp[..., cap - dx : cap - dx + w])
        torch.minimum(best, cand.add_(dx * dx), out=best)
    # Truncated square roots of the integer squared distances by table look-up (sqrt of an
    # exact 0, most pixels here, is many times slower than of other values on x86 CPUs).
    dtype = edges.dtype if edges.is_floating_point() else torch.float32
    roots = _truncated_roots(far * far, cap, edges.device, dtype)
    return roots.index_select(0, best.view(-1).int()).view(best.shape)


@lru_cache(maxsize=4)
def _truncated_roots(n: int, cap: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``min(sqrt(k), cap)`` for ``k = 0..n`` (float32 roots, correctly rounded)."""
    return torch.arange(n + 1, dtype=torch.float32).sqrt_().clamp_(max=cap).to(device, dtype)


#: ImageNet-C's emboss kernel (correlation taps), applied as shifted adds: a 3x3
#: ``conv2d`` on one channel is much slower on CPU than seven slice additions.
EMBOSS = ((-2.0, -1.0, 0.0), (-1.0, 1.0, 1.0), (0.0, 1.0, 2.0))


def _emboss(padded: torch.Tensor) -> torch.Tensor:
    """Correlate a 1-pixel-padded ``[B, 1, H + 2, W + 2]`` with ``EMBOSS`` -> ``[B, 1, H, W]``."""
    h, w = padded.shape[-2] - 2, padded.shape[-1] - 2
    out = None
    for dy, row in enumerate(EMBOSS):
        for dx, wt in enumerate(row):
            if wt:
                view = padded[..., dy : dy + h, dx : dx + w]
                out = view * wt if out is None else out.add_(view, alpha=wt)
    return out


def _equalize_hist(u8: torch.Tensor) -> torch.Tensor:
    """OpenCV ``equalizeHist`` per image of integer values ``[B, 1, H, W]`` in 0..255."""
    b = u8.shape[0]
    # Values of image i index 256 * i + value: one histogram count and one table read for
    # the whole batch.
    # int32 indices (half the memory traffic of int64; bincount and index_select take them).
    offsets = torch.arange(b, device=u8.device, dtype=torch.int32).view(b, 1) * 256
    flat = u8.reshape(b, -1).int().add_(offsets)
    hist = torch.bincount(flat.view(-1), minlength=256 * b).view(b, 256).double()
    total = flat.shape[1]
    first = (hist > 0).float().argmax(dim=1, keepdim=True)
    cdf = hist.cumsum(1)
    base = cdf.gather(1, first)
    denom = (total - hist.gather(1, first)).clamp_min(1.0)
    lut = ((cdf - base) * 255.0 / denom).round().clamp(0, 255)
    lut = torch.where(torch.arange(256, device=u8.device) <= first, 0.0, lut)
    # A constant image maps to itself (OpenCV's special case).
    constant = hist.gather(1, first) == total
    lut = torch.where(constant, first.to(lut.dtype), lut)
    return lut.view(-1).to(u8.dtype).index_select(0, flat.view(-1)).view_as(u8)


def _liquid(noise: torch.Tensor, mean: float, std: float, sigma: float) -> torch.Tensor:
    """ImageNet-C's liquid layer ``gaussian(noise * std + mean, sigma)`` (edges replicated);
    the blur is linear with unit gain, so it is ``gaussian(noise, sigma) * std + mean``."""
    return gaussian_filter(noise, sigma, mode="nearest").mul_(std).add_(mean)


def _water(liquid: torch.Tensor, strength: float) -> torch.Tensor:
    """The water layer ``[B, 1, H, W]`` (float) of the thresholded ``liquid``: Canny edges
    of its 8-bit values, distance to them truncated at 20, box blur, histogram
    equalisation, emboss, box blur, times the 8-bit liquid, scaled to ``strength`` at the
    image's maximum."""
    u8 = liquid.mul(255.0).floor_()
    if bool(u8.amax() >= 256.0):
        u8.remainder_(256.0)  # the reference's uint8 cast wraps
    dist = _edge_distance(_canny(u8, 50.0, 150.0), 20)
    dist = _equalize_hist(_box3(dist).floor_())
    dist = _emboss(F.pad(dist, (1, 1, 1, 1), mode="reflect"))
    m = _box3(dist.round_().clamp_(0, 255)).mul_(u8)
    return m.mul_(strength / m.amax(dim=(2, 3), keepdim=True).clamp_min(1e-12))


@in_image_steps
def spatter(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Spatter: a blurred, thresholded liquid layer drawn as pale-turquoise water with
    embossed edges (severities with mode 0) or opaque brown mud (mode 1).

    Water follows the reference's Canny -> distance transform (truncated at 20 px) ->
    box blur -> histogram equalisation -> emboss -> box blur chain; the distance is exact
    Euclidean where OpenCV uses its 5x5 chamfer approximation.
    """
    check_images("spatter", images)
    mean, std, sigma, thresh, strength, mode = severity_param("spatter", SPATTER, table, severity)
    scale = spatial_scale(table, images)
    h, w = images.shape[-2:]
    noise = draw_batch(generator, "normal", 1, h, w).to(images.device, images.dtype)
    liquid = _liquid(noise, mean, std, sigma * scale)
    if mode == 0:
        liquid.mul_(_mask(torch.ge, liquid, thresh))  # below the threshold: 0
        m = _water(liquid, strength)
        color = torch.tensor([175.0, 238.0, 238.0], device=images.device, dtype=images.dtype)
        color = color[: images.shape[1]].view(1, -1, 1, 1) / 255.0
        return torch.addcmul(images, m, color).clamp_(0.0, 1.0)
    m = gaussian_filter(_mask(torch.gt, liquid, thresh), strength * scale, mode="nearest")
    m.mul_(_mask(torch.ge, m, 0.8))  # below 0.8: 0
    mud = torch.tensor([63.0, 42.0, 20.0], device=images.device, dtype=images.dtype)
    mud = mud[: images.shape[1]].view(1, -1, 1, 1) / 255.0
    # images * (1 - m) + mud * m
    return torch.sub(mud, images).mul_(m).add_(images).clamp_(0.0, 1.0)
