"""SoTTA: robust test-time adaptation on noisy data streams.

Paper: Gong, Kim, Lee, Chottananurak, Lee, "SoTTA: Robust Test-Time Adaptation on Noisy Data
Streams", NeurIPS 2023, https://arxiv.org/abs/2310.10074.
Official code: https://github.com/taeckyung/SoTTA, commit
50b33330b44ebd831ef2f8669f1be07b96bb3444 (MIT; learner/sotta.py: SoTTA.__init__,
train_online, step; learner/dnn.py: the optimiser (``--esm``), the memory, the online
evaluation; utils/memory.py: HUS; utils/sam_optimizer.py: SAM, sam_collect_params;
utils/loss_functions.py: HLoss; main.py: arguments; conf.py: CIFAR10Opt; tta.sh: the
published runs). Also read, for its CLIP port: MarcLafon/cliptta, commit
f4221f4f2b3bfbd220f8836411bbd3774758933d (ttavlm/methods/sotta.py,
ttavlm/configuration.py, ttavlm/methods/__init__.py).

Which code the defaults follow: the official tta.sh for CIFAR-10-C (``cifar10noisy``), since
the digits suites are, like CIFAR-10-C, 10-class 32 px corruption sets; CLIPTTA's port
differs as listed below.

Along the stream, as officially (``train_online``, one sample at a time):

1. each sample is predicted by the current model in eval mode (BatchNorm with its running
   statistics); these logits are its prediction (officially the online evaluation of every
   ``update_every`` samples uses the model of their arrival: no update happens between);
2. HUS (high-confidence uniform-class sampling): the sample is offered to the memory under
   its pseudo-label ``argmax p`` with confidence ``max p``; it is dropped when
   ``max p < high_threshold``; otherwise, if the memory holds ``memory_size`` samples, one
   is evicted first: a random one of a random class among the largest classes when the
   pseudo-label's class is not one of them, else a random one of its own class; then it
   is stored (while the memory has room every confident sample goes in);
3. after every ``update_every``-th sample of the stream (possibly mid-batch: the rest of the
   batch is then predicted and offered with the updated model): ``steps`` passes (official
   ``epoch``) over the memory, shuffled, in chunks of ``memory_batch_size``, each chunk one
   ESM step: forward in train mode (BatchNorm on the chunk's statistics, running
   statistics updated with momentum ``bn_momentum``), loss ``HLoss`` = mean over the chunk
   of ``-sum softmax(z / T) log(softmax(z / T) + 1e-6)``; SAM ascent of the adapted
   parameters by ``rho * g / (||g|| + 1e-12)``; a second forward and backward there; back
   to the unperturbed parameters and one Adam step with the second gradient.

Own OOD score: the prediction's maximum softmax probability, the quantity HUS compares with
``high_threshold`` to reject a sample (higher = more in-distribution).

Defaults (official tta.sh, cifar10noisy): memory 64, update every 64 samples, confidence
threshold 0.99, one epoch, memory batch 128 (conf.py's CIFAR-10 batch size, larger than the
memory: one chunk), temperature 1, ESM with rho 0.05 over Adam lr 1e-3 (betas 0.9, 0.999),
weight decay 5e-4 (tta.sh passes ``--weight_decay 0``, which main.py's ``if
conf.args.weight_decay:`` ignores, so conf.py's CIFAR-10 value 0.0005 stays), BatchNorm
momentum 0.2 with learned statistics (``--use_learned_stats``), float32. Parameters
(``sam_collect_params(freeze_top=True)``): the affine parameters of every
BatchNorm/LayerNorm/GroupNorm except those of the top blocks (ResNet ``layer4``, timm ViT-B
``blocks.9``-``blocks.11`` and the final ``norm``), mapped to CLIP towers as SAR's rule
(``mura_plugin.methods.sar``): the deepest quarter of the blocks and the final norm
(``ln_post``) stay frozen. On CLIP ViTs that is LayerNorm affine only, as the TENT family
here (docs/methods.md); the text tower is frozen.

What differs and why:
* Parameters: LayerNorm affine on CLIP ViTs (the official ResNet-18 has BatchNorm only); on
  a LayerNorm tower train and eval mode are the same, so ``bn_momentum`` has no effect.
* Random eviction draws from the method's generator (official: Python's ``random``), so runs
  reproduce per seed; the shuffle of the memory as well (official: the DataLoader's).
* A memory of one sample is adapted on in eval mode (officially a one-sample BatchNorm
  forward in train mode fails).
* SAM is written out (``mura_plugin.methods.sar``: ascent, restore, then the base Adam step),
  the official SAM optimiser's arithmetic; its ``_grad_norm`` covers the optimised
  parameters only, as here.
* The per-class offer counter is kept (``counter``; officially unused by the update).
* The stream's leftover samples after the last multiple of ``update_every`` are predicted
  here (officially dropped from the evaluation).
* CLIPTTA's CLIP port (not followed): confidence threshold 0.5, an update on the memory
  after every batch, a plain Adam step unless ``--use_sam``, all LayerNorms of the image
  tower, logits scaled by a fixed 100, prediction from a forward after the update.

Measured effect: not measured (docs/methods.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from mura_plugin.methods.sar import sam_ascent, sam_restore, sar_parameters
from tta_bench.bounds import bounded, one_of
from tta_bench.method import PRECISIONS, GradientConfig, GradientMethod
from tta_bench.model import ZeroShotClassifier

__all__ = ["HUSMemory", "SoTTA", "SoTTAConfig", "hloss"]


@dataclass
class SoTTAConfig(GradientConfig):
    """The official SoTTA setting on CIFAR-10-C (tta.sh, conf.py)."""

    optimizer: str = "adam"
    lr: float = 1e-3
    #: conf.py's CIFAR-10 value (tta.sh's 0 is ignored by main.py; see the header).
    weight_decay: float = 5e-4
    #: Passes over the memory per update (official ``epoch``).
    steps: int = bounded(1, ge=1)
    precision: str = one_of("fp32", PRECISIONS)
    #: Capacity of the HUS memory (official ``memory_size``).
    memory_size: int = bounded(64, ge=1)
    #: Adapt after every this many test samples (official ``update_every_x``).
    update_every: int = bounded(64, ge=1)
    #: HUS confidence threshold on the maximum softmax (official ``high_threshold``).
    high_threshold: float = bounded(0.99, ge=0, le=1)
    #: Memory samples per ESM step (official ``opt['batch_size']``).
    memory_batch_size: int = bounded(128, ge=1)
    #: Softmax temperature of the entropy loss (official ``temperature``).
    temperature: float = bounded(1.0, gt=0)
    #: ESM (SAM) neighbourhood radius.
    rho: float = bounded(0.05, ge=0)
    #: Fraction of the deepest blocks (ViT) / stages (ResNet) whose norms stay frozen.
    exclude_top: float = bounded(0.25, ge=0, lt=1)
    #: Keep the tower's final norm (CLIP ``ln_post``, timm ``norm``) frozen too.
    exclude_final_norm: bool = True
    #: BatchNorm running-statistics momentum in the memory forwards (official ``bn_momentum``).
    bn_momentum: float = bounded(0.2, gt=0, le=1)


def hloss(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """SoTTA's ``HLoss``: the mean over samples of ``-sum q log(q + 1e-6)``,
    ``q = softmax(logits / temperature)`` (float32)."""
    q = (logits.float() / temperature).softmax(dim=1)
    return -(q * torch.log(q + 1e-6)).sum(dim=1).mean()


# -- the HUS memory ----------------------------------------------------------------------------
class HUSMemory:
    """SoTTA's high-confidence uniform-class sampling memory.

    ``classes[c]`` holds ``(data, confidence)`` items of pseudo-label ``c`` in insertion order;
    ``data`` is anything (the method stores image tensors). ``draw(n)`` returns a random index
    in ``[0, n)`` (the method's generator)."""

    def __init__(self, capacity: int, num_classes: int, threshold: float):
        if num_classes < 1:
            raise ValueError(f"sotta's memory needs at least 1 class, got {num_classes}")
        self.capacity = int(capacity)
        self.num_classes = int(num_classes)
        self.threshold = float(threshold)
        self.classes: list[list[tuple[Any, float]]] = [[] for _ in range(self.num_classes)]
        #: Offers per pseudo-label, rejected ones included (the official ``counter``).
        self.counter = [0] * self.num_classes

    def __len__(self) -> int:
        return sum(len(items) for items in self.classes)

    def sizes(self) -> list[int]:
        return [len(items) for items in self.classes]

    def add(self, data: Any, label: int, confidence: float, draw: Callable[[int], int]) -> bool:
        """Offer one sample; returns whether it was stored."""
        label = int(label)
        self.counter[label] += 1
        if confidence < self.threshold:
            return False
        if len(self) >= self.capacity:
            self._evict(label, draw)
        self.classes[label].append((data, float(confidence)))
        return True

    def _evict(self, label: int, draw: Callable[[int], int]) -> None:
        sizes = self.sizes()
        largest = [c for c, size in enumerate(sizes) if size == max(sizes)]
        victim = label if label in largest else largest[draw(len(largest))]
        del self.classes[victim][draw(len(self.classes[victim]))]

    def contents(self) -> list[Any]:
        """The stored data, class by class, each class in insertion order."""
        return [data for items in self.classes for data, _ in items]

    def state(self) -> dict[str, Any]:
        return {"classes": [list(items) for items in self.classes], "counter": list(self.counter)}

    def load_state(self, state: dict[str, Any]) -> None:
        self.classes = [list(items) for items in state["classes"]]
        self.counter = list(state["counter"])


# -- the method --------------------------------------------------------------------------------
class SoTTA(GradientMethod):
    """HUS memory + entropy-sharpness minimisation on it, every ``update_every`` samples."""

    Config = SoTTAConfig
    stream_kind: ClassVar[str | None] = "online"
    own_ood_score: ClassVar[str | None] = "sotta: maximum softmax (HUS confidence)"

    def setup(self) -> None:
        cfg = self.config
        self.memory = HUSMemory(cfg.memory_size, self.model.num_classes, cfg.high_threshold)
        #: Test samples offered to the memory since setup/reset (the update clock).
        self.seen = 0
        #: Memory updates since setup/reset.
        self.updates = 0
        super().setup()

    def configure(self, model: ZeroShotClassifier) -> None:
        """BatchNorm keeps (and, in the memory forwards, updates) running statistics with
        momentum ``bn_momentum`` (official ``--use_learned_stats``); eval mode otherwise."""
        self._batch_norms = [
            m for m in model.visual.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
        ]
        for m in self._batch_norms:
            if m.running_mean is None:
                raise ValueError("sotta's learned statistics need BatchNorms with running stats")
            m.momentum = self.config.bn_momentum
            m.eval()

    def collect_params(self, model: ZeroShotClassifier) -> list[nn.Parameter]:
        return sar_parameters(model, self.config, "sotta")

    def extra_state(self) -> dict[str, Any]:
        return {"memory": self.memory.state(), "seen": self.seen, "updates": self.updates}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.memory.load_state(state["memory"])
        self.seen = state["seen"]
        self.updates = state["updates"]

    def compute_loss(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(HLoss broadcast to [B], logits)`` of one forward (the contract's hook; the ESM
        step computes ``hloss`` directly)."""
        logits = self.model(images)
        loss = hloss(logits, self.config.temperature)
        return loss.expand(images.shape[0]), logits

    @contextlib.contextmanager
    def _batch_norm_training(self, train: bool) -> Iterator[None]:
        for m in self._batch_norms:
            m.train(train)
        try:
            yield
        finally:
            for m in self._batch_norms:
                m.eval()

    # -- prediction ------------------------------------------------------------------------
    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """The current model's logits in eval mode; the own score is their maximum softmax."""
        with self.autocast():
            logits = self.model(images).float()
        self.last_ood_score = logits.softmax(dim=1).amax(dim=1)
        return logits

    def _draw(self, n: int) -> int:
        return int(torch.randint(n, (1,), generator=self.generator))

    def step(self, images: torch.Tensor) -> torch.Tensor:
        """Predict and offer the batch in segments that end where the stream reaches a
        multiple of ``update_every``; update there."""
        every, outputs, start = self.config.update_every, [], 0
        while start < images.shape[0]:
            end = min(images.shape[0], start + every - self.seen % every)
            with self.timed("predict"):
                logits = self.predict(images[start:end])
            outputs.append(logits)
            with self.timed("adapt"):
                self.offer(images[start:end], logits)
                if self.seen % every == 0:
                    self.update()
            start = end
        logits = torch.cat(outputs)
        self.last_ood_score = logits.softmax(dim=1).amax(dim=1)
        return logits

    def offer(self, images: torch.Tensor, logits: torch.Tensor) -> None:
        """Offer each sample to HUS under its pseudo-label and confidence, in stream order."""
        confidence, labels = logits.float().softmax(dim=1).max(dim=1)
        for i, (label, conf) in enumerate(zip(labels.tolist(), confidence.tolist())):
            self.memory.add(images[i].detach().clone(), label, conf, self._draw)
            self.seen += 1

    # -- adaptation ------------------------------------------------------------------------
    def update(self) -> None:
        """``steps`` shuffled passes over the memory, one ESM step per chunk."""
        data = self.memory.contents()
        if not data:
            return
        memory = torch.stack(data)
        for _ in range(self.config.steps):
            order = torch.randperm(memory.shape[0], generator=self.generator)
            for chunk in memory[order.to(memory.device)].split(self.config.memory_batch_size):
                self.esm_step(chunk)
        self.updates += 1

    def esm_step(self, images: torch.Tensor) -> None:
        """One entropy-sharpness step: HLoss, SAM ascent, HLoss again, restore, Adam."""
        with self._batch_norm_training(images.shape[0] > 1):
            self.optimizer.zero_grad(set_to_none=True)
            with torch.enable_grad(), self.autocast():
                first = hloss(self.model(images), self.config.temperature)
            first.backward()
            saved = sam_ascent(self.params, self.config.rho)
            self.optimizer.zero_grad(set_to_none=True)
            with torch.enable_grad(), self.autocast():
                second = hloss(self.model(images), self.config.temperature)
            second.backward()
            sam_restore(self.params, saved)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.last_loss = first.detach()

    def adapt(self, images: torch.Tensor) -> torch.Tensor:
        """``step`` (the predictions, the memory and its updates)."""
        return self.step(images)
