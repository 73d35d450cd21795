"""AdaContrast: contrastive test-time adaptation with a MoCo queue and kNN-refined pseudo-labels.

Paper: Chen, Wang, Darrell, Ebrahimi, "Contrastive Test-Time Adaptation", CVPR 2022,
https://arxiv.org/abs/2204.10377.
Official code: https://github.com/DianCh/AdaContrast, commit
c3c8b880131f2658d6fd0d5ed14d71f326174d57 (target.py: train_epoch, refine_predictions,
soft_k_nearest_neighbors, update_labels, instance_loss, classification_loss,
diversification_loss; moco/builder.py: AdaMoCo; configs/learn/target.yaml,
configs/model_tta/moco.yaml, configs/optim/sgd.yaml). Reference harness:
mariodoebler/test-time-adaptation, commit 8b2ed63255d906b6b0afaefc6ae630b9ec4bdaa1
(classification/methods/adacontrast.py, augmentations/transforms_adacontrast.py,
datasets/data_loading.py get_transform, cfgs/cifar10_c/adacontrast.yaml, conf.py
ADACONTRAST / CONTRAST / M_TEACHER / OPTIM).

The defaults follow the reference harness, because it is the online variant our protocols
run: the official code is offline source-free domain adaptation (a full pass over the whole
target set fills the feature bank before training, then 15 epochs over it with a cosine
learning-rate schedule and the classifier head at 10x the learning rate), which a test
stream seen once cannot do. Both share the loss, the MoCo machinery and their constants
(queue 16,384, key momentum 0.999, temperature 0.07, 10 cosine neighbours, alpha = beta =
eta = 1, SGD momentum 0.9 with Nesterov and weight decay 1e-4, lr 2e-4 as in the official
training scripts); the reference starts with an empty feature bank, grows it along the
stream and uses plain argmax pseudo-labels until it has seen 1,024 samples.

One step per batch (the reference's forward_and_adapt; views drawn once per batch):

1. views: a weak view (horizontal flip, p 0.5) and two strong views ``q``, ``k``
   (the reference's CIFAR/ImageNet-C "moco-v2-light": colour jitter (0.4, 0.4, 0.4, 0.1)
   with p 0.8, grayscale p 0.2, Gaussian blur sigma U(0.1, 2) with p 0.5, horizontal flip
   p 0.5; no crop), drawn per image;
2. pseudo-labels: the adapted model's softmax on the weak view; once ``refine_after``
   (1,024) samples have been seen, refined by soft voting of the ``num_neighbors`` (10)
   nearest entries (cosine distance) of the feature bank: the mean of their stored
   probabilities, then argmax;
3. the key encoder (an EMA of the adapted parameters, momentum 0.999, updated before the
   gradient step) encodes view ``k``; the query ``q`` (adapted model, view ``q``) is scored
   against its key and the ``queue_size`` (16,384) keys of the memory queue, / 0.07;
   the batch's keys and pseudo-labels are enqueued (FIFO), then the class-aware mask drops
   every queued negative whose label equals the query's pseudo-label (the mask reads the
   queue's labels after the enqueue, as both official codes do);
4. loss = alpha CE(logits(q), pseudo) + beta CE(instance logits, positive = 0)
   + eta sum(pbar log(pbar + 1e-8)) with pbar the batch-mean softmax of view ``q``
   (alpha = beta = eta = 1); one SGD step (lr 2e-4, momentum 0.9, Nesterov, weight decay
   1e-4);
5. the key encoder (already updated in 3) encodes the weak view: its features and softmax
   enter the feature bank (grown to ``queue_size``, then replaced FIFO).

The batch's prediction is the adapted model's forward on the unaugmented batch after the
update (the reference's eval forward on its "t" view). ``reset()`` returns parameters,
optimiser, key encoder, queue, bank and sample counter to their state after ``setup()``.

Queue size on short streams: the MoCo queue starts as 16,384 random unit vectors with
random labels (the reference's initialisation), and each batch replaces only its own size
of them, so on a digits-c domain (360 images, reset per shift) at least 16,024 of the
negatives stay random for the whole domain, and the feature bank never fills; the kNN
refinement starts after 1,024 samples, so under ``reset_each_shift`` on digits-c it never
runs (pseudo-labels are the weak view's argmax) and only the continual protocols reach it.

CLIP mapping: the encoder is the image tower, its features the projected image features
(``encode_image`` before L2 normalisation; MoCo normalises them, cosine kNN is scale-free),
the classifier the frozen zero-shot text head (logit scale x cosine to the class
embeddings). There is no projection head (neither official code has one). Every parameter
of the image tower adapts (both codes train the whole network); the key encoder is an EMA
of all of them. BatchNorm towers normalise with batch statistics (``use_batch_statistics``).

Defaults: SGD lr 2e-4, momentum 0.9, Nesterov, weight decay 1e-4, 1 step, float32 (the
cifar10_c cfg; imagenet_c: the same values, batch 64), queue 16,384, key momentum 0.999,
temperature 0.07 (conf.py's CONTRAST default is 0.1; both cfgs set 0.07), class-aware
contrast, weak-strong supervision, 10 cosine neighbours, alpha = beta = eta = 1.

What differs:
* The reference harness cannot run AdaContrast on CLIP: ``split_up_model`` has no case for
  its ZeroShotCLIP wrapper, and its CLIP data path hands one view instead of the four
  (t, w, s, s) the method unpacks. The CLIP mapping above is ours.
* Parameters: every parameter of the image tower (the reference's ``collect_params`` keeps
  parameters named ``weight``/``bias``, every parameter of its CNNs, but on a CLIP ViT it
  would skip the class and position embeddings, the projection and the attention
  ``in_proj`` weights); the text tower is frozen.
* BatchNorm: the reference adapts in train mode (batch statistics, running statistics
  updated) and predicts in eval mode with the running statistics; here BatchNorm towers use
  batch statistics throughout and keep no running statistics (CLIP ViTs have none).
* Augmentations are batched tensor versions of torchvision's float kernels (brightness,
  contrast, saturation and hue as its ``adjust_*``, luma grayscale) with every parameter
  drawn per image from the method's generator (the reference: v1 transforms on PIL images,
  8-bit rounding after each operation, Python's and torch's global RNGs); the blur is a
  true Gaussian (kernel radius 6 px = 3 x the largest sigma, edges replicated) where PIL's
  ``GaussianBlur(radius)`` approximates one with box blurs. The views are the same for all
  ``steps`` of a batch, as in the reference.
* The initial queue is drawn at ``setup()`` from torch's global generator (the runner seeds
  it per method and seed before setup); ``reset()`` restores that queue, where the
  reference's ``reset`` draws a new random one.
* A queue shorter than a batch keeps the batch's last keys (the reference's indexed write
  with repeated indices leaves that to the device).

Measured effect: docs/methods.md#adacontrast.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from mura_plugin.methods._norm import use_batch_statistics
from mura_plugin.methods.cotta import ema_update_
from tta_bench.bounds import bounded, one_of
from tta_bench.method import (
    OPTIMIZERS,
    PRECISIONS,
    GradientConfig,
    GradientMethod,
    build_optimizer,
    release_optimizer,
)
from tta_bench.model import ZeroShotClassifier

__all__ = [
    "AdaContrast",
    "AdaContrastConfig",
    "adjust_hue",
    "class_aware_mask",
    "color_jitter",
    "diversity_loss",
    "enqueue",
    "feature_distances",
    "gaussian_blur",
    "instance_logits",
    "instance_loss",
    "soft_knn_refine",
    "strong_view",
    "update_bank",
    "weak_view",
]


@dataclass
class AdaContrastConfig(GradientConfig):
    """The reference harness's cifar10_c setting (cfgs/cifar10_c/adacontrast.yaml, conf.py)."""

    optimizer: str = one_of("sgd", OPTIMIZERS)
    lr: float = bounded(2e-4, gt=0)
    weight_decay: float = bounded(1e-4, ge=0)
    momentum: float = bounded(0.9, ge=0, le=1)
    #: Nesterov momentum for SGD (OPTIM.NESTEROV; needs momentum > 0).
    nesterov: bool = True
    steps: int = bounded(1, ge=1)
    precision: str = one_of("fp32", PRECISIONS)
    #: Keys in the MoCo queue and entries in the kNN feature bank (QUEUE_SIZE).
    queue_size: int = bounded(16384, ge=1)
    #: EMA momentum of the key encoder (M_TEACHER.MOMENTUM).
    key_momentum: float = bounded(0.999, ge=0, le=1)
    #: Temperature of the instance logits (CONTRAST.TEMPERATURE in the cfg).
    temperature: float = bounded(0.07, gt=0)
    #: ``class_aware``: no negatives of the query's pseudo-label; ``all``: plain MoCo.
    contrast_type: str = one_of("class_aware", ("class_aware", "all"))
    #: Which view the classification and diversity terms read: the strong ``q`` view
    #: (weak_strong) or the weak view (weak_weak).
    ce_sup_type: str = one_of("weak_strong", ("weak_strong", "weak_weak"))
    #: Pseudo-label refinement once ``refine_after`` samples were seen.
    refine: str = one_of("nearest_neighbors", ("nearest_neighbors", "none"))
    dist_type: str = one_of("cosine", ("cosine", "euclidean"))
    num_neighbors: int = bounded(10, ge=1)
    #: Samples seen with plain argmax pseudo-labels before kNN refinement (the reference's
    #: fixed 1,024).
    refine_after: int = bounded(1024, ge=0)
    #: Weights of the classification, instance and diversity terms.
    alpha: float = bounded(1.0, ge=0)
    beta: float = bounded(1.0, ge=0)
    eta: float = bounded(1.0, ge=0)


