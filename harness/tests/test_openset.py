"""Open-set evaluation (``tta_bench.run.openset``): the detection metrics against values worked
out by hand, the closed-set metrics on the in-distribution rows only, the OOD option of the
protocol (id, overrides, bad values) and a run that mixes an OOD set into the stream."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tta_bench import metrics
from tta_bench.run import openset

from .helpers import cli, run

# Two classes; the max softmax probability of row i is P[i] (logits log p, log(1 - p)).
P_ID = [0.9, 0.8, 0.6]
P_OOD = [0.7, 0.55, 0.95]


def _msp_cell() -> tuple[torch.Tensor, torch.Tensor]:
    p = torch.tensor(P_ID + P_OOD, dtype=torch.float64)
    logits = torch.stack([p.log(), (1 - p).log()], dim=1).float()
    labels = torch.tensor([0, 0, 1, -1, -1, -1])
    return logits, labels


def test_detection_metrics_by_hand():
    logits, labels = _msp_cell()
    # AUROC: of the 9 (in, out) pairs, the in-distribution row scores higher in 5
    assert openset.auroc(logits, labels) == pytest.approx(5 / 9)
    # AUPR-In: ranked 0.95 out, 0.9 in, 0.8 in, 0.7 out, 0.6 in, 0.55 out -> the precision at
    # each in-distribution row: 1/2, 2/3, 3/5
    assert openset.aupr(logits, labels) == pytest.approx((1 / 2 + 2 / 3 + 3 / 5) / 3)
    # FPR95: keeping 95% of 3 rows keeps all three (threshold 0.6): 0.95 and 0.7 pass
    assert openset.fpr95(logits, labels) == pytest.approx(2 / 3)
    # the score really is the max softmax probability
    np.testing.assert_allclose(openset.ood_score(logits), P_ID + P_OOD, rtol=1e-6)


def test_energy_score_by_hand():
    # logits [x, x]: logsumexp = x + log 2, so the order is that of x
    x = torch.tensor([3.0, 1.0, 2.0, 0.0])
    logits = torch.stack([x, x], dim=1)
    labels = torch.tensor([0, 1, -1, -1])
    np.testing.assert_allclose(openset.ood_score(logits, "energy"), x + math.log(2), rtol=1e-6)
    # pairs: 3 > 2, 3 > 0, 1 > 0, 1 < 2
    assert openset.auroc(logits, labels, score="energy") == pytest.approx(3 / 4)
    # msp is 0.5 for every row: no ranking at all
    assert openset.auroc(logits, labels, score="msp") == pytest.approx(0.5)
    with pytest.raises(ValueError, match="unknown OOD score 'odin'; available: msp, energy"):
        openset.ood_score(logits, "odin")


def test_detection_needs_both_kinds():
    logits, _ = _msp_cell()
    with pytest.raises(ValueError, match="both in-distribution and OOD rows"):
        openset.auroc(logits, torch.zeros(6, dtype=torch.long))


def test_compute_all_scores_known_rows_and_skips_detection_when_closed():
    logits, labels = _msp_cell()  # predictions: 0 on every row (p >= 0.5 for class 0)
    out = metrics.compute_all(logits, labels)
    assert out["accuracy"] == pytest.approx(2 / 3)  # of the known rows 0, 0, 1
    assert out["auroc"] == pytest.approx(5 / 9) and out["fpr95"] == pytest.approx(2 / 3)
    known = labels >= 0
    assert out["nll"] == pytest.approx(metrics.nll(logits[known], labels[known]))
    assert out["ece20"] == pytest.approx(
        metrics.expected_calibration_error(logits[known], labels[known], n_bins=20)
    )
    closed = metrics.compute_all(logits[:3], labels[:3])
    assert "auroc" not in closed and "aupr" not in closed and "fpr95" not in closed
    energy = metrics.compute_all(logits, labels, ood_score="energy")
    assert energy["accuracy"] == out["accuracy"]


def test_ece20_is_ctpt_binning():
    # confidences 0.52 and 0.54 share C-TPT's bin (0.5, 0.55] but not a 15-bin one
    p = torch.tensor([0.52, 0.54], dtype=torch.float64)
    logits = torch.stack([p.log(), (1 - p).log()], dim=1).float()
    labels = torch.tensor([0, 1])
    # 20 bins: one bin, accuracy 1/2, confidence 0.53
    assert metrics.ece_ctpt(logits, labels) == pytest.approx(0.03, abs=1e-6)
    # 15 bins: (0.4667, 0.5333] holds 0.52 (right), (0.5333, 0.6] holds 0.54 (wrong)
    assert metrics.expected_calibration_error(logits, labels) == pytest.approx(
        (abs(1 - 0.52) + abs(0 - 0.54)) / 2, abs=1e-6
    )


def test_protocol_ood_id_and_overrides():
    from tta_bench.run.protocol import load_protocol

    plain = load_protocol("tiny-shifts")
    half = load_protocol("tiny-shifts", ood_dataset="synthetic", ood_ratio=0.5)
    assert "-ood" not in plain.id and "-bs8-ood0.5-" in half.id
    assert half.ood == {
        "dataset": "synthetic",
        "dataset_args": {},
        "ratio": 0.5,
        "seed": 0,
        "score": "msp",
    }
    others = [
        load_protocol("tiny-shifts", ood_dataset="synthetic", ood_ratio=0.25),
        load_protocol("tiny-shifts", ood_dataset="synthetic", ood_seed=1),
        load_protocol("tiny-shifts", ood_dataset="synthetic", ood_score="energy"),
        load_protocol("tiny-shifts", ood_dataset="synthetic", ood_dataset_args={"split": "train"}),
    ]
    assert len({half.id, *(p.id for p in others)}) == 5  # each setting is in the id
    with pytest.raises(ValueError, match="protocol.ood_ratio set without an OOD set"):
        load_protocol("tiny-shifts", ood_ratio=0.3)
    with pytest.raises(ValueError, match="unknown dataset 'nope'; available: .*synthetic"):
        load_protocol("tiny-shifts", ood_dataset="nope")
    with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\)"):
        load_protocol("tiny-shifts", ood_dataset="synthetic", ood_ratio=1.0)
    with pytest.raises(ValueError, match="unknown score 'odin'"):
        load_protocol("tiny-shifts", ood_dataset="synthetic", ood_score="odin")


def test_cli_refuses_bad_ood_options_before_work(capsys, tmp_path):
    out = tmp_path / "r.json"
    base = ["run", "--method", "zeroshot", "--suite", "tiny-shifts", "--output", str(out)]
    rc, _, err = cli(capsys, *base, "protocol.ood_dataset=nope")
    assert rc == 2 and "unknown dataset 'nope'" in err and "synthetic" in err
    rc, _, err = cli(capsys, *base, "protocol.ood_dataset=synthetic", "protocol.ood_ratio=1.5")
    assert rc == 2 and "ood_ratio" in err
    rc, _, err = cli(capsys, *base, "protocol.ood_ratio=0.2")
    assert rc == 2 and "protocol.ood_dataset=<dataset>" in err
    assert not out.exists()


#: Class names of an out-of-distribution synthetic set: none is a known class.
UNKNOWN = ["ochre", "teal", "mauve", "umber"]


def test_an_ood_set_sharing_a_known_class_is_refused_naming_it(tmp_path, capsys):
    from tta_bench.registry import registry

    synthetic = registry("datasets").get("synthetic")
    ind = synthetic(per_class=4)
    spec = openset.check_ood({"dataset": "synthetic", "ratio": 0.2})
    known = list(ind.classnames)
    # one known class under another spelling: case, underscores and hyphens do not hide it
    names = [*UNKNOWN[:3], known[2].upper().replace(" ", "_")]
    with pytest.raises(ValueError, match=rf"shares 1 class\(es\) .*'{known[2]}'"):
        openset.mix(ind, synthetic(split="train", per_class=2, names=names), spec)
    with pytest.raises(ValueError, match="shares 4 class"):
        openset.mix(ind, synthetic(split="train", per_class=2), spec)
    out = tmp_path / "r.json"
    rc, _, err = cli(
        capsys, "run", "--method", "zeroshot", "--suite", "tiny-shifts", "--output", str(out),
        "protocol.ood_dataset=synthetic", "seeds=[0]",
    )  # fmt: skip
    assert rc == 2 and "shares 4 class(es)" in err and not out.exists()


def test_mix_counts_rows_and_refuses_too_few():
    from tta_bench.registry import registry

    synthetic = registry("datasets").get("synthetic")
    ind, ood = synthetic(per_class=4), synthetic(split="train", per_class=2, names=UNKNOWN)
    spec = openset.check_ood({"dataset": "synthetic", "ratio": 0.2})
    mixed = openset.mix(ind, ood, spec)
    assert openset.ood_count(16, 0.2) == 4
    assert len(mixed) == 20 and mixed.labels.tolist() == ind.labels.tolist() + [-1] * 4
    assert mixed.classnames == ind.classnames and mixed.open_set
    again = openset.mix(ind, ood, spec)
    assert again.fingerprint == mixed.fingerprint  # the same OOD rows for the same seed
    other = openset.mix(ind, ood, {**spec, "seed": 1})
    assert other.fingerprint != mixed.fingerprint
    with pytest.raises(ValueError, match="needs 16 out-of-distribution images .* has 8"):
        openset.mix(ind, ood, {**spec, "ratio": 0.5})


def test_open_set_run_scores_known_rows_and_detection(tmp_path):
    """The colour oracle classifies every known row right: an accuracy of 1.0 shows the OOD
    rows are left out of it; the detection metrics equal those of the stored logits."""
    from tta_bench.run import samples

    protocol = {
        "ood_dataset": "synthetic",
        "ood_dataset_args": {"split": "train", "per_class": 8, "names": UNKNOWN},
        "ood_ratio": 0.5,
    }
    out = tmp_path / "r.json"
    record = run(out, "colour_oracle", protocol=protocol, log_samples="logits")
    assert record["protocol"]["ood"]["ratio"] == 0.5
    for cell in record["cells"]:
        assert cell["n"] == 64 and cell["n_known"] == 32 and cell["n_ood"] == 32
        assert cell["accuracy"] == 1.0 and cell["error"] == 0.0
        table = samples.read_cell(samples.samples_dir(out), cell["shift"], cell["severity"], 0)
        logits, labels = samples.logits_and_labels(table, "cell")
        assert (labels == -1).sum() == 32
        want = openset.auroc(torch.from_numpy(logits), torch.from_numpy(labels))
        assert cell["auroc"] == pytest.approx(want)
    summary = record["summary"]
    assert {"mean_auroc", "mean_aupr", "mean_fpr95"} <= set(summary)


def test_a_record_says_how_its_binned_metrics_bin(tmp_path):
    record = run(tmp_path / "r.json", "zeroshot")
    bins = record["metric_bins"]
    assert bins["ece"] == {
        "count": 15,
        "width": "equal",
        "interval": "(lo, hi]",
        "confidence": "max softmax probability",
    }
    assert bins["ece20"]["count"] == metrics.CTPT_ECE_BINS == 20


# -- a method's own OOD score and decision (Method.own_ood_score) ------------------------


def test_own_score_metrics_and_decision_accuracies_by_hand():
    labels = np.array([0, 0, 1, -1, -1, -1])
    own = np.array([0.9, 0.8, 0.6, 0.7, 0.55, 0.95])  # the msp cell's scores above
    out = openset.own_metrics(labels, own)
    assert out["auroc_own"] == pytest.approx(5 / 9)
    assert out["aupr_own"] == pytest.approx((1 / 2 + 2 / 3 + 3 / 5) / 3)
    assert out["fpr95_own"] == pytest.approx(2 / 3)
    # predictions 0, 1, 1 on the known rows: rows 0 and 2 right; judged in: rows 0, 1, 5
    logits = np.array([[1, 0], [0, 1], [0, 1], [1, 0], [1, 0], [1, 0]], dtype=np.float32)
    keep = np.array([True, True, False, False, False, True])
    acc = openset.decision_metrics(logits, labels, keep)
    assert acc["acc_id"] == pytest.approx(1 / 3)  # row 0 only: right and kept
    assert acc["acc_ood"] == pytest.approx(2 / 3)  # rows 3 and 4 rejected
    assert acc["acc_h"] == pytest.approx(2 * (1 / 3) * (2 / 3) / (1 / 3 + 2 / 3))
    none = openset.decision_metrics(logits, labels, np.zeros(6, bool))
    assert none["acc_id"] == 0 and none["acc_ood"] == 1 and none["acc_h"] == 0


def _own_protocol() -> dict:
    return {
        "ood_dataset": "synthetic",
        "ood_dataset_args": {"split": "train", "per_class": 8, "names": UNKNOWN},
        "ood_ratio": 0.5,
    }


def test_a_run_scores_the_methods_own_score_beside_the_protocols(tmp_path):
    """Every open-set cell of a method with its own score holds auroc_own & co. computed
    from the per-sample column it wrote, and the decision accuracies; rescore recomputes
    them from the files; a closed-set run of the same method holds none of them."""
    from tta_bench.run import rescore, samples

    out = tmp_path / "r.json"
    record = run(out, "own_score_oracle", protocol=_own_protocol(), log_samples="logits")
    assert record["own_ood_score"] == "largest cosine to a class colour"
    for cell in record["cells"]:
        table = samples.read_cell(samples.samples_dir(out), cell["shift"], cell["severity"], 0)
        own = table.column(samples.OWN_SCORE).to_numpy()
        keep = table.column(samples.DECISION).to_numpy(zero_copy_only=False)
        logits, labels = samples.logits_and_labels(table, "cell")
        np.testing.assert_allclose(own, logits.max(axis=1) / 10, rtol=1e-6)
        want = openset.own_metrics(labels, own)
        assert {k: cell[k] for k in want} == pytest.approx(want)
        acc = openset.decision_metrics(logits, labels, keep)
        assert {k: cell[k] for k in acc} == pytest.approx(acc)
        assert cell["auroc"] == pytest.approx(openset.auroc(torch.from_numpy(logits), labels))
    checks = {c.name: c for c in rescore.rescore(out)}
    assert checks["auroc_own"].max_difference == 0 and checks["acc_h"].max_difference == 0
    closed = run(tmp_path / "c.json", "own_score_oracle")
    assert all("auroc_own" not in c and "acc_h" not in c for c in closed["cells"])
    plain = run(tmp_path / "p.json", "colour_oracle", protocol=_own_protocol())
    assert "own_ood_score" not in plain and "auroc_own" not in plain["cells"][0]


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("missing", "declares an own OOD score but set none"),
        ("shape", "own OOD score has 15 values for 16 images"),
        ("nan", "non-finite own OOD score"),
    ],
)
def test_a_bad_own_score_is_reported_never_scored(tmp_path, fault, reason):
    record = run(
        tmp_path / "r.json",
        "own_score_oracle",
        method_args={"fault": fault},
        protocol={**_own_protocol(), "batch_size": 16},
    )
    cells = record["cells"]
    assert cells and all(c["accuracy"] is None for c in cells)
    assert all(reason in c["diverged"]["reason"] for c in cells)


def test_an_open_set_cells_rates_count_its_known_rows():
    """Regression: the results check read accuracy as a count of all n rows, so an
    open-set cell whose known rows do not divide n (protocol.max_images=64 on digits-open:
    33 known of 64) was refused as corrupt after every run."""
    from tta_bench.run.schema import ResultsFormatError, check_cells

    cell = {"shift": "fog", "severity": 5, "seed": 0, "n": 64, "n_known": 33, "n_ood": 31}
    check_cells([{**cell, "accuracy": 17 / 33, "error": 16 / 33}], "r.json")
    with pytest.raises(ResultsFormatError, match="no count of its 33 in-distribution images"):
        check_cells([{**cell, "accuracy": 0.3, "error": 0.7}], "r.json")
    run_ok = {**cell, "n_known": None, "accuracy": 0.5, "error": 0.5}
    check_cells([run_ok], "r.json")


def test_a_small_ood_set_is_repeated_only_when_asked():
    """ZS-NTTA's resampling: the whole set n // m times, then n % m distinct drawn rows;
    without repeat too few images are refused, naming the option."""
    rows = openset.ood_rows(7, 3, seed=0)
    assert list(rows[:6]) == [0, 1, 2, 0, 1, 2] and len(set(rows[6:])) == 1
    assert sorted(openset.ood_rows(3, 5, seed=1)) == list(openset.ood_rows(3, 5, seed=1))
    assert openset.check_ood({"dataset": "x"}) == {**openset.OOD_KEYS, "dataset": "x"}
    assert openset.check_ood({"dataset": "x", "repeat": True})["repeat"] is True
    assert "repeat" not in openset.check_ood({"dataset": "x", "repeat": False})
    with pytest.raises(ValueError, match="repeat must be true or false, got 'yes'"):
        openset.check_ood({"dataset": "x", "repeat": "yes"})
    from tta_bench.registry import registry

    synthetic = registry("datasets").get("synthetic")
    ind, ood = synthetic(per_class=4), synthetic(split="train", per_class=2, names=UNKNOWN)
    spec = openset.check_ood({"dataset": "synthetic", "ratio": 0.75})
    with pytest.raises(ValueError, match="protocol.ood_repeat=true"):
        openset.mix(ind, ood, spec)
    mixed = openset.mix(ind, ood, {**spec, "repeat": True})
    assert len(mixed) == len(ind) + openset.ood_count(len(ind), 0.75)
