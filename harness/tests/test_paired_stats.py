"""Per-sample paired statistics (``tta_bench.report.paired``): McNemar, Benjamini-Hochberg
and the minimum detectable effect against hand-computed values; simulated datasets with a
planted difference (found at the rate the minimum detectable effect promises) and with none
(rejected at about the nominal 5%); the batch bootstrap widening when batches are
correlated; tiers; and, on real tiny runs with per-sample files, ``load_pairs``,
``compare``, its refusals, ``tta-bench compare`` and the leaderboard's per-sample table."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tta_bench.report import collect, paired, stats
from tta_bench.report import leaderboard as report
from tta_bench.run import results, samples
from tta_bench.run.resolve import resolve_run
from tta_bench.run.runner import run

from .helpers import cli

#: Joint outcomes of a sample: (both right, only A right, only B right, both wrong).
PLANTED = (0.50, 0.10, 0.05, 0.35)  # A right 60%, B right 55%: 5 points, 15% discordant
NULL = (0.50, 0.075, 0.075, 0.35)


def _pairs(counts, block=None, seeds=(0,)) -> paired.PairedSamples:
    """Pairs holding ``counts`` samples of each joint outcome (``PLANTED``'s order)."""
    counts = [int(c) for c in counts]
    a = np.repeat([True, True, False, False], counts)
    b = np.repeat([True, False, True, False], counts)
    block = np.arange(len(a)) % 20 if block is None else np.asarray(block)
    return paired.PairedSamples("A", "B", a, b, block, tuple(seeds))


# -- hand-computed values ----------------------------------------------------------------
def test_mcnemar_is_the_exact_binomial_test_of_the_discordant_pairs():
    # b = 6 (only A right), c = 1: p = 2 * P(X <= 1 | Bin(7, 1/2)) = 2 * 8 / 128
    result = paired.mcnemar(_pairs([10, 6, 1, 3]))
    assert (result.n, result.a_only, result.b_only) == (20, 6, 1)
    assert result.p_value == pytest.approx(16 / 128)
    assert result.difference == pytest.approx(5 / 20) and result.discordance == pytest.approx(0.35)
    assert paired.mcnemar(_pairs([5, 0, 0, 5])).p_value == 1.0


def test_benjamini_hochberg_matches_a_hand_computed_example_and_keeps_none():
    # sorted 0.01, 0.03, 0.04, 0.20 of m = 4: 0.04, 0.06, 0.0533, 0.20, then running minima
    q = paired.benjamini_hochberg([0.01, 0.04, 0.03, 0.20, None])
    assert q[:4] == pytest.approx([0.04, 0.16 / 3, 0.16 / 3, 0.20])
    assert q[4] is None
    assert paired.benjamini_hochberg([None, None]) == [None, None]
    with pytest.raises(ValueError, match="1.5"):
        paired.benjamini_hochberg([0.1, 1.5])


def test_minimum_detectable_effect_is_the_normal_approximation():
    # (z_0.975 + z_0.8) * sqrt(0.1 / 1000) = (1.959964 + 0.841621) * 0.01
    assert paired.minimum_detectable_effect(1000, 0.1) == pytest.approx(0.02801585, abs=1e-7)
    assert paired.minimum_detectable_effect(1000, 0.0) == 0.0
    for bad, match in (({"n": 0}, "n must be"), ({"discordance": 2.0}, "discordance must")):
        with pytest.raises(ValueError, match=match):
            paired.minimum_detectable_effect(**{"n": 10, "discordance": 0.1, **bad})
    with pytest.raises(ValueError, match="power must be in"):
        paired.minimum_detectable_effect(10, 0.1, power=1.0)


def test_bootstrap_refuses_bad_settings_naming_them():
    pairs = _pairs([10, 6, 1, 3])
    with pytest.raises(ValueError, match="unknown bootstrap unit 'cell'; available: sample, batch"):
        paired.bootstrap(pairs, "cell")
    with pytest.raises(ValueError, match="n_resamples must be a positive integer, got 0"):
        paired.bootstrap(pairs, n_resamples=0)
    with pytest.raises(ValueError, match=r"confidence must be in \(0, 1\), got 1"):
        paired.bootstrap(pairs, confidence=1)


def test_bootstrap_is_reproducible_and_centred_on_the_difference():
    pairs = _pairs([400, 60, 30, 110])
    for unit in paired.BOOTSTRAP_UNITS:
        one, two = paired.bootstrap(pairs, unit, 2000), paired.bootstrap(pairs, unit, 2000)
        assert one == two
        assert one.difference == pytest.approx(30 / 600)
        assert one.ci_low < one.difference < one.ci_high
    assert paired.bootstrap(_pairs([5, 0, 0, 5]), "batch", 200).p_value == 1.0


# -- simulated datasets ------------------------------------------------------------------
def _rejections(joint, n: int, replications: int, seed: int) -> dict[str, float]:
    """The share of ``replications`` datasets of ``n`` pairs drawn from ``joint`` (the
    counts drawn at once, a multinomial) in which McNemar and the sample bootstrap reject
    at 5%."""
    rng = np.random.default_rng(seed)
    hits = {"mcnemar": 0, "sample": 0}
    for i, counts in enumerate(rng.multinomial(n, joint, size=replications)):
        pairs = _pairs(counts)
        hits["mcnemar"] += paired.mcnemar(pairs).p_value < 0.05
        hits["sample"] += paired.bootstrap(pairs, "sample", 999, rng_seed=i).p_value < 0.05
    return {k: v / replications for k, v in hits.items()}


def test_a_planted_difference_is_found_at_the_rate_the_detectable_effect_states():
    # n where the planted 5 points is the minimum detectable effect at 15% discordance:
    # the tests should find it in about 80% of the datasets (the exact McNemar test in 79%)
    n = round(paired.minimum_detectable_effect(1, 0.15) ** 2 / 0.05**2)
    assert paired.minimum_detectable_effect(n, 0.15) == pytest.approx(0.05, rel=0.01)
    rates = _rejections(PLANTED, n, 400, seed=1)
    assert 0.72 <= rates["mcnemar"] <= 0.87, rates  # 400 datasets: +- 2 points per sd
    assert 0.72 <= rates["sample"] <= 0.89, rates
    # four times the samples: the difference is found almost always
    assert min(_rejections(PLANTED, 4 * n, 100, seed=2).values()) >= 0.97


def test_with_no_difference_the_tests_reject_at_about_five_percent():
    rates = _rejections(NULL, 2000, 400, seed=3)
    # binomial tolerance over 400 datasets: 5% +- 3.3 sd
    assert 0.015 <= rates["mcnemar"] <= 0.085, rates
    assert 0.015 <= rates["sample"] <= 0.085, rates


def test_the_batch_bootstrap_is_wider_when_batches_are_correlated():
    # 100 batches of 40: in half A wins most discordant pairs, in the others B does, so the
    # samples of one batch move together
    rng = np.random.default_rng(4)
    a, b, block = [], [], []
    for j in range(100):
        swing = (0.25, 0.05) if rng.random() < 0.5 else (0.05, 0.25)
        counts = rng.multinomial(40, [0.5, *swing, 0.5 - sum(swing)])
        one = _pairs(counts)
        a.append(one.a_correct)
        b.append(one.b_correct)
        block.append(np.full(40, j))
    pairs = paired.PairedSamples(
        "A", "B", np.concatenate(a), np.concatenate(b), np.concatenate(block)
    )
    by_sample = paired.bootstrap(pairs, "sample", 4000)
    by_batch = paired.bootstrap(pairs, "batch", 4000)
    assert by_batch.n_units == 100 and by_sample.n_units == 4000
    width = lambda r: r.ci_high - r.ci_low  # noqa: E731
    assert width(by_batch) > 2 * width(by_sample)
    mde = paired.block_minimum_detectable_effect(pairs)
    assert mde > 2 * paired.minimum_detectable_effect(pairs.n, paired.mcnemar(pairs).discordance)
    # with the batches shuffled away, both agree
    shuffled = paired.PairedSamples(
        "A", "B", pairs.a_correct, pairs.b_correct, rng.permutation(pairs.block)
    )
    assert width(paired.bootstrap(shuffled, "batch", 4000)) < 1.3 * width(by_sample)


# -- tiers -------------------------------------------------------------------------------
def test_tiers_group_the_methods_the_best_cannot_be_told_apart_from():
    found = {  # (leader, other): (other - leader, p)
        ("a", "b"): (-0.01, 0.5),
        ("a", "c"): (-0.05, 0.001),
        ("a", "d"): (-0.08, 0.0001),
        ("c", "d"): (-0.03, 0.3),
    }
    assert paired.tiers("abcd", lambda x, y: found[(x, y)]) == {"a": 1, "b": 1, "c": 2, "d": 2}


def test_tiers_adjust_for_the_number_of_comparisons_and_ignore_untestable_ones():
    # b alone would be worse (p 0.04), but q = 0.08 after adjusting with c's p 0.5
    found = {("a", "b"): (-0.02, 0.04), ("a", "c"): (-0.01, 0.5), ("a", "d"): (-0.5, None)}
    assert paired.tiers(["a", "b", "c", "d"], lambda x, y: found[(x, y)]) == dict.fromkeys(
        "abcd", 1
    )
    # a significant difference in favour of the other is not "worse"
    assert paired.tiers(["a", "b"], lambda x, y: (0.1, 1e-6)) == {"a": 1, "b": 1}
    with pytest.raises(ValueError, match="distinct"):
        paired.tiers(["a", "a"], lambda x, y: (0.0, 1.0))


# -- real tiny runs ----------------------------------------------------------------------
def _run(method: str, output: Path, *overrides: str) -> dict:
    _, spec = resolve_run(
        method=method,
        overrides=["log_samples=true", "seeds=[0,1]", "progress=false", *overrides],
    )
    return run(spec, output)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """norm_tent (a large step: it differs from the frozen model) and zeroshot on
    tiny-shifts, seeds 0 and 1, with per-sample files (and the reference's predictions)."""
    d = tmp_path_factory.mktemp("paired")
    _run("norm_tent", d / "tent.json", "method.lr=5")
    _run("zeroshot", d / "zs.json")
    return d


def _copy(runs: Path, dest: Path, *names: str, with_samples: bool = True) -> list[Path]:
    out = []
    for name in names:
        shutil.copy(runs / name, dest / name)
        if with_samples:
            shutil.copytree(samples.samples_dir(runs / name), samples.samples_dir(dest / name))
        out.append(dest / name)
    return out


def _load(path: Path) -> dict:
    return results.load_results(path)


def test_load_pairs_reproduces_every_cell_s_accuracy_and_reference(runs):
    tent, zs = _load(runs / "tent.json"), _load(runs / "zs.json")
    own = paired.load_pairs(tent, runs / "tent.json")
    versus = paired.load_pairs(tent, runs / "tent.json", zs, runs / "zs.json")
    n = sum(c["n"] for c in tent["cells"])
    assert own.n == versus.n == n and own.seeds == (0, 1) and len(own.cells) == 8
    # the frozen model on the identical stream is the zeroshot run: the same predictions
    assert np.array_equal(own.b_correct, versus.b_correct)
    assert own.a_correct.sum() == round(sum(c["accuracy"] * c["n"] for c in tent["cells"]))
    assert own.b_correct.sum() == round(
        sum(c["reference_accuracy"] * c["n"] for c in tent["cells"])
    )
    assert own.blocks == 8 * 4  # batches of 8 over 32 images per cell
    assert own.a_correct.mean() != own.b_correct.mean()


def test_compare_gathers_every_test_and_agrees_with_the_seed_level_one(runs):
    tent, zs = _load(runs / "tent.json"), _load(runs / "zs.json")
    found = paired.compare(tent, runs / "tent.json", zs, runs / "zs.json", n_resamples=2000)
    json.dumps(found)  # plain values
    seed = stats.paired_comparison(tent, zs)
    assert found["seed_t"]["difference"] == seed.mean_difference
    assert found["seed_t"]["p_value"] == seed.p_value
    assert found["accuracy"]["method"] == pytest.approx(stats.suite_estimate(tent).mean)
    assert found["accuracy"]["baseline"] == pytest.approx(stats.suite_estimate(zs).mean)
    mc = found["mcnemar"]
    assert mc["n"] == found["n"] == 256 and mc["a_only"] + mc["b_only"] > 0
    assert mc["difference"] == pytest.approx(found["difference"])  # equal cells: pooled = means
    for unit in ("bootstrap_sample", "bootstrap_batch"):
        boot = found[unit]
        assert boot["ci_low"] <= boot["difference"] <= boot["ci_high"]
    assert found["bootstrap_batch"]["n_units"] == found["batches"] == 32
    assert found["mde"]["sample"] == pytest.approx(
        paired.minimum_detectable_effect(256, mc["discordance"])
    )
    own = paired.compare(tent, runs / "tent.json", n_resamples=2000)
    assert own["baseline"] == stats.reference_label()
    assert own["mcnemar"] == found["mcnemar"]


def test_missing_per_sample_files_are_refused_naming_the_path(runs, tmp_path):
    (bare,) = _copy(runs, tmp_path, "tent.json", with_samples=False)
    with pytest.raises(ValueError, match=r"tent\.samples.*log_samples=true"):
        paired.load_pairs(_load(bare), bare)
    (tmp_path / "both").mkdir()
    tent, zs = _copy(runs, tmp_path / "both", "tent.json", "zs.json")
    gone = next(samples.samples_dir(zs).glob("*.parquet"))
    gone.unlink()
    with pytest.raises(ValueError, match=f"{gone.name}.*log_samples=true"):
        paired.load_pairs(_load(tent), tent, _load(zs), zs)


def _rewrite(path: Path, change) -> Path:
    """Rewrite the first cell file of run ``path`` with ``change(CellSamples)`` applied, as
    its own run would have written it (the file verifies: identity, rows, digest)."""
    record = _load(path)
    key = results.cell_key(record["cells"][0])
    folder = samples.samples_dir(path)
    table = samples.read_cell(folder, *key)
    cols = {
        k: np.asarray(table.column(k).to_numpy()) for k in ("label", "prediction", "index", "batch")
    }
    classes = int(max(cols["label"].max(), cols["prediction"].max())) + 1
    cell = samples.CellSamples(
        *key,
        domain=table.column("domain")[0].as_py(),
        logits=10 * np.eye(classes, dtype=np.float32)[cols["prediction"]],
        labels=cols["label"].copy(),
        indices=cols["index"],
        batches=cols["batch"].copy(),
        references=samples.references(table),
    )
    change(cell)
    run_key = results.record_key(record, with_weights=True)
    samples.write_cell(folder, samples.method_label(record), cell, 1, False, run_key=run_key)
    return path


def test_rows_pair_by_sample_in_any_order_and_a_sample_visited_twice_in_turn():
    """Two runs' rows of one cell pair each sample with itself: in one stream order row by
    row, in another order by dataset index, a sample the stream visits twice (``gradual``)
    first visit with first visit; other samples are refused naming the cell."""

    def rows(index, batch):
        index = np.asarray(index)
        return paired.CellRows(index, np.asarray(batch), index % 3, index % 5, None)

    key = ("fog", 5, 0)
    a = rows([5, 3, 5, 7], [0, 0, 1, 1])
    assert paired._align(key, a, rows([5, 3, 5, 7], [0, 0, 1, 1]), "A vs B") is None  # row i
    matched = paired._align(key, a, rows([3, 5, 7, 5], [0, 0, 1, 1]), "A vs B")
    assert matched.tolist() == [1, 0, 3, 2]
    with pytest.raises(ValueError, match=r"cell \(fog, severity 5, seed 0\) holds other"):
        paired._align(key, a, rows([5, 3, 6, 7], [0, 0, 1, 1]), "A vs B")
    with pytest.raises(ValueError, match="1 samples have different batch numbers"):
        paired._align(key, a, rows([5, 3, 5, 7], [0, 1, 1, 1]), "A vs B")


def test_streams_that_differ_are_refused_naming_the_cell(runs, tmp_path):
    tent, zs = _copy(runs, tmp_path, "tent.json", "zs.json")
    key = results.cell_key(_load(zs)["cells"][0])

    def relabel(cell):
        cell.labels[3] = (cell.labels[3] + 1) % 4

    _rewrite(zs, relabel)
    cell = f"cell \\({key[0]}, severity {key[1]}, seed {key[2]}\\)"
    with pytest.raises(ValueError, match=f"{cell}: 1 samples have different labels"):
        paired.load_pairs(_load(tent), tent, _load(zs), zs)

    def rebatch(cell):
        cell.labels[3] = (cell.labels[3] - 1) % 4  # back as it was
        cell.batches[0] += 1

    _rewrite(zs, rebatch)
    with pytest.raises(ValueError, match=f"{cell}: 1 samples have different batch numbers"):
        paired.load_pairs(_load(tent), tent, _load(zs), zs)


def test_another_protocol_and_files_without_the_reference_are_refused(runs, tmp_path):
    tent, zs = _copy(runs, tmp_path, "tent.json", "zs.json")
    other = _load(zs)
    other["protocol"] = {**other["protocol"], "id": "elsewhere", "batch_size": 16}
    with pytest.raises(stats.ProtocolMismatchError, match="batch_size: 8 vs 16"):
        paired.load_pairs(_load(tent), tent, other, zs)

    def unreferenced(cell):
        cell.references = None

    _rewrite(tent, unreferenced)
    with pytest.raises(ValueError, match="hold no 'reference' column"):
        paired.load_pairs(_load(tent), tent)
    no_reference = _load(tent)
    for c in no_reference["cells"]:
        c["reference_accuracy"] = None
    with pytest.raises(ValueError, match="hold no reference accuracy"):
        paired.load_pairs(no_reference, tent)


def test_the_compare_command_prints_every_test_and_refuses_bad_input(runs, capsys):
    tent, zs = str(runs / "tent.json"), str(runs / "zs.json")
    rc, out, _ = cli(capsys, "compare", tent, zs, "--resamples", "500")
    assert rc == 0
    for row in ("accuracy norm_tent %", "seed-level paired t (2 seeds)", "McNemar exact (b=",
                "sample bootstrap (256 samples)", "batch block bootstrap (32 batches)",
                "minimum detectable effect"):  # fmt: skip
        assert row in out, out
    rc, out, _ = cli(capsys, "compare", tent, "--json", "--resamples", "500", "--confidence", "0.9")
    doc = json.loads(out)
    assert rc == 0 and doc["baseline"] == stats.reference_label() and doc["confidence"] == 0.9
    for argv, message in (
        ([tent, "--resamples", "0"], "--resamples 0: expected a positive integer"),
        ([tent, "--confidence", "95"], "--confidence 95.0: expected a level in (0, 1)"),
        ([str(runs / "missing.json")], "missing.json' does not exist"),
    ):
        rc, _, err = cli(capsys, "compare", *argv)
        assert rc == 2 and message in err, err


def test_the_leaderboard_compares_per_sample_when_every_run_has_files(runs, tmp_path):
    _copy(runs, tmp_path, "tent.json", "zs.json")
    board = report.collect(tmp_path, "tiny-shifts")
    headers, rows = report.leaderboard_rows(board)
    assert headers[5:9] == ["Δ vs zeroshot (95% CI)", "p", "q (BH)", "tier"]
    analysis = collect.sample_analysis(board, report.tables.REFERENCE)
    tent = _load(tmp_path / "tent.json")
    pairs = paired.load_pairs(
        tent, tmp_path / "tent.json", _load(tmp_path / "zs.json"), tmp_path / "zs.json"
    )
    boot, test = paired.bootstrap(pairs, "batch"), paired.mcnemar(pairs)
    first = rows[0]  # tent ranks first
    assert first[1] == "norm_tent" and first[6] == report.tables._p(test.p_value)
    assert (
        first[5]
        == f"{100 * boot.difference:+.1f} [{100 * boot.ci_low:+.1f}, {100 * boot.ci_high:+.1f}]"
    )
    assert first[7] == first[6]  # one comparison: q = p
    assert [r[8] for r in rows] == ["1", "2"] and analysis.tier == [1, 2]
    text = report.leaderboard_markdown(board, images=False)
    assert "block bootstrap over stream batches" in text and "Benjamini-Hochberg" in text
    assert "with 128 samples per seed x 2 seeds" in text
    # the notes the seed-level path writes are the same as a board of seed-level runs'
    assert collect._notes(board, report.tables.REFERENCE, "t") == collect._notes(
        report.collect(tmp_path, "tiny-shifts"), report.tables.REFERENCE, "t"
    )


def test_a_run_without_per_sample_files_is_compared_by_seeds_and_marked(runs, tmp_path):
    _copy(runs, tmp_path, "tent.json")
    _copy(runs, tmp_path, "zs.json", with_samples=False)
    board = report.collect(tmp_path, "tiny-shifts")
    headers, rows = report.leaderboard_rows(board)
    assert "q (BH)" in headers and "tier" in headers
    analysis = collect.sample_analysis(board, None)
    assert analysis.seed_level == ("zeroshot",) and analysis.seed_rows == (1,)
    text = report.leaderboard_markdown(board, images=False)
    assert "Runs without per-sample files (zeroshot) are compared at the seed level" in text
    # against the leader, the run without files is tested by seeds in the tiers
    assert analysis.tier[0] == 1
    # without any per-sample file the notes are today's, word for word
    shutil.rmtree(samples.samples_dir(tmp_path / "tent.json"))
    bare = report.collect(tmp_path, "tiny-shifts")
    notes = collect._notes(bare, report.tables.REFERENCE, "t", per_sample=True)
    assert notes == collect._notes(bare, report.tables.REFERENCE, "t")
