"""Batched building blocks shared by the shift kernels.

Every op here has one implementation, the same on every device: torch on ``[B, C, H, W]``
float batches, with no branch on the device or on an image-size threshold. Separable
filters (Gaussians) are two dense matrix products (``M_h @ X @ M_w^T``) with the boundary
rule folded into the matrices, so the cost does not grow with the filter's width; fixed
non-separable kernels (disks) are FFT correlations after padding; per-sample sparse kernels
(motion lines) are weighted sums of windows of a padded batch (``shifted_taps``, built on
``gather_windows``). The only branches left inside an op are for correctness (see
``fft_correlate``'s padding of kernels wider than the image).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

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

#: The most values a kernel's stack of shifted or zoomed copies holds at once (16 MiB of
#: float32), on any device: ``shifted_taps`` and zoom_blur build such stacks a few samples
#: (channels) at a time and reduce each right after it is written, so their temporary
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


#: Dense 1-D Gaussian matrices of ``gaussian_filter`` by (side, sigma, truncate, mode, device,
#: dtype).
_GAUSSIAN_MATRICES = BoundedCache(16)


def gaussian_filter(
    images: torch.Tensor, sigma: float, *, truncate: float = 4.0, mode: str = "nearest"
) -> torch.Tensor:
    """Isotropic Gaussian blur of ``images [..., H, W]`` (skimage ``gaussian`` per channel):
    ``M_h X M_w^T`` with the dense 1-D filter matrices (``gaussian_matrix``), cached by
    ``(side, sigma, truncate, mode, device, dtype)`` (building them costs more than applying
    them to a batch of small images)."""
    h, w = images.shape[-2:]

    def matrix(n: int) -> torch.Tensor:
        key = (n, float(sigma), float(truncate), mode, str(images.device), images.dtype)
        return _GAUSSIAN_MATRICES.get(
            key,
            lambda: gaussian_matrix(
                n, sigma, truncate=truncate, mode=mode, device=images.device, dtype=images.dtype
            ),
        )

    mh = matrix(h)
    return apply_separable(images, mh, mh if w == h else matrix(w))


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


def fft_correlate(
    images: torch.Tensor, kernels: torch.Tensor, mode: str, *, cache_key: object = None
) -> torch.Tensor:
    """Correlate ``images [B, C, H, W]`` with centred ``kernels [B or 1, kh, kw]`` (odd sides).

    Pads by the kernel radius with ``mode`` (``replicate`` or ``reflect`` = OpenCV's
    reflect-101) so the circular FFT product equals the bounded correlation inside the
    image (the FFT length is then rounded up to a 5-smooth size; the extra zeros never wrap
    into the kept region). A hashable ``cache_key`` naming a fixed kernel caches its
    spectrum.
    """
    h, w = images.shape[-2:]
    kh, kw = kernels.shape[-2:]
    ry, rx = kh // 2, kw // 2
    fh, fw = fft_size(h + 2 * ry), fft_size(w + 2 * rx)

    def spectrum() -> torch.Tensor:
        return _kernel_spectrum(kernels.to(images.device), fh, fw, images.dtype)

    if cache_key is None:
        spec_k = spectrum()
    else:
        spec_k = _SPECTRA.get((cache_key, fh, fw, str(images.device), images.dtype), spectrum)
    if mode == "reflect" and (ry >= h or rx >= w):
        # torch's reflect padding needs pad < size; fold the indices instead.
        iy = fold_index(torch.arange(-ry, h + ry, device=images.device), h, "reflect101")
        ix = fold_index(torch.arange(-rx, w + rx, device=images.device), w, "reflect101")
        padded = images[:, :, iy][:, :, :, ix]
    else:
        padded = F.pad(images, (rx, rx, ry, ry), mode=mode)
    spec = torch.fft.rfft2(padded, s=(fh, fw))
    spec.mul_(spec_k[:, None])
    res = torch.fft.irfft2(spec, s=(fh, fw))
    return res[:, :, ry : ry + h, rx : rx + w].contiguous()


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
    out = torch.empty(b, 1, c * h * w, device=images.device, dtype=images.dtype)
    per = n * c * h * w
    step = max(1, STACK_ELEMENTS // per)
    stack = images.new_empty(min(step, b) * n, c, h, w)
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
    out = torch.empty(len(generator), *shape, dtype=dtype)
    for row, g in zip(out, generator.generators):
        fill(row, generator=g)
    return out
