"""``tta-bench rescore`` over committed digits-c runs: results/digits-c-samples holds the
committed zeroshot and tent runs of digits-c rerun with ``log_samples=logits`` (their cells
equal results/digits-c's); rescoring their per-sample files reproduces the stored accuracy,
ECE and NLL exactly, without adapting again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tta_bench.rescore import recompute

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
        assert {m: stored[m] for m in ("n", "accuracy", "ece", "nll")} == {
            m: committed[key][m] for m in ("n", "accuracy", "ece", "nll")
        }
        for metric in ("accuracy", "ece", "nll"):
            assert values[key][metric] == stored[metric], (key, metric)
