"""CLIPArTT, WATT and BATCLIP on the real tiny model: known values of their core rules from
the papers' equations (pseudo-label prompts, transductive targets, weight averaging, the
three BATCLIP terms), their official defaults, behaviour, and clear errors."""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings

import pytest
import torch
from torch import nn

from mura_plugin.methods._clip_text import (
    clipartt_loss,
    clipartt_targets,
    encode_text,
    prompt_features,
)
from mura_plugin.methods.batclip import (
    BATCLIP,
    BATCLIP_TEMPLATE,
    class_prototypes,
    inter_class_separation,
    prototype_text_alignment,
)
from mura_plugin.methods.clipartt import (
    CLIPARTT_TEMPLATE,
    CLIPArTT,
    pseudo_label_prompt,
)
from mura_plugin.methods.watt import WATT, WATT_TEMPLATES, weight_average
from tta_bench.model import ZeroShotClassifier


@pytest.fixture(autouse=True)
def _quiet_tokenizer():
    # the tiny model warns that "or" (CLIPArTT's prompts) and WATT's template words are
    # outside its trained vocabulary: expected here
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="tiny-clip-digits was pretrained")
        yield


def _build(cls, classifier, **overrides):
    torch.manual_seed(0)
    method = cls(copy.deepcopy(classifier), dataclasses.replace(cls.Config(), **overrides))
    method.setup()
    return method


@pytest.fixture(scope="module")
def batch(test_images):
    images, _ = test_images
    noise = torch.randn(16, *images.shape[1:], generator=torch.Generator().manual_seed(0))
    return (images[:16] + 0.3 * noise).clamp(0, 1)


def _norm_state(method):
    return [p.detach().clone() for p in method.params]


# -- CLIPArTT --------------------------------------------------------------------------
def test_pseudo_label_prompt_is_the_official_string():
    # official getprompt: "a photo of a " + c1, then " or " + c_k for k = 2..K
    assert pseudo_label_prompt(["cat", "dog", "ship"]) == "a photo of a cat or dog or ship"
    assert pseudo_label_prompt(["cat"]) == "a photo of a cat"
    assert (
        pseudo_label_prompt(["one", "seven"], "a handwritten {}.") == "a handwritten one or seven."
    )
    assert CLIPARTT_TEMPLATE == "a photo of a {}"


def test_clipartt_targets_known_values():
    """Q = softmax(((I I^T + T T^T) / 2) / tau) row-wise, on a toy batch of 3."""
    i = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    t = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    tau = 0.5
    ii = [[sum(a * b for a, b in zip(r, c)) for c in i.tolist()] for r in i.tolist()]
    tt = [[sum(a * b for a, b in zip(r, c)) for c in t.tolist()] for r in t.tolist()]
    expected = []
    for a in range(3):
        e = [math.exp(((ii[a][b] + tt[a][b]) / 2) / tau) for b in range(3)]
        expected.append([v / sum(e) for v in e])
    got = clipartt_targets(i, t, tau)
    torch.testing.assert_close(got, torch.tensor(expected), rtol=0, atol=1e-6)
    # e.g. row 0: S = [1, 0.5, 0.3] -> exp(S / 0.5) normalised
    s0 = [1.0, 0.5, 0.3]
    row0 = [math.exp(v / tau) / sum(math.exp(w / tau) for w in s0) for v in s0]
    torch.testing.assert_close(got[0], torch.tensor(row0), rtol=0, atol=1e-6)


def test_clipartt_loss_known_values():
    """loss_i = -sum_j Q[j, i] log softmax_j(s I_i . T_j) (the official cross-entropy of the
    transposed logits against the transposed targets)."""
    i = torch.tensor([[1.0, 0.0], [0.6, 0.8]])
    t = torch.tensor([[0.8, 0.6], [0.0, 1.0]])
    s, tau = 2.0, 0.25
    q = clipartt_targets(i, t, tau).tolist()
    dots = [[sum(a * b for a, b in zip(r, c)) for c in t.tolist()] for r in i.tolist()]
    expected = []
    for a in range(2):
        z = sum(math.exp(s * dots[a][k]) for k in range(2))
        expected.append(-sum(q[j][a] * math.log(math.exp(s * dots[a][j]) / z) for j in range(2)))
    got = clipartt_loss(i, t, s, tau)
    torch.testing.assert_close(got, torch.tensor(expected), rtol=0, atol=1e-6)


