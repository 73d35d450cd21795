"""Many stream orders from one image set (``protocol.orders``, the feature cache of
``tta_bench.run.features``) and the compute-matched track (``protocol.realtime``,
``tta_bench.run.realtime``), end to end on the test plugin."""

from __future__ import annotations

import dataclasses

import pytest

from tta_bench.report.stats import order_spread, tail_mean
from tta_bench.run import samples
from tta_bench.run.features import chunks
from tta_bench.run.protocol import load_protocol
from tta_bench.run.realtime import BACKWARD_UNITS, step_units
from tta_bench.run.resolve import resolve_run

from .helpers import run, scores, spec

ORDERS = {"orders": 3, "max_images": 20}


def _digests(folder):
    return {p.name: samples.data_digest(p.read_bytes()) for p in sorted(folder.glob("*.parquet"))}


def test_replayed_features_give_the_cells_of_encoding_every_order(tmp_path):
    """The cache's cells (and every logit of every sample) equal encoding each batch of each
    order; each image is encoded once, not once per order."""
    kw = dict(protocol=ORDERS, seeds=[0, 1, 2], log_samples="logits")
    cached = run(tmp_path / "cached.json", "feature_memory", "tiny-shifts", **kw)
    plain = run(
        tmp_path / "plain.json", "feature_memory", "tiny-shifts", feature_cache="never", **kw
    )
    assert scores(cached) == scores(plain)
    folder = samples.samples_dir
    assert _digests(folder(tmp_path / "cached.json")) == _digests(folder(tmp_path / "plain.json"))
    domains = len(cached["protocol"]["shifts"]) * len(cached["protocol"]["severities"])
    assert cached["feature_cache"]["images_encoded"] == 20 * domains
    assert "feature_cache" not in plain
    # the orders differ: the method depends on the order, and the orders are different
    per_order = {s: [c["accuracy"] for c in cached["cells"] if c["seed"] == s] for s in range(3)}
    assert len({tuple(v) for v in per_order.values()}) > 1


def test_every_order_sees_the_same_images(tmp_path):
    """With ``orders`` the shift noise is the protocol's, not the order's: an order-blind
    method scores every order alike (a per-seed noise would not)."""
    record = run(tmp_path / "r.json", "zeroshot", "tiny-shifts", protocol=ORDERS, seeds=[0, 1, 2])
    by_cell: dict = {}
    for c in record["cells"]:
        by_cell.setdefault((c["shift"], c["severity"]), set()).add(c["accuracy"])
    assert all(len(v) == 1 for v in by_cell.values())
    assert "feature_cache" not in record  # the test plugin's zeroshot has no feature path


def test_orders_are_part_of_the_id_and_their_seeds_are_pinned():
    p = load_protocol("tiny-shifts", orders=100)
    assert "-o100-" in p.id and p.id != load_protocol("tiny-shifts").id
    assert p.default_seeds() == list(range(100)) and p.noise_seed(57) == 0
    assert load_protocol("tiny-shifts").noise_seed(57) == 57
    with pytest.raises(ValueError, match="orders=1"):
        load_protocol("tiny-shifts", orders=1)
    _, resolved = resolve_run("zeroshot", "tiny-shifts", overrides=["protocol.orders=5"])
    assert resolved.seeds == [0, 1, 2, 3, 4]
    _, resolved = resolve_run("zeroshot", "tiny-shifts")
    assert resolved.seeds == [0, 1, 2]
    with pytest.raises(ValueError, match=r"seeds=\[0, 7\] with protocol.orders=5"):
        resolve_run("zeroshot", "tiny-shifts", overrides=["protocol.orders=5", "seeds=[0,7]"])
    with pytest.raises(ValueError, match="feature_cache policy 'sometimes'"):
        resolve_run("zeroshot", "tiny-shifts", overrides=["feature_cache=sometimes"])


