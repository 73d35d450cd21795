"""Results files: the declared schema refuses hand-edited files naming the bad field; the
snapshot writer's guarantees; records of other model weights are never compared."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from filelock import FileLock

from tta_bench.run import results
from tta_bench.run.schema import ResultsFormatError

from .helpers import cli, run, scores, strict_json


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished run's results file and record."""
    path = tmp_path_factory.mktemp("finished") / "r.json"
    run(path, "zeroshot")
    return path, strict_json(path)


def _edited(tmp_path, record, edit) -> str:
    data = json.loads(json.dumps(record))
    data = edit(data) or data
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_a_finished_file_renders(finished, capsys):
    rc, out, err = cli(capsys, "table", str(finished[0]))
    assert rc == 0, err
    assert "tiny-shifts" in out and "| noise" in out


def _set(path, value):
    def edit(data):
        target = data
        for part in path[:-1]:
            target = target[part]
        if value is KeyError:
            del target[path[-1]]
        else:
            target[path[-1]] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (_set(["cells", 0, "accuracy"], "0.25"), "cells[0].accuracy: '0.25' is not of type"),
        (_set(["cells", 2, "accuracy"], 1.7), "cells[2].accuracy: 1.7 is greater than the maximum"),
        (_set(["cells", 1, "n"], KeyError), "cells[1]: 'n' is a required property"),
        (_set(["protocol"], KeyError), "(top level): 'protocol' is a required property"),
        (_set(["cells", 3, "severity"], 9), "cells[3].severity: 9 is greater than the maximum"),
        (lambda data: [data], "(top level): expected a results object, got a JSON list"),
        (_set(["schema_version"], 1), "schema_version 1 is not supported"),
    ],
)
def test_table_refuses_a_hand_edited_file_naming_the_bad_field(
    finished, tmp_path, capsys, edit, expected
):
    path = _edited(tmp_path, finished[1], edit)
    rc, out, err = cli(capsys, "table", path)
    assert rc == 2 and out == ""
    assert path in err and expected in err, err
    with pytest.raises(ResultsFormatError, match="edited.json"):
        results.load_results(path)


def test_the_same_contents_are_validated_once_and_any_change_again(finished, tmp_path, monkeypatch):
    """Validation is a pure function of a file's bytes: contents that passed are not
    validated again in this process (another path, the same file read again); changed
    contents are, and bad contents are refused at every read."""
    from tta_bench.run import schema

    calls: list[str] = []
    real = schema.validate

    def spy(data, source):
        calls.append(Path(source).name)
        return real(data, source)

    monkeypatch.setattr(schema, "validate", spy)
    monkeypatch.setattr(results, "_VALID", {})
    text = finished[0].read_text()
    for name in ("a.json", "b.json"):
        (tmp_path / name).write_text(text)
        assert results.load_results(tmp_path / name) == finished[1]
    assert calls == ["a.json"]
    changed = json.loads(text)
    changed["cells"][0]["time_per_sample_s"] = changed["cells"][0]["time_per_sample_s"] + 1.0
    (tmp_path / "b.json").write_text(json.dumps(changed))
    assert (
        results.load_results(tmp_path / "b.json")["cells"][0]["time_per_sample_s"]
        == changed["cells"][0]["time_per_sample_s"]
    )
    assert calls == ["a.json", "b.json"]
    bad = _edited(tmp_path, finished[1], _set(["cells", 3, "severity"], 9))
    for _ in range(2):
        with pytest.raises(ResultsFormatError, match="greater than the maximum"):
            results.load_results(bad)
    assert calls[2:] == ["edited.json", "edited.json"]


def test_table_refuses_a_nan_literal(finished, tmp_path, capsys):
    path = tmp_path / "nan.json"
    text = finished[0].read_text()
    accuracy = json.dumps(finished[1]["cells"][0]["nll"])
    assert text.count(accuracy) == 1
    path.write_text(text.replace(accuracy, "NaN"))
    json.loads(path.read_text())  # Python's own parser would have accepted it
    rc, _, err = cli(capsys, "table", str(path))
    assert rc == 2 and "non-standard JSON constant NaN" in err and str(path) in err


def test_a_missing_file_and_a_truncated_file_are_named(finished, tmp_path, capsys):
    rc, _, err = cli(capsys, "table", str(tmp_path / "nowhere.json"))
    assert rc == 2 and "nowhere.json" in err and "does not exist" in err
    cut = tmp_path / "cut.json"
    cut.write_text(finished[0].read_text()[:200])
    rc, _, err = cli(capsys, "table", str(cut))
    assert rc == 2 and "cut.json" in err and "not valid JSON" in err


