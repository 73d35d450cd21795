"""RoTTA: robust test-time adaptation with a category-balanced memory and a mean teacher.

Paper: Yuan, Xie, Li, "Robust Test-Time Adaptation in Dynamic Scenarios", CVPR 2023,
https://arxiv.org/abs/2303.13899.
Official code: https://github.com/BIT-DA/RoTTA, commit
67e34c900cdd355fc07e55edd4c577ea7b8ebcc9 (core/adapter/rotta.py: forward_and_adapt,
update_model, timeliness_reweighting, configure_model; core/utils/memory.py: CSTU;
core/utils/bn_layers.py: RobustBN1d/2d; core/utils/custom_transforms.py:
get_tta_transforms; configs/adapter/rotta.yaml, core/configs/defaults.py).
Reference harness: mariodoebler/test-time-adaptation, commit
8b2ed63255d906b6b0afaefc6ae630b9ec4bdaa1 (classification/methods/rotta.py,
classification/conf.py ``ROTTA.*``, classification/cfgs/cifar10_c/rotta.yaml).

Which code the defaults follow: the values are the same in both (official
configs/adapter/rotta.yaml; the harness's conf.py + cfgs/cifar10_c/rotta.yaml), except the
harness's CIFAR-10-C batch size 200 against the official 64 (the batch size is the
protocol's: 64 on digits-c, the official value). The memory, the robust BatchNorm, the
teacher and the loss follow the official code (the harness copies them). The choice of
parameters on ViTs follows the harness: the official ``configure_model`` adapts the affine
parameters of its robust BatchNorms only, so a LayerNorm tower would have nothing to adapt;
the harness's ``configure_model`` also makes every LayerNorm and GroupNorm trainable (no
replacement: they normalise each sample on its own, so there are no batch statistics for a
robust BatchNorm to blend). Here: the robust BatchNorm for every BatchNorm of a BN tower
(CLIP ResNets), and the affine parameters of every LayerNorm / GroupNorm of the image tower
adapt as they are, which on the CLIP ViTs is all RoTTA adapts.

Per batch, as officially:

1. the teacher predicts the batch in eval mode (robust BatchNorms normalise with their
   stored statistics); these logits are the batch's prediction (before any update below);
   pseudo-label = argmax, uncertainty = ``-sum p log(p + 1e-6)`` of its softmax;
2. each sample in turn enters the memory (CSTU, ``CategoryBalancedMemory``) under its
   pseudo-label: score ``lambda_t / (1 + exp(-age / K)) + lambda_u * H / ln C`` (K the
   capacity, age in samples); while its class holds fewer than ``K / C`` items it goes in if
   the memory has room, else it replaces the highest-scoring item of the fullest classes;
   otherwise it replaces the highest-scoring item of its own class; a replacement happens
   only when that item's score is strictly above the newcomer's (age 0), else the newcomer
   is dropped; ties go to the last item in class-then-insertion order; after every offer all
   stored items age by one;
3. every ``update_frequency`` samples (counted along the stream, so possibly mid-batch): the
   memory's images ``x`` in class-then-insertion order get one strong augmentation (the
   CoTTA/KATANA transforms, one random draw for the whole memory batch); the teacher
   predicts ``x`` and the student predicts the augmented ``x``, both in train mode (a robust
   BatchNorm normalises with ``(1 - alpha) * stored + alpha * batch`` statistics and stores
   them); loss = mean over the memory of ``w(a) * CE(softmax(teacher), student)`` with the
   timeliness weight ``w(a) = exp(-a) / (1 + exp(-a))``, ``a = age / K``; one Adam step on
   the student; then ``teacher <- (1 - nu) teacher + nu student`` on the parameters (each
   model keeps its own robust-BatchNorm statistics).

Defaults: Adam lr 1e-3, betas (0.9, 0.999), no weight decay, 1 step, float32 (the official
code has no mixed precision); memory size 64, update frequency 64, lambda_t = lambda_u = 1,
teacher rate ``nu`` 0.001 (teacher momentum 0.999), robust-BatchNorm momentum ``alpha``
0.05, augmentation noise std 0.005. The harness's imagenet_c/rotta.yaml: the same values
(Adam 1e-3, batch 64, ResNet-50). (A note on names: the official ``NU`` is the teacher's
rate and ``ALPHA`` the robust BatchNorm's, not the other way round.)

What differs:
* ViTs (the default tiny-clip-digits and the CLIP ViTs): no robust BatchNorm exists; the
  image tower's LayerNorm affine parameters adapt (the harness's mapping, above), so
  ``alpha`` and the train/eval distinction have no effect there. The text tower is frozen.
* The teacher is a copy of the adapted tensors (and of the robust-BatchNorm statistics),
  run with ``torch.func.functional_call`` on the student's modules; the official teacher is
  a deep copy of the whole model whose EMA also runs over the frozen parameters, where it
  leaves them unchanged (up to rounding). Train/eval switching touches the robust
  BatchNorms only (the official ``model.train()`` also switches other layers; CLIP towers
  have no dropout there).
* The robust BatchNorm stores its statistics in place (official: reassigns the buffers),
  so the teacher's statistics live in the teacher's tensors; the same values. It generalises
  the official 1d/2d classes to any input rank (mean over every dimension but channels).
* Augmentations: torchvision v2 kernels with the method's generator
  (``mura_plugin.methods.cotta.cotta_augment``, the same operations and ranges); on CUDA
  the noise comes from a device generator seeded from the method's generator.
* Memory images are stored as copies (official: views of the batch tensor); same values.
* ``steps`` is fixed at 1: the official loop over steps would re-insert the batch into the
  memory on every step.
* The harness's rotta.py calls ``loss_calculation(x)`` on its float32 path, which takes no
  argument (a TypeError), so there only its CUDA mixed-precision path runs; float32 here,
  as officially.

Measured effect: docs/methods.md#rotta.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from mura_plugin.methods.cotta import cotta_augment, soft_cross_entropy
from tta_bench.bounds import bounded, one_of
from tta_bench.method import PRECISIONS, GradientConfig, GradientMethod
from tta_bench.model import ZeroShotClassifier

__all__ = [
    "CategoryBalancedMemory",
    "RoTTA",
    "RoTTAConfig",
    "RobustBatchNorm",
    "timeliness_weights",
]


@dataclass
class RoTTAConfig(GradientConfig):
    """The official RoTTA setting (configs/adapter/rotta.yaml)."""

    optimizer: str = "adam"
    lr: float = 1e-3
    weight_decay: float = 0.0
    #: One optimisation step per memory update (official OPTIM.STEPS 1; fixed, see header).
    steps: int = bounded(1, ge=1, le=1)
    precision: str = one_of("fp32", PRECISIONS)
    #: Capacity K of the category-balanced memory (official MEMORY_SIZE).
    memory_size: int = bounded(64, ge=1)
    #: Adapt once every this many test samples (official UPDATE_FREQUENCY).
    update_frequency: int = bounded(64, ge=1)
    #: Weight of the age term of the memory's score (official LAMBDA_T).
    lambda_t: float = bounded(1.0, ge=0)
    #: Weight of the uncertainty term of the memory's score (official LAMBDA_U).
    lambda_u: float = bounded(1.0, ge=0)
    #: Teacher rate: teacher <- (1 - nu) teacher + nu student (official NU).
    nu: float = bounded(0.001, ge=0, le=1)
    #: Robust BatchNorm momentum: (1 - alpha) stored + alpha batch statistics (official ALPHA).
    alpha: float = bounded(0.05, ge=0, le=1)
    #: Standard deviation of the strong augmentation's additive Gaussian noise.
    noise_std: float = bounded(0.005, ge=0)


# -- the category-balanced memory (CSTU) -------------------------------------------------------
class CategoryBalancedMemory:
    """RoTTA's category-balanced sampling with timeliness and uncertainty (CSTU).

    ``classes[c]`` holds ``[data, uncertainty, age]`` items of pseudo-label ``c`` in
    insertion order; ``data`` is anything (the method stores image tensors)."""

    def __init__(self, capacity: int, num_classes: int, lambda_t: float, lambda_u: float):
        if num_classes < 2:
            raise ValueError(f"rotta's memory needs at least 2 classes, got {num_classes}")
        self.capacity = int(capacity)
        self.num_classes = int(num_classes)
        self.lambda_t = float(lambda_t)
        self.lambda_u = float(lambda_u)
        self.classes: list[list[list[Any]]] = [[] for _ in range(self.num_classes)]

    @property
    def per_class(self) -> float:
        return self.capacity / self.num_classes

    def __len__(self) -> int:
        return sum(len(items) for items in self.classes)

    def score(self, age: float, uncertainty: float) -> float:
        """``lambda_t / (1 + exp(-age / K)) + lambda_u * uncertainty / ln C``: higher = the
        first to go."""
        timeliness = 1.0 / (1.0 + math.exp(-age / self.capacity))
        return self.lambda_t * timeliness + self.lambda_u * uncertainty / math.log(self.num_classes)

    def add(self, data: Any, label: int, uncertainty: float) -> bool:
        """Offer one sample; returns whether it was stored. Every stored item ages by one
        afterwards, whether or not the sample went in."""
        label = int(label)
        new_score = self.score(0, uncertainty)
        if len(self.classes[label]) < self.per_class:
            if len(self) < self.capacity:
                stored = True
            else:
                stored = self._evict(self._fullest_classes(), new_score)
        else:
            stored = self._evict([label], new_score)
        if stored:
            self.classes[label].append([data, float(uncertainty), 0])
        for items in self.classes:
            for item in items:
                item[2] += 1
        return stored

    def _fullest_classes(self) -> list[int]:
        sizes = [len(items) for items in self.classes]
        return [c for c, size in enumerate(sizes) if size == max(sizes)]

    def _evict(self, candidates: list[int], new_score: float) -> bool:
        """Drop the highest-scoring item of ``candidates`` (the last one on ties) if its
        score is above ``new_score``; True when there is room for the newcomer."""
        best: tuple[float, int, int] | None = None
        for c in candidates:
            for i, (_, uncertainty, age) in enumerate(self.classes[c]):
                s = self.score(age, uncertainty)
                if best is None or s >= best[0]:
                    best = (s, c, i)
        if best is None:
            return True
        if best[0] > new_score:
            del self.classes[best[1]][best[2]]
            return True
        return False

    def contents(self) -> tuple[list[Any], list[float]]:
        """``(data, ages / K)`` of every stored item, class by class, in insertion order."""
        items = [item for items in self.classes for item in items]
        return [item[0] for item in items], [item[2] / self.capacity for item in items]

    def state(self) -> list[list[tuple[Any, float, int]]]:
        return [[tuple(item) for item in items] for items in self.classes]

    def load_state(self, state: list[list[tuple[Any, float, int]]]) -> None:
        self.classes = [[list(item) for item in items] for items in state]


def timeliness_weights(ages: torch.Tensor) -> torch.Tensor:
    """RoTTA's loss weight of a memory item of normalised age ``a``: ``exp(-a) / (1 + exp(-a))``."""
    return torch.exp(-ages) / (1.0 + torch.exp(-ages))


