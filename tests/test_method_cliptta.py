"""CLIPTTA (mura_plugin/methods/cliptta.py): Otsu's threshold against skimage and a hand
value, the OCE loss, the soft contrastive loss and the regulariser against hand values and
numpy, the class-wise confident memory's insert/evict/draw rules, the ID filter and the
first step's objective on the real tiny ViT against an independent recomputation, reset,
seeds, the closed-set mode and the config checks."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from method_runs import (
    assert_params_at_snapshot,
    assert_reset_then_reseed_reproduces,
    assert_same_seeded_steps,
    build_method,
)

from mura_plugin.methods.cliptta import (
    CLIPTTA,
    ClassMemory,
    CLIPTTAConfig,
    max_log_prob,
    official_template,
    otsu_threshold,
    outlier_contrastive_loss,
    soft_contrastive_loss,
    softmax_mean_entropy,
)


# -- numpy references written from the paper / official formulas ----------------------------
def _np_entropy_rows(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    return -(p * np.log(p)).sum(axis=1)


def _np_soft_contrastive(feats: np.ndarray, text: np.ndarray, scale: float) -> float:
    pred = (feats @ text.T).argmax(axis=1)
    return float(_np_entropy_rows(scale * feats @ text[pred].T).mean())


def _np_mean_entropy(logits: np.ndarray) -> float:
    z = logits - logits.max(axis=1, keepdims=True)
    p = (np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)).mean(axis=0)
    return float(-(p * np.log(p + 1e-6)).sum())


def _np_oce(scores: np.ndarray, alpha: float, gamma: float) -> float:
    w = 1 / (1 + np.exp(-(scores - alpha) / gamma))
    mu_in = (w * scores).sum() / w.sum()
    mu_out = ((1 - w) * scores).sum() / (1 - w).sum()
    return float(-((mu_in - mu_out) ** 2))


def _np_max_log_prob(cos: np.ndarray) -> np.ndarray:
    z = cos - cos.max(axis=1, keepdims=True)
    return (z - np.log(np.exp(z).sum(axis=1, keepdims=True))).max(axis=1)


# -- Otsu ----------------------------------------------------------------------------------
def test_otsu_hand_value_and_constant_scores():
    # two values, two each: every split between the end bins ties, the first one wins:
    # the centre of bin 0 of 256 over [0, 1]
    assert otsu_threshold(np.array([0.0, 0.0, 1.0, 1.0], dtype=np.float32)) == 1 / 512
    assert otsu_threshold(np.array([-1.5, -1.5], dtype=np.float32)) == -1.5  # all equal
    with pytest.raises(ValueError, match="at least one"):
        otsu_threshold(np.array([]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_otsu_matches_skimage(seed):
    filters = pytest.importorskip("skimage.filters")
    rng = np.random.default_rng(seed)
    n = [7, 64, 300][seed]
    scores = np.concatenate([rng.normal(-1.6, 0.05, n), rng.normal(-2.1, 0.1, n // 2)])
    scores = scores.astype(np.float32)
    assert otsu_threshold(scores) == float(filters.threshold_otsu(scores))


# -- the losses ----------------------------------------------------------------------------
def test_oce_loss_known_values_and_gradients():
    scores = torch.tensor([0.0, 0.1, 0.3], dtype=torch.float64, requires_grad=True)
    alpha = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
    w = [1 / (1 + math.exp(-z)) for z in (-1.0, 0.0, 2.0)]  # sigmoid((s - 0.1) / 0.1)
    s = [0.0, 0.1, 0.3]
    mu_in = sum(a * b for a, b in zip(w, s)) / sum(w)
    mu_out = sum((1 - a) * b for a, b in zip(w, s)) / sum(1 - a for a in w)
    p_in = sum(w) / 3
    expected = {
        "avg_contrastive": -((mu_in - mu_out) ** 2),
        "max_inter_var": -p_in * (1 - p_in) * (mu_in - mu_out) ** 2,
        "min_intra_var": -(1 - p_in) * mu_out**2 - p_in * mu_in**2,
    }
    for kind, value in expected.items():
        loss = outlier_contrastive_loss(scores, alpha, 0.1, kind)
        assert float(loss.detach()) == pytest.approx(value, rel=1e-12)
    loss = outlier_contrastive_loss(scores, alpha, 0.1)
    loss.backward()
    assert alpha.grad is not None and float(alpha.grad) != 0.0
    assert scores.grad is not None and bool(torch.all(scores.grad != 0))
    # every weight saturated at 1 (all far above alpha): no OOD side, the term is 0
    saturated = outlier_contrastive_loss(torch.tensor([5.0, 6.0]), torch.tensor(0.0), 0.005)
    assert float(saturated) == 0.0
    with pytest.raises(ValueError, match="unknown ood_loss"):
        outlier_contrastive_loss(scores, alpha, 0.1, "nope")


def test_soft_contrastive_loss_known_value_and_numpy():
    # three images nearest to class 0: the B x B logits of each row are equal, entropy log 3
    text = torch.eye(3)
    feats = torch.nn.functional.normalize(
        torch.tensor([[1.0, 0.1, 0.0], [1.0, 0.0, 0.2], [0.9, 0.3, 0.1]]), dim=-1
    )
    assert float(soft_contrastive_loss(feats, text, 100.0)) == pytest.approx(math.log(3))
    gen = torch.Generator().manual_seed(0)
    feats = torch.nn.functional.normalize(torch.randn(9, 6, generator=gen), dim=-1)
    text = torch.nn.functional.normalize(torch.randn(4, 6, generator=gen), dim=-1)
    expected = _np_soft_contrastive(feats.double().numpy(), text.double().numpy(), 13.0)
    assert float(soft_contrastive_loss(feats, text, 13.0)) == pytest.approx(expected, rel=1e-5)
    assert float(soft_contrastive_loss(feats[:0], text, 13.0)) == 0.0  # nothing kept
    # the regulariser: two uniform rows over 2 classes -> mean (0.5, 0.5)
    uniform = torch.zeros(2, 2)
    assert float(softmax_mean_entropy(uniform)) == pytest.approx(-math.log(0.5 + 1e-6))
    logits = torch.randn(5, 4, generator=gen) * 3
    assert float(softmax_mean_entropy(logits)) == pytest.approx(
        _np_mean_entropy(logits.double().numpy()), rel=1e-5
    )
    cos = torch.randn(5, 4, generator=gen) * 0.3
    np.testing.assert_allclose(
        max_log_prob(cos).numpy(), _np_max_log_prob(cos.double().numpy()), rtol=1e-5
    )


# -- the memory ----------------------------------------------------------------------------
def _ids(images: torch.Tensor) -> list[int]:
    return [int(v) for v in images[:, 0, 0, 0].tolist()]


def _tagged(ids: list[int]) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.float32).view(-1, 1, 1, 1).expand(-1, 3, 2, 2)


def test_memory_insert_evict_and_draw_rules():
    memory = ClassMemory(num_classes=3, num_shots=2, sample_size=4)
    memory.update(_tagged([1, 2, 3]), torch.tensor([0, 0, 2]), torch.tensor([0.5, 0.7, 0.4]))
    assert memory.sizes() == [2, 0, 1]
    assert _ids(memory.images[0]) == [1, 2]  # room left: arrival order
    # class 0 over capacity: the two most confident stay, most confident first; a tie
    # with a stored item keeps the earlier one
    memory.update(_tagged([4, 5]), torch.tensor([0, 0]), torch.tensor([0.9, 0.7]))
    assert _ids(memory.images[0]) == [4, 2]
    assert memory.confidences[0].tolist() == pytest.approx([0.9, 0.7])
    assert _ids(memory.images[2]) == [3]
    # draws: max(1, int(4 / 3)) = 1 per class; class 0 has 2 -> one of them, class 2 its one
    drawn = _ids(memory.sample(torch.Generator().manual_seed(0)))
    assert len(drawn) == 2 and drawn[0] in (4, 2) and drawn[1] == 3
    seen = {_ids(memory.sample(torch.Generator().manual_seed(s)))[0] for s in range(20)}
    assert seen == {4, 2}  # random among the class's entries
    assert ClassMemory(3, 2, 100).sample_size == 6  # capped at num_shots x C, as officially
    assert ClassMemory(3, 2, 4).sample(torch.Generator()) is None  # empty
    state = memory.state()
    memory.clear()
    assert len(memory) == 0
    memory.load_state(state)
    assert memory.sizes() == [2, 0, 1]


def test_official_templates():
    assert official_template(None) == "a photo of a {}"
    assert official_template("cifar10_c") == "a photo of a {}"
    assert official_template("imagenet_c") == "A photo of a {}."
    assert official_template("dtd") == "{} texture."


# -- the method on the tiny model ----------------------------------------------------------
def _frozen(method) -> tuple[torch.Tensor, torch.Tensor]:
    return method.model.class_embeddings.double(), method.model.logit_scale.double()


def test_step_shapes_score_and_filter(classifier, noisy_images):
    method = build_method(CLIPTTA, classifier)
    images = noisy_images
    out = method.step(images)
    assert out.shape == (6, classifier.num_classes) and torch.isfinite(out).all()
    assert method.last_ood_score.shape == (6,) and torch.isfinite(method.last_ood_score).all()
    assert method.last_ood_decision.dtype == torch.bool and method.last_ood_decision.shape == (6,)
    # the batch is predicted and scored by the adapted model
    torch.testing.assert_close(method.predict(images), out)
    torch.testing.assert_close(
        method.last_ood_score, max_log_prob((method.model.encode_image(images)) @ method.head.t())
    )
    assert torch.equal(method.last_ood_decision, method.last_ood_score > method.alpha.detach())
    assert any(not torch.equal(p, s) for p, s in zip(method.params, method._snapshot["params"]))
    assert method.resolved_settings() == {"num_shots": 16, "sample_size": 128}


def test_first_step_objective_filter_and_memory_match_a_recomputation(classifier, noisy_images):
    """One step, memory on: alpha = Otsu of the frozen scores, the memory holds exactly the
    images scored above it (at most 16 per class, none evicted here), and the step's loss
    is beta_tta (TTA(kept) + TTA(memory)) - beta_reg (REG(batch) + REG(memory)) + 0.1 OCE,
    all recomputed in numpy from the frozen model's features."""
    method = build_method(CLIPTTA, classifier, steps=1)
    frozen = copy.deepcopy(classifier)
    with torch.no_grad():
        feats = frozen.encode_image(noisy_images).double()
    text, scale = _frozen(method)
    f, t, s = feats.numpy(), text.numpy(), float(scale)
    cos = f @ t.T
    scores = _np_max_log_prob(cos)
    alpha = otsu_threshold(scores.astype(np.float32))
    keep = scores > alpha
    assert 0 < keep.sum() < len(keep)  # the filter splits this batch
    method.step(noisy_images)
    assert len(method.memory) == int(keep.sum())
    stored = torch.cat([m for m in method.memory.images if len(m)])
    kept_images = noisy_images[torch.from_numpy(keep)]
    assert sorted(stored.sum(dim=(1, 2, 3)).tolist()) == pytest.approx(
        sorted(kept_images.sum(dim=(1, 2, 3)).tolist())
    )
    tta = 2 * _np_soft_contrastive(f[keep], t, s)  # the memory holds the kept images
    reg = _np_mean_entropy(s * cos) + _np_mean_entropy(s * cos[keep])
    expected = tta - reg + 0.1 * _np_oce(scores, alpha, 0.005)
    assert float(method.last_loss) == pytest.approx(expected, abs=1e-5)


