"""RMT (mura_plugin/methods/rmt.py): the symmetric cross-entropy, the class prototypes and
the prototype contrastive loss against references written here from the paper's and
SupCon's equations; one step on the real tiny model against the official loss assembled
here; the warm-up's learning-rate ramp and teacher; reset (to the state after the warm-up,
source order included), seeds and the defaults of the reference cfg."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from method_runs import assert_reset_then_reseed_reproduces, build_with_source, seeded_step

from mura_plugin.methods.cotta import cotta_augment
from mura_plugin.methods.rmt import (
    RMT,
    RMTConfig,
    class_prototypes,
    make_projector,
    nearest_prototype,
    prototype_contrastive_loss,
    symmetric_cross_entropy,
)

#: Two source digits per class (the first 20 training digits are 0..9 twice).
N_SOURCE = 20


@pytest.fixture(scope="module")
def source():
    from mura_plugin.datasets.digits import digits_arrays

    x, y = digits_arrays("train")
    images = torch.from_numpy(x[:N_SOURCE]).permute(0, 3, 1, 2).float() / 255.0
    labels = torch.from_numpy(y[:N_SOURCE]).long()
    assert sorted(labels.tolist()) == sorted(list(range(10)) * 2)
    return images, labels


def _build(cls, classifier, source, **overrides):
    fields = {"source_size": N_SOURCE, "source_batch_size": 4, "warmup_samples": 0}
    config = dataclasses.replace(cls.Config(), **{**fields, **overrides})
    return build_with_source(cls, classifier, config, lambda n, labels=False: source)


# -- the rules against references written here ------------------------------------------------
def _sce_reference(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """From the paper's Eq.: 0.5 * CE(p_t, p_x) + 0.5 * CE(p_x, p_t), probabilities by exp."""
    px = x.double().exp() / x.double().exp().sum(1, keepdim=True)
    pt = t.double().exp() / t.double().exp().sum(1, keepdim=True)
    return -0.5 * (pt * px.log()).sum(1) - 0.5 * (px * pt.log()).sum(1)


def test_symmetric_cross_entropy_known_values():
    got = symmetric_cross_entropy(torch.tensor([[2.0, 0.0]]), torch.tensor([[0.0, 0.0]]))
    # 0.25 (log(1 + e^-2) + log(1 + e^2)) + 0.5 log 2
    expected = 0.25 * (math.log1p(math.exp(-2)) + math.log1p(math.exp(2))) + 0.5 * math.log(2)
    assert float(got) == pytest.approx(expected, abs=1e-6)
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(0)) * 3
    t = torch.randn(5, 7, generator=torch.Generator().manual_seed(1)) * 3
    torch.testing.assert_close(
        symmetric_cross_entropy(x, t).double(), _sce_reference(x, t), rtol=0, atol=1e-5
    )
    assert symmetric_cross_entropy(x, t).shape == (5,)
    # no gradient reaches the teacher; the student gets one through both terms
    x, t = x.clone().requires_grad_(True), t.clone().requires_grad_(True)
    symmetric_cross_entropy(x, t).sum().backward()
    assert t.grad is None and x.grad.abs().sum() > 0


def test_class_prototypes_and_the_nearest_one():
    feats = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0], [0.0, 4.0], [1.0, 1.0]])
    labels = torch.tensor([0, 0, 2, 2, 0])
    protos, present = class_prototypes(feats, labels, 3)
    expected = torch.tensor([[5 / 3, 1 / 3], [0.0, 0.0], [0.0, 3.0]])  # class means by hand
    torch.testing.assert_close(protos, expected)
    assert present.tolist() == [True, False, True]
    queries = torch.tensor([[1.0, 0.1], [0.1, 1.0], [-1.0, -1.0]])
    # cosine to class 0 = (5, 1)/|.|, class 2 = (0, 1); the last query is closer to the
    # absent class 1 (a zero prototype: cosine 0) than to any present one, which win
    assert nearest_prototype(queries, protos, present).tolist() == [0, 2, 2]
    with pytest.raises(ValueError, match="source labels"):
        class_prototypes(feats, torch.tensor([0, 0, 3, 2, 0]), 3)


