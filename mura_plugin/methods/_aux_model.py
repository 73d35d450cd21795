"""A second registered model beside the run's own (RLCF's reward ``teacher``, COSMIC's
auxiliary encoder ``aux_model``): built by its name in the model registry with its factory's
keyword arguments, as a frozen ``ZeroShotClassifier`` over the run's classes on the run's
device. Nothing is downloaded: a model whose weights are not on the machine fails to build."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tta_bench.model import ZeroShotClassifier

__all__ = ["aux_classifier"]


def aux_classifier(
    model: ZeroShotClassifier,
    name: str,
    args: dict[str, Any],
    templates: Sequence[str],
    device: torch.device,
) -> tuple[ZeroShotClassifier, Any]:
    """``(classifier, bundle)``: registered model ``name`` built with ``args``, its head
    over ``model``'s classes with ``templates`` (``model``'s dataset, text chunking and
    text cache), frozen, on ``device``; the bundle says what the results record of it
    (name, weights tag and SHA-256)."""
    from tta_bench.registry import registry

    bundle = registry("models").get(name)(**dict(args))
    bundle.clip.to(device)
    classifier = ZeroShotClassifier(
        bundle,
        model.classnames,
        templates,
        model.dataset,
        text_chunk_size=model.text_chunk_size,
        text_cache=model.text_cache,
    ).to(device)
    classifier.requires_grad_(False)
    return classifier, bundle