# -- the core rule ---------------------------------------------------------------------------
def feature_distances(x: torch.Tensor, bank: torch.Tensor, dist_type: str) -> torch.Tensor:
    """Distances ``[N, M]`` from ``x [N, D]`` to ``bank [M, D]``: ``1 - cos`` or Euclidean."""
    if dist_type == "cosine":
        return 1.0 - F.normalize(x, dim=1) @ F.normalize(bank, dim=1).t()
    if dist_type == "euclidean":
        return torch.cdist(x, bank)
    raise ValueError(f"unknown dist_type {dist_type!r}; available: cosine, euclidean")


@torch.no_grad()
def soft_knn_refine(
    features: torch.Tensor,
    bank_features: torch.Tensor,
    bank_probs: torch.Tensor,
    num_neighbors: int,
    dist_type: str = "cosine",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft voting: the mean of the stored probabilities of each feature's
    ``num_neighbors`` nearest bank entries (``[N, C]``) and its argmax (``[N]``)."""
    k = min(int(num_neighbors), bank_features.shape[0])
    distances = feature_distances(features.float(), bank_features.float(), dist_type)
    nearest = distances.topk(k, dim=1, largest=False).indices
    probs = bank_probs[nearest].mean(dim=1)
    return probs.argmax(dim=1), probs


def instance_logits(
    q: torch.Tensor, k: torch.Tensor, queue: torch.Tensor, temperature: float
) -> torch.Tensor:
    """MoCo logits ``[B, 1 + K]``: ``[q.k, q.queue] / T`` (``q``, ``k`` unit rows ``[B, D]``,
    ``queue`` unit columns ``[D, K]``, not differentiated)."""
    positive = (q * k).sum(dim=1, keepdim=True)
    negative = q @ queue.detach()
    return torch.cat([positive, negative], dim=1) / temperature


def class_aware_mask(pseudo_labels: torch.Tensor, queue_labels: torch.Tensor) -> torch.Tensor:
    """``[B, 1 + K]`` True where a logit takes part: the positive always, a queued negative
    only when its label differs from the query's pseudo-label."""
    keep_negative = pseudo_labels.view(-1, 1) != queue_labels.view(1, -1)
    positive = torch.ones_like(keep_negative[:, :1])
    return torch.cat([positive, keep_negative], dim=1)


def instance_loss(
    logits: torch.Tensor,
    pseudo_labels: torch.Tensor | None = None,
    queue_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """Batch-mean cross-entropy of the instance logits to the positive (index 0); with
    ``pseudo_labels`` and ``queue_labels``, same-label negatives are masked to ``-inf``."""
    if pseudo_labels is not None and queue_labels is not None:
        mask = class_aware_mask(pseudo_labels, queue_labels)
        logits = logits.masked_fill(~mask, float("-inf"))
    target = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    return F.cross_entropy(logits, target)


def diversity_loss(logits: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``sum_c pbar_c log(pbar_c + eps)``, ``pbar`` the batch-mean softmax: the negative
    entropy of the marginal prediction (minimised: a diverse batch)."""
    mean = logits.float().softmax(dim=1).mean(dim=0)
    return (mean * torch.log(mean + eps)).sum()


@torch.no_grad()
def enqueue(
    queue: torch.Tensor,
    queue_labels: torch.Tensor,
    ptr: int,
    keys: torch.Tensor,
    labels: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """FIFO write of ``keys [B, D]`` and ``labels [B]`` into the queue ``[D, K]`` from
    position ``ptr`` (wrapping); returns new tensors and the next position. With more keys
    than slots, the last ``K`` keys are kept."""
    size = queue.shape[1]
    n = keys.shape[0]
    if n > size:
        ptr, keys, labels = (ptr + n - size) % size, keys[n - size :], labels[n - size :]
        n = size
    slots = (ptr + torch.arange(n, device=queue.device)) % size
    queue = queue.index_copy(1, slots, keys.t().to(queue.dtype))
    queue_labels = queue_labels.index_copy(0, slots, labels.to(queue_labels.dtype))
    return queue, queue_labels, (ptr + n) % size


@torch.no_grad()
def update_bank(
    features: torch.Tensor,
    probs: torch.Tensor,
    ptr: int,
    new_features: torch.Tensor,
    new_probs: torch.Tensor,
    size: int,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The reference's feature bank: appended to while it holds fewer than ``size`` entries
    (then the pointer is ``(ptr + n) mod new length``), afterwards overwritten from ``ptr``
    (wrapping)."""
    n = new_features.shape[0]
    if features.shape[0] < size:
        features = torch.cat([features, new_features.to(features.dtype)])
        probs = torch.cat([probs, new_probs.to(probs.dtype)])
        return features, probs, (ptr + n) % features.shape[0]
    slots = (ptr + torch.arange(n, device=features.device)) % features.shape[0]
    features = features.index_copy(0, slots, new_features.to(features.dtype))
    probs = probs.index_copy(0, slots, new_probs.to(probs.dtype))
    return features, probs, (ptr + n) % features.shape[0]


# -- views -------------------------------------------------------------------------------------
def _uniform(n: int, low: float, high: float, generator: torch.Generator) -> torch.Tensor:
    return torch.empty(n).uniform_(low, high, generator=generator)


def _gray(images: torch.Tensor) -> torch.Tensor:
    """ITU-R 601 luma ``[B, 1, H, W]`` (torchvision's ``rgb_to_grayscale`` weights)."""
    r, g, b = images.unbind(dim=1)
    return (0.2989 * r + 0.587 * g + 0.114 * b).unsqueeze(1)


def _blend(images: torch.Tensor, other: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    f = factor.view(-1, 1, 1, 1)
    return (f * images + (1.0 - f) * other).clamp(0.0, 1.0)


def adjust_hue(images: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """torchvision's ``adjust_hue`` with one hue shift per image (``[B]`` in [-0.5, 0.5]):
    RGB to HSV, hue + shift modulo 1, back to RGB."""
    r, g, b = images.unbind(dim=1)
    maxc, _ = images.max(dim=1)
    minc = images.min(dim=1).values
    equal = maxc == minc
    cr = maxc - minc
    ones = torch.ones_like(maxc)
    s = cr / torch.where(equal, ones, maxc)
    cr_div = torch.where(equal, ones, cr)
    rc, gc, bc = (maxc - r) / cr_div, (maxc - g) / cr_div, (maxc - b) / cr_div
    hr = (maxc == r) * (bc - gc)
    hg = ((maxc == g) & (maxc != r)) * (2.0 + rc - bc)
    hb = ((maxc != g) & (maxc != r)) * (4.0 + gc - rc)
    h = ((hr + hg + hb) / 6.0 + 1.0) % 1.0
    h = (h + shift.view(-1, 1, 1)) % 1.0
    i = torch.floor(h * 6.0)
    f = h * 6.0 - i
    i = i.to(torch.int64) % 6
    v = maxc
    p = (v * (1.0 - s)).clamp(0.0, 1.0)
    q = (v * (1.0 - s * f)).clamp(0.0, 1.0)
    t = (v * (1.0 - s * (1.0 - f))).clamp(0.0, 1.0)
    table = torch.stack(
        [
            torch.stack([v, q, p, p, t, v], dim=1),
            torch.stack([t, v, v, q, p, p], dim=1),
            torch.stack([p, p, t, v, v, q], dim=1),
        ],
        dim=1,
    )  # [B, 3, 6, H, W]
    index = i.unsqueeze(1).unsqueeze(2).expand(-1, 3, 1, -1, -1)
    return table.gather(2, index).squeeze(2)


#: The blur kernel's radius in pixels: 3 x the largest sigma (2.0).
BLUR_RADIUS = 6


def gaussian_blur(images: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """A separable Gaussian blur of each image with its own ``sigma`` (``[B]``, pixels),
    kernel radius ``BLUR_RADIUS``, edges replicated."""
    n, c, h, w = images.shape
    x = torch.arange(-BLUR_RADIUS, BLUR_RADIUS + 1, dtype=images.dtype, device=images.device)
    kernel = torch.exp(-0.5 * (x.view(1, -1) / sigma.to(images).view(-1, 1)) ** 2)
    kernel = (kernel / kernel.sum(dim=1, keepdim=True)).repeat_interleave(c, dim=0)
    r = BLUR_RADIUS
    out = F.pad(images.reshape(1, n * c, h, w), (r, r, r, r), mode="replicate")
    out = F.conv2d(out, kernel.view(n * c, 1, 1, -1), groups=n * c)
    out = F.conv2d(out, kernel.view(n * c, 1, -1, 1), groups=n * c)
    return out.view(n, c, h, w)


def color_jitter(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """torchvision's ``ColorJitter(0.4, 0.4, 0.4, 0.1)`` per image: brightness, contrast,
    saturation factors U(0.6, 1.4) and a hue shift U(-0.1, 0.1), applied in a random order
    of the four (a permutation per image, as its ``get_params``)."""
    n = images.shape[0]
    order = torch.rand(n, 4, generator=generator).argsort(dim=1)
    factors = torch.stack([_uniform(n, 0.6, 1.4, generator) for _ in range(3)], dim=1)
    hue = _uniform(n, -0.1, 0.1, generator)
    factors, hue, order = (t.to(images.device) for t in (factors, hue, order))
    ops = (
        lambda x, i: _blend(x, torch.zeros_like(x), factors[i, 0]),
        lambda x, i: _blend(x, _gray(x).mean(dim=(1, 2, 3), keepdim=True), factors[i, 1]),
        lambda x, i: _blend(x, _gray(x), factors[i, 2]),
        lambda x, i: adjust_hue(x, hue[i]),
    )
    x = images.clone()
    for position in range(4):
        for op, apply in enumerate(ops):
            rows = (order[:, position] == op).nonzero().flatten()
            if rows.numel():
                x[rows] = apply(x[rows], rows)
    return x


def strong_view(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The reference's "moco-v2-light" view of each image of ``images [B, 3, H, W]`` in
    [0, 1]: colour jitter (p 0.8), grayscale (p 0.2), Gaussian blur sigma U(0.1, 2)
    (p 0.5), horizontal flip (p 0.5); every draw per image, from ``generator``."""
    n = images.shape[0]
    draws = torch.rand(n, 4, generator=generator)
    sigma = _uniform(n, 0.1, 2.0, generator)
    jitter, gray, blur, flip = (draws[:, i].to(images.device) for i in range(4))
    x = images.clamp(0.0, 1.0)
    x = torch.where((jitter < 0.8).view(-1, 1, 1, 1), color_jitter(x, generator), x)
    x = torch.where((gray < 0.2).view(-1, 1, 1, 1), _gray(x).expand_as(x), x)
    x = torch.where((blur < 0.5).view(-1, 1, 1, 1), gaussian_blur(x, sigma), x)
    return torch.where((flip < 0.5).view(-1, 1, 1, 1), x.flip(-1), x)


def weak_view(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The reference's "plain" view at the model's size: a horizontal flip with p 0.5 per
    image (its resize and random crop to the same size change nothing)."""
    flip = torch.rand(images.shape[0], generator=generator) < 0.5
    flip = flip.to(images.device).view(-1, 1, 1, 1)
    return torch.where(flip, images.flip(-1), images)


# -- the method --------------------------------------------------------------------------------
class _ImageFeatures(nn.Module):
    """``model.encode_image(images, normalize=False)`` as a forward, for functional calls
    of the key encoder (its tensors are named ``model.<name>``)."""

    def __init__(self, model: ZeroShotClassifier):
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model.encode_image(images, normalize=False)


class AdaContrast(GradientMethod):
    """Online AdaContrast on the image tower with the frozen zero-shot head."""

    Config = AdaContrastConfig
    predict_from_last_forward = False
    state_attributes = (
        "key_params",
        "queue",
        "queue_labels",
        "queue_ptr",
        "bank_features",
        "bank_probs",
        "bank_ptr",
        "seen",
    )

    def setup(self) -> None:
        for name in self.state_attributes:
            setattr(self, name, None)
        super().setup()
        release_optimizer(self.optimizer)
        self.optimizer = self._make_optimizer()
        names = {id(p): n for n, p in self.model.named_parameters()}
        self._key_names = [f"model.{names[id(p)]}" for p in self.params]
        self._features = _ImageFeatures(self.model)
        self._init_state()
        self._snapshot = self._capture()

    def _init_state(self) -> None:
        """Key encoder = the source tensors; the random unit-vector queue with random labels
        (torch's global generator, on the CPU); an empty feature bank."""
        dim = self.model.class_embeddings.shape[1]  # the image features' dimension
        size, c = self.config.queue_size, self.model.num_classes
        self.key_params = [p.detach().clone() for p in self.params]
        self.queue = F.normalize(torch.randn(dim, size), dim=0).to(self.device)
        self.queue_labels = torch.randint(0, c, (size,)).to(self.device)
        self.queue_ptr = 0
        self.bank_features = torch.zeros(0, dim, device=self.device)
        self.bank_probs = torch.zeros(0, c, device=self.device)
        self.bank_ptr = 0
        self.seen = 0

    def _make_optimizer(self) -> torch.optim.Optimizer:
        cfg = self.config
        if cfg.optimizer != "sgd":
            return build_optimizer(self.param_groups(), cfg)
        return torch.optim.SGD(
            self.param_groups(),
            lr=cfg.lr,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            nesterov=bool(cfg.nesterov and cfg.momentum > 0),
        )

    def _restore(self) -> None:
        super()._restore()
        release_optimizer(self.optimizer)
        self.optimizer = self._make_optimizer()

    def configure(self, model: ZeroShotClassifier) -> None:
        use_batch_statistics(model.visual)

    def collect_params(self, model: ZeroShotClassifier) -> list[nn.Parameter]:
        return list(model.visual.parameters())

    # -- forwards ------------------------------------------------------------------------------
    def _encode(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(features, logits)`` of the adapted model (float32)."""
        feats = self.model.encode_image(images, normalize=False).float()
        return feats, self.model.logits_from_features(feats / feats.norm(dim=-1, keepdim=True))

    @torch.no_grad()
    def _encode_keys(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(features, logits)`` of the key encoder (float32)."""
        tensors = dict(zip(self._key_names, self.key_params))
        feats = functional_call(self._features, tensors, (images,)).float()
        return feats, self.model.logits_from_features(feats / feats.norm(dim=-1, keepdim=True))

    def draw_views(self, images: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(weak, strong q, strong k)`` views of the batch, from the method's generator."""
        return (
            weak_view(images, self.generator),
            strong_view(images, self.generator),
            strong_view(images, self.generator),
        )

    @torch.no_grad()
    def pseudo_labels(self, features: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Argmax of the weak view's softmax, or its kNN refinement once ``refine_after``
        samples were seen (the reference counts samples until then)."""
        cfg = self.config
        refine = cfg.refine == "nearest_neighbors" and self.seen >= cfg.refine_after
        if not refine:
            self.seen += features.shape[0]
        if refine and self.bank_features.shape[0] > 0:
            labels, _ = soft_knn_refine(
                features, self.bank_features, self.bank_probs, cfg.num_neighbors, cfg.dist_type
            )
            return labels
        return logits.argmax(dim=1)

    def compute_loss(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss [1], logits of the supervised view)`` for ``images``' freshly drawn views
        (the queue is updated as a side effect, as in a step)."""
        loss, logits = self.view_loss(self.draw_views(images))
        return loss.reshape(1), logits

    def view_loss(self, views: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 2-4 on ``(weak, q, k)``: the total loss (scalar) and the logits of the view
        the classification term reads; updates the key encoder and the queue."""
        cfg = self.config
        weak, view_q, view_k = views
        with torch.set_grad_enabled(cfg.ce_sup_type == "weak_weak" and torch.is_grad_enabled()):
            feats_w, logits_w = self._encode(weak)
        pseudo = self.pseudo_labels(feats_w.detach(), logits_w.detach())
        feats_q, logits_q = self._encode(view_q)
        q = F.normalize(feats_q, dim=1)
        ema_update_(self.key_params, self.params, cfg.key_momentum)
        k = F.normalize(self._encode_keys(view_k)[0], dim=1)
        logits_ins = instance_logits(q, k, self.queue, cfg.temperature)
        self.queue, self.queue_labels, self.queue_ptr = enqueue(
            self.queue, self.queue_labels, self.queue_ptr, k, pseudo
        )
        aware = cfg.contrast_type == "class_aware"
        loss_ins = instance_loss(logits_ins, pseudo if aware else None, self.queue_labels)
        supervised = logits_w if cfg.ce_sup_type == "weak_weak" else logits_q
        loss = cfg.alpha * F.cross_entropy(supervised, pseudo) + cfg.beta * loss_ins
        if cfg.eta > 0:
            loss = loss + cfg.eta * diversity_loss(supervised)
        return loss, supervised

    @torch.no_grad()
    def _update_bank(self, weak: torch.Tensor) -> None:
        with self.autocast():
            feats, logits = self._encode_keys(weak)
        self.bank_features, self.bank_probs, self.bank_ptr = update_bank(
            self.bank_features,
            self.bank_probs,
            self.bank_ptr,
            feats,
            logits.softmax(dim=1),
            self.config.queue_size,
        )

    def adapt(self, images: torch.Tensor) -> torch.Tensor:
        views = self.draw_views(images)
        logits = None
        for _ in range(self.config.steps):
            with torch.enable_grad(), self.autocast():
                loss, logits = self.view_loss(views)
            self.optimizer.zero_grad(set_to_none=True)
            self.optimizer_step(loss)
            self.last_loss = loss.detach()
            self._update_bank(views[0])
        return logits
