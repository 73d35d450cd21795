"""Batched building blocks shared by the shift kernels.

Every op here has one implementation, the same on every device: torch on ``[B, C, H, W]``
float batches, with no branch on the device or on an image-size threshold. Separable
filters (Gaussians) are ``M_h @ X @ M_w^T`` with the boundary rule folded into the 1-D
matrices, each applied as a banded block product (``_BandedPlan``: the work per output
follows the filter's width, not the side; one dense block where blocks would not halve
it); fixed
non-separable kernels (disks) are FFT correlations after padding; per-sample sparse kernels
(motion lines) are weighted sums of windows of a padded batch (``shifted_taps``, built on
``gather_windows``). The only branches left inside an op are for correctness (see
``fft_correlate``'s padding of kernels wider than the image). Kernels with several
batch-sized temporaries run a few images at a time (``in_image_steps``), the same steps
on every device.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from tta_bench.buffers import batch_buffer, buffer_like

if TYPE_CHECKING:
    from tta_bench.rng import SampleGenerator

__all__ = [
    "fold_index",
    "gaussian_matrix",
    "apply_separable",
    "gaussian_filter",
    "fft_correlate",
    "fft_size",
    "zoom_axis",
    "clipped_zoom",
    "rgb_to_gray",
    "gather_windows",
    "shifted_taps",
    "draw_batch",
]

BOUNDARY_MODES = ("nearest", "reflect", "reflect101")

#: The most values a kernel's stack of shifted or zoomed copies, or its padded images and
#: spectra, holds at once (16 MiB of float32), on any device: ``shifted_taps``, zoom_blur,
#: ``fft_correlate`` and the banded Gaussian (``_apply_plans``) work a few samples
#: (channels) at a time and reduce each step right after it is written, so their temporary
#: memory stays bounded whatever the batch (one 224 px sample's motion line is ~4.7M values).
STACK_ELEMENTS = 1 << 22


class BoundedCache:
    """A least-recently-used map of at most ``size`` entries, for values built from
    unhashable inputs (tensors) under a key the caller names (``functools.lru_cache``
    needs hashable arguments)."""

    def __init__(self, size: int):
        self.size = size
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The value under ``key``; ``build()`` makes (and stores) it on a miss."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key]
        value = build()
        self._entries[key] = value
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return value


def fold_index(idx: torch.Tensor, n: int, mode: str) -> torch.Tensor:
    """Map out-of-range integer indices into ``0..n-1``.

    ``nearest`` replicates the edge; ``reflect`` is scipy's half-sample mirror
    (``d c b a | a b c d``); ``reflect101`` is OpenCV's default (``d c b | a b c d``).
    Any distance from the image is handled (the mirror is periodic).
    """
    if mode == "nearest":
        return idx.clamp(0, n - 1)
    if n == 1:
        return torch.zeros_like(idx)
    if mode == "reflect":
        period = 2 * n
        r = idx.remainder(period)
        return torch.where(r < n, r, period - 1 - r)
    if mode == "reflect101":
        period = 2 * n - 2
        r = idx.remainder(period)
        return torch.where(r < n, r, period - r)
    raise ValueError(f"unknown boundary mode {mode!r}; expected one of {BOUNDARY_MODES}")


def _filter_matrix(n: int, weights: torch.Tensor, mode: str) -> torch.Tensor:
    """``[n, n]`` matrix applying the centred 1-D correlation ``weights`` with a boundary."""
    radius = (weights.numel() - 1) // 2
    rows = torch.arange(n, device=weights.device).repeat_interleave(weights.numel())
    taps = torch.arange(-radius, radius + 1, device=weights.device).repeat(n)
    cols = fold_index(rows + taps, n, mode)
    mat = torch.zeros(n * n, dtype=weights.dtype, device=weights.device)
    mat.index_add_(0, rows * n + cols, weights.repeat(n))
    return mat.view(n, n)


def gaussian_weights(
    sigma: float, truncate: float, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """scipy.ndimage's normalised Gaussian taps (radius ``int(truncate * sigma + 0.5)``)."""
    radius = int(truncate * sigma + 0.5)
    x = torch.arange(-radius, radius + 1, device=device, dtype=torch.float64)
    w = torch.exp(-0.5 * (x / sigma) ** 2)
    return (w / w.sum()).to(dtype)


