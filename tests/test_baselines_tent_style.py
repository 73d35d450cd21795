"""The TENT-style baselines (TENT, ETA, EATA, SAR, DeYO, CoTTA): their core rules against
values written from the papers' equations, and their behaviour on the real tiny ViT and on a
BatchNorm tower (open_clip RN50, random weights, 64 px)."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from method_runs import build_with_source
from torch import nn

from mura_plugin.methods._norm import top_excluded_norm_parameters
from mura_plugin.methods.cotta import (
    CoTTA,
    cotta_augment,
    ema_update_,
    soft_cross_entropy,
    stochastic_restore_,
)
from mura_plugin.methods.deyo import DeYO, deyo_weights, patch_shuffle, pixel_shuffle, plpd
from mura_plugin.methods.eata import EATA, fisher_information, fisher_penalty
from mura_plugin.methods.eta import (
    ETA,
    entropy_weights,
    official_sgd_lr,
    select_samples,
    tower_kind,
    update_moving_probs,
)
from mura_plugin.methods.sar import SAR, sam_ascent, sam_restore, update_loss_ema
from mura_plugin.methods.tent import Tent
from tta_bench.model import ZeroShotClassifier

ALL = (Tent, ETA, EATA, SAR, DeYO, CoTTA)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    p = logits.float().softmax(dim=1)
    return -(p * p.log()).sum(dim=1)


def _build(cls, classifier, source=None, **overrides):
    config = dataclasses.replace(cls.Config(), **overrides)
    return build_with_source(cls, classifier, config, lambda n: source)


@pytest.fixture(scope="module")
def mixed_batch(test_images):
    """4 clean digits (confident) and 4 heavily noised ones (uncertain)."""
    x, _ = test_images
    noisy = x[4:8] + 1.0 * torch.randn(4, *x.shape[1:], generator=torch.Generator().manual_seed(1))
    return torch.cat([x[:4], noisy.clamp(0, 1)])


@pytest.fixture(scope="module")
def source_images(test_images):
    return test_images[0][100:164]


# -- official defaults -----------------------------------------------------------------------
def _assert_defaults(cls, **expected):
    """Each field named in ``expected`` of ``cls.Config()`` equals its given value."""
    config = cls.Config()
    for name, value in expected.items():
        assert getattr(config, name) == value, f"{cls.__name__}.Config().{name}"


def test_official_defaults():
    _assert_defaults(Tent, loss="entropy", optimizer="adam", lr=1e-3, steps=1, weight_decay=0)
    _assert_defaults(
        EATA, optimizer="sgd", lr=None, momentum=0.9, steps=1, e_margin=0.4, d_margin=0.05
    )
    _assert_defaults(
        EATA, probs_momentum=0.9, fisher_alpha=2000.0, fisher_size=2000, fisher_batch_size=64
    )
    assert not hasattr(ETA.Config(), "fisher_alpha")
    _assert_defaults(
        SAR, optimizer="sgd", lr=None, momentum=0.9, e_margin=0.4, rho=0.05, reset_threshold=0.2
    )
    _assert_defaults(SAR, ema_momentum=0.9, exclude_top=0.25, exclude_final_norm=True)
    _assert_defaults(
        DeYO, e_margin=0.5, reweight_margin=0.4, plpd_threshold=0.2, patch_len=4, aug_type="patch"
    )
    d = DeYO.Config()
    assert d.filter_ent and d.filter_plpd and d.reweight_ent and d.reweight_plpd
    _assert_defaults(
        CoTTA, optimizer="adam", lr=1e-3, steps=1, teacher_momentum=0.999, restore_prob=0.01
    )
    _assert_defaults(CoTTA, confidence_threshold=0.92, augmentations=32, noise_std=0.005)
    assert all(cls.Config().precision == "fp32" for cls in ALL)


def test_official_learning_rate_rule():
    assert official_sgd_lr("vit", 64) == pytest.approx(0.001)
    assert official_sgd_lr("vit", 128) == pytest.approx(0.002)
    assert official_sgd_lr("resnet", 64) == pytest.approx(0.00025)
    assert official_sgd_lr("resnet", 32) == pytest.approx(0.00025)
    assert official_sgd_lr("resnet", 16) == pytest.approx(0.00025 / 64 * 16 * 2)
    assert official_sgd_lr("vit", 1, double_at_batch_one=True) == pytest.approx(2 * 0.001 / 64)
    assert official_sgd_lr("vit", 2, double_at_batch_one=True) == pytest.approx(0.001 / 32)
    with pytest.raises(ValueError, match="available: resnet, vit"):
        official_sgd_lr("convnext", 64)


def test_learning_rate_resolves_from_the_first_batch_and_resets(classifier, mixed_batch):
    method = _build(ETA, classifier)
    assert method.tower == "vit" and method.resolved_lr is None
    method.reseed(0)
    method.step(mixed_batch)
    assert method.resolved_lr == pytest.approx(0.001 * 8 / 64)
    method.step(mixed_batch[:3])  # a short last batch keeps the protocol's batch size
    assert method.optimizer.param_groups[0]["lr"] == pytest.approx(0.001 * 8 / 64)
    method.reset()
    assert method.resolved_lr is None
    fixed = _build(SAR, classifier, lr=0.01)
    fixed.step(mixed_batch[:1])
    assert fixed.resolved_lr == 0.01 and fixed.optimizer.param_groups[0]["lr"] == 0.01
    with pytest.raises(ValueError, match="give method.lr"):
        _build(DeYO, classifier, optimizer="adam")


# -- ETA / EATA ------------------------------------------------------------------------------
def test_reliability_and_redundancy_filters_known_values():
    c = 10
    e0 = 0.4 * math.log(c)
    confident = torch.full((c,), 0.01)
    confident[3] = 0.91
    uniform = torch.full((c,), 0.1)
    other = torch.full((c,), 0.002)
    other[7] = 0.982
    probs = torch.stack([confident, uniform, other])
    entropy = -(probs * probs.log()).sum(dim=1)
    assert entropy[0] < e0 < entropy[1] and entropy[2] < e0  # 0.50, 2.30, 0.11 vs 0.92
    reliable, selected = select_samples(entropy, probs, e0, None, 0.05)
    assert reliable.tolist() == [True, False, True] and torch.equal(selected, reliable)
    # cosine to a moving average concentrated on class 3: ~0.99 (redundant) vs ~0.03
    moving = confident.clone()
    cos = torch.stack([(moving @ p) / (moving.norm() * p.norm()) for p in probs])
    assert cos[0] > 0.05 > cos[2]
    reliable, selected = select_samples(entropy, probs, e0, moving, 0.05)
    assert reliable.tolist() == [True, False, True] and selected.tolist() == [False, False, True]
    # weights 1 / exp(H - E0)
    torch.testing.assert_close(entropy_weights(entropy, e0), 1 / torch.exp(entropy - e0))


def test_moving_average_of_probabilities_known_values():
    a, b = torch.tensor([[0.2, 0.8], [0.6, 0.4]]), torch.tensor([[1.0, 0.0]])
    assert update_moving_probs(None, a[:0]) is None
    m = update_moving_probs(None, a)
    torch.testing.assert_close(m, torch.tensor([0.4, 0.6]))
    m2 = update_moving_probs(m, b, 0.9)
    torch.testing.assert_close(m2, 0.9 * torch.tensor([0.4, 0.6]) + 0.1 * torch.tensor([1.0, 0.0]))
    assert update_moving_probs(m2, b[:0]) is m2


def test_eta_step_is_the_paper_update(classifier, mixed_batch):
    """One ETA step = SGD (first step: lr * grad) on mean_selected exp(E0 - H) H; the
    prediction is the pre-update forward; the moving average = mean of the selected probs."""
    lr = 0.5
    method = _build(ETA, classifier, lr=lr)
    reference = copy.deepcopy(classifier)
    ref_method = _build(Tent, reference)  # the same parameter set (all norms), BN-free
    params = ref_method.params
    e0 = 0.4 * math.log(10)
    with torch.enable_grad():
        logits = ref_method.model(mixed_batch)
        h = _entropy(logits)
        keep = h < e0
        assert 0 < int(keep.sum()) < len(keep)  # the batch exercises the filter
        loss = (torch.exp(e0 - h.detach()) * h)[keep].mean()
        grads = torch.autograd.grad(loss, params)
    method.reseed(0)
    out = method.step(mixed_batch)
    torch.testing.assert_close(out, logits.detach(), rtol=0, atol=1e-5)
    for p, p0, g in zip(method.params, params, grads):
        torch.testing.assert_close(p.detach(), p0.detach() - lr * g, rtol=0, atol=1e-6)
    torch.testing.assert_close(
        method.moving_probs, logits.detach().softmax(1)[keep].mean(0), rtol=0, atol=1e-6
    )
    assert method.counts == {"reliable": int(keep.sum()), "selected": int(keep.sum())}
    # the second pass of the same batch meets the redundancy filter
    method.step(mixed_batch)
    assert method.counts["selected"] < 2 * int(keep.sum())


def test_no_selected_sample_means_no_update(classifier, mixed_batch):
    method = _build(ETA, classifier, e_margin=1e-6, lr=0.5)
    before = [p.detach().clone() for p in method.params]
    method.reseed(0)
    method.step(mixed_batch)
    assert all(torch.equal(p, b) for p, b in zip(method.params, before))
    assert method.moving_probs is None and not method.optimizer.state


def test_fisher_information_and_penalty_known_values():
    """Toy model z = [a x, -a x]: pseudo-label 0 for a x > 0, CE = log(1 + exp(-2 a x)),
    dCE/da = -2 x sigmoid(-2 a x); F = mean over batches of (batch-mean gradient)^2."""
    a = nn.Parameter(torch.tensor(0.7))
    images = torch.tensor([0.5, 1.0, 2.0, 0.25, 1.5])

    def forward(x):
        return torch.stack([a * x, -a * x], dim=1)

    (fisher,) = fisher_information(forward, [a], images, batch_size=2)
    grads = [-2 * x * torch.sigmoid(-2 * 0.7 * x) for x in images]
    batches = [(grads[0] + grads[1]) / 2, (grads[2] + grads[3]) / 2, grads[4]]
    expected = sum(g**2 for g in batches) / 3
    torch.testing.assert_close(fisher, expected, rtol=1e-5, atol=0)
    theta = [torch.tensor([1.0, 2.0]), torch.tensor(3.0)]
    fishers = [torch.tensor([0.5, 0.1]), torch.tensor(2.0)]
    anchors = [torch.tensor([0.0, 1.0]), torch.tensor(2.5)]
    value = fisher_penalty(theta, fishers, anchors, alpha=2000.0)
    assert float(value) == pytest.approx(2000 * (0.5 * 1 + 0.1 * 1 + 2.0 * 0.25))


def test_eata_needs_source_images(classifier):
    method = EATA(copy.deepcopy(classifier), EATA.Config(fisher_size=300))
    assert method.source_images_needed() == 300
    with pytest.raises(ValueError, match="set_source.*'eta'"):
        method.setup()


def test_eata_regulariser(classifier, mixed_batch, source_images):
    eata = _build(EATA, classifier, source_images, lr=0.5, fisher_batch_size=16)
    assert [f.shape for f in eata.fishers] == [p.shape for p in eata.params]
    assert all(bool((f >= 0).all()) for f in eata.fishers) and any(
        bool((f > 0).any()) for f in eata.fishers
    )
    assert float(eata.penalty().detach()) == 0.0  # at the source
    # no redundancy filter here, so that every step updates and the penalty acts
    common = {"lr": 0.5, "d_margin": 2.0}
    no_reg = _build(EATA, classifier, source_images, fisher_alpha=0.0, **common)
    eta = _build(ETA, classifier, **common)
    # strong but stable: the penalty's step lr * 2 alpha F stays below 0.5 everywhere
    f_max = max(float(f.max()) for f in eata.fishers)
    strong = _build(EATA, classifier, source_images, fisher_alpha=0.25 / (0.5 * f_max), **common)
    source = [p.detach().clone() for p in eta.params]
    outs, drift = [], []
    for method in (no_reg, eta, strong):
        for seed in range(3):
            method.reseed(seed)
            out = method.step(mixed_batch)
        outs.append(out)
        drift.append(
            sum(float((p.detach() - s).pow(2).sum()) for p, s in zip(method.params, source))
        )
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-6)  # alpha 0: ETA
    assert 0 < drift[2] < drift[1]  # the Fisher term holds the parameters near the source


# -- SAR -------------------------------------------------------------------------------------
def test_sam_step_on_a_quadratic():
    """f(w) = 1/2 w^T A w: SAM's update is w - lr * A (w + rho * A w / ||A w||)."""
    a = torch.tensor([[3.0, 0.5], [0.5, 1.0]])
    w0 = torch.tensor([1.0, -2.0])
    w = nn.Parameter(w0.clone())
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    (0.5 * w @ a @ w).backward()
    saved = sam_ascent([w], rho=0.05)
    g = a @ w0
    torch.testing.assert_close(w.detach(), w0 + 0.05 * g / g.norm())
    opt.zero_grad()
    (0.5 * w @ a @ w).backward()
    sam_restore([w], saved)
    opt.step()
    expected = w0 - 0.1 * a @ (w0 + 0.05 * g / g.norm())
    torch.testing.assert_close(w.detach(), expected)


