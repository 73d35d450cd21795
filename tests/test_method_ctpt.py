"""C-TPT (mura_plugin.methods.ctpt) on the real tiny model and digits data."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest
import torch
from method_runs import (
    FAST,
    assert_batched_episodes_equal_sequential,
    assert_params_at_snapshot,
    assert_reset_then_reseed_reproduces,
    build_method,
    run_method,
    scored_cell,
    seeded_step,
)

from mura_plugin.methods.ctpt import CTPT, atfd, dataset_setting
from mura_plugin.methods.tpt import TPT
from tta_bench.run.profiles import method_settings

_build = build_method


def _atfd_numpy(text: np.ndarray) -> float:
    centroid = text.mean(axis=0)
    return float(np.mean([math.sqrt(((row - centroid) ** 2).sum()) for row in text]))


def test_atfd_known_values():
    text = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    # centroid (0, 1/3): distances sqrt(1 + 1/9), 2/3, sqrt(1 + 1/9)
    expected = (2 * math.sqrt(10 / 9) + 2 / 3) / 3
    assert float(atfd(text)) == pytest.approx(expected, abs=1e-6)
    rng = np.random.default_rng(0)
    many = rng.normal(size=(3, 5, 4)).astype(np.float32)  # [S, C, D]: one per episode
    got = atfd(torch.from_numpy(many))
    assert got.shape == (3,)
    for s in range(3):
        assert float(got[s]) == pytest.approx(_atfd_numpy(many[s]), abs=1e-5)
    # identical class embeddings: no dispersion
    assert float(atfd(torch.ones(4, 3))) == 0.0


def test_lambda_and_augmix_per_dataset():
    assert dataset_setting("digits") == (20.0, False)  # lambda of the natural-shift script
    assert dataset_setting(None) == (20.0, False)
    assert dataset_setting("imagenet_a") == (20.0, True)
    assert dataset_setting("imagenet") == (50.0, False)  # README: I with the fg script
    assert dataset_setting("dtd") == (50.0, True)
    assert dataset_setting("digits", "tta_vlm") == (20.0, False)
    assert dataset_setting("imagenet", "tta_vlm") == (20.0, False)
    assert dataset_setting("dtd", "tta_vlm") == (50.0, True)
    with pytest.raises(ValueError):
        dataset_setting("digits", "nope")


def test_loss_is_tpts_minus_lambda_atfd(classifier, batch):
    """The C-TPT loss on the same views is TPT's loss minus lambda times the ATFD of the
    prompt's class embeddings, computed separately (numpy)."""
    ctpt = _build(CTPT, classifier, lambda_term=7.0, augmix=False, **FAST)
    tpt = _build(TPT, classifier, **FAST)
    ctpt.reseed(3)
    views = ctpt.make_views(batch)
    tpt.reseed(3)
    assert torch.equal(views, tpt.make_views(batch))  # augmix=false: TPT's views
    feats = ctpt.encode_views(views)
    ctpt.step_index = tpt.step_index = 0
    with torch.no_grad():
        loss_c, _ = ctpt.view_loss(feats)
        loss_t, _ = tpt.view_loss(feats)
        text = ctpt.prompt().numpy()
    expected = loss_t.numpy() - 7.0 * _atfd_numpy(text)
    np.testing.assert_allclose(loss_c.numpy(), expected, rtol=0, atol=1e-5)
    assert ctpt.resolved_settings() == {"lambda_term": 7.0, "augmix": False}


def test_the_atfd_term_changes_the_update(classifier, batch):
    outs = [
        seeded_step(_build(CTPT, classifier, lambda_term=lam, **FAST), batch, 1)
        for lam in (0.0, 50.0)
    ]
    assert not torch.allclose(outs[0], outs[1], atol=1e-4)


def test_batched_episodes_equal_the_sequential_loop(classifier, batch):
    config = {**FAST, "chunk_views": 16}  # 16 // 8 views: chunks of 2 samples
    assert_batched_episodes_equal_sequential(
        functools.partial(_build, CTPT, classifier, **config), batch, loss_atol=1e-5
    )


def test_reset_and_seed_reproduce(classifier, batch):
    build = functools.partial(_build, CTPT, classifier, **FAST)
    fresh, used, a = assert_reset_then_reseed_reproduces(build, batch)
    fresh.reset()
    assert torch.equal(a, seeded_step(fresh, batch, 5))
    assert_params_at_snapshot(used)


def test_class_attributes():
    assert CTPT.stream_kind == "episodic" and CTPT.adapts and not CTPT.light
    config = dataclasses.replace(CTPT.Config(), **method_settings("tta_vlm", "ctpt"))
    assert config.dataset_settings == "tta_vlm"
    default = CTPT.Config()
    assert (default.views, default.selection, default.lr, default.steps) == (63, 0.1, 5e-3, 1)
    assert (default.precision, default.grad_scale, default.loss) == (
        "fp16",
        1000.0,
        "marginal_entropy",
    )


@pytest.mark.parametrize("tta_vlm", [False, True])
def test_end_to_end_through_the_runner(tmp_path, tta_vlm):
    record = run_method(tmp_path, "ctpt", tta_vlm=tta_vlm, max_images=32)
    scored_cell(record)
    expected = {"lambda_term": 20.0, "augmix": False}
    assert record["method_resolved"] == expected