def _supcon_reference(views, projector, temperature):
    """SupCon (Khosla et al., Eq. 2) written per anchor in float64: anchors = every view of
    every sample, positives = the sample's other views, denominator = every other row."""
    proj = copy.deepcopy(projector).double()
    b, v, _ = views.shape
    z = {(i, k): F.normalize(proj(views[i, k].double()), dim=0) for i in range(b) for k in range(v)}
    total = 0.0
    for anchor, za in z.items():
        denom = sum(torch.exp(za @ zc / temperature) for c, zc in z.items() if c != anchor)
        positives = [zp for p, zp in z.items() if p != anchor and p[0] == anchor[0]]
        total += -sum(
            torch.log(torch.exp(za @ zp / temperature) / denom) for zp in positives
        ) / len(positives)
    return total / len(z)


def test_prototype_contrastive_loss_is_supcon():
    torch.manual_seed(0)
    views = torch.randn(5, 3, 8)
    views[3, 0] = views[1, 0]  # two samples sharing one nearest prototype, as in a batch
    projector = make_projector(8, 6)
    got = prototype_contrastive_loss(views, projector, 0.1)
    assert got.shape == (5,)
    expected = _supcon_reference(views, projector, 0.1)
    assert float(got.detach().mean()) == pytest.approx(float(expected.detach()), abs=1e-5)
    assert float(expected.detach()) > 0.5  # not a vanishing value


# -- the method on the real tiny model ------------------------------------------------------
def assert_adam_first_step(params, before, grads, lr):
    """Adam's first step moves each element by ``-lr g / (|g| + 1e-8)``: ``-lr sign(g)``
    wherever the reference gradient ``g`` is clearly non-zero (the loss's gradient, its
    sign and its support, against the one written in the test). Every tensor moves."""
    checked = 0
    for p, p0, g in zip(params, before, grads, strict=True):
        step, clear = p.detach() - p0, g.abs() > 1e-5
        torch.testing.assert_close(step[clear], -lr * g.sign()[clear].float(), rtol=0, atol=2e-6)
        assert not torch.equal(p.detach(), p0)
        checked += int(clear.sum())
    assert checked > 0


def test_defaults_are_the_reference_cfg():
    cfg = RMTConfig()
    assert (cfg.optimizer, cfg.lr, cfg.weight_decay, cfg.steps, cfg.precision) == (
        "adam",
        1e-3,
        0.0,
        1,
        "fp32",
    )
    assert cfg.teacher_momentum == 0.999  # M_TEACHER.MOMENTUM
    assert (cfg.lambda_ce_src, cfg.lambda_ce_trg, cfg.lambda_cont) == (1.0, 1.0, 1.0)
    assert (cfg.temperature, cfg.projection_dim) == (0.1, 128)  # CONTRAST
    assert cfg.noise_std == 0.005  # get_tta_transforms' gaussian_std
    assert cfg.warmup_samples is None  # one pass over the source images (see the header)
    assert (cfg.source_size, cfg.source_batch_size) == (2000, 64)
    assert RMT.needs_source_labels and RMT(None, cfg).source_images_needed() == 2000


def test_setup_refuses_without_labelled_source(classifier):
    method = RMT(copy.deepcopy(classifier), RMTConfig())
    with pytest.raises(ValueError, match="labelled clean source images"):
        method.setup()


def test_one_step_is_the_official_loss(classifier, source, batch):
    """No warm-up, one source batch of all 20 images (the replay CE is order-free): the
    step's loss is the official one assembled here, its prediction the student + teacher
    ensemble (both the source model: 2 z), and the teacher moves by the EMA."""
    images, labels = source
    method = _build(RMT, classifier, source, source_batch_size=N_SOURCE)
    assert method.warmup_steps == 0
    assert len(method.model_params) == len(list(classifier.visual.parameters()))
    projector = copy.deepcopy(method.projector)
    with torch.no_grad():
        src_feats = classifier.encode_image(images)
        protos = torch.stack([src_feats[labels == c].mean(0) for c in range(10)])
        view = cotta_augment(batch, *[torch.Generator().manual_seed(3)] * 2, noise_std=0.005)
    student = copy.deepcopy(classifier)
    student_params = list(student.visual.parameters())
    for p in student_params:
        p.requires_grad_(True)
    feats, aug_feats = student.encode_image(batch), student.encode_image(view)
    z, z_aug = student.logits_from_features(feats), student.logits_from_features(aug_feats)
    t = z.detach()
    nearest = [int(torch.stack([F.cosine_similarity(f, p, dim=0) for p in protos]).argmax())
               for f in feats.detach()]  # fmt: skip
    views = torch.stack([protos[nearest], feats, aug_feats], dim=1)
    expected = (
        (0.5 * _sce_reference(z, t) + 0.5 * _sce_reference(z_aug, t)).mean()
        + _supcon_reference(views, projector, 0.1)
        + F.cross_entropy(student(images), labels).double()
    )
    grads = torch.autograd.grad(expected, student_params)
    out = seeded_step(method, batch, 3)
    assert float(method.last_loss) == pytest.approx(float(expected.detach()), abs=1e-4)
    torch.testing.assert_close(out, 2 * z.detach(), rtol=0, atol=1e-4)
    source_params = [p.detach() for p in classifier.visual.parameters()]
    assert_adam_first_step(method.model_params, source_params, grads, 1e-3)
    for teacher, src, p in zip(method.teacher, source_params, method.model_params):
        torch.testing.assert_close(teacher, 0.999 * src + 0.001 * p.detach(), rtol=0, atol=1e-6)
    assert not torch.equal(method.projector[0].weight, projector[0].weight)


