"""CMF (mura_plugin/methods/cmf.py): the Kalman filter over parameters against a scalar
reference written here from the paper's equations (and one step by hand), the step on the
real tiny model against the filter applied to a twin without ensembling, the process-noise
rule, reset, seeds and the reference harness's defaults."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from method_runs import assert_params_at_snapshot, assert_reset_then_reseed_reproduces, build_method
from torch import nn

from mura_plugin.methods.cmf import CMF, CMFConfig, kalman_gain, momentum_filter_
from mura_plugin.methods.roid import ROID


def _scalar_filter(theta, hidden, source, var, alpha, gamma, q, lp=True):
    """One step for one scalar parameter, from the paper's filter: predict
    h- = alpha h + (1 - alpha) theta_0, P- = alpha^2 P + q; Kalman gain K = P- / (P- + r),
    r = 1 - q, clipped as officially (1 - K in [0.89, 1), 1 - K >= 0.9999 -> 1);
    h = h- + K (theta - h-), P = (1 - K) P-; theta <- gamma theta + (1 - gamma) h
    (h- for "op")."""
    h_pred = alpha * hidden + (1 - alpha) * source
    p_pred = alpha * alpha * var + q
    keep = 1 - p_pred / (p_pred + 1 - q)  # 1 - K
    if keep < 0.89:
        keep = 0.89
    if keep >= 0.9999:
        keep = 1.0
    gain = 1 - keep
    h_new = h_pred + gain * (theta - h_pred)
    merged = h_new if lp else h_pred
    return gamma * theta + (1 - gamma) * merged, h_new, keep * p_pred, keep


def test_first_filter_step_by_hand():
    # source 1, theta 2 after the optimiser, q 0.005: P- = q, beta = 0.995 / 1 = 0.995,
    # h = 0.995 * 1 + 0.005 * 2 = 1.005, theta = 0.99 * 2 + 0.01 * 1.005 = 1.99005
    theta, hidden, source = torch.tensor([2.0]), torch.tensor([1.0]), torch.tensor([1.0])
    var, beta = momentum_filter_([theta], [hidden], [source], 0.0, alpha=0.99, gamma=0.99, q=0.005)
    assert beta == pytest.approx(0.995) and var == pytest.approx(0.995 * 0.005)
    assert float(hidden) == pytest.approx(1.005, rel=1e-6)
    assert float(theta) == pytest.approx(1.99005, rel=1e-6)


@pytest.mark.parametrize(
    ("q", "filter_type"), [(0.005, "lp"), (0.3, "lp"), (1e-6, "lp"), (0.05, "op")]
)
def test_filter_matches_the_scalar_kalman_reference(q, filter_type):
    """Several steps on small tensors, the model moved between steps as an optimiser would;
    q = 0.3 hits the 0.89 floor of beta, q = 1e-6 the jump to 1."""
    gen = torch.Generator().manual_seed(0)
    source = [
        torch.randn(3, generator=gen, dtype=torch.float64),
        torch.randn(2, 2, generator=gen, dtype=torch.float64),
    ]
    params = [s.clone() for s in source]
    hidden = [s.clone() for s in source]
    ref_theta = [s.flatten().tolist() for s in source]
    ref_hidden = [s.flatten().tolist() for s in source]
    var = ref_var = 0.0
    betas = []
    for _ in range(6):
        for i, p in enumerate(params):
            delta = 0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.add_(delta)
            ref_theta[i] = [t + d for t, d in zip(ref_theta[i], delta.flatten().tolist())]
        var, beta = momentum_filter_(
            params, hidden, source, var, alpha=0.99, gamma=0.99, q=q, filter_type=filter_type
        )
        betas.append(beta)
        for i, src in enumerate(source):
            out = [
                _scalar_filter(t, h, s, ref_var, 0.99, 0.99, q, lp=filter_type == "lp")
                for t, h, s in zip(ref_theta[i], ref_hidden[i], src.flatten().tolist())
            ]
            ref_theta[i] = [o[0] for o in out]
            ref_hidden[i] = [o[1] for o in out]
            next_var, ref_beta = out[0][2], out[0][3]
        ref_var = next_var
        assert beta == pytest.approx(ref_beta, rel=1e-12) and var == pytest.approx(ref_var)
        for p, h, rt, rh in zip(params, hidden, ref_theta, ref_hidden):
            torch.testing.assert_close(p.flatten(), torch.tensor(rt, dtype=torch.float64))
            torch.testing.assert_close(h.flatten(), torch.tensor(rh, dtype=torch.float64))
    if q == 0.3:
        assert min(betas) == 0.89
    if q == 1e-6:
        assert betas[0] == 1.0
    if q == 0.005:
        assert 0.89 < min(betas) < max(betas) < 1.0  # the gain moves with P


def test_kalman_gain_clipping():
    assert kalman_gain(0.0, 0.0) == 1.0
    assert kalman_gain(0.5, 0.2) == 0.89
    assert kalman_gain(0.01, 0.005) == pytest.approx(0.995 / 1.005)


def _layer_norm_count(classifier) -> int:
    return sum(
        p.numel()
        for m in classifier.visual.modules()
        if isinstance(m, nn.LayerNorm)
        for p in m.parameters()
    )


def test_one_step_on_the_tiny_model(classifier, batch):
    """The step is ROID's loss and optimiser step (the same first prediction and loss as
    ROID), then the filter: against a twin with gamma = 1 (theta' = the optimiser's
    result), theta = 0.99 theta' + 0.01 ((1 - q) theta_0 + q theta'). A large step and
    Q = 0.5 make the filter's share visible above float32 rounding."""
    cmf = build_method(CMF, classifier, lr=0.05, q=0.5)
    twin = build_method(CMF, classifier, lr=0.05, q=0.5, gamma=1.0)
    roid = build_method(ROID, classifier, lr=0.05)
    outs = []
    for m in (cmf, twin, roid):
        m.reseed(6)
        outs.append(m.step(batch))
    torch.testing.assert_close(outs[0], outs[2], rtol=0, atol=0)
    torch.testing.assert_close(cmf.last_loss, roid.last_loss, rtol=0, atol=0)
    q = 0.5 * _layer_norm_count(classifier) / 38400
    assert cmf.process_noise == pytest.approx(q)
    assert cmf.resolved_settings()["process_noise"] == pytest.approx(q)
    assert cmf.beta == pytest.approx(1 - q) and cmf.variance == pytest.approx((1 - q) * q)
    for p, t, src in zip(cmf.params, twin.params, cmf.source_params):
        expected = 0.99 * t + 0.01 * ((1 - q) * src + q * t)
        torch.testing.assert_close(p.detach(), expected.detach(), rtol=0, atol=1e-6)
    for h, t, src in zip(cmf.hidden, twin.params, cmf.source_params):
        torch.testing.assert_close(h, ((1 - q) * src + q * t).detach(), rtol=0, atol=1e-6)
    # ROID's ensembling (theta_0 in place of the hidden model) is far from that
    gap = max(
        float((p - (0.99 * t + 0.01 * src)).detach().abs().max())
        for p, t, src in zip(cmf.params, twin.params, cmf.source_params)
    )
    assert gap > 1e-5


