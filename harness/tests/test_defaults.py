"""The harness's defaults come from the installed catalogues' ``defaults:`` section, never
from the harness itself: with the test plugin they are its choices; with no plugin there
are none, and each place that needs one says so."""

from __future__ import annotations

import pytest

from tta_bench import catalog
from tta_bench.config import run_config
from tta_bench.deploy.predict import PredictJob
from tta_bench.registry import registry
from tta_bench.report import tables
from tta_bench.run.resolve import resolve_run

from .helpers import cli


def test_the_defaults_are_the_test_plugins(capsys):
    assert [catalog.default(k) for k in catalog.DEFAULT_KEYS] == [
        "tiny-shifts",
        "zeroshot",
        "tiny-clip",
        "zeroshot",
    ]
    rc, out, _ = cli(capsys, "ls", "defaults")
    assert rc == 0
    assert [line.split() for line in out.splitlines()[2:]] == [
        ["suite", "tiny-shifts"],
        ["method", "zeroshot"],
        ["model", "tiny-clip"],
        ["reference", "zeroshot"],
    ]
    cfg = run_config()
    assert cfg.suite == "tiny-shifts"
    assert cfg.defaults[1:] == [{"method": "zeroshot"}, {"model": "tiny-clip"}]


def test_a_run_without_method_or_suite_takes_the_catalogues():
    _, spec = resolve_run(overrides=["seeds=[0]"])
    assert (spec.method, spec.protocol.name, spec.model) == ("zeroshot", "tiny-shifts", "tiny-clip")


def test_the_reference_is_a_contract_attribute():
    assert registry("methods").get("zeroshot").is_reference
    assert not registry("methods").get("norm_tent").is_reference
    assert tables.baseline_name(tables.REFERENCE) == "zeroshot"


def test_without_a_plugin_no_default_exists_and_each_place_says_so(plugins_env, tmp_path):
    plugins_env("tta-bench")
    with pytest.raises(
        catalog.NoDefaultError, match="no installed catalogue names a default method"
    ):
        catalog.default("method")
    assert catalog.default_or_none("reference") is None
    assert tables.baseline_name(tables.REFERENCE) is None
    images = tmp_path / "in"
    images.mkdir()
    with pytest.raises(ValueError, match="predict job key 'method'"):
        PredictJob.from_dict({"input_dir": str(images), "output_dir": str(tmp_path / "out")})
    with pytest.raises(KeyError, match="unknown default 'metric'"):
        catalog.default("metric")
