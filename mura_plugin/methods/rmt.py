"""RMT: robust mean teacher with source prototypes, source replay and a warm-up.

Paper: Döbler, Marsden, Yang, "Robust Mean Teacher for Continual and Gradual Test-Time
Adaptation", CVPR 2023, https://arxiv.org/abs/2211.13081.
Official code: https://github.com/mariodoebler/test-time-adaptation, commit
8b2ed63255d906b6b0afaefc6ae630b9ec4bdaa1 (the authors maintain this harness; it is also the
reference harness: classification/methods/rmt.py, methods/base.py, utils/losses.py
(SymmetricCrossEntropy), utils/misc.py (ema_update_model), augmentations/transforms_cotta.py
(get_tta_transforms), datasets/data_loading.py (get_source_loader), models/model.py
(split_up_model, ZeroShotCLIP), conf.py (RMT, CONTRAST, M_TEACHER, SOURCE, OPTIM),
cfgs/cifar10_c/rmt.yaml, cfgs/imagenet_c/rmt.yaml).

The defaults follow cfgs/cifar10_c/rmt.yaml + conf.py: the default suite (digits-c) is 10
classes of 32 px images like CIFAR-10-C.

Before adaptation (``setup``), from the labelled clean source images the runner hands over
(``needs_source_labels``; the protocol's declared source split, never the test stream):

1. source prototypes: the mean image feature of each class over the source images
   (features of the source model, computed once; ``class_prototypes``);
2. a projector ``Linear(D, 128) -> ReLU -> Linear(128, 128)`` (PyTorch's default
   initialisation) whose parameters adapt with the model's;
3. mean-teacher warm-up: ``warmup_samples // source_batch_size`` steps on source batches
   (images only) with the loss ``SCE(student, teacher)``, the learning rate ramped
   linearly ``lr * (i + 1) / steps`` and the teacher updated after every step (rule 6);
   the learning rate is then ``lr`` again, and the optimiser keeps its moments.

Each test batch, one step:

4. student: features ``f`` and logits ``z`` of the batch, ``f'``/``z'`` of one augmented copy
   (CoTTA's augmentation, one draw for the batch); teacher logits ``t`` of the batch;
5. loss = ``lambda_ce_trg * mean_i (0.5 SCE(z_i, t_i) + 0.5 SCE(z'_i, t_i))``
   ``+ lambda_cont * L_con + lambda_ce_src * CE(student(x_src), y_src)`` with the symmetric
   cross-entropy ``SCE(z, t) = -0.5 sum softmax(t) log softmax(z) - 0.5 sum softmax(z)
   log softmax(t)`` (gradient through ``z`` in both terms, none through the teacher);
   ``L_con``: the supervised-contrastive loss (SupCon, temperature 0.1, mode "all") over
   three views of each sample, its nearest source prototype (cosine similarity of ``f``),
   ``f`` and ``f'``, all through the projector and L2-normalised; the views of one sample are
   its positives, every other row a negative; ``(x_src, y_src)`` the next labelled source
   batch (source replay); one Adam step;
6. teacher: ``theta_t <- 0.999 theta_t + 0.001 theta_s`` on every adapted parameter;
7. the batch's prediction is ``z + t`` (student plus teacher logits, before the update),
   as officially; ``predict`` gives the same ensemble of the current state.

Source batches come from one shuffled pass over the source images after another (the
official DataLoader: shuffle, last batch short), shared by the warm-up and the replay.

Defaults (cifar10_c/rmt.yaml, conf.py): Adam lr 1e-3, betas (0.9, 0.999), no weight decay,
1 step, float32 (``MIXED_PRECISION`` False), teacher momentum 0.999, ``LAMBDA_CE_SRC``,
``LAMBDA_CE_TRG``, ``LAMBDA_CONT`` 1.0, ``CONTRAST.TEMPERATURE`` 0.1,
``CONTRAST.PROJECTION_DIM`` 128, ``CONTRAST.MODE`` "all", source batch = the test batch
size (200 on CIFAR-10-C, 64 on ImageNet-C and on digits-c: ``source_batch_size`` 64).
ImageNet-C (imagenet_c/rmt.yaml): SGD lr 0.01, momentum 0.9, Nesterov, batch 64.

Source data (``source_size`` images asked for, 2,000 by default): the official code uses the
whole source training split (``SOURCE.NUM_SAMPLES`` -1: 50,000 CIFAR-10 images) for the
prototypes, the warm-up and the replay. 2,000 is the budget EATA's Fisher already asks of
the same protocols; on digits-c it is the whole split (1,437 training digits), as
officially; on CIFAR-10-C a fixed 2,000-image subset, on ImageNet-C about two per class.
Warm-up (``warmup_samples``): officially 50,000 samples, one pass over CIFAR-10's training
split (250 steps of 200); the default here (None) is one pass over the source images handed
over (digits-c: 1,437 // 64 = 22 steps), which keeps setup to seconds on a CPU; set it to
50000 for the official count (781 steps of 64, minutes on a CPU), which changes the
digits-c results markedly (docs/methods.md#rmt).

Parameters: every parameter of the image tower (official ``configure_model`` makes every
module trainable, BatchNorm on test-batch statistics) and the projector's. Features: the
L2-normalised image features (``model.encode_image``), those the reference's CLIP wrapper
returns (``ZeroShotCLIP.forward(return_features=True)``); the classifier on them is CLIP's
scaled cosine to the frozen class embeddings.

What differs:
* The reference harness has no CLIP split for RMT (``split_up_model`` knows CNNs and
  timm/torchvision ViTs; its features are those before the last linear layer): the image
  features and the text head stand in for the feature extractor and the classifier.
* Parameters: the official ``collect_params`` takes the parameters named ``weight`` or
  ``bias``, every parameter of its CNNs; on a CLIP tower that name filter would skip the
  class and position embeddings, the projection and the attention ``in_proj`` weights, so
  every image-tower parameter adapts here (as ``cotta``). The teacher averages those (the
  official EMA covers all parameters, the frozen ones staying equal).
* Source data: ``source_size`` images instead of the whole split; their order comes from a
  generator seeded at setup from torch's seed (the runner seeds it per run), not from a
  DataLoader on the global RNG. A class without source images gets no prototype and is
  left out of the nearest-prototype search (officially its prototype is NaN).
* ``reset()`` returns to the state right after setup, i.e. after the warm-up: student,
  teacher, projector, optimiser moments, and the source order and position (officially the
  source iterator keeps going across resets). The reference caches the prototypes and the
  warm-up checkpoint on disk; here they are recomputed at every setup, with the same result.
* Only SupCon's mode "all" (the default); mode "one" would compare unprojected prototypes
  with projected features (it needs the feature size to equal the projection size).
* The augmentations use torchvision's ``transforms.v2.functional`` kernels with parameters
  drawn from the method's generator (``cotta_augment``; official: v1 transforms on the
  global RNG): the same operations and ranges.
* The reference harness at 8b2ed63 calls ``get_source_loader`` without its ``use_clip``
  argument (a TypeError before adaptation starts); the rule followed is that of its code.
* The SGD option has no Nesterov momentum (the ImageNet-C setting uses it).

Measured effect: docs/methods.md#rmt.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from mura_plugin.methods._norm import use_batch_statistics
from mura_plugin.methods._online import symmetric_cross_entropy as sce
from mura_plugin.methods.cotta import cotta_augment, ema_update_
from tta_bench.bounds import bounded
from tta_bench.method import GradientConfig, GradientMethod
from tta_bench.model import ZeroShotClassifier

__all__ = [
    "RMT",
    "RMTConfig",
    "SourcePrototypeConfig",
    "SourcePrototypeMethod",
    "class_prototypes",
    "make_projector",
    "nearest_prototype",
    "prototype_contrastive_loss",
    "symmetric_cross_entropy",
]


@dataclass
class SourcePrototypeConfig(GradientConfig):
    """What RMT and SANTA share: the official CONTRAST options, the target loss weights
    and the labelled source data (conf.py defaults)."""

    #: Weight of the self-training term (``LAMBDA_CE_TRG``).
    lambda_ce_trg: float = bounded(1.0, ge=0)
    #: Weight of the prototype contrastive term (``LAMBDA_CONT``).
    lambda_cont: float = bounded(1.0, ge=0)
    #: SupCon temperature (``CONTRAST.TEMPERATURE``).
    temperature: float = bounded(0.1, gt=0)
    #: Output size of the projector (``CONTRAST.PROJECTION_DIM``).
    projection_dim: int = bounded(128, ge=1)
    #: Labelled source images asked of the protocol's source split (officially all of it).
    source_size: int = bounded(2000, ge=1)
    #: Source batch size (officially the test batch size; digits-c's is 64).
    source_batch_size: int = bounded(64, ge=1)
    #: Standard deviation of the augmentation's additive Gaussian noise (official 0.005).
    noise_std: float = bounded(0.005, ge=0)


@dataclass
class RMTConfig(SourcePrototypeConfig):
    """The official RMT CIFAR-10-C setting (cfgs/cifar10_c/rmt.yaml + conf.py)."""

    #: Mean-teacher EMA momentum (``M_TEACHER.MOMENTUM``).
    teacher_momentum: float = bounded(0.999, ge=0, le=1)
    #: Weight of the source replay cross-entropy (``LAMBDA_CE_SRC``; 0 = source-free).
    lambda_ce_src: float = bounded(1.0, ge=0)
    #: Source samples of the warm-up (officially 50,000); None: one pass over the source
    #: images handed over; 0: no warm-up.
    warmup_samples: Optional[int] = bounded(None, ge=0)


# -- the rules ---------------------------------------------------------------------------------
def symmetric_cross_entropy(
    logits: torch.Tensor, teacher: torch.Tensor, alpha: float = 0.5
) -> torch.Tensor:
    """Per-sample ``-(1 - alpha) sum softmax(teacher) log softmax(logits)
    - alpha sum softmax(logits) log softmax(teacher)`` ``[B]`` (float32; the teacher is not
    differentiated)."""
    return sce(logits.float(), teacher.detach().float(), alpha)


def class_prototypes(
    features: torch.Tensor, labels: torch.Tensor, num_classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prototypes [C, D], present [C] bool)``: the mean feature of each class (zeros and
    ``present`` False for a class without samples)."""
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(f"source labels must lie in [0, {num_classes}), got {labels.unique()}")
    features = features.float()
    sums = torch.zeros(num_classes, features.shape[1], device=features.device)
    sums.index_add_(0, labels.to(features.device), features)
    counts = torch.bincount(labels.cpu(), minlength=num_classes).to(features.device)
    present = counts > 0
    return sums / counts.clamp(min=1).unsqueeze(1), present