def test_clipartt_gradient_flows_through_the_targets_too():
    """The official code does not detach the image-image similarities of the targets (a
    soft temperature, where the targets are far from one-hot, shows it)."""
    i = torch.nn.functional.normalize(torch.randn(4, 3, generator=torch.Generator().manual_seed(1)))
    t = torch.nn.functional.normalize(torch.randn(4, 3, generator=torch.Generator().manual_seed(2)))
    full = i.clone().requires_grad_(True)
    clipartt_loss(full, t, 10.0, 1.0).mean().backward()
    partial = i.clone().requires_grad_(True)
    q = clipartt_targets(partial.detach(), t, 1.0)
    logp = (10.0 * partial @ t.t()).log_softmax(dim=-1)
    (-(q.t() * logp).sum(dim=-1)).mean().backward()
    assert not torch.allclose(full.grad, partial.grad)


def test_clipartt_pseudo_label_features_follow_the_top_k_order(classifier):
    method = _build(CLIPArTT, classifier)
    top = torch.tensor([[2, 0, 1], [5, 3, 9], [2, 0, 1], [0, 2, 1]])
    got = method.pseudo_label_features(top)
    names = [
        "two or zero or one",
        "five or three or nine",
        "two or zero or one",
        "zero or two or one",
    ]
    with torch.no_grad():
        expected = prompt_features(method.model, names, classifier.templates)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert not torch.allclose(got[0], got[3])  # the order of the classes is part of the prompt


def test_clipartt_heads(classifier):
    protocol = _build(CLIPArTT, classifier)
    assert protocol.templates == classifier.templates
    torch.testing.assert_close(protocol.head, classifier.class_embeddings)
    official = _build(CLIPArTT, classifier, text_head="official")
    assert official.templates == ["a photo of a {}"]
    torch.testing.assert_close(official.head, classifier.encode_templates(["a photo of a {}"]))


def test_clipartt_official_defaults():
    cfg = CLIPArTT.Config()
    assert (cfg.top_k, cfg.temperature, cfg.steps) == (3, 0.01, 10)
    assert (cfg.optimizer, cfg.lr, cfg.weight_decay) == ("adam", 1e-3, 0.0)
    assert (cfg.text_head, cfg.episodic, cfg.precision) == ("protocol", "batch", "fp16")
    assert not hasattr(cfg, "loss")  # no registered loss: the objective is fixed


def test_clipartt_resets_every_batch_unless_online(classifier, batch):
    x, other = batch[:8], batch[8:]
    episodic = _build(CLIPArTT, classifier, steps=2)
    first = episodic.step(x)
    episodic.step(other)
    torch.testing.assert_close(episodic.step(x), first, rtol=0, atol=1e-6)

    online = _build(CLIPArTT, classifier, steps=2, episodic="online")
    first = online.step(x)
    online.step(other)
    assert not torch.allclose(online.step(x), first, atol=1e-4)


def test_clipartt_adapts_and_predicts_after_the_update(classifier, batch):
    method = _build(CLIPArTT, classifier, steps=3)
    before = _norm_state(method)
    logits = method.step(batch)
    assert any(not torch.equal(a, b) for a, b in zip(before, method.params))
    with torch.no_grad():
        feats = method.model.encode_image(batch)
        expected = method.model.logits_from_features(feats, method.head)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    assert torch.isfinite(method.last_loss)


# -- WATT ------------------------------------------------------------------------------
def test_weight_average_known_values():
    snapshots = [
        [torch.tensor([1.0, 2.0]), torch.tensor([[0.0]])],
        [torch.tensor([3.0, 6.0]), torch.tensor([[3.0]])],
        [torch.tensor([5.0, 1.0]), torch.tensor([[-6.0]])],
    ]
    got = weight_average(snapshots)
    torch.testing.assert_close(got[0], torch.tensor([3.0, 3.0]))
    torch.testing.assert_close(got[1], torch.tensor([[-1.0]]))
    with pytest.raises(ValueError):
        weight_average([])


