"""UniEnt (mura_plugin/methods/unient.py): the distribution-aware filter (min-max csOOD
score, two-component mixture, csID = the smaller-mean component) against scikit-learn
driven here, its degenerate batches, the loss against a NumPy reference in both
weightings, one real update on the tiny ViT against a recomputation, the source score,
reset, seeds and bad values."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from method_runs import assert_same_seeded_steps, build_method
from sklearn.mixture import GaussianMixture

from mura_plugin.methods._norm import norm_parameters
from mura_plugin.methods.unient import UniEnt, UniEntConfig, UniEntSplit, gmm_split, unient_loss


# -- the filter ----------------------------------------------------------------------------
def test_split_of_two_clear_groups():
    """High cosine = csID; the verdict does not depend on which component the mixture
    numbers 0, nor on the random state."""
    s = torch.tensor([0.91, 0.30, 0.90, 0.92, 0.31, 0.29])
    for state in (0, 1, 7):
        split = gmm_split(s, state)
        assert split.fitted
        assert split.is_id.tolist() == [True, False, True, True, False, False]
        torch.testing.assert_close(split.id_weight, split.is_id.float(), rtol=0, atol=1e-6)
        flipped = gmm_split(-s, state)  # now the low-cosine three are csID
        assert flipped.is_id.tolist() == [False, True, False, False, True, True]


def test_split_is_the_posterior_of_the_smaller_mean_component():
    """Overlapping scores: the weights are the posterior, computed here from a mixture fitted
    to ``1 - (s - min) / (max - min)`` with the same random state."""
    s = torch.tensor([0.82, 0.75, 0.79, 0.40, 0.55, 0.61, 0.70, 0.48, 0.66, 0.73])
    x = s.numpy().astype(np.float64)
    o = (1 - (x - x.min()) / (x.max() - x.min())).astype(np.float32).reshape(-1, 1)
    gm = GaussianMixture(n_components=2, random_state=3).fit(o)
    k = int(np.argmin(gm.means_[:, 0]))
    split = gmm_split(s, 3)
    np.testing.assert_allclose(split.id_weight.numpy(), gm.predict_proba(o)[:, k], atol=1e-6)
    assert split.is_id.tolist() == (gm.predict(o) == k).tolist()
    assert 0 < int(split.is_id.sum()) < 10  # both sides non-empty


@pytest.mark.parametrize("scores", [[0.5], [0.3, 0.3, 0.3], []])
def test_unsplittable_batches_are_all_in_distribution(scores):
    split = gmm_split(torch.tensor(scores), 0)
    assert not split.fitted and split.is_id.all() and split.id_weight.shape == (len(scores),)
    assert torch.equal(split.id_weight, torch.ones(len(scores)))


# -- the loss ------------------------------------------------------------------------------
def _np_loss(logits, weight, is_id, weighting, ood_weight, marginal_weight):
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    h = -(p * np.log(p)).sum(1)
    pbar = p.mean(0)
    marginal = -(pbar * np.log(pbar)).sum()
    if weighting == "soft":
        id_term, ood_term = (weight * h).mean(), ((1 - weight) * h).mean()
    else:
        id_term = h[is_id].mean() if is_id.any() else 0.0
        ood_term = h[~is_id].mean() if (~is_id).any() else 0.0
    return id_term - ood_weight * ood_term - marginal_weight * marginal


@pytest.mark.parametrize("weighting", ["soft", "hard"])
@pytest.mark.parametrize("is_id", [[True, False, True, False], [True, True, True, True]])
def test_loss_known_values(weighting, is_id):
    logits = torch.tensor(
        [[2.0, 0.5, -1.0], [0.1, 0.2, 0.3], [3.0, -2.0, 0.0], [-0.5, 1.5, 1.0]],
        requires_grad=True,
    )
    weight = torch.tensor([0.9, 0.2, 0.7, 0.05])
    mask = torch.tensor(is_id)
    split = UniEntSplit(weight, mask, True)
    loss = unient_loss(logits, split, weighting=weighting, ood_weight=0.3, marginal_weight=0.7)
    expected = _np_loss(logits.detach().numpy(), weight.numpy(), mask.numpy(), weighting, 0.3, 0.7)
    assert abs(float(loss.detach()) - expected) < 1e-6
    loss.backward()  # finite gradients even with an empty csOOD side (hard)
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0


def test_unknown_weighting_is_refused():
    split = UniEntSplit(torch.ones(2), torch.ones(2, dtype=torch.bool), True)
    with pytest.raises(ValueError, match="weighting"):
        unient_loss(torch.zeros(2, 3), split, weighting="x", ood_weight=0, marginal_weight=0)


# -- the method on the real tiny ViT -------------------------------------------------------
def test_defaults():
    cfg = UniEnt.Config()
    assert (cfg.optimizer, cfg.lr, cfg.adam_eps, cfg.steps, cfg.precision) == (
        "adam", 1e-4, 1e-6, 10, "fp32"
    )  # fmt: skip
    assert (cfg.weighting, cfg.ood_weight, cfg.marginal_weight, cfg.loss) == (
        "soft",
        0.1,
        1.0,
        None,
    )
    assert UniEnt.own_ood_score and UniEnt.stream_kind is None and UniEnt.adapts


def _source_score(model, images):
    with torch.no_grad():
        feats = F.normalize(model.encode_image(images), dim=-1)
    return (feats @ F.normalize(model.class_embeddings, dim=-1).t()).max(dim=1).values


@pytest.mark.parametrize("weighting", ["soft", "hard"])
def test_one_update_is_the_paper_update(classifier, noisy_images, weighting):
    """One SGD step (no momentum) on UniEnt's loss for the split the mixture gives the
    source cosine scores (random state drawn from the generator as the method draws it);
    the prediction is the updated model's; the own OOD score is the source max cosine."""
    lr, seed, images = 0.5, 3, noisy_images
    method = build_method(
        UniEnt, classifier, steps=1, optimizer="sgd", momentum=0.0, lr=lr, weighting=weighting
    )
    reference = copy.deepcopy(classifier)
    params = norm_parameters(reference.visual)
    assert [p.shape for p in params] == [p.shape for p in method.params]
    score = _source_score(reference, images)
    state = int(torch.randint(0, 2**31 - 1, (1,), generator=torch.Generator().manual_seed(seed)))
    x = score.numpy().astype(np.float64)
    o = (1 - (x - x.min()) / (x.max() - x.min())).astype(np.float32).reshape(-1, 1)
    gm = GaussianMixture(n_components=2, random_state=state).fit(o)
    k = int(np.argmin(gm.means_[:, 0]))
    weight, is_id = gm.predict_proba(o)[:, k], gm.predict(o) == k
    with torch.enable_grad():
        for p in params:
            p.requires_grad_(True)
        logits = reference(images)
        expected_loss = _np_loss(
            logits.detach().numpy(), weight, is_id, weighting, 0.1, 1.0
        )  # the reference value of the loss below, from NumPy
        split = UniEntSplit(torch.from_numpy(weight).float(), torch.from_numpy(is_id), True)
        loss = unient_loss(logits, split, weighting=weighting, ood_weight=0.1, marginal_weight=1.0)
        grads = torch.autograd.grad(loss, params)
    assert abs(float(loss.detach()) - expected_loss) < 1e-5
    method.reseed(seed)
    out = method.step(images)
    torch.testing.assert_close(method.last_loss, loss.detach(), rtol=0, atol=1e-5)
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.sub_(lr * g)
        expected_out = reference(images)
    for p, q in zip(method.params, params):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-5)
    assert method.last_ood_score.shape == (images.shape[0],)
    torch.testing.assert_close(method.last_ood_score, score, rtol=0, atol=1e-6)
    assert any(float(g.abs().max()) > 1e-4 for g in grads)  # the step moved something
    # the source score stays the source's after the update, and leaves the model as it is
    moved = [p.detach().clone() for p in method.params]
    torch.testing.assert_close(method.source_score(images), score, rtol=0, atol=1e-6)
    assert all(torch.equal(p, m) for p, m in zip(method.params, moved))