def test_loss_ema_known_values():
    assert update_loss_ema(None, 0.8) == 0.8
    assert update_loss_ema(0.8, 0.3) == pytest.approx(0.9 * 0.8 + 0.1 * 0.3)


def test_sar_without_perturbation_is_reliable_entropy_sgd(classifier, mixed_batch):
    lr = 0.5
    method = _build(SAR, classifier, lr=lr, rho=0.0, reset_threshold=0.0)
    model = copy.deepcopy(classifier)
    params = top_excluded_norm_parameters(model.visual, 0.25)
    assert [p.shape for p in params] == [p.shape for p in method.params]
    with torch.enable_grad():
        for p in params:
            p.requires_grad_(True)
        logits = model(mixed_batch)
        h = _entropy(logits)
        keep = h < 0.4 * math.log(10)
        grads = torch.autograd.grad(h[keep].mean(), params)
    method.step(mixed_batch)
    for p, p0, g in zip(method.params, params, grads):
        torch.testing.assert_close(p.detach(), p0.detach() - lr * g, rtol=0, atol=1e-6)
    assert method.loss_ema == pytest.approx(float(h[keep].mean().detach()), abs=1e-6)
    perturbed = _build(SAR, classifier, lr=lr, rho=0.5, reset_threshold=0.0)
    perturbed.step(mixed_batch)
    assert not all(torch.allclose(a, b) for a, b in zip(perturbed.params, method.params))