def test_watt_official_defaults():
    cfg = WATT.Config()
    assert (cfg.mode, cfg.iterations, cfg.meta_iterations) == ("sequential", 2, None)
    assert (cfg.optimizer, cfg.lr, cfg.temperature, cfg.text_head) == (
        "adam",
        1e-3,
        0.01,
        "protocol",
    )
    # the official templates.yaml, one per line
    official = """a photo of a {}
        itap of a {}
        a bad photo of the {}.
        a origami {}.
        a photo of the large {}.
        a {} in a video game.
        art of the {}.
        a photo of the small {}."""
    assert tuple(line.strip() for line in official.splitlines()) == WATT_TEMPLATES


def test_watt_meta_iterations_default_per_mode(classifier):
    assert _build(WATT, classifier).meta_iterations == 5
    assert _build(WATT, classifier, mode="parallel").meta_iterations == 50
    assert _build(WATT, classifier, mode="parallel", meta_iterations=3).meta_iterations == 3


def test_watt_heads(classifier):
    protocol = _build(WATT, classifier)
    assert protocol.templates == classifier.templates
    torch.testing.assert_close(protocol.head, classifier.class_embeddings)
    official = _build(WATT, classifier, text_head="official")
    assert official.templates == list(WATT_TEMPLATES)
    assert official.template_heads.shape[:2] == (8, classifier.num_classes)
    torch.testing.assert_close(official.head, classifier.encode_templates(list(WATT_TEMPLATES)))


def test_watt_parallel_is_the_average_of_independent_per_template_adaptations(
    default_bundle, classifier, batch
):
    """WATT-P, one round: each template adapts from the source weights with a fresh
    optimiser; the result is the mean of the per-template weights."""
    x = batch[:8]
    watt = _build(WATT, classifier, mode="parallel", meta_iterations=1)
    watt.step(x)
    per_template = []
    for template in classifier.templates:
        single = ZeroShotClassifier(default_bundle, classifier.classnames, [template])
        alone = _build(WATT, single, mode="parallel", meta_iterations=1)
        alone.step(x)
        per_template.append(_norm_state(alone))
    for got, expected in zip(watt.params, weight_average(per_template)):
        torch.testing.assert_close(got.detach(), expected, rtol=0, atol=1e-6)


def test_watt_sequential_chains_templates_and_takes_the_official_number_of_steps(classifier, batch):
    x = batch[:8]
    sequential = _build(WATT, classifier, meta_iterations=1)
    sequential.step(x)
    parallel = _build(WATT, classifier, mode="parallel", meta_iterations=1)
    parallel.step(x)
    assert any(not torch.allclose(a, b) for a, b in zip(sequential.params, parallel.params))
    # one optimiser for the whole batch in sequential mode: M x T x L Adam steps
    two_rounds = _build(WATT, classifier, meta_iterations=2)
    two_rounds.step(x)
    steps = {int(s["step"]) for s in two_rounds.optimizer.state.values()}
    assert steps == {2 * len(classifier.templates) * 2}


def test_watt_restarts_from_the_source_every_batch(classifier, batch):
    x, other = batch[:8], batch[8:]
    method = _build(WATT, classifier, meta_iterations=1)
    first = method.step(x)
    method.step(other)
    torch.testing.assert_close(method.step(x), first, rtol=0, atol=1e-6)