# -- robust batch normalisation ----------------------------------------------------------------
class RobustBatchNorm(nn.Module):
    """RoTTA's robust BatchNorm: in train mode it normalises with
    ``(1 - momentum) * stored + momentum * batch`` statistics (biased variance) and stores
    them (in place); in eval mode with the stored ones. Starts from the replaced BatchNorm's
    running statistics and affine parameters."""

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm, momentum: float):
        super().__init__()
        if bn.running_mean is None or bn.running_var is None:
            raise ValueError("RoTTA's robust BatchNorm needs a BatchNorm with running statistics")
        if bn.weight is None or bn.bias is None:
            raise ValueError("RoTTA's robust BatchNorm needs a BatchNorm with affine parameters")
        self.num_features = bn.num_features
        self.momentum = float(momentum)
        self.eps = bn.eps
        self.weight = nn.Parameter(bn.weight.detach().clone())
        self.bias = nn.Parameter(bn.bias.detach().clone())
        self.register_buffer("source_mean", bn.running_mean.detach().clone())
        self.register_buffer("source_var", bn.running_var.detach().clone())
        self.train(bn.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = [1, -1] + [1] * (x.dim() - 2)
        if self.training:
            dims = [0, *range(2, x.dim())]
            batch_var, batch_mean = torch.var_mean(x, dim=dims, unbiased=False)
            mean = (1 - self.momentum) * self.source_mean + self.momentum * batch_mean
            var = (1 - self.momentum) * self.source_var + self.momentum * batch_var
            with torch.no_grad():
                self.source_mean.copy_(mean)
                self.source_var.copy_(var)
        else:
            mean, var = self.source_mean, self.source_var
        x = (x - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        return x * self.weight.view(shape) + self.bias.view(shape)


def _replace_batch_norms(module: nn.Module, momentum: float) -> list[RobustBatchNorm]:
    """Swap every BatchNorm1d/2d under ``module`` for a ``RobustBatchNorm``; returns them."""
    replaced = []
    for name, child in list(module.named_children()):
        if isinstance(child, (nn.BatchNorm1d, nn.BatchNorm2d)):
            robust = RobustBatchNorm(child, momentum)
            setattr(module, name, robust)
            replaced.append(robust)
        else:
            replaced += _replace_batch_norms(child, momentum)
    return replaced


def _adapted_modules(visual: nn.Module) -> Iterator[nn.Module]:
    return (
        m for m in visual.modules() if isinstance(m, (RobustBatchNorm, nn.LayerNorm, nn.GroupNorm))
    )


# -- the method --------------------------------------------------------------------------------
class RoTTA(GradientMethod):
    """Category-balanced memory + timeliness-weighted mean-teacher updates + robust BN."""

    Config = RoTTAConfig

    def setup(self) -> None:
        cfg = self.config
        self.memory = CategoryBalancedMemory(
            cfg.memory_size, self.model.num_classes, cfg.lambda_t, cfg.lambda_u
        )
        #: Test samples offered to the memory since setup/reset (the update clock).
        self.seen = 0
        #: Memory updates since setup/reset.
        self.updates = 0
        self.teacher: dict[str, torch.Tensor] = {}
        self._device_generator: torch.Generator | None = None
        super().setup()
        names = {id(p): n for n, p in self.model.named_parameters()}
        self.teacher = {names[id(p)]: p.detach().clone() for p in self.params}
        for name, module in self.model.named_modules():
            if isinstance(module, RobustBatchNorm):
                self.teacher[f"{name}.source_mean"] = module.source_mean.detach().clone()
                self.teacher[f"{name}.source_var"] = module.source_var.detach().clone()
        self._param_names = [names[id(p)] for p in self.params]
        self._snapshot = self._capture()  # now with the teacher

    def configure(self, model: ZeroShotClassifier) -> None:
        self._robust = _replace_batch_norms(model.visual, self.config.alpha)
        self._set_robust_mode(False)

    def collect_params(self, model: ZeroShotClassifier) -> list[nn.Parameter]:
        params: list[nn.Parameter] = []
        for m in _adapted_modules(model.visual):
            params += [p for p in (m.weight, m.bias) if p is not None]
        if not params:
            raise ValueError(
                f"rotta adapts BatchNorm (robust), LayerNorm or GroupNorm affine parameters, "
                f"but {type(model.visual).__name__} has none"
            )
        return params

    # -- state -------------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        return {
            "teacher": dict(self.teacher),
            "memory": self.memory.state(),
            "seen": self.seen,
            "updates": self.updates,
        }

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.teacher = state["teacher"]
        self.memory.load_state(state["memory"])
        self.seen = state["seen"]
        self.updates = state["updates"]

    # -- forwards ----------------------------------------------------------------------------
    def _set_robust_mode(self, train: bool) -> None:
        for m in self._robust:
            m.train(train)

    def _teacher_forward(self, images: torch.Tensor, train: bool) -> torch.Tensor:
        self._set_robust_mode(train)
        try:
            with torch.no_grad(), self.autocast():
                logits = functional_call(self.model, self.teacher, (images,))
        finally:
            self._set_robust_mode(False)
        return logits.float()

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """The teacher's logits (eval mode: stored statistics, nothing changes)."""
        return self._teacher_forward(images, train=False)

    def compute_loss(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(CE(teacher(x), student(aug(x))) [B], student logits)`` on memory images ``x``,
        both forwards in train mode (robust BatchNorms blend and store statistics)."""
        augmented = cotta_augment(
            images, self.generator, self._noise_generator(), noise_std=self.config.noise_std
        )
        teacher = self._teacher_forward(images, train=True)
        self._set_robust_mode(True)
        try:
            with self.autocast():
                student = self.model(augmented)
        finally:
            self._set_robust_mode(False)
        return soft_cross_entropy(student, teacher), student

    def _noise_generator(self) -> torch.Generator:
        """``self.generator`` on the CPU; elsewhere a device generator seeded from it."""
        if self.device.type == "cpu":
            return self.generator
        if self._device_generator is None:
            self._device_generator = torch.Generator(device=self.device)
        seed = int(torch.randint(0, 2**62, (1,), generator=self.generator))
        return self._device_generator.manual_seed(seed)

    # -- adaptation --------------------------------------------------------------------------
    def step(self, images: torch.Tensor) -> torch.Tensor:
        with self.timed("predict"):
            logits = self._teacher_forward(images, train=False)
        with self.timed("adapt"):
            self.adapt_on(images, logits)
        return logits

    def adapt_on(self, images: torch.Tensor, teacher_logits: torch.Tensor) -> None:
        """Offer each sample of the batch to the memory under the teacher's pseudo-label
        and uncertainty; update every ``update_frequency`` samples."""
        probs = teacher_logits.float().softmax(dim=1)
        labels = probs.argmax(dim=1).tolist()
        uncertainty = (-(probs * torch.log(probs + 1e-6)).sum(dim=1)).tolist()
        for i in range(images.shape[0]):
            self.memory.add(images[i].detach().clone(), labels[i], uncertainty[i])
            self.seen += 1
            if self.seen % self.config.update_frequency == 0:
                self.update()

    def update(self) -> None:
        """One timeliness-weighted mean-teacher step on the memory, then the teacher EMA."""
        data, ages = self.memory.contents()
        if not data:
            return
        x = torch.stack(data)
        weights = timeliness_weights(torch.tensor(ages, dtype=torch.float32, device=x.device))
        with torch.enable_grad():
            per_sample, _ = self.compute_loss(x)
            loss = (per_sample * weights).mean()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_step(loss)
        nu = self.config.nu
        with torch.no_grad():
            for name, p in zip(self._param_names, self.params):
                self.teacher[name].mul_(1 - nu).add_(p.detach(), alpha=nu)
        self.updates += 1
        self.last_loss = loss.detach()

    def adapt(self, images: torch.Tensor) -> torch.Tensor:
        """``step`` without its timing split: the teacher's logits, then the memory update."""
        logits = self._teacher_forward(images, train=False)
        self.adapt_on(images, logits)
        return logits