def test_sar_model_recovery(classifier, mixed_batch):
    recovering = _build(SAR, classifier, lr=0.5, reset_threshold=100.0)
    source = [p.detach().clone() for p in recovering.params]
    first_loss = _build(SAR, classifier, lr=0.5, reset_threshold=0.0)
    first_loss.step(mixed_batch)
    recovering.step(mixed_batch)
    # the official code sets the moving average again right after reset(): it survives
    assert recovering.recoveries == 1 and recovering.loss_ema == first_loss.loss_ema
    assert all(torch.equal(p, s) for p, s in zip(recovering.params, source))
    assert not recovering.optimizer.state  # the optimiser is back to its fresh state
    kept = _build(SAR, classifier, lr=0.5, reset_threshold=0.0)
    kept.step(mixed_batch)
    assert kept.recoveries == 0 and kept.loss_ema is not None
    assert not all(torch.equal(p, s) for p, s in zip(kept.params, source))


def test_sar_keeps_recovering_while_the_kept_average_stays_low(classifier, test_images):
    """mr-eggplant/SAR sar.py: after a recovery (``reset()`` clears ``ema``) the forward
    sets ``self.ema = ema`` again, so the average carries over and the next batch recovers
    as long as it stays under the threshold. On a stream [clean, noisier] with a threshold
    between the kept average ``0.9 L1 + 0.1 L2`` and the noisier batch's own loss ``L2``,
    the official rule recovers twice; clearing the average after a recovery, once."""
    x, _ = test_images
    clean = x[:8]
    noisier = (x[8:16] + 0.25 * torch.randn(8, *x.shape[1:],
               generator=torch.Generator().manual_seed(3))).clamp(0, 1)  # fmt: skip
    losses = []
    for batch in (clean, noisier):  # each batch's loss from the source model (never reset)
        probe = _build(SAR, classifier, lr=0.5, reset_threshold=0.0)
        probe.step(batch)
        losses.append(probe.loss_ema)
    l1, l2 = losses
    assert l1 is not None and l2 is not None and l2 > l1, losses  # the stream's premise
    kept_average = 0.9 * l1 + 0.1 * l2
    threshold = (kept_average + l2) / 2  # above the kept average, below L2 alone
    sar = _build(SAR, classifier, lr=0.5, reset_threshold=threshold)
    sar.step(clean)  # L1 < threshold: recovery 1 (the source state again)
    sar.step(noisier)  # from the source state: its loss is L2, the average 0.9 L1 + 0.1 L2
    assert sar.loss_ema == pytest.approx(kept_average, rel=1e-6)
    assert sar.recoveries == 2


