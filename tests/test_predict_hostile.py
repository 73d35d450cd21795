"""``tta-bench predict`` on hostile folders, with the real default model and digits images:
16-bit PNGs predict as their 8-bit copies; an image over the pixel budget (``max_pixels``)
is refused from its header, never decoded, and named with its size under either
``on_bad_image`` policy; dangling and looping symlinks are listed with their reason."""

from __future__ import annotations

import json
from pathlib import Path

import fixtures_data as fx
import numpy as np
import pytest
from predict_jobs import batch_results, write_job

from tta_bench.cli import main


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def _digits(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``n`` digits test images as 8-bit gray ``[n, 32, 32]`` and their labels."""
    from mura_plugin.datasets.digits import digits_arrays

    x, y = digits_arrays("test")
    return x[:n, :, :, 0], y[:n]


def test_16bit_pngs_predict_exactly_as_their_8bit_copies(tmp_path, digits_stream):
    """The reported failure: 16-bit PNGs were clipped (most of a digit white: 7 of 24
    correct, against 23 of 24 for the 8-bit copies)."""
    from PIL import Image

    classnames = list(digits_stream.classnames)
    gray, labels = _digits(24)
    for depth in (8, 16):
        for i, (img, label) in enumerate(zip(gray, labels)):
            path = tmp_path / f"png{depth}" / classnames[int(label)] / f"{i:03d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            arr = img if depth == 8 else img.astype(np.uint16) * 257
            Image.fromarray(arr).save(path)
            if depth == 16:
                with Image.open(path) as check:
                    assert check.mode == "I;16"
    summaries, results = {}, {}
    for depth in (8, 16):
        out = tmp_path / f"out{depth}"
        job = write_job(tmp_path, input_dir=str(tmp_path / f"png{depth}"), output_dir=str(out))
        assert main(["predict", "--config", str(job), "--quiet"]) == 0
        summaries[depth], results[depth] = _summary(out), batch_results(out)
    assert summaries[8]["images"] == summaries[16]["images"] == 24
    assert summaries[8]["accuracy"] > 0.8
    assert summaries[16]["accuracy"] == summaries[8]["accuracy"]
    for name, eight in results[8].items():
        sixteen = results[16][name]
        assert [p["file"] for p in sixteen["predictions"]] == [
            p["file"] for p in eight["predictions"]
        ]
        assert [p["label"] for p in sixteen["predictions"]] == [
            p["label"] for p in eight["predictions"]
        ]
        assert [p["score"] for p in sixteen["predictions"]] == [
            p["score"] for p in eight["predictions"]
        ]


@pytest.fixture()
def budget_dir(tmp_path):
    """Five digits PNGs, a 48x48 copy of one (2304 pixels) and a 12000 x 12000 PNG."""
    from PIL import Image

    root = tmp_path / "in"
    root.mkdir()
    gray, _ = _digits(5)
    for i, img in enumerate(gray):
        Image.fromarray(img).save(root / f"{i}.png")
    Image.fromarray(gray[0]).resize((48, 48)).save(root / "5-large.png")
    fx.bilevel_png(root / "huge.png", 12000, 12000)
    assert (root / "huge.png").stat().st_size < 64_000
    return root


def test_an_image_over_the_pixel_budget_is_skipped_from_its_header_never_decoded(
    tmp_path, budget_dir, pil_loads, capsys
):

    loaded = pil_loads
    out = tmp_path / "out"
    job = write_job(tmp_path, input_dir=str(budget_dir), output_dir=str(out))  # default budget
    assert main(["predict", "--config", str(job), "--quiet"]) == 0
    assert (12000, 12000) not in loaded, "the oversized image must not be decoded"
    message = (
        "ImageTooLargeError: image 'huge.png' is 12000x12000 = 144000000 pixels; the limit is "
        "40000000 pixels per image (predict job key 'max_pixels')"
    )
    assert f"bad image huge.png (batch batch-00000): {message}" in capsys.readouterr().err
    summary = _summary(out)
    assert summary["status"] == "complete" and summary["images"] == 6
    assert summary["config"]["max_pixels"] == 40_000_000
    expected = {"file": "huge.png", "error": message, "width": 12000, "height": 12000}
    expected["pixels"] = 144_000_000
    assert summary["bad_images"] == [{**expected, "batch": "batch-00000"}]
    (result,) = batch_results(out).values()
    assert result["bad_images"] == [expected]
    assert "huge.png" not in [p["file"] for p in result["predictions"]]


def test_fail_batch_fails_the_batch_holding_an_image_over_the_budget(tmp_path, budget_dir):
    out = tmp_path / "out"
    job = write_job(
        tmp_path,
        input_dir=str(budget_dir),
        output_dir=str(out),
        max_pixels=2000,  # the 32x32 digits pass, the 48x48 copy and the huge file do not
        on_bad_image="fail_batch",
        batch_size=3,
        max_retry=0,
    )
    assert main(["predict", "--config", str(job), "--quiet"]) == 1
    summary = _summary(out)
    assert summary["status"] == "incomplete" and summary["finished_batches"] == 1
    failed = {f["batch"]: f["error"] for f in summary["failed"]}
    # 0.png 1.png 2.png | 3.png 4.png 5-large.png | huge.png: the first batch alone finishes
    assert sorted(failed) == ["batch-00001", "batch-00002"]
    limit = "the limit is 2000 pixels per image (predict job key 'max_pixels')"
    assert failed["batch-00001"] == (
        "BadImagesError: 1 image(s) of batch batch-00001 cannot be decoded: 5-large.png: "
        f"ImageTooLargeError: image '5-large.png' is 48x48 = 2304 pixels; {limit}"
    )
    assert (
        "huge.png: ImageTooLargeError: image 'huge.png' is 12000x12000 = 144000000 "
        in (failed["batch-00002"])
    )
    logs = [json.loads(line) for line in (out / "logs" / "predict.jsonl").read_text().splitlines()]
    assert [(e["batch"], e["status"]) for e in logs] == [
        ("batch-00000", "ok"),
        ("batch-00001", "failed"),
        ("batch-00002", "failed"),
    ]
    assert "5-large.png" in logs[1]["error"] and "48x48" in logs[1]["error"]


def test_a_job_without_max_pixels_resumes_as_one_with_the_default(tmp_path, budget_dir):
    """The default budget leaves the job's fingerprint as it was before the key existed."""
    out = tmp_path / "out"
    before = write_job(tmp_path, input_dir=str(budget_dir), output_dir=str(out))
    assert main(["predict", "--config", str(before), "--quiet"]) == 0
    same = write_job(
        tmp_path, input_dir=str(budget_dir), output_dir=str(out), max_pixels=40_000_000
    )
    assert main(["predict", "--config", str(same), "--quiet"]) == 0
    assert _summary(out)["computed_batches"] == 0 and _summary(out)["skipped_batches"] == 1


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "predict.max_pixels=0 is out of range: it must be >= 1"),
        ("40M", "predict job key 'max_pixels' must be an integer"),
        (True, "predict job key 'max_pixels' must be an integer"),
        (4e7, "predict job key 'max_pixels' must be an integer"),
    ],
)
def test_a_bad_max_pixels_exits_2_naming_it(tmp_path, budget_dir, capsys, value, message):
    job = write_job(
        tmp_path, input_dir=str(budget_dir), output_dir=str(tmp_path / "o"), max_pixels=value
    )
    assert main(["predict", "--config", str(job)]) == 2
    assert message in capsys.readouterr().err


