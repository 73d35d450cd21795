"""Methods: a parameter-free zero-shot, a small gradient method, and test instruments.

``spy``, ``needs_source`` record what the harness hands them in class-level lists (read by
in-process tests); ``diverge`` turns its output non-finite after ``after`` batches;
``sleepy`` is zero-shot slowed down, so a test can kill a run mid-way; ``colour_oracle``
reads the class off the image's colour (accuracy 1.0 iff labels follow their images).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from tta_bench.method import GradientConfig, GradientMethod, Method
from tta_bench.model import ZeroShotClassifier

from .data import COLOURS


class ZeroShot(Method):
    """The frozen classifier."""

    is_reference = True

    @torch.no_grad()
    def step(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images).float()


class FeatureMemory(Method):
    """An online method that reads its images only through their features: each batch's
    features are shifted away from the mean feature of the batches before it, so its
    predictions depend on the stream order (``Method.features_only``)."""

    def setup(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seen = 0
        self.total = torch.zeros(self.model.class_embeddings.shape[1])

    @torch.no_grad()
    def step(self, images: torch.Tensor) -> torch.Tensor:
        return self.step_features(self.model.encode_image(images))

    def features_only(self) -> bool:
        return True

    @torch.no_grad()
    def step_features(self, features: torch.Tensor) -> torch.Tensor:
        mean = self.total / max(self.seen, 1)
        logits = self.model.logits_from_features(features - 0.5 * mean).float()
        self.total = self.total + features.sum(dim=0)
        self.seen += len(features)
        return logits


@dataclass
class NormTentConfig(GradientConfig):
    loss: str = "entropy"


class NormTent(GradientMethod):
    """Entropy minimisation of the image tower's LayerNorm affine parameters."""

    Config = NormTentConfig

    def collect_params(self, model: ZeroShotClassifier) -> list[nn.Parameter]:
        return [
            p for m in model.visual.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()
        ]

    def compute_loss(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model(images)
        return self.loss_fn(logits), logits


class ColourOracle(Method):
    """Logits = cosine of each image's mean colour with the class colours (no model)."""

    @torch.no_grad()
    def step(self, images: torch.Tensor) -> torch.Tensor:
        names = self.model.classnames
        colours = torch.tensor([COLOURS[n] for n in names], dtype=torch.float32)
        mean = images.float().mean(dim=(2, 3))
        return (
            10
            * torch.nn.functional.normalize(mean, dim=1)
            @ torch.nn.functional.normalize(colours, dim=1).t().to(images.device)
        )


@dataclass
class OwnScoreConfig:
    #: ``none``; ``missing`` (no score set), ``shape`` (one value too few), ``nan``: the
    #: faults the runner must report rather than score
    fault: str = "none"
    threshold: float = 0.9


class OwnScoreOracle(ColourOracle):
    """``colour_oracle`` with its own OOD score (the largest cosine to a class colour, the
    logits over 10) and decision (the score above ``threshold``)."""

    Config: ClassVar[type] = OwnScoreConfig
    own_ood_score: ClassVar[str | None] = "largest cosine to a class colour"

    @torch.no_grad()
    def step(self, images: torch.Tensor) -> torch.Tensor:
        logits = super().step(images)
        score = logits.max(dim=1).values / 10
        fault = self.config.fault
        if fault == "missing":
            return logits
        if fault == "shape":
            score = score[1:]
        elif fault == "nan":
            score = score.clone()
            score[0] = float("nan")
        self.last_ood_score = score
        self.last_ood_decision = score > self.config.threshold
        return logits


class Spy(Method):
    """Zero-shot that records every call the harness makes on it in ``Spy.calls``:
    ``(name, args, kwargs)``."""

    calls: ClassVar[list[tuple[str, tuple, dict]]] = []

    def __init__(self, model: Any, config: Any = None):
        super().__init__(model, config)
        Spy.calls.append(("__init__", (model, config), {}))

    def setup(self) -> None:
        Spy.calls.append(("setup", (), {}))

    def reset(self) -> None:
        Spy.calls.append(("reset", (), {}))

    def reseed(self, *args: Any, **kwargs: Any) -> None:
        Spy.calls.append(("reseed", args, kwargs))
        super().reseed(*args, **kwargs)

    def set_source(self, *args: Any, **kwargs: Any) -> None:
        Spy.calls.append(("set_source", args, kwargs))

    @torch.no_grad()
    def step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        Spy.calls.append(("step", args, kwargs))
        return self.model(args[0]).float()


@dataclass
class DivergeConfig:
    #: Batches with finite output; from the next one on the output is non-finite.
    after: int = 2
    #: ``logits``: NaN logits; ``loss``: finite logits but an infinite ``last_loss``.
    what: str = "logits"


class Diverge(Method):
    """Zero-shot until ``after`` batches, then NaN logits (or an infinite loss), for good:
    the batch count survives ``reset()``, as a blown-up model would."""

    Config = DivergeConfig
    adapts = True  # the runner reads ``last_loss`` of adapting methods only

    def setup(self) -> None:
        self.steps = 0

    @torch.no_grad()
    def step(self, images: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        logits = self.model(images).float()
        self.last_loss = torch.tensor(0.0)
        if self.steps > self.config.after:
            if self.config.what == "logits":
                logits = torch.full_like(logits, float("nan"))
            else:
                self.last_loss = torch.tensor(float("inf"))
        return logits


@dataclass
class SourceConfig:
    n: int = 6
    #: Ask for the source images' labels too (``needs_source_labels``).
    labels: bool = False


class NeedsSource(Method):
    """Zero-shot that asks for ``n`` clean source images (with their labels when
    ``labels``); ``NeedsSource.received`` holds what ``set_source`` was given, per instance."""

    Config = SourceConfig
    received: ClassVar[list[tuple[Any, ...]]] = []

    @property
    def needs_source_labels(self) -> bool:  # type: ignore[override]
        return bool(self.config.labels)

    def source_images_needed(self) -> int:
        return self.config.n

    def set_source(self, *args: Any, **kwargs: Any) -> None:
        NeedsSource.received.append((args, kwargs))
        super().set_source(*args, **kwargs)

    def setup(self) -> None:
        if self.source is None:
            raise RuntimeError("setup() ran before set_source()")

    @torch.no_grad()
    def step(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images).float()


@dataclass
class SleepyConfig:
    seconds: float = 0.1


class Sleepy(Method):
    """Zero-shot that sleeps ``seconds`` per batch."""

    Config = SleepyConfig

    @torch.no_grad()
    def step(self, images: torch.Tensor) -> torch.Tensor:
        time.sleep(self.config.seconds)
        return self.model(images).float()