def test_sar_excludes_the_top_blocks_and_the_final_norm(classifier):
    from open_clip.transformer import VisionTransformer

    vit12 = VisionTransformer(
        image_size=32, patch_size=8, width=32, layers=12, heads=2, mlp_ratio=2.0, output_dim=16
    )
    chosen = {id(p) for p in top_excluded_norm_parameters(vit12, 0.25)}
    names = {n.rsplit(".", 1)[0] for n, p in vit12.named_parameters() if id(p) in chosen}
    expected = {"ln_pre"} | {f"transformer.resblocks.{i}.ln_{j}" for i in range(9) for j in (1, 2)}
    assert names == expected  # blocks 9-11 and ln_post stay frozen, as timm ViT-B's 9-11 + norm
    tiny = SAR(copy.deepcopy(classifier), SAR.Config())
    tiny.setup()
    ids = {id(p) for p in tiny.params}
    tiny_names = {n for n, p in tiny.model.visual.named_parameters() if id(p) in ids}
    assert not any(n.startswith(("transformer.resblocks.3.", "ln_post")) for n in tiny_names)
    assert "ln_pre.weight" in tiny_names and len(tiny_names) == 14
    with pytest.raises(ValueError, match="cannot find the blocks"):
        top_excluded_norm_parameters(nn.Sequential(nn.LayerNorm(4)), 0.25)


