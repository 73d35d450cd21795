"""Noise corruptions (Hendrycks & Dietterich 2019, ImageNet-C / CIFAR-10-C).

Every draw is made per sample from the ``SampleGenerator`` (on the CPU, then moved), so a
sample's noise does not depend on the batch it is in.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from mura_plugin.shifts._ops import chunk_rows
from mura_plugin.shifts._params import check_images, severity_param
from tta_bench.rng import SampleGenerator

__all__ = ["gaussian_noise", "shot_noise", "impulse_noise", "speckle_noise"]

GAUSSIAN_NOISE = {
    "cifar": (0.04, 0.06, 0.08, 0.09, 0.10),
    "imagenet": (0.08, 0.12, 0.18, 0.26, 0.38),
    "digits": (0.3, 0.45, 0.6, 0.7, 0.8),
}
#: Photon counts per unit intensity (lower = noisier).
SHOT_NOISE = {
    "cifar": (500, 250, 100, 75, 50),
    "imagenet": (60, 25, 12, 5, 3),
    "digits": (4, 2, 1.2, 0.8, 0.5),
}
#: Fraction of values replaced by salt or pepper (skimage ``random_noise(mode='s&p')``).
IMPULSE_NOISE = {
    "cifar": (0.01, 0.02, 0.03, 0.05, 0.07),
    "imagenet": (0.03, 0.06, 0.09, 0.17, 0.27),
    "digits": (0.1, 0.2, 0.3, 0.4, 0.5),
}
SPECKLE_NOISE = {
    "cifar": (0.06, 0.1, 0.12, 0.16, 0.2),
    "imagenet": (0.15, 0.2, 0.35, 0.45, 0.6),
    "digits": (0.6, 1.0, 1.5, 2.0, 3.0),
}


def gaussian_noise(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Add N(0, c^2) noise per value and clip to [0, 1]."""
    check_images("gaussian_noise", images)
    c = severity_param("gaussian_noise", GAUSSIAN_NOISE, table, severity)
    return _with_normal_noise(
        images, generator, lambda x, z, out: torch.add(x, z, alpha=c, out=out)
    )


def _with_normal_noise(images: torch.Tensor, generator: SampleGenerator, combine) -> torch.Tensor:
    """``clip(combine(x, z, out=...))`` with ``z`` standard-normal noise of ``images``' shape,
    drawn per sample from its generator (the same values as ``generator.normal``), a
    cache-sized chunk at a time into one reused buffer (no batch-sized noise tensor)."""
    out = torch.empty_like(images)
    step = chunk_rows(images)
    draws = torch.empty(min(step, images.shape[0]), *images.shape[1:])
    for s in range(0, images.shape[0], step):
        n = min(step, images.shape[0] - s)
        for j, g in enumerate(generator.generators[s : s + n]):
            torch.randn(images.shape[1:], generator=g, out=draws[j])
        z = draws[:n].to(images.device, images.dtype)
        combine(images[s : s + n], z, out[s : s + n]).clamp_(0.0, 1.0)
    return out


#: Poisson sampler layout (see ``poisson_counts``): rate levels are ``delta`` apart with
#: ``delta <= POISSON_STEP`` (at most ``POISSON_LEVELS`` levels), and each level's quantile
#: function is tabulated on ``2^POISSON_BINS_LOG2`` bins of the uniform.
POISSON_STEP = 1.0 / 8.0
POISSON_LEVELS = 256
POISSON_BINS_LOG2 = 10
_LOW_BITS = 31 - POISSON_BINS_LOG2  # bits of a 31-bit uniform below its bin index
#: Values per ``poisson_counts`` call on CPU: its ~25 small ops per call cost more in fixed
#: overhead (scalar operands, dispatch) on smaller segments than cache misses on larger
#: ones (measured at 224 px, one thread: 2^15 -> 2^18 is ~25% faster).
POISSON_SEGMENT = 1 << 18


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


