"""CoTTA: continual test-time adaptation with a mean teacher and stochastic restore.

Paper: Wang et al., "Continual Test-Time Domain Adaptation", CVPR 2022.
Official code: https://github.com/qinenergy/cotta, commit
c212a204b32be4005092e4323105a24a29ad2952 (cifar/cotta.py: CoTTA.forward_and_adapt,
get_tta_transforms, update_ema_variables, configure_model, collect_params;
cifar/my_transforms.py; cifar/cfgs/cifar10/cotta.yaml).

One step per batch, as in the official CIFAR code:

1. the student (the adapted model) predicts the batch; the source model ("anchor")
   predicts it too, and its mean max-probability is the batch's confidence;
2. the teacher's prediction: its logits on the batch, or, when the confidence is below
   ``confidence_threshold`` (AP; 0.92 for CIFAR-10, the 10-class setting the default follows;
   0.72 for CIFAR-100), the mean of its logits on 32 augmented copies of the batch;
3. student loss: cross-entropy of the student's prediction to the teacher's softmax
   (``-sum softmax(teacher) * log_softmax(student)``, batch mean); one Adam step;
4. teacher update: ``teacher <- 0.999 teacher + 0.001 student`` on every parameter;
5. stochastic restore: each element of each adapted parameter returns to its source value
   with probability 0.01.

The batch's prediction is the teacher's (step 2, before the updates), as officially. The
method is stateful across batches (student, teacher, optimiser) and is meant for the
``continual`` protocol; ``reset()`` restores the student, the teacher and the optimiser to
the source state (as the official ``reset``, which re-copies the teacher from the
restored student).

Defaults (official cifar10/cotta.yaml): Adam lr 1e-3, betas (0.9, 0.999), no weight decay,
1 step, float32, teacher momentum 0.999, restore probability 0.01, AP 0.92, 32
augmentations. Parameters: every parameter of the vision tower (official
``configure_model`` makes everything trainable; BatchNorm uses batch statistics in
student, teacher and anchor alike). Teacher and anchor are forwards of the same modules
with the teacher's / source tensors substituted (``torch.func.functional_call``); the
source tensors are a copy kept by the method.

Augmentation (official ``get_tta_transforms``, non-soft), one random draw per augmented copy
shared by the whole batch (the official transforms act on the batch tensor): clip to [0, 1];
colour jitter in a random order of brightness U(0.6, 1.4), contrast U(0.7, 1.3),
saturation U(0.5, 1.5), hue U(-0.06, 0.06), gamma U(0.7, 1.3) (input clamped to
[1e-8, 1] first); edge padding by half the image size; random affine (rotation U(-15, 15)
degrees, translation up to 1/16 of the padded size, rounded to whole pixels, scale
U(0.9, 1.1), bilinear); Gaussian blur (kernel 5, sigma U(0.001, 0.5)); centre crop back to
the input size; horizontal flip with probability 0.5; additive N(0, 0.005) noise per
element; clip to [0, 1].

What differs:
* The augmentations use torchvision's ``transforms.v2.functional`` kernels with parameters
  drawn from the method's generator (official: torchvision v1 transforms on the global RNG,
  ``resample=PIL.Image.BILINEAR``): the same operations and ranges.
* The 32 augmented forwards run only when the teacher's prediction needs them (the
  official code always computes them and discards them when confident): the same result.
* Parameters: the official ``collect_params`` takes every parameter named ``weight`` or
  ``bias``, which on its CIFAR/ImageNet CNNs is every parameter; on CLIP towers that name
  filter would skip the class and position embeddings, the projection and the attention
  ``in_proj`` weights, so "every parameter" is taken literally here.
* The ImageNet variant of the official code (symmetric cross-entropy, AP 0.1, restore
  probability 0.001) is not the default; AP and the restore probability are fields.
* Randomness on CUDA (noise, restore masks) comes from a device generator seeded from the
  method's generator each step: reproducible per seed, not bit-equal to the CPU draws.

Measured effect: docs/methods.md#cotta.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torchvision.transforms.v2.functional as TF
from torch import nn
from torch.func import functional_call

from mura_plugin.methods._norm import use_batch_statistics
from tta_bench.bounds import bounded, one_of
from tta_bench.method import PRECISIONS, GradientConfig, GradientMethod
from tta_bench.model import ZeroShotClassifier

__all__ = [
    "CoTTA",
    "CoTTAConfig",
    "cotta_augment",
    "ema_update_",
    "stochastic_restore_",
    "soft_cross_entropy",
]


@dataclass
class CoTTAConfig(GradientConfig):
    """The official CoTTA CIFAR-10 setting."""

    loss: str = one_of(
        "entropy", ("entropy",)
    )  # unused: CoTTA's objective is the cross-entropy to its teacher
    optimizer: str = "adam"
    lr: float = 1e-3
    weight_decay: float = 0.0
    steps: int = bounded(1, ge=1)
    precision: str = one_of("fp32", PRECISIONS)
    #: Teacher EMA momentum (official MT).
    teacher_momentum: float = bounded(0.999, ge=0, le=1)
    #: Probability that an element of an adapted parameter returns to its source value.
    restore_prob: float = bounded(0.01, ge=0, le=1)
    #: Augment the teacher when the source model's mean confidence is below this (AP).
    confidence_threshold: float = bounded(0.92, ge=0, le=1)
    #: Augmented copies averaged for the teacher's prediction.
    augmentations: int = bounded(32, ge=1)
    #: Standard deviation of the augmentation's additive Gaussian noise.
    noise_std: float = bounded(0.005, ge=0)


def _uniform(generator: torch.Generator, low: float, high: float) -> float:
    return float(torch.empty(1).uniform_(low, high, generator=generator))


def cotta_augment(
    images: torch.Tensor,
    generator: torch.Generator,
    noise_generator: torch.Generator | None = None,
    *,
    noise_std: float | None = 0.005,
    padding_mode: str = "edge",
    blur: bool = True,
) -> torch.Tensor:
    """One augmented copy of the batch ``images [B, 3, S, S]`` in [0, 1] (the official
    non-soft ``get_tta_transforms``): every random parameter is drawn once from
    ``generator`` and shared by the batch; the per-element noise is drawn from
    ``noise_generator`` (default ``generator``; it must live on the images' device).
    ``padding_mode``, ``blur`` and ``noise_std=None`` (no noise drawn) give the reference
    harness's ``cotta_augs=False`` variant that ROID uses (reflect padding, no blur, no
    noise); the draws left are in the same order."""
    size = images.shape[-1]
    x = images.clamp(0.0, 1.0)
    for op in torch.randperm(5, generator=generator).tolist():
        if op == 0:
            x = TF.adjust_brightness(x, _uniform(generator, 0.6, 1.4))
        elif op == 1:
            x = TF.adjust_contrast(x, _uniform(generator, 0.7, 1.3))
        elif op == 2:
            x = TF.adjust_saturation(x, _uniform(generator, 0.5, 1.5))
        elif op == 3:
            x = TF.adjust_hue(x, _uniform(generator, -0.06, 0.06))
        else:
            x = TF.adjust_gamma(x.clamp(1e-8, 1.0), _uniform(generator, 0.7, 1.3))
    pad = size // 2
    x = TF.pad(x, [pad, pad, pad, pad], padding_mode=padding_mode)
    angle = _uniform(generator, -15.0, 15.0)
    max_shift = x.shape[-1] / 16
    shift = [round(_uniform(generator, -max_shift, max_shift)) for _ in range(2)]
    scale = _uniform(generator, 0.9, 1.1)
    x = TF.affine(
        x,
        angle=angle,
        translate=shift,
        scale=scale,
        shear=[0.0, 0.0],
        interpolation=TF.InterpolationMode.BILINEAR,
        fill=0.0,
    )
    if blur:
        sigma = _uniform(generator, 0.001, 0.5)
        x = TF.gaussian_blur(x, kernel_size=[5, 5], sigma=[sigma, sigma])
    x = TF.center_crop(x, [size, size])
    if float(torch.rand(1, generator=generator)) < 0.5:
        x = TF.horizontal_flip(x)
    if noise_std is None:
        return x.clamp(0.0, 1.0)
    noise = torch.randn(
        x.shape, generator=noise_generator or generator, device=x.device, dtype=x.dtype
    )
    return (x + noise_std * noise).clamp(0.0, 1.0)


def soft_cross_entropy(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """CoTTA's loss per sample: ``-sum softmax(teacher) * log_softmax(student)`` ``[B]``
    (float32; the teacher is not differentiated)."""
    target = teacher_logits.detach().float().softmax(dim=1)
    return -(target * student_logits.float().log_softmax(dim=1)).sum(dim=1)


@torch.no_grad()
def ema_update_(
    teacher: Sequence[torch.Tensor], student: Sequence[torch.Tensor], momentum: float
) -> None:
    """Mean-teacher update in place: ``t <- momentum * t + (1 - momentum) * s``."""
    for t, s in zip(teacher, student, strict=True):
        t.mul_(momentum).add_(s.detach(), alpha=1 - momentum)


@torch.no_grad()
def stochastic_restore_(
    params: Sequence[torch.Tensor],
    source: Sequence[torch.Tensor],
    prob: float,
    generator: torch.Generator,
) -> None:
    """Return each element of ``params`` to its ``source`` value with probability ``prob``
    (mask ``rand < prob`` per element, drawn from ``generator`` on the parameters' device)."""
    for p, src in zip(params, source, strict=True):
        mask = torch.rand(p.shape, generator=generator, device=p.device) < prob
        p.copy_(torch.where(mask, src, p))


class CoTTA(GradientMethod):
    """Mean teacher + augmentation-averaged pseudo-labels + stochastic restore."""

    Config = CoTTAConfig
    predict_from_last_forward = True

    def setup(self) -> None:
        super().setup()
        names = {id(p): n for n, p in self.model.named_parameters()}
        self._names = [names[id(p)] for p in self.params]
        #: The adapted parameters' source values: the anchor model and the restore target.
        self.source_params = [p.detach().clone() for p in self.params]
        #: The EMA teacher, one tensor per adapted parameter (starts at the source).
        self.teacher = [p.detach().clone() for p in self.params]
        self._device_generator: torch.Generator | None = None

    def configure(self, model: ZeroShotClassifier) -> None:
        use_batch_statistics(model.visual)

    def collect_params(self, model: ZeroShotClassifier) -> list[nn.Parameter]:
        return list(model.visual.parameters())

    def compute_loss(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(student loss [B], teacher prediction [B, C])``: the cross-entropy of the
        student's logits to the teacher's prediction, which is also the batch's prediction."""
        student = self.model(images)
        teacher = self.teacher_prediction(images)
        return soft_cross_entropy(student, teacher), teacher

    def reset(self) -> None:
        super().reset()
        with self.timed("adapt"), torch.no_grad():
            for t, src in zip(self.teacher, self.source_params, strict=True):
                t.copy_(src)

    # -- teacher ---------------------------------------------------------------------------
    def _forward_with(self, tensors: Sequence[torch.Tensor], images: torch.Tensor) -> torch.Tensor:
        return functional_call(self.model, dict(zip(self._names, tensors)), (images,))

    def _generator(self) -> torch.Generator:
        """``self.generator`` on the CPU; on another device, a generator there seeded from
        it (one draw per call)."""
        if self.device.type == "cpu":
            return self.generator
        if self._device_generator is None:
            self._device_generator = torch.Generator(device=self.device)
        seed = int(torch.randint(0, 2**62, (1,), generator=self.generator))
        return self._device_generator.manual_seed(seed)

    @torch.no_grad()
    def teacher_prediction(self, images: torch.Tensor) -> torch.Tensor:
        """The teacher's logits ``[B, C]``: plain, or averaged over augmented copies when
        the source model's mean max-probability is below ``confidence_threshold``."""
        cfg = self.config
        anchor = self._forward_with(self.source_params, images).float().softmax(dim=1)
        if float(anchor.max(dim=1).values.mean()) >= cfg.confidence_threshold:
            return self._forward_with(self.teacher, images).float()
        noise = self._generator()
        total = None
        for _ in range(cfg.augmentations):
            view = cotta_augment(images, self.generator, noise, noise_std=cfg.noise_std)
            out = self._forward_with(self.teacher, view).float()
            total = out if total is None else total + out
        return total / cfg.augmentations

    # -- adaptation ------------------------------------------------------------------------
    def adapt(self, images: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        prediction = None
        for _ in range(cfg.steps):
            with torch.enable_grad(), self.autocast():
                loss, prediction = self.compute_loss(images)
                loss = loss.mean()
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            ema_update_(self.teacher, self.params, cfg.teacher_momentum)
            if cfg.restore_prob > 0:
                generator = self._generator()
                stochastic_restore_(self.params, self.source_params, cfg.restore_prob, generator)
            self.last_loss = loss.detach()
        return prediction
