"""AugMix as TPT's and TDA's ``AugMixAugmenter`` (data/augmix_ops.py of azshue/TPT and
kdiAAA/TDA), batched on tensors: the 9 PIL operations on 8-bit values with PIL's formulas,
the chains' draws (``augmix_draws``) and their application (``apply_augmix``, ``augmix``).
``mura_plugin.augment`` (the view pipeline) re-exports the public names; its docstring
describes the operations and their differences from torchvision's ``AugMix``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = [
    "AUGMIX_OPS",
    "STEP_ELEMENTS",
    "AugMixDraws",
    "apply_augmix",
    "augmix",
    "augmix_draws",
    "pil_reference_op",
]


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
    width = draws.ops.shape[0]
    x8 = (images.float() * 255).round().clamp(0, 255)
    square = images.shape[-1] == images.shape[-2]  # PIL's ops read the side of a square
    if dev.type == "cpu" and images.shape[1] in (1, 3) and square:
        chains = _pil_chains(x8, draws)
    else:
        chains = _tensor_chains(x8, draws)
    chains = chains.view(width, n, *images.shape[1:]) / 255
    mix = torch.einsum("wn,wnchx->nchx", draws.weights.t().to(dev), chains)
    m = draws.m.to(dev).view(-1, 1, 1, 1)
    return (m * (x8 / 255) + (1 - m) * mix).to(images.dtype)


def _tensor_chains(x8: torch.Tensor, draws: AugMixDraws) -> torch.Tensor:
    """The chains ``[width * N, C, H, W]`` (8-bit values as floats) of ``x8``, each
    operation applied to every chain that draws it at a step, batched on ``x8``'s device."""
    dev = x8.device
    width, max_depth = draws.ops.shape[0], draws.ops.shape[2]
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
    return chains


def _pil_chains(x8: torch.Tensor, draws: AugMixDraws) -> torch.Tensor:
    """``_tensor_chains`` on the CPU through PIL: each chain's operations are the official
    PIL calls (``pil_reference_op``) on its 8-bit image, which the batched operations equal
    value for value (tested per operation and per chain), in one C loop per operation
    instead of many tensor passes; autocontrast keeps the batched operation's table
    (``_autocontrast_pil``). Float ``[width * N, C, H, W]``, as ``_tensor_chains``."""
    from PIL import Image

    names = list(AUGMIX_OPS)
    width, n = draws.ops.shape[:2]
    hwc = x8.to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()  # [N, H, W, C]
    if hwc.shape[-1] == 1:
        hwc = hwc[..., 0]
    depth, ops = draws.depth.tolist(), draws.ops.tolist()
    levels, negative = draws.levels.tolist(), draws.negative.tolist()
    out = np.empty((width, n, *hwc.shape[1:]), dtype=np.uint8)
    for i in range(n):
        source = Image.fromarray(hwc[i])
        for w in range(width):
            chain = source
            for step in range(depth[w][i]):
                name = names[ops[w][i][step]]
                if name == "autocontrast":
                    chain = _autocontrast_pil(chain)
                else:
                    chain = pil_reference_op(name, chain, levels[w][i][step], negative[w][i][step])
            out[w, i] = np.asarray(chain)
    chains = torch.from_numpy(out).view(width * n, *hwc.shape[1:])
    if chains.dim() == 3:
        chains = chains.unsqueeze(-1)
    return chains.permute(0, 3, 1, 2).float()


def _autocontrast_pil(image: Any) -> Any:
    """``_autocontrast`` of one PIL image (its float64 look-up table): PIL's own computes
    ``ix * scale + offset`` with Python floats, which torch's vectorised arithmetic can
    round the other way on a value that is an integer in exact arithmetic (one pixel
    level, rarely); the committed results were computed with this table."""
    from PIL import Image

    arr = np.array(image)  # writable, for torch
    x = torch.from_numpy(arr.reshape(*arr.shape[:2], -1)).permute(2, 0, 1)[None].float()
    y = _autocontrast(x, x, x).to(torch.uint8)[0].permute(1, 2, 0).numpy()
    return Image.fromarray(y[..., 0] if arr.ndim == 2 else y)


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


def pil_reference_op(name: str, image: Any, level: float, negative: bool) -> Any:
    """One operation of the official data/augmix_ops.py on a square PIL ``image`` (its
    IMAGE_SIZE = the image's side) at ``level``, its sign drawn as ``negative``: the same PIL
    calls, as the reference the batched ``AUGMIX_OPS`` are tested against and
    ``benchmarks/augmix_speed.py`` times."""
    from PIL import Image, ImageOps

    s = image.size[0]
    sign = -1 if negative else 1
    if name == "autocontrast":
        return ImageOps.autocontrast(image)
    if name == "equalize":
        return ImageOps.equalize(image)
    if name == "posterize":
        return ImageOps.posterize(image, 4 - int(level * 4 / 10))
    if name == "solarize":
        return ImageOps.solarize(image, 256 - int(level * 256 / 10))
    if name == "rotate":
        return image.rotate(sign * int(level * 30 / 10), resample=Image.BILINEAR)
    shear = sign * level * 0.3 / 10
    shift = sign * int(level * (s / 3) / 10)
    data = {
        "shear_x": (1, shear, 0, 0, 1, 0),
        "shear_y": (1, 0, 0, shear, 1, 0),
        "translate_x": (1, 0, shift, 0, 1, 0),
        "translate_y": (1, 0, 0, 0, 1, shift),
    }[name]
    return image.transform((s, s), Image.AFFINE, data, resample=Image.BILINEAR)