# -- BATCLIP ---------------------------------------------------------------------------
def test_batclip_terms_known_values():
    f = torch.tensor([[2.0, 0.0], [4.0, 0.0], [0.0, 3.0], [1.0, 1.0]])  # unnormalised
    labels = torch.tensor([0, 0, 1, 2])
    text = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    classes, protos = class_prototypes(f, labels)
    assert classes.tolist() == [0, 1, 2]
    torch.testing.assert_close(protos, torch.tensor([[3.0, 0.0], [0.0, 3.0], [1.0, 1.0]]))
    # mean_u mu_u . t_u = (3 + 3 + (0.6 + 0.8)) / 3
    torch.testing.assert_close(
        prototype_text_alignment(f, text, labels), torch.tensor(7.4 / 3), rtol=0, atol=1e-6
    )
    # sum over ordered pairs u != v of 1 - cos: cos(0,1) = 0, cos(0,2) = cos(1,2) = 1/sqrt(2)
    expected = 2 * (1.0 + 2 * (1 - 1 / math.sqrt(2)))
    torch.testing.assert_close(
        inter_class_separation(f, labels), torch.tensor(expected), rtol=0, atol=1e-6
    )
    # only the classes that are predicted count; one class: no separation term
    torch.testing.assert_close(
        prototype_text_alignment(f[:2], text, torch.tensor([2, 2])), torch.tensor(3.0 * 0.6)
    )
    assert float(inter_class_separation(f[:2], torch.tensor([2, 2]))) == 0.0


def test_batclip_loss_is_entropy_minus_the_two_terms(classifier, batch):
    method = _build(BATCLIP, classifier)
    with torch.no_grad():
        loss, logits = method.compute_loss(batch)
        raw = method.model.clip.encode_image(method.model.normalize(batch))
        text = method.class_text_features()
    labels = logits.argmax(dim=-1)
    p = logits.softmax(dim=-1)
    entropy = -(p * p.log()).sum(dim=-1).mean()
    expected = (
        entropy - prototype_text_alignment(raw, text, labels) - inter_class_separation(raw, labels)
    )
    torch.testing.assert_close(loss.mean(), expected, rtol=0, atol=1e-5)
    assert loss.shape == (len(batch),)


def test_batclip_text_features_start_at_the_head(classifier):
    protocol = _build(BATCLIP, classifier)
    with torch.no_grad():
        torch.testing.assert_close(
            protocol.class_text_features(), classifier.class_embeddings, rtol=0, atol=1e-6
        )
    official = _build(BATCLIP, classifier, text_head="official")
    with torch.no_grad():
        torch.testing.assert_close(
            official.class_text_features(),
            classifier.encode_templates([BATCLIP_TEMPLATE]),
            rtol=0,
            atol=1e-6,
        )