def poisson_counts(
    rates: torch.Tensor,
    a1: torch.Tensor,
    a2: torch.Tensor,
    rate_max: float,
    *,
    resolve: bool = True,
) -> torch.Tensor:
    """Exact Poisson draws (int32, same shape) for ``rates`` in ``[0, rate_max]``, from two
    independent uniforms per value given as int32 ``a1, a2`` in ``[0, 2^31)``.

    ``Poisson(r) = Poisson(j * delta) + Poisson(r - j * delta)`` (independent parts) with
    ``j = floor(r / delta)``: the first part by inversion of ``a1`` through a tabulated
    quantile function (one table read, no search; ``_poisson_tables``), the second, whose
    rate is below ``delta <= 1/8``, by inversion of ``a2`` unrolled over counts 0..2.
    Everything is exact up to the uniforms' resolution (2^-31 and 2^-24) and float64
    tables; the rare values the fast path cannot settle (a table bin with several CDF
    steps, a second-stage count of 3 or more) are finished by exact search. Branch-free
    integer/float arithmetic (no boolean tensors) keeps the common path cheap on CPU.
    With ``resolve=False`` the marked values are left negative for the caller to settle
    (``_poisson_search``), so many calls can share one search.
    """
    delta, _, table = _poisson_tables(float(rate_max), rates.device)
    levels = table.numel() >> POISSON_BINS_LOG2
    level = torch.mul(rates, 1.0 / delta).floor_().clamp_(0, levels - 1)
    # Second stage first (it needs the float level): exp(-frac), frac = r - level * delta.
    negf = torch.mul(level, delta).sub_(rates).clamp_(max=0.0)
    p = torch.exp(negf)
    u2 = (a2 >> 7).to(rates.dtype).mul_(2.0**-24)
    # m = [u2 >= F0] + [u2 >= F1] + [u2 >= F2] with [u2 >= F] = floor(u2 - F) + 1 (|.| < 1).
    m = torch.sub(u2, p).floor_()
    term = torch.mul(p, negf).neg_()  # p * frac
    cdf = torch.add(p, term)
    m.add_(torch.sub(u2, cdf).floor_())
    term.mul_(negf).mul_(-0.5)  # p * frac^2 / 2
    cdf.add_(term)
    m.add_(torch.sub(u2, cdf).floor_()).add_(3.0)
    # First stage: one packed table read per value.
    idx = torch.bitwise_right_shift(a1, _LOW_BITS)
    idx.add_(level.to(torch.int32), alpha=1 << POISSON_BINS_LOG2)
    code = table.index_select(0, idx.view(-1)).view_as(a1)
    low = torch.bitwise_and(a1, (1 << _LOW_BITS) - 1)
    # count = lo + [low >= thr]: (low - thr) >> 31 is -1 below the step, 0 from it on.
    counts = low.sub_(torch.bitwise_and(code, (1 << _LOW_BITS) - 1)).bitwise_right_shift_(31)
    counts.add_(code.bitwise_right_shift_(_LOW_BITS)).add_(1)
    m = m.to(torch.int32)
    # Marks for the fallback: a -1 table entry gives a negative count; m == 3 is made so.
    counts.add_(m).sub_(torch.bitwise_right_shift(m, 1).bitwise_and_(m).mul_(1 << 30))
    if resolve and int(counts.amin()) < 0:
        _poisson_fallback(counts, rates, a1, a2, float(rate_max))
    return counts


