"""The label-shift stream policies (``tta_bench.run.stream``): ``label_shift`` (each batch
holds at most ``classes_per_batch`` classes, every sample of a cell once) and ``imbalanced``
(a long-tailed subset of each cell, ``imbalance_ratio``). Both are pinned by (protocol,
seed, labels), their fields are checked and in the id, and the existing policies' ids and
streams did not move. Runs on the test plugin's ``tiny-shifts`` suite (4 classes)."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from tta_bench.run.protocol import load_protocol
from tta_bench.run.stream import build_stream, imbalanced_subset, label_shift_batches, subset

from .helpers import cli, run

#: The ids of the test plugin's suites and of ``tiny-shifts`` under each older policy, as
#: before the label-shift policies existed.
OLD_IDS = {
    ("tiny-shifts", None): "tiny-shifts@v1-reset_each_shift-bs8-2c569097c2",
    ("tiny-continual", None): "tiny-continual@v1-continual-bs8-8de436e48c",
    ("tiny-folder", None): "tiny-folder@v1-reset_each_shift-bs4-4c70e67279",
    ("tiny-domains", None): "tiny-domains@v1-mixed_domains-bs5-e2d7e84726",
    ("tiny-shifts", "episodic_batch"): "tiny-shifts@v1-episodic_batch-bs8-e0976dcd88",
    ("tiny-shifts", "non_iid"): "tiny-shifts@v1-non_iid-d0.1-bs8-ae73e475fd",
    ("tiny-shifts", "gradual"): "tiny-shifts@v1-gradual-bs8-86db2653c2",
}
#: Digests of the seed-1 streams of ``tiny-shifts`` under each older policy (``_digest``
#: of ``_labels``), as before the label-shift policies existed.
OLD_STREAMS = {
    "continual": "5faf58e1f473c7f9",
    "episodic_batch": "859a1adb4260f4da",
    "episodic_sample": "e2200b8be4517247",
    "gradual": "27d848e623c34c07",
    "mixed_domains": "783095f7c70ede61",
    "non_iid": "c79debf9a275b361",
    "reset_each_shift": "cf20f1de4c940b72",
}


def _protocol(reset: str, **kw):
    return load_protocol("tiny-shifts", reset=reset, **kw)


def _labels(protocol, y: np.ndarray) -> dict:
    return {(s, v): y for s in protocol.shifts for v in protocol.severities}


def _digest(stream) -> str:
    rows = [
        (b.number, b.indices.tolist(), b.domains.tolist(), b.reset_before, b.group)
        for b in stream.batches
    ]
    return hashlib.sha256(repr(rows).encode()).hexdigest()[:16]


def _cells(stream) -> dict[int, list]:
    """``{domain id: [batch, ...]}`` in stream order; every batch holds one domain."""
    out: dict[int, list] = {}
    for b in stream.batches:
        d = b.single_domain()
        assert d is not None
        out.setdefault(d, []).append(b)
    return out


@pytest.mark.parametrize(("k", "bs", "max_images"), [(1, 8, None), (3, 16, None), (2, 8, 150)])
def test_label_shift_uses_each_sample_once_in_batches_of_at_most_k_classes(k, bs, max_images):
    p = _protocol("label_shift", classes_per_batch=k, batch_size=bs, max_images=max_images)
    y = np.random.default_rng(3).integers(0, 7, 300)  # 7 classes of unequal sizes
    stream = build_stream(p, 0, _labels(p, y))
    expected = subset(p, 300)  # the whole split, or max_images of it as in every policy
    assert len(expected) == (max_images or 300)
    for d, batches in _cells(stream).items():
        used = np.concatenate([b.indices for b in batches])
        assert np.array_equal(np.sort(used), expected)  # every sample of the cell, once
        assert batches[0].reset_before == (d > 0) and not any(b.reset_before for b in batches[1:])
        assert len(batches) >= math.ceil(len(used) / bs)
        for j, b in enumerate(batches):
            classes = set(y[b.indices].tolist())
            assert 1 <= len(classes) <= k and 1 <= len(b) <= bs
            if len(b) < bs:  # short only when the batch's classes ran out
                later = np.concatenate([c.indices for c in batches[j + 1 :]] or [[]]).astype(int)
                assert not classes & set(y[later].tolist())


def test_label_shift_draws_the_classes_of_each_batch_uniformly():
    """Classes are drawn per batch, uniformly among those with samples left: each class is
    in the first batch of a cell in about k/C of the seeds, and batches vary."""
    k, n_classes, seeds = 2, 4, 400
    p = _protocol("label_shift", classes_per_batch=k, shifts=["dim"], severities=[1])
    y = np.repeat(np.arange(n_classes), 30)
    hits = np.zeros(n_classes)
    for seed in range(seeds):
        first = build_stream(p, seed, _labels(p, y)).batches[0]
        hits[np.unique(y[first.indices])] += 1
    assert np.allclose(hits / seeds, k / n_classes, atol=0.08), hits / seeds


def test_label_shift_batches_takes_a_batch_from_the_pooled_classes():
    """Within the drawn classes a batch takes samples uniformly from their pool: a class
    with more samples left gives more of the batch."""
    y = np.array([0] * 90 + [1] * 10)
    share = []
    for seed in range(200):
        rng = np.random.default_rng(seed)
        first = label_shift_batches(np.arange(100), y, 2, 20, rng)[0]
        share.append(float((y[first] == 0).mean()))
    assert 0.85 < np.mean(share) < 0.95


@pytest.mark.parametrize(
    ("reset", "kw"),
    [("label_shift", {"classes_per_batch": 2}), ("imbalanced", {"imbalance_ratio": 5})],
)
def test_the_stream_is_pinned_by_protocol_and_seed(reset, kw):
    p = _protocol(reset, **kw)
    labels = _labels(p, np.random.default_rng(0).integers(0, 4, 120))
    a, b = build_stream(p, 0, labels), build_stream(p, 0, labels)
    assert _digest(a) == _digest(b)
    assert _digest(build_stream(p, 1, labels)) != _digest(a)
    cells = _cells(a)
    assert [b.indices.tolist() for b in cells[0]] != [b.indices.tolist() for b in cells[1]]


def test_imbalanced_class_counts_follow_the_ratio():
    ratio, per_class, n_classes = 10.0, 40, 10
    p = _protocol("imbalanced", imbalance_ratio=ratio, batch_size=16)
    y = np.repeat(np.arange(n_classes), per_class)
    expected = [
        max(1, math.floor(per_class * ratio ** (-r / (n_classes - 1)) + 0.5))
        for r in range(n_classes)
    ]
    assert expected[0] == per_class and expected[-1] == per_class / ratio
    ranked = {}
    for seed in (0, 1):
        stream = build_stream(p, seed, _labels(p, y))
        kept = []
        for batches in _cells(stream).values():
            idx = np.concatenate([b.indices for b in batches])
            assert len(set(idx.tolist())) == len(idx)  # each kept sample once
            counts = np.bincount(y[idx], minlength=n_classes)
            assert sorted(counts.tolist(), reverse=True) == expected
            assert all(len(b) == 16 for b in batches[:-1])  # the protocol's batch size
            kept.append((np.sort(idx).tolist(), idx.tolist()))
        # one seed: the same kept samples in every domain, in a different order
        assert all(k[0] == kept[0][0] for k in kept) and kept[0][1] != kept[1][1]
        ranked[seed] = np.argsort(-counts, kind="stable").tolist()
    assert ranked[0] != ranked[1]  # the class ranking is drawn per seed


def test_imbalanced_subset_keeps_a_single_class_whole():
    y = np.zeros(12, dtype=int)
    kept = imbalanced_subset(np.arange(12), y, 10.0, np.random.default_rng(0))
    assert kept.tolist() == list(range(12))


def test_the_ids_name_the_fields_and_old_ids_and_streams_hold():
    assert "-label_shift-k2-bs8-" in _protocol("label_shift", classes_per_batch=2).id
    assert "-imbalanced-r10-bs8-" in _protocol("imbalanced", imbalance_ratio=10).id
    assert (
        _protocol("label_shift", classes_per_batch=2).id
        != _protocol("label_shift", classes_per_batch=3).id
    )
    assert "classes_per_batch" not in _protocol("continual").identity()
    assert "imbalance_ratio" not in _protocol("continual").identity()
    for (suite, reset), pid in OLD_IDS.items():
        kw = {"dirichlet_delta": 0.1} if reset == "non_iid" else {}
        over = {"reset": reset, **kw} if reset else {}
        assert load_protocol(suite, **over).id == pid
    y = np.random.default_rng(0).integers(0, 4, 40)
    for reset, digest in OLD_STREAMS.items():
        p = _protocol(reset, **({"dirichlet_delta": 0.1} if reset == "non_iid" else {}))
        assert _digest(build_stream(p, 1, _labels(p, y))) == digest, reset


@pytest.mark.parametrize(
    ("over", "words"),
    [
        ({"reset": "label_shift"}, "needs classes_per_batch, an integer >= 1 .* got None"),
        ({"reset": "label_shift", "classes_per_batch": 0}, "got 0"),
        ({"reset": "label_shift", "classes_per_batch": 2.5}, "got 2.5"),
        ({"reset": "label_shift", "classes_per_batch": True}, "got True"),
        ({"reset": "continual", "classes_per_batch": 2}, "classes_per_batch=2 only applies"),
        ({"reset": "imbalanced"}, "needs imbalance_ratio, a finite number > 1 .* got None"),
        ({"reset": "imbalanced", "imbalance_ratio": 1}, "got 1.0"),
        ({"reset": "imbalanced", "imbalance_ratio": float("inf")}, "got inf"),
        ({"reset": "imbalanced", "imbalance_ratio": float("nan")}, "got nan"),
        ({"reset": "non_iid", "dirichlet_delta": 0.1, "imbalance_ratio": 4}, "'non_iid'"),
    ],
)
def test_bad_fields_are_refused_naming_the_value(over, words):
    with pytest.raises(ValueError, match=words):
        load_protocol("tiny-shifts", **over)


def test_more_classes_per_batch_than_the_domain_has_is_refused_naming_both():
    p = _protocol("label_shift", classes_per_batch=5)
    y = np.arange(40) % 4
    with pytest.raises(ValueError, match=r"classes_per_batch=5 is more than the 4 classes"):
        build_stream(p, 0, _labels(p, y))
    assert build_stream(_protocol("label_shift", classes_per_batch=4), 0, _labels(p, y)).batches


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["protocol.reset=label_shift"], "needs classes_per_batch"),
        (["protocol.reset=label_shift", "protocol.classes_per_batch=0"], "classes_per_batch=0"),
        (["protocol.reset=imbalanced"], "needs imbalance_ratio"),
        (["protocol.reset=imbalanced", "protocol.imbalance_ratio=1"], "imbalance_ratio=1"),
        (["protocol.classes_per_batch=3"], "only applies to reset policy 'label_shift'"),
    ],
)
def test_the_cli_refuses_a_bad_field_before_anything_is_built(
    args, words, tmp_path, capsys, monkeypatch
):
    from tta_bench.run.inputs import RunInputs

    def built(*_a, **_k):
        raise AssertionError("the run's inputs were built")

    monkeypatch.setattr(RunInputs, "build", built)
    out = tmp_path / "r.json"
    rc, _, err = cli(
        capsys, "run", "--suite", "tiny-shifts", "--quiet", "--output", str(out), *args
    )
    assert rc == 2 and words in err, err
    assert not out.exists()


def test_end_to_end_runs_of_both_policies(tmp_path):
    rec = run(tmp_path / "ls.json", protocol={"reset": "label_shift", "classes_per_batch": 2})
    assert "-label_shift-k2-" in rec["protocol"]["id"]
    assert len(rec["cells"]) == 4 and all(c["n"] == 32 for c in rec["cells"])
    rec = run(tmp_path / "im.json", protocol={"reset": "imbalanced", "imbalance_ratio": 4})
    assert "-imbalanced-r4-" in rec["protocol"]["id"]
    # 8 images per class, ranks 0..3 keep 8 * 4^(-r/3): 8, 5, 3, 2 (accuracy over these)
    assert len(rec["cells"]) == 4 and all(c["n"] == 18 for c in rec["cells"])
    with pytest.raises(ValueError, match=r"classes_per_batch=5 is more than the 4 classes"):
        run(tmp_path / "bad.json", protocol={"reset": "label_shift", "classes_per_batch": 5})
