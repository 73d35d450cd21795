"""DMN-ZS (mura_plugin/methods/dmn.py): the memory read-out and fusion against a separate
numpy reference on hand-made features, the write rule by hand, one step against a
reference loop on the real model, the runner end to end, reset and seeds, and the
descriptions head (_dmn_dpe_prompts.py)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from method_runs import run_method

from mura_plugin.methods.dmn import (
    DMN,
    DynamicMemory,
    confident_label,
    fuse,
    memory_readout,
)
from tta_bench.run.profiles import method_settings


def _np_readout(mem, counts, text, q, beta, scale):
    """p_mem of the official ``get_image_pred`` (similarity_weighted), written in numpy."""
    logits = []
    for c in range(text.shape[0]):
        slots = [m / np.linalg.norm(m) for m in mem[c, : counts[c]]]
        slots.append(text[c] / np.linalg.norm(text[c]))
        slots = np.stack(slots)
        w = np.exp(-beta * (1.0 - slots @ q))
        proto = (w[:, None] * slots).sum(0)
        proto = proto / np.linalg.norm(proto)
        logits.append(scale * proto @ q)
    logits = np.array(logits)
    e = np.exp(logits - logits.max())
    return e / e.sum()


def test_readout_and_fusion_match_a_numpy_reference():
    rng = np.random.default_rng(0)
    c, m, d = 3, 3, 5
    mem = rng.normal(size=(c, m, d))
    counts = [2, 0, 3]  # class 1 empty: its text feature alone
    text = rng.normal(size=(c, d))
    text /= np.linalg.norm(text, axis=1, keepdims=True)
    q = rng.normal(size=d)
    q /= np.linalg.norm(q)
    beta, scale, w = 5.5, 20.0, 0.7
    expected_mem = _np_readout(mem, counts, text, q, beta, scale)
    logits = scale * text @ q
    p_zs = np.exp(logits - logits.max())
    p_zs /= p_zs.sum()
    expected = np.log((p_zs + w * expected_mem) / (1 + w))

    # the stale feature in class 0's third slot (unfilled) must not count
    feats = torch.tensor(mem, dtype=torch.float32)
    filled = torch.arange(m)[None, :] < torch.tensor(counts)[:, None]
    p_mem = memory_readout(
        feats, filled, torch.tensor(text).float(), torch.tensor(q).float(), beta, scale
    )
    np.testing.assert_allclose(p_mem.numpy(), expected_mem, rtol=1e-5, atol=1e-6)
    got = fuse(torch.tensor(p_zs).float(), p_mem, w)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-6)
    assert abs(float(got.exp().sum()) - 1.0) < 1e-5  # a log-probability


def test_write_rule_fills_then_replaces_the_highest_entropy_slot():
    mem = DynamicMemory(classes=2, size=3, dim=2, device="cpu")
    for i, ent in enumerate([0.5, 0.9, 0.9]):
        mem.write(1, torch.tensor([float(i), 1.0]), ent)
    assert mem.count == [0, 3]
    mem.write(1, torch.tensor([7.0, 7.0]), 0.95)  # not lower than the top: dropped
    assert mem.entropy[1].tolist() == pytest.approx([0.5, 0.9, 0.9])
    mem.write(1, torch.tensor([8.0, 8.0]), 0.2)  # replaces the last of the tied 0.9 slots
    assert mem.entropy[1].tolist() == pytest.approx([0.5, 0.9, 0.2])
    assert mem.features[1, 2].tolist() == [8.0, 8.0]
    mem.write(1, torch.tensor([9.0, 9.0]), 3.0, replace="always")  # TTA-VLM's rule
    assert mem.entropy[1].tolist() == pytest.approx([0.5, 3.0, 0.2])
    assert mem.filled().tolist() == [[False] * 3, [True] * 3]


def test_confident_label_by_hand():
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 4.0, 0.0], [0.0, 0.0, 1.0], [3.0, 0.0, 2.9]])
    probs = logits.softmax(-1).numpy()
    ent = -(probs * np.log(probs + 1e-6)).sum(1)
    chosen = np.argsort(ent)[:2]
    p_bar = probs[chosen].mean(0)
    label, h = confident_label(logits, 2, "prob")
    assert label == int(p_bar.argmax())
    assert h == pytest.approx(float(-(p_bar * np.log(p_bar + 1e-8)).sum()), rel=1e-5)
    mean_logits = logits.numpy()[chosen].mean(0)
    p = np.exp(mean_logits) / np.exp(mean_logits).sum()
    label, h = confident_label(logits, 2, "logit")
    assert label == int(mean_logits.argmax())
    assert h == pytest.approx(float(-(p * np.log(p + 1e-5)).sum()), rel=1e-5)


def _build(classifier, **kw) -> DMN:
    method = DMN(classifier, dataclasses.replace(DMN.Config(), **kw))
    method.setup()
    return method


def _batch(test_images, n=6):
    x, _ = test_images
    return x[:n]


def test_step_equals_a_reference_loop(classifier, test_images):
    """One step of 6 images (3 views each) against the official loop written out here:
    confident views -> write -> numpy read-out -> fusion, in stream order."""
    from mura_plugin.augment import make_views

    images = _batch(test_images)
    dmn = _build(classifier, n_views=2, memory_size=2, selection=0.5)
    dmn.reseed(3)
    got = dmn.step(images)

    views = make_views(images, 2, torch.Generator().manual_seed(3), scale=(0.5, 1.0))
    with torch.no_grad():
        f = classifier.encode_image(views.flatten(0, 1)).view(3, len(images), -1)
    f = (f / f.norm(dim=-1, keepdim=True)).double().numpy()
    text = classifier.class_embeddings.double().numpy()
    scale = float(classifier.logit_scale)
    c, d = text.shape
    mem, ents, counts = np.zeros((c, 2, d)), np.zeros((c, 2)), [0] * c
    for i in range(len(images)):
        logits = scale * f[:, i] @ text.T
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        chosen = np.argsort(-(p * np.log(p + 1e-6)).sum(1))[:1]
        p_bar = p[chosen].mean(0)
        label, h = int(p_bar.argmax()), -(p_bar * np.log(p_bar + 1e-8)).sum()
        if counts[label] < 2:
            mem[label, counts[label]], ents[label, counts[label]] = f[0, i], h
            counts[label] += 1
        elif h < ents[label].max():
            slot = int(np.flatnonzero(ents[label] == ents[label].max())[-1])
            mem[label, slot], ents[label, slot] = f[0, i], h
        p_mem = _np_readout(mem, counts, text, f[0, i], 5.5, scale)
        expected = np.log((p[0] + p_mem) / 2.0)
        np.testing.assert_allclose(got[i].numpy(), expected, rtol=1e-4, atol=1e-4)
    assert dmn.memory.count == counts


def test_reset_returns_to_setup_and_seeds_repeat(classifier, test_images):
    images = _batch(test_images, 8)
    fresh = _build(classifier, n_views=3)
    fresh.reseed(7)
    expected = fresh.step(images[:4])
    used = _build(classifier, n_views=3)
    for seed in (1, 2):
        used.reseed(seed)
        used.step(images[4:])
    assert sum(used.memory.count) > 0
    used.reset()
    assert sum(used.memory.count) == 0 and not used.memory.features.any()
    used.reseed(7)
    torch.testing.assert_close(used.step(images[:4]), expected, rtol=0, atol=0)
    again = _build(classifier, n_views=3)
    again.reseed(7)
    torch.testing.assert_close(again.step(images[:4]), expected, rtol=0, atol=0)
    assert torch.isfinite(expected).all()


#: The fusion weight each of DMN's zero-shot runs chose on the test labels, as its
#: ViT-B/16 camera-ready logs print them (camera_ready_dmn_tf_searched_vit_0.txt, the
#: ``n_shot 0`` block; camera_ready_dmn_tf_shift_0.txt): its ``set_id``, the registered
#: dataset that is that set, the weight.
OFFICIAL_FUSION = [
    ("I", "imagenet", 1.0),
    ("Flower102", "oxford_flowers", 10.0),
    ("DTD", "dtd", 10.0),
    ("Pets", "oxford_pets", 1.0),
    ("Cars", "stanford_cars", 0.3),
    ("UCF101", "ucf101", 0.3),
    ("Caltech101", "caltech101", 0.3),
    ("Food101", "food101", 0.3),
    ("SUN397", "sun397", 3.0),
    ("Aircraft", "fgvc_aircraft", 1.0),
    ("eurosat", "eurosat", 0.3),
    ("A", "imagenet_a", 3.0),
    ("V", "imagenet_v2", 1.0),
    ("R", "imagenet_r", 0.3),
    ("K", "imagenet_sketch", 1.0),
]


@pytest.mark.parametrize(("set_id", "dataset", "weight"), OFFICIAL_FUSION)
def test_fusion_weight_none_takes_the_searched_value_of_every_official_set(
    classifier, set_id, dataset, weight
):
    from tta_bench.registry import registry

    assert dataset in registry("datasets").names(), (set_id, dataset)
    model = copy.copy(classifier)
    model.dataset = dataset  # the classes are the digits'; only the rule is checked
    method = DMN(model, dataclasses.replace(DMN.Config(), fusion_weight=None))
    method.setup()
    assert method.fusion_weight == weight, set_id
    assert method.resolved_settings()["fusion_weight"] == weight


def test_the_searched_table_is_the_official_one_and_other_sets_fuse_with_1(classifier):
    from mura_plugin.methods.dmn import SEARCHED_FUSION

    assert {dataset: weight for _, dataset, weight in OFFICIAL_FUSION} == SEARCHED_FUSION
    model = copy.copy(classifier)
    model.dataset = "digits"  # not in DMN's logs
    method = DMN(model, dataclasses.replace(DMN.Config(), fusion_weight=None))
    method.setup()
    assert method.resolved_settings() == {"fusion_weight": 1.0, "augmix": False}
    assert _build(classifier).fusion_weight == 1.0  # the fixed default


def test_descriptions_head_is_the_mean_over_templates_and_descriptions(classifier, tmp_path):
    from tta_bench.text_head import encode_text_cut

    names = classifier.classnames
    descriptions = {n: [f"a handwritten digit {n}.", f"the blurry number {n}."] for n in names}
    file = tmp_path / "prompts.json"
    file.write_text(json.dumps(descriptions))
    dmn = _build(classifier, prompts=str(file))
    rows = []
    for n in names:
        texts = [t.format(n) for t in classifier.templates] + descriptions[n]
        with torch.no_grad():
            feats = encode_text_cut(classifier.clip, classifier.tokenizer(texts)).float()
        feats = feats / feats.norm(dim=-1, keepdim=True)
        mean = feats.mean(0)
        rows.append(mean / mean.norm())
    torch.testing.assert_close(dmn.class_embeddings(), torch.stack(rows), rtol=0, atol=1e-5)
    assert not torch.allclose(dmn.class_embeddings(), classifier.class_embeddings, atol=1e-3)
    missing = tmp_path / "missing.json"
    missing.write_text(json.dumps({names[0]: ["x"]}))
    with pytest.raises(ValueError, match="no descriptions"):
        _build(classifier, prompts=str(missing))


def test_runs_through_the_runner_with_its_defaults(tmp_path):
    record = run_method(tmp_path, "dmn")
    [cell] = record["cells"]
    assert cell["n"] == 32 and 0.0 <= cell["accuracy"] <= 1.0
    assert math.isfinite(cell["nll"])


def test_runs_through_the_runner_with_tta_vlm_settings(tmp_path):
    # TTA-VLM's settings on its stream of batch size 1; fewer views than its 63 for time
    config = dataclasses.replace(DMN.Config(), **method_settings("tta_vlm", "dmn"))
    assert (config.n_views, config.replace, config.confident_mean) == (63, "always", "logit")
    record = run_method(tmp_path, "dmn", "method.n_views=3", tta_vlm=True, max_images=16)
    assert record["config"]["profile_applied"]["protocol.batch_size"] == 1
    [cell] = record["cells"]
    assert cell["n"] == 16 and 0.0 <= cell["accuracy"] <= 1.0
    assert math.isfinite(cell["nll"])