def test_chunks_never_leave_a_single_row_behind():
    import numpy as np

    assert [len(c) for c in chunks(np.arange(17), 8)] == [8, 9]
    assert [len(c) for c in chunks(np.arange(16), 8)] == [8, 8]
    assert [len(c) for c in chunks(np.arange(3), 1)] == [1, 1, 1]
    assert [len(c) for c in chunks(np.arange(1), 8)] == [1]


def test_order_spread_and_expected_tail_accuracy():
    assert tail_mean([0.5, 0.9, 0.1, 0.7]) == (0.1, 1)
    assert tail_mean([float(v) for v in range(20)]) == (0.5, 2)
    record = {
        "protocol": {"orders": 20},
        "cells": [
            {"shift": s, "severity": 1, "seed": k, "accuracy": (k + (s == "b")) / 100}
            for k in range(20)
            for s in ("a", "b")
        ],
    }
    spread = order_spread(record)
    assert spread is not None and spread.estimate.n == 20
    assert spread.tail == pytest.approx((0.005 + 0.015) / 2) and spread.tail_n == 2
    assert order_spread({**record, "protocol": {}}) is None


def test_step_units_count_passes_against_the_reference():
    assert step_units(64, 0, 64) == 1  # the reference itself
    assert step_units(64, 64, 64) == 1 + BACKWARD_UNITS  # one forward and backward
    assert step_units(65 * 64, 64 * 64, 64) == 65 + 64 * BACKWARD_UNITS
    assert step_units(0, 0, 64) == 1 and step_units(10, 0, 0) == 1


def _expected_adapted(sizes: list[int], units: int) -> int:
    """Samples adapted on when every adapting step costs ``units``."""
    adapted, busy = 0, 0
    for n in sizes:
        if busy == 0:
            adapted += n
            busy = units - 1
        else:
            busy -= 1
    return adapted


def test_realtime_adapts_on_one_batch_in_k_and_predicts_the_rest(tmp_path):
    record = run(tmp_path / "rt.json", "norm_tent", "tiny-shifts", protocol={"realtime": True})
    assert "-rt-" in record["protocol"]["id"]
    for cell in record["cells"]:
        n = cell["n"]
        sizes = [min(8, n - k) for k in range(0, n, 8)]
        # norm_tent: a forward with gradients and a backward, then a forward to predict
        units = step_units(2 * 8, 8, 8)
        assert cell["realtime"] == {
            "adapted_samples": _expected_adapted(sizes, units),
            "samples": n,
        }
    reference = run(tmp_path / "zs.json", "zeroshot", "tiny-shifts", protocol={"realtime": True})
    assert all(c["realtime"]["adapted_samples"] == c["n"] for c in reference["cells"])
    offline = run(tmp_path / "zs0.json", "zeroshot", "tiny-shifts")
    assert scores(offline) == scores(reference)  # the reference costs one unit: unchanged


def test_a_realtime_cell_cannot_be_sharded():
    with pytest.raises(ValueError, match="protocol.shard=0/2 with protocol.realtime=true"):
        resolve_run(
            "zeroshot",
            "tiny-shifts",
            overrides=["protocol.realtime=true", "protocol.reset=episodic_batch",
                       "protocol.shard=0/2"],
        )  # fmt: skip


def test_log_samples_auto_writes_new_outputs_and_spares_old_ones(tmp_path):
    out = tmp_path / "r.json"
    run(out, "zeroshot", "tiny-shifts", seeds=[0], log_samples="topk", log_samples_auto=True)
    assert len(list(samples.samples_dir(out).glob("*.parquet"))) == 4
    old = tmp_path / "old.json"
    run(old, "zeroshot", "tiny-shifts", seeds=[0])  # a run of before: no per-sample files
    more = spec("zeroshot", "tiny-shifts", seeds=[0, 1], log_samples="topk")
    from tta_bench.run import runner

    runner.run(dataclasses.replace(more, log_samples_auto=True), old)
    assert not samples.samples_dir(old).exists()  # resumed without: stays without
