"""``tta-bench predict``: a batch job over an image folder, on real digits images written as
PNG/JPEG files (one corrupt), with the real default model; results are checked against the
standalone adapter on the same files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from predict_jobs import batch_results, write_job

from tta_bench.cli import main

CORRUPT = "three/corrupt.png"


def _write_images(root: Path, n: int, classnames: list[str], labeled: bool) -> list[str]:
    """The first ``n`` digits test images as files under ``root``: mostly PNG (lossless: the
    pixels of the dataset), every 5th a JPEG, every 7th upscaled to 40x48 (so it goes
    through the resize and crop); labeled: in class subfolders."""
    from PIL import Image

    from mura_plugin.datasets.digits import digits_arrays

    x, y = digits_arrays("test")
    written = []
    for i in range(n):
        img = Image.fromarray(x[i])
        if i % 7 == 3:
            img = img.resize((40, 48), Image.BICUBIC)
        ext = ".jpg" if i % 5 == 4 else ".png"
        rel = f"{classnames[int(y[i])]}/{i:04d}{ext}" if labeled else f"{i:04d}{ext}"
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        img.save(path, quality=95) if ext == ".jpg" else img.save(path)
        written.append(rel)
    return written


def _corrupt(path: Path) -> None:
    """A truncated PNG: the first 60 bytes of a real one (the header parses, decoding fails)."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    good = path.with_suffix(".tmp.png")
    Image.fromarray(np.full((32, 32, 3), 200, np.uint8)).save(good)
    path.write_bytes(good.read_bytes()[:60])
    good.unlink()


@pytest.fixture(scope="module")
def classnames(digits_stream):
    return list(digits_stream.classnames)


@pytest.fixture(scope="module")
def labeled_dir(tmp_path_factory, classnames):
    root = tmp_path_factory.mktemp("labeled")
    _write_images(root, 40, classnames, labeled=True)
    _corrupt(root / CORRUPT)
    (root / "three" / "notes.txt").write_text("not an image")
    return root


@pytest.fixture(scope="module")
def flat_dir(tmp_path_factory, classnames):
    root = tmp_path_factory.mktemp("flat")
    _write_images(root, 20, classnames, labeled=False)
    return root


def _adapter_replay(bundle, input_dir: Path, results: dict, method: str, reset: str, **kw):
    """What the standalone adapter predicts for the batches the job formed (same files in
    the same order, the same resets)."""
    from tta_bench.deploy.adapter import Adapter

    adapter = Adapter.from_bundle(bundle, dataset="digits", method=method, device="cpu", **kw)
    out = {}
    for name in sorted(results):
        if reset == "per_batch":
            adapter.reset()
        files = [input_dir / p["file"] for p in results[name]["predictions"]]
        out[name] = adapter(adapter.preprocess(files))
    return out


#: An online MuRA on both towers that updates on every second batch only (the article's
#: lighter deployment): the job must replay exactly as the standalone adapter steps.
ONLINE_MURA = {"episodic": "online", "adapt_every": 2, "towers": "both", "views": 3, "lr": 0.01}


@pytest.mark.parametrize(
    ("method", "reset", "overrides"),
    [
        ("tent", "never", {"steps": 1}),
        ("mura", "per_batch", {"views": 15}),
        ("mura", "never", ONLINE_MURA),
    ],
)
def test_labeled_folder_matches_the_adapter_and_reports_accuracy(
    tmp_path, labeled_dir, default_bundle, method, reset, overrides, capsys
):
    out = tmp_path / "out"
    job = write_job(
        tmp_path,
        input_dir=str(labeled_dir),
        output_dir=str(out),
        method=method,
        reset=reset,
        top_k=3,
        overrides=overrides if method == "tent" else [f"{k}={v}" for k, v in overrides.items()],
    )
    assert main(["predict", "--config", str(job)]) == 0
    printed = capsys.readouterr()
    assert "accuracy" in printed.out and "corrupt.png" in printed.err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["layout"] == "classes" and summary["labeled"] is True
    assert summary["status"] == "complete" and summary["batches"] == 6  # 41 files / 8
    assert [b["file"] for b in summary["bad_images"]] == [CORRUPT]
    assert summary["ignored_files"] == ["three/notes.txt"]
    results = batch_results(out)
    assert len(results) == 6 and summary["images"] == 40
    expected = _adapter_replay(
        default_bundle, labeled_dir, results, method, reset, overrides=overrides
    )
    correct = 0
    for name, result in results.items():
        pred = expected[name]
        assert [p["label"] for p in result["predictions"]] == pred.labels
        got = torch.tensor([p["score"] for p in result["predictions"]])
        torch.testing.assert_close(got, pred.scores, rtol=0, atol=1e-6)
        for p, top in zip(result["predictions"], pred.top_k(3)):
            assert [t["label"] for t in p["top_k"]] == [lab for lab, _ in top]
            assert p["true_label"] == Path(p["file"]).parts[0]
            correct += p["correct"]
    assert summary["accuracy"] == pytest.approx(correct / 40)
    assert summary["accuracy"] > 0.5  # clean digits: the model is far above chance
    # the corrupt file is reported in its batch's result, the rest of the batch predicted
    with_bad = [r for r in results.values() if r["bad_images"]]
    assert len(with_bad) == 1 and with_bad[0]["n"] == len(with_bad[0]["files"]) - 1
    logs = [json.loads(line) for line in (out / "logs" / "predict.jsonl").read_text().splitlines()]
    assert [entry["status"] for entry in logs] == ["ok"] * 6
    for entry in logs:
        assert entry["loss"] is not None and entry["seconds"]["total"] > 0
        assert entry["memory_bytes"] > 0
    assert not list(out.glob(".*.tmp"))


