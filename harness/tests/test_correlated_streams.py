"""The class-sorted stream policies (``tta_bench.run.stream``), the reference harness's
``correlated``, ``gradual_correlated`` and ``mixed_domains_correlated`` settings: the
domains, visits and resets of ``continual``, ``gradual`` and ``mixed_domains``, each
segment (the whole mixed stream) sorted by class label, or in a Dirichlet label order with
``dirichlet_delta``. Pinned by (protocol, seed, labels); their ids carry the policy and the
delta; the other policies' ids and streams did not move (``test_label_shift_streams``).
Runs on the test plugin's ``tiny-shifts`` suite (4 classes)."""

from __future__ import annotations

import numpy as np
import pytest

from tta_bench.run.protocol import CORRELATED, load_protocol
from tta_bench.run.stream import build_stream, class_sorted

from .helpers import cli, run


def _protocol(reset: str, **kw):
    return load_protocol("tiny-shifts", reset=reset, **kw)


def _labels(protocol, y: np.ndarray) -> dict:
    return {(s, v): y for s in protocol.shifts for v in range(1, 6)}


def _sequence(stream) -> list[tuple[int, int]]:
    """``(domain id, dataset index)`` of every sample in stream order."""
    return [(int(d), int(i)) for b in stream.batches for d, i in zip(b.domains, b.indices)]


def test_class_sorted_sorts_by_label_and_shuffles_within_a_class():
    y = np.array([2, 0, 1, 0, 2, 1, 0, 2, 1, 0])
    idx = np.arange(10)
    out = class_sorted(idx, y, np.random.default_rng(0))
    assert sorted(out.tolist()) == idx.tolist()
    assert y[out].tolist() == sorted(y.tolist())
    orders = {tuple(class_sorted(idx, y, np.random.default_rng(s)).tolist()) for s in range(20)}
    assert len(orders) > 1  # within a class the order is drawn


@pytest.mark.parametrize("reset", sorted(CORRELATED))
def test_each_correlated_policy_is_its_base_stream_sorted_by_class(reset):
    base = CORRELATED[reset]
    p, q = _protocol(reset), _protocol(base)
    y = np.random.default_rng(1).integers(0, 4, 40)
    sorted_stream = build_stream(p, 0, _labels(p, y))
    plain = build_stream(q, 0, _labels(q, y))
    assert p.stateful and p.order_policy == base
    # the same domains, visits, resets and batch sizes as the base policy
    assert sorted_stream.domains == plain.domains and sorted_stream.groups == plain.groups
    assert [len(b) for b in sorted_stream.batches] == [len(b) for b in plain.batches]
    assert not any(b.reset_before for b in sorted_stream.batches)
    assert sorted(_sequence(sorted_stream)) == sorted(_sequence(plain))
    if base == "mixed_domains":  # one segment: the whole stream ascends in class
        ys = [y[i] for _, i in _sequence(sorted_stream)]
        assert ys == sorted(ys)
        assert len({d for b in sorted_stream.batches for d in b.domains.tolist()}) > 1
    else:  # every segment (a domain visit) ascends in class
        seq, start = _sequence(sorted_stream), 0
        n = len(y)
        for start in range(0, len(seq), n):
            part = seq[start : start + n]
            assert len({d for d, _ in part}) == 1
            ys = [y[i] for _, i in part]
            assert ys == sorted(ys), (reset, start)
        assert _sequence(plain) != _sequence(sorted_stream)


@pytest.mark.parametrize("reset", sorted(CORRELATED))
def test_the_stream_is_pinned_by_protocol_and_seed(reset):
    p = _protocol(reset)
    y = np.random.default_rng(0).integers(0, 4, 60)
    a, b = build_stream(p, 0, _labels(p, y)), build_stream(p, 0, _labels(p, y))
    assert _sequence(a) == _sequence(b)
    assert _sequence(build_stream(p, 1, _labels(p, y))) != _sequence(a)


def test_a_dirichlet_delta_gives_a_temporally_correlated_order_instead():
    y = np.repeat(np.arange(4), 50)
    p = _protocol("correlated", dirichlet_delta=0.05, batch_size=10)
    stream = build_stream(p, 0, _labels(p, y))
    first = [y[b.indices] for b in stream.batches[:20]]  # the first domain
    ys = np.concatenate(first)
    assert ys.tolist() != sorted(ys.tolist())  # not the plain class sort
    # few classes per batch: small delta concentrates each class into few slots
    assert np.mean([len(set(c.tolist())) for c in first]) < 2.5
    wide = _protocol("correlated", dirichlet_delta=100.0, batch_size=10)
    spread = [y[b.indices] for b in build_stream(wide, 0, _labels(wide, y)).batches[:20]]
    assert np.mean([len(set(c.tolist())) for c in spread]) > 3.0


def test_ids_name_the_policy_and_the_delta():
    assert "-correlated-bs8-" in _protocol("correlated").id
    assert "-gradual_correlated-bs8-" in _protocol("gradual_correlated").id
    pid = _protocol("mixed_domains_correlated", dirichlet_delta=0.01).id
    assert "-mixed_domains_correlated-d0.01-bs8-" in pid
    assert _protocol("correlated").id != _protocol("continual").id


@pytest.mark.parametrize(
    ("reset", "delta", "words"),
    [
        ("correlated", -1.0, "takes dirichlet_delta > 0"),
        ("correlated", float("inf"), "takes dirichlet_delta > 0"),
        ("continual", 0.1, "only applies to reset policies 'non_iid', 'correlated'"),
    ],
)
def test_bad_deltas_are_refused_naming_the_value(reset, delta, words):
    with pytest.raises(ValueError, match=words):
        _protocol(reset, dirichlet_delta=delta)


def test_the_cli_lists_and_refuses_naming_the_options(capsys, tmp_path):
    out = tmp_path / "bad.json"
    rc, _, err = cli(
        capsys, "run", "--method", "zeroshot", "--suite", "tiny-shifts",
        "protocol.reset=sorted", f"output={out}", "progress=false",
    )  # fmt: skip
    assert rc == 2 and "correlated" in err and "mixed_domains_correlated" in err
    assert not out.exists()


def test_end_to_end_run_scores_every_cell_once(tmp_path):
    rec = run(tmp_path / "c.json", protocol={"reset": "gradual_correlated"})
    assert "-gradual_correlated-" in rec["protocol"]["id"]
    plain = run(tmp_path / "g.json", protocol={"reset": "gradual"})
    assert [(c["shift"], c["severity"], c["n"]) for c in rec["cells"]] == [
        (c["shift"], c["severity"], c["n"]) for c in plain["cells"]
    ]
    # the frozen model scores the same samples whatever their order
    assert [c["accuracy"] for c in rec["cells"]] == pytest.approx(
        [c["accuracy"] for c in plain["cells"]], abs=1e-9
    )
