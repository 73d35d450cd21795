"""Derived results never trust their inputs: per-sample files carry their run's identity
(run key, cell, method, rows, the digest of their data pages), ``rescore`` and ``merge``
refuse files that are not the run's own or were edited, ``merge`` recomputes every count
from the rows (the reference accuracy too) and checks each part's batches against the
stream's layout, empty parts merge, and ``rescore --write`` keeps the previous file and
never writes one readers refuse. Each case was a silent wrong result or a destroyed file
before."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tta_bench.run import rescore, results, samples, shard
from tta_bench.run.resolve import resolve_run
from tta_bench.run.runner import run

from .helpers import SCORES, cli

SEEDS = [0, 1]
EPISODIC = ["protocol.reset=episodic_batch", "progress=false"]
#: Batches of 5 over 32 images: 7 batches per cell, the last of 2 images.
BATCH5 = "protocol.batch_size=5"


def _run(method: str, output: Path, overrides: list[str]) -> dict:
    _, spec = resolve_run(method=method, overrides=overrides)
    return run(spec, output)


def _logged(method: str, output: Path, seeds=SEEDS) -> dict:
    seeds_arg = f"seeds=[{','.join(map(str, seeds))}]"
    return _run(method, output, ["log_samples=logits", seeds_arg, "progress=false"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """norm_tent and zeroshot on tiny-shifts with per-sample logits, seeds 0 and 1."""
    d = tmp_path_factory.mktemp("runs")
    _logged("norm_tent", d / "tent.json")
    _logged("zeroshot", d / "zs.json")
    return d


@pytest.fixture()
def tent(runs, tmp_path):
    """A private copy of the norm_tent run (results file and per-sample folder)."""
    out = tmp_path / "tent.json"
    shutil.copy(runs / "tent.json", out)
    shutil.copytree(samples.samples_dir(runs / "tent.json"), samples.samples_dir(out))
    return out


def _cell_path(out: Path, shift="noise", severity=1, seed=0) -> Path:
    return samples.cell_file(samples.samples_dir(out), shift, severity, seed)


def _rewrite(path: Path, change) -> None:
    """Rewrite a cell file with ``change(columns)`` applied, keeping its metadata."""
    table = pq.read_table(path)
    columns = {n: table.column(n).combine_chunks() for n in table.column_names}
    change(columns)
    new = pa.table(columns).replace_schema_metadata(table.schema.metadata)
    pq.write_table(new, path)


def _refused_by_rescore(capsys, out: Path, *words: str) -> None:
    before = out.read_bytes()
    rc, _, err = cli(capsys, "rescore", str(out), "--write")
    assert rc == 2, err
    for w in words:
        assert w in err, err
    assert out.read_bytes() == before  # nothing written
    assert not rescore.backup_path(out).exists()


# -- per-sample identity --------------------------------------------------------------
def test_each_file_carries_its_run_and_cell(runs):
    record = results.load_results(runs / "tent.json")
    path = _cell_path(runs / "tent.json", "dim", 3, 1)
    table = pq.read_table(path)
    found = samples.identity(table)
    assert found["run_key"] == results.record_key(record, with_weights=True)
    assert found["cell"] == ["dim", 3, 1] and found["method"] == "norm_tent"
    assert found["rows"] == table.num_rows == 32
    assert found["data_sha256"] == samples.data_digest(path.read_bytes())
    assert "reference" in table.column_names  # the frozen model's predictions, for merge


def test_rescore_of_an_untouched_run_changes_no_figure(tent, capsys):
    before = json.loads(tent.read_text())
    rc, _, err = cli(capsys, "rescore", str(tent), "--write")
    assert rc == 0, err
    after = results.load_results(tent)  # readers accept what was written
    for a, b in zip(before["cells"], after["cells"]):
        assert {k: a.get(k) for k in SCORES} == {k: b.get(k) for k in SCORES}
    assert json.loads(rescore.backup_path(tent).read_text()) == before


def test_another_runs_file_of_the_same_size_is_refused(tent, runs, capsys):
    # before: its accuracy was written into this run's cell and its error left stale
    shutil.copy(_cell_path(runs / "zs.json"), _cell_path(tent))
    _refused_by_rescore(capsys, tent, "noise__sev1__seed0.parquet", "method_config_hash")


def test_another_seeds_file_renamed_is_refused(tent, capsys):
    shutil.copy(_cell_path(tent, seed=1), _cell_path(tent, seed=0))
    _refused_by_rescore(capsys, tent, "cell ['noise', 1, 1] (expected ['noise', 1, 0])")


@pytest.mark.parametrize(
    "edit",
    [
        lambda c: c.__setitem__("label", pa.array(np.roll(c["label"].to_numpy(), 1))),
        lambda c: c.__setitem__(
            "logits",
            pa.FixedSizeListArray.from_arrays(
                pa.array(c["logits"].flatten().to_numpy() * 10), c["logits"].type.list_size
            ),
        ),
        lambda c: c.__setitem__("seed", pa.array([1] * len(c["seed"]), pa.int64())),
    ],
    ids=["labels", "logits_x10", "seed_column"],
)
def test_edited_rows_are_refused(tent, capsys, edit):
    _rewrite(_cell_path(tent), edit)
    _refused_by_rescore(capsys, tent, "noise__sev1__seed0.parquet", "is not cell")


def test_a_file_without_identity_is_refused(tent, capsys):
    path = _cell_path(tent)
    pq.write_table(pq.read_table(path).replace_schema_metadata(None), path)
    _refused_by_rescore(capsys, tent, "carries no identity")


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_single_value_edit_of_a_cell_file_is_refused(runs, tmp_path, data):
    table = pq.read_table(_cell_path(runs / "tent.json", "dim", 1, 0))
    columns = {n: table.column(n).combine_chunks() for n in table.column_names}
    name = data.draw(st.sampled_from(sorted(columns)))
    column = columns[name]
    values = column.to_pylist()
    row = data.draw(st.integers(0, len(values) - 1))
    old = values[row]
    if isinstance(old, list):  # one element of a list column
        j = data.draw(st.integers(0, len(old) - 1))
        values[row] = [*old[:j], _changed(old[j], data), *old[j + 1 :]]
    elif isinstance(old, str):
        values[row] = old + "x"
    else:
        values[row] = _changed(old, data)
    columns[name] = pa.array(values, column.type)
    edited = pa.table(columns).replace_schema_metadata(table.schema.metadata)
    folder = Path(tempfile.mkdtemp(dir=tmp_path))  # one per example
    pq.write_table(edited, samples.cell_file(folder, "dim", 1, 0))
    record = results.load_results(runs / "tent.json")
    # read whole, or only the columns a paired comparison reads: an edit of a column left
    # unread is refused too (the digest covers every data page)
    read = data.draw(st.sampled_from([None, ("index", "batch", "label", "prediction")]))
    with pytest.raises(ValueError, match="is not cell"):
        samples.verify_cell(
            samples.open_cell(folder, "dim", 1, 0, columns=read),
            run_key=results.record_key(record, with_weights=True),
            key=("dim", 1, 0),
            method="norm_tent",
            n=32,
        )


def _changed(value: float | int, data) -> float | int:
    """Another value of the same type: an integer moved by one, a float scaled."""
    if isinstance(value, int):
        return value + data.draw(st.sampled_from([1, -1]))
    return value * 1.5 + 0.125


# -- merge -----------------------------------------------------------------------------
def _parts(d: Path, count: int, extra: list[str], method="norm_tent") -> list[Path]:
    paths = [d / f"part{i}.json" for i in range(count)]
    for i, p in enumerate(paths):
        _run(method, p, [*EPISODIC, *extra, f"protocol.shard={i}/{count}"])
    return paths


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """norm_tent reset per batch, unsharded (with per-sample logits) and in 3 parts."""
    d = tmp_path_factory.mktemp("sharded")
    extra = ["seeds=[0]", BATCH5]
    whole = _run("norm_tent", d / "whole.json", [*EPISODIC, *extra, "log_samples=logits"])
    return d, whole, _parts(d, 3, extra)


def _copy_parts(parts: list[Path], dest: Path) -> list[Path]:
    out = []
    for p in parts:
        shutil.copy(p, dest / p.name)
        shutil.copytree(samples.samples_dir(p), samples.samples_dir(dest / p.name))
        out.append(dest / p.name)
    return out


def _scores(record: dict) -> list[dict]:
    return [{k: c.get(k) for k in SCORES} for c in record["cells"]]


def test_the_parts_merge_to_the_whole_run(sharded, tmp_path):
    _, whole, parts = sharded
    merged = shard.merge_parts(parts, tmp_path / "m.json")
    assert _scores(merged) == _scores(whole)
    rescore.recompute(tmp_path / "m.json")  # the merged files carry the merged run's identity


def test_edited_labels_in_a_part_are_refused(sharded, tmp_path):
    parts = _copy_parts(sharded[2], tmp_path)
    _rewrite(
        _cell_path(parts[1], "noise", 1, 0),
        lambda c: c.__setitem__("label", pa.array(np.zeros(len(c["label"]), np.int64))),
    )
    with pytest.raises(shard.MergeError, match="data digest"):
        shard.merge_parts(parts)


def test_a_part_relabelled_as_another_shard_is_refused(sharded, tmp_path):
    # before: part 0 relabelled as shard 1 counted half the images twice, half never
    parts = _copy_parts(sharded[2], tmp_path)
    for path, index in ((parts[0], 1), (parts[1], 0)):
        record = json.loads(path.read_text())
        record["shard"]["index"] = index
        record["config"]["protocol"]["shard"] = f"{index}/3"
        path.write_text(json.dumps(record))
    with pytest.raises(shard.MergeError, match="not cell|another part"):
        shard.merge_parts(parts)


def test_an_edited_reference_accuracy_is_refused_and_never_taken(sharded, tmp_path):
    parts = _copy_parts(sharded[2], tmp_path)
    record = json.loads(parts[2].read_text())
    cell = record["cells"][0]
    cell["reference_accuracy"] = 1.0 if cell["reference_accuracy"] != 1.0 else 0.0
    parts[2].write_text(json.dumps(record))
    with pytest.raises(shard.MergeError, match="reference_accuracy"):
        shard.merge_parts(parts)


def test_a_missing_batch_is_refused(sharded, tmp_path):
    parts = _copy_parts(sharded[2], tmp_path)
    record = json.loads(parts[0].read_text())
    record["stream_layout"][0]["batches"][0][1] += 3  # the layout this part claims
    parts[0].write_text(json.dumps(record))
    with pytest.raises(shard.MergeError, match="different stream layouts"):
        shard.merge_parts(parts)
    for p in parts[1:]:  # all parts agree on a layout with batches no part holds
        other = json.loads(p.read_text())
        other["stream_layout"] = record["stream_layout"]
        p.write_text(json.dumps(other))
    with pytest.raises(shard.MergeError, match="missing batch"):
        shard.merge_parts(parts)


def test_a_part_with_no_batch_merges(tmp_path, capsys):
    # before: a part that got no batch ended in a traceback (run, then sweep and merge)
    extra = ["seeds=[0]", "protocol.shifts=[noise]", "protocol.severities=[1]"]
    extra += ["protocol.max_images=5", BATCH5]  # one batch: parts 1..3 get none
    whole = _run("norm_tent", tmp_path / "w.json", [*EPISODIC, *extra])
    parts = [tmp_path / f"p{i}.json" for i in range(4)]
    for i, p in enumerate(parts):
        rc, _, err = cli(
            capsys, "run", "--method", "norm_tent", "--output", str(p), "--quiet",
            *EPISODIC, *extra, f"protocol.shard={i}/4",
        )  # fmt: skip
        assert rc == 0, err
    assert results.load_results(parts[3])["cells"] == []
    merged = shard.merge_parts(parts, tmp_path / "m.json")
    assert _scores(merged) == _scores(whole)


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(count=st.integers(1, 5), batch=st.integers(1, 9), images=st.integers(3, 32))
def test_merged_parts_equal_the_unsharded_run_for_any_layout(tmp_path, count, batch, images):
    d = tmp_path / f"n{count}-b{batch}-i{images}"
    d.mkdir()
    extra = ["seeds=[0]", "protocol.shifts=[dim]", f"protocol.max_images={images}"]
    extra += [f"protocol.batch_size={batch}"]
    whole = _run("norm_tent", d / "w.json", [*EPISODIC, *extra])
    parts = _parts(d, count, extra)
    assert _scores(shard.merge_parts(parts)) == _scores(whole)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_single_count_edit_of_a_part_is_refused(sharded, tmp_path, data):
    parts = _copy_parts(sharded[2], Path(tempfile.mkdtemp(dir=tmp_path)))
    path = data.draw(st.sampled_from(parts))
    record = json.loads(path.read_text())
    cell = data.draw(st.sampled_from(record["cells"]))
    field = data.draw(st.sampled_from(["accuracy", "error", "reference_accuracy", "n"]))
    n = cell["n"]
    if field == "n":
        cell["n"] = n + data.draw(st.sampled_from([1, -1]))
    else:
        others = [k / n for k in range(n + 1) if k / n != cell[field]]
        cell[field] = data.draw(st.sampled_from(others))
    path.write_text(json.dumps(record))
    with pytest.raises(shard.MergeError):
        shard.merge_parts(parts)
