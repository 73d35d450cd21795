"""Every file the harness writes reaches its name whole: logs (``paths.AtomicLog``),
leaderboards and plots, like the results (``paths.atomic_path``)."""

from __future__ import annotations

import json

from tta_bench.paths import AtomicLog

from .helpers import run


def test_a_log_reaches_its_file_only_when_flushed_and_whole(tmp_path):
    path = tmp_path / "logs" / "run.jsonl"
    log = AtomicLog(path)
    log.write('{"a": 1}\n')
    assert not path.exists()  # nothing flushed yet: no partial file
    log.flush()
    assert path.read_text() == '{"a": 1}\n'
    log.write('{"b": 2')  # a torn write is never seen ...
    assert path.read_text() == '{"a": 1}\n'
    log.write("}\n")
    log.close()  # ... the file moves from one whole state to the next
    assert path.read_text() == '{"a": 1}\n{"b": 2}\n'
    assert not list(path.parent.glob(".*.tmp"))


def test_append_keeps_what_the_file_holds_and_a_new_log_starts_empty(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text("old\n")
    with AtomicLog(path, append=True) as log:
        log.write("new\n")
    assert path.read_text() == "old\nnew\n"
    with AtomicLog(path):
        pass
    assert path.read_text() == ""


def test_the_batch_log_holds_a_line_per_batch_after_the_run(tmp_path):
    log = tmp_path / "batches.jsonl"
    record = run(tmp_path / "r.json", "norm_tent", batch_log=str(log))
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == record["loop"]["batches"]
    assert not list(tmp_path.glob(".*.tmp"))
