"""The text head a method classifies with (``text_head``, shared by every method of this
plugin): ``protocol`` classifies with the protocol's templates (``model.templates``, the
zero-shot head ``zeroshot`` uses); ``official`` with the head of the method's official
code (``class_head``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tta_bench.model import ZeroShotClassifier

__all__ = ["SINGLE_PROMPT", "TEXT_HEADS", "OwnHead", "check_text_head", "class_head"]

#: protocol: the protocol's templates (``model.templates``, as ``zeroshot``); official: the
#: head of the method's official code.
TEXT_HEADS = ("protocol", "official")

#: The single prompt of TPT's, TTL's and ZERO's official code ("a photo of a" + class + ".";
#: TDA's on digits). On ``digits-c`` (protocol v2, the shipped weights, seed 0, CPU) the frozen
#: zero-shot model scores 57.9% with it against 56.9% with the protocol's templates: the head
#: alone moves a method by about a point there, which is why every method starts from the
#: protocol's head by default.
SINGLE_PROMPT = ("a photo of a {}.",)


def check_text_head(text_head: str) -> None:
    if text_head not in TEXT_HEADS:
        raise ValueError(f"unknown text_head {text_head!r}; available: {', '.join(TEXT_HEADS)}")


def class_head(model: ZeroShotClassifier, text_head: str, official: Sequence[str]) -> torch.Tensor:
    """Class embeddings ``[C, D]`` a method classifies with: ``protocol`` = the model's own
    head (a copy of ``model.class_embeddings``, built from ``model.templates``); ``official``
    = ``model.encode_templates(official)``. The model is never changed."""
    check_text_head(text_head)
    if text_head == "protocol":
        return model.class_embeddings.detach().clone()
    return model.encode_templates(list(official)).to(model.class_embeddings)


class OwnHead:
    """For a method that classifies with its own text head ``self.head`` ``[C, D]``, set in
    its ``setup`` by ``class_head`` (the shared model's head is never changed)."""

    head: torch.Tensor

    def class_embeddings(self) -> torch.Tensor:
        """The text head this method classifies with ``[C, D]`` (``text_head``)."""
        return self.head

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """A batch the realtime track reveals while the method is busy: the (maybe
        adapted) model's features on this method's own head, no views, no update; a
        method with a cache or a memory adds it (its own ``predict``)."""
        feats = self.model.encode_image(images).float()
        return self.model.logits_from_features(feats, self.head.float()).float()
