"""The Python ``Adapter`` and ``Prediction`` against careless or hostile arguments: NaN
refused where infinity is (and the adapter not poisoned by the refused call), wrong
argument types named, numpy images, ``top_k`` out of range, and the per-image pixel budget
``predict`` and ``serve`` apply, checked before an image is decoded. The real default
model and digits images; ``predict`` and ``serve`` against NaN in a float image too."""

from __future__ import annotations

import io
import json
import warnings

import fixtures_data as fx
import numpy as np
import pytest
import torch
from PIL import Image

from tta_bench.deploy.adapter import Adapter, Prediction


@pytest.fixture(scope="module")
def digits() -> np.ndarray:
    """The first 4 digits test images, uint8 ``[4, 32, 32, 3]``."""
    from mura_plugin.datasets.digits import digits_arrays

    x, _ = digits_arrays("test")
    return x[:4]


def _tent(bundle) -> Adapter:
    """An adapter whose state a bad batch would change (Tent: LayerNorm affines)."""
    return Adapter.from_bundle(
        bundle, dataset="digits", method="tent", overrides={"lr": 0.05}, device="cpu"
    )


def _float_image(values: np.ndarray) -> Image.Image:
    """A 32-bit float (mode ``F``) PIL image: the mode of float TIFFs and float arrays."""
    return Image.fromarray(values.astype(np.float32), mode="F")


# -- 2. NaN is refused where infinity is, and poisons nothing --------------------------------
def _with(value: float, kind: str, digits: np.ndarray):
    """A batch holding one ``value`` pixel, as ``kind`` of input."""
    if kind == "tensor":
        x = torch.from_numpy(digits).permute(0, 3, 1, 2).float() / 255
        x[1, 2, 5, 7] = value
        return x
    if kind == "array":
        x = digits[:2].astype(np.float32) / 255
        x[1, 5, 7, 2] = value
        return [x[0], x[1]]
    gray = digits[0, :, :, 0].astype(np.float32) / 255
    gray[5, 7] = value
    return [_float_image(gray)]


@pytest.mark.parametrize("kind", ["tensor", "array", "pil"])
def test_nan_is_refused_like_inf_and_leaves_the_adapter_as_it_was(default_bundle, digits, kind):
    """The reported fault: one NaN pixel passed silently and made every later prediction
    NaN until ``reset()``. Now refused as infinity is (a ValueError naming NaN), before the
    method sees the batch: afterwards the adapter predicts exactly as a twin that never
    saw it (not poisoned, its call counter unchanged)."""
    clean = torch.from_numpy(digits).permute(0, 3, 1, 2).float() / 255
    adapter, twin = _tent(default_bundle), _tent(default_bundle)
    first = adapter(clean)
    assert torch.equal(first.logits, twin(clean).logits)
    with pytest.raises(ValueError) as inf:
        adapter(_with(float("inf"), kind, digits))
    with pytest.raises(ValueError) as nan:
        adapter(_with(float("nan"), kind, digits))
    assert "NaN" in str(nan.value), str(nan.value)
    assert str(inf.value).split(" ")[:2] == str(nan.value).split(" ")[:2]  # the same kind
    after, expected = adapter(clean), twin(clean)
    assert torch.isfinite(after.scores).all()
    torch.testing.assert_close(after.logits, expected.logits, rtol=0, atol=0)


def _float_tiff(values: np.ndarray) -> bytes:
    buf = io.BytesIO()
    _float_image(values).save(buf, format="TIFF")
    return buf.getvalue()


