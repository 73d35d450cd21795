"""The image operations spatter's mud and water are made of, on batched tensors: Canny edges
with OpenCV's hysteresis (``_canny``), the distance to the nearest edge, emboss, a 3x3 box and
histogram equalisation (``mura_plugin.shifts.weather.spatter`` uses them; its docstring says
what each follows)."""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from tta_bench.buffers import buffer_like


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
    return op(a, b, out=buffer_like(a))


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
