"""The committed MuRA variant study (``results/mura-variants``, from
``benchmarks/mura_variants.py``): its choice rule, and every committed file being the run
the script says it is (today's config and protocol for its point), tuned on the held-out
suite only."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tta_bench.run.resolve import resolve_run
from tta_bench.run.resume import method_config_hash

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "mura_variants.py"
DIR = ROOT / "results" / "mura-variants"


def _script():
    spec = importlib.util.spec_from_file_location("mura_variants", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


mv = _script()


def test_choice_rule_prefers_fewer_towers_within_the_tie():
    P = mv.Point
    scores = {
        P("per_shift", "both", "infomax", 5e-3): 70.05,
        P("per_shift", "vision", "infomax", 5e-3): 70.0,  # within 0.1 of the best: wins
        P("per_shift", "text", "entropy", 5e-4): 69.0,
    }
    assert mv.choose(scores) == P("per_shift", "vision", "infomax", 5e-3)
    scores[P("per_shift", "both", "infomax", 5e-3)] = 70.2  # beyond the tie
    assert mv.choose(scores) == P("per_shift", "both", "infomax", 5e-3)


def test_points_name_their_overrides():
    p = mv.Point("continual", "both", "consistency", 5e-3, ("method.adapt_every=2",))
    over = p.overrides()
    assert "method.views=2" in over and "method.views=15" not in over  # the signal's wins
    assert over[-2:] == ["protocol.reset=continual", "method.adapt_every=2"]
    assert p.stem == "continual_both_consistency_lr0.005_adapt_every2"
    assert mv.Point("episodic", "vision", "entropy", 5e-4).overrides() == []  # the defaults


def _committed() -> list[tuple[Path, list[str], str]]:
    """(file, overrides, suite) of every committed grid and evaluation file."""
    if not (DIR / mv.HELD_OUT).is_dir():
        return []
    out = []
    extra = DIR / mv.HELD_OUT
    grid = mv.load_grid(DIR)
    for points in grid.values():
        for p in points:
            out.append((extra / f"{p.stem}.json", p.overrides(), mv.HELD_OUT))
    for setting, p in mv.chosen_points(DIR).items():
        out.append(
            (extra / f"{p.stem}_single.json", [*p.overrides(), mv.MATCHED_SINGLE], mv.HELD_OUT)
        )
        method = [o for o in p.overrides() if o not in mv.CONTINUAL]
        for suite in mv.EVAL[setting]:
            out.append((mv.eval_path(DIR, p, suite), method, suite))
        home = mv.HOME[setting]
        out.append((mv.eval_path(DIR, p, home, True), [*method, mv.MATCHED_SINGLE], home))
    return out


@pytest.mark.parametrize(
    ("path", "overrides", "suite"),
    _committed(),
    ids=lambda v: str(v.relative_to(ROOT)) if isinstance(v, Path) else None,
)
def test_committed_file_is_the_run_of_its_point(path, overrides, suite):
    assert path.exists(), f"{path} is missing: python benchmarks/mura_variants.py"
    record = json.loads(path.read_text(encoding="utf-8"))
    _, spec = resolve_run(method="mura", suite=suite, overrides=[mv.SEEDS, *overrides])
    assert record["method_config_hash"] == method_config_hash(
        spec.method_config, spec.method_configs
    )
    assert record["protocol"]["id"] == spec.protocol.id
    assert record["finished"] and len(record["cells"]) == len(spec.protocol.shifts) * 3


def test_tuning_never_saw_the_evaluation_corruptions():
    if not (DIR / mv.HELD_OUT).is_dir():
        pytest.skip("the study is not committed")
    from tta_bench.run.protocol import load_protocol

    held_out = set(load_protocol(mv.HELD_OUT).shifts)
    assert not held_out & set(load_protocol("digits-c").shifts)
    for path in (DIR / mv.HELD_OUT).glob("*.json"):
        record = json.loads(path.read_text(encoding="utf-8"))
        assert {c["shift"] for c in record["cells"]} <= held_out, path.name


def test_presets_are_the_chosen_variants():
    """A setting's preset (``PRESETS``) is exactly its chosen variant's method config."""
    if not (DIR / mv.HELD_OUT).is_dir():
        pytest.skip("the study is not committed")
    chosen = mv.chosen_points(DIR)
    for setting, preset in mv.PRESETS.items():
        _, want = resolve_run(method="mura", overrides=chosen[setting].method_overrides())
        _, got = resolve_run(method=preset)
        assert method_config_hash(got.method_config) == method_config_hash(want.method_config)
