"""The zero-shot classifier every method adapts.

``ZeroShotClassifier`` wraps a CLIP-style dual encoder (open_clip, or timm-backed through
open_clip): the image tower ``visual``, the text side needed to rebuild class embeddings
(prompt tuning), the class text embeddings built from class names x templates (prompt
ensemble), and the logit scale. It takes images as float tensors in [0, 1] at
``image_size`` and normalises them itself, so shifts and augmentations work in pixel space.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tta_bench import text_head


@dataclass(frozen=True)
class Preprocess:
    """What the model expects: square input size and per-channel normalisation."""

    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


@dataclass
class ModelBundle:
    """What a model factory returns: the CLIP model, its tokenizer and its preprocessing."""

    clip: nn.Module
    tokenizer: Callable[[Sequence[str]], torch.Tensor]
    preprocess: Preprocess
    name: str
    weights: str  # pretrained tag, checkpoint path or shipped file name
    #: SHA-256 of the weights file the model was loaded from, when there is one.
    weights_sha256: str | None = None


def format_prompts(classnames: Sequence[str], templates: Sequence[str]) -> list[str]:
    return [t.format(c) for c in classnames for t in templates]


class ZeroShotClassifier(nn.Module):
    """Images in [0, 1] -> class logits ``[B, C]`` = scale * <image feature, class embedding>
    (+ the model's ``logit_bias`` where it has one: sigmoid-loss models such as SigLIP)."""

    def __init__(
        self,
        bundle: ModelBundle,
        classnames: Sequence[str],
        templates: Sequence[str],
        dataset: str | None = None,
        *,
        text_chunk_size: int = text_head.DEFAULT_CHUNK_PROMPTS,
        text_cache: bool = True,
        class_prompts: Mapping[str, Sequence[str]] | None = None,
    ):
        super().__init__()
        if not classnames:
            raise ValueError("a zero-shot classifier needs at least one class name")
        if not templates and class_prompts is None:
            raise ValueError("a zero-shot classifier needs at least one prompt template")
        self.clip = bundle.clip
        self.tokenizer = bundle.tokenizer
        self.preprocess = bundle.preprocess
        self.model_name = bundle.name
        self.weights = bundle.weights
        self.classnames = list(classnames)
        #: The protocol's text head: every method starts from these templates ...
        self.templates = list(templates)
        #: ... and, under the prompt modes ``cupl``/``all`` (``tta_bench.prompts``), each
        #: class's own sentences (None: templates only). Methods that encode prompts from
        #: ``templates`` themselves declare the modes they support (``Method.text_heads``).
        self.class_prompts = (
            None if class_prompts is None else {c: list(class_prompts[c]) for c in classnames}
        )
        #: The registered dataset the classes come from (methods whose official code picks
        #: settings per dataset read it); None outside a benchmark run.
        self.dataset = dataset
        #: Prompts per ``encode_text`` call when building heads, and whether heads go
        #: through the on-disk cache (``tta_bench.text_head``).
        self.text_chunk_size = text_chunk_size
        self.text_cache = text_cache
        self.register_buffer("mean", torch.tensor(bundle.preprocess.mean).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(bundle.preprocess.std).view(1, 3, 1, 1))
        self.clip.eval()
        for p in self.clip.parameters():
            p.requires_grad_(False)
        with torch.no_grad():
            self.register_buffer("class_embeddings", self.build_class_embeddings())

    def __deepcopy__(self, memo: dict[int, object]) -> ZeroShotClassifier:
        """A deep copy (new module tree, tensors and text head) that shares the tokenizer:
        it is stateless (its cache memoises a pure function), and copying its BPE tables
        alone takes about a second. Every copy of a classifier goes through here (the
        runner's method instances, the adapters, ``tta-bench check``, user code); what the
        caller's ``memo`` maps already (the adapters' shared frozen tensors) stays shared."""
        memo.setdefault(id(self.tokenizer), self.tokenizer)
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__dict__, memo))  # nn.Module's own restore
        return new

    @property
    def visual(self) -> nn.Module:
        return self.clip.visual

    @property
    def logit_scale(self) -> torch.Tensor:
        return self.clip.logit_scale.exp()

    @property
    def logit_bias(self) -> torch.Tensor | None:
        """The model's learned logit bias (sigmoid-loss models such as SigLIP), or None. It
        is the same for every class, so it moves no softmax probability and no prediction;
        it is what makes ``sigmoid(logits)`` the model's own match probabilities."""
        return getattr(self.clip, "logit_bias", None)

    @property
    def num_classes(self) -> int:
        return len(self.classnames)

    def build_class_embeddings(self) -> torch.Tensor:
        """The protocol head: ``encode_templates(self.templates, self.class_prompts)``."""
        return self.encode_templates(self.templates, self.class_prompts)

    def encode_templates(
        self,
        templates: Sequence[str],
        class_prompts: Mapping[str, Sequence[str]] | None = None,
    ) -> torch.Tensor:
        """Class embeddings ``[C, D]`` of another template set (a method's official head),
        without changing this classifier: the normalised mean over templates of the
        normalised text embeddings of every class name (with ``class_prompts``, each class's
        own sentences after its formatted templates: ``tta_bench.prompts``), encoded in chunks
        of ``text_chunk_size`` prompts and cached on disk (``tta_bench.text_head``)."""
        return text_head.class_embeddings(
            self.clip,
            self.tokenizer,
            self.classnames,
            list(templates),
            chunk_size=self.text_chunk_size,
            cache=self.text_cache,
            about={"model": self.model_name, "weights": self.weights},
            class_prompts=None if class_prompts is None else dict(class_prompts),
        )

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        return (images - self.mean) / self.std

    def encode_image(self, images: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        """Image features ``[B, D]`` of images in [0, 1], L2-normalised unless
        ``normalize=False`` (the raw projected features some losses need)."""
        size = self.preprocess.image_size
        if images.shape[-1] != size or images.shape[-2] != size:
            raise ValueError(
                f"{self.model_name} expects {size}x{size} images, got "
                f"{tuple(images.shape[-2:])}: the data pipeline must resize to the model's size"
            )
        feats = self.clip.encode_image(self.normalize(images))
        return feats / feats.norm(dim=-1, keepdim=True) if normalize else feats

    def logits_from_features(
        self, features: torch.Tensor, class_embeddings: torch.Tensor | None = None
    ) -> torch.Tensor:
        emb = self.class_embeddings if class_embeddings is None else class_embeddings
        logits = self.logit_scale * features @ emb.t()
        bias = self.logit_bias
        return logits if bias is None else logits + bias

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.logits_from_features(self.encode_image(images))


def state_sha256(module: nn.Module) -> str:
    """SHA-256 of a module's state (every tensor's name, dtype, shape and bytes, in
    ``state_dict`` order): identical weights give the identical hash on any machine."""
    return text_head.tensors_sha256(module.state_dict().items())


def count_parameters(module: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)