class _Recording(RMT):
    """RMT noting the learning rate of every update."""

    def _update(self, loss):
        self.__dict__.setdefault("lrs", []).append(self.optimizer.param_groups[0]["lr"])
        super()._update(loss)


def test_warm_up_ramps_the_learning_rate_and_moves_the_teacher(classifier, source):
    method = _build(_Recording, classifier, source, warmup_samples=13)  # 13 // 4 = 3 steps
    assert method.warmup_steps == 3 and method.resolved_settings() == {"warmup_steps": 3}
    assert method.lrs == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3])
    assert all(g["lr"] == 1e-3 for g in method.optimizer.param_groups)
    state = method.optimizer.state
    assert all(int(state[p]["step"]) == 3 for p in method.model_params)
    assert not any(p in state for p in method.projector.parameters())  # no grad in warm-up
    source_params = list(classifier.visual.parameters())
    assert not any(torch.equal(t, s) for t, s in zip(method.teacher, source_params))
    assert method._source_position == 12  # 3 batches of 4 of the 20 images
    assert _build(RMT, classifier, source, warmup_samples=None).warmup_steps == 5  # 20 // 4


def test_reset_returns_to_the_state_after_the_warm_up(classifier, source, noisy_images):
    """With a warm-up and replay batches crossing a pass over the source, a used and reset
    method steps like a fresh one, twice (the second step reads the restored teacher,
    projector, optimiser moments and source order)."""

    def build():
        return _build(RMT, classifier, source, warmup_samples=8, source_batch_size=8)

    fresh, used, _ = assert_reset_then_reseed_reproduces(build, noisy_images[:4])
    assert torch.equal(fresh.last_loss, used.last_loss)  # the same replay batch
    seeded_step(used, noisy_images[:4], 2)
    used.reset()
    assert int(used.optimizer.state[used.model_params[0]]["step"]) == 1  # the warm-up's
    assert used._source_position == 8
    used_again = seeded_step(used, noisy_images[:4], 5)
    fresh_again = _build(RMT, classifier, source, warmup_samples=8, source_batch_size=8)
    torch.testing.assert_close(used_again, seeded_step(fresh_again, noisy_images[:4], 5))
    # replay batches: rows 8-15, the short 16-19, then a new pass over the 20 images
    for seed in (6, 7):
        torch.testing.assert_close(
            seeded_step(used, noisy_images, seed), seeded_step(fresh_again, noisy_images, seed)
        )
        assert torch.equal(used.last_loss, fresh_again.last_loss)
    assert used._source_position == fresh_again._source_position == 8


def test_same_seed_same_step_and_predict_is_the_ensemble(classifier, source, batch):
    first, second = (_build(RMT, classifier, source, warmup_samples=4) for _ in range(2))
    out = seeded_step(first, batch, 4)
    assert torch.equal(out, seeded_step(second, batch, 4))
    assert torch.equal(first.last_loss, second.last_loss)
    other = _build(RMT, classifier, source, warmup_samples=4)
    seeded_step(other, batch, 9)
    assert float(other.last_loss) != float(first.last_loss)  # another augmentation draw
    with torch.no_grad():
        ensemble = first.model(batch) + first.forward_with(first.teacher, batch)
    torch.testing.assert_close(first.predict(batch), ensemble, rtol=0, atol=0)
    torch.testing.assert_close(first.predict(batch), second.predict(batch), rtol=0, atol=0)
