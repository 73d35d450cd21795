"""DynaPrompt (mura_plugin/methods/dynaprompt.py): the prompt selection rule, the buffer's
delete/append bookkeeping and the loss on hand-made values; fresh AdamW state per sample
(unselected prompts only decay) against TTA-VLM's kept state; recycling; a real run through
the runner; reset and seeds."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from method_runs import run_method

from mura_plugin.methods.dynaprompt import (
    DynaPrompt,
    DynaPromptConfig,
    PromptBuffer,
    buffer_loss,
    select_prompts,
)


@pytest.mark.parametrize(
    ("entropy", "difference", "init", "official", "ids"),
    [
        # every prompt equal (the buffer at the start): the initial prompt alone
        ([0.7] * 4, [0.2] * 4, 0, [0], [0]),
        # by entropy: 2, 0, 4 (init, rank 2), 1, 3 -> lower {1, 3}; by difference 1, 4, ... ->
        # the first 2 are {1, 4}; candidate {1}; the official reads it as rank 1: prompt 0
        ([0.9, 0.5, 1.2, 0.3, 0.7], [0.1, 0.4, 0.0, 0.2, 0.3], 4, [0, 4], [1, 4]),
        # the initial prompt has the lowest entropy: ent_order[min(r + 1, P - 1):] is itself,
        # it is among the 3 sharpest, and the official selects it twice
        ([0.8, 0.6, 0.4, 0.2], [0.0, 0.1, 0.2, 0.3], 3, [3, 3], [3]),
        # lower-entropy prompts that are not sharper: none, a new prompt enters the buffer
        ([0.5, 0.9, 0.1], [0.3, 0.5, 0.1], 0, [0], [0]),
        # two candidates {0, 3}: the official takes ranks 0 and 3 (prompts 4 and 0)
        ([0.2, 0.8, 0.5, 0.1, 0.9], [0.9, 0.0, 0.1, 0.8, 0.2], 2, [4, 0, 2], [0, 3, 2]),
    ],
)
def test_prompt_selection_on_hand_made_entropies(entropy, difference, init, official, ids):
    assert select_prompts(entropy, difference, init, "official") == official
    assert select_prompts(entropy, difference, init, "ids") == ids


def test_buffer_appends_and_deletes_the_least_recently_used():
    buf = PromptBuffer(3)
    assert (buf.order, buf.uses, buf.init) == ([0, 1, 2], [0, 0, 0], 0)
    assert buf.recycle() is None  # unused prompts left: nothing deleted
    buf.use([0])
    assert (buf.order, buf.uses, buf.init) == ([1, 2, 0], [1, 0, 0], 1)
    buf.use([2, 1])
    assert (buf.order, buf.uses) == ([0, 2, 1], [1, 1, 1])
    # full: the least recently used (0) is deleted for a fresh initial prompt
    assert buf.recycle() == 0
    assert (buf.order, buf.uses, buf.init) == ([0, 2, 1], [0, 1, 1], 0)
    assert buf.recycle() is None
    buf.use([0, 0])  # the official's repeated selection counts twice
    assert (buf.order, buf.uses) == ([2, 1, 0], [2, 1, 1])
    assert buf.recycle() == 2


def test_loss_is_the_mean_over_prompts_of_the_confident_views_marginal_entropy():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 2, 3, generator=gen) * 2
    z = logits.double().numpy()
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    view_ent = -(p * np.log(p)).sum(-1).mean(-1)  # [V]: mean over the selected prompts
    kept = np.argsort(view_ent)[:2]  # int(4 * 0.5) views
    mean_p = p[kept].mean(0)  # [S, C]
    expected = (-(mean_p * np.log(mean_p)).sum(-1)).mean()
    assert buffer_loss(logits, 0.5).item() == pytest.approx(expected, rel=1e-5)


def test_criteria_are_the_mean_entropy_and_the_max_logit_difference(classifier):
    method = DynaPrompt(copy.deepcopy(classifier), _small())
    method.setup()
    logits = torch.tensor(
        [  # [V=3, P=2, C=2]: view 0 the original
            [[2.0, 0.0], [1.0, 1.0]],
            [[1.0, 0.5], [3.0, 0.0]],
            [[0.0, 0.5], [0.0, 2.0]],
        ]
    )
    entropy, difference = method.criteria(logits)

    def h(a, b):
        q = np.exp([a, b]) / np.exp([a, b]).sum()
        return -(q * np.log(q)).sum()

    np.testing.assert_allclose(
        entropy.numpy(),
        [np.mean([h(2, 0), h(1, 0.5), h(0, 0.5)]), np.mean([h(1, 1), h(3, 0), h(0, 2)])],
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        difference.numpy(), [((2 - 1) + (2 - 0.5)) / 2, ((1 - 3) + (1 - 2)) / 2], rtol=1e-6
    )


def _small(**overrides) -> DynaPromptConfig:
    cfg = DynaPromptConfig(buffer_size=3, views=7, text_head="official")
    return dataclasses.replace(cfg, **overrides)


def _walk(method, feats, n):
    """Run ``n`` samples of ``feats [V, N, D]``; per sample the deltas before and after,
    the prompts it selected (uses grown) and the one recycled before it."""
    out = []
    for i in range(n):
        before = method.delta.detach().clone()
        uses = list(method.buffer.uses)
        recycled = method.buffer.order[0] if 0 not in uses else None
        method._sample(feats[:, i])
        grown = {
            j for j in range(len(uses)) if method.buffer.uses[j] > (uses[j] if j != recycled else 0)
        }
        out.append((before, method.delta.detach().clone(), grown, recycled))
    return out


def test_a_fresh_optimizer_per_sample_moves_only_the_selected_prompts(classifier, test_images):
    method = DynaPrompt(copy.deepcopy(classifier), _small())
    method.setup()
    method.reseed(0)
    feats = method.encode_views(test_images[0][:6])
    lr, wd = method.lr, method.config.weight_decay
    saw_recycling = False
    for i, (before, after, chosen, recycled) in enumerate(_walk(method, feats, 6)):
        if i == 0:  # all prompts equal: the initial prompt 0 alone
            assert chosen == {0}
        if recycled is not None:  # deleted for a fresh initial prompt, which is selected
            saw_recycling = True
            assert recycled in chosen
            before[recycled] = 0
        for j in range(3):
            if j in chosen:
                # one AdamW step from a fresh state: at most lr per element (plus decay)
                step = after[j] - before[j] * (1 - lr * wd)
                assert float(step.abs().max()) <= lr * (1 + 1e-3)
                assert float(step.abs().max()) > 0.5 * lr
            else:  # no gradient and no state: only the weight decay
                torch.testing.assert_close(after[j], before[j] * (1 - lr * wd), rtol=1e-6, atol=0)
    assert saw_recycling  # 6 samples through 3 prompts: the buffer was full


def test_tta_vlm_keeps_the_optimizer_state(classifier, test_images):
    """TTA-VLM never reloads the AdamW state: a prompt selected earlier keeps moving with
    its momentum in a sample that does not select it."""
    method = DynaPrompt(copy.deepcopy(classifier), _small(reset_optimizer=False))
    method.setup()
    method.reseed(0)
    feats = method.encode_views(test_images[0][:6])
    lr, wd = method.lr, method.config.weight_decay
    moved = 0
    for before, after, chosen, recycled in _walk(method, feats, 6):
        for j in range(3):
            if j not in chosen and j != recycled and bool(before[j].ne(0).any()):
                decay_only = before[j] * (1 - lr * wd)
                moved += int(float((after[j] - decay_only).abs().max()) > 1e-3 * lr)
    assert moved > 0


@pytest.mark.parametrize("tta_vlm", [False, True])
def test_runs_through_the_runner(tta_vlm, tmp_path):
    # the defaults (few views), and TTA-VLM's settings on its stream of batch size 1
    head = ["method.text_head=official"] if tta_vlm else []
    record = run_method(tmp_path, "dynaprompt", "method.views=7", *head, tta_vlm=tta_vlm,
                        max_images=16)  # fmt: skip
    cell = record["cells"][0]
    assert 0.0 <= cell["accuracy"] <= 1.0
    # the image tower: 1 + 7 views per sample, forward only (the prompts train the text side)
    assert cell["forward_passes_per_sample"] == pytest.approx(8.0)
    assert cell["backward_passes_per_sample"] == 0.0
    if tta_vlm:  # lr=None: TTA-VLM's rule, 3e-3 off ImageNet
        assert record["method_resolved"]["lr"] == pytest.approx(3e-3)


def test_reset_returns_to_setup_and_seeds_repeat(classifier, test_images):
    x = test_images[0]
    a, b = x[:2], x[2:4]
    fresh = DynaPrompt(copy.deepcopy(classifier), _small())
    fresh.setup()
    fresh.reseed(5)
    expected = fresh.step(a)
    assert torch.isfinite(expected).all() and expected.shape == (2, classifier.num_classes)
    used = DynaPrompt(copy.deepcopy(classifier), _small())
    used.setup()
    for seed in (1, 2):
        used.reseed(seed)
        used.step(b)
    assert bool(used.delta.ne(0).any())
    used.reset()
    assert not bool(used.delta.ne(0).any()) and used.buffer.uses == [0, 0, 0]
    used.reseed(5)
    torch.testing.assert_close(used.step(a), expected, rtol=0, atol=0)
    # before any step the buffer's head is TPT's: the protocol head (text_head=protocol)
    tpt_like = DynaPrompt(copy.deepcopy(classifier), DynaPromptConfig(views=3))
    tpt_like.setup()
    torch.testing.assert_close(
        tpt_like.class_embeddings(), classifier.class_embeddings, rtol=0, atol=1e-6
    )
