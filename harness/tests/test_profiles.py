"""Protocol profiles are catalogue data (tta_bench.run.profiles): ``tiny_bench`` exists only in
the test plugin's registry.yaml, and ``profile=tiny_bench`` (or its switch
``tiny_bench=true``) changes the run: its protocol fields and a method's own settings for it,
each only where the run does not set the value itself."""

from __future__ import annotations

import pytest

from tta_bench.run import profiles, runner
from tta_bench.run.resolve import resolve_run

SMALL = ["seeds=[0]", "progress=false", "reference=false", "protocol.max_images=8"]


def test_the_profile_is_the_catalogues_and_no_harness_module_names_it():
    from pathlib import Path

    assert profiles.names() == ["tiny_bench"]
    harness = Path(profiles.__file__).parents[1]
    assert not [p for p in harness.rglob("*.py") if "tiny_bench" in p.read_text()]


def test_a_profile_sets_the_protocol_and_the_methods_settings():
    _, plain = resolve_run(method="norm_tent")
    _, spec = resolve_run(method="norm_tent", overrides=["profile=tiny_bench"])
    assert (plain.protocol.batch_size, plain.method_config.lr) == (8, 1e-3)
    assert (spec.protocol.batch_size, spec.method_config.lr) == (2, 0.5)
    assert spec.protocol.templates == ("a {} thing.",)
    assert spec.protocol.id != plain.protocol.id
    assert spec.config["profile"] == "tiny_bench"
    assert spec.config["profile_applied"] == {
        "protocol.batch_size": 2,
        "protocol.templates": ["a {} thing."],
        "method.lr": 0.5,
    }
    assert spec.config["method"]["lr"] == 0.5  # the record says what ran


def test_what_the_run_sets_wins_and_other_methods_keep_their_config():
    _, own = resolve_run(
        method="norm_tent",
        overrides=["profile=tiny_bench", "protocol.batch_size=4", "method.lr=0.01"],
    )
    assert (own.protocol.batch_size, own.method_config.lr) == (4, 0.01)
    assert "profile_applied" in own.config and "method.lr" not in own.config["profile_applied"]
    _, zs = resolve_run(method="zeroshot", overrides=["tiny_bench=true"])
    _, zs_plain = resolve_run(method="zeroshot")
    assert zs.protocol.batch_size == 2 and zs.method_config == zs_plain.method_config


def test_a_run_under_the_profile_is_scored_on_its_stream(tmp_path):
    _, plain = resolve_run(method="norm_tent", overrides=SMALL)
    _, spec = resolve_run(method="norm_tent", overrides=["profile=tiny_bench", *SMALL])
    base = runner.run(plain, tmp_path / "plain.json")["cells"][0]
    cell = runner.run(spec, tmp_path / "profile.json")["cells"][0]
    assert (base["n"], base["batches"]) == (8, 1)
    assert (cell["n"], cell["batches"]) == (8, 4)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("profile=tiny", "unknown profile='tiny'; available: tiny_bench"),
        ("tiny_bench=yes", "tiny_bench='yes': expected true or false"),
    ],
)
def test_a_bad_profile_is_refused_before_anything_is_built(capsys, override, message):
    from tta_bench.cli import main
    from tta_bench.run.resolve import UsageError

    with pytest.raises(UsageError, match=message):
        resolve_run(method="norm_tent", overrides=[override])
    assert main(["run", "--method", "norm_tent", override]) == 2
    assert message in capsys.readouterr().err


def test_a_switch_in_a_sweep_becomes_the_profile_choice():
    assert profiles.rewrite_switches(["tiny_bench=true,false", "seeds=[0]"]) == [
        "profile=tiny_bench,null",
        "seeds=[0]",
    ]
