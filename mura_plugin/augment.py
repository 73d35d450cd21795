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
  (the official ``IMAGE_SIZE / 3`` with IMAGE_SIZE = its 224 px input). On the CPU the
  chains of a square image run through PIL itself (``mura_plugin.augmix._pil_chains``: one
  C loop over 8-bit pixels per operation, faster than the batched tensor passes; tested equal
  to them chain for chain), except autocontrast, which keeps the batched operation's
  float64 table (PIL's Python-float table rounds the other way, rarely, on a value that is
  an integer in exact arithmetic).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mura_plugin.augmix import AUGMIX_OPS, AugMixDraws, apply_augmix, augmix, augmix_draws

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
