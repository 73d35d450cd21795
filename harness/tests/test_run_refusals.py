"""What ``run`` and ``tta_bench.evaluate`` refuse before anything is built or written, and
what they no longer refuse: each case was a traceback, a silent no-op, a failure after the
whole run, or a refusal of a usable setup before."""

from __future__ import annotations

import json

import pytest

import tta_bench

from .helpers import cli

QUICK = ["--quiet", "seeds=[0]", "protocol.shifts=[dim]", "protocol.severities=[1]"]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"output": 123}, "output must be a path"),
        ({"data_dir": 5}, "data_dir must be a path"),
        ({"device": 3}, "device must be a string"),
        ({"progress": "yes"}, "progress must be True or False"),
    ],
)
def test_evaluate_names_an_argument_of_the_wrong_type(kwargs, words):
    # before: output=123 was a TypeError from pathlib after the run was resolved
    with pytest.raises(ValueError, match=words):
        tta_bench.evaluate("zeroshot", **kwargs)


def test_a_negative_seed_is_refused_by_the_cli_as_by_the_api(tmp_path, capsys):
    # before: the CLI ran seeds=[-1] that evaluate() refused
    out = tmp_path / "r.json"
    rc, _, err = cli(capsys, "run", "--output", str(out), *QUICK[:1], "seeds=[-1]")
    assert rc == 2 and "non-negative" in err and not out.exists()
    with pytest.raises(ValueError, match="non-negative"):
        tta_bench.evaluate("zeroshot", seeds=[-1])


def test_log_samples_top_k_below_one_is_refused_before_the_run(tmp_path, capsys):
    # before: the whole run ran, then pyarrow failed on a list of size 0
    out = tmp_path / "r.json"
    rc, _, err = cli(
        capsys, "run", "--output", str(out), *QUICK, "log_samples=true", "log_samples_top_k=0"
    )
    assert rc == 2 and "log_samples_top_k=0" in err
    assert not out.exists()


def test_logging_samples_into_a_finished_output_without_them_is_refused(tmp_path, capsys):
    # before: exit 0, nothing run (the cells were finished) and no per-sample file written
    out = tmp_path / "r.json"
    assert cli(capsys, "run", "--output", str(out), *QUICK, "log_samples=false")[0] == 0
    before = out.read_bytes()
    rc, _, err = cli(capsys, "run", "--output", str(out), *QUICK, "log_samples=logits")
    assert rc == 2 and "without per-sample files" in err and "new --output" in err
    assert out.read_bytes() == before
    # a run that logged them resumes with them
    logged = tmp_path / "logged.json"
    assert cli(capsys, "run", "--output", str(logged), *QUICK, "log_samples=logits")[0] == 0
    rc, text, err = cli(capsys, "run", "--output", str(logged), *QUICK, "log_samples=logits")
    assert rc == 0, err


def test_an_unusable_cache_folder_serves_a_run_with_cache_never(tmp_path, capsys, monkeypatch):
    # before: refused even though cache=never writes no decoded image
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("TTA_BENCH_CACHE", str(blocker / "cache"))
    out = tmp_path / "r.json"
    rc, _, err = cli(capsys, "run", "--output", str(out), *QUICK, "cache=auto")
    assert rc == 2 and "not writable" in err
    with pytest.warns(UserWarning, match="text heads are not cached"):
        rc, _, err = cli(capsys, "run", "--output", str(out), *QUICK, "cache=never")
    assert rc == 0, err
    assert json.loads(out.read_text())["cells"]
