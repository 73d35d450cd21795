"""The fast helpers behind the shift kernels equal their straightforward definitions."""

from __future__ import annotations

import pytest
import torch

from mura_plugin.shifts import blur, weather
from mura_plugin.shifts._ops import fft_correlate, fft_size
from mura_plugin.shifts.digital import hsv_to_rgb, rgb_to_hsv, scale_saturation, shift_value


@pytest.fixture(scope="module")
def rgb() -> torch.Tensor:
    x = torch.rand(3, 3, 17, 19, generator=torch.Generator().manual_seed(0))
    x[0, :, :2] = 0.0  # black
    x[1, :, 3:5] = 0.5  # grey
    return x


def test_hsv_round_trip(rgb):
    torch.testing.assert_close(hsv_to_rgb(rgb_to_hsv(rgb)), rgb, atol=1e-6, rtol=0)


@pytest.mark.parametrize("c", [0.0, 0.3, 1.5])
def test_shift_value_equals_hsv_round_trip(rgb, c):
    hsv = rgb_to_hsv(rgb)
    ref = hsv_to_rgb(torch.stack((hsv[:, 0], hsv[:, 1], (hsv[:, 2] + c).clamp(0, 1)), 1))
    torch.testing.assert_close(shift_value(rgb, c), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("a,b", [(0.1, 0.0), (2.0, 0.0), (20.0, 0.2)])
def test_scale_saturation_equals_hsv_round_trip(rgb, a, b):
    hsv = rgb_to_hsv(rgb)
    ref = hsv_to_rgb(torch.stack((hsv[:, 0], (hsv[:, 1] * a + b).clamp(0, 1), hsv[:, 2]), 1))
    torch.testing.assert_close(scale_saturation(rgb, a, b), ref, atol=1e-5, rtol=0)


def test_fft_size_is_smooth_and_minimal():
    assert [fft_size(n) for n in (1, 7, 17, 240, 241, 284)] == [1, 8, 18, 240, 243, 288]


@pytest.mark.parametrize("radius,sigma", [(3, 1.5), (12, 6.0)])
def test_motion_filter_equals_the_kernel_correlation(rgb, radius, sigma):
    """The tap line equals the correlation with its kernels, edges replicated (lines
    longer than the image included)."""
    angles = torch.tensor([-40.0, 5.0, 33.0])
    kernels = blur.motion_kernels(radius, sigma, angles, rgb.device)
    ref = fft_correlate(rgb.double(), kernels, "replicate").float()
    out = blur.motion_filter(rgb, radius, sigma, angles)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_fast_spatter_parts_equal_convolutions():
    x = torch.rand(2, 1, 12, 13, generator=torch.Generator().manual_seed(1))
    emboss = torch.tensor(weather.EMBOSS).view(1, 1, 3, 3)
    torch.testing.assert_close(weather._emboss(x), torch.nn.functional.conv2d(x, emboss))
    box = torch.nn.functional.avg_pool2d(torch.nn.functional.pad(x, (1,) * 4, "reflect"), 3, 1)
    torch.testing.assert_close(weather._box3(x), box)
    edges = x > 0.9
    idx = torch.stack(torch.meshgrid(torch.arange(12), torch.arange(13), indexing="ij"), -1)
    for i in range(2):
        pts = idx[edges[i, 0]].float()
        d = torch.cdist(idx.view(-1, 2).float(), pts).amin(1).view(12, 13).clamp(max=4)
        torch.testing.assert_close(weather._edge_distance(edges, 4)[i, 0], d)


@pytest.mark.parametrize("table,severity", [("imagenet", 3), ("digits", 5)])
def test_batched_zoom_blur_equals_the_clipped_zoom_average(table, severity):
    from mura_plugin.shifts._ops import clipped_zoom
    from tta_bench.rng import SampleGenerator

    x = torch.rand(2, 3, 23, 29, generator=torch.Generator().manual_seed(2))
    factors = blur.zoom_factors(table, severity)
    ref = (x + sum(clipped_zoom(x, float(z)) for z in factors)) / (len(factors) + 1)
    gen = SampleGenerator.for_samples(range(2), 0, "zoom_blur", severity)
    out = blur.zoom_blur(x, severity, generator=gen, table=table)
    torch.testing.assert_close(out, ref.clamp(0, 1), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="factor >= 1"):
        clipped_zoom(x, 0.9)


@pytest.mark.parametrize(
    "lam,rate_max",
    [(0.05, 12.0), (3.7, 12.0), (12.0, 12.0), (47.3, 60.0), (7.7, 500.0), (499.0, 500.0)],
)
def test_poisson_sampler_matches_the_poisson_law(lam, rate_max):
    """The table-driven sampler behind shot_noise draws exactly Poisson(lam) counts: a
    chi-square test of the frequencies against the Poisson pmf (and a fixed seed), at small,
    fractional, level-boundary and large rates, including the rare exact-search path."""
    from scipy import stats

    from mura_plugin.shifts.noise import poisson_counts

    n = 400_000
    g = torch.Generator().manual_seed(int(lam * 100))
    a = torch.empty(2, n, dtype=torch.int32).random_(generator=g)
    counts = poisson_counts(torch.full((n,), lam), a[0], a[1], rate_max).long()
    assert counts.min() >= 0
    k = torch.arange(int(counts.max()) + 1)
    observed = torch.bincount(counts, minlength=len(k)).double().numpy()
    expected = stats.poisson.pmf(k.numpy(), lam) * n
    keep = expected > 10
    chi2 = (((observed - expected) ** 2 / expected)[keep]).sum()
    assert stats.chi2.sf(chi2, max(1, keep.sum() - 1)) > 1e-3, (lam, chi2)
    assert abs(counts.double().mean().item() - lam) < 5 * (lam / n) ** 0.5 + 1e-9


def test_gather_windows_equals_slicing():
    from mura_plugin.shifts._ops import gather_windows

    src = torch.rand(3, 2, 9, 11, generator=torch.Generator().manual_seed(3))
    which, top, left = (
        torch.tensor([2, 0, 2, 1]),
        torch.tensor([0, 4, 5, 2]),
        torch.tensor([6, 0, 3, 1]),
    )
    out = gather_windows(src, which, top, left, 4, 5)
    for k in range(4):
        t, s = int(top[k]), int(left[k])
        assert torch.equal(out[k], src[int(which[k]), :, t : t + 4, s : s + 5])
    buf = torch.empty(4, 2, 4, 5)
    assert gather_windows(src, which, top, left, 4, 5, out=buf) is buf
    assert torch.equal(buf, out)


def test_shifted_taps_equal_scipy_correlation():
    """Per-sample taps (shifts larger than the image included) equal scipy.ndimage's
    correlation with the same taps as a kernel, edges replicated (mode 'nearest')."""
    from scipy import ndimage

    from mura_plugin.shifts._ops import shifted_taps

    g = torch.Generator().manual_seed(4)
    x = torch.rand(2, 3, 7, 9, generator=g, dtype=torch.float64)
    dy = torch.tensor([[0, 1, -3, 9], [2, 0, -1, -12]])
    dx = torch.tensor([[0, -2, 4, 1], [0, 11, -1, 0]])
    weights = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    out = shifted_taps(x, dy, dx, weights)
    for b in range(2):
        r = int(max(dy[b].abs().max(), dx[b].abs().max()))
        kernel = torch.zeros(2 * r + 1, 2 * r + 1, dtype=torch.float64)
        for j in range(4):  # out[y, x] += w * img[y - dy, x - dx]: kernel offset (-dy, -dx)
            kernel[r - int(dy[b, j]), r - int(dx[b, j])] += weights[j]
        for c in range(3):
            ref = ndimage.correlate(x[b, c].numpy(), kernel.numpy(), mode="nearest")
            torch.testing.assert_close(out[b, c], torch.from_numpy(ref))


@pytest.mark.parametrize("mode", ["nearest", "reflect"])
@pytest.mark.parametrize(
    "h,w,sigma,truncate",
    [
        (32, 35, 1.0, 4.0),
        (20, 23, 0.05, 4.0),
        (12, 15, 4.0, 4.0),
        (150, 141, 3.0, 4.0),
        (40, 40, 2.4, 3.0),
    ],
)
def test_gaussian_filter_equals_scipy(mode, h, w, sigma, truncate):
    """Narrow and wide filters, radii past the image side (the boundary fold is periodic),
    non-square images; the second call reads the cached matrices."""
    from scipy import ndimage

    from mura_plugin.shifts._ops import gaussian_filter

    x = torch.rand(2, h, w, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    for _ in range(2):
        out = gaussian_filter(x, sigma, truncate=truncate, mode=mode)
        for i in range(2):
            ref = ndimage.gaussian_filter(x[i].numpy(), sigma, mode=mode, truncate=truncate)
            torch.testing.assert_close(out[i], torch.from_numpy(ref))


@pytest.mark.parametrize("sparse_limit", [0.0, 1.0])
def test_canny_equals_opencv(monkeypatch, sparse_limit):
    """Both hysteresis paths: whole-image dilations (limit 0) and candidates followed one
    by one (limit 1); the inputs have ~1400 and ~10 weak-only candidates, half of which
    join an edge."""
    cv2 = pytest.importorskip("cv2")
    from mura_plugin.shifts._ops import gaussian_filter

    monkeypatch.setattr(weather, "SPARSE_HYSTERESIS", sparse_limit)

    g = torch.Generator().manual_seed(7)
    smooth = (gaussian_filter(torch.rand(2, 1, 48, 53, generator=g), 1.5) * 255).floor()
    contrasty = (smooth - smooth.mean()).mul(6).add(128).clamp(0, 255).floor()
    for u8 in (smooth, contrasty):
        ours = weather._canny(u8, 50.0, 150.0)
        for i in range(2):
            ref = cv2.Canny(u8[i, 0].numpy().astype("uint8"), 50, 150) > 0
            assert ref.sum() > 50
            assert torch.equal(ours[i, 0] > 0, torch.from_numpy(ref))


def _glass_blur_per_iteration(x, severity, seeds, table):
    """glass_blur's definition, one scrambling pass per iteration with integer division."""
    from mura_plugin.shifts._ops import gaussian_filter
    from mura_plugin.shifts._params import spatial_scale

    sigma, delta, iterations = blur.GLASS_BLUR[table][severity - 1]
    scale = spatial_scale(table, x)
    sigma, delta = sigma * scale, max(1, int(round(delta * scale)))
    b, c, h, w = x.shape
    x = (gaussian_filter(x, sigma, mode="nearest") * 255).floor() / 255
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    draws = torch.stack(
        [torch.empty(iterations, h * w, dtype=torch.int32).random_(generator=g) for g in gens]
    ).long()
    span = 2 * delta
    yy, xx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    yy, xx = yy.reshape(-1), xx.reshape(-1)
    interior = (yy >= delta) & (yy < h - delta) & (xx >= delta) & (xx < w - delta)
    for it in range(iterations):
        pair = ((draws[:, it] >> 15) * span * span) >> 16
        sy, sx = yy + pair // span - delta, xx + pair % span - delta
        src = torch.where(interior, sy * w + sx, yy * w + xx)
        x = torch.gather(x.reshape(b, c, h * w), 2, src[:, None].expand(b, c, h * w))
    return gaussian_filter(x.view(b, c, h, w), sigma, mode="nearest").clamp(0, 1)


@pytest.mark.parametrize(
    "table,severity,size", [("digits", 5, 32), ("cifar", 2, 14), ("imagenet", 3, 40)]
)
def test_glass_blur_equals_per_iteration_scrambling(table, severity, size):
    from tta_bench.rng import SampleGenerator

    x = torch.rand(3, 3, size, size, generator=torch.Generator().manual_seed(4))
    seeds = [11, 12, 13]
    out = blur.glass_blur(x, severity, generator=SampleGenerator(seeds), table=table)
    ref = _glass_blur_per_iteration(x, severity, seeds, table)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)


# -- per-sample draws, the elastic affine, shot noise ----------------------------------------------
@pytest.mark.parametrize(
    "kind,shape,dtype",
    [
        ("uniform", (3, 2), torch.float64),
        ("normal", (1, 5, 7), torch.float32),
        ("uniform", (1,), torch.float32),
    ],
)
def test_draw_batch_equals_sample_generator(kind, shape, dtype):
    from mura_plugin.shifts._ops import draw_batch
    from tta_bench.rng import SampleGenerator

    ref_gen, gen = SampleGenerator([3, 4, 5]), SampleGenerator([3, 4, 5])
    ref = getattr(ref_gen, kind)(*shape, dtype=dtype)
    out = draw_batch(gen, kind, *shape, dtype=dtype)
    assert out.dtype == dtype and torch.equal(out, ref)
    # The generators are left in the same state: the next draws agree too.
    assert torch.equal(gen.uniform(2), ref_gen.uniform(2))
    with pytest.raises(ValueError, match="uniform"):
        draw_batch(gen, "poisson", 2)


def test_elastic_theta_equals_lapack_solution():
    from mura_plugin.shifts.geometric import _elastic_theta

    h, w, jitter = 32, 40, 5.0
    noise = torch.rand(7, 3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    cy, cx, sq = float(h // 2), float(w // 2), float(min(h, w) // 3)
    pts1 = torch.tensor([[cy + sq, cx + sq], [cy + sq, cx - sq], [cy - sq, cx - sq]]).double()
    a = torch.cat((pts1, torch.ones(3, 1, dtype=torch.float64)), 1)
    m = torch.linalg.solve(a.expand(7, 3, 3), pts1 + jitter * noise).transpose(1, 2)
    full = torch.cat((m, torch.tensor([[[0.0, 0.0, 1.0]]]).double().expand(7, 1, 3)), 1)
    to_norm = torch.tensor(
        [[2 / (w - 1), 0.0, -1.0], [0.0, 2 / (h - 1), -1.0], [0.0, 0.0, 1.0]], dtype=torch.float64
    )
    ref = (to_norm @ torch.linalg.inv(full) @ torch.linalg.inv(to_norm))[:, :2]
    torch.testing.assert_close(_elastic_theta(noise, jitter, h, w), ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("rate_max", [0.5, 12.0, 60.0, 500.0])
def test_poisson_offsets_decode_the_packed_table(rate_max):
    """The one-add first stage of ``poisson_counts`` gives ``lo + [low >= thr]`` of the packed
    table at every bin's edges and steps, and a negative count in its marked bins."""
    from mura_plugin.shifts.noise import _LOW_BITS, _poisson_offsets, _poisson_tables

    _, _, packed = _poisson_tables(rate_max, torch.device("cpu"))
    packed = packed.long()
    offsets = _poisson_offsets(rate_max, torch.device("cpu")).long()
    mask = (1 << _LOW_BITS) - 1
    lo, thr = packed >> _LOW_BITS, packed & mask
    for low in (torch.zeros_like(thr), (thr - 1).clamp(min=0), thr, torch.full_like(thr, mask)):
        assert int((low + offsets).abs().max()) < 2**31  # no int32 overflow in the sampler
        got = (low + offsets) >> _LOW_BITS
        ok = packed != -(2**31)
        assert torch.equal(got[ok].long(), lo[ok] + (low[ok] >= thr[ok]).long())
        assert bool((got[~ok] < -2).all())


@pytest.mark.parametrize(
    "size,channels,table,severity",
    [(32, 3, "digits", 5), (20, 1, "cifar", 2), (48, 3, "imagenet", 1)],
)
def test_shot_noise_equals_exact_search_on_per_sample_draws(size, channels, table, severity):
    """shot_noise is Poisson(x * c) / c with, per sample, its first ``C*H*W`` int32 draws as
    the first uniforms and the next ``C*H*W`` as the second, counted by the exact search."""
    from mura_plugin.shifts import noise
    from tta_bench.rng import SampleGenerator

    x = torch.rand(5, channels, size, size, generator=torch.Generator().manual_seed(size))
    x[0, 0, :2] = 1.0
    c = float(noise.SHOT_NOISE[table][severity - 1])
    per = x[0].numel()
    gens = SampleGenerator(range(5)).generators
    a = torch.empty(2, 5, per, dtype=torch.int32)
    for j, g in enumerate(gens):
        a[0, j].random_(generator=g)
        a[1, j].random_(generator=g)
    rates = (x.reshape(5, per) * c).reshape(-1)
    counts = noise._poisson_search(rates, a[0].reshape(-1), a[1].reshape(-1), c)
    expected = (counts.float() * (1.0 / c)).clamp(max=1.0).view_as(x)
    got = noise.shot_noise(x, severity, generator=SampleGenerator(range(5)), table=table)
    assert torch.equal(got, expected)


def _plasma_reference(uniforms: torch.Tensor, mapsize: int, decay: float) -> torch.Tensor:
    """ImageNet-C's ``plasma_fractal`` in float32 on ``[B, mapsize^2 - 1]`` uniforms: rolled
    neighbour sums per level, each level's midpoints consuming the next uniforms."""
    m = torch.zeros(uniforms.shape[0], mapsize, mapsize)
    step, wibble, used = mapsize, 100.0, 0

    def wibbled(total: torch.Tensor) -> torch.Tensor:
        nonlocal used
        u = uniforms[:, used : used + total[0].numel()].view_as(total)
        used += total[0].numel()
        return total / 4 + wibble * (u * 2 * wibble - wibble)

    while step >= 2:
        half = step // 2
        ul = m[:, 0::step, 0::step]
        sq = ul + torch.roll(ul, -1, 1)
        m[:, half::step, half::step] = wibbled(sq + torch.roll(sq, -1, 2))
        dr = m[:, half::step, half::step]
        lt = dr + torch.roll(dr, 1, 1) + ul + torch.roll(ul, -1, 2)
        m[:, 0::step, half::step] = wibbled(lt)
        tt = dr + torch.roll(dr, 1, 2) + ul + torch.roll(ul, -1, 1)
        m[:, half::step, 0::step] = wibbled(tt)
        step //= 2
        wibble /= decay
    m -= m.amin(dim=(1, 2), keepdim=True)
    return m / m.amax(dim=(1, 2), keepdim=True)


@pytest.mark.parametrize("mapsize,decay,batch", [(2, 3.0, 3), (8, 1.75, 5), (32, 1.4, 4)])
def test_plasma_fractal_equals_level_by_level_reference_bitwise(mapsize, decay, batch):
    """Same uniforms (the sample generators' draws, in order) and the same float32 values
    as the per-level construction; a crop is the crop of the whole normalised map."""
    from tta_bench.rng import SampleGenerator

    uniforms = SampleGenerator(range(batch)).uniform(mapsize * mapsize - 1)
    ref = _plasma_reference(uniforms, mapsize, decay)
    out = weather.plasma_fractal(SampleGenerator(range(batch)), mapsize, decay)
    assert out.shape == (batch, mapsize, mapsize) and torch.equal(out, ref)
    crop = (mapsize - mapsize // 4, mapsize - 1)
    cropped = weather.plasma_fractal(SampleGenerator(range(batch)), mapsize, decay, crop=crop)
    assert torch.equal(cropped, ref[:, : crop[0], : crop[1]])
    with pytest.raises(ValueError, match="power of two"):
        weather.plasma_fractal(SampleGenerator(range(batch)), 24, decay)
    with pytest.raises(ValueError, match="inside"):
        weather.plasma_fractal(SampleGenerator(range(batch)), 8, decay, crop=(9, 8))


def _correlate_reference(images: torch.Tensor, kernel: torch.Tensor, mode: str) -> torch.Tensor:
    """``sum_(dy, dx) kernel[dy, dx] * image[fold(y + dy - ry), fold(x + dx - rx)]``."""
    from mura_plugin.shifts._ops import fold_index

    h, w = images.shape[-2:]
    kh, kw = kernel.shape
    out = torch.zeros_like(images)
    for dy in range(kh):
        ys = fold_index(torch.arange(h) + dy - kh // 2, h, mode)
        for dx in range(kw):
            xs = fold_index(torch.arange(w) + dx - kw // 2, w, mode)
            out += kernel[dy, dx] * images[..., ys, :][..., xs]
    return out


@pytest.mark.parametrize(
    "table,severity,size",
    [("digits", 5, 32), ("cifar", 4, 28), ("imagenet", 5, 60), ("cifar", 1, 8)],
)
def test_defocus_blur_equals_the_float64_correlation(table, severity, size):
    """The FFT correlation equals the direct one, reflect-101 border (at 8 px the disk's
    radius reaches the image side: the folded padding)."""
    from mura_plugin.shifts._params import spatial_scale

    x = torch.rand(4, 3, size, size, generator=torch.Generator().manual_seed(size))
    radius, alias = blur.DEFOCUS_BLUR[table][severity - 1]
    scale = spatial_scale(table, x)
    kernel = blur.disk_kernel(radius * scale, alias * scale)
    ref = _correlate_reference(x.double(), kernel, "reflect101").clamp(0.0, 1.0).float()
    out = blur.defocus_blur(x, severity, generator=None, table=table)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
