"""The runner end to end on the test plugin: the cells of a run, resume (finished cells are
skipped, a killed run continues, stateful protocols resume per seed), and what a method is
handed: images only, never labels."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tta_bench.model import ZeroShotClassifier
from tta_bench.run import results

from .helpers import (
    run,
    scores,
    strict_json,
    subprocess_env,
    tta_bench_cmd,
)

SHIFTS, SEVERITIES = ("noise", "dim"), (1, 3)
#: Relative difference of float metrics (NLL, ECE) between two processes with the same thread
#: count: a few float32 roundings per logit (``2**-24`` each) summed over a 48-wide dot product.
FLOAT_RTOL = 48 * 8 * 2**-24


def _same_scores(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        n, acc, *rest = a[key]
        n2, acc2, *rest2 = b[key]
        assert (n, acc) == (n2, acc2), key
        for x, y in zip(rest, rest2):
            assert (x is None and y is None) or math.isclose(x, y, rel_tol=FLOAT_RTOL), key


def _drop_cells(path: Path, keep) -> None:
    """Hand-edit a results file: keep only the cells for which ``keep(cell)`` holds."""
    record = strict_json(path)
    record["cells"] = [c for c in record["cells"] if keep(c)]
    record["summary"] = results.summarize(record["cells"])
    results.write_json_atomic(path, record)


@pytest.fixture()
def spy():
    from tta_bench_testplugin.methods import Spy

    Spy.calls.clear()
    yield Spy
    Spy.calls.clear()


def _steps(spy) -> int:
    return sum(1 for name, _, _ in spy.calls if name == "step")


def test_a_run_has_one_cell_per_shift_severity_and_seed(tmp_path):
    record = run(tmp_path / "r.json", "zeroshot", seeds=[0, 1])
    keys = {(s, v, seed) for s in SHIFTS for v in SEVERITIES for seed in (0, 1)}
    assert set(scores(record)) == keys and len(record["cells"]) == len(keys)
    for cell in record["cells"]:
        assert cell["n"] == 32 and cell["batches"] == 4
        assert cell["error"] == pytest.approx(1 - cell["accuracy"])
        assert cell["reference_accuracy"] == cell["accuracy"]  # zero-shot is the reference
        assert "diverged" not in cell
    per_seed = [sum(c["accuracy"] for c in record["cells"] if c["seed"] == s) / 4 for s in (0, 1)]
    assert record["summary"]["mean_accuracy"] == pytest.approx(sum(per_seed) / 2)
    assert record["summary"]["n_cells"] == 8
    assert record["seeds"] == [0, 1] and record["method"] == "zeroshot"
    assert strict_json(tmp_path / "r.json") == json.loads(json.dumps(record))  # what run() gave
    again = run(tmp_path / "again.json", "zeroshot", seeds=[0, 1])
    assert scores(again) == scores(record)  # deterministic


def test_scores_follow_the_images_through_the_pipeline(tmp_path):
    """The colour oracle reads each image's class off its colour: every cell scores 1.0
    only if every label is scored against its own image (shuffled stream, shifted)."""
    record = run(tmp_path / "r.json", "colour_oracle", seeds=[3])
    assert [c["accuracy"] for c in record["cells"]] == [1.0] * 4
    adapted = run(tmp_path / "tent.json", "norm_tent", method_args={"lr": 0.05})
    zeroshot = run(tmp_path / "zs.json", "zeroshot")
    assert scores(adapted) != scores(zeroshot)  # the gradient method does adapt
    assert adapted["parameters"]["trainable"] == 2 * 16  # LayerNorm weight and bias
    assert adapted["parameters"]["total"] > 2000


def test_the_method_is_handed_images_only_never_labels(tmp_path, spy):
    run(tmp_path / "r.json", "spy")
    steps = [(args, kwargs) for name, args, kwargs in spy.calls if name == "step"]
    assert len(steps) == 16  # 4 cells x 4 batches
    for args, kwargs in steps:
        assert kwargs == {} and len(args) == 1
        (images,) = args
        assert images.dtype == torch.float32 and images.shape[1:] == (3, 16, 16)
        assert float(images.min()) >= 0.0 and float(images.max()) <= 1.0
    for name, args, kwargs in spy.calls:
        if name == "__init__":
            model, config = args
            assert isinstance(model, ZeroShotClassifier)
            assert {n for n, _ in model.named_buffers()} == {"mean", "std", "class_embeddings"}
        elif name == "reseed":
            assert len(args) == 1 and type(args[0]) is int and kwargs == {}
        else:
            assert name in ("setup", "reset", "step"), name
    assert "set_source" not in {name for name, _, _ in spy.calls}


def test_a_method_needing_source_images_gets_unlabeled_source_split_images(tmp_path):
    from tta_bench_testplugin.data import synthetic
    from tta_bench_testplugin.methods import NeedsSource

    NeedsSource.received.clear()
    record = run(tmp_path / "r.json", "needs_source", method_args={"n": 6})
    assert len(record["cells"]) == 4
    assert len(NeedsSource.received) == 4  # one fresh instance per cell
    train = synthetic(split="train")
    test = synthetic(split="test")

    def pixels(stream):
        import numpy as np

        rows = [np.asarray(stream.dataset[i]["image"].convert("RGB")) for i in range(len(stream))]
        return torch.from_numpy(np.stack(rows)).permute(0, 3, 1, 2).float() / 255.0

    train_px, test_px = pixels(train), pixels(test)
    for args, kwargs in NeedsSource.received:
        assert kwargs == {} and len(args) == 1
        (images,) = args
        assert images.shape == (6, 3, 16, 16) and images.dtype == torch.float32
        for img in images:  # each one a clean train image, none a test image
            assert any(torch.equal(img, t) for t in train_px)
            assert not any(torch.equal(img, t) for t in test_px)
    NeedsSource.received.clear()


def test_a_method_needing_source_labels_gets_the_source_splits_own_labels(tmp_path):
    import numpy as np
    from tta_bench_testplugin.data import synthetic
    from tta_bench_testplugin.methods import NeedsSource

    NeedsSource.received.clear()
    run(tmp_path / "r.json", "needs_source", method_args={"n": 6, "labels": True})
    assert len(NeedsSource.received) == 4
    train = synthetic(split="train")
    rows = [np.asarray(train.dataset[i]["image"].convert("RGB")) for i in range(len(train))]
    train_px = torch.from_numpy(np.stack(rows)).permute(0, 3, 1, 2).float() / 255.0
    train_y = torch.as_tensor(np.asarray(train.labels), dtype=torch.int64)
    for args, kwargs in NeedsSource.received:
        assert kwargs == {} and len(args) == 2
        images, labels = args
        assert labels.shape == (6,) and labels.dtype == torch.int64
        for img, y in zip(images, labels):  # each label the one of its own train image
            match = [j for j, t in enumerate(train_px) if torch.equal(img, t)]
            assert match and all(int(train_y[j]) == int(y) for j in match)
    NeedsSource.received.clear()


def test_labelled_source_from_a_split_that_is_not_for_training_is_refused(tmp_path):
    import dataclasses

    from tta_bench.run.inputs import check_labelled_source
    from tta_bench.run.protocol import load_protocol

    base = load_protocol("tiny-shifts")
    check_labelled_source(base)  # split train: fine
    leaky = dataclasses.replace(base, source={"dataset": "synthetic", "dataset_args": {}})
    with pytest.raises(ValueError, match=r"split .the dataset's default split., not a training"):
        check_labelled_source(leaky, "rmt")
    test_split = {"dataset": "synthetic", "dataset_args": {"split": "test"}}
    with pytest.raises(ValueError, match=r"rmt trains on the labels .* split 'test'"):
        check_labelled_source(dataclasses.replace(base, source=test_split), "rmt")


def test_a_finished_run_returns_without_building_anything(tmp_path):
    from tta_bench_testplugin import model

    out = tmp_path / "r.json"
    first = run(out, "zeroshot")
    built = model.builds
    again = run(out, "zeroshot")
    assert model.builds == built
    assert again["skipped_cells"] == 4
    assert scores(again) == scores(first)


def test_resume_skips_finished_cells_and_redoes_the_missing_ones(tmp_path, spy):
    out = tmp_path / "r.json"
    first = run(out, "spy")
    _drop_cells(out, lambda c: c["shift"] == "noise")
    spy.calls.clear()
    resumed = run(out, "spy")
    assert resumed["skipped_cells"] == 2
    assert _steps(spy) == 8  # the two dim cells, 4 batches each; nothing else ran
    assert scores(resumed) == scores(first)
    assert scores(strict_json(out)) == scores(first)


def test_resuming_with_other_seeds_lists_every_seed_the_file_holds(tmp_path):
    out = tmp_path / "r.json"
    run(out, "zeroshot", seeds=[0])
    record = run(out, "zeroshot", seeds=[1])
    held = sorted({c["seed"] for c in strict_json(out)["cells"]})
    assert held == [0, 1]
    assert strict_json(out)["seeds"] == held, "the file's seeds omit seeds its cells hold"
    assert record["seeds"] == held


@pytest.mark.slow
def test_a_killed_run_resumes_where_it_stopped(tmp_path):
    out = tmp_path / "r.json"
    args = ["run", "--method", "sleepy", "--output", str(out), "--quiet", "device=cpu"]
    args += ["method.seconds=0.1"]
    env = subprocess_env(OMP_NUM_THREADS=str(torch.get_num_threads()))
    proc = subprocess.Popen(
        tta_bench_cmd(*args), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 120
        cells = 0
        while cells == 0 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
            if out.exists():
                cells = len(strict_json(out)["cells"])  # always a whole file
        assert proc.poll() is None, proc.communicate()
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    partial = strict_json(out)
    assert 1 <= len(partial["cells"]) < 4, "the run was not killed mid-way"
    assert "finished" not in partial
    resumed = run(out, "sleepy", method_args={"seconds": 0.1})
    assert resumed["skipped_cells"] == len(partial["cells"])
    assert len(resumed["cells"]) == 4
    assert not list(tmp_path.glob(".r.json.*.tmp"))
    # The same numbers as an uninterrupted run (sleepy predicts like zeroshot).
    _same_scores(
        {k: v[:2] + v[4:] for k, v in scores(resumed).items()},
        {k: v[:2] + v[4:] for k, v in scores(run(tmp_path / "z.json", "zeroshot")).items()},
    )


def test_a_stateful_protocol_resumes_per_seed(tmp_path, spy):
    out = tmp_path / "r.json"
    run(out, "spy", "tiny-continual", seeds=[0])
    spy.calls.clear()
    both = run(out, "spy", "tiny-continual", seeds=[0, 1])
    assert both["skipped_cells"] == 4 and _steps(spy) == 16  # seed 1, whole
    # A seed with some of its cells missing is redone whole: its cells depend on each other.
    _drop_cells(out, lambda c: not (c["seed"] == 1 and c["shift"] == "dim"))
    spy.calls.clear()
    again = run(out, "spy", "tiny-continual", seeds=[0, 1])
    assert again["skipped_cells"] == 4 and _steps(spy) == 16
    assert scores(again) == scores(both)


def test_an_adapting_method_resumed_mid_seed_gives_the_uninterrupted_numbers(tmp_path):
    tent = {"method_args": {"lr": 0.05}}
    whole = run(tmp_path / "whole.json", "norm_tent", "tiny-continual", seeds=[0], **tent)
    fresh = run(tmp_path / "fresh.json", "norm_tent", "tiny-shifts", seeds=[0], **tent)
    assert scores(whole) != scores(fresh)  # continual state matters for these numbers
    out = tmp_path / "r.json"
    run(out, "norm_tent", "tiny-continual", seeds=[0], **tent)
    _drop_cells(out, lambda c: c["shift"] == "noise")
    resumed = run(out, "norm_tent", "tiny-continual", seeds=[0], **tent)
    assert resumed["skipped_cells"] == 0
    assert scores(resumed) == scores(whole)
