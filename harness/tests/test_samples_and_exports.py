"""Per-sample outputs (``log_samples``), ``rescore`` from them, and machine-readable tables
and listings (``table --format json|csv|csv-summary``, ``ls --json``, ``env --json``)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tta_bench import metrics
from tta_bench.report import stats
from tta_bench.run import rescore, samples

from .helpers import GOLDEN, cli


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """A norm_tent run over two seeds with ``log_samples=logits`` (the test plugin)."""
    import tta_bench

    out = tmp_path_factory.mktemp("samples") / "run.json"
    record = tta_bench.evaluate(
        "norm_tent",
        seeds=[0, 1],
        output=out,
        overrides=["log_samples=logits", "log_samples_top_k=3"],
    )
    return out, record


def test_one_parquet_file_per_cell_with_every_scored_sample(logged):
    out, record = logged
    folder = samples.samples_dir(out)
    assert folder.name == "run.samples"
    files = sorted(p.name for p in folder.glob("*.parquet"))
    assert len(files) == len(record["cells"])
    for cell in record["cells"]:
        table = pq.read_table(
            samples.cell_file(folder, cell["shift"], cell["severity"], cell["seed"])
        )
        rows = table.to_pydict()
        assert table.num_rows == cell["n"]
        assert set(rows["method"]) == {"norm_tent"} and set(rows["seed"]) == {cell["seed"]}
        assert rows["position"] == list(range(cell["n"]))
        logits, labels = samples.logits_and_labels(table)
        assert rows["prediction"] == logits.argmax(axis=1).tolist()
        assert np.mean(np.asarray(rows["prediction"]) == labels) == cell["accuracy"]
        top = np.asarray(rows["topk_classes"])
        assert top.shape == (cell["n"], 3) and (top[:, 0] == logits.argmax(axis=1)).all()
        probs = np.asarray(rows["topk_probs"])
        assert (np.diff(probs, axis=1) <= 0).all()  # most probable first
        assert sorted(set(rows["index"])) == sorted(rows["index"])  # each dataset row once


def test_rescore_reproduces_the_stored_metrics_exactly(logged):
    out, record = logged
    checks = {c.name: c for c in rescore.rescore(out)}
    assert set(checks) >= {"accuracy", "ece", "nll"}
    for name in ("accuracy", "ece", "nll"):
        assert checks[name].stored == len(record["cells"])
        assert checks[name].max_difference == 0.0


def test_a_metric_registered_later_is_computed_over_the_old_run(logged, tmp_path, capsys):
    out, record = logged
    copy = tmp_path / "run.json"
    copy.write_text(out.read_text(encoding="utf-8"), encoding="utf-8")
    samples.samples_dir(copy).symlink_to(samples.samples_dir(out))
    metrics.register_metric(
        "top1_error", lambda logits, labels: 1.0 - metrics.accuracy(logits, labels)
    )
    try:
        rc, text, _ = cli(capsys, "rescore", str(copy), "--write")
        assert rc == 0 and "top1_error" in text
    finally:
        metrics.METRICS.pop("top1_error")
    rewritten = json.loads(copy.read_text(encoding="utf-8"))
    for cell in rewritten["cells"]:
        assert cell["top1_error"] == pytest.approx(cell["error"], abs=1e-12)
    assert "mean_top1_error" in rewritten["summary"]


def test_top_k_only_files_cannot_be_rescored(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert (
        cli(capsys, "run", "--quiet", "--output", str(out), "seeds=[0]", "log_samples=true")[0] == 0
    )
    folder = samples.samples_dir(out)
    assert "logits" not in pq.read_table(next(folder.glob("*.parquet"))).column_names
    rc, _, err = cli(capsys, "rescore", str(out))
    assert rc == 2 and "log_samples=logits" in err


def test_a_bad_log_samples_value_is_refused(capsys, tmp_path):
    rc, _, err = cli(
        capsys, "run", "--quiet", "--output", str(tmp_path / "r.json"), "log_samples=maybe"
    )
    assert rc == 2 and "log_samples='maybe': expected auto, false, true or logits" in err


RESULTS = [str(GOLDEN / "golden_zeroshot.json"), str(GOLDEN / "golden_tent.json")]


def test_table_json_gives_numbers_for_every_cell_and_run(capsys):
    rc, text, _ = cli(capsys, "table", "--format", "json", *RESULTS)
    assert rc == 0
    doc = json.loads(text)
    records = [json.loads(Path(p).read_text(encoding="utf-8")) for p in RESULTS]
    assert len(doc["cells"]) == sum(len(r["cells"]) for r in records)
    first = doc["cells"][0]
    assert isinstance(first["accuracy"], float) and isinstance(first["severity"], int)
    tent = next(s for s in doc["summary"] if s["method"] == "tent")
    est = stats.suite_estimate(records[1])
    assert (tent["accuracy"], tent["accuracy_ci_low"], tent["accuracy_ci_high"]) == (
        est.mean,
        est.ci_low,
        est.ci_high,
    )
    assert tent["baseline"] == "zeroshot" and isinstance(tent["delta_ci_low"], float)


def test_table_csv_is_one_numeric_row_per_cell_and_csv_summary_one_per_run(capsys):
    rc, text, _ = cli(capsys, "table", "--format", "csv", *RESULTS)
    rows = list(csv.DictReader(io.StringIO(text)))
    assert rc == 0 and len(rows) == len(
        json.loads(cli(capsys, "table", "--format", "json", *RESULTS)[1])["cells"]
    )
    assert {r["method"] for r in rows} == {"zeroshot", "tent"}
    float(rows[0]["accuracy"]), int(rows[0]["seed"])  # numbers, not "51.1 ± 2.0"
    rc, text, _ = cli(capsys, "table", "--format", "csv-summary", *RESULTS)
    summary = list(csv.DictReader(io.StringIO(text)))
    assert [r["method"] for r in summary] == ["zeroshot", "tent"]
    assert float(summary[1]["accuracy_ci_low"]) < float(summary[1]["accuracy"])


def test_ls_and_env_print_json(capsys):
    rc, text, _ = cli(capsys, "ls", "methods", "--json")
    assert rc == 0
    assert {m["name"] for m in json.loads(text)} >= {"zeroshot", "norm_tent"}
    rc, text, _ = cli(capsys, "ls", "--json")
    assert set(json.loads(text)) >= {"methods", "shifts", "suites"}
    rc, text, _ = cli(capsys, "env", "--json")
    doc = json.loads(text)
    assert rc == 0 and "torch" in doc and "tta-bench-testplugin" in doc["plugin distributions"]