def nearest_prototype(
    features: torch.Tensor, prototypes: torch.Tensor, present: torch.Tensor
) -> torch.Tensor:
    """Index ``[B]`` of the prototype with the highest cosine similarity to each feature,
    among the classes ``present``."""
    sim = F.cosine_similarity(features.float().unsqueeze(1), prototypes.unsqueeze(0), dim=-1)
    return sim.masked_fill(~present.unsqueeze(0), float("-inf")).argmax(dim=1)


def make_projector(dim: int, projection_dim: int) -> nn.Sequential:
    """The official projector ``Linear(dim, p) -> ReLU -> Linear(p, p)`` (default init from
    torch's global generator)."""
    return nn.Sequential(
        nn.Linear(dim, projection_dim), nn.ReLU(), nn.Linear(projection_dim, projection_dim)
    )


def prototype_contrastive_loss(
    views: torch.Tensor, projector: nn.Module, temperature: float
) -> torch.Tensor:
    """SupCon (mode "all", no labels) over ``views [B, V, D]``: every one of the ``V * B``
    projected, L2-normalised rows is an anchor whose positives are the other views of its
    sample and whose contrast set is every other row. Returns the per-sample mean over its
    ``V`` anchors ``[B]``, whose batch mean is the official loss."""
    b, v = views.shape[:2]
    rows = torch.cat(views.unbind(dim=1), dim=0)  # view-major: row k*B + i is view k of i
    z = F.normalize(projector(rows).float(), p=2, dim=1)
    sim = z @ z.t() / temperature
    sim = sim - sim.max(dim=1, keepdim=True).values.detach()
    eye = torch.eye(b * v, dtype=torch.bool, device=z.device)
    sample = torch.arange(b, device=z.device).repeat(v)
    positives = (sample.unsqueeze(0) == sample.unsqueeze(1)) & ~eye
    log_prob = sim - torch.logsumexp(sim.masked_fill(eye, float("-inf")), dim=1, keepdim=True)
    per_row = -(log_prob * positives).sum(dim=1) / positives.sum(dim=1)
    return per_row.view(v, b).mean(dim=0)