def test_default_step_shapes_and_predict(classifier, batch):
    method = build_method(UniEnt, classifier)
    assert method.optimizer.param_groups[0]["eps"] == 1e-6
    method.reseed(0)
    out = method.step(batch)
    assert out.shape == (batch.shape[0], classifier.num_classes) and torch.isfinite(out).all()
    assert method.last_ood_score.shape == (batch.shape[0],)
    assert torch.isfinite(method.last_ood_score).all() and method.counts["fitted"] == 1
    assert torch.isfinite(method.last_loss)
    before = [p.detach().clone() for p in method.params]
    assert not all(torch.equal(p, s) for p, s in zip(before, method._snapshot["params"]))
    method.last_ood_score = None
    predicted = method.predict(batch)  # changes nothing, sets the score
    assert all(torch.equal(p, b) for p, b in zip(method.params, before))
    torch.testing.assert_close(predicted, out, rtol=0, atol=1e-6)
    assert method.last_ood_score.shape == (batch.shape[0],)
    one = method.step(batch[:1])  # an unsplittable batch still adapts and scores
    assert one.shape == (1, classifier.num_classes) and method.counts["unsplit"] == 1


def test_reset_and_seeds(classifier, batch):
    build = lambda: build_method(UniEnt, classifier, steps=2, lr=1e-2)  # noqa: E731
    fresh, used = build(), build()
    used.reseed(1)
    used.step(batch)
    used.reset()
    for p, saved in zip(used.params, fresh.params):
        assert torch.equal(p, saved)
    assert not used.optimizer.state and used.counts == {"fitted": 0, "unsplit": 0}
    assert_same_seeded_steps(fresh, used, batch, seed=5, atol=0)
    torch.testing.assert_close(fresh.last_ood_score, used.last_ood_score, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("field", "value"),
    [("weighting", "both"), ("ood_weight", -0.1), ("lr", 0.0), ("adam_eps", 0.0), ("steps", 0)],
)
def test_bad_values_are_refused(classifier, field, value):
    config = dataclasses.replace(UniEntConfig(), **{field: value})
    with pytest.raises(ValueError, match=f"method.{field}"):
        UniEnt(classifier, config)