# -- DeYO ------------------------------------------------------------------------------------
def test_patch_shuffle_permutes_whole_patches():
    grid = torch.arange(16.0).view(1, 1, 4, 4)  # one value per patch
    images = F.interpolate(grid, scale_factor=3, mode="nearest").repeat(2, 3, 1, 1)  # 12 px
    out = patch_shuffle(images, 4, torch.Generator().manual_seed(5))
    order = torch.rand(2, 16, generator=torch.Generator().manual_seed(5)).argsort(dim=-1)
    for i in range(2):
        patches = out[i, 0].unfold(0, 3, 3).unfold(1, 3, 3).reshape(16, 9)
        assert bool((patches == patches[:, :1]).all())  # every patch stays whole
        assert patches[:, 0].tolist() == order[i].float().tolist()
        assert torch.equal(out[i, 1], out[i, 0])  # channels move together
    assert not torch.equal(out[0], out[1])  # each image its own permutation
    resized = patch_shuffle(torch.rand(1, 3, 10, 10), 4, torch.Generator().manual_seed(0))
    assert resized.shape == (1, 3, 10, 10)
    pixels = pixel_shuffle(images, torch.Generator().manual_seed(0))
    assert torch.equal(pixels.flatten(2).sort(-1).values, images.flatten(2).sort(-1).values)


