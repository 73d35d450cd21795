"""RDumb (mura_plugin/methods/rdumb.py): ETA plus a reset to the source state after every
``reset_every`` adaptation steps. The reset rule on the real tiny ViT: the state after
exactly N steps equals a fresh instance's (parameters, optimiser, moving average), steps
that select no sample count, every optimisation step counts; ETA without the reset; the
harness's CIFAR-10-C defaults; reset and seeds."""

from __future__ import annotations

import dataclasses

import torch
from method_runs import (
    assert_params_at_snapshot,
    assert_reset_then_reseed_reproduces,
    assert_same_seeded_steps,
    build_method,
)

from mura_plugin.methods.eta import ETA
from mura_plugin.methods.rdumb import RDumb


def _params(method):
    return [p.detach().clone() for p in method.params]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _assert_source_state(method, fresh):
    """``method`` is in ``fresh``'s state right after setup: parameters, optimiser (state
    and groups), ETA's moving average."""
    assert _same(_params(method), _params(fresh))
    assert method.optimizer.state_dict() == fresh.optimizer.state_dict()
    assert not method.optimizer.state and method.moving_probs is None


def test_defaults_are_the_harness_cifar10_values(classifier):
    cfg = RDumb.Config()
    assert (cfg.optimizer, cfg.lr, cfg.weight_decay, cfg.steps, cfg.precision) == (
        "adam", 1e-3, 0.0, 1, "fp32"
    )  # fmt: skip
    assert (cfg.e_margin, cfg.d_margin, cfg.probs_momentum, cfg.reset_every) == (
        0.4, 0.4, 0.9, 1000
    )  # fmt: skip
    method = build_method(RDumb, classifier)
    assert method.optimizer.defaults["betas"] == (0.9, 0.999)
    assert RDumb.stream_kind is None and issubclass(RDumb, ETA)


def test_state_after_exactly_n_steps_is_the_source_state(classifier, batch):
    n = 3
    method = build_method(RDumb, classifier, reset_every=n, lr=0.05)
    plain = build_method(RDumb, classifier, reset_every=0, lr=0.05)  # ETA, never reset
    fresh = build_method(RDumb, classifier, reset_every=n, lr=0.05)
    source = _params(fresh)
    for i in range(1, n + 1):
        method.reseed(i)
        plain.reseed(i)
        out = method.step(batch)
        expected = plain.step(batch)
        # each batch is predicted before its step: the resetting batch too
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        assert method.updates == i
        if i < n:
            assert not _same(_params(method), source) and method.resets == 0
    assert method.resets == 1 and not _same(_params(plain), source)
    assert method.counts["selected"] > 0  # the steps before the reset did update
    _assert_source_state(method, fresh)
    # the next step is a fresh instance's first step
    for m in (method, fresh):
        m.reseed(7)
    torch.testing.assert_close(method.step(batch), fresh.step(batch), rtol=0, atol=0)
    assert _same(_params(method), _params(fresh))
    torch.testing.assert_close(method.moving_probs, fresh.moving_probs, rtol=0, atol=0)


def test_steps_without_a_selected_sample_count(classifier, batch):
    """Both codes count every forward (official ``total_steps``, harness
    ``performed_updates``), also when nothing is selected and the optimiser does not step."""
    method = build_method(RDumb, classifier, reset_every=2, lr=0.05)
    never = build_method(RDumb, classifier, reset_every=0, lr=0.05)
    fresh = build_method(RDumb, classifier, lr=0.05)
    for m in (method, never):
        m.reseed(0)
        m.step(batch)  # all 4 reliable: an update
        m.config = dataclasses.replace(m.config, e_margin=1e-6)  # now none is reliable
    after_first = _params(never)
    assert not _same(after_first, _params(fresh))
    selected = method.counts["selected"]
    for m in (method, never):
        m.step(batch)
    assert method.counts["selected"] == selected  # the second step selected nothing
    assert _same(_params(never), after_first)  # ... so it made no update
    assert method.resets == 1  # ... yet it counted: the source state again
    _assert_source_state(method, fresh)


def test_every_optimisation_step_counts(classifier, batch):
    fresh = build_method(RDumb, classifier, lr=0.05)
    two = build_method(RDumb, classifier, steps=2, reset_every=2, lr=0.05, d_margin=2.0)
    two.step(batch)
    assert (two.updates, two.resets) == (2, 1)
    _assert_source_state(two, fresh)
    three = build_method(RDumb, classifier, steps=2, reset_every=3, lr=0.05, d_margin=2.0)
    three.step(batch)
    assert (three.updates, three.resets) == (2, 0)
    assert not _same(_params(three), _params(fresh))
    three.step(batch)  # step 3 resets mid-batch, step 4 adapts from the source
    assert (three.updates, three.resets) == (4, 1)
    once = build_method(RDumb, classifier, lr=0.05, d_margin=2.0)
    once.step(batch)
    assert _same(_params(three), _params(once))


def test_the_official_learning_rate_rule_survives_a_periodic_reset(classifier, batch):
    method = build_method(RDumb, classifier, optimizer="sgd", lr=None, reset_every=1)
    method.step(batch)
    assert method.resets == 1 and method.resolved_lr == 0.001 * 4 / 64
    assert method.optimizer.param_groups[0]["lr"] == 0.001 * 4 / 64  # the new optimiser's
    method.step(batch[:2])  # a short batch keeps the first batch's size
    assert method.optimizer.param_groups[0]["lr"] == 0.001 * 4 / 64


def test_reset_and_seeds(classifier, batch):
    def build():
        return build_method(RDumb, classifier, reset_every=2, lr=0.05)

    fresh, used, _ = assert_reset_then_reseed_reproduces(build, batch)
    assert (used.updates, used.resets) == (1, 0)  # the schedule restarted at the reset
    used.reset()
    assert (used.updates, used.resets) == (0, 0)
    assert_params_at_snapshot(used)
    assert not used.optimizer.state and used.moving_probs is None
    assert_same_seeded_steps(build(), build(), batch, seed=3, atol=0)
