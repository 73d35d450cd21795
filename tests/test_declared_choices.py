"""Every text-head, precision and ranged field is declared once on its config field and
refused from the command line and the Python API with the same message, before anything
is built (``tta_bench.bounds``)."""

from __future__ import annotations

import dataclasses

import pytest

from tta_bench.bounds import _declared
from tta_bench.registry import registry

METHODS = registry("methods").names()


def _fields(name: str) -> set[str]:
    cfg = registry("methods").get(name).Config
    return {f.name for f in dataclasses.fields(cfg)} if dataclasses.is_dataclass(cfg) else set()


@pytest.mark.parametrize("name", METHODS)
def test_text_head_and_precision_are_declared_choices(name):
    cfg = registry("methods").get(name).Config
    for field in {"text_head", "precision"} & _fields(name):
        assert _declared(cfg, field, "choices"), f"{name}.{field} is a free string"


TEXT_HEAD_METHODS = [m for m in METHODS if "text_head" in _fields(m)]


@pytest.mark.parametrize("name", TEXT_HEAD_METHODS)
def test_a_bad_text_head_is_refused_before_anything_is_built(name, capsys, monkeypatch):
    import tta_bench
    from tta_bench.cli import main

    wanted = "unknown method.text_head='clip'; available: protocol, official"
    with pytest.raises(ValueError) as api_error:
        tta_bench.evaluate(name, overrides=["method.text_head=clip"], seeds=[0])
    assert wanted in str(api_error.value)
    assert main(["run", "--method", name, "method.text_head=clip"]) == 2
    assert wanted in capsys.readouterr().err


def test_a_bad_range_is_refused_with_the_same_message_on_cli_and_api(capsys):
    import tta_bench
    from tta_bench.cli import main

    wanted = "method.tie_eps=0.0 is out of range: it must be > 0 and < 1"
    with pytest.raises(ValueError, match=wanted.replace(".", r"\.")):
        tta_bench.evaluate("zero", overrides=["method.tie_eps=0.0"], seeds=[0])
    assert main(["run", "--method", "zero", "method.tie_eps=0.0"]) == 2
    assert wanted in capsys.readouterr().err
