"""The committed results of the open-set methods and the 2025 cache successors (issue 43):
each of ``ostta``, ``sotta``, ``unient``, ``stamp``, ``cliptta``, ``zsntta``, ``rosita``,
``mcp``, ``oga``, ``tca`` and ``cosmic`` is committed on ``digits-c``, ``digits-open`` and
``digits-noisy`` as a whole run of today's code (``benchmarks/digits_evidence.py``): the
suite's current protocol id, the method's current default config, 3 seeds x 15 cells, every
cell scored; on the open suites every cell holds the detection metrics of the harness's
score and, for a method with its own OOD score, of that score too (and ZS-NTTA's
accuracies for those that decide); each on its folder's leaderboard. Reading only."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tta_bench.registry import registry
from tta_bench.run.protocol import load_protocol
from tta_bench.run.resume import method_config_hash

ROOT = Path(__file__).resolve().parents[1]
OPEN_SET = ("ostta", "sotta", "unient", "stamp", "cliptta", "zsntta", "rosita")
CACHE_2025 = ("mcp", "oga", "tca", "cosmic")
SUITES = ("digits-c", "digits-open", "digits-noisy")
#: The methods that decide in or out themselves (``Method.last_ood_decision``).
DECIDE = ("cliptta", "zsntta", "rosita")
RUNS = [(s, m) for s in SUITES for m in (*OPEN_SET, *CACHE_2025)]


def _record(suite: str, method: str) -> dict:
    return json.loads((ROOT / "results" / suite / f"{method}.json").read_text("utf-8"))


@pytest.mark.parametrize(("suite", "method"), RUNS)
def test_a_committed_run_is_a_whole_run_of_todays_defaults(suite, method):
    record = _record(suite, method)
    assert record["finished"] and record["method"] == method
    assert record["protocol"]["id"] == load_protocol(suite).id
    cls = registry("methods").get(method)
    assert record["method_config_hash"] == method_config_hash(cls.Config()), (
        f"results/{suite}/{method}.json was run with other settings than today's defaults"
    )
    cells = record["cells"]
    assert sorted({c["seed"] for c in cells}) == [0, 1, 2] and len(cells) == 45
    assert all(math.isfinite(c["accuracy"]) for c in cells)
    board = (ROOT / "results" / suite / "leaderboard.md").read_text("utf-8")
    assert f"| {method} " in board or f"[{method}]" in board, f"{method} not on {suite}'s board"
    if suite == "digits-c":
        assert all(c["n"] == 360 and "auroc" not in c for c in cells)
        return
    assert all(c["n_known"] == 180 and c["n_ood"] == 180 for c in cells)
    assert all(0 <= c[k] <= 1 for c in cells for k in ("auroc", "aupr", "fpr95"))
    if method in OPEN_SET:
        assert record["own_ood_score"] == cls.own_ood_score
        assert all(0 <= c[k] <= 1 for c in cells for k in ("auroc_own", "aupr_own", "fpr95_own"))
    else:
        assert "own_ood_score" not in record and all("auroc_own" not in c for c in cells)
    assert all(("acc_h" in c) == (method in DECIDE) for c in cells)


def test_the_noisy_suite_compares_with_zsntta_s_baselines():
    """digits-noisy also holds ZS-NTTA's baselines (zero-shot, Tent, TDA; SoTTA above)."""
    for method in ("zeroshot", "tent", "tda"):
        record = _record("digits-noisy", method)
        assert record["protocol"]["id"] == load_protocol("digits-noisy").id
        assert len(record["cells"]) == 45