def test_a_one_image_batch_keeps_nothing_and_stays_finite(classifier, noisy_images):
    """Otsu's threshold of one score is the score itself: the filter keeps nothing (the
    official mean over no rows would be NaN), the memory stays empty, the step is finite."""
    method = build_method(CLIPTTA, classifier, steps=2)
    out = method.step(noisy_images[:1])
    assert torch.isfinite(out).all() and math.isfinite(float(method.last_loss))
    assert len(method.memory) == 0
    assert all(torch.isfinite(p).all() for p in method.params)


def test_closed_set_mode(classifier, batch):
    method = build_method(CLIPTTA, classifier, open_set=False, steps=1)
    assert method.resolved_settings() == {"num_shots": 4, "sample_size": 40}
    assert not method.alpha.requires_grad and len(method.optimizer.param_groups) == 1
    out = method.step(batch)
    assert out.shape == (4, classifier.num_classes)
    assert method.last_ood_decision is None and method.last_ood_score.shape == (4,)
    assert len(method.memory) == 4  # no filter: every image enters its class
    assert method.alpha.item() == 0.5  # no threshold in the closed set


def test_reset_restores_parameters_threshold_and_memory(classifier, noisy_images):
    def build():
        return build_method(CLIPTTA, classifier, steps=2)

    fresh, used, _ = assert_reset_then_reseed_reproduces(build, noisy_images)
    used.reset()
    assert_params_at_snapshot(used)
    assert used.alpha.item() == 0.5 and len(used.memory) == 0
    assert used.optimizer.param_groups[0]["eps"] == 1e-6  # the official Adam eps
    assert len(used.optimizer.param_groups) == 2  # LayerNorms + the threshold


def test_same_seed_same_output_and_memory_draws_use_the_generator(classifier, noisy_images):
    # 1 shot per class and a draw of 1 per class keep the draws deterministic anyway; with
    # 3 shots and 1 drawn per class (sample_size 10) the draw depends on the seed
    a = build_method(CLIPTTA, classifier, steps=2, num_shots=3, sample_size=10)
    b = build_method(CLIPTTA, classifier, steps=2, num_shots=3, sample_size=10)
    assert_same_seeded_steps(a, b, noisy_images, seed=3, atol=0, loss_atol=0)


def test_bad_config_values_are_refused(classifier):
    with pytest.raises(ValueError, match=r"method\.gamma=0\.0 is out of range"):
        CLIPTTA(classifier, CLIPTTAConfig(gamma=0.0))
    with pytest.raises(ValueError, match=r"unknown method\.ood_loss='nope'"):
        CLIPTTA(classifier, CLIPTTAConfig(ood_loss="nope"))
    with pytest.raises(ValueError, match=r"method\.num_shots=0 is out of range"):
        CLIPTTA(classifier, CLIPTTAConfig(num_shots=0))
