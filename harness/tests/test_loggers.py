"""Experiment trackers (``logger=[...]``, ``tta_bench.run.trackers``) against the real libraries:
each run's cells, config and artifacts are read back from what W&B (offline), MLflow (a
local file store) and TensorBoard (event files) wrote. Bad names and missing extras are
refused before anything is built; no tracker is imported unless chosen; a resumed run
sends only the cells it ran; a failing tracker costs no results."""

from __future__ import annotations

import json
import logging
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest

import tta_bench
from tta_bench.run import trackers as loggers

from .helpers import cli, run, spec, strict_json, subprocess_env

#: The modules the trackers bring; none may be imported by a run that chose none.
TRACKER_MODULES = ("wandb", "mlflow", "tensorboard", "torch.utils.tensorboard")


def _evaluate(out: Path, *overrides: str) -> dict[str, Any]:
    return tta_bench.evaluate("norm_tent", seeds=[0], output=out, overrides=list(overrides))


def _accuracies(record: dict[str, Any]) -> list[tuple[int, float]]:
    """``(step, accuracy)`` per cell: a cell's step is its index in the results file."""
    return [(i, c["accuracy"]) for i, c in enumerate(record["cells"])]


# -- choosing ------------------------------------------------------------------------------
def test_an_unknown_logger_exits_2_naming_the_options_before_anything_is_built(tmp_path, capsys):
    from tta_bench_testplugin import model

    before = model.builds
    out = tmp_path / "r.json"
    rc, _, err = cli(capsys, "run", "--quiet", "--output", str(out), "logger=[wandbb]")
    assert rc == 2
    assert "unknown logger 'wandbb'; available: mlflow, tensorboard, wandb" in err
    with pytest.raises(ValueError, match="unknown logger 'tb'; available: mlflow, tensorboard"):
        _evaluate(out, "logger=[tensorboard,tb]")
    assert model.builds == before and not out.exists()


def test_a_missing_library_names_the_extra_to_install():
    with pytest.raises(ValueError) as info:
        loggers.require("wandb", "tta_bench_no_such_tracker_library")
    assert "pip install 'tta-bench[wandb]'" in str(info.value)
    assert "'tta_bench_no_such_tracker_library'" in str(info.value)


def test_a_folder_named_like_the_library_is_not_the_library(tmp_path, monkeypatch):
    (tmp_path / "tta_bench_fake_tracker").mkdir()  # W&B leaves ./wandb/ behind, say
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"pip install 'tta-bench\[mlflow\]'"):
        loggers.require("mlflow", "tta_bench_fake_tracker")


def test_a_missing_extra_is_refused_before_anything_is_built(tmp_path, monkeypatch, capsys):
    from tta_bench_testplugin import model

    monkeypatch.setitem(loggers.TRACKERS, "mlflow", "tta_bench_no_such_tracker_library")
    before = model.builds
    out = tmp_path / "r.json"
    rc, _, err = cli(capsys, "run", "--quiet", "--output", str(out), "logger=[mlflow]")
    assert rc == 2 and "pip install 'tta-bench[mlflow]'" in err
    with pytest.raises(ValueError, match=r"pip install 'tta-bench\[mlflow\]'"):
        _evaluate(out, "logger=[mlflow]")
    assert model.builds == before and not out.exists()


def test_the_choice_reaches_the_spec_checked_and_once_each():
    from tta_bench.run.resolve import resolve_run

    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    _, spec = resolve_run("norm_tent", None, None, ["logger=[tensorboard,wandb,tensorboard]"])
    assert spec.loggers == ["tensorboard", "wandb"]
    _, spec = resolve_run("norm_tent", None, None, [])
    assert spec.loggers == []


