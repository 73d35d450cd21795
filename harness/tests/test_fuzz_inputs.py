"""Property-based tests (Hypothesis): whatever a user types or a file holds, the override
parser and config validation, and the results-file reader, give a result or a clear error
(a ``ValueError``: ``UsageError``, ``RegistryError``, ``ResultsFormatError``), never a
traceback of another kind. Each test prints how many inputs it tried."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tta_bench.bounds import Bounds, bounded, check_values
from tta_bench.registry import RegistryError
from tta_bench.run.resolve import resolve_run
from tta_bench.run.results import load_results

from .helpers import GOLDEN

KEYS = [
    "method.lr", "method.steps", "method.momentum", "method.optimizer", "method.loss",
    "+method.lrr", "seeds", "device", "cache", "protocol.batch_size", "protocol.severities",
    "protocol.max_images", "protocol.shifts", "protocol.reset", "+severities", "+foo",
    "loader.num_workers", "model.width", "+protocol.x", "suite", "method", "~seeds",
]  # fmt: skip
VALUES = st.one_of(
    st.integers(-(10**12), 10**12).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["nan", "inf", "-inf", "[]", "[0]", "[0,0]", "[1.7]", "null", "true", "''"]),
    st.sampled_from(["adam", "sgdd", "entropy", "noise", "cpu", "tpu", "norm_tent", "x"]),
    st.text(alphabet="[]{},=:'\"\\$ 0123456789abc.-_", max_size=12),
)
OVERRIDE = st.one_of(
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(KEYS), VALUES),
    st.text(max_size=20),
)


@pytest.mark.slow
def test_any_override_resolves_or_is_refused_clearly():
    tried = 0

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(OVERRIDE, max_size=3))
    def check(overrides):
        nonlocal tried
        tried += 1
        try:
            resolve_run("norm_tent", overrides=["seeds=[0]", *overrides])
        except (ValueError, RegistryError) as exc:
            assert str(exc)  # a message, not a bare error

    check()
    print(f"override parser: {tried} inputs tried")
    assert tried > 0


@dataclasses.dataclass
class _Config:
    rate: float = bounded(0.5, gt=0, le=1)
    count: int = bounded(1, ge=1)
    sizes: list = bounded(default_factory=lambda: [1], ge=0)
    free: float = 0.0


NUMBER = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5))


def test_check_values_refuses_exactly_what_the_bounds_exclude():
    tried = 0

    @settings(max_examples=400, deadline=None)
    @given(NUMBER, st.integers(-5, 5), st.lists(NUMBER, max_size=3), NUMBER)
    def check(rate, count, sizes, free):
        nonlocal tried
        tried += 1
        config = _Config(rate=rate, count=count, sizes=sizes, free=free)
        numbers = [rate, count, *sizes, free]
        finite = all(not isinstance(v, float) or math.isfinite(v) for v in numbers)
        expected = (
            finite and Bounds(gt=0, le=1).holds(rate) and count >= 1 and all(s >= 0 for s in sizes)
        )
        try:
            check_values(config, "method")
        except ValueError as exc:
            assert not expected, exc
            assert str(exc).startswith("method.")
        else:
            assert expected

    check()
    print(f"config validation: {tried} inputs tried")
    assert tried > 0


SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text())
JSONISH = st.recursive(
    SCALARS,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads((GOLDEN / "golden_tent.json").read_text(encoding="utf-8"))


def test_any_results_file_is_read_or_refused_clearly(tmp_path_factory, golden):
    tried = 0

    @settings(max_examples=300, deadline=None)
    @given(st.data())
    def check(data):
        nonlocal tried
        tried += 1
        kind = data.draw(st.sampled_from(["bytes", "json", "mutated"]))
        path = Path(tmp_path_factory.mktemp("fuzz")) / "r.json"
        if kind == "bytes":
            path.write_bytes(data.draw(st.binary(max_size=200)))
        elif kind == "json":
            path.write_text(json.dumps(data.draw(JSONISH)), encoding="utf-8")
        else:  # the golden record with one field replaced, at the top or in a cell
            record = json.loads(json.dumps(golden))
            cells = record["cells"]
            target = record if data.draw(st.booleans()) else data.draw(st.sampled_from(cells))
            key = data.draw(st.sampled_from(sorted(target)))
            target[key] = data.draw(JSONISH)
            path.write_text(json.dumps(record), encoding="utf-8")
        try:
            record = load_results(path)
        except ValueError as exc:
            assert str(path) in str(exc)
        else:
            assert isinstance(record, dict) and isinstance(record["cells"], list)

    check()
    print(f"results reader: {tried} inputs tried")
    assert tried > 0
