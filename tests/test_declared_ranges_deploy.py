"""Deployment refuses a value out of its declared range the way every config check does
(``tta_bench.bounds.check_values``: ``KEY=VALUE is out of range: it must be ...``), with
exit status 2, on every path, before any model is built: a method option in a predict job,
in ``tta-bench serve``'s overrides and in the Python API; a predict job key; a serve limit.

"Before any model is built" is shown by a registered model whose factory fails the test
when it is called: a check that ran after building the model would hit it first."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from processes import python_ok

from tta_bench.cli import main
from tta_bench.registry import registry

#: What ``check_values`` says of tent's ``lr=-1`` (OmegaConf makes the float field -1.0).
LR_MESSAGE = "method.lr=-1.0 is out of range: it must be > 0"
NEVER_BUILT = "never-built-model"


@pytest.fixture()
def factory_calls():
    """Registers ``NEVER_BUILT``, a model factory that records its call and raises; yields
    the calls (none is the point)."""
    calls: list[dict] = []

    def factory(**kwargs):
        calls.append(kwargs)
        raise AssertionError("the model was built before the bad value was refused")

    registry("models").add(NEVER_BUILT, factory)
    try:
        yield calls
    finally:
        registry("models")._scan().pop(NEVER_BUILT)
        registry("models")._loaded.pop(NEVER_BUILT, None)


def _job(tmp_path, **change) -> dict:
    images = tmp_path / "images"
    images.mkdir(exist_ok=True)
    return {
        "input_dir": str(images),
        "output_dir": str(tmp_path / "out"),
        "model": NEVER_BUILT,
        "classnames": ["cat", "dog"],
        "method": "tent",
        "overrides": {"lr": -1},
        "progress": False,
        **change,
    }


def _stderr_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


# -- (a) a method option out of range in a predict job ---------------------------------------
def test_predict_job_with_a_method_option_out_of_range_exits_2(tmp_path, capsys, factory_calls):
    path = tmp_path / "job.json"
    path.write_text(json.dumps(_job(tmp_path)))
    assert main(["predict", "--config", str(path)]) == 2
    lines = _stderr_lines(capsys)
    assert len(lines) == 1 and lines[0].endswith(LR_MESSAGE), lines
    assert factory_calls == []
    assert not (tmp_path / "out").exists()


def test_every_python_path_of_a_predict_job_refuses_it_alike(tmp_path, factory_calls):
    from tta_bench.deploy.adapter import Adapter
    from tta_bench.deploy.predict import PredictJob, run_job

    cfg = _job(tmp_path)
    with pytest.raises(ValueError, match=f"^{re.escape(LR_MESSAGE)}$"):
        PredictJob.from_dict(cfg)  # the checked job
    with pytest.raises(ValueError, match=f"^{re.escape(LR_MESSAGE)}$"):
        run_job(PredictJob(**cfg))  # a job built without its checks: refused at the adapter
    with pytest.raises(ValueError, match=f"^{re.escape(LR_MESSAGE)}$"):
        Adapter.from_registry(NEVER_BUILT, classnames=["cat"], method="tent", overrides=["lr=-1"])
    assert factory_calls == []
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"top_k": 0}, "predict.top_k=0 is out of range: it must be >= 1"),
        ({"batch_size": -3}, "predict.batch_size=-3 is out of range: it must be >= 1"),
        ({"max_retry": -1}, "predict.max_retry=-1 is out of range: it must be >= 0"),
        ({"on_bad_image": "ignore"}, "unknown predict.on_bad_image='ignore'; available: skip"),
    ],
)
def test_a_predict_job_key_out_of_range_exits_2(tmp_path, capsys, factory_calls, change, message):
    path = tmp_path / "job.json"
    path.write_text(json.dumps(_job(tmp_path, overrides={}, **change)))
    assert main(["predict", "--config", str(path)]) == 2
    assert message in capsys.readouterr().err
    assert factory_calls == [] and not (tmp_path / "out").exists()


def test_the_job_keys_are_declared_once():
    """Each key's type, default, help and range or choices sit on its field."""
    from tta_bench.bounds import field_bounds
    from tta_bench.deploy.job import PredictJob

    fields = {f.name: f for f in dataclasses.fields(PredictJob)}
    assert all(f.metadata["help"] for f in fields.values())
    assert str(field_bounds(PredictJob, "max_pixels")) == ">= 1"
    assert fields["layout"].metadata["choices"] == ("auto", "folder", "subfolders", "classes")
    job = PredictJob(input_dir="in", output_dir="out")
    assert (job.batch_size, job.reset, job.overrides, job.resume) == (64, "per_batch", {}, True)


# -- (b) a method option out of range in tta-bench serve -------------------------------------
def test_serve_with_a_method_option_out_of_range_exits_2(capsys, monkeypatch, factory_calls):
    pytest.importorskip("fastapi")
    monkeypatch.delenv("TTA_BENCH_SERVE_TOKEN", raising=False)  # --no-auth refuses a token
    args = ["--model", NEVER_BUILT, "--classnames", "cat,dog", "--method", "tent", "lr=-1"]
    assert main(["serve", "--port", "0", "--no-auth", *args]) == 2
    lines = _stderr_lines(capsys)
    assert len(lines) == 1 and lines[0].endswith(LR_MESSAGE), lines
    assert factory_calls == []


# -- (c) a serve limit out of range ----------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-body-mb", "-1"], "serve.max_body_mb=-1.0 is out of range: it must be > 0"),
        (["--workers", "0"], "serve.workers=0 is out of range: it must be > 0"),
        (["--body-timeout-s", "0"], "serve.body_timeout_s=0.0 is out of range: it must be > 0"),
        (["--session-idle-s", "nan"], "serve.session_idle_s=nan: not a finite number"),
    ],
)
def test_serve_with_a_limit_out_of_range_exits_2(capsys, monkeypatch, factory_calls, args, message):
    pytest.importorskip("fastapi")
    monkeypatch.delenv("TTA_BENCH_SERVE_TOKEN", raising=False)  # --no-auth refuses a token
    model = ["--model", NEVER_BUILT, "--classnames", "cat,dog"]
    assert main(["serve", "--port", "0", "--no-auth", *model, *args]) == 2
    lines = _stderr_lines(capsys)
    assert len(lines) == 1 and lines[0].endswith(message), lines
    assert factory_calls == []


def test_the_serve_options_are_generated_from_the_limits():
    """One option per ``Limits`` field, its default the field's (MiB options in MiB), and
    a ``Limits`` out of range is refused in the same words."""
    import argparse

    from tta_bench.deploy.serve import Limits, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    defaults = Limits()
    for f in dataclasses.fields(Limits):
        if f.name.endswith("_bytes"):
            mib = getattr(args, f.name.removesuffix("_bytes") + "_mb")
            assert mib * 2**20 == getattr(defaults, f.name), f.name
        else:
            assert getattr(args, f.name) == getattr(defaults, f.name), f.name
    with pytest.raises(ValueError, match=re.escape("serve.max_images=0 is out of range")):
        Limits(max_images=0)


def test_importing_serve_loads_neither_fastapi_nor_uvicorn_nor_torch():
    python_ok(
        "import sys, tta_bench.deploy.serve\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('fastapi', 'uvicorn', 'starlette', 'h11', 'torch'))\n"
        "assert not bad, bad\n"
    )
