"""Noise corruptions (Hendrycks & Dietterich 2019, ImageNet-C / CIFAR-10-C).

Every draw is made per sample from the ``SampleGenerator`` (on the CPU, then moved), so a
sample's noise does not depend on the batch it is in.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from mura_plugin.shifts._ops import draw_batch, in_image_steps
from mura_plugin.shifts._params import check_images, severity_param, severity_table
from tta_bench.buffers import batch_buffer, buffer_like
from tta_bench.rng import SampleGenerator

__all__ = ["gaussian_noise", "shot_noise", "impulse_noise", "speckle_noise"]

# Severity tables, table name -> parameters of severities 1..5 (``severities.json``).
#: Standard deviation of the added noise.
GAUSSIAN_NOISE = severity_table("gaussian_noise")
#: Photon counts per unit intensity (lower = noisier).
SHOT_NOISE = severity_table("shot_noise")
#: Fraction of values replaced by salt or pepper (skimage ``random_noise(mode='s&p')``).
IMPULSE_NOISE = severity_table("impulse_noise")
#: Standard deviation of the multiplicative noise.
SPECKLE_NOISE = severity_table("speckle_noise")


def gaussian_noise(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Add N(0, c^2) noise per value and clip to [0, 1]."""
    check_images("gaussian_noise", images)
    c = severity_param("gaussian_noise", GAUSSIAN_NOISE, table, severity)
    out = buffer_like(images)
    return torch.add(images, _normal_noise(images, generator), alpha=c, out=out).clamp_(0, 1)


def _normal_noise(images: torch.Tensor, generator: SampleGenerator) -> torch.Tensor:
    """Standard-normal noise of ``images``' shape, dtype and device, drawn per sample from its
    generator (the values of ``generator.normal``)."""
    z = draw_batch(generator, "normal", *images.shape[1:])
    return z.to(images.device, images.dtype)


#: Poisson sampler layout (see ``poisson_counts``): rate levels are ``delta`` apart with
#: ``delta <= POISSON_STEP`` (at most ``POISSON_LEVELS`` levels), and each level's quantile
#: function is tabulated on ``2^POISSON_BINS_LOG2`` bins of the uniform.
POISSON_STEP = 1.0 / 8.0
POISSON_LEVELS = 256
POISSON_BINS_LOG2 = 10
_LOW_BITS = 31 - POISSON_BINS_LOG2  # bits of a 31-bit uniform below its bin index