def test_predict_and_serve_refuse_nan_in_a_float_image(tmp_path, default_bundle, digits):
    """The other input paths: a float TIFF with one NaN pixel is a bad image ``predict``
    names (and skips) and ``serve`` answers 422, as it does for infinity."""
    from predict_jobs import write_job

    from tta_bench.cli import main

    gray = digits[0, :, :, 0].astype(np.float32) / 255
    bad = {}
    for name, value in (("nan", float("nan")), ("inf", float("inf"))):
        poisoned = gray.copy()
        poisoned[5, 7] = value
        bad[name] = _float_tiff(poisoned)
    root = tmp_path / "in"
    root.mkdir()
    Image.fromarray(digits[1]).save(root / "ok.png")
    for name, data in bad.items():
        (root / f"{name}.tif").write_bytes(data)
    out = tmp_path / "out"
    job = write_job(tmp_path, input_dir=str(root), output_dir=str(out))
    assert main(["predict", "--config", str(job), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    errors = {b["file"]: b["error"] for b in summary["bad_images"]}
    assert sorted(errors) == ["inf.tif", "nan.tif"] and summary["images"] == 1
    assert "NaN" in errors["nan.tif"], errors

    pytest.importorskip("fastapi")
    import httpx

    from tta_bench.deploy.serve import Limits, Service, running

    service = Service(Adapter.from_bundle(default_bundle, dataset="digits", device="cpu"), Limits())
    with running(service) as url, httpx.Client(base_url=url, timeout=60) as client:
        for name, data in bad.items():
            files = [("image", (f"{name}.tif", data, "image/tiff"))]
            r = client.post("/predict", files=files)
            assert r.status_code == 422, r.text
            assert "NaN" in r.json()["detail"], r.text


# -- 3. wrong argument types are named --------------------------------------------------------
def test_wrong_argument_types_name_the_argument(default_bundle, digits):
    adapter = Adapter.from_bundle(default_bundle, dataset="digits", device="cpu")
    clean = torch.from_numpy(digits).permute(0, 3, 1, 2).float() / 255
    cases = [
        (lambda: Adapter.from_registry(method=123), r"method must be .*name.*got int 123"),
        (lambda: Adapter.from_registry(model=4.5), r"model must be .*name.*got float 4.5"),
        (lambda: adapter(123), r"images must be .*got int"),
        (lambda: adapter({"a": 1}), r"images must be .*got dict"),
        (lambda: adapter([]), r"no images"),
        (lambda: adapter([digits[0], None]), r"images\[1\] is None; expected"),
        (lambda: adapter([digits[0], 7]), r"images\[1\] is an int \(7\); expected"),
        (lambda: adapter(clean, seed="a"), r"seed must be an integer .*, got 'a'"),
        (lambda: adapter(clean, seed=True), r"seed must be an integer .*, got True"),
        (lambda: adapter(clean, seed=2**64), rf"seed must be an integer .*, got {2**64}"),
        (lambda: adapter.preprocess(clean), r"preprocess takes .*a float tensor"),
        (
            lambda: Adapter.from_bundle(default_bundle, dataset="digits", seed="a"),
            r"seed must be an integer .*, got 'a'",
        ),
        (
            lambda: Adapter.from_bundle(default_bundle, classnames="cat,dog"),
            r"classnames must be a list of class names.*got the string 'cat,dog'",
        ),
    ]
    for call, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            call()
    with pytest.raises(ValueError):  # the one class of bad input the docs promise
        adapter(None)
    assert adapter(clean, seed=np.int64(3)).logits.shape == (4, 10)
    assert adapter(clean, seed=-1).logits.shape == (4, 10)  # torch takes negative seeds


def test_numpy_images_are_images_as_pil_images_are(default_bundle, digits):
    """``[H, W, 3]`` (or gray ``[H, W]``) arrays, uint8 or float on the 0..1 scale, one or a
    batch ``[B, H, W, 3]``, predict as the same PIL images; anything else is named."""
    adapter = Adapter.from_bundle(default_bundle, dataset="digits", device="cpu")
    big = np.stack([np.asarray(Image.fromarray(d).resize((40, 48))) for d in digits[:2]])
    want = adapter([Image.fromarray(b) for b in big]).logits
    assert torch.equal(adapter(big).logits, want)  # a batch array
    assert torch.equal(adapter([big[0], big[1]]).logits, want)
    assert torch.equal(adapter(big.astype(np.float64) / 255).logits, want)  # float, 0..1
    torch.testing.assert_close(adapter(big[0]).logits, want[:1], rtol=0, atol=1e-5)  # one
    gray = big[0, :, :, 0]
    assert torch.equal(adapter(gray).logits, adapter(Image.fromarray(gray)).logits)
    refused = [
        (big.astype(np.float32), r"images\[0\].*float.*0\.\.1.*got values in \[0, 255\]"),
        (big.astype(np.int64), r"images\[0\] has dtype int64; expected uint8 or float"),
        (big[0].transpose(2, 0, 1), r"images has shape \(3, 48, 40\); expected .*\[H, W, 3\]"),
        (np.zeros((8, 8, 4), np.uint8), r"images has shape \(8, 8, 4\); expected"),
        (np.zeros((1, 2, 8, 8, 3), np.uint8), r"images has shape \(1, 2, 8, 8, 3\)"),
        (np.zeros((0, 8), np.uint8), r"images has shape \(0, 8\): no pixels"),
    ]
    for images, message in refused:
        with pytest.raises(ValueError, match=message):
            adapter(images)


# -- 4. Prediction.top_k ---------------------------------------------------------------------
def test_top_k_takes_an_integer_from_1_and_clips_at_the_classes(default_bundle, digits):
    adapter = Adapter.from_bundle(default_bundle, dataset="digits", device="cpu")
    pred = adapter(torch.from_numpy(digits).permute(0, 3, 1, 2).float() / 255)
    for k in (0, -1, 1.5, "3", True, None):
        with pytest.raises(ValueError, match=rf"k must be an integer >= 1.*got {k!r}"):
            pred.top_k(k)
        with pytest.raises(ValueError, match=rf"k must be an integer >= 1.*got {k!r}"):
            pred.records(k)
    assert [len(t) for t in pred.top_k(1)] == [1] * 4
    assert [len(t) for t in pred.top_k(np.int64(2))] == [2] * 4
    assert [len(t) for t in pred.top_k(100)] == [10] * 4  # clipped at the 10 classes
    assert "clipped" in Prediction.top_k.__doc__ and "clipped" in Prediction.records.__doc__


# -- 5. the pixel budget of predict and serve, before decoding -------------------------------
def test_the_adapter_refuses_an_image_over_the_pixel_budget_before_decoding_it(
    tmp_path, default_bundle, pil_loads
):
    """A 12000 x 12000 PNG (20 KB) that ``predict`` and ``serve`` refuse from its header
    was decoded whole by the Adapter; now refused by the one declared budget, as a path,
    as a lazily opened PIL image and as bytes, with no pixel decoded."""

    from tta_bench.deploy import DEFAULT_MAX_PIXELS
    from tta_bench.deploy.job import PredictJob
    from tta_bench.run.images import ImageTooLargeError

    huge = fx.bilevel_png(tmp_path / "huge.png", 12000, 12000)
    assert huge.stat().st_size < 64_000
    adapter = Adapter.from_bundle(default_bundle, dataset="digits", device="cpu")
    assert adapter.max_pixels == DEFAULT_MAX_PIXELS == PredictJob("i", "o").max_pixels
    assert adapter.spawn().max_pixels == DEFAULT_MAX_PIXELS
    loaded = pil_loads
    message = (
        rf"is 12000x12000 = 144000000 pixels; the limit is {DEFAULT_MAX_PIXELS} pixels per "
        r"image \(Adapter.max_pixels\)"
    )
    with warnings.catch_warnings():  # the test's own open: PIL warns of the bomb
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        lazy = Image.open(huge)
    with lazy, warnings.catch_warnings():
        warnings.simplefilter("error")  # and the adapter's refusal warns of nothing
        for images in (huge, str(huge), [lazy], huge.read_bytes()):
            with pytest.raises(ImageTooLargeError, match=message):
                adapter(images)
    assert (12000, 12000) not in loaded, "the oversized image must not be decoded"

    small = Image.fromarray(np.zeros((48, 48, 3), np.uint8))
    adapter.max_pixels = 2000
    with pytest.raises(ImageTooLargeError, match=r"48x48 = 2304 pixels; the limit is 2000"):
        adapter([small])
    with pytest.raises(ImageTooLargeError, match=r"48x48 = 2304 pixels; the limit is 2000"):
        adapter(np.zeros((48, 48, 3), np.uint8))
    adapter.max_pixels = 100_000  # 1 x 4000 resizes to 32 x 128000: past the budget
    with pytest.raises(ImageTooLargeError, match=r"resizing .* makes 32x128000 = 4096000"):
        adapter([Image.new("L", (1, 4000))])
    assert adapter.preprocess([small], max_pixels=3000).shape == (1, 3, 32, 32)
    for bad in (0, -5, 1.5, "40M", True):
        with pytest.raises(ValueError, match=rf"max_pixels must be an integer >= 1, got {bad!r}"):
            adapter.max_pixels = bad
