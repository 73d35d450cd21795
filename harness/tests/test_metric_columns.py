"""A newly registered metric reaches every table without editing a renderer: the run
summary (``results.summarize``), ``tta-bench table``'s suite summary and the leaderboard
take their metric columns from the metrics the cells hold, shown as the metric's catalogue
entry says (``table: {label, scale, decimals, order}``)."""

from __future__ import annotations

import copy
import json

import pytest

from tta_bench import catalog, metrics
from tta_bench.report import leaderboard as report
from tta_bench.report import tables
from tta_bench.report.columns import MetricColumn, column, table_columns
from tta_bench.run import results

from .helpers import GOLDEN

CATALOGUE = {
    "metrics": {
        "brier": {
            "description": "Brier score.",
            "table": {"label": "Brier %", "scale": 100, "decimals": 2, "order": 5},
        }
    }
}


def _brier(logits, labels):
    import torch

    probs = torch.softmax(logits.float(), dim=1)
    onehot = torch.nn.functional.one_hot(labels, probs.shape[1]).float()
    return float(((probs - onehot) ** 2).sum(dim=1).mean())


@pytest.fixture()
def brier():
    """``brier`` registered in-process with a catalogue entry, removed afterwards."""
    metrics.register_metric("brier", _brier)
    catalog.add_catalog(CATALOGUE)
    yield
    metrics.METRICS.pop("brier")
    catalog._EXTRA.remove(CATALOGUE)
    catalog.reset_catalog()


def _with_brier(name: str, offset: float) -> dict:
    record = json.loads((GOLDEN / name).read_text(encoding="utf-8"))
    for i, cell in enumerate(record["cells"]):
        cell["brier"] = offset + 0.01 * (i % 3)
    return record


def test_the_builtin_metrics_keep_their_columns():
    assert [c.label for c in table_columns([{"accuracy": 0.5, "ece": 0.1, "nll": 1.0}])] == [
        "ECE %",
        "NLL",
    ]
    assert column("ece").format(0.1234) == "12.3"
    assert column("nll").format(1.23456) == "1.235"
    # a metric no catalogue describes: its name, three decimals
    assert column("unheard_of") == MetricColumn("unheard_of", "unheard_of")


def test_a_new_metric_reaches_summary_table_and_leaderboard(brier, tmp_path):
    zs, tent = _with_brier("golden_zeroshot.json", 0.30), _with_brier("golden_tent.json", 0.20)
    # the record's own summary
    summary = results.summarize(tent["cells"])
    expected = sum(c["brier"] for c in tent["cells"]) / len(tent["cells"])
    assert summary["mean_brier"] == pytest.approx(expected)
    # tta-bench table's suite summary: after ECE and NLL (order 5 > 1, 2)
    headers, rows = tables.summary_rows([zs, tent])
    assert headers[-3:] == ["ECE %", "NLL", "Brier %"]
    assert rows[1][-1] == f"{100 * expected:.2f}"
    # the leaderboard of a results folder holding both
    for name, record in (("zs.json", zs), ("tent.json", tent)):
        (tmp_path / name).write_text(json.dumps(record), encoding="utf-8")
    board = report.collect(tmp_path, "golden")
    lb_headers, lb_rows = report.leaderboard_rows(board)
    i = lb_headers.index("Brier %")
    assert lb_headers[i - 2 : i] == ["ECE %", "NLL"]
    by_method = {row[1]: row[i] for row in lb_rows}
    assert by_method["tent"] == f"{100 * expected:.2f}"


def test_a_metric_absent_from_the_cells_adds_no_column(brier):
    zs = json.loads((GOLDEN / "golden_zeroshot.json").read_text(encoding="utf-8"))
    headers, _ = tables.summary_rows([copy.deepcopy(zs)])
    assert "Brier %" not in headers
