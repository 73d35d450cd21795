"""DPE (mura_plugin/methods/dpe.py): one sample's queue update, residual step, prediction
and textual prototype update against a reference written out here on hand-made features;
the per-dataset settings; the runner end to end; reset and seeds."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from method_runs import run_method

from mura_plugin.methods.dpe import DPE, SETTINGS


def _build(classifier, **kw) -> DPE:
    method = DPE(classifier, dataclasses.replace(DPE.Config(), **kw))
    method.setup()
    return method


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def _reference(text, entries, feats, scale, lr, through_text, k):
    """The official per-image update (main_dpe.run_test_dpe with steps = 1), written out:
    returns (logits, the queue entry (label, entropy / log2 C), new textual prototypes)."""
    c = text.shape[0]
    alpha, beta, align, eps = 6.0 * scale / 100.0, 5.0, 0.5, 1e-3

    def heads(rt):
        return _unit(text + rt)

    logits = scale * feats @ heads(torch.zeros_like(text)).t()
    if feats.shape[0] == 1:
        chosen = torch.tensor([0])
    else:
        p = logits.softmax(-1)
        chosen = torch.argsort(-(p * p.log()).sum(-1))[:k]
    x = feats[chosen].mean(0)
    p_bar = logits[chosen].softmax(-1).mean(0)
    ent = float(-(p_bar * p_bar.log()).sum())
    label = int(logits[chosen].mean(0).argmax())
    queue = {cls: list(v) for cls, v in entries.items()}
    queue.setdefault(label, []).append(x)
    classes = sorted(queue)
    means = torch.stack([torch.stack(queue[cls]).mean(0) for cls in classes])

    rt = torch.zeros_like(text, requires_grad=True)
    rv = torch.zeros_like(means, requires_grad=True)
    # without entropy_through_text the CLIP logits carry no gradient to the text residual
    w_clip = heads(rt) if through_text else heads(torch.zeros_like(text))
    keys = _unit(means + rv)
    cache = torch.zeros(c)
    cache[classes] = alpha * torch.exp(-beta * (1 - keys @ x))
    final = (scale * feats[chosen] @ w_clip.t()).mean(0) + cache
    entropy = -(final.softmax(-1) * final.log_softmax(-1)).sum()
    sim = keys @ heads(rt)[classes].t() / 0.01
    nce = -torch.diagonal(sim.log_softmax(-1)).mean()
    (entropy + align * nce).backward()
    with torch.no_grad():  # AdamW's first step from zero: -lr * g / (|g| + eps)
        rt1 = -lr * rt.grad / (rt.grad.abs() + eps)
        rv1 = -lr * rv.grad / (rv.grad.abs() + eps)
        keys1 = _unit(means + rv1)
        out = scale * feats[0] @ heads(rt1).t()
        cache = torch.zeros(c)
        cache[classes] = alpha * torch.exp(-beta * (1 - keys1 @ feats[0]))
        out = out + cache
        new_text = text * 0.5 + heads(rt1) * 0.5  # the first update: n = 1
    return out, (label, ent / math.log2(c)), new_text


@pytest.mark.parametrize("views", [1, 4])
@pytest.mark.parametrize("through_text", [True, False])
def test_one_sample_matches_the_written_out_update(classifier, views, through_text):
    g = torch.Generator().manual_seed(0)
    c, d = classifier.class_embeddings.shape
    lr = 0.05  # large enough that a wrong gradient shows in the logits
    dpe = _build(
        classifier,
        lr_text=lr,
        lr_image=lr,
        selection=0.5,
        update_entropy=1.0,  # always update (entropy / log2 C < ln C / log2 C < 1)
        entropy_through_text=through_text,
    )
    text = _unit(torch.randn(c, d, generator=g)) * 0.9  # T is not renormalised
    dpe.text_global = text.clone()
    entries = {2: [_unit(torch.randn(d, generator=g)) for _ in range(2)]}
    entries[5] = [_unit(torch.randn(d, generator=g))]
    dpe.cache.offer(2, entries[2][0], 0.3, dpe._one)
    dpe.cache.offer(2, entries[2][1], 0.1, dpe._one)
    dpe.cache.offer(5, entries[5][0], 0.2, dpe._one)
    feats = _unit(torch.randn(views, d, generator=g) + 2.0 * text[7])
    scale = float(classifier.logit_scale)

    got, loss = dpe.adapt_sample(feats)
    expected, (label, ent), new_text = _reference(
        text, entries, feats, scale, lr, through_text, k=2
    )
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dpe.text_global, new_text, rtol=1e-4, atol=1e-5)
    assert dpe.updates == 1 and loss is not None and torch.isfinite(loss)
    slot = torch.isclose(dpe.cache.entropy[label], torch.tensor(ent), atol=1e-6)
    assert slot.sum() == 1  # the sample entered its pseudo-class's queue
    # the step moved the prediction: a wrong gradient would not pass the check above
    steps0, _, _ = _reference(text, entries, feats, scale, 0.0, through_text, k=2)
    assert (steps0 - expected).abs().max() > 1e-2


def test_no_textual_update_above_the_threshold(classifier, test_images):
    x, _ = test_images
    dpe = _build(classifier, update_entropy=0.0)
    dpe.step(x[:4])
    assert dpe.updates == 0
    torch.testing.assert_close(dpe.class_embeddings(), dpe.head, rtol=0, atol=0)
    assert torch.isfinite(dpe.cache.entropy).sum() == 4


def test_settings_follow_the_dataset(classifier):
    model = copy.copy(classifier)
    model.dataset = "imagenet_a"  # the classes are the digits'; only the rules are checked
    dpe = DPE(model, DPE.Config())
    dpe.setup()
    alpha, beta, lr_text, lr_image, align = SETTINGS["imagenet_a"]
    assert (dpe.alpha, dpe.beta, dpe.lr_text, dpe.lr_image, dpe.align) == (
        6.0,
        5.0,
        3e-4,
        3e-4,
        2.5,
    )
    assert dpe.multi_view and dpe.predict_on_views and dpe.augmix
    digits = _build(classifier, align=0.0)
    assert not digits.multi_view and not digits.predict_on_views
    assert (digits.alpha, digits.align) == (SETTINGS["imagenet"][0], 0.0)


@pytest.mark.parametrize("views", ["official", "multi"])
def test_reset_returns_to_setup_and_seeds_repeat(classifier, test_images, views):
    x, _ = test_images
    kw = {"views": views, "n_views": 3, "augmix": False}
    fresh = _build(classifier, **kw)
    fresh.reseed(7)
    expected = fresh.step(x[:4])
    used = _build(classifier, **kw)
    for seed in (1, 2):
        used.reseed(seed)
        used.step(x[4:8])
    assert torch.isfinite(used.cache.entropy).any()
    used.reset()
    assert not torch.isfinite(used.cache.entropy).any() and used.updates == 0
    used.reseed(7)
    torch.testing.assert_close(used.step(x[:4]), expected, rtol=0, atol=0)
    assert torch.isfinite(expected).all()


def test_runs_through_the_runner_with_its_defaults(tmp_path):
    record = run_method(tmp_path, "dpe")
    [cell] = record["cells"]
    assert cell["n"] == 32 and 0.0 <= cell["accuracy"] <= 1.0
    assert math.isfinite(cell["nll"])
    assert record["method_resolved"]["alpha"] == SETTINGS["imagenet"][0]


def test_runs_through_the_runner_with_tta_vlm_settings(tmp_path):
    # TTA-VLM's settings on its stream of batch size 1 (digits: no AugMix, not a
    # fine-grained set); fewer views than its 63 for time
    record = run_method(tmp_path, "dpe", "method.n_views=3", tta_vlm=True, max_images=16)
    assert record["config"]["profile_applied"]["method.augmix"] is False
    [cell] = record["cells"]
    assert cell["n"] == 16 and 0.0 <= cell["accuracy"] <= 1.0
    assert math.isfinite(cell["nll"])
    assert record["method_resolved"]["multi_view"] is True