def test_plpd_and_weights_known_values():
    p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]])
    p_destroyed = torch.tensor([[0.2, 0.5, 0.3], [0.1, 0.35, 0.55]])
    torch.testing.assert_close(plpd(p, p_destroyed), torch.tensor([0.5, 0.05]))
    h, d, e0 = torch.tensor([0.3, 0.9]), torch.tensor([0.5, 0.05]), 0.4 * math.log(3)
    expected = torch.exp(-(h - e0)) + torch.exp(d)
    torch.testing.assert_close(deyo_weights(h, d, e0), expected)
    torch.testing.assert_close(deyo_weights(h, d, e0, reweight_plpd=False), torch.exp(-(h - e0)))


def test_deyo_step_is_the_paper_update(classifier, mixed_batch):
    lr = 0.5
    method = _build(DeYO, classifier, lr=lr)
    reference = copy.deepcopy(classifier)
    params = top_excluded_norm_parameters(reference.visual, 0.25)
    log_c = math.log(10)
    with torch.enable_grad():
        for p in params:
            p.requires_grad_(True)
        logits = reference(mixed_batch)
        h = _entropy(logits)
        keep = h < 0.5 * log_c
        with torch.no_grad():
            shuffled = patch_shuffle(mixed_batch[keep], 4, torch.Generator().manual_seed(9))
            diff = plpd(logits[keep].softmax(1), reference(shuffled).softmax(1))
        chosen = diff > 0.2
        assert 0 < int(chosen.sum()) < int(keep.sum()) < len(keep)  # both filters act
        hk = h[keep][chosen]
        w = torch.exp(-(hk.detach() - 0.4 * log_c)) + torch.exp(diff[chosen])
        grads = torch.autograd.grad((w * hk).mean(), params)
    method.reseed(9)
    out = method.step(mixed_batch)
    torch.testing.assert_close(out, logits.detach(), rtol=0, atol=1e-5)
    for p, p0, g in zip(method.params, params, grads):
        torch.testing.assert_close(p.detach(), p0.detach() - lr * g, rtol=0, atol=1e-6)
    assert method.counts == {"entropy": int(keep.sum()), "selected": int(chosen.sum())}


# -- CoTTA -----------------------------------------------------------------------------------
def test_ema_teacher_and_stochastic_restore_known_values():
    teacher, student = [torch.tensor([1.0, 2.0])], [torch.tensor([3.0, -2.0])]
    ema_update_(teacher, student, 0.999)
    torch.testing.assert_close(teacher[0], torch.tensor([1.002, 1.996]))
    params, source = torch.randn(1000), torch.zeros(1000)
    kept = params.clone()
    stochastic_restore_([kept], [source], 0.0, torch.Generator().manual_seed(0))
    assert torch.equal(kept, params)
    restored = params.clone()
    stochastic_restore_([restored], [source], 0.01, torch.Generator().manual_seed(3))
    mask = torch.rand(1000, generator=torch.Generator().manual_seed(3)) < 0.01
    assert torch.equal(restored, torch.where(mask, source, params)) and 0 < int(mask.sum()) < 30
    loss = soft_cross_entropy(torch.tensor([[2.0, 0.0]]), torch.tensor([[0.0, 0.0]]))
    assert float(loss) == pytest.approx(math.log(1 + math.exp(2)) - 1)  # -(0.5 lsm_0 + 0.5 lsm_1)


def test_cotta_augment(test_images):
    x = test_images[0][:3]
    x = torch.cat([x, x[:1]])  # image 0 twice
    a = cotta_augment(x, torch.Generator().manual_seed(1), noise_std=0.0)
    b = cotta_augment(x, torch.Generator().manual_seed(1), noise_std=0.0)
    assert a.shape == x.shape and torch.equal(a, b) and a.min() >= 0 and a.max() <= 1
    torch.testing.assert_close(a[3], a[0])  # one parameter draw for the whole batch
    assert not torch.allclose(a, x, atol=1e-3)
    c = cotta_augment(x, torch.Generator().manual_seed(2), noise_std=0.0)
    assert not torch.allclose(a, c, atol=1e-3)


