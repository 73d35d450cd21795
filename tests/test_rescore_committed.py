"""``tta-bench rescore`` over committed digits-c runs: results/digits-c-samples holds the
committed zeroshot and tent runs of digits-c rerun with ``log_samples=logits`` (their cells
equal results/digits-c's); rescoring their per-sample files reproduces the stored accuracy
exactly and ECE and NLL to float32 rounding, without adapting again. The results were
written on a CPU with AVX-512 kernels; on an AVX2-only CPU torch's vectorised log-softmax
rounds the last bit of some NLLs differently (1.6340886 against 1.6340888 on one cell of
zeroshot), which moves the float32 NLL and the ECE's last digits, never a prediction."""

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
        assert {m: stored[m] for m in ("n", "accuracy", "ece", "nll")} == {
            m: committed[key][m] for m in ("n", "accuracy", "ece", "nll")
        }
        assert values[key]["accuracy"] == stored["accuracy"], key
        for metric in ("ece", "nll"):
            assert values[key][metric] == pytest.approx(stored[metric], rel=1e-6, abs=1e-7), (
                key,
                metric,
            )
