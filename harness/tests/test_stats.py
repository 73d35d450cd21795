"""Statistics over seeds and paired comparisons (hand-computed values on the golden results
in harness/tests/golden/), and the calibration / per-class metrics against plain numpy."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from tta_bench import metrics
from tta_bench.registry import RegistryError, registry, reset_registries
from tta_bench.report import stats

from .helpers import GOLDEN

T_975_DF2 = 4.302652729911275  # Student t quantile 0.975, 2 degrees of freedom (tables)
T_975_DF11 = 2.200985160082949  # ... 11 degrees of freedom


def _load(name: str) -> dict:
    return json.loads((GOLDEN / name).read_text())


@pytest.fixture(scope="module")
def zeroshot():
    return _load("golden_zeroshot.json")


@pytest.fixture(scope="module")
def tent():
    return _load("golden_tent.json")


def _hand_t(values: list[float], t: float) -> tuple[float, float, float]:
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t * std / math.sqrt(n)
    return mean, std, half


def test_describe_is_the_student_t_interval():
    mean, std, half = _hand_t([0.465, 0.49, 0.51], T_975_DF2)
    est = stats.describe([0.465, 0.49, 0.51])
    assert est.n == 3
    assert est.mean == pytest.approx(mean)
    assert est.std == pytest.approx(std)
    assert est.ci_low == pytest.approx(mean - half)
    assert est.ci_high == pytest.approx(mean + half)
    assert est.half_width == pytest.approx(half)


def test_one_seed_has_no_spread_or_interval():
    est = stats.describe([0.7])
    assert (est.mean, est.std, est.ci_low, est.half_width) == (0.7, None, None, None)
    with pytest.raises(ValueError, match="at least one"):
        stats.describe([])


def test_suite_estimate_averages_cells_per_seed_first(tent):
    # per seed: mean of the four cells (shift x severity) of that seed
    per_seed = [(0.62 + 0.43 + 0.50 + 0.31) / 4, (0.64 + 0.44 + 0.53 + 0.35) / 4]
    per_seed.append((0.66 + 0.48 + 0.56 + 0.34) / 4)
    mean, _, half = _hand_t(per_seed, T_975_DF2)
    est = stats.suite_estimate(tent)
    assert est.mean == pytest.approx(mean)
    assert est.half_width == pytest.approx(half)
    cell = stats.cell_estimates(tent)[("gaussian_noise", 5)]
    assert cell.mean == pytest.approx((0.43 + 0.44 + 0.48) / 3)


def test_paired_t_matches_hand_computation(tent, zeroshot):
    diffs = [0.465 - 0.45, 0.49 - 0.45, 0.51 - 0.45]
    mean, std, half = _hand_t(diffs, T_975_DF2)
    t = mean / (std / math.sqrt(3))
    p = 1 - t / math.sqrt(2 + t * t)  # two-sided p of Student t with 2 df, closed form
    cmp = stats.paired_comparison(tent, zeroshot)
    assert (cmp.method, cmp.baseline, cmp.unit, cmp.test, cmp.n_pairs) == (
        "tent",
        "zeroshot",
        "seed",
        "t",
        3,
    )
    assert cmp.mean_difference == pytest.approx(mean)
    assert cmp.ci_low == pytest.approx(mean - half)
    assert cmp.ci_high == pytest.approx(mean + half)
    assert cmp.p_value == pytest.approx(p)


def test_paired_by_cell_uses_every_cell(tent, zeroshot):
    mine = stats.cell_values(tent)
    theirs = stats.cell_values(zeroshot)
    diffs = [mine[k] - theirs[k] for k in sorted(mine)]
    mean, _, half = _hand_t(diffs, T_975_DF11)
    cmp = stats.paired_comparison(tent, zeroshot, unit="cell")
    assert cmp.n_pairs == 12
    assert cmp.mean_difference == pytest.approx(mean)
    assert cmp.ci_high - cmp.mean_difference == pytest.approx(half)


def test_reference_baseline_pairs_like_the_zeroshot_file(tent, zeroshot):
    via_file = stats.paired_comparison(tent, zeroshot)
    via_ref = stats.paired_comparison(tent, stats.reference_record(tent))
    assert via_ref.baseline == "zeroshot (reference)"
    assert via_ref.mean_difference == pytest.approx(via_file.mean_difference)
    assert via_ref.p_value == pytest.approx(via_file.p_value)


def test_identical_runs_differ_by_zero_without_a_p_value(zeroshot):
    cmp = stats.paired_comparison(zeroshot, zeroshot)
    assert (cmp.mean_difference, cmp.ci_low, cmp.ci_high, cmp.p_value) == (0.0, 0.0, 0.0, None)


def test_bootstrap_is_reproducible_and_brackets_the_mean(tent, zeroshot):
    a = stats.paired_comparison(tent, zeroshot, unit="cell", test="bootstrap", n_resamples=2000)
    b = stats.paired_comparison(tent, zeroshot, unit="cell", test="bootstrap", n_resamples=2000)
    assert a == b
    assert a.ci_low < a.mean_difference < a.ci_high
    assert 0 < a.p_value <= 1
    c = stats.paired_comparison(
        tent, zeroshot, unit="cell", test="bootstrap", n_resamples=2000, rng_seed=1
    )
    assert c.ci_low != a.ci_low


def test_different_protocols_are_never_compared(tent, zeroshot):
    other = _load("golden_tent_bs16.json")
    with pytest.raises(stats.ProtocolMismatchError, match="batch_size: 16 vs 8"):
        stats.paired_comparison(other, zeroshot)


def test_bad_options_list_the_choices(tent, zeroshot):
    with pytest.raises(ValueError, match="seed, cell"):
        stats.paired_comparison(tent, zeroshot, unit="shift")
    with pytest.raises(ValueError, match="t, bootstrap"):
        stats.paired_comparison(tent, zeroshot, test="wilcoxon")


def test_no_common_cells_is_an_error(tent, zeroshot):
    only_seed_0 = {**zeroshot, "cells": [c for c in zeroshot["cells"] if c["seed"] == 0]}
    only_seed_1 = {**tent, "cells": [c for c in tent["cells"] if c["seed"] == 1]}
    with pytest.raises(ValueError, match="share no"):
        stats.paired_comparison(only_seed_1, only_seed_0)


# -- metrics -----------------------------------------------------------------------------
def _numpy_ece(logits: np.ndarray, labels: np.ndarray, n_bins: int = 15) -> float:
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    conf, pred = p.max(axis=1), p.argmax(axis=1)
    ece = 0.0
    for k in range(n_bins):
        lo, hi = k / n_bins, (k + 1) / n_bins
        in_bin = (conf > lo) & (conf <= hi)
        if in_bin.any():
            gap = abs((pred[in_bin] == labels[in_bin]).mean() - conf[in_bin].mean())
            ece += in_bin.mean() * gap
    return float(ece)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ece_matches_a_numpy_reference(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(500, 10, generator=g) * (1 + 2 * seed)
    labels = torch.randint(0, 10, (500,), generator=g)
    expected = _numpy_ece(logits.double().numpy(), labels.numpy())
    assert metrics.expected_calibration_error(logits, labels) == pytest.approx(expected, abs=1e-12)


def test_ece_hand_case():
    # confidences 0.9 (right), 0.9 (wrong), 0.7 (right), 0.7 (right): two occupied bins,
    # |0.5 - 0.9| * 2/4 + |1.0 - 0.7| * 2/4 = 0.35
    probs = torch.tensor([[0.9, 0.1], [0.9, 0.1], [0.7, 0.3], [0.3, 0.7]])
    labels = torch.tensor([0, 1, 0, 1])
    ece = metrics.expected_calibration_error(probs.log(), labels)
    assert ece == pytest.approx(0.35)


def test_per_class_accuracy_and_absent_classes():
    logits = torch.tensor([[2.0, 0, 0], [2.0, 0, 0], [0, 2.0, 0], [2.0, 0, 0]])
    labels = torch.tensor([0, 0, 1, 1])
    assert metrics.per_class_accuracy(logits, labels, 3) == [1.0, 0.5, None]


def test_compute_all_has_accuracy_nll_and_ece():
    logits = torch.tensor([[3.0, 0.0], [0.0, 1.0]])
    labels = torch.tensor([0, 0])
    out = metrics.compute_all(logits, labels)
    assert out["accuracy"] == 0.5
    assert out["ece"] == pytest.approx(metrics.expected_calibration_error(logits, labels))
    assert out["nll"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, labels)))


@pytest.fixture()
def clean_registries():
    yield
    reset_registries()


def _top2(logits: torch.Tensor, labels: torch.Tensor) -> float:
    top = logits.topk(2, dim=1).indices
    return float((top == labels[:, None]).any(dim=1).float().mean())


def test_a_plugin_metric_is_computed_for_every_cell(clean_registries):
    registry("metrics").add("top2_accuracy", _top2, distribution="test-plugin")
    logits = torch.tensor([[3.0, 2.0, 0.0], [0.0, 1.0, 2.0]])
    out = metrics.compute_all(logits, torch.tensor([1, 0]))
    assert out["top2_accuracy"] == 0.5
    assert out["accuracy"] == 0.0


def test_a_plugin_metric_may_not_shadow_a_builtin(clean_registries):
    # Built-in metrics are entry points of tta-bench: a plugin reusing a name is a duplicate.
    with pytest.raises(RegistryError, match="duplicate metric name 'ece'"):
        registry("metrics").add("ece", _top2, distribution="test-plugin")


def test_an_in_process_metric_may_not_shadow_a_builtin(clean_registries, monkeypatch):
    monkeypatch.setattr(metrics, "METRICS", {})
    metrics.register_metric("accuracy", _top2)
    with pytest.raises(RegistryError, match="clashes"):
        metrics.compute_all(torch.zeros(2, 2), torch.tensor([0, 1]))


def test_a_metric_with_the_wrong_shape_is_refused_at_registration(clean_registries):
    with pytest.raises(RegistryError, match="invalid"):
        registry("metrics").add("bad", lambda: 0.0)


def test_the_t_quantile_is_scipy_stats_own():
    """``describe`` reads the quantile from ``scipy.special.stdtrit`` (no ``scipy.stats``
    import per command): bit for bit the value of ``scipy.stats.t.ppf``, so the committed
    intervals do not move."""
    from scipy import stats as sps
    from scipy.special import stdtrit

    for q in (0.9, 0.95, 0.975, 0.995):
        for df in (1, 2, 3, 4, 9, 29, 99, 999):
            assert float(stdtrit(df, q)) == float(sps.t.ppf(q, df))
    values = [0.465, 0.49, 0.51, 0.47]
    est = stats.describe(values)
    t = float(sps.t.ppf(0.975, 3))
    assert est.ci_high == est.mean + t * est.std / math.sqrt(4)