@pytest.mark.slow
def test_a_run_without_loggers_imports_no_tracker(tmp_path):
    code = (
        "import json, sys, tta_bench\n"
        f"tta_bench.evaluate('norm_tent', seeds=[0], output={str(tmp_path / 'r.json')!r})\n"
        f"names = {TRACKER_MODULES!r}\n"
        "print(json.dumps(sorted(m for m in sys.modules\n"
        "    if any(m == n or m.startswith(n + '.') for n in names))))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == []
    assert len(strict_json(tmp_path / "r.json")["cells"]) == 4


# -- W&B -----------------------------------------------------------------------------------
def _wandb_records(path: Path) -> list[Any]:
    """The records of an offline run's ``run-<id>.wandb`` file, as W&B's own protobuf
    ``Record``s. The file is W&B's transaction log, a LevelDB-style log: a 7-byte header
    (``:W&B``, magic ``0xBEE1``, version 0), then 32 KiB blocks of chunks, each ``crc32
    (uint32, over the type byte and the data) | length (uint16) | type (uint8: 1 full, 2
    first, 3 middle, 4 last) | data``; a block's tail too short for a header is padding.
    (W&B's Python reader, ``wandb.sdk.internal.datastore``, is used where it still ships.)"""
    from wandb.proto import wandb_internal_pb2 as pb

    def parse(data: bytes) -> Any:
        record = pb.Record()
        record.ParseFromString(data)
        return record

    try:
        from wandb.sdk.internal import datastore  # older wandb
    except ImportError:
        datastore = None
    if datastore is not None:
        store = datastore.DataStore()
        store.open_for_scan(str(path))
        out = []
        while (data := store.scan_data()) is not None:
            out.append(parse(data))
        return out
    raw = path.read_bytes()
    assert struct.unpack("<4sHB", raw[:7]) == (b":W&B", 0xBEE1, 0), "not a W&B log"
    block, i, chunks, out = 32768, 7, b"", []
    while i + 7 <= len(raw):
        if block - i % block < 7:
            i += block - i % block  # padding
            continue
        crc, length, kind = struct.unpack("<IHB", raw[i : i + 7])
        if (crc, length, kind) == (0, 0, 0):  # the rest of a preallocated block
            break
        data = raw[i + 7 : i + 7 + length]
        assert zlib.crc32(data, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, "bad chunk"
        i += 7 + length
        chunks += data
        if kind in (1, 4):  # full, last: a record ends here
            out.append(parse(chunks))
            chunks = b""
    return out


@pytest.fixture()
def wandb_offline(tmp_path, monkeypatch):
    """W&B offline, every folder it writes under ``tmp_path``; its service process is shut
    down after the test."""
    wandb = pytest.importorskip("wandb")
    home = tmp_path / "wandb-home"
    for name in ("DIR", "CACHE_DIR", "CONFIG_DIR", "DATA_DIR", "ARTIFACT_DIR"):
        (home / name.lower()).mkdir(parents=True)
        monkeypatch.setenv(f"WANDB_{name}", str(home / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    for name in ("WANDB_PROJECT", "WANDB_NAME", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    yield home / "dir"
    wandb.finish()  # nothing left open if the test failed mid-run
    wandb.teardown()  # a no-op when the test did it


def test_wandb_offline_run_holds_the_config_every_cell_and_the_artifacts(tmp_path, wandb_offline):
    out = tmp_path / "r.json"
    record = _evaluate(out, "logger=[wandb]", "log_samples=true")
    import wandb

    wandb.teardown()  # the service process ends: it has closed (flushed) the run's log
    (log,) = wandb_offline.glob("wandb/offline-run-*/run-*.wandb")
    records = _wandb_records(log)
    by_kind: dict[str, list[Any]] = {}
    for r in records:
        by_kind.setdefault(r.WhichOneof("record_type"), []).append(r)

    assert "run" in by_kind, f"{log}: {[(k, len(v)) for k, v in by_kind.items()]}"
    (start,) = [r.run for r in by_kind["run"]]
    assert start.project == "tta-bench" and start.display_name == "norm_tent on tiny-shifts"
    config = {u.key: json.loads(u.value_json) for u in start.config.update}
    assert config["method"]["name"] == "norm_tent" and config["seeds"] == [0]
    assert config["logger"] == ["wandb"]

    rows = {}
    for r in by_kind["history"]:
        row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        rows[row["_step"]] = row
    assert [(s, rows[s]["cell/accuracy"]) for s in sorted(rows)] == _accuracies(record)
    for step, cell in enumerate(record["cells"]):
        assert rows[step]["cell/time_per_sample_s"] == pytest.approx(cell["time_per_sample_s"])
        assert rows[step]["cell/severity"] == cell["severity"]
    last = rows[len(record["cells"]) - 1]  # the cells table: logged at the last step
    assert last["cells/_type"] == "table-file"
    table = json.loads((log.parent / "files" / last["cells/path"]).read_text(encoding="utf-8"))
    column = table["columns"].index("accuracy")
    assert [(row[0], row[column]) for row in table["data"]] == _accuracies(record)
    assert [row[1:4] for row in table["data"]] == [
        [c["shift"], c["severity"], c["seed"]] for c in record["cells"]
    ]

    artifacts = {r.artifact.type: r.artifact for r in by_kind["artifact"]}
    assert {e.path for e in artifacts["results"].manifest.contents} == {"r.json"}
    samples = {e.path for e in artifacts["samples"].manifest.contents}
    assert samples == {f"r.samples/{p.name}" for p in (tmp_path / "r.samples").iterdir()}
    assert len(samples) == 4
    assert by_kind["exit"][0].exit.exit_code == 0


# -- MLflow --------------------------------------------------------------------------------
@pytest.fixture()
def mlflow_store(tmp_path, monkeypatch):
    """A local MLflow file store; its URI is in ``MLFLOW_TRACKING_URI``."""
    pytest.importorskip("mlflow")
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 opts in to file stores
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    return uri


def _only_mlflow_run(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    (found,) = client.search_runs(experiments)
    return client, found


def test_mlflow_run_holds_params_metrics_per_step_and_artifacts(tmp_path, mlflow_store):
    out = tmp_path / "r.json"
    record = _evaluate(out, "logger=[mlflow]", "log_samples=true")
    client, found = _only_mlflow_run(mlflow_store)
    run_id = found.info.run_id
    assert found.info.status == "FINISHED"
    assert found.info.run_name == "norm_tent on tiny-shifts"
    params = found.data.params
    assert params["method.name"] == "norm_tent" and params["seeds"] == "[0]"
    assert params["logger"] == '["mlflow"]' and params["suite"] == "tiny-shifts"
    assert found.data.tags["tta_bench.protocol_id"] == record["protocol"]["id"]

    history = [(m.step, m.value) for m in client.get_metric_history(run_id, "cell/accuracy")]
    assert sorted(history) == _accuracies(record)
    seeds = client.get_metric_history(run_id, "cell/seed")
    assert sorted(m.step for m in seeds) == [0, 1, 2, 3]
    assert found.data.metrics["summary/mean_accuracy"] == pytest.approx(
        record["summary"]["mean_accuracy"]
    )

    listed = {a.path for a in client.list_artifacts(run_id)}
    assert listed == {"r.json", "r.samples"}
    samples = {Path(a.path).name for a in client.list_artifacts(run_id, "r.samples")}
    assert samples == {p.name for p in (tmp_path / "r.samples").iterdir()}
    local = Path(client.download_artifacts(run_id, "r.json", str(tmp_path / "down")))
    assert json.loads(local.read_text(encoding="utf-8")) == strict_json(out)


def test_mlflow_params_are_cut_to_mlflows_limits():
    pytest.importorskip("mlflow")
    from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, MAX_PARAM_VAL_LENGTH

    long = "x" * (MAX_PARAM_VAL_LENGTH + 10)
    params = dict(loggers.mlflow_params({"a": {"b": long, "c": None}, "k" * 300: 1, "q?": "v"}))
    assert params["a.b"] == long[:MAX_PARAM_VAL_LENGTH]
    assert params["a.c"] == "null"
    assert params["k" * MAX_ENTITY_KEY_LENGTH] == "1"
    assert params["q_"] == "v"


def test_a_failed_run_closes_the_mlflow_run_as_failed_with_the_cells_it_finished(
    tmp_path, mlflow_store
):
    from tta_bench.run import runner

    seen = []

    def stop_in_the_second_group(seed: int, batch: Any, images: Any) -> None:
        seen.append(batch.group)
        if len(set(seen)) > 1:
            raise RuntimeError("stopped on purpose")

    out = tmp_path / "r.json"
    with pytest.raises(RuntimeError, match="stopped on purpose"):
        runner.run(
            spec("norm_tent", loggers=["mlflow"]),
            out,
            observer=stop_in_the_second_group,
        )
    partial = strict_json(out)
    client, found = _only_mlflow_run(mlflow_store)
    assert found.info.status == "FAILED"
    history = client.get_metric_history(found.info.run_id, "cell/accuracy")
    assert sorted((m.step, m.value) for m in history) == _accuracies(partial)
    assert 1 <= len(partial["cells"]) < 4
    assert not client.list_artifacts(found.info.run_id)  # artifacts: finished runs only


# -- TensorBoard ---------------------------------------------------------------------------
def _events(folder: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return events


def _text(events: Any, tag: str) -> list[str]:
    return [e.tensor_proto.string_val[0].decode() for e in events.Tensors(f"{tag}/text_summary")]


def test_tensorboard_event_files_hold_a_scalar_per_cell_and_the_config(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.delenv(loggers.TENSORBOARD_DIR_ENV, raising=False)
    out = tmp_path / "r.json"
    record = _evaluate(out, "logger=[tensorboard]")
    events = _events(tmp_path / "r.tensorboard")
    scalars = [(e.step, e.value) for e in events.Scalars("cell/accuracy")]
    assert [s for s, _ in scalars] == [s for s, _ in _accuracies(record)]
    assert [v for _, v in scalars] == pytest.approx([a for _, a in _accuracies(record)])
    nll = [e.value for e in events.Scalars("cell/nll")]
    assert nll == pytest.approx([c["nll"] for c in record["cells"]], rel=1e-6)
    (config,) = _text(events, "config")
    assert '"name": "norm_tent"' in config and '"tensorboard"' in config
    cells = _text(events, "cell")
    assert cells[0] == "{shift} severity {severity} seed {seed}".format(**record["cells"][0])
    assert "summary/mean_accuracy" in events.Tags()["scalars"]


def test_a_resumed_run_sends_only_the_cells_it_ran(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.setenv(loggers.TENSORBOARD_DIR_ENV, str(tmp_path / "tb"))
    out = tmp_path / "r.json"
    run(out, "zeroshot", seeds=[0])  # 4 cells, no tracker
    resumed = run(out, "zeroshot", seeds=[0, 1], loggers=["tensorboard"])
    assert resumed["skipped_cells"] == 4 and len(resumed["cells"]) == 8
    events = _events(tmp_path / "tb" / "r")  # $TTA_BENCH_TENSORBOARD_DIR/<results stem>
    assert [e.step for e in events.Scalars("cell/accuracy")] == [4, 5, 6, 7]
    assert {e.value for e in events.Scalars("cell/seed")} == {1.0}
    assert not (tmp_path / "r.tensorboard").exists()


# -- failures ------------------------------------------------------------------------------
@pytest.fixture()
def warnings_logged(caplog, monkeypatch):
    """The ``tta_bench`` logger's warnings (the CLI's ``configure`` stops it propagating)."""
    monkeypatch.setattr(logging.getLogger("tta_bench"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="tta_bench")

    def messages() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "tta_bench"]

    return messages


def test_a_tracker_that_cannot_start_costs_no_results(tmp_path, monkeypatch, warnings_logged):
    pytest.importorskip("tensorboard")
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("", encoding="utf-8")
    monkeypatch.setenv(loggers.TENSORBOARD_DIR_ENV, str(blocker))
    out = tmp_path / "r.json"
    record = run(out, "zeroshot", loggers=["tensorboard"])
    assert len(record["cells"]) == 4 and "finished" in strict_json(out)
    (message,) = warnings_logged()
    assert message.startswith("logger 'tensorboard': start failed") and str(out) in message


def test_a_tracker_failing_mid_run_costs_no_results(tmp_path, monkeypatch, warnings_logged):
    pytest.importorskip("tensorboard")
    monkeypatch.delenv(loggers.TENSORBOARD_DIR_ENV, raising=False)

    def broken(self: Any, steps: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(loggers.TensorBoardTracker, "log_cells", broken)
    out = tmp_path / "r.json"
    record = run(out, "zeroshot", loggers=["tensorboard"])
    assert len(strict_json(out)["cells"]) == len(record["cells"]) == 4
    failed = [m for m in warnings_logged() if "log_cells failed (OSError: disk full)" in m]
    assert len(failed) == 4  # one per group (tiny-shifts: a group per cell); the run went on
    (config,) = _text(_events(tmp_path / "r.tensorboard"), "config")  # closed, not lost
    assert config


def test_a_single_logger_needs_no_brackets():
    from tta_bench.run.resolve import resolve_run

    _, spec = resolve_run("norm_tent", overrides=["seeds=[0]", "logger=tensorboard"])
    assert spec.loggers == ["tensorboard"]