def test_reset_and_seeds_reproduce(classifier, batch):
    def build():
        return build_method(CMF, classifier)

    fresh, used, _ = assert_reset_then_reseed_reproduces(build, batch)
    used.reset()
    assert_params_at_snapshot(used)
    assert used.variance == 0.0 and used.beta is None
    assert all(torch.equal(h, s) for h, s in zip(used.hidden, used.source_params))
    assert torch.equal(used.class_probs, torch.full((10,), 0.1))
    other = build()  # fresh stepped after reseed(5); another seed draws other views
    other.reseed(4)
    other.step(batch)
    assert any(not torch.equal(p, q) for p, q in zip(fresh.params, other.params))


def test_reference_defaults_and_checks(classifier):
    cfg = CMFConfig()
    expected = dict(
        loss=None, optimizer="adam", lr=1e-3, weight_decay=0.0, steps=1, precision="fp32",
        use_weighting=True, use_consistency=True, use_prior_correction=True,
        momentum_probs=0.9, temperature=1 / 3, alpha=0.99, gamma=0.99, q=0.005,
        filter_type="lp",
    )  # fmt: skip
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert not hasattr(cfg, "momentum_src")
    assert CMF.adapts and not CMF.light and CMF.stream_kind is None
    with pytest.raises(ValueError):
        CMF(classifier, dataclasses.replace(cfg, filter_type="kf"))