def test_batclip_adapts_both_towers_online_and_predicts_from_its_forward(classifier, batch):
    x = batch[:8]
    method = _build(BATCLIP, classifier)
    clip = method.model.clip
    visual = {id(p) for p in clip.visual.parameters()}
    declared = {id(p) for p in method.params}
    assert any(i in visual for i in declared) and any(i not in visual for i in declared)
    norms = {id(p) for m in clip.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    assert declared == norms
    before = _norm_state(method)
    with torch.no_grad():
        expected = method.compute_loss(x)[1]
    first = method.step(x)
    torch.testing.assert_close(first, expected, rtol=0, atol=1e-5)  # pre-update logits
    changed = [not torch.equal(a, p) for a, p in zip(before, method.params)]
    in_visual = [id(p) in visual for p in method.params]
    assert any(c and v for c, v in zip(changed, in_visual))
    assert any(c and not v for c, v in zip(changed, in_visual))
    assert not torch.allclose(method.step(x), first, atol=1e-4)  # no reset of its own


def test_batclip_two_pass_text_gradient_equals_one_pass(classifier, batch):
    """adapt() pushes the class features' gradient through the text tower chunk by chunk;
    the gradients equal those of one differentiable pass (here 3 classes per chunk)."""
    x = batch[:8]
    small = copy.deepcopy(classifier)
    small.text_chunk_size = 3 * len(classifier.templates)
    method = _build(BATCLIP, small)
    assert len(method._class_chunks()) == 4
    method.optimizer.zero_grad(set_to_none=True)
    method.compute_loss(x)[0].mean().backward()
    one_pass = [p.grad.clone() for p in method.params]

    method.optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        text = method.class_text_features()
    text.requires_grad_(True)
    method.batch_loss(x, text)[0].mean().backward()
    method._text_backward(text.grad)
    for a, b in zip(one_pass, method.params):
        torch.testing.assert_close(b.grad, a, rtol=1e-4, atol=1e-6)
    assert any(float(g.abs().sum()) > 0 for g in one_pass)


def test_chunked_prompt_features_equal_one_forward(classifier):
    small = copy.deepcopy(classifier)
    small.text_chunk_size = 5  # one class (4 templates) per text forward
    with torch.no_grad():
        chunked = prompt_features(small, classifier.classnames, classifier.templates)
    torch.testing.assert_close(chunked, classifier.class_embeddings, rtol=0, atol=1e-6)


def test_batclip_official_defaults():
    cfg = BATCLIP.Config()
    assert (cfg.loss, cfg.optimizer, cfg.lr, cfg.weight_decay, cfg.steps) == (
        "entropy",
        "adamw",
        1e-3,
        0.01,
        1,
    )
    assert (cfg.i2t_weight, cfg.inter_weight, cfg.precision) == (1.0, 1.0, "fp16")
    assert BATCLIP_TEMPLATE == "a photo of a {}."


# -- shared text side ------------------------------------------------------------------
def test_encode_text_equals_open_clip_encode_text(classifier):
    prompts = ["a photo of the digit seven.", "a handwritten one or two or three.", "the number"]
    tokens = classifier.tokenizer(prompts)
    with torch.no_grad():
        torch.testing.assert_close(
            encode_text(classifier.clip, tokens),
            classifier.clip.encode_text(tokens),
            rtol=0,
            atol=1e-5,
        )


def test_prompt_features_reproduce_the_protocol_head(classifier):
    with torch.no_grad():
        got = prompt_features(classifier, classifier.classnames, classifier.templates)
    torch.testing.assert_close(got, classifier.class_embeddings, rtol=0, atol=1e-6)


# -- errors ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cls, overrides, match",
    [
        (CLIPArTT, {"text_head": "mine"}, "protocol, official"),
        (CLIPArTT, {"episodic": "sample"}, "batch, online"),
        (CLIPArTT, {"top_k": 0}, "top_k"),
        (CLIPArTT, {"top_k": 11}, "1..10"),
        (CLIPArTT, {"precision": "fp8"}, "fp32, fp16, bf16"),
        (WATT, {"mode": "both"}, "parallel, sequential"),
        (WATT, {"text_head": "ensemble"}, "protocol, official"),
        (WATT, {"meta_iterations": 0}, "meta_iterations"),
        (BATCLIP, {"text_head": "cupl"}, "protocol, official"),
        (BATCLIP, {"optimizer": "lion"}, "adam, adamw, sgd"),
    ],
)
def test_bad_config_values_are_named(classifier, cls, overrides, match):
    with pytest.raises(ValueError, match=match):
        _build(cls, classifier, **overrides)


@pytest.fixture(scope="module")
def resnet_classifier(default_bundle, digits_stream):
    """A real open_clip CLIP with a (small, randomly initialised) ResNet image tower: it
    normalises with BatchNorm, not LayerNorm."""
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

    torch.manual_seed(0)
    clip = CLIP(
        embed_dim=32,
        vision_cfg=CLIPVisionCfg(layers=(1, 1, 1, 1), width=16, image_size=32, head_width=16),
        text_cfg=CLIPTextCfg(context_length=16, vocab_size=49408, width=32, heads=2, layers=1),
    )
    bundle = dataclasses.replace(default_bundle, clip=clip, name="rn-tiny")
    return ZeroShotClassifier(bundle, digits_stream.classnames, digits_stream.templates)


@pytest.mark.parametrize("cls", [CLIPArTT, WATT, BATCLIP])
def test_an_image_tower_without_layer_norm_is_refused(resnet_classifier, cls):
    with pytest.raises(ValueError, match="no LayerNorm"):
        _build(cls, resnet_classifier)


def test_batclip_needs_text_layer_norms(classifier):
    stripped = copy.deepcopy(classifier)
    clip = stripped.clip
    for block in clip.transformer.resblocks:
        block.ln_1, block.ln_2 = nn.Identity(), nn.Identity()
    clip.ln_final = nn.Identity()
    with pytest.raises(ValueError, match="text tower's LayerNorm"):
        _build(BATCLIP, stripped)


def test_encode_text_needs_a_text_tower():
    with pytest.raises(ValueError, match="no text tower"):
        encode_text(nn.Linear(2, 2), torch.zeros(1, 4, dtype=torch.long))