def test_flat_folder_of_unlabeled_images(tmp_path, flat_dir):
    out = tmp_path / "out"
    job = write_job(tmp_path, input_dir=str(flat_dir), output_dir=str(out), top_k=20)
    assert main(["predict", "--config", str(job), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["layout"] == "folder" and summary["accuracy"] is None
    results = batch_results(out)
    assert list(results) == ["batch-00000", "batch-00001", "batch-00002"]
    first = results["batch-00000"]["predictions"][0]
    assert first["file"] == "0000.png" and "correct" not in first
    assert len(first["top_k"]) == 10  # top_k is capped at the number of classes
    assert first["top_k"][0]["label"] == first["label"]
    assert sum(t["score"] for t in first["top_k"]) == pytest.approx(1.0, abs=1e-5)


def test_subfolders_are_batches(tmp_path, flat_dir):
    from PIL import Image

    root = tmp_path / "cams"
    for folder, count in (("cam a", 3), ("cam-b", 11)):
        for i in range(count):
            (root / folder).mkdir(parents=True, exist_ok=True)
            src = sorted(flat_dir.glob("*.png"))[i]
            Image.open(src).save(root / folder / f"{i}.png")
    out = tmp_path / "out"
    job = write_job(
        tmp_path, input_dir=str(root), output_dir=str(out), reset="per_folder", method="tent"
    )
    assert main(["predict", "--config", str(job), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["layout"] == "subfolders"
    assert sorted(batch_results(out)) == ["cam-b-00000", "cam-b-00001", "cam_a"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bogus": 1}, "unknown predict job key(s) 'bogus'; known keys: input_dir, output_dir"),
        ({"batch_size": "8"}, "'batch_size' must be an integer"),
        ({"batch_size": True}, "'batch_size' must be an integer"),
        ({"reset": "sometimes"}, "predict.reset='sometimes'; available: per_batch, per_folder"),
        ({"layout": "flat"}, "predict.layout='flat'; available: auto, folder, subfolders, classes"),
        ({"method": "mrua"}, "Did you mean 'mura'"),
        ({"overrides": {"lr": "fast"}}, "lr"),
        ({"overrides": {"rank": 4}, "method": "mura"}, "unknown mura option(s) 'rank'; known:"),
        ({"reset": "per_folder"}, "class (label) boundaries"),
        ({"input_dir": "missing"}, "is not a folder"),
    ],
)
def test_bad_job_exits_2_naming_the_problem(tmp_path, labeled_dir, capsys, change, message):
    cfg = {"input_dir": str(labeled_dir), "output_dir": str(tmp_path / "out"), **change}
    assert main(["predict", "--config", str(write_job(tmp_path, **cfg))]) == 2
    assert message in capsys.readouterr().err


def test_ambiguous_layout_is_an_error(tmp_path, flat_dir, capsys):
    root = tmp_path / "mixed"
    (root / "one").mkdir(parents=True)
    (root / "elsewhere").mkdir()
    for d in ("one", "elsewhere"):
        (root / d / "a.png").write_bytes(next(flat_dir.glob("*.png")).read_bytes())
    job = write_job(tmp_path, input_dir=str(root), output_dir=str(tmp_path / "out"))
    assert main(["predict", "--config", str(job)]) == 2
    assert "ambiguous layout" in capsys.readouterr().err


@pytest.mark.parametrize(("reset", "recomputed"), [("per_batch", 1), ("never", 6)])
def test_failing_batch_is_retried_reported_and_redone_on_rerun(
    tmp_path, labeled_dir, reset, recomputed, capsys
):
    """fail_batch: the batch with the corrupt file fails max_retry + 1 times and is
    reported, the others finish; with the file replaced, a rerun computes only what is
    unfinished (with reset=never the stream shares state: the whole stream again)."""
    import shutil

    from PIL import Image

    data = tmp_path / "data"
    shutil.copytree(labeled_dir, data)
    out = tmp_path / "out"
    job = write_job(
        tmp_path,
        input_dir=str(data),
        output_dir=str(out),
        method="tent",
        on_bad_image="fail_batch",
        max_retry=2,
        reset=reset,
    )
    assert main(["predict", "--config", str(job), "--quiet"]) == 1
    assert "failed batch" in capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "incomplete" and len(summary["failed"]) == 1
    failed = summary["failed"][0]
    assert failed["attempts"] == 3 and CORRUPT in failed["error"]
    assert summary["finished_batches"] == 5
    logs = [json.loads(line) for line in (out / "logs" / "predict.jsonl").read_text().splitlines()]
    attempts = [e["attempt"] for e in logs if e["batch"] == failed["batch"]]
    assert attempts == [1, 2, 3] and all(
        e["status"] == "failed" for e in logs if e["batch"] == failed["batch"]
    )
    assert not (out / f"{failed['batch']}_result.json").exists()

    Image.fromarray(np.full((32, 32, 3), 30, np.uint8)).save(data / CORRUPT)  # repaired
    assert main(["predict", "--config", str(job), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["finished_batches"] == 6
    assert summary["computed_batches"] == recomputed
    assert summary["skipped_batches"] == 6 - recomputed
    assert summary["bad_images"] == [] and summary["images"] == 41


def test_other_jobs_results_are_not_mixed_in(tmp_path, flat_dir, capsys):
    out = tmp_path / "out"
    first = write_job(tmp_path, input_dir=str(flat_dir), output_dir=str(out))
    assert main(["predict", "--config", str(first), "--quiet"]) == 0
    other = write_job(tmp_path, input_dir=str(flat_dir), output_dir=str(out), method="tent")
    assert main(["predict", "--config", str(other), "--quiet"]) == 2
    assert "holds results of another job" in capsys.readouterr().err
    fresh = write_job(
        tmp_path, input_dir=str(flat_dir), output_dir=str(out), method="tent", resume=False
    )
    assert main(["predict", "--config", str(fresh), "--quiet"]) == 0
    assert all(r["method"] == "tent" for r in batch_results(out).values())


@pytest.mark.slow
def test_killed_job_resumes_where_it_stopped(tmp_path, labeled_dir):
    """SIGKILL the job once a batch is written; the rerun skips the finished batches and
    ends with the results of an uninterrupted run."""
    cfg = {
        "input_dir": str(labeled_dir),
        "method": "mura",
        "batch_size": 2,
        "overrides": {"steps": 2},
    }
    out = tmp_path / "killed"
    job = write_job(tmp_path, output_dir=str(out), **cfg)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tta_bench.cli", "predict", "--config", str(job), "--quiet"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not list(out.glob("*_result.json")):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "no batch finished in time"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
        proc.stderr.close()
    done = len(list(out.glob("*_result.json")))
    assert 0 < done < 21, "the job must be killed midway"
    assert main(["predict", "--config", str(job), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_batches"] == done and summary["computed_batches"] == 21 - done
    assert not list(out.glob(".*.tmp"))

    reference = tmp_path / "reference"
    assert (
        main(["predict", "--config", str(write_job(tmp_path, output_dir=str(reference), **cfg))])
        == 0
    )
    got, want = batch_results(out), batch_results(reference)
    assert sorted(got) == sorted(want)
    for name in want:
        g, w = got[name]["predictions"], want[name]["predictions"]
        assert [p["label"] for p in g] == [p["label"] for p in w], name
        np.testing.assert_allclose([p["score"] for p in g], [p["score"] for p in w], atol=1e-5)
