"""Cell accounting: ``CellBook`` folds each batch's predictions and costs into its cell(s),
rows of mixed batches by domain and costs by row share, into strict-JSON entries."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tta_bench.run.accounting import BatchCost, CellBook, non_finite
from tta_bench.run.cost import PeakMemory
from tta_bench.run.stream import Batch, Stream

DOMAINS = (("a", 1), ("b", 1))


def _stream(*batches: Batch) -> Stream:
    return Stream(seed=0, domains=DOMAINS, groups=((0, 1),), batches=tuple(batches))


def _batch(number: int, indices, domains) -> Batch:
    return Batch(number, np.asarray(indices), np.asarray(domains), False, 0)


def _logits(predicted: list[int], classes: int = 3) -> torch.Tensor:
    """Logits whose argmax is ``predicted`` (a margin of 2 over the other classes)."""
    return 2.0 * F.one_hot(torch.tensor(predicted), classes).float()


def _cost(data, shift, method, reference, adapt, forward, backward, flops=None) -> BatchCost:
    seconds = {"data": data, "shift": shift, "method": method, "reference": reference}
    return BatchCost(seconds, adapt, forward, backward, flops)


def _entries(book: CellBook) -> dict[str, dict]:
    with PeakMemory(torch.device("cpu")) as memory:
        pass
    return {e["shift"]: e for e in book.entries(seed=7, memory=memory)}


@pytest.fixture()
def mixed():
    """Batch 0 mixes domains a (rows 0, 1, 3) and b (row 2); batch 1 is all b."""
    b0 = _batch(0, [0, 1, 0, 2], [0, 0, 1, 0])
    b1 = _batch(1, [1, 2], [1, 1])
    book = CellBook(_stream(b0, b1), reference=True, is_reference=False, per_class=True)
    # batch 0: predicted [0, 1, 1, 2] vs labels [0, 1, 0, 2]; the reference predicts 0
    book.fold(
        b0,
        _logits([0, 1, 1, 2]),
        torch.tensor([0, 1, 0, 2]),
        torch.tensor([0, 0, 0, 0]),
        _cost(0.4, 0.2, 0.8, 0.1, 0.5, 4, 4),
    )
    # batch 1: predicted [1, 2] vs labels [1, 1]; the reference predicts 1
    book.fold(
        b1,
        _logits([1, 2]),
        torch.tensor([1, 1]),
        torch.tensor([1, 1]),
        _cost(0.2, 0.0, 0.4, 0.1, 0.2, 2, 0),
    )
    return book


def test_rows_of_a_mixed_batch_are_scored_in_their_own_cells(mixed):
    a, b = _entries(mixed)["a"], _entries(mixed)["b"]
    assert (a["n"], a["accuracy"], a["reference_accuracy"]) == (3, 1.0, pytest.approx(1 / 3))
    assert (b["n"], b["accuracy"], b["reference_accuracy"]) == (3, pytest.approx(1 / 3), 1.0)
    assert a["error"] == 0.0 and b["error"] == pytest.approx(2 / 3)
    assert (a["batches"], b["batches"]) == (1, 2)
    assert a["per_class_accuracy"] == [1.0, 1.0, 1.0]
    assert b["per_class_accuracy"] == [0.0, 0.5, None]  # b: labels [0, 1, 1], preds [1, 1, 2]
    b_logits, b_labels = torch.cat([_logits([1]), _logits([1, 2])]), torch.tensor([0, 1, 1])
    assert b["nll"] == pytest.approx(float(F.cross_entropy(b_logits, b_labels)), rel=1e-6)
    assert (a["seed"], a["severity"]) == (7, 1)


def test_costs_of_a_mixed_batch_are_shared_by_row_count(mixed):
    a, b = _entries(mixed)["a"], _entries(mixed)["b"]
    # a: 3/4 of batch 0
    assert a["method_time_per_sample_s"] == pytest.approx(0.75 * 0.8 / 3)
    assert a["data_wait_time_per_sample_s"] == pytest.approx(0.75 * 0.4 / 3)
    assert a["shift_time_per_sample_s"] == pytest.approx(0.75 * 0.2 / 3)
    assert a["data_time_per_sample_s"] == pytest.approx(0.75 * 0.6 / 3)
    assert a["time_per_sample_s"] == pytest.approx(0.75 * 1.4 / 3)
    assert a["adapt_time_per_sample_s"] == pytest.approx(0.75 * 0.5 / 3)
    assert a["predict_time_per_sample_s"] == pytest.approx(0.75 * 0.3 / 3)
    assert a["forward_passes_per_sample"] == pytest.approx(1.0)
    assert a["backward_passes_per_sample"] == pytest.approx(1.0)
    assert a["data_wait_share"] == pytest.approx(0.6 / 1.4)
    # b: 1/4 of batch 0 and all of batch 1
    assert b["method_time_per_sample_s"] == pytest.approx((0.25 * 0.8 + 0.4) / 3)
    assert b["data_time_per_sample_s"] == pytest.approx((0.25 * 0.6 + 0.2) / 3)
    assert b["adapt_time_per_sample_s"] == pytest.approx((0.25 * 0.5 + 0.2) / 3)
    assert b["forward_passes_per_sample"] == pytest.approx((0.25 * 4 + 2) / 3)
    assert b["backward_passes_per_sample"] == pytest.approx((0.25 * 4 + 0) / 3)
    assert a["timed_samples"] == b["timed_samples"] == 3
    assert "flops_per_sample" not in a


def test_a_flop_counted_batch_is_left_out_of_the_times():
    b0 = _batch(0, [0, 1], [0, 0])
    b1 = _batch(1, [2, 3], [0, 0])
    book = CellBook(_stream(b0, b1), reference=False, is_reference=False, per_class=False)
    labels = torch.tensor([0, 1])
    book.fold(b0, _logits([0, 1]), labels, None, _cost(9, 9, 9, 0, 9, 2, 0, flops=1000.0))
    book.fold(b1, _logits([0, 0]), labels, None, _cost(0.1, 0.1, 0.2, 0, 0.1, 2, 0))
    (a,) = _entries(book).values()
    assert a["n"] == 4 and a["timed_samples"] == 2 and a["accuracy"] == 0.75
    assert a["flops_per_sample"] == pytest.approx(500.0)
    assert a["method_time_per_sample_s"] == pytest.approx(0.1)
    assert a["reference_accuracy"] is None
    only_counted = CellBook(_stream(b0), reference=False, is_reference=False, per_class=False)
    only_counted.fold(b0, _logits([0, 1]), labels, None, _cost(1, 1, 1, 0, 1, 2, 0, flops=8.0))
    (c,) = _entries(only_counted).values()
    assert c["time_per_sample_s"] is None and c["samples_per_s"] is None


def test_the_zeroshot_reference_is_its_own_accuracy():
    b0 = _batch(0, [0, 1], [0, 0])
    book = CellBook(_stream(b0), reference=True, is_reference=True, per_class=False)
    book.fold(b0, _logits([0, 2]), torch.tensor([0, 1]), None, _cost(0, 0, 0, 0, 0, 2, 0))
    (a,) = _entries(book).values()
    assert a["accuracy"] == a["reference_accuracy"] == 0.5


def test_entries_hold_no_non_finite_float():
    b0 = _batch(0, [0, 1], [0, 0])
    book = CellBook(_stream(b0), reference=True, is_reference=False, per_class=False)
    logits = torch.tensor([[3e38, -3e38, 0.0], [0.0, 1.0, 0.0]])  # row 0: log p(label) = -inf
    book.fold(b0, logits, torch.tensor([1, 1]), torch.tensor([0, 1]), _cost(0, 0, 0, 0, 0, 0, 0))
    (a,) = _entries(book).values()
    assert a["nll"] is None  # infinite, so not a number a results file can hold
    assert a["accuracy"] == 0.5 and a["reference_accuracy"] == 0.5
    json.dumps(a, allow_nan=False)
    floats = [v for v in a.values() if isinstance(v, float)]
    assert floats and all(math.isfinite(v) for v in floats)


def test_a_diverged_batch_marks_every_cell_it_touches(mixed):
    b2 = _batch(2, [2, 1, 0], [1, 0, 1])
    mixed.diverge(b2, "non-finite logits")
    a, b = _entries(mixed)["a"], _entries(mixed)["b"]
    for cell, n in ((a, 4), (b, 5)):
        assert cell["diverged"] == {"batch": 2, "reason": "non-finite logits"}
        assert cell["accuracy"] is None and cell["reference_accuracy"] is None
        assert cell["n"] == n
    json.dumps([a, b], allow_nan=False)


def test_non_finite_output_is_named():
    finite = torch.zeros(2, 3)
    assert non_finite(finite, None) is None
    assert non_finite(finite, torch.tensor(0.5)) is None
    assert non_finite(torch.tensor([[0.0, float("nan")]]), None) == "non-finite logits"
    assert non_finite(torch.tensor([[0.0, float("inf")]]), 0.1) == "non-finite logits"
    assert non_finite(finite, torch.tensor(float("inf"))) == "non-finite loss (inf)"
    assert non_finite(finite, float("nan")) == "non-finite loss (nan)"