# -- the shared machinery -----------------------------------------------------------------------
class SourcePrototypeMethod(GradientMethod):
    """Source prototypes from labelled source images, a projector that adapts with the
    model, the prototype contrastive term and the augmented view: what RMT and SANTA share.
    A subclass names the model parameters that adapt (``model_parameters``)."""

    Config: ClassVar[type] = SourcePrototypeConfig
    needs_source_labels: ClassVar[bool] = True
    predict_from_last_forward: ClassVar[bool] = True
    #: The method's name in error messages.
    method_name: ClassVar[str] = "rmt"

    def source_images_needed(self) -> int:
        return int(self.config.source_size)

    def model_parameters(self, model: ZeroShotClassifier) -> list[nn.Parameter]:
        raise NotImplementedError

    def _source(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.source is None or self.source.shape[0] == 0 or self.source_labels is None:
            raise ValueError(
                f"{self.method_name} needs labelled clean source images for its class prototypes: "
                "run it on a protocol that declares a source split (the runner then calls "
                "set_source(images, labels)), or call method.set_source(images, labels) "
                "before setup() in Python"
            )
        if self.source_labels.shape[0] != self.source.shape[0]:
            raise ValueError("set_source: one label per source image is needed")
        return self.source.to(self.device), self.source_labels.to(self.device).long()

    def configure(self, model: ZeroShotClassifier) -> None:
        images, labels = self._source()
        use_batch_statistics(model.visual)
        with torch.no_grad(), self.autocast():
            feats = [model.encode_image(b) for b in images.split(self.config.source_batch_size)]
        features = torch.cat(feats).float()
        self.prototypes, self.present = class_prototypes(features, labels, model.num_classes)
        dim = features.shape[1]
        self.projector = make_projector(dim, self.config.projection_dim).to(self.device)

    def collect_params(self, model: ZeroShotClassifier) -> list[nn.Parameter]:
        self.model_params = list(self.model_parameters(model))
        names = {id(p): n for n, p in model.named_parameters()}
        self._names = [names[id(p)] for p in self.model_params]
        return self.model_params + list(self.projector.parameters())

    def forward_with(self, tensors: Sequence[torch.Tensor], images: torch.Tensor) -> torch.Tensor:
        """The model's logits with ``tensors`` in place of the adapted model parameters."""
        return functional_call(self.model, dict(zip(self._names, tensors)), (images,))

    def _noise_generator(self) -> torch.Generator:
        """``self.generator`` on the CPU; elsewhere a generator on the device seeded from it."""
        if self.device.type == "cpu":
            return self.generator
        if getattr(self, "_device_generator", None) is None:
            self._device_generator = torch.Generator(device=self.device)
        seed = int(torch.randint(0, 2**62, (1,), generator=self.generator))
        return self._device_generator.manual_seed(seed)

    def augment(self, images: torch.Tensor) -> torch.Tensor:
        """One augmented copy of the batch (the official ``get_tta_transforms``)."""
        noise = self._noise_generator()
        return cotta_augment(images, self.generator, noise, noise_std=self.config.noise_std)

    def student(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(features [B, D], logits [B, C])`` of the adapted model."""
        features = self.model.encode_image(images)
        return features, self.model.logits_from_features(features)

    def contrastive(self, features: torch.Tensor, augmented: torch.Tensor) -> torch.Tensor:
        """The prototype contrastive term per sample ``[B]``: views (nearest source
        prototype, features, augmented features)."""
        with torch.no_grad():
            nearest = nearest_prototype(features, self.prototypes, self.present)
        views = torch.stack([self.prototypes[nearest], features.float(), augmented.float()], 1)
        return prototype_contrastive_loss(views, self.projector, self.config.temperature)


# -- RMT -----------------------------------------------------------------------------------------
class RMT(SourcePrototypeMethod):
    """Mean teacher with symmetric cross-entropy, source prototypes and source replay."""

    Config = RMTConfig
    method_name = "rmt"
    resolved = ("warmup_steps",)

    def model_parameters(self, model: ZeroShotClassifier) -> list[nn.Parameter]:
        return list(model.visual.parameters())

    def configure(self, model: ZeroShotClassifier) -> None:
        super().configure(model)
        cfg = self.config
        self.teacher = [p.detach().clone() for p in self.model_parameters(model)]
        n = self.source.shape[0]
        samples = n if cfg.warmup_samples is None else cfg.warmup_samples
        self.warmup_steps = int(samples) // cfg.source_batch_size
        self._source_generator = torch.Generator()
        self._source_generator.manual_seed(int(torch.randint(0, 2**62, (1,))))
        self._source_order = torch.randperm(n, generator=self._source_generator)
        self._source_position = 0

    def setup(self) -> None:
        super().setup()
        self._warm_up()
        self._snapshot = self._capture()
        self._optimizer_snapshot = copy.deepcopy(self.optimizer.state_dict())

    def reset(self) -> None:
        super().reset()
        with self.timed("adapt"):
            self.optimizer.load_state_dict(copy.deepcopy(self._optimizer_snapshot))

    # -- state beyond the parameters ---------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        return {
            "teacher": self.teacher,
            "order": self._source_order,
            "position": self._source_position,
            "rng": self._source_generator.get_state(),
        }

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.teacher = state["teacher"]
        self._source_order = state["order"]
        self._source_position = state["position"]
        self._source_generator.set_state(state["rng"])

    def next_source_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next labelled source batch: a shuffled pass over the source images after
        another, the last batch of a pass short (the official DataLoader)."""
        n = self.source.shape[0]
        if self._source_position >= n:
            self._source_order = torch.randperm(n, generator=self._source_generator)
            self._source_position = 0
        start = self._source_position
        rows = self._source_order[start : start + self.config.source_batch_size]
        self._source_position = start + len(rows)
        rows = rows.to(self.source.device)
        return self.source[rows].to(self.device), self.source_labels[rows].to(self.device).long()

    # -- teacher and updates ------------------------------------------------------------------
    def teacher_logits(self, images: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.forward_with(self.teacher, images).float()

    def _update(self, loss: torch.Tensor) -> None:
        """One optimiser step on ``loss``, then the teacher's EMA."""
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_step(loss)
        ema_update_(self.teacher, self.model_params, self.config.teacher_momentum)
        self.last_loss = loss.detach()

    def _warm_up(self) -> None:
        """Mean-teacher warm-up on source images with a linear learning-rate ramp."""
        lr, steps = self.config.lr, self.warmup_steps
        for i in range(steps):
            for group in self.optimizer.param_groups:
                group["lr"] = lr * (i + 1) / steps
            images, _ = self.next_source_batch()
            with torch.enable_grad(), self.autocast():
                student = self.model(images)
                loss = symmetric_cross_entropy(student, self.teacher_logits(images)).mean()
            self._update(loss)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.last_loss = None

    def compute_loss(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss per sample [B], ensemble logits [B, C])``: the batch mean of the loss is
        the official loss (the source replay term is a batch term added to every sample)."""
        cfg = self.config
        features, logits = self.student(images)
        aug_features, aug_logits = self.student(self.augment(images))
        teacher = self.teacher_logits(images)
        self_training = 0.5 * symmetric_cross_entropy(logits, teacher)
        self_training = self_training + 0.5 * symmetric_cross_entropy(aug_logits, teacher)
        loss = cfg.lambda_ce_trg * self_training
        loss = loss + cfg.lambda_cont * self.contrastive(features, aug_features)
        if cfg.lambda_ce_src > 0:
            src_images, src_labels = self.next_source_batch()
            src_logits = self.model(src_images).float()
            loss = loss + cfg.lambda_ce_src * F.cross_entropy(src_logits, src_labels)
        return loss, logits.detach().float() + teacher

    def adapt(self, images: torch.Tensor) -> torch.Tensor:
        prediction = None
        for _ in range(self.config.steps):
            with torch.enable_grad(), self.autocast():
                loss, prediction = self.compute_loss(images)
                loss = loss.mean()
            self._update(loss)
        return prediction

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """The ensemble of the current student and teacher (official
        ``forward_sliding_window``)."""
        with self.autocast():
            return self.model(images).float() + self.teacher_logits(images)