def gaussian_matrix(
    n: int,
    sigma: float,
    *,
    truncate: float = 4.0,
    mode: str = "nearest",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``[n, n]`` matrix of a 1-D Gaussian filter (scipy ``gaussian_filter1d`` semantics)."""
    if sigma <= 0:
        return torch.eye(n, device=device, dtype=dtype)
    w = gaussian_weights(sigma, truncate, torch.device(device), torch.float64)
    return _filter_matrix(n, w, mode).to(dtype)


def apply_separable(images: torch.Tensor, mh: torch.Tensor, mw: torch.Tensor) -> torch.Tensor:
    """``mh @ X @ mw^T`` over the last two dims of ``images [..., H, W]``."""
    out = torch.matmul(images, mw.t())
    return torch.matmul(mh, out)


#: Output positions per block of a banded 1-D filter are at least this many (see
#: ``_banded_plan``): a product with a handful of columns wastes the matrix unit.
BAND_BLOCK = 16


class _BandedPlan:
    """A 1-D filter matrix ``M [n, n]`` (boundary folded in) cut into diagonal blocks.

    The outputs are split into ``blocks`` runs of ``tile`` consecutive positions (``tile``
    divides ``n``); block ``b`` reads the ``width = tile + 2 pad`` inputs from ``b * tile -
    pad`` of the input padded by ``pad`` zeros on each side, and ``mats [blocks, width,
    tile]`` holds the matching entries of ``M`` (transposed; zero where the padded position
    lies outside the image). Every non-zero of ``M`` is inside its block when the filter's
    reach (``radius``) plus the boundary fold stays within ``pad`` of the block: checked,
    otherwise (radius near the side) the plan is one dense block (``pad = 0``, ``width = n``,
    the matrix itself), as it is when blocks would not halve the work: the work per output
    is ``width`` products instead of ``n``."""

    def __init__(self, mat: torch.Tensor, radius: int):
        n = mat.shape[0]
        tile = next((d for d in range(max(BAND_BLOCK, 2 * radius), n) if n % d == 0), n)
        if 2 * (tile + 2 * radius) > n:
            tile = n  # blocks would save less than half the products: one dense block
        pad = radius if tile < n else 0
        blocks = n // tile
        width = tile + 2 * pad
        mats = torch.zeros(blocks, width, tile, dtype=mat.dtype, device=mat.device)
        for b in range(blocks):
            cols = torch.arange(b * tile - pad, b * tile - pad + width, device=mat.device)
            ok = (cols >= 0) & (cols < n)
            mats[b, ok] = mat[b * tile : (b + 1) * tile, cols[ok]].t()
        if tile < n and int(mats.count_nonzero()) != int(mat.count_nonzero()):
            # Not every non-zero was inside its block (a fold reaching past the pad): one
            # dense block is always exact.
            tile, pad, blocks, width, mats = n, 0, 1, n, mat.t().reshape(1, n, n)
        self.tile, self.pad, self.blocks, self.width = tile, pad, blocks, width
        self.mats = mats.contiguous()

    def rows(self, src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``x [R, n] @ M^T`` into ``out [R, n]`` (contiguous), ``x`` given as ``src [R, n +
        2 pad]`` with ``pad`` zero columns on each side (``_apply_plans`` writes the
        vertical pass into such a buffer): one batched product over the blocks, each block's
        windows a strided view of ``src`` (no copy)."""
        r, n_in = src.shape
        view = src.as_strided((self.blocks, r, self.width), (self.tile, n_in, 1))
        torch.bmm(view, self.mats, out=out.view(r, self.blocks, self.tile).transpose(0, 1))
        return out

    def cols(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``M @ x`` for ``x [N, n, W]`` into ``out [N, n, W]`` (any row stride): per
        block, one batched product of its matrix with its window of rows, read in place
        (the image's edge blocks drop the window rows outside the image, whose entries are
        zero), into the block's rows of ``out``."""
        n_img, n, _ = x.shape
        mats = self.mats.transpose(1, 2)
        for b in range(self.blocks):
            lo = b * self.tile - self.pad
            first, last = max(0, -lo), min(self.width, n - lo)
            torch.bmm(
                mats[b, :, first:last].expand(n_img, -1, -1),
                x[:, lo + first : lo + last],
                out=out[:, b * self.tile : (b + 1) * self.tile],
            )
        return out


def _apply_plans(
    images: torch.Tensor, plans: tuple[_BandedPlan, _BandedPlan], clamp=None
) -> torch.Tensor:
    """The separable filter of two ``_BandedPlan``s (rows, then columns) on ``images
    [..., H, W]``: the vertical pass into a buffer with the horizontal plan's zero columns
    on each side of every row, then the horizontal pass into the output (clipped to
    ``clamp=(lo, hi)`` if given).

    The batch is taken a few images at a time (at most ``STACK_ELEMENTS`` values of the
    buffer per step, one image at least), so the temporary memory is bounded whatever the
    batch and is reused from step to step."""
    ph, pw = plans
    h, w = images.shape[-2:]
    x = images.reshape(-1, h, w)
    n_img = x.shape[0]
    wp = w + 2 * pw.pad
    out = buffer_like(x)
    step = min(n_img, max(1, STACK_ELEMENTS // (h * wp)))
    buf = batch_buffer((step, h, wp), x.dtype, x.device)
    buf[..., : pw.pad] = 0.0
    buf[..., w + pw.pad :] = 0.0
    for s in range(0, n_img, step):
        e = min(n_img, s + step)
        vert = buf[: e - s]
        ph.cols(x[s:e], vert[..., pw.pad : pw.pad + w])
        res = pw.rows(vert.view(-1, wp), out[s:e].view(-1, w))
        if clamp is not None:
            res.clamp_(clamp[0], clamp[1])
    return out.view(images.shape)


#: Banded plans of ``gaussian_filter``'s 1-D Gaussians by (side, sigma, truncate, mode,
#: device, dtype).
_GAUSSIAN_PLANS = BoundedCache(16)


def gaussian_filter(
    images: torch.Tensor,
    sigma: float,
    *,
    truncate: float = 4.0,
    mode: str = "nearest",
    clamp: tuple[float, float] | None = None,
) -> torch.Tensor:
    """Isotropic Gaussian blur of ``images [..., H, W]`` (skimage ``gaussian`` per channel):
    ``M_h X M_w^T`` with the 1-D filter matrices (``gaussian_matrix``), each applied as a
    banded block product (``_BandedPlan``: about ``2 radius + tile`` products per output
    and pass, not ``H`` or ``W``), cached by ``(side, sigma, truncate, mode, device,
    dtype)``. ``clamp=(lo, hi)`` clips the result as it is written out."""
    h, w = images.shape[-2:]
    radius = int(truncate * sigma + 0.5) if sigma > 0 else 0

    def plan(n: int) -> _BandedPlan:
        key = (n, float(sigma), float(truncate), mode, str(images.device), images.dtype)
        return _GAUSSIAN_PLANS.get(
            key,
            lambda: _BandedPlan(
                gaussian_matrix(
                    n,
                    sigma,
                    truncate=truncate,
                    mode=mode,
                    device=images.device,
                    dtype=images.dtype,
                ),
                radius,
            ),
        )

    ph = plan(h)
    return _apply_plans(images, (ph, ph if w == h else plan(w)), clamp)


def fft_size(n: int) -> int:
    """The smallest 5-smooth integer (only factors 2, 3, 5) >= ``n``: a fast FFT length."""
    m = n
    while True:
        k = m
        for p in (2, 3, 5):
            while k % p == 0:
                k //= p
        if k == 1:
            return m
        m += 1


#: Spectra of fixed kernels by (cache key, FFT size, device, dtype); a few entries suffice
#: (one per corruption, severity and image size in use).
_SPECTRA = BoundedCache(16)


def _kernel_spectrum(kernels: torch.Tensor, fh: int, fw: int, dtype: torch.dtype) -> torch.Tensor:
    kh, kw = kernels.shape[-2:]
    # Correlation = convolution with the flipped kernel; put the kernel centre at (0, 0).
    flipped = torch.flip(kernels, dims=(-2, -1)).to(dtype)
    kpad = torch.zeros(kernels.shape[0], fh, fw, device=kernels.device, dtype=dtype)
    kpad[:, :kh, :kw] = flipped
    kpad = torch.roll(kpad, shifts=(-(kh // 2), -(kw // 2)), dims=(-2, -1))
    return torch.fft.rfft2(kpad)


#: The complex dtype of a real dtype's spectrum.
_COMPLEX = {torch.float32: torch.complex64, torch.float64: torch.complex128}


def _rfft2(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``torch.fft.rfft2(x, s=size)``, written into a recycled buffer (``batch_buffer``)."""
    if x.dtype not in _COMPLEX:
        return torch.fft.rfft2(x, s=size)
    spec = batch_buffer((*x.shape[:-2], size[0], size[1] // 2 + 1), _COMPLEX[x.dtype], x.device)
    return torch.fft.rfft2(x, s=size, out=spec)


def _irfft2(spec: torch.Tensor, size: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.fft.irfft2(spec, s=size)`` of real ``dtype``, into a recycled buffer."""
    if dtype not in _COMPLEX or spec.dtype != _COMPLEX[dtype]:
        return torch.fft.irfft2(spec, s=size)
    out = batch_buffer((*spec.shape[:-2], *size), dtype, spec.device)
    return torch.fft.irfft2(spec, s=size, out=out)


def fft_correlate(
    images: torch.Tensor,
    kernels: torch.Tensor,
    mode: str,
    *,
    cache_key: object = None,
    clamp: tuple[float, float] | None = None,
) -> torch.Tensor:
    """Correlate ``images [B, C, H, W]`` with centred ``kernels [B or 1, kh, kw]`` (odd sides).

    Pads by the kernel radius with ``mode`` (``replicate`` or ``reflect`` = OpenCV's
    reflect-101) so the circular FFT product equals the bounded correlation inside the
    image (the FFT length is then rounded up to a 5-smooth size; the extra zeros never wrap
    into the kept region). A hashable ``cache_key`` naming a fixed kernel caches its
    spectrum; ``clamp=(lo, hi)`` clips the result as it is written out.

    The padded images and their spectra are temporaries larger than the result (a complex
    spectrum holds ~2x the values of the padded image), so the batch is transformed a few
    samples at a time, at most ``STACK_ELEMENTS`` spectrum values per step (one sample at
    least), each step's crop written into the one output: the temporary memory is bounded
    whatever the batch, and each step reuses the memory the previous one released.
    """
    b, c, h, w = images.shape
    kh, kw = kernels.shape[-2:]
    ry, rx = kh // 2, kw // 2
    fh, fw = fft_size(h + 2 * ry), fft_size(w + 2 * rx)

    def spectrum(k: torch.Tensor = kernels) -> torch.Tensor:
        return _kernel_spectrum(k.to(images.device), fh, fw, images.dtype)

    per_kernel = kernels.shape[0] > 1
    if per_kernel:
        spec_k = None
    elif cache_key is None:
        spec_k = spectrum()
    else:
        spec_k = _SPECTRA.get((cache_key, fh, fw, str(images.device), images.dtype), spectrum)
    if mode == "reflect" and (ry >= h or rx >= w):
        # torch's reflect padding needs pad < size; fold the indices instead.
        iy = fold_index(torch.arange(-ry, h + ry, device=images.device), h, "reflect101")
        ix = fold_index(torch.arange(-rx, w + rx, device=images.device), w, "reflect101")

        def pad(x: torch.Tensor) -> torch.Tensor:
            return x[:, :, iy][:, :, :, ix]
    else:

        def pad(x: torch.Tensor) -> torch.Tensor:
            return F.pad(x, (rx, rx, ry, ry), mode=mode)

    out = buffer_like(images)
    step = max(1, STACK_ELEMENTS // (2 * c * fh * (fw // 2 + 1)))
    for s in range(0, b, step):
        e = min(b, s + step)
        spec = _rfft2(pad(images[s:e]), (fh, fw))
        spec.mul_((spectrum(kernels[s:e]) if per_kernel else spec_k)[:, None])
        res = _irfft2(spec, (fh, fw), images.dtype)[:, :, ry : ry + h, rx : rx + w]
        if clamp is None:
            out[s:e] = res
        else:
            torch.clamp(res, clamp[0], clamp[1], out=out[s:e])
    return out


def zoom_axis(n: int, factor: float, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Linear-interpolation taps of ImageNet-C's ``clipped_zoom`` along one axis of length n.

    The centre ``ceil(n / factor)`` pixels are zoomed by scipy.ndimage.zoom (order 1, corner
    aligned: output o samples input ``o * (m - 1) / (M - 1)``) to ``M = round(m * factor)``
    pixels and the centre ``n`` are kept. Returns ``(i0, i1, w1)`` with
    ``out[o] = (1 - w1[o]) * x[i0[o]] + w1[o] * x[i1[o]]``.
    """
    m = int(math.ceil(n / factor))
    top = (n - m) // 2
    big = int(round(m * factor))
    trim = (big - n) // 2
    o = torch.arange(n, device=device, dtype=torch.float64) + trim
    pos = o * ((m - 1) / (big - 1)) if big > 1 else torch.zeros_like(o)
    i0 = pos.floor().clamp(0, m - 1)
    w1 = pos - i0
    i1 = (i0 + 1).clamp(max=m - 1)
    return (i0.long() + top, i1.long() + top, w1)


def clipped_zoom(images: torch.Tensor, factor: float) -> torch.Tensor:
    """ImageNet-C's ``clipped_zoom`` of ``images [B, C, H, W]`` by ``factor >= 1``: the
    centre crop (``zoom_axis``) zoomed by scipy's order-1 zoom, which is bilinear with
    corners aligned, and trimmed to ``[H, W]``."""
    if images.dim() != 4 or not factor >= 1.0:
        raise ValueError(
            f"clipped_zoom expects images [B, C, H, W] and a factor >= 1, got "
            f"{tuple(images.shape)} and {factor!r}"
        )
    h, w = images.shape[-2:]
    mh, mw = int(math.ceil(h / factor)), int(math.ceil(w / factor))
    top, left = (h - mh) // 2, (w - mw) // 2
    bh, bw = int(round(mh * factor)), int(round(mw * factor))
    crop = images[..., top : top + mh, left : left + mw]
    big = F.interpolate(crop, size=(bh, bw), mode="bilinear", align_corners=True)
    th, tw = (bh - h) // 2, (bw - w) // 2
    return big[..., th : th + h, tw : tw + w]


def rgb_to_gray(images: torch.Tensor) -> torch.Tensor:
    """ITU-R 601 luma (OpenCV's RGB2GRAY), ``[B, 1, H, W]``; 1-channel input passes through."""
    if images.shape[1] == 1:
        return images
    r, g, b = images[:, 0:1], images[:, 1:2], images[:, 2:3]
    return 0.299 * r + 0.587 * g + 0.114 * b


def gather_windows(
    sources: torch.Tensor,
    which: torch.Tensor,
    top: torch.Tensor,
    left: torch.Tensor,
    h: int,
    w: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[K, C, h, w]`` windows ``sources[which[k], :, top[k]:top[k]+h, left[k]:left[k]+w]``
    of ``sources [N, C, Hs, Ws]`` (integer index tensors ``[K]``; windows must lie inside),
    written into ``out`` when given.

    One ``index_select`` over an overlapping strided view of the flat storage (one entry
    per possible window start), so each window is a block copy: far cheaper than a
    per-element gather or a Python loop of slices."""
    n, c, hs, ws = sources.shape
    src = sources.contiguous()
    total = src.numel() - ((c - 1) * hs * ws + (h - 1) * ws + w) + 1
    view = src.view(-1).as_strided((total, c, h, w), (1, hs * ws, ws, 1))
    start = which.long() * (c * hs * ws) + top.long() * ws + left.long()
    return torch.index_select(view, 0, start.to(sources.device), out=out)


def shifted_taps(
    images: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Per-sample sparse correlation with edges replicated:
    ``out[b, c, y, x] = sum_j weights[j] * images[b, c, clamp(y - dy[b, j]), clamp(x - dx[b, j])]``
    for ``images [B, C, H, W]``, integer shifts ``dy, dx [B, n]`` and ``weights [n]`` or
    ``[B, n]`` (any shift size: the padding is what the shifts need).

    Each sample's shifted copies are windows of one padded batch (``gather_windows``) and
    their weighted sum is one batched product, a few samples at a time (at most
    ``STACK_ELEMENTS`` values of windows, or one sample's) in one reused buffer."""
    b, c, h, w = images.shape
    n = dy.shape[1]
    dy, dx = dy.long().cpu(), dx.long().cpu()
    top, bottom = max(0, int(dy.max())), max(0, -int(dy.min()))
    lft, rgt = max(0, int(dx.max())), max(0, -int(dx.min()))
    padded = F.pad(images, (lft, rgt, top, bottom), mode="replicate")
    which = torch.arange(b).view(b, 1).expand(b, n)
    sy, sx = top - dy, lft - dx
    wts = weights.to(images.device, images.dtype).reshape(-1, 1, n).expand(b, 1, n)
    out = batch_buffer((b, 1, c * h * w), images.dtype, images.device)
    per = n * c * h * w
    step = max(1, STACK_ELEMENTS // per)
    stack = batch_buffer((min(step, b) * n, c, h, w), images.dtype, images.device)
    for s in range(0, b, step):
        e = min(b, s + step)
        win = gather_windows(
            padded,
            which[s:e].reshape(-1),
            sy[s:e].reshape(-1),
            sx[s:e].reshape(-1),
            h,
            w,
            out=stack[: (e - s) * n],
        )
        torch.bmm(wts[s:e], win.view(e - s, n, c * h * w), out=out[s:e])
    return out.view(b, c, h, w)


def draw_batch(
    generator: SampleGenerator, kind: str, *shape: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The values of ``generator.uniform(*shape)`` (``kind="uniform"``) or
    ``generator.normal(*shape)`` (``"normal"``), ``[B, *shape]`` on the CPU: each sample's
    generator fills its own row of one preallocated batch in place (the same draws from the
    same generators in the same order, without a tensor per sample and the stacking copy,
    which cost more than the draws for small shapes)."""
    fills = {"uniform": torch.Tensor.uniform_, "normal": torch.Tensor.normal_}
    if kind not in fills:
        raise ValueError(f"draw_batch: unknown kind {kind!r}; expected one of {sorted(fills)}")
    fill = fills[kind]
    out = batch_buffer((len(generator), *shape), dtype)
    for row, g in zip(out, generator.generators):
        fill(row, generator=g)
    return out


def in_image_steps(kernel: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``kernel`` run a few images at a time (at most ``STACK_ELEMENTS`` values per step, or
    one image), each step written into one output; a batch that fits one step is one call.

    For kernels with several batch-sized temporaries: a step's temporaries stay small
    enough for the allocator to reuse from step to step and call to call, where fresh
    batch-sized ones (above glibc's 32 MiB mapping threshold) are zero pages touched
    anew each time, which cost more than the arithmetic at 224 px. The same code runs on
    every device (a GPU runs a 224 px batch of 64 in three calls). Each image keeps its
    own generator (``SampleGenerator.subset``); the kernel's batch independence (tested
    for every kernel, to float rounding) makes the steps' output the batch's."""

    def stepped(
        images: torch.Tensor, severity: int, *, generator: SampleGenerator, **kwargs: Any
    ) -> torch.Tensor:
        b = images.shape[0]
        step = max(1, STACK_ELEMENTS // max(1, images[0].numel()))
        if step >= b:
            return kernel(images, severity, generator=generator, **kwargs)
        out = buffer_like(images)
        for s in range(0, b, step):
            e = min(b, s + step)
            part = None if generator is None else generator.subset(s, e)
            out[s:e] = kernel(images[s:e], severity, generator=part, **kwargs)
        return out

    stepped.__name__ = kernel.__name__
    stepped.__qualname__ = kernel.__qualname__
    stepped.__doc__ = kernel.__doc__
    stepped.__wrapped__ = kernel  # type: ignore[attr-defined]
    return stepped