@lru_cache(maxsize=8)
def _poisson_tables(
    rate_max: float, device: torch.device
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """``(delta, cdf [levels + 1, K] float64, table [(levels + 1) * bins] int32)`` for rates
    in ``[0, rate_max]``.

    ``cdf[j, k] = P(Poisson(j * delta) <= k)`` (the last column is set to 2, past every
    uniform; the mass it drops is below 1e-30). For a 31-bit uniform ``a`` in bin
    ``a >> _LOW_BITS`` the count ``#{k : cdf[j, k] <= a / 2^31}`` is ``lo + (low >= thr)``
    with ``low`` the bits below the bin index: ``thr`` is the exact integer position of the
    CDF step inside the bin if it holds one, else 0 with ``lo`` lowered by one. Entries are
    ``(lo << _LOW_BITS) | thr`` (``lo >= -1``); bins with several steps are marked -2^31
    and resolved by search (``_poisson_fallback``).
    """
    levels = max(1, min(POISSON_LEVELS, math.ceil(rate_max / POISSON_STEP)))
    delta = rate_max / levels
    rates = torch.arange(levels + 1, dtype=torch.float64)[:, None] * delta
    kmax = int(rate_max + 12.0 * math.sqrt(rate_max) + 40)
    if kmax > 1 << (31 - _LOW_BITS):
        raise ValueError(f"shot_noise: photon count scale {rate_max} is too large (max ~700)")
    k = torch.arange(kmax, dtype=torch.float64)
    pmf = torch.exp(k * torch.log(rates.clamp_min(1e-300)) - rates - torch.lgamma(k + 1))
    pmf[0] = 0.0
    pmf[0, 0] = 1.0  # Poisson(0) is 0
    cdf = pmf.cumsum(1)
    cdf[:, -1] = 2.0
    bins = 1 << POISSON_BINS_LOG2
    # Integer positions of the steps: a / 2^31 >= cdf  <=>  a >= ceil(cdf * 2^31).
    steps = torch.ceil(cdf * 2.0**31).clamp_(max=2.0**32).long()
    edges = torch.arange(bins + 1, dtype=torch.int64) << _LOW_BITS
    starts = edges[:-1].expand(levels + 1, -1).contiguous()
    ends = (edges[1:] - 1).expand(levels + 1, -1).contiguous()
    lo = torch.searchsorted(steps, starts, right=True)  # count at the bin's first value
    hi = torch.searchsorted(steps, ends, right=True)  # ... at its last value
    thr = steps.gather(1, lo.clamp(max=kmax - 1)) - starts
    no_step = hi == lo
    thr = torch.where(no_step, 0, thr)
    lo = lo - no_step.long()  # hi - lo is now 1 for no step or one step
    table = torch.where(hi - lo <= 1, (lo << _LOW_BITS) | thr, -(1 << 31)).to(torch.int32)
    return delta, cdf.to(device), table.view(-1).to(device)


def _poisson_search(
    lam: torch.Tensor, a1: torch.Tensor, a2: torch.Tensor, rate_max: float
) -> torch.Tensor:
    """Exact Poisson counts (int64) for 1-D ``lam`` from the same uniforms as
    ``poisson_counts`` (``a1``, ``a2`` int32), by search: the first stage compares ``a1``
    with the whole CDF row of the level, the second inverts Poisson(frac) term by term."""
    delta, cdf, _ = _poisson_tables(rate_max, lam.device)
    lam = lam.double()
    level = torch.div(lam, delta).floor_().clamp_(0, cdf.shape[0] - 1)
    frac = torch.addcmul(lam, level, lam.new_tensor(-delta)).clamp_(min=0.0)
    u1 = a1.double() * 2.0**-31
    k1 = (cdf[level.long()] <= u1[:, None]).sum(1)
    u2 = (a2 >> 7).double() * 2.0**-24
    term = torch.exp(-frac)
    total, m, n = term.clone(), torch.zeros_like(k1), 0
    while True:
        more = u2 >= total
        if not bool(more.any()):
            break
        n += 1
        m += more
        term = term * frac / n
        total = total + term
    return k1 + m


def _marked(counts: torch.Tensor) -> torch.Tensor:
    """Flat positions of the negative (marked) entries of ``counts`` (rows of 128 values
    are screened by their minimum first: a full-size ``nonzero`` is slow on CPU)."""
    flat = counts.reshape(-1)
    n = flat.numel()
    width = 128 if n % 128 == 0 else n
    rows = flat.view(-1, width).amin(1).lt(0).nonzero().squeeze(1)
    sub = flat.view(-1, width).index_select(0, rows).lt(0).nonzero()
    return rows[sub[:, 0]] * width + sub[:, 1]


def _poisson_fallback(
    counts: torch.Tensor, rates: torch.Tensor, a1: torch.Tensor, a2: torch.Tensor, rate_max: float
) -> None:
    """Resolve the rare values ``poisson_counts`` marks (a negative count: its first-stage
    bin holds several CDF steps, or the second stage reached 3) by exact search, in place."""
    pos = _marked(counts)
    found = _poisson_search(
        rates.reshape(-1)[pos], a1.reshape(-1)[pos], a2.reshape(-1)[pos], rate_max
    )
    counts.view(-1)[pos] = found.to(counts.dtype)


@lru_cache(maxsize=8)
def _poisson_offsets(rate_max: float, device: torch.device) -> torch.Tensor:
    """First-stage table of ``poisson_counts``: int32 ``[(levels + 1) * bins]`` offsets ``E``
    such that ``(low + E[level * bins + (a >> _LOW_BITS)]) >> _LOW_BITS``, with ``low`` the
    bits of the 31-bit uniform ``a`` below its bin index, is the first-stage count (the same
    as from the packed ``_poisson_tables`` entries ``lo, thr``: the bins are the same).

    ``E = ((lo + 1) << _LOW_BITS) - thr`` gives ``(lo << _LOW_BITS) + (2^_LOW_BITS - thr +
    low)``, whose shift is ``lo + [low >= thr]`` (``0 <= low, thr < 2^_LOW_BITS``; arithmetic
    shift, so ``lo = -1`` works too). Bins the packed table marks (several CDF steps) get
    ``E = -2^30``: a count of ``-2^(30 - _LOW_BITS)``, negative whatever the second stage
    adds. One addition replaces the packed entry's two masks, a subtraction and a shift."""
    _, _, packed = _poisson_tables(rate_max, torch.device("cpu"))
    packed = packed.long()
    lo, thr = packed >> _LOW_BITS, packed & ((1 << _LOW_BITS) - 1)
    # lo + 1 < 2^(31 - _LOW_BITS) keeps E and every sum low + E inside int32.
    if int(lo.max()) + 1 >= 1 << (31 - _LOW_BITS):
        raise ValueError(f"shot_noise: photon count scale {rate_max} is too large (max ~700)")
    offsets = torch.where(packed == -(1 << 31), -(1 << 30), ((lo + 1) << _LOW_BITS) - thr)
    return offsets.to(torch.int32).to(device)


def poisson_counts(
    rates: torch.Tensor, a1: torch.Tensor, a2: torch.Tensor, rate_max: float
) -> torch.Tensor:
    """Exact Poisson draws (int32, same shape) for ``rates`` in ``[0, rate_max]``, from two
    independent uniforms per value given as int32 ``a1, a2`` in ``[0, 2^31)``.

    ``Poisson(r) = Poisson(j * delta) + Poisson(r - j * delta)`` (independent parts) with
    ``j = floor(r / delta)``: the first part by inversion of ``a1`` through a tabulated
    quantile function (one table read, no search; ``_poisson_offsets``), the second, whose
    rate is below ``delta <= 1/8``, by inversion of ``a2`` unrolled over counts 0..2.
    Everything is exact up to the uniforms' resolution (2^-31 and 2^-24) and float64
    tables; the rare values the fast path cannot settle (a table bin with several CDF
    steps, a second-stage count of 3 or more) are finished by exact search.
    """
    counts = _poisson_marked(rates, a1, a2, float(rate_max))
    if int(counts.amin()) < 0:
        _poisson_fallback(counts, rates, a1, a2, float(rate_max))
    return counts


def _poisson_marked(
    rates: torch.Tensor, a1: torch.Tensor, a2: torch.Tensor, rate_max: float
) -> torch.Tensor:
    """``poisson_counts`` with the values it must settle by search left negative (marked).

    ~26 elementwise passes, each in place or into one of eight work buffers of ``rates``'
    shape. Branch-free arithmetic with comparisons into float outputs (no boolean tensors);
    the float second stage repeats the reference order of operations exactly."""

    def buffer(dtype: torch.dtype) -> torch.Tensor:
        return buffer_like(rates, dtype)

    delta, _, _ = _poisson_tables(rate_max, rates.device)
    offsets = _poisson_offsets(rate_max, rates.device)
    levels = offsets.numel() >> POISSON_BINS_LOG2
    level = torch.mul(rates, 1.0 / delta, out=buffer(rates.dtype))
    level.floor_().clamp_(0, levels - 1)
    negf = torch.mul(level, delta, out=buffer(rates.dtype))  # -frac, frac = r - level * delta
    negf.sub_(rates).clamp_(max=0.0)
    # First stage: one table read per value, count = (low + E) >> _LOW_BITS.
    idx = torch.bitwise_right_shift(a1, _LOW_BITS, out=buffer(torch.int32))
    counts = buffer(torch.int32).copy_(level)  # the level as int32 (exact)
    idx.add_(counts, alpha=1 << POISSON_BINS_LOG2)
    torch.index_select(offsets, 0, idx.view(-1), out=counts.view(-1))
    counts.add_(torch.bitwise_and(a1, (1 << _LOW_BITS) - 1, out=idx))
    counts.bitwise_right_shift_(_LOW_BITS)
    # Second stage: m = [u2 >= F0] + [u2 >= F1] - 2^30 [u2 >= F2], F the CDF of
    # Poisson(frac) (the -2^30 marks a count of 3 or more for the exact search).
    cdf = torch.exp(negf, out=level)  # F0 = P(0)
    u2 = torch.mul(torch.bitwise_right_shift(a2, 7, out=idx), 2.0**-24, out=buffer(rates.dtype))
    m = torch.ge(u2, cdf, out=buffer(rates.dtype))
    term = torch.mul(cdf, negf, out=buffer(rates.dtype))  # -P(1) = -F0 * frac
    hit = torch.ge(u2, cdf.sub_(term), out=buffer(rates.dtype))
    m.add_(hit)
    # F2 = F1 + P(1) * frac / 2 with P(1) * frac = term * negf: halving is exact (or the
    # product is too small to change F1), so ``alpha=0.5`` equals a separate multiply.
    m.add_(torch.ge(u2, cdf.add_(term.mul_(negf), alpha=0.5), out=hit), alpha=-(2.0**30))
    return counts.add_(idx.copy_(m))


@in_image_steps
def shot_noise(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Poisson (photon) noise: ``Poisson(x * c) / c``, clipped (exact Poisson draws from two
    31-bit uniforms per value of the sample's generator; see ``poisson_counts``)."""
    check_images("shot_noise", images)
    c = float(severity_param("shot_noise", SHOT_NOISE, table, severity))
    b, per = images.shape[0], images[0].numel()
    # Two 31-bit uniforms per value (int32 ``random_`` is uniform on [0, 2^31)): a sample's
    # ``2 * per`` draws fill its row of ``draws [B, 2, per]`` in one call (the same values
    # as two calls of ``per``).
    draws = batch_buffer((b, 2, per), torch.int32)
    for row, g in zip(draws, generator.generators):
        row.random_(generator=g)
    a = draws.to(images.device)
    rates = images.detach().reshape(b, per) * c
    counts = poisson_counts(rates, a[:, 0], a[:, 1], c)
    return counts.to(images.dtype).mul_(1.0 / c).clamp_(max=1.0).view(images.shape)


def impulse_noise(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Salt-and-pepper: each value becomes 0 or 1 (equally likely) with probability ``c``.

    One uniform draw ``u`` per value decides both: salt if ``u < c / 2``, pepper if
    ``c / 2 <= u < c`` (the same joint law as separate hit and salt draws)."""
    check_images("impulse_noise", images)
    c = severity_param("impulse_noise", IMPULSE_NOISE, table, severity)
    u = draw_batch(generator, "uniform", *images.shape[1:]).to(images.device)
    # Hit values become the salt mask (1 or 0), the others keep x; written over the draws,
    # so the output is the only batch-sized float tensor (the masks are bytes).
    hit = torch.lt(u, c, out=buffer_like(u, torch.bool))
    salt = torch.lt(u, c / 2, out=buffer_like(u, torch.bool))
    return torch.where(hit, salt, images, out=u)


def speckle_noise(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Multiplicative noise ``x + x * N(0, c^2)``, clipped."""
    check_images("speckle_noise", images)
    c = severity_param("speckle_noise", SPECKLE_NOISE, table, severity)
    z = _normal_noise(images, generator)
    return torch.addcmul(images, images, z, value=c, out=buffer_like(images)).clamp_(0.0, 1.0)