def test_records_of_other_model_weights_are_refused_by_table_and_left_out_of_leaderboard(
    tmp_path, capsys
):
    board = tmp_path / "board"
    run(board / "a.json", "zeroshot")
    run(board / "b.json", "colour_oracle")
    other = run(board / "c.json", "zeroshot", model_args={"seed": 1})
    mine = strict_json(board / "a.json")["model"]["state_sha256"]
    assert other["model"]["state_sha256"] != mine
    assert other["protocol"]["id"] == strict_json(board / "a.json")["protocol"]["id"]
    rc, out, err = cli(capsys, "table", str(board / "a.json"), str(board / "c.json"))
    assert rc == 2 and out == ""
    assert "model weights differ" in err and mine[:12] in err
    rc, out, err = cli(capsys, "leaderboard", str(board), "--suite", "tiny-shifts", "--no-plots")
    assert rc == 0, err
    assert "ranked 2 runs" in out
    assert "left out c.json: model weights" in err and f"differ from the ranked {mine[:12]}" in err


# -- SnapshotWriter ------------------------------------------------------------------------
def _records(finished, k):
    """``k`` valid records of one run holding 1, 2, ... of its cells."""
    record = finished[1]
    out = []
    for i in range(1, k + 1):
        r = json.loads(json.dumps(record))
        r["cells"] = r["cells"][:i]
        r["summary"] = results.summarize(r["cells"])
        out.append(r)
    return out


def test_a_snapshot_is_frozen_when_submitted(finished, tmp_path):
    path = tmp_path / "r.json"
    (snapshot,) = _records(finished, 1)
    writer = results.SnapshotWriter(path)
    with FileLock(str(path) + ".lock"):  # the writer thread waits here with the snapshot
        writer.submit(snapshot)
        snapshot["cells"].append(finished[1]["cells"][1])
        snapshot["method"] = "changed"
    writer.close()
    written = strict_json(path)
    assert written["method"] == "zeroshot" and len(written["cells"]) == 1


def test_the_newest_snapshot_wins(finished, tmp_path):
    path = tmp_path / "r.json"
    writer = results.SnapshotWriter(path)
    snapshots = _records(finished, 4)
    with FileLock(str(path) + ".lock"):
        for k, s in enumerate(snapshots):
            s["config"] = {"snapshot": k}  # merging keeps cells, never this field
            writer.submit(s)
    writer.close()
    written = strict_json(path)
    assert written["config"] == {"snapshot": 3}
    assert scores(written) == scores(snapshots[-1])


def test_a_snapshot_with_a_nan_is_refused_at_submit(finished, tmp_path):
    (snapshot,) = _records(finished, 1)
    snapshot["cells"][0]["nll"] = float("nan")
    writer = results.SnapshotWriter(tmp_path / "r.json")
    with pytest.raises(ValueError, match="JSON compliant"):
        writer.submit(snapshot)
    writer.close()
    assert not (tmp_path / "r.json").exists()


def test_a_failed_write_is_raised_at_close_and_the_writer_refuses_more(finished, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    writer = results.SnapshotWriter(blocker / "r.json")  # its folder is a file
    (snapshot,) = _records(finished, 1)
    writer.submit(snapshot)
    with pytest.raises(OSError, match="could not write results file"):
        writer.close()
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit(snapshot)


def test_the_file_on_disk_is_always_a_whole_snapshot(finished, tmp_path):
    """Read the file while a writer replaces it again and again: every read parses."""
    path = tmp_path / "r.json"
    snapshots = _records(finished, 4)
    results.write_json_atomic(path, snapshots[0])
    stop, seen, bad = threading.Event(), set(), []

    def read():
        while not stop.is_set():
            try:
                seen.add(len(results.load_results(path)["cells"]))
            except ValueError as exc:  # noqa: PERF203 - a torn file would land here
                bad.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    writer = results.SnapshotWriter(path)
    for _ in range(20):
        for s in snapshots:
            writer.submit(s)
    writer.close()
    stop.set()
    reader.join()
    assert not bad and seen and seen <= {1, 2, 3, 4}


def test_fields_added_at_a_behaviour_preserving_default_stay_out_of_the_run_key():
    """``hash_omit_at_default``: a field added later leaves earlier run keys as they were
    while it holds its default, and changes the key at any other value."""
    import dataclasses

    from tta_bench.run.resume import method_config_hash

    @dataclasses.dataclass
    class Before:
        lr: float = 1e-3

    @dataclasses.dataclass
    class After:
        hash_omit_at_default = ("rotate",)
        lr: float = 1e-3
        rotate: float = 0.0

    @dataclasses.dataclass
    class Undeclared:
        lr: float = 1e-3
        rotate: float = 0.0

    assert method_config_hash(After()) == method_config_hash(Before())
    assert method_config_hash(After(rotate=10.0)) != method_config_hash(Before())
    assert method_config_hash(Undeclared()) != method_config_hash(Before())


def test_package_versions_are_read_once_and_each_caller_gets_its_own_copy(monkeypatch):
    first = results.package_versions()
    assert first["torch"] and set(first) == set(results.PACKAGES)
    first["torch"] = "edited by a caller"
    monkeypatch.setattr(results.md, "version", lambda name: pytest.fail(f"read {name} again"))
    again = results.package_versions()
    assert again["torch"] != "edited by a caller" and again == results.package_versions()
