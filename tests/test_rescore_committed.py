"""``tta-bench rescore`` over committed digits-c runs: results/digits-c-samples holds the
digits-c zeroshot and tent runs rerun with ``log_samples=logits`` (2026-12-06, after their
per-sample files gained their run's identity). Rescoring their per-sample files reproduces
their stored accuracy exactly and ECE and NLL to float32 rounding, without adapting again.

Against results/digits-c (written before the glass_blur and Gaussian-filter kernels were
stepped per image, commits d736b3c and 2aef486): n, accuracy and the reference accuracy
are equal in every cell; glass_blur's and elastic_transform's logits moved in their last
float32 bits (up to 1.8e-3), which moves their ECE and NLL by at most 4e-6 relative and no
prediction. Results written on an AVX2-only CPU would round some NLLs differently too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tta_bench.run.rescore import recompute

ROOT = Path(__file__).resolve().parents[1]


def _cells(path: Path) -> dict:
    record = json.loads(path.read_text(encoding="utf-8"))
    return {(c["shift"], c["severity"], c["seed"]): c for c in record["cells"]}


@pytest.mark.parametrize("method", ["zeroshot", "tent"])
def test_rescore_reproduces_the_committed_metrics_exactly(method):
    path = ROOT / "results" / "digits-c-samples" / f"{method}.json"
    committed = _cells(ROOT / "results" / "digits-c" / f"{method}.json")
    record, values = recompute(path)
    assert len(values) == len(committed) == 45
    for key, stored in _cells(path).items():
        counts = ("n", "accuracy", "reference_accuracy")
        assert {m: stored[m] for m in counts} == {m: committed[key][m] for m in counts}
        for metric in ("ece", "nll"):  # the kernels' float rounding since (module docstring)
            assert stored[metric] == pytest.approx(committed[key][metric], rel=1e-5), key
        assert values[key]["accuracy"] == stored["accuracy"], key
        for metric in ("ece", "nll"):
            assert values[key][metric] == pytest.approx(stored[metric], rel=1e-6, abs=1e-7), (
                key,
                metric,
            )
