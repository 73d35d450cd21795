"""SANTA (mura_plugin/methods/santa.py): the source anchoring loss against values written
from its equation, one step on the real tiny model against the official loss assembled here
(anchoring + RMT's prototype contrastive term, whose SupCon reference is in
test_method_rmt.py), which parameters adapt, reset, seeds and the reference cfg's
defaults."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from method_runs import assert_reset_then_reseed_reproduces, build_with_source, seeded_step
from test_method_rmt import _supcon_reference, assert_adam_first_step

from mura_plugin.methods.cotta import cotta_augment
from mura_plugin.methods.santa import SANTA, SANTAConfig, anchored_cross_entropy

N_SOURCE = 20


@pytest.fixture(scope="module")
def source():
    from mura_plugin.datasets.digits import digits_arrays

    x, y = digits_arrays("train")
    images = torch.from_numpy(x[:N_SOURCE]).permute(0, 3, 1, 2).float() / 255.0
    return images, torch.from_numpy(y[:N_SOURCE]).long()


def _build(classifier, source, **overrides):
    fields = {"source_size": N_SOURCE, "source_batch_size": 8, **overrides}
    config = dataclasses.replace(SANTAConfig(), **fields)
    return build_with_source(SANTA, classifier, config, lambda n, labels=False: source)


def _anchoring_reference(z, z_aug, a):
    """The official AugCrossEntropy, written from the equation with probabilities by exp."""
    p, q = (v.double().exp() / v.double().exp().sum(1, keepdim=True) for v in (z, z_aug))
    log_a = a.double() - a.double().exp().sum(1, keepdim=True).log()
    return -0.5 * (p * log_a).sum(1) - 0.5 * (q * log_a).sum(1)


def test_anchored_cross_entropy_known_values():
    z, z_aug, a = torch.tensor([[2.0, 0.0]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, 0.0]])
    a[0, 1] = math.log(3.0)  # anchor probabilities (1/4, 3/4)
    s = 1 / (1 + math.exp(-2))  # softmax([2, 0])[0]
    expected = -0.5 * (s * math.log(0.25) + (1 - s) * math.log(0.75))
    expected += -0.5 * (0.5 * math.log(0.25) + 0.5 * math.log(0.75))
    assert float(anchored_cross_entropy(z, z_aug, a)) == pytest.approx(expected, abs=1e-6)
    g = torch.Generator().manual_seed(0)
    z, z_aug, a = (torch.randn(6, 5, generator=g) * 3 for _ in range(3))
    torch.testing.assert_close(
        anchored_cross_entropy(z, z_aug, a).double(),
        _anchoring_reference(z, z_aug, a),
        rtol=0,
        atol=1e-5,
    )
    z, a = z.clone().requires_grad_(True), a.clone().requires_grad_(True)
    anchored_cross_entropy(z, z_aug, a).sum().backward()
    assert a.grad is None and z.grad.abs().sum() > 0


def test_defaults_are_the_reference_cfg():
    cfg = SANTAConfig()
    assert (cfg.optimizer, cfg.lr, cfg.weight_decay, cfg.steps, cfg.precision) == (
        "adam",
        1e-3,
        0.0,
        1,
        "fp32",
    )
    assert (cfg.lambda_ce_trg, cfg.lambda_cont) == (1.0, 1.0)  # SANTA options
    assert (cfg.temperature, cfg.projection_dim) == (0.1, 128)  # CONTRAST
    assert cfg.noise_std == 0.005
    assert (cfg.source_size, cfg.source_batch_size) == (2000, 64)
    assert SANTA.needs_source_labels and SANTA(None, cfg).source_images_needed() == 2000


def test_setup_refuses_without_labelled_source(classifier, source):
    method = SANTA(copy.deepcopy(classifier), SANTAConfig())
    method.set_source(source[0])  # images without labels
    with pytest.raises(ValueError, match="labelled clean source images"):
        method.setup()


def test_one_step_is_the_official_loss(classifier, source, batch):
    """The loss of the first step is the official one assembled here (the anchor and the
    student are both the source model), its prediction the student's logits, and only the
    image tower's LayerNorm affine parameters and the projector move."""
    images, labels = source
    method = _build(classifier, source)
    norms = [
        p
        for m in classifier.visual.modules()
        if isinstance(m, torch.nn.LayerNorm)
        for p in (m.weight, m.bias)
    ]
    assert [id(p) for p in method.model_params] == [
        id(p) for m in method.model.visual.modules() if isinstance(m, torch.nn.LayerNorm)
        for p in (m.weight, m.bias)
    ]  # fmt: skip
    assert len(method.model_params) == len(norms)
    projector = copy.deepcopy(method.projector)
    with torch.no_grad():
        src_feats = classifier.encode_image(images)
        protos = torch.stack([src_feats[labels == c].mean(0) for c in range(10)])
        view = cotta_augment(batch, *[torch.Generator().manual_seed(3)] * 2, noise_std=0.005)
    student = copy.deepcopy(classifier)
    student_norms = [
        p
        for m in student.visual.modules()
        if isinstance(m, torch.nn.LayerNorm)
        for p in (m.weight, m.bias)
    ]
    for p in student_norms:
        p.requires_grad_(True)
    feats, aug_feats = student.encode_image(batch), student.encode_image(view)
    z, z_aug = student.logits_from_features(feats), student.logits_from_features(aug_feats)
    nearest = [int(torch.stack([F.cosine_similarity(f, p, dim=0) for p in protos]).argmax())
               for f in feats.detach()]  # fmt: skip
    views = torch.stack([protos[nearest], feats, aug_feats], dim=1)
    expected = _anchoring_reference(z, z_aug, z.detach()).mean()
    expected = expected + _supcon_reference(views, projector, 0.1)
    grads = torch.autograd.grad(expected, student_norms)
    before = {k: v.clone() for k, v in method.model.state_dict().items()}
    out = seeded_step(method, batch, 3)
    assert float(method.last_loss) == pytest.approx(float(expected.detach()), abs=1e-4)
    torch.testing.assert_close(out, z.detach(), rtol=0, atol=1e-4)
    assert_adam_first_step(method.model_params, [p.detach() for p in norms], grads, 1e-3)
    adapted = {k for k, p in method.model.named_parameters() if p.requires_grad}
    changed = {k for k, v in method.model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and changed <= adapted and all("ln_" in k for k in changed)
    assert all(torch.equal(a, n.detach()) for a, n in zip(method.anchor, norms))  # frozen
    assert not torch.equal(method.projector[0].weight, projector[0].weight)


def test_reset_and_seeds(classifier, source, noisy_images):
    def build():
        return _build(classifier, source)

    fresh, used, _ = assert_reset_then_reseed_reproduces(build, noisy_images[:4])
    first_loss = float(fresh.last_loss)
    assert float(used.last_loss) == first_loss
    for seed in (6, 7):  # the projector, parameters and optimiser were restored too
        torch.testing.assert_close(
            seeded_step(used, noisy_images, seed), seeded_step(fresh, noisy_images, seed)
        )
        assert torch.equal(used.last_loss, fresh.last_loss)
    other = build()
    seeded_step(other, noisy_images[:4], 9)
    assert float(other.last_loss) != first_loss  # another augmentation draw (seed 9, not 5)
