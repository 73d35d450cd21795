"""Composite shifts ``"A>B"`` (``tta_bench.run.composite``), the steps of a CCC-style
stream: at severity k, A at severity 6 - k then B at k, each checked and clamped; names
checked before anything is built; a run over composite domains records the plugins of
both parts and scores every (composite, severity) cell. Runs on the test plugin's shifts
(``noise``, ``dim``)."""

from __future__ import annotations

import pytest
import torch

from tta_bench.registry import RegistryError
from tta_bench.rng import SampleGenerator
from tta_bench.run.composite import CompositeShift, check_shift, parts, shift_kernel

from .helpers import run


def _generator(seed: int = 0) -> SampleGenerator:
    import numpy as np

    return SampleGenerator.for_samples(np.arange(4), seed, "noise>dim", 2, device="cpu")


def test_parts_of_a_name():
    assert parts("noise") is None
    assert parts("noise>dim") == ("noise", "dim")
    for bad in ("noise>", ">dim", "noise>dim>noise", "dim>dim"):
        with pytest.raises(ValueError, match="two different registered shifts"):
            parts(bad)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_severity_k_applies_a_at_6_minus_k_then_b_at_k(k):
    from tta_bench_testplugin.shifts import dim

    x = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    kernel = shift_kernel("dim>noise")
    assert isinstance(kernel, CompositeShift)
    out = kernel(x, k, generator=_generator())
    # written out: dim at 6 - k (clamped), then the noise at k with the same generator
    first = dim(x, 6 - k, generator=_generator()).clamp(0, 1)
    gen = _generator()
    draws = gen.normal(*x.shape[1:]).to(x.dtype)
    expected = (first + 0.04 * k * draws).clamp(0, 1)
    assert torch.allclose(out, expected, atol=1e-6)
    # the order matters: B(A(x)) is not A(B(x)) when A clamps what B would bring back
    other = shift_kernel("noise>dim")(x, k, generator=_generator())
    assert not torch.allclose(out, other)


def test_severity_outside_1_to_5_is_refused():
    with pytest.raises(ValueError, match="severity must be in 1..5, got 6"):
        shift_kernel("dim>noise")(torch.zeros(1, 3, 4, 4), 6, generator=_generator())


def test_unknown_parts_are_refused_naming_the_options():
    check_shift("noise>dim")
    with pytest.raises(RegistryError, match=r"unknown shift 'fogg'.*Available"):
        check_shift("noise>fogg")


def test_a_continual_run_over_composite_shifts_scores_every_step(tmp_path):
    rec = run(
        tmp_path / "c.json",
        suite="tiny-continual",
        protocol={"shifts": ["noise>dim", "dim>noise"], "severities": [1, 3, 5]},
    )
    cells = [(c["shift"], c["severity"]) for c in rec["cells"]]
    assert cells == [(s, v) for s in ("noise>dim", "dim>noise") for v in (1, 3, 5)]
    assert "-continual-" in rec["protocol"]["id"]
    plugins = rec["provenance"]["plugins"]
    shifts = [p["name"] for p in plugins if p["group"] == "tta_bench.shifts"]
    assert shifts == ["noise", "dim"]  # each part once, no composite name
    with pytest.raises(Exception, match="unknown shift 'fogg'"):
        run(tmp_path / "bad.json", suite="tiny-continual", protocol={"shifts": ["noise>fogg"]})
