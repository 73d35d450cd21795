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
from mura_plugin.shifts._params import check_images, severity_param, severity_table, spatial_scale
from mura_plugin.shifts._spatter_ops import (  # noqa: F401 - tests read them here
    EMBOSS,
    SPARSE_HYSTERESIS,
    _box3,
    _canny,
    _dilate3,
    _edge_distance,
    _emboss,
    _equalize_hist,
    _mask,
)
from mura_plugin.shifts.blur import motion_filter
from tta_bench.buffers import batch_buffer, buffer_like
from tta_bench.rng import SampleGenerator

__all__ = ["fog", "snow", "frost", "spatter", "plasma_fractal", "frost_texture"]

# Severity tables, table name -> parameters of severities 1..5 (``severities.json``).
#: (fog strength, plasma-fractal wibble decay).
FOG = severity_table("fog")
#: (grain mean, grain std, grain zoom, threshold, blur radius, blur sigma, image weight).
SNOW = severity_table("snow")
#: (image weight, frost weight).
FROST = severity_table("frost")
#: Frost texture pixels per image pixel at the table's native size: ImageNet-C crops the
#: photographs at full resolution, CIFAR-10-C first shrinks them by 0.2.
FROST_ZOOM = {"cifar": 0.2, "imagenet": 1.0, "digits": 0.2}
#: (liquid mean, liquid std, liquid blur sigma, threshold, strength or mud blur, mode) with
#: mode 0 = water, 1 = mud.
SPATTER = severity_table("spatter")


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
    out = batch_buffer((len(generator), h * w))
    return out.copy_(picked.t()).view(-1, h, w)  # a 2-D transpose: torch's blocked copy


def fog_blend(images: torch.Tensor, pattern: torch.Tensor, strength: float) -> torch.Tensor:
    """Add ``strength * pattern [B, H, W]`` and rescale by ``max / (max + strength)``."""
    max_val = images.amax(dim=(1, 2, 3), keepdim=True)
    x = torch.add(
        images,
        pattern.unsqueeze(1).to(images),
        alpha=strength,
        out=buffer_like(images),
    )
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
@in_image_steps
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


@in_image_steps
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
