"""OnZeta (mura_plugin/methods/onzeta.py) on the real tiny model: its first updates against a
separate float64 rendering of the official loop, the stream-length schedule, a run
through the real runner (defaults and TTA-VLM settings), reset and seeding."""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch
from method_runs import run_method, seeded_step

from mura_plugin.methods.onzeta import ONZETA_7, OnZeta, official_templates
from tta_bench.run.profiles import method_settings


def _official(xs, text, n, *, tau_t, tau_i, cw, cr, alpha, beta):
    """main_online.py's loop, written separately in numpy float64: ``text [D, C]`` columns,
    ``softmax(.) * exp(rho)`` renormalised, ``F.normalize(w, dim=0)``. Returns per sample
    (combo_label, w, rho) after it."""

    def softmax(z):
        e = np.exp(z - z.max())
        return e / e.sum()

    d, c = text.shape
    w, rho = text.copy(), np.zeros(c)
    out = []
    for i, x in enumerate(xs):
        lr, rlr = cw / math.sqrt(i + 1), cr / math.sqrt(i + 1)
        b = beta * math.sqrt((i + 1) / n)
        tlabel = softmax(x @ text / tau_t) * np.exp(rho)
        tlabel /= tlabel.sum()
        rho = rho - rlr * (tlabel - alpha / c)
        rho[rho < 0] = 0
        vision = softmax(x @ w / tau_i)
        combo = b * vision + (1 - b) * tlabel
        w = w - (lr / tau_i) * np.outer(x, vision - tlabel)
        w = w / np.linalg.norm(w, axis=0, keepdims=True)
        out.append((combo, w.copy(), rho.copy()))
    return out


def _build(classifier, stream_length=None, dataset=None, **overrides):
    model = copy.deepcopy(classifier)
    model.dataset = dataset
    method = OnZeta(model, dataclasses.replace(OnZeta.Config(), **overrides))
    method.stream_length = stream_length
    method.setup()
    return method


