"""STAMP: outlier-aware test-time adaptation with a stable memory and SAM.

Paper: Yu, Sheng, He, Xu, Liu, "STAMP: Outlier-Aware Test-Time Adaptation with Stable
Memory Replay", ECCV 2024, https://arxiv.org/abs/2407.15773.
Official code: https://github.com/yuyongcan/STAMP, read at commit
dbdb2a98274654850ca3713cbdd1dafc7f244f2c (no licence file: read only; src/methods/stamp.py:
RBM, STAMP; src/methods/setup.py: setup_stamp; src/utils/sam.py; src/utils/conf.py;
src/data/data.py: get_transform, get_stamp_transforms;
src/data/augmentations/transforms_cotta.py; src/utils/utils.py: get_accuracy,
softmax_entropy; test-time-evaluation.py; test-time-eva-baseline.sh;
cfgs/Online_TTA_os/cifar10_c_svhn/stamp.yaml). CLIP port read
for comparison: MarcLafon/cliptta, commit f4221f4f2b3bfbd220f8836411bbd3774758933d
(ttavlm/methods/stamp.py, ttavlm/configuration.py); none of its scripts runs STAMP.

Per batch, as officially (its branch for fewer than 1000 classes):

1. the current model predicts the batch (logits ``z``) and ``views`` augmented copies of
   every image; the prediction ``p`` is the mean of the ``1 + views`` softmaxes (returned
   as ``log p``: its softmax is ``p``); ``H = -sum p log(p + 1e-5)``;
2. reliable samples: the current model's argmax of ``z`` equals the source model's
   (consistency filter, official ``norm_model``: the model as configured before any
   update) and ``H < alpha ln C``; they enter the memory under the label ``argmax z``;
3. the class-balanced stable memory (official ``RBM``, capacity 64): while it holds fewer
   than 64 items a newcomer is added; otherwise one item is evicted first, the oldest of a
   class chosen at random among the non-empty classes whose moving count is the largest;
   the moving count of each class is updated whenever the memory is read,
   ``n_c <- 0.9 n_c + 0.1 |class c|`` (so eviction lags the current sizes);
4. if the memory holds anything: its images (class by class, oldest first) give the
   self-weighted entropy ``mean_i(H_i * 64 * softmax(-H)_i)`` (``H_i`` the entropy of the
   memory image's softmax; the weights are not detached, as officially) and one SAM update
   (rho 0.05: ascent, second forward and backward on the memory, back, base SGD step); the
   base learning rate follows a cosine schedule over ``t_max`` updates,
   ``lr * (1 + cos(pi k / t_max)) / 2`` after ``k`` updates (torch's
   ``CosineAnnealingLR``, periodic beyond ``t_max``);
5. own OOD score (the official evaluation's): ``-H`` of step 1 (higher = in-distribution).

Augmented views (official ``get_stamp_transforms`` for ``cifar10_c``: the CoTTA/KATANA
transforms, ``mura_plugin.methods.cotta.cotta_augment``, non-soft, noise std 0.005), each
view of each image with its own random draw, as the official per-sample dataset transform.

Defaults = the official CIFAR-10-C setting (test-time-eva-baseline.sh for ``cifar10_c``:
``OPTIM_LR`` 0.1, ``STAMP_ALPHA`` 0.25, which override the yaml's 0.05 / 0.45): SAM over
SGD (lr 0.1, no momentum, no weight decay, rho 0.05, not adaptive), alpha 0.25 (threshold
``0.25 ln C``), memory 64, 15 views, consistency filter on, cosine schedule over 150 updates
(750 for 1000 classes officially), float32, one update per batch. The CLIP port's defaults
(memory 128, alpha 0.45, Adam 1e-3 without SAM, no schedule, no consistency filter) are not
a CLIP setting of STAMP (no script of it runs STAMP), so the official one is followed.

Parameters (official ``collect_params``): the norm affine parameters outside the top blocks
(``layer4``, ``blocks.9``-``blocks.11``, the final ``norm``), the same mapping as SAR's
(``mura_plugin.methods.sar.sar_parameters``: the deepest quarter of the blocks and the final
norm stay frozen); BatchNorm with test-batch statistics (official ``configure_model``).

What differs and why:
* The source model of the consistency filter is the adapted modules run with the values
  saved at ``setup()`` (``torch.func.functional_call``; official: a deep copy); the same
  forward.
* The random class of an eviction and the views are drawn from the method's generator
  (official: Python's ``random`` and torchvision on the global RNGs); on CUDA the views'
  noise comes from a device generator seeded from it.
* The views are rendered from the image at the model's input size with torchvision v2
  kernels (official: per-sample torchvision v1 transforms of the 32 px image); the same
  operations and ranges relative to the image size.
* The prediction is the log of the mean probability, computed in log space (official: the
  mean probability itself, whose argmax is the same).
* The official weight normaliser is the literal 64 (the memory size); here
  ``memory_size``.
* ``last_loss`` is the loss at the unperturbed point (the official code records none).
* The source forward of the consistency filter is skipped when no sample of the batch
  passes the entropy threshold (officially always run): the same memory.
* The views of a batch are built one image at a time (each its own draw, as officially),
  so a batch costs ``B x views`` augmentation calls besides ``1 + views`` forwards.
* ``reset()`` empties the memory (and its moving counts) and restarts the schedule, and
  restores parameters and optimiser, as the official ``reset``.
* The official ImageNet branch (1000 classes: no consistency filter, 750-update schedule,
  lr 0.01, alpha 0.8, crop-and-flip views) is not selected by class count;
  ``consistency_filter`` and ``t_max`` give its filter and schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.func import functional_call

from mura_plugin.methods._norm import use_batch_statistics
from mura_plugin.methods.cotta import cotta_augment
from mura_plugin.methods.sar import sam_ascent, sam_restore, sar_parameters
from tta_bench.bounds import bounded, one_of
from tta_bench.method import OPTIMIZERS, PRECISIONS, GradientConfig, GradientMethod
from tta_bench.model import ZeroShotClassifier

__all__ = [
    "STAMP",
    "STAMPConfig",
    "StableMemory",
    "cosine_lr",
    "mean_view_log_probs",
    "memory_loss",
    "reliable_mask",
    "stamp_entropy",
]


@dataclass
class STAMPConfig(GradientConfig):
    """The official STAMP CIFAR-10-C setting (test-time-eva-baseline.sh)."""

    optimizer: str = one_of("sgd", OPTIMIZERS)  # SAM's base optimiser
    lr: float = bounded(0.1, gt=0)
    weight_decay: float = bounded(0.0, ge=0)
    momentum: float = bounded(0.0, ge=0, le=1)
    #: One memory update per batch (fixed: more would re-insert the batch).
    steps: int = bounded(1, ge=1, le=1)
    precision: str = one_of("fp32", PRECISIONS)
    #: Reliability threshold as a fraction of ln C (official ``STAMP.ALPHA``).
    alpha: float = bounded(0.25, gt=0)
    #: Capacity of the stable memory (official ``RBM(64, ...)``).
    memory_size: int = bounded(64, ge=1)
    #: Augmented views per image averaged with the image (official ``STAMP.NUM_AUG``).
    views: int = bounded(15, ge=0)
    #: Keep only samples whose current and source predictions agree (official, < 1000 classes).
    consistency_filter: bool = True
    #: SAM neighbourhood radius.
    rho: float = bounded(0.05, ge=0)
    #: Period of the cosine learning-rate schedule in updates (official 150; 750 on ImageNet).
    t_max: int = bounded(150, ge=1)
    #: Fraction of the deepest blocks whose norms stay frozen (official: blocks 9-11 of 12).
    exclude_top: float = bounded(0.25, ge=0, lt=1)
    #: Keep the tower's final norm frozen too (official: ``norm`` skipped).
    exclude_final_norm: bool = True
    #: Standard deviation of the views' additive Gaussian noise (CoTTA transforms).
    noise_std: float = bounded(0.005, ge=0)


# -- the stable memory -----------------------------------------------------------------------
class StableMemory:
    """STAMP's class-balanced stable memory (official ``RBM``). ``classes[c]`` holds the
    items of pseudo-label ``c``, oldest first; ``counts`` the float32 moving class counts."""

    def __init__(self, capacity: int, num_classes: int):
        self.capacity = int(capacity)
        self.num_classes = int(num_classes)
        self.classes: list[list[Any]] = [[] for _ in range(self.num_classes)]
        self.counts = torch.zeros(self.num_classes, dtype=torch.float32)
        self.total = 0

    def __len__(self) -> int:
        return self.total

    def eviction_candidates(self) -> list[int]:
        """The non-empty classes whose moving count is the largest among non-empty ones
        (a count of 0 is the floor, as officially)."""
        top = 0.0
        for c in range(self.num_classes):
            if self.classes[c] and float(self.counts[c]) > top:
                top = float(self.counts[c])
        return [c for c in range(self.num_classes) if self.classes[c] and self.counts[c] == top]

    def evict(self, generator: torch.Generator) -> int:
        """Drop the oldest item of a class drawn uniformly among ``eviction_candidates``;
        returns that class."""
        candidates = self.eviction_candidates()
        pick = candidates[int(torch.randint(len(candidates), (1,), generator=generator))]
        self.classes[pick].pop(0)
        return pick

    def add(self, items: list[Any], labels: list[int], generator: torch.Generator) -> None:
        """Insert ``items`` in order under ``labels``, evicting one first when full."""
        for item, label in zip(items, labels, strict=True):
            if self.total < self.capacity:
                self.total += 1
            else:
                self.evict(generator)
            self.classes[int(label)].append(item)

    def read(self) -> list[Any]:
        """Every item, class by class, oldest first; updates the moving counts."""
        items: list[Any] = []
        for c in range(self.num_classes):
            items.extend(self.classes[c])
            self.counts[c] = 0.9 * self.counts[c] + 0.1 * len(self.classes[c])
        return items

    def state(self) -> dict[str, Any]:
        return {
            "classes": [list(items) for items in self.classes],
            "counts": self.counts.clone(),
            "total": self.total,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.classes = [list(items) for items in state["classes"]]
        self.counts = state["counts"].clone()
        self.total = int(state["total"])


# -- the rules -------------------------------------------------------------------------------
def mean_view_log_probs(view_logits: torch.Tensor) -> torch.Tensor:
    """``log mean_v softmax(view_logits[v])`` ``[B, C]`` of ``[V, B, C]`` (float32)."""
    logp = view_logits.float().log_softmax(dim=-1)
    return torch.logsumexp(logp, dim=0) - math.log(logp.shape[0])


def stamp_entropy(log_probs: torch.Tensor) -> torch.Tensor:
    """The official filter entropy ``-sum p log(p + 1e-5)`` of ``p = exp(log_probs)``."""
    p = log_probs.exp()
    return -(p * torch.log(p + 1e-5)).sum(dim=-1)


def reliable_mask(
    entropy: torch.Tensor,
    margin: float,
    current_pred: torch.Tensor,
    source_pred: torch.Tensor | None,
) -> torch.Tensor:
    """``[B]`` samples that enter the memory: ``entropy < margin`` and, with
    ``source_pred`` (the consistency filter), the same argmax as the source model."""
    keep = entropy < margin
    if source_pred is not None:
        keep = keep & (current_pred == source_pred)
    return keep


def memory_loss(logits: torch.Tensor, normaliser: float) -> torch.Tensor:
    """STAMP's self-weighted entropy of the memory: ``mean_i(H_i w_i)``, ``w = normaliser *
    softmax(-H)`` over the memory, differentiated through the weights too (float32)."""
    logp = logits.float().log_softmax(dim=-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    weights = torch.softmax(-entropy, dim=0) * normaliser
    return (entropy * weights).mean()


def cosine_lr(base: float, updates: int, t_max: int) -> float:
    """``CosineAnnealingLR``'s rate after ``updates`` steps (eta_min 0, periodic)."""
    return base * (1.0 + math.cos(math.pi * updates / t_max)) / 2.0


