"""Protocols (typed, versioned, stable ids) and the streams they produce."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from tta_bench.registry import registry
from tta_bench.run import runner
from tta_bench.run.protocol import RESET_POLICIES, STATEFUL, load_protocol
from tta_bench.run.spec import RunSpec
from tta_bench.run.stream import build_stream, dirichlet_order

POLICIES = sorted(RESET_POLICIES)


def _protocol(reset: str, **kw):
    if reset == "non_iid":
        kw.setdefault("dirichlet_delta", 0.1)
    if reset == "label_shift":
        kw.setdefault("classes_per_batch", 3)
    if reset == "imbalanced":
        kw.setdefault("imbalance_ratio", 10.0)
    kw.setdefault("shifts", ["contrast", "gaussian_noise"])
    kw.setdefault("max_images", 100)
    return load_protocol("digits-c", reset=reset, **kw)


def _labels(protocol, n: int = 360, seed: int = 0) -> dict:
    y = np.random.default_rng(seed).integers(0, 10, n)
    sevs = sorted(set(protocol.severities))
    return {(s, v): y for s in protocol.shifts for v in sevs}


def test_every_policy_has_a_distinct_stable_id():
    ids = {r: _protocol(r).id for r in POLICIES}
    assert len(set(ids.values())) == len(POLICIES)
    for r, pid in ids.items():
        assert pid == _protocol(r).id  # stable
        assert f"-{r}" in pid and "@v2-" in pid
    assert "-non_iid-d0.1-" in ids["non_iid"]
    assert _protocol("non_iid", dirichlet_delta=1.0).id != ids["non_iid"]
    # An unused new field does not enter the identity (old ids hold).
    assert "dirichlet_delta" not in _protocol("continual").identity()


def test_bad_protocols_name_the_value():
    with pytest.raises(ValueError, match="dirichlet_delta"):
        load_protocol("digits-c", reset="non_iid")
    with pytest.raises(ValueError, match="only applies"):
        load_protocol("digits-c", reset="continual", dirichlet_delta=0.1)
    with pytest.raises(ValueError, match="unknown reset policy 'sometimes'.*gradual"):
        load_protocol("digits-c", reset="sometimes")
    assert {p for p in POLICIES if _protocol(p).stateful} == set(STATEFUL)


@pytest.mark.parametrize("reset", POLICIES)
def test_stream_is_a_pure_function_of_protocol_and_seed(reset):
    p = _protocol(reset, severities=[3, 5], batch_size=1 if reset == "episodic_sample" else 16)
    labels = _labels(p)
    a, b = build_stream(p, 0, labels), build_stream(p, 0, labels)
    assert a.sequence() == b.sequence()
    assert a.sequence() != build_stream(p, 1, labels).sequence()
    # Every sample of every domain is seen (gradual: up and down, so twice except the top).
    seq = a.sequence()
    for shift, sev in a.domains:
        got = sorted(i for i, s, v in seq if (s, v) == (shift, sev))
        if reset == "imbalanced":  # a long-tailed subset of the 100, each kept sample once
            assert len(got) == len(set(got)) < 100
            continue
        visits = 2 if p.order_policy == "gradual" and sev != max(p.severities) else 1
        assert len(got) == visits * 100 and len(set(got)) == 100
    assert all(len(batch) <= p.batch_size for batch in a.batches)


def test_reset_points_and_orders_per_policy():
    labels_for = _labels
    ep = _protocol("episodic_batch", batch_size=32)
    s = build_stream(ep, 0, labels_for(ep))
    assert [b.reset_before for b in s.batches] == [False] + [True] * (len(s.batches) - 1)

    rs = _protocol("reset_each_shift", batch_size=32)
    s = build_stream(rs, 0, labels_for(rs))
    starts = [b.reset_before for b in s.batches]
    assert sum(starts) == len(s.domains) - 1 and len(s.groups) == len(s.domains)

    for policy in ("continual", "gradual", "mixed_domains"):
        p = _protocol(policy, severities=[1, 2, 3, 4, 5] if policy == "gradual" else [5])
        s = build_stream(p, 0, labels_for(p))
        assert not any(b.reset_before for b in s.batches)
        assert len(s.groups) == 1  # one group per seed: resumable per seed only

    gr = _protocol("gradual", severities=[1, 2, 3, 4, 5], batch_size=100)
    s = build_stream(gr, 0, labels_for(gr))
    order = [s.domains[int(b.domains[0])] for b in s.batches]
    ramp = [1, 2, 3, 4, 5, 4, 3, 2, 1]
    assert order == [("contrast", v) for v in ramp] + [("gaussian_noise", v) for v in ramp]

    mx = _protocol("mixed_domains", batch_size=50)
    s = build_stream(mx, 0, labels_for(mx))
    assert sum(b.single_domain() is None for b in s.batches) >= len(s.batches) - 1


def test_non_iid_order_is_label_correlated_and_delta_controls_it():
    labels = np.repeat(np.arange(10), 36)
    idx = np.arange(360)

    def classes_per_batch(order: np.ndarray) -> float:
        """Mean number of distinct labels in each of the 6 time slots (batches of 60)."""
        return float(np.mean([len(set(labels[order[k : k + 60]])) for k in range(0, 360, 60)]))

    iid = classes_per_batch(np.random.default_rng(0).permutation(idx))
    low_order = dirichlet_order(idx, labels, 6, 0.01, np.random.default_rng(1))
    high = classes_per_batch(dirichlet_order(idx, labels, 6, 100.0, np.random.default_rng(1)))
    assert sorted(low_order) == list(idx)  # a reordering: every sample exactly once
    assert iid == 10
    assert classes_per_batch(low_order) <= 4  # each batch holds few classes
    assert high >= 9.5  # large delta: close to i.i.d.


def _record_stream(method: str, protocol, tmp_path) -> tuple[list, dict]:
    seen: list = []

    def observer(seed, batch, images):
        digest = hashlib.sha1(images.detach().cpu().numpy().tobytes()).hexdigest()
        seen.append((seed, batch.indices.tolist(), batch.domains.tolist(), digest))

    spec = RunSpec(
        method=method,
        method_config=registry("methods").get(method).Config(),
        model="tiny-clip-digits",
        model_args={},
        protocol=protocol,
        seeds=[0, 1],
        progress=False,
        reference=False,
        resume=False,
    )
    record = runner.Evaluation(spec, tmp_path / f"{method}.json", observer=observer).run()
    return seen, record


@pytest.mark.parametrize("reset", ["mixed_domains", "non_iid"])
def test_every_method_sees_the_identical_stream(reset, tmp_path, default_bundle, digits_stream):
    p = _protocol(reset, max_images=48, batch_size=16)
    zs, rec_zs = _record_stream("zeroshot", p, tmp_path)
    tent, rec_tent = _record_stream("tent", p, tmp_path)
    assert zs == tent  # same (index, shift, severity) order and the same corrupted pixels
    labels = {d: digits_stream.labels for d in _labels(p)}
    expected = [
        (0, b.indices.tolist(), b.domains.tolist()) for b in build_stream(p, 0, labels).batches
    ]
    assert [s[:3] for s in zs if s[0] == 0] == expected
    # Cells are per (shift, severity, seed) whatever the order; each holds its 48 samples.
    for rec in (rec_zs, rec_tent):
        keys = sorted((c["shift"], c["severity"], c["seed"]) for c in rec["cells"])
        assert keys == sorted((s, 5, seed) for s in p.shifts for seed in (0, 1))
        assert all(c["n"] == 48 for c in rec["cells"])
