"""One cell split over N parts (protocol.shard=i/N) and merged back (tta-bench merge): the
merged cell equals the unsharded one exactly, for both episodic reset policies; parts of
different runs, missing or repeated parts, and online protocols are refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tta_bench.report import leaderboard as report
from tta_bench.run import results, runner, samples, shard
from tta_bench.run.resolve import UsageError, resolve_run
from tta_bench.run.resume import ResumeMismatchError

#: Long: run first, so that pytest-xdist's workers share them out (tests/conftest.py).
pytestmark = pytest.mark.slow

SCORES = (
    *("shift", "severity", "seed", "n", "accuracy", "nll", "ece", "error"),
    *("reference_accuracy", "forward_passes_per_sample", "backward_passes_per_sample"),
    "batches",
)
#: Seven augmented views, not MuRA's official 63: a merge is exact for any view count. The
#: per-sample files keep the logits.
EPISODIC_BATCH = ["protocol.reset=episodic_batch", "protocol.shifts=[contrast,fog]",
                  "protocol.max_images=30", "protocol.batch_size=5", "seeds=[0,1]",
                  "progress=false", "method.views=7", "log_samples=logits"]  # fmt: skip


def _run(method: str, overrides: list[str], output):
    _, spec = resolve_run(method=method, overrides=overrides)
    return runner.run(spec, output)


def _scores(record):
    return [{k: c.get(k) for k in SCORES} for c in record["cells"]]


@pytest.fixture(scope="module")
def mura_parts(tmp_path_factory):
    """MuRA (augmented views, adapted and reset per batch) unsharded, and in 4 parts."""
    d = tmp_path_factory.mktemp("mura")
    whole = _run("mura", EPISODIC_BATCH, d / "whole.json")
    parts = [d / f"part{i}.json" for i in range(4)]
    for i, path in enumerate(parts):
        _run("mura", [*EPISODIC_BATCH, f"protocol.shard={i}/4"], path)
    return d, whole, parts


def test_four_parts_merged_equal_the_unsharded_run_exactly(mura_parts):
    d, whole, parts = mura_parts
    part = results.load_results(parts[1])
    assert part["shard"] == {"index": 1, "count": 4}
    assert part["protocol"]["id"] == whole["protocol"]["id"]  # the shard is not in the id
    assert sum(c["n"] for c in part["cells"]) < sum(c["n"] for c in whole["cells"])
    merged = shard.merge_parts(parts, d / "merged.json")
    assert "shard" not in merged and merged["merged_shards"]["count"] == 4
    assert _scores(merged) == _scores(whole)  # counts, accuracy, NLL, ECE: bit for bit
    assert merged["summary"]["mean_accuracy"] == whole["summary"]["mean_accuracy"]
    assert merged["summary"]["accuracy_ci95"] == whole["summary"]["accuracy_ci95"]
    # the merged per-sample rows, logits included, are the unsharded run's, in stream order
    for cell in merged["cells"]:
        key = results.cell_key(cell)
        a = samples.read_cell(samples.samples_dir(d / "merged.json"), *key)
        b = samples.read_cell(samples.samples_dir(d / "whole.json"), *key)
        for column in ("index", "batch", "label", "prediction"):
            assert a.column(column).to_pylist() == b.column(column).to_pylist(), column
        la, _ = samples.logits_and_labels(a)
        lb, _ = samples.logits_and_labels(b)
        assert np.array_equal(la, lb)


def test_a_part_per_sample_reset_protocol_merges_exactly(tmp_path):
    """``episodic_sample``: batch size 1, TENT adapted and reset on every image."""
    base = ["protocol.reset=episodic_sample", "protocol.shifts=[contrast]",
            "protocol.max_images=9", "seeds=[0]", "progress=false"]  # fmt: skip
    whole = _run("tent", base, tmp_path / "whole.json")
    parts = [tmp_path / f"p{i}.json" for i in range(3)]
    for i, path in enumerate(parts):
        _run("tent", [*base, f"protocol.shard={i}/3"], path)
    assert [c["n"] for c in results.load_results(parts[0])["cells"]] == [3]
    assert _scores(shard.merge_parts(parts)) == _scores(whole)


def test_the_merge_refuses_what_is_not_one_whole_run(mura_parts, tmp_path):
    d, _, parts = mura_parts
    with pytest.raises(shard.MergeError, match=r"missing part\(s\) 3/4"):
        shard.merge_parts(parts[:3])
    with pytest.raises(shard.MergeError, match="given twice"):
        shard.merge_parts([parts[0], parts[0], parts[2], parts[3]])
    with pytest.raises(shard.MergeError, match="not a shard part"):
        shard.merge_parts([*parts[:3], d / "whole.json"])
    # another protocol (a different subset of images): another run
    other = tmp_path / "other.json"
    _run("mura", [*EPISODIC_BATCH[:2], "protocol.max_images=20", *EPISODIC_BATCH[3:],
                  "protocol.shard=3/4"], other)  # fmt: skip
    with pytest.raises(shard.MergeError, match="protocol_id"):
        shard.merge_parts([*parts[:3], other])
    # another method setting
    lr = tmp_path / "lr.json"
    _run("mura", [*EPISODIC_BATCH, "method.lr=0.01", "protocol.shard=3/4"], lr)
    with pytest.raises(shard.MergeError, match="method_config_hash"):
        shard.merge_parts([*parts[:3], lr])
    # a run setting that changes numbers (the frozen-model reference)
    ref = tmp_path / "ref.json"
    _run("mura", [*EPISODIC_BATCH, "reference=false", "protocol.shard=3/4"], ref)
    with pytest.raises(shard.MergeError, match="reference"):
        shard.merge_parts([*parts[:3], ref])
    # an unfinished part (a killed task)
    cut = tmp_path / "cut.json"
    record = results.load_results(parts[3])
    record.pop("finished")
    cut.write_text(json.dumps(record))
    with pytest.raises(shard.MergeError, match="unfinished"):
        shard.merge_parts([*parts[:3], cut])


def test_the_command_merges_and_exits_2_on_a_refusal(mura_parts, tmp_path, capsys):
    from tta_bench.cli import main

    _, whole, parts = mura_parts
    out = tmp_path / "m.json"
    cmd = ["merge", *map(str, parts), "--output", str(out)]
    assert main(cmd) == 0, capsys.readouterr().err
    assert "merged 4 parts" in capsys.readouterr().out
    assert _scores(results.load_results(out)) == _scores(whole)
    assert main(cmd) == 2 and "exists" in capsys.readouterr().err
    short = ["merge", *map(str, parts[:2]), "-o", str(tmp_path / "x.json")]
    assert main(short) == 2
    assert "missing part(s) 2/4, 3/4 of 4" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_a_part_is_never_ranked_nor_resumed_as_another_part(mura_parts, tmp_path):
    d, _, parts = mura_parts
    board = report.collect(d, "digits-c", protocol_id=results.load_results(parts[0])[
        "protocol"]["id"])  # fmt: skip
    reasons = dict(board.left_out)
    assert all("shard part" in reasons[p.name] for p in parts)
    copy = tmp_path / "p.json"
    copy.write_text(parts[0].read_text())
    _, spec = resolve_run(method="mura", overrides=[*EPISODIC_BATCH, "protocol.shard=1/4"])
    with pytest.raises(ResumeMismatchError, match="shard"):
        runner.run(spec, copy)


def test_online_and_continual_protocols_cannot_be_sharded():
    with pytest.raises(UsageError, match="reset_each_shift.*cannot be split"):
        resolve_run(method="tent", overrides=["protocol.shard=0/2"])
    with pytest.raises(UsageError, match="continual"):
        resolve_run(method="tent", overrides=["protocol.reset=continual", "protocol.shard=0/2"])
    for bad in ("2/2", "1", "a/b", "-1/3", "0/0"):
        with pytest.raises(ValueError, match="protocol.shard"):
            shard.parse(bad)
    assert shard.parse("1/3") == shard.Shard(1, 3) and shard.parse(None) is None


def test_the_method_seed_of_a_batch_does_not_depend_on_the_split():
    from tta_bench.run.protocol import load_protocol
    from tta_bench.run.stream import build_stream

    p = load_protocol("digits-c", reset="episodic_batch", shifts=["contrast", "fog"],
                      batch_size=7)  # fmt: skip
    labels = {d: np.zeros(50, dtype=np.int64) for d in [("contrast", 5), ("fog", 5)]}
    stream = build_stream(p, 0, labels)
    seeds = runner.batch_seeds(stream)
    assert len(set(seeds.values())) == len(stream.batches)  # one seed per batch
    part = shard.take(stream, shard.Shard(1, 3))
    assert [b.number % 3 for b in part.batches] == [1] * len(part.batches)
    assert runner.batch_seeds(part) != {b.number: seeds[b.number] for b in part.batches}