# -- the method ------------------------------------------------------------------------------
class STAMP(GradientMethod):
    """Reliable samples -> class-balanced stable memory -> SAM self-weighted entropy."""

    Config = STAMPConfig
    own_ood_score: ClassVar[str | None] = (
        "stamp: negative entropy of the prediction averaged over the image and its views"
    )

    def setup(self) -> None:
        if self.config.loss is not None:
            raise ValueError(
                f"stamp's objective is fixed (memory_loss): method.loss must be null, "
                f"got {self.config.loss!r}"
            )
        self.memory = StableMemory(self.config.memory_size, self.model.num_classes)
        #: SAM updates since setup or reset (the schedule's clock).
        self.updates = 0
        #: Samples offered / stored since setup or reset.
        self.counts = {"seen": 0, "stored": 0}
        self._device_generator: torch.Generator | None = None
        super().setup()
        names = {id(p): n for n, p in self.model.named_parameters()}
        self._source = {
            names[id(p)]: saved for p, saved in zip(self.params, self._snapshot["params"])
        }

    @property
    def margin(self) -> float:
        """The reliability threshold ``alpha ln C`` in nats."""
        return self.config.alpha * math.log(self.model.num_classes)

    def configure(self, model: ZeroShotClassifier) -> None:
        use_batch_statistics(model.visual)

    def collect_params(self, model: ZeroShotClassifier) -> list[nn.Parameter]:
        return sar_parameters(model, self.config, "stamp")

    def extra_state(self) -> dict[str, Any]:
        return {"memory": self.memory.state(), "updates": self.updates, "counts": dict(self.counts)}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.memory.load_state(state["memory"])
        self.updates = state["updates"]
        self.counts = dict(state["counts"])

    # -- forwards ------------------------------------------------------------------------
    def _noise_generator(self) -> torch.Generator:
        """``self.generator`` on the CPU; elsewhere a device generator seeded from it."""
        if self.device.type == "cpu":
            return self.generator
        if self._device_generator is None:
            self._device_generator = torch.Generator(device=self.device)
        seed = int(torch.randint(0, 2**62, (1,), generator=self.generator))
        return self._device_generator.manual_seed(seed)

    def augmented(self, images: torch.Tensor) -> torch.Tensor:
        """One augmented copy of ``images``, each image with its own random draw."""
        noise = self._noise_generator()
        std = self.config.noise_std
        return torch.cat(
            [
                cotta_augment(images[i : i + 1], self.generator, noise, noise_std=std)
                for i in range(images.shape[0])
            ]
        )

    @torch.no_grad()
    def view_prediction(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log mean probability [B, C], logits of the image itself [B, C])`` of the
        current model over the image and its ``views`` augmented copies."""
        with self.autocast():
            logits = self.model(images).float()
        total = logits.log_softmax(dim=-1)
        for _ in range(self.config.views):
            with self.autocast():
                view = self.model(self.augmented(images)).float()
            total = torch.logaddexp(total, view.log_softmax(dim=-1))
        return total - math.log(1 + self.config.views), logits

    @torch.no_grad()
    def source_logits(self, images: torch.Tensor) -> torch.Tensor:
        """The source model's logits (the adapted modules with their ``setup()`` values)."""
        with self.autocast():
            return functional_call(self.model, self._source, (images,)).float()

    # -- adaptation ----------------------------------------------------------------------
    def update_memory(
        self, images: torch.Tensor, log_probs: torch.Tensor, logits: torch.Tensor
    ) -> None:
        """Offer the batch to the memory (the reliability and consistency filters)."""
        current = logits.argmax(dim=1)
        entropy = stamp_entropy(log_probs)
        source = None
        if self.config.consistency_filter and bool((entropy < self.margin).any()):
            source = self.source_logits(images).argmax(dim=1)  # only needed if one passes
        keep = reliable_mask(entropy, self.margin, current, source)
        rows = keep.nonzero().flatten().tolist()
        labels = current.tolist()
        self.memory.add(
            [images[i].detach().clone() for i in rows], [labels[i] for i in rows], self.generator
        )
        self.counts["seen"] += images.shape[0]
        self.counts["stored"] += len(rows)

    def compute_loss(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(memory loss, logits)`` of one forward of the memory images ``images``."""
        logits = self.model(images)
        return memory_loss(logits, float(self.config.memory_size)), logits

    def update(self) -> None:
        """One SAM update of the self-weighted entropy on the memory (if not empty)."""
        if len(self.memory) == 0:
            return
        data = torch.stack(self.memory.read())
        lr = cosine_lr(self.config.lr, self.updates, self.config.t_max)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        with torch.enable_grad(), self.autocast():
            first = self.compute_loss(data)[0]
        first.backward()
        saved = sam_ascent(self.params, self.config.rho)
        self.optimizer.zero_grad(set_to_none=True)
        with torch.enable_grad(), self.autocast():
            second = self.compute_loss(data)[0]
        second.backward()
        sam_restore(self.params, saved)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1
        self.last_loss = first.detach()

    def adapt(self, images: torch.Tensor) -> torch.Tensor:
        """``step`` without its timing split: the prediction, then the memory and update."""
        log_probs, logits = self.view_prediction(images)
        self.update_memory(images, log_probs, logits)
        self.update()
        return log_probs

    def step(self, images: torch.Tensor) -> torch.Tensor:
        with self.timed("predict"):
            log_probs, logits = self.view_prediction(images)
        with self.timed("adapt"):
            self.update_memory(images, log_probs, logits)
            self.update()
        self.last_ood_score = -stamp_entropy(log_probs)
        return log_probs

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """The view-averaged prediction of the current model; nothing changes."""
        log_probs = self.view_prediction(images)[0]
        self.last_ood_score = -stamp_entropy(log_probs)
        return log_probs