def shot_noise(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Poisson (photon) noise: ``Poisson(x * c) / c``, clipped (exact Poisson draws from two
    31-bit uniforms per value of the sample's generator; see ``poisson_counts``)."""
    check_images("shot_noise", images)
    c = float(severity_param("shot_noise", SHOT_NOISE, table, severity))
    b, per = images.shape[0], images[0].numel()
    flat_in = images.detach().reshape(b, per)
    out = torch.empty(images.shape, dtype=images.dtype, device=images.device)
    flat_out = out.view(b, per)
    # Two 31-bit uniforms per value (int32 ``random_`` is uniform on [0, 2^31)). CPU: about
    # ``POISSON_SEGMENT`` values per sampler call (a segment of one big image, or several
    # small images); other devices take the whole batch.
    cpu = images.device.type == "cpu"
    rows = min(b, max(1, POISSON_SEGMENT // per)) if cpu else b
    seg = POISSON_SEGMENT if cpu else per
    draws = torch.empty(2, rows, per, dtype=torch.int32)
    # Marked values (see ``poisson_counts``) of every segment are settled by one search.
    marked: list[tuple[torch.Tensor, ...]] = []
    for s in range(0, b, rows):
        n = min(rows, b - s)
        for j, g in enumerate(generator.generators[s : s + n]):
            draws[0, j].random_(generator=g)
            draws[1, j].random_(generator=g)
        a = draws[:, :n].to(images.device)
        for t in range(0, per, seg):
            rates = flat_in[s : s + n, t : t + seg] * c
            a1, a2 = a[0, :, t : t + seg], a[1, :, t : t + seg]
            counts = poisson_counts(rates, a1, a2, c, resolve=False)
            if int(counts.amin()) < 0:
                pos = _marked(counts)
                width = counts.shape[1]
                flat_pos = (pos // width + s) * per + pos % width + t
                marked.append(
                    (flat_pos, rates.reshape(-1)[pos], a1.reshape(-1)[pos], a2.reshape(-1)[pos])
                )
            torch.mul(counts, 1.0 / c, out=flat_out[s : s + n, t : t + seg]).clamp_(max=1.0)
    if marked:
        flat_pos, lam, a1, a2 = (torch.cat(parts) for parts in zip(*marked))
        found = _poisson_search(lam, a1, a2, c)
        out.view(-1)[flat_pos] = found.to(out.dtype).mul_(1.0 / c).clamp_(max=1.0)
    return out


def impulse_noise(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Salt-and-pepper: each value becomes 0 or 1 (equally likely) with probability ``c``.

    One uniform draw ``u`` per value decides both: salt if ``u < c / 2``, pepper if
    ``c / 2 <= u < c`` (the same joint law as separate hit and salt draws)."""
    check_images("impulse_noise", images)
    c = severity_param("impulse_noise", IMPULSE_NOISE, table, severity)
    out = torch.empty_like(images)
    step = chunk_rows(images)
    draws = torch.empty(min(step, images.shape[0]), *images.shape[1:])
    hit = torch.empty(draws.shape, dtype=images.dtype, device=images.device)
    salt = torch.empty_like(hit)
    for s in range(0, images.shape[0], step):
        n = min(step, images.shape[0] - s)
        for j, g in enumerate(generator.generators[s : s + n]):
            torch.rand(images.shape[1:], generator=g, out=draws[j])
        u = draws[:n].to(images.device)
        # x - x * hit + salt with float 0/1 masks (exactly 0, 1 or x): comparisons into
        # float outputs and arithmetic are much cheaper on CPU than bool masks.
        torch.lt(u, c, out=hit[:n])
        torch.lt(u, c / 2, out=salt[:n])
        x = images[s : s + n]
        torch.addcmul(x, x, hit[:n], value=-1.0, out=out[s : s + n]).add_(salt[:n])
    return out


def speckle_noise(
    images: torch.Tensor, severity: int, *, generator: SampleGenerator, table: str = "cifar"
) -> torch.Tensor:
    """Multiplicative noise ``x + x * N(0, c^2)``, clipped."""
    check_images("speckle_noise", images)
    c = severity_param("speckle_noise", SPECKLE_NOISE, table, severity)
    return _with_normal_noise(
        images, generator, lambda x, z, out: torch.addcmul(x, x, z, value=c, out=out)
    )