def test_dangling_and_looping_symlinks_are_listed_with_their_reason(
    tmp_path, digits_stream, capsys
):
    from PIL import Image

    classnames = list(digits_stream.classnames)
    gray, labels = _digits(4)
    flat, classes = tmp_path / "flat", tmp_path / "classes"
    for i, (img, label) in enumerate(zip(gray, labels)):
        for path in (flat / f"{i}.png", classes / classnames[int(label)] / f"{i}.png"):
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(img).save(path)
    (flat / "gone.png").symlink_to("missing.png")
    (flat / "loop.png").symlink_to("loop.png")
    (flat / "ping.jpg").symlink_to("pong.jpg")
    (flat / "pong.jpg").symlink_to("ping.jpg")
    (flat / "alias.png").symlink_to("0.png")  # a working symlink is an image like any other
    first_class = classes / classnames[int(labels[0])]
    (first_class / "moved.png").symlink_to(tmp_path / "nowhere" / "moved.png")

    out = tmp_path / "out-flat"
    job = write_job(tmp_path, input_dir=str(flat), output_dir=str(out))
    assert main(["predict", "--config", str(job)]) == 0
    summary = _summary(out)
    assert summary["status"] == "complete" and summary["images"] == 5  # 4 + the alias
    assert summary["ignored_files"] == ["gone.png", "loop.png", "ping.jpg", "pong.jpg"]
    assert summary["ignored_reasons"] == {
        "gone.png": "dangling symlink: its target 'missing.png' does not exist",
        "loop.png": "symlink loop: its target 'loop.png' leads back to it",
        "ping.jpg": "symlink loop: its target 'pong.jpg' leads back to it",
        "pong.jpg": "symlink loop: its target 'ping.jpg' leads back to it",
    }
    err = capsys.readouterr().err
    assert "ignored gone.png: dangling symlink: its target 'missing.png' does not exist" in err

    out = tmp_path / "out-classes"
    job = write_job(tmp_path, input_dir=str(classes), output_dir=str(out))
    assert main(["predict", "--config", str(job), "--quiet"]) == 0
    summary = _summary(out)
    rel = f"{first_class.name}/moved.png"
    assert summary["images"] == 4 and summary["ignored_files"] == [rel]
    target = str(tmp_path / "nowhere" / "moved.png")
    assert summary["ignored_reasons"] == {
        rel: f"dangling symlink: its target {target!r} does not exist"
    }
