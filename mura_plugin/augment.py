"""Batched view augmentation for the multi-view methods (TPT, TTL, MuRA, ZERO, TDA).

All views of all samples are drawn at once from the method's own ``torch.Generator`` (seeded
by the runner per batch), so they are reproducible and cheap:

* ``crop_boxes`` draws crop boxes exactly as torchvision's ``RandomResizedCrop.get_params``
  does (area fraction uniform in ``scale``, log aspect ratio uniform in ``log(ratio)``, width
  and height rounded to whole pixels, up to 10 attempts per view until the box fits, then the
  centre-crop fallback with the aspect ratio clamped to ``ratio``), vectorised over views.
* ``random_resized_crops`` cuts those boxes (optionally mirrored, as RandomHorizontalFlip
  after the crop) and resizes them back to ``H x W`` with one bilinear ``grid_sample``.
  Differences from torchvision/PIL: no antialiasing (it only acts when a crop is *shrunk*;
  crops of an image already at the model's size are never shrunk, so it changes nothing
  here), at a crop's inner edges the bilinear taps may read the neighbouring pixel outside
  the box (torchvision crops first, so it repeats the box's edge pixel), and values stay
  float (PIL rounds each view to 8 bits).
* ``random_rotations`` (``make_views(rotate_degrees=d)``, off by default) rotates each view
  about its centre by an angle uniform in ``[-d, d]`` degrees, as torchvision's
  ``RandomAffine(degrees=d)`` (rotation only) after the crop: a second bilinear
  ``grid_sample`` with torchvision's tensor ``rotate`` geometry and its ``fill=0`` rule
  (zero outside the view, edge pixels weighted by the interpolated coverage), so it equals
  ``transforms.functional.rotate(view, angle, BILINEAR, fill=0)``. ``RandomAffine``'s own
  default interpolation is nearest; views here are bilinear, as the crops.
* ``augmix`` is the AugMix of TPT's and TDA's ``AugMixAugmenter`` (data/augmix_ops.py of
  azshue/TPT and kdiAAA/TDA): 3 chains of 1-3 operations drawn from 9 PIL operations
  (autocontrast, equalize, posterize, rotate, solarize, shear_x, shear_y, translate_x,
  translate_y) at severity 1, mixed with Dirichlet(1, 1, 1) weights, then blended with the
  crop by m ~ Beta(1, 1). torchvision's ``AugMix`` (all_ops=False) has the same 9
  operations and mixing but draws each magnitude from 11 discrete bins (severity 1 always
  gives bin 0: no rotation, shear or translation) instead of the official continuous
  ``level ~ U(0.1, severity)`` out of 10, so the operations are written here, on 8-bit
  values with PIL's formulas (per-band histograms, look-up tables, and PIL's affine sampler:
  pixel-centre coordinates, bilinear taps clamped to the image, black outside);
  ``tests/test_augment.py`` compares each one with PIL. Translations scale with the image
  (the official ``IMAGE_SIZE / 3`` with IMAGE_SIZE = its 224 px input).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "AUGMIX_OPS",
    "AugMixDraws",
    "ViewPlan",
    "apply_augmix",
    "augmix",
    "augmix_draws",
    "crop_boxes",
    "crop_thetas",
    "make_views",
    "plan_views",
    "random_resized_crops",
    "random_rotations",
    "render_crops",
    "render_views",
    "rotate",
    "rotation_angles",
]

_ATTEMPTS = 10  # torchvision's RandomResizedCrop.get_params


def crop_boxes(
    n: int,
    height: int,
    width: int,
    generator: torch.Generator,
    *,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(top, left, h, w)``, int64 ``[n]`` each: ``n`` independent draws of torchvision's
    ``RandomResizedCrop.get_params`` on a ``height x width`` image (see the module docstring)."""
    if not 0.0 < scale[0] <= scale[1]:
        raise ValueError(f"scale must satisfy 0 < min <= max, got {scale}")
    if not 0.0 < ratio[0] <= ratio[1]:
        raise ValueError(f"ratio must satisfy 0 < min <= max, got {ratio}")
    f64 = torch.float64
    area = torch.empty(n, _ATTEMPTS, dtype=f64).uniform_(scale[0], scale[1], generator=generator)
    log_r = torch.empty(n, _ATTEMPTS, dtype=f64).uniform_(
        math.log(ratio[0]), math.log(ratio[1]), generator=generator
    )
    target, aspect = area * (height * width), log_r.exp()
    w = (target * aspect).sqrt().round()  # torch.round, like Python's round: half to even
    h = (target / aspect).sqrt().round()
    fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    first = fits.to(torch.uint8).argmax(dim=1, keepdim=True)  # the first attempt that fits
    w, h = w.gather(1, first)[:, 0].long(), h.gather(1, first)[:, 0].long()
    found = fits.any(dim=1)
    # the fallback: a centre crop of the whole image, its aspect ratio clamped to ``ratio``
    in_ratio = width / height
    if in_ratio < ratio[0]:
        fw, fh = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        fw, fh = int(round(height * ratio[1])), height
    else:
        fw, fh = width, height
    w = torch.where(found, w, fw)
    h = torch.where(found, h, fh)
    u_top = torch.rand(n, dtype=f64, generator=generator)
    u_left = torch.rand(n, dtype=f64, generator=generator)
    top = torch.where(found, (u_top * (height - h + 1)).floor().long(), (height - fh) // 2)
    left = torch.where(found, (u_left * (width - w + 1)).floor().long(), (width - fw) // 2)
    return top, left, h, w


def crop_thetas(
    n: int,
    height: int,
    width: int,
    generator: torch.Generator,
    *,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    flip: bool = False,
) -> torch.Tensor:
    """``[n, 2, 3]`` float64 ``affine_grid`` matrices of ``n`` random resized crops of a
    ``height x width`` image (boxes from ``crop_boxes``; then, when ``flip``, one draw per
    crop mirrors it with probability 1/2): the random part of ``random_resized_crops``."""
    top, left, ch, cw = crop_boxes(n, height, width, generator, scale=scale, ratio=ratio)
    # affine_grid maps output [-1, 1] coordinates onto the box (align_corners=False: pixel
    # edges at -1 and 1), so output pixel centres sample the box like a resize of the crop
    sx, sy = cw.double() / width, ch.double() / height
    cx = (2 * left + cw).double() / width - 1
    cy = (2 * top + ch).double() / height - 1
    if flip:
        sx = torch.where(torch.rand(n, generator=generator) < 0.5, -sx, sx)
    theta = torch.zeros(n, 2, 3, dtype=torch.float64)
    theta[:, 0, 0], theta[:, 0, 2] = sx, cx
    theta[:, 1, 1], theta[:, 1, 2] = sy, cy
    return theta


def render_crops(images: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """``[V, B, C, H, W]`` crops of ``images [B, C, H, W]`` by the view-major matrices
    ``theta [V * B, 2, 3]`` (``crop_thetas``), resized to ``H x W`` by one bilinear
    ``grid_sample``. Each output depends on its own image and matrix only."""
    b, c, h, w = images.shape
    n = theta.shape[0]
    theta = theta.to(images.device, images.dtype)
    src = images.unsqueeze(0).expand(n // b, b, c, h, w).reshape(n, c, h, w)
    grid = F.affine_grid(theta, [n, c, h, w], align_corners=False)
    out = F.grid_sample(src, grid, mode="bilinear", padding_mode="border", align_corners=False)
    return out.view(n // b, b, c, h, w)


def random_resized_crops(
    images: torch.Tensor,
    n_views: int,
    generator: torch.Generator,
    *,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    flip: bool = False,
) -> torch.Tensor:
    """``[V, B, C, H, W]`` random resized crops of ``images [B, C, H, W]`` (boxes from
    ``crop_boxes``; mirrored with probability 1/2 when ``flip``), each resized back to
    ``H x W`` bilinearly. View-major: view ``v`` of sample ``b`` is draw ``v * B + b``."""
    b, _, h, w = images.shape
    theta = crop_thetas(n_views * b, h, w, generator, scale=scale, ratio=ratio, flip=flip)
    return render_crops(images, theta)


def rotate(images: torch.Tensor, degrees: torch.Tensor) -> torch.Tensor:
    """``images [N, C, H, W]`` each rotated counter-clockwise by ``degrees [N]`` about its
    centre, bilinearly, zero outside: torchvision's ``functional.rotate(img, angle,
    InterpolationMode.BILINEAR, fill=0)`` on tensors (pixel-centre grid in pixel units, so
    non-square images rotate without shearing; the sampled image is multiplied by the
    sampled coverage of an all-ones channel, as torchvision applies ``fill``)."""
    n, c, h, w = images.shape
    rad = degrees.to(torch.float64).cpu() * (math.pi / 180)
    cos, sin = rad.cos(), rad.sin()
    # source = R(-angle) . output in centred pixel coordinates (y down), written in
    # affine_grid's normalised coordinates (x / (w / 2), y / (h / 2))
    theta = torch.zeros(n, 2, 3, dtype=torch.float64)
    theta[:, 0, 0], theta[:, 0, 1] = cos, -sin * (h / w)
    theta[:, 1, 0], theta[:, 1, 1] = sin * (w / h), cos
    theta = theta.to(images.device, images.dtype)
    grid = F.affine_grid(theta, [n, c + 1, h, w], align_corners=False)
    ones = torch.ones(n, 1, h, w, dtype=images.dtype, device=images.device)
    out = F.grid_sample(
        torch.cat([images, ones], dim=1),
        grid,
        mode="bilinear",
        padding_mode="zeros",
        align_corners=False,
    )
    return out[:, :c] * out[:, c:]


def rotation_angles(n: int, degrees: float, generator: torch.Generator) -> torch.Tensor:
    """``[n]`` float64 angles uniform in ``[-degrees, degrees]`` (the draws of
    ``random_rotations``)."""
    if degrees < 0:
        raise ValueError(f"degrees must be >= 0, got {degrees}")
    return torch.empty(n, dtype=torch.float64).uniform_(-degrees, degrees, generator=generator)


def random_rotations(
    images: torch.Tensor, degrees: float, generator: torch.Generator
) -> torch.Tensor:
    """``images [N, C, H, W]`` each rotated by its own angle uniform in ``[-degrees, degrees]``
    (float64 draws from ``generator``, one per image in order): ``RandomAffine(degrees)``
    with rotation only (see ``rotate``)."""
    return rotate(images, rotation_angles(images.shape[0], degrees, generator))


# -- AugMix ------------------------------------------------------------------------------
# Each operation takes 8-bit values as floats ``x [n, C, H, W]`` in 0..255, the per-image
# level ``level [n]`` (float64, U(0.1, severity)) and random sign ``neg [n]`` (bool), and
# returns 8-bit values; the level -> parameter rules are the official ``int_parameter``
# (truncated ``level * maxval / 10``) and ``float_parameter`` (``level * maxval / 10``).


def _autocontrast(x: torch.Tensor, level: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    lo = x.amin(dim=(2, 3)).double().unsqueeze(-1)  # [n, C, 1]
    hi = x.amax(dim=(2, 3)).double().unsqueeze(-1)
    scale = 255.0 / (hi - lo).clamp_min(1.0)
    values = torch.arange(256, dtype=torch.float64, device=x.device)
    lut = (values * scale - lo * scale).floor().clamp(0, 255)  # PIL: int(ix * scale + offset)
    lut = torch.where(hi > lo, lut, values).to(x.dtype)  # hi <= lo: PIL leaves the band as is
    return lut.gather(2, x.flatten(2).long()).view_as(x)


def _equalize(x: torch.Tensor, level: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    n, c = x.shape[:2]
    values = x.flatten(2).long()  # [n, C, HW]
    hist = torch.zeros(n, c, 256, dtype=torch.long, device=x.device)
    hist.scatter_add_(2, values, torch.ones_like(values))
    last = hist.gather(2, values.amax(dim=2, keepdim=True))  # count of the highest value
    step = (values.shape[2] - last) // 255  # [n, C, 1]
    before = hist.cumsum(dim=2) - hist  # pixels below each value
    lut = ((step // 2 + before) // step.clamp_min(1)).clamp_max(255)
    identity = ((hist > 0).sum(dim=2, keepdim=True) <= 1) | (step == 0)
    y = lut.gather(2, values).to(x.dtype).view_as(x)
    return torch.where(identity.unsqueeze(-1), x, y)


def _posterize(x: torch.Tensor, level: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    bits = 4 - (level * 4 / 10).floor()  # ImageOps.posterize(img, 4 - int_parameter(level, 4))
    step = (2.0 ** (8 - bits)).to(x.dtype).view(-1, 1, 1, 1)
    return torch.div(x, step, rounding_mode="floor") * step


def _solarize(x: torch.Tensor, level: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    threshold = (256 - (level * 256 / 10).floor()).to(x.dtype).view(-1, 1, 1, 1)
    return torch.where(x < threshold, x, 255 - x)


def _rotate(x: torch.Tensor, level: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    degrees = (level * 30 / 10).floor() * torch.where(neg, -1.0, 1.0).double()
    h, w = x.shape[-2:]
    # PIL's Image.rotate(deg): inverse matrix about the centre, entries rounded to 15 digits
    # (computed per distinct whole angle with Python floats, as PIL does)
    matrices = torch.empty(len(x), 6, dtype=torch.float64)
    for deg in degrees.unique().tolist():
        a = -math.radians(deg)
        m = [round(math.cos(a), 15), round(math.sin(a), 15), 0.0]
        m += [round(-math.sin(a), 15), round(math.cos(a), 15), 0.0]
        cx, cy = w / 2.0, h / 2.0
        m[2] = m[0] * -cx + m[1] * -cy + cx
        m[5] = m[3] * -cx + m[4] * -cy + cy
        matrices[degrees.cpu() == deg] = torch.tensor(m, dtype=torch.float64)
    out = _pil_affine(x, matrices.to(x.device))
    return torch.where((degrees == 0).view(-1, 1, 1, 1), x, out)  # PIL: angle 0 is a copy


def _shear(axis: int) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    def op(x: torch.Tensor, level: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        s = level * 0.3 / 10 * torch.where(neg, -1.0, 1.0).double()
        m = torch.zeros(len(x), 6, dtype=torch.float64, device=x.device)
        m[:, 0] = m[:, 4] = 1.0
        m[:, 1 if axis == 0 else 3] = s  # (1, s, 0, 0, 1, 0) or (1, 0, 0, s, 1, 0)
        return _pil_affine(x, m)

    op.__name__ = "shear_x" if axis == 0 else "shear_y"
    return op


def _translate(axis: int) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    def op(x: torch.Tensor, level: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        # PIL's affine (1, 0, t, 0, 1, 0) or (1, 0, 0, 0, 1, t) by a whole number of
        # pixels t: output pixel i reads the input's pixel centre i + t exactly (weights 0
        # and 1), black where that lies outside. A copy of the overlapping window.
        size = x.shape[-1] if axis == 0 else x.shape[-2]
        t = (level * (size / 3) / 10).floor() * torch.where(neg, -1.0, 1.0).double()
        out = torch.zeros_like(x)
        for i, shift in enumerate(t.long().tolist()):
            lo, hi = max(0, -shift), min(size, size - shift)
            if lo >= hi:
                continue
            if axis == 0:
                out[i, :, :, lo:hi] = x[i, :, :, lo + shift : hi + shift]
            else:
                out[i, :, lo:hi] = x[i, :, lo + shift : hi + shift]
        return out

    op.__name__ = "translate_x" if axis == 0 else "translate_y"
    return op


#: Values of the largest temporary one step of AugMix works on (``apply_augmix``'s chains,
#: ``_pil_affine``'s float64 taps): the batch is taken a few images at a time (one at
#: least), so the temporary memory is bounded whatever the batch and each step reuses the
#: memory the previous one released (on this project's CPU, a 224 px batch in one piece
#: ran rotations 8x slower: every call faulted in fresh pages for its temporaries).
STEP_ELEMENTS = 1 << 19


def _pil_affine(x: torch.Tensor, matrices: torch.Tensor) -> torch.Tensor:
    """PIL's ``Image.transform(size, AFFINE, (a, b, c, d, e, f), BILINEAR)`` of 8-bit values
    ``x [n, C, H, W]`` with per-image matrices ``[n, 6]``: output pixel (x, y) reads the input
    at ``(a X + b Y + c, d X + e Y + f)``, ``X = x + 0.5``, ``Y = y + 0.5``; black where that
    point lies outside the image, else bilinear taps clamped to the image, truncated to 8 bits.

    Coordinates and weights are float64, as PIL's, computed once per distinct matrix (a
    rotation of AugMix takes one of 4 whole angles) and shared by the images that have it.
    Taps whose weight is exactly 0 everywhere are skipped (a shear moves whole rows or
    columns: one axis has no fractional offset), which leaves the values as they are. The
    images are taken a few at a time (``STEP_ELEMENTS``)."""
    n, c, h, w = x.shape
    out = torch.empty_like(x)
    step = max(1, STEP_ELEMENTS // (c * h * w))
    distinct, which = torch.unique(matrices.cpu(), dim=0, return_inverse=True)
    for u, m in enumerate(distinct.tolist()):
        plan = _affine_taps(m, h, w, x.device)
        rows = (which == u).nonzero()[:, 0].to(x.device)
        for s in range(0, len(rows), step):
            sel = rows[s : s + step]
            out[sel] = _apply_taps(x[sel].flatten(2), plan).view(-1, c, h, w).to(x.dtype)
    return out


def _affine_taps(m: list[float], h: int, w: int, device: torch.device) -> dict:
    """Where each output pixel of PIL's affine ``m`` reads (``_pil_affine``): tap indices
    into the flattened image, float64 weights (None where 0 everywhere) and the inside mask."""
    xs = torch.arange(w, dtype=torch.float64, device=device) + 0.5
    ys = torch.arange(h, dtype=torch.float64, device=device)[:, None] + 0.5
    xin = m[0] * xs + m[1] * ys + m[2]  # [H, W]
    yin = m[3] * xs + m[4] * ys + m[5]
    inside = ((xin >= 0) & (xin < w) & (yin >= 0) & (yin < h)).flatten()
    xin, yin = xin - 0.5, yin - 0.5
    x0, y0 = xin.floor(), yin.floor()
    dx, dy = (xin - x0).flatten(), (yin - y0).flatten()
    xa, xb = x0.clamp(0, w - 1).long().flatten(), (x0 + 1).clamp(0, w - 1).long().flatten()
    ya, yb = y0.clamp(0, h - 1).long().flatten() * w, (y0 + 1).clamp(0, h - 1).long().flatten() * w
    wx = dx if bool((dx != 0).any()) else None
    wy = dy if bool((dy != 0).any()) else None
    taps = [ya + xa]
    if wx is not None:
        taps.append(ya + xb)
    if wy is not None:
        taps += [yb + xa] + ([yb + xb] if wx is not None else [])
    return {"taps": taps, "wx": wx, "wy": wy, "inside": inside}


def _apply_taps(img: torch.Tensor, plan: dict) -> torch.Tensor:
    """The bilinear values ``[k, C, HW]`` of ``img [k, C, HW]`` by ``_affine_taps``' plan,
    PIL's order of operations (the row's two taps, then between rows), truncated, black
    outside."""
    k, c, hw = img.shape
    img = img.double()

    def tap(index: torch.Tensor) -> torch.Tensor:
        return img.gather(2, index.view(1, 1, hw).expand(k, c, hw))

    taps, wx, wy = list(plan["taps"]), plan["wx"], plan["wy"]
    value = tap(taps.pop(0))
    if wx is not None:
        value = value + (tap(taps.pop(0)) - value) * wx
    if wy is not None:
        bottom = tap(taps.pop(0))
        if wx is not None:
            bottom = bottom + (tap(taps.pop(0)) - bottom) * wx
        value = value + (bottom - value) * wy
    return torch.where(plan["inside"], value.floor_().clamp_(0, 255), 0.0)


#: The official ``augmentations`` list, in its order (the index an op is drawn by).
AUGMIX_OPS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "autocontrast": _autocontrast,
    "equalize": _equalize,
    "posterize": _posterize,
    "rotate": _rotate,
    "solarize": _solarize,
    "shear_x": _shear(0),
    "shear_y": _shear(1),
    "translate_x": _translate(0),
    "translate_y": _translate(1),
}


@dataclass(frozen=True)
class AugMixDraws:
    """The random draws of ``augmix`` for ``n`` images: Dirichlet mixing weights
    ``weights [n, width]`` (float32), the blend ``m [n]`` (float32), and per chain and
    image the chain length ``depth [width, n]``, operation indices ``ops``, levels
    ``levels`` (float64) and signs ``negative``, each ``[width, n, max_depth]``."""

    weights: torch.Tensor
    m: torch.Tensor
    depth: torch.Tensor
    ops: torch.Tensor
    levels: torch.Tensor
    negative: torch.Tensor

    def select(self, index: torch.Tensor) -> AugMixDraws:
        """The draws of images ``index`` (int64 ``[k]``), in that order."""
        return AugMixDraws(
            self.weights[index],
            self.m[index],
            self.depth[:, index],
            self.ops[:, index],
            self.levels[:, index],
            self.negative[:, index],
        )


def augmix_draws(
    n: int,
    generator: torch.Generator,
    *,
    severity: float = 1.0,
    width: int = 3,
    max_depth: int = 3,
) -> AugMixDraws:
    """The draws of ``augmix`` for ``n`` images, in the order ``augmix`` makes them."""
    if severity < 0.1:
        raise ValueError(f"severity must be >= 0.1 (levels are U(0.1, severity)), got {severity}")
    k = len(AUGMIX_OPS)
    u = 1.0 - torch.rand(n, width, dtype=torch.float64, generator=generator)  # (0, 1]
    weights = -u.log()
    weights = (weights / weights.sum(dim=1, keepdim=True)).float()  # Dirichlet(1, ..., 1)
    m = torch.rand(n, generator=generator).float()  # Beta(1, 1)
    depth = torch.randint(1, max_depth + 1, (width, n), generator=generator)
    ops = torch.randint(0, k, (width, n, max_depth), generator=generator)
    levels = torch.empty(width, n, max_depth, dtype=torch.float64).uniform_(
        0.1, severity, generator=generator
    )
    negative = torch.rand(width, n, max_depth, generator=generator) > 0.5
    return AugMixDraws(weights, m, depth, ops, levels, negative)


def apply_augmix(images: torch.Tensor, draws: AugMixDraws) -> torch.Tensor:
    """AugMix of ``images [N, C, H, W]`` in [0, 1] with the draws ``draws`` (one per image,
    ``augmix_draws``): image ``i``'s output depends on image ``i`` and its draws only, so
    the images are taken a few at a time (``STEP_ELEMENTS`` values of chains per step)."""
    n = images.shape[0]
    width = draws.ops.shape[0]
    step = max(1, STEP_ELEMENTS // (width * images[0].numel()))
    if n <= step:
        return _augmix_step(images, draws)
    out = torch.empty_like(images)
    for s in range(0, n, step):
        rows = torch.arange(s, min(n, s + step))
        out[s : s + step] = _augmix_step(images[s : s + step], draws.select(rows))
    return out


def _augmix_step(images: torch.Tensor, draws: AugMixDraws) -> torch.Tensor:
    """``apply_augmix`` of one step's images."""
    n = images.shape[0]
    dev = images.device
    width, max_depth = draws.ops.shape[0], draws.ops.shape[2]
    x8 = (images.float() * 255).round().clamp(0, 255)
    chains = x8.unsqueeze(0).repeat(width, 1, 1, 1, 1).flatten(0, 1)  # [width * N, ...]
    depth, ops = draws.depth.flatten(), draws.ops.flatten(0, 1)
    levels, negative = draws.levels.flatten(0, 1), draws.negative.flatten(0, 1)
    for step in range(max_depth):
        for index, op in enumerate(AUGMIX_OPS.values()):
            rows = ((depth > step) & (ops[:, step] == index)).nonzero()[:, 0]
            if len(rows):
                on = rows.to(dev)
                chains[on] = op(
                    chains[on], levels[rows, step].to(dev), negative[rows, step].to(dev)
                )
    chains = chains.view(width, n, *images.shape[1:]) / 255
    mix = torch.einsum("wn,wnchx->nchx", draws.weights.t().to(dev), chains)
    m = draws.m.to(dev).view(-1, 1, 1, 1)
    return (m * (x8 / 255) + (1 - m) * mix).to(images.dtype)


def augmix(
    images: torch.Tensor,
    generator: torch.Generator,
    *,
    severity: float = 1.0,
    width: int = 3,
    max_depth: int = 3,
) -> torch.Tensor:
    """AugMix of each image of ``images [N, C, H, W]`` in [0, 1] (the official
    ``augmix(image, preprocess, augmentations, severity=1)``, see the module docstring):
    the image is taken to 8 bits, ``width`` chains each apply 1..``max_depth`` operations
    drawn uniformly from ``AUGMIX_OPS`` (level ~ U(0.1, ``severity``), random sign for the
    geometric ones), and the result is ``m x + (1 - m) sum_i w_i chain_i(x)`` with
    ``w ~ Dirichlet(1, ..., 1)``, ``m ~ Beta(1, 1)``; same shape and dtype as ``images``."""
    draws = augmix_draws(
        images.shape[0], generator, severity=severity, width=width, max_depth=max_depth
    )
    return apply_augmix(images, draws)


@dataclass(frozen=True)
class ViewPlan:
    """Every random draw of ``make_views`` for a batch of ``batch`` images, made up front
    (``plan_views``) so that the views of any subset of the images can be rendered later
    (``render_views``), chunk by chunk, with the values the whole batch would get.
    Per crop, view-major (view ``v`` of sample ``b`` is row ``v * batch + b``): the crop
    matrices ``theta [n_views * batch, 2, 3]`` (float64), rotation ``angles`` (float64, or
    None) and ``augmix`` draws (or None)."""

    batch: int
    n_views: int
    include_original: bool
    theta: torch.Tensor
    angles: torch.Tensor | None
    augmix: AugMixDraws | None

    @property
    def views(self) -> int:
        """Views per image: the crops, plus the original when it is included."""
        return self.n_views + int(self.include_original)

    def rows(self, rows: slice) -> ViewPlan:
        """The plan of samples ``rows`` only (a batch of ``len(rows)`` images)."""
        samples = torch.arange(self.batch)[rows]
        index = (torch.arange(self.n_views)[:, None] * self.batch + samples).flatten()
        return ViewPlan(
            batch=len(samples),
            n_views=self.n_views,
            include_original=self.include_original,
            theta=self.theta[index],
            angles=None if self.angles is None else self.angles[index],
            augmix=None if self.augmix is None else self.augmix.select(index),
        )


def plan_views(
    batch: int,
    height: int,
    width: int,
    n_views: int,
    generator: torch.Generator,
    *,
    include_original: bool = True,
    scale: tuple[float, float] = (0.08, 1.0),
    flip: bool = True,
    augmix_views: bool = False,
    rotate_degrees: float = 0.0,
) -> ViewPlan:
    """The draws of ``make_views`` on a batch of ``batch`` images of ``height x width``,
    in its order: the crops (boxes, then flips), then the rotations (when
    ``rotate_degrees > 0``), then the AugMix draws (when ``augmix_views``)."""
    if n_views < 0 or (n_views == 0 and not include_original):
        raise ValueError(
            f"need at least one view: n_views={n_views}, include_original={include_original}"
        )
    n = n_views * batch
    if n == 0:  # nothing is drawn
        return ViewPlan(
            batch, 0, include_original, torch.zeros(0, 2, 3, dtype=torch.float64), None, None
        )
    theta = crop_thetas(n, height, width, generator, scale=scale, flip=flip)
    angles = rotation_angles(n, rotate_degrees, generator) if rotate_degrees > 0 else None
    mix = augmix_draws(n, generator) if augmix_views else None
    return ViewPlan(batch, n_views, include_original, theta, angles, mix)


def render_views(images: torch.Tensor, plan: ViewPlan) -> torch.Tensor:
    """``[V, B, C, H, W]`` views of ``images [B, C, H, W]`` by ``plan`` (``plan_views``, or
    ``plan.rows(...)`` for these images of a larger batch): the original first (when
    included), then the crops, rotated and AugMix-ed as planned."""
    if images.shape[0] != plan.batch:
        raise ValueError(f"the plan is for {plan.batch} images, got {images.shape[0]}")
    parts = [images.unsqueeze(0)] if plan.include_original else []
    if plan.n_views > 0:
        crops = render_crops(images, plan.theta)
        if plan.angles is not None:
            crops = rotate(crops.flatten(0, 1), plan.angles).view_as(crops)
        if plan.augmix is not None:
            crops = apply_augmix(crops.flatten(0, 1), plan.augmix).view_as(crops)
        parts.append(crops)
    return torch.cat(parts, dim=0)


def make_views(
    images: torch.Tensor,
    n_views: int,
    generator: torch.Generator,
    *,
    include_original: bool = True,
    scale: tuple[float, float] = (0.08, 1.0),
    flip: bool = True,
    augmix_views: bool = False,
    rotate_degrees: float = 0.0,
) -> torch.Tensor:
    """``[V, B, C, H, W]``: the original images first (when ``include_original``), then
    ``n_views`` random resized crops (TPT's preprocessing: RandomResizedCrop + horizontal
    flip), each rotated by an angle uniform in ``[-rotate_degrees, rotate_degrees]`` when
    ``rotate_degrees > 0`` (``random_rotations``: RandomAffine after the crop; 0 draws
    nothing), then AugMix-ed when ``augmix_views`` (TPT/TDA's ``AugMixAugmenter`` with
    ``augmix=True``). At least one view is required. The same as ``render_views(images,
    plan_views(...))``."""
    b, _, h, w = images.shape
    plan = plan_views(
        b,
        h,
        w,
        n_views,
        generator,
        include_original=include_original,
        scale=scale,
        flip=flip,
        augmix_views=augmix_views,
        rotate_degrees=rotate_degrees,
    )
    return render_views(images, plan)