def test_cotta_teacher_prediction_update_and_restore(classifier, mixed_batch):
    method = _build(CoTTA, classifier, confidence_threshold=0.0, restore_prob=0.0)
    assert len(method.params) == len(list(classifier.visual.parameters()))
    with torch.no_grad():
        source_logits = classifier(mixed_batch)
    method.reseed(0)
    out = method.step(mixed_batch)
    torch.testing.assert_close(out, source_logits, rtol=0, atol=1e-5)  # teacher = source
    for t, s, p in zip(method.teacher, method.source_params, method.params):
        torch.testing.assert_close(t, 0.999 * s + 0.001 * p.detach(), rtol=0, atol=1e-7)
    second = method.step(mixed_batch)
    assert not torch.equal(second, out)  # stateful: the teacher moved
    method.reset()
    assert all(torch.equal(t, s) for t, s in zip(method.teacher, method.source_params))
    assert all(torch.equal(p, s) for p, s in zip(method.params, method.source_params))
    full = _build(CoTTA, classifier, confidence_threshold=0.0, restore_prob=1.0)
    full.step(mixed_batch)
    assert all(torch.equal(p, s) for p, s in zip(full.params, full.source_params))
    assert not all(torch.equal(t, s) for t, s in zip(full.teacher, full.source_params))


def test_cotta_averages_augmented_teacher_predictions_when_unconfident(classifier, mixed_batch):
    method = _build(CoTTA, classifier, confidence_threshold=1.0, augmentations=4)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        views = [cotta_augment(mixed_batch, generator, generator) for _ in range(4)]
        expected = torch.stack([classifier(v) for v in views]).mean(0)
    method.reseed(11)
    torch.testing.assert_close(method.step(mixed_batch), expected, rtol=0, atol=1e-5)


# -- towers and errors -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def bn_classifier(digits_stream):
    from mura_plugin.models.openclip import openclip

    torch.manual_seed(0)
    bundle = openclip(arch="RN50", image_size=64, allow_random=True)
    return ZeroShotClassifier(bundle, digits_stream.classnames, digits_stream.templates[:1])


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_batchnorm_tower(cls, bn_classifier, mixed_batch):
    images = F.interpolate(mixed_batch, size=64, mode="bilinear")
    # a random tower is unconfident: widen the filters so that every method updates
    overrides = {"augmentations": 2} if cls is CoTTA else {}
    if cls in (ETA, EATA, SAR, DeYO):
        overrides["e_margin"] = 1.0
    if cls is DeYO:
        overrides["plpd_threshold"] = -1.0
    if cls is EATA:
        overrides["fisher_batch_size"] = 4
    method = _build(cls, bn_classifier, images, lr=0.01, **overrides)
    assert all(
        m.running_mean is None
        for m in method.model.visual.modules()
        if isinstance(m, nn.BatchNorm2d)
    )
    declared = {id(p) for p in method.params}
    frozen = {
        n: p.detach().clone() for n, p in method.model.named_parameters() if id(p) not in declared
    }
    before = [p.detach().clone() for p in method.params]
    method.reseed(0)
    out = method.step(images)
    assert out.shape == (8, 10) and bool(torch.isfinite(out).all())
    after = dict(method.model.named_parameters())
    assert all(torch.equal(after[n], v) for n, v in frozen.items())
    if cls in (SAR, DeYO):
        names = {n for n, p in method.model.visual.named_parameters() if id(p) in declared}
        assert names and not any(n.startswith("layer4.") for n in names)
    assert not all(torch.equal(p, b) for p, b in zip(method.params, before))
    if cls in (ETA, EATA, SAR, DeYO):
        assert method.tower == "resnet" and method.resolved_lr == 0.01


def test_undefined_combinations_are_clear_errors(classifier):
    with pytest.raises(ValueError, match="no BatchNorm2d, GroupNorm or LayerNorm"):
        tower_kind(nn.Sequential(nn.Linear(3, 3)))
    with pytest.raises(ValueError, match="unknown method.loss='info_max'; available: entropy"):
        _build(SAR, classifier, loss="info_max")
    with pytest.raises(ValueError, match="available: patch, pixel"):
        _build(DeYO, classifier, aug_type="occ")
    with pytest.raises(ValueError, match="exclude_top must be in"):
        _build(SAR, classifier, exclude_top=1.0)
    with pytest.raises(ValueError, match="unknown method.loss='info_max'; available: entropy"):
        _build(CoTTA, classifier, loss="info_max")  # its objective is fixed