def test_a_loss_is_refused(classifier):
    method = UniEnt(copy.deepcopy(classifier), UniEntConfig(loss="entropy"))
    with pytest.raises(ValueError, match="method.loss must be null"):
        method.setup()


# -- a BatchNorm tower ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def bn_classifier(classifier):
    """The tiny classifier's text head on a small random CLIP ResNet (BatchNorm)."""
    from open_clip.modified_resnet import ModifiedResNet

    torch.manual_seed(0)
    model = copy.deepcopy(classifier)
    tower = ModifiedResNet(layers=(1, 1, 1, 1), output_dim=64, heads=2, image_size=32, width=8)
    tower.eval().requires_grad_(False)
    model.clip.visual = tower
    return model


def test_batchnorm_tower_uses_batch_statistics(bn_classifier, batch):
    """The official setting: BatchNorm affine adapts with test-batch statistics, and the
    source score is that of the unadapted tower on the same batch statistics."""
    method = build_method(UniEnt, bn_classifier, steps=1, lr=1e-2)
    n_bn = sum(isinstance(m, torch.nn.BatchNorm2d) for m in bn_classifier.visual.modules())
    assert len(method.params) == 2 * n_bn > 0
    reference = copy.deepcopy(method.model)  # configured (batch statistics), not adapted
    method.reseed(0)
    method.step(batch)
    assert not all(torch.equal(p, s) for p, s in zip(method.params, method._snapshot["params"]))
    torch.testing.assert_close(method.last_ood_score, _source_score(reference, batch))
    assert not any(
        m.running_mean is not None
        for m in method.model.visual.modules()
        if isinstance(m, torch.nn.BatchNorm2d)
    )