def test_first_two_updates_on_hand_made_features(classifier):
    """Three classes in 3-d, a stream of 5: the first two OnZeta steps (predictions, vision
    proxy, dual variable) equal the official loop's. Temperatures are chosen so that the
    dual variable leaves zero and the proxy moves visibly."""
    text = np.array([[1.0, 0.0, 0.0], [0.6, 0.8, 0.0], [0.0, 0.6, 0.8]]).T  # [D, C]
    xs = np.array([[0.8, 0.6, 0.0], [0.0, 0.8, 0.6]])
    hyper = dict(tau_t=0.5, tau_i=0.25, cw=0.5, cr=20.0, alpha=1.0, beta=0.8)
    method = _build(classifier, stream_length=5, scale_tau=False, **hyper)
    method.head = torch.tensor(text.T, dtype=torch.float32)
    method.reset()
    expected = _official(xs, text, 5, **hyper)
    for i, x in enumerate(xs):
        log_pred = method.update_features(torch.tensor(x[None], dtype=torch.float32))[0]
        combo, w, rho = expected[i]
        np.testing.assert_allclose(log_pred.exp().numpy(), combo, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(method.w.numpy(), w.T, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(method.rho.numpy(), rho, rtol=1e-5, atol=1e-5)
    # the dual moved off zero and the proxy off the text: the check can fail
    assert (expected[1][2] > 0).any() and not np.allclose(expected[1][1], text)
    assert method.position == 2


def test_schedule_follows_the_stream_length(classifier):
    method = _build(classifier, stream_length=4)
    cfg = method.config
    for i in range(6):
        lr, rlr, beta = method.schedule(i)
        assert lr == pytest.approx(cfg.cw / math.sqrt(i + 1))
        assert rlr == pytest.approx(cfg.cr / math.sqrt(i + 1))
        assert beta == pytest.approx(cfg.beta * math.sqrt(min(1.0, (i + 1) / 4)))
    assert _build(classifier).schedule(0)[2] == pytest.approx(cfg.beta)  # unknown length


def test_step_on_real_images_equals_the_official_loop(classifier, test_images):
    """The model's features of 3 images and the method's text proxy through the official
    loop (stream of 3, temperatures rescaled to the model's logit scale)."""
    images = test_images[0][:3]
    method = _build(classifier, stream_length=3)
    with torch.no_grad():
        feats = classifier.encode_image(images).double().numpy()
    ratio = 100.0 / float(classifier.logit_scale)
    cfg = method.config
    expected = _official(
        feats, method.head.double().numpy().T, 3, tau_t=cfg.tau_t * ratio,
        tau_i=cfg.tau_i * ratio, cw=cfg.cw, cr=cfg.cr, alpha=cfg.alpha, beta=cfg.beta,
    )  # fmt: skip
    out = method.step(images)
    assert torch.isfinite(out).all()
    for i in range(3):
        np.testing.assert_allclose(out[i].exp().numpy(), expected[i][0], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(method.w.numpy(), expected[-1][1].T, rtol=1e-4, atol=1e-6)


def test_heads_and_tta_vlm_beta_follow_the_dataset(classifier, monkeypatch):
    from mura_plugin.methods import onzeta

    assert official_templates("imagenet_c") == list(ONZETA_7)
    assert official_templates("digits") == ["a photo of a {}."]
    assert not onzeta.fine_grained("digits") and not onzeta.fine_grained(None)
    tta = dict(method_settings("tta_vlm", "onzeta"))
    assert _build(classifier, dataset="digits", **tta).beta == 0.8  # not fine-grained
    monkeypatch.setattr(onzeta, "fine_grained", lambda name: name == "digits")
    assert _build(classifier, dataset="digits", **tta).beta == 0.4
    assert _build(classifier, dataset="imagenet_a", **tta).beta == 0.8
    assert _build(classifier, dataset="digits").beta == 0.8
    assert OnZeta.light and not OnZeta.adapts and OnZeta.stream_kind == "online"


def test_tta_vlm_alpha_is_0_on_caltech101_and_the_updates_follow_it(classifier, test_images):
    """TTA-VLM's online_method/onzeta.py sets alpha 0 on Caltech101 only: under the profile
    the method's alpha is 0 there (and the step is the official loop with alpha 0: the dual
    never leaves zero), 1 on other sets; without the profile 1 everywhere."""
    tta = dict(method_settings("tta_vlm", "onzeta"))
    assert tta["alpha_by_dataset"] == {"caltech101": 0.0}
    for dataset, alpha in [("caltech101", 0.0), ("oxford_flowers", 1.0), ("digits", 1.0)]:
        assert _build(classifier, dataset=dataset, **tta).alpha == alpha, dataset
    assert _build(classifier, dataset="caltech101").alpha == 1.0  # official: 1 everywhere

    images = test_images[0][:3]
    method = _build(classifier, stream_length=3, dataset="caltech101", **tta)
    with torch.no_grad():
        feats = classifier.encode_image(images).double().numpy()
    ratio = 100.0 / float(classifier.logit_scale)
    cfg = method.config
    hyper = dict(tau_t=cfg.tau_t * ratio, tau_i=cfg.tau_i * ratio, cw=cfg.cw, cr=cfg.cr)
    text = method.head.double().numpy().T
    assert method.beta == 0.4  # Caltech101 is a fine-grained set: TTA-VLM's beta there
    expected = _official(feats, text, 3, alpha=0.0, beta=0.4, **hyper)
    with_one = _official(feats, text, 3, alpha=1.0, beta=0.4, **hyper)
    out = method.step(images)
    for i in range(3):
        np.testing.assert_allclose(out[i].exp().numpy(), expected[i][0], rtol=1e-4, atol=1e-6)
    assert not method.rho.any()  # alpha 0: the dual stays at zero
    # with alpha 1 the dual moves on the same images and the last prediction differs
    assert with_one[-1][2].any() and not np.allclose(with_one[-1][0], expected[-1][0])
    assert method.resolved_settings()["alpha"] == 0.0


def test_alpha_by_dataset_refuses_an_unknown_dataset_or_a_negative_alpha():
    with pytest.raises(ValueError, match=r"unknown dataset 'caltech'; available: .*caltech101"):
        OnZeta.Config(alpha_by_dataset={"caltech": 0.0})
    with pytest.raises(ValueError, match=r"alpha_by_dataset\['caltech101'\]=-1.0 is out of range"):
        OnZeta.Config(alpha_by_dataset={"caltech101": -1.0})


def test_reset_returns_to_setup_and_seeding_is_deterministic(classifier, test_images):
    images = test_images[0]
    expected = seeded_step(_build(classifier, stream_length=16), images[:8], 0)
    used = _build(classifier, stream_length=16)
    used.step(images[8:16])
    used.step(images[16:24])
    assert used.position == 16
    used.reset()
    torch.testing.assert_close(seeded_step(used, images[:8], 0), expected, rtol=0, atol=0)
    again = _build(classifier, stream_length=16)
    torch.testing.assert_close(seeded_step(again, images[:8], 0), expected, rtol=0, atol=0)


@pytest.mark.parametrize("tta_vlm", [False, True])
def test_runs_through_the_runner(tmp_path, tta_vlm):
    record = run_method(tmp_path, "onzeta", tta_vlm=tta_vlm)
    if tta_vlm:  # the harness's TTA-VLM option: single prompt, batch 1, tta_vlm values
        applied = record["config"]["profile_applied"]
        assert applied["protocol.batch_size"] == 1
        assert applied["method.beta_fine_grained"] == 0.4
        assert applied["method.alpha_by_dataset"] == {"caltech101": 0.0}
    [cell] = record["cells"]
    assert cell["n"] == 32 and 0.0 <= cell["accuracy"] <= 1.0
    assert math.isfinite(cell["nll"])
    resolved = record["method_resolved"]
    assert resolved["stream_length"] == 32  # the runner told it the stream's length
    assert resolved["beta"] == 0.8  # digits is not a fine-grained set
    assert resolved["alpha"] == 1.0  # nor Caltech101


def test_text_heads(classifier):
    method = _build(classifier)
    torch.testing.assert_close(method.class_embeddings(), classifier.class_embeddings)
    official = _build(classifier, text_head="official")  # outside ImageNet: one prompt
    single = classifier.encode_templates(["a photo of a {}."])
    torch.testing.assert_close(official.class_embeddings(), single, rtol=0, atol=0)
