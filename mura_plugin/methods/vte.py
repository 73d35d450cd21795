"""VTE: vision-text-space ensemble (test-time augmentation, no backpropagation).

Paper: Döbler, Marsden, Raichle, Yang, "A Lost Opportunity for Vision-Language Models: A
Comparative Study of Online Test-Time Adaptation for Vision-Language Models"
(https://arxiv.org/abs/2405.14977). Official code:
https://github.com/mariodoebler/test-time-adaptation, read at commit
8b2ed63255d906b6b0afaefc6ae630b9ec4bdaa1: VTE's code is the reference harness itself
(classification/methods/vte.py; cfgs/imagenet_c/vte.yaml, cfgs/imagenet_others/vte.yaml;
conf.py ``TPT.SELECTION_P``, ``CLIP``; datasets/data_loading.py ``get_transform``;
augmentations/transforms_augmix.py; models/model.py ``ZeroShotCLIP``; datasets/prompts.py).

Defaults follow the reference's cfgs (only imagenet_c and imagenet_others exist, and they
agree): one image per episode, ``N_AUGMENTATIONS`` 64 views, ``TPT.SELECTION_P`` 0.1,
``PROMPT_MODE`` ensemble, CLIP in fp16 (``CLIP.PRECISION``'s default; VTE's cfg keeps it).

Per image, with the frozen model (nothing adapts, nothing persists):

1. views: the image itself (view 0) + 63 RandomResizedCrop (scale 0.08-1) + horizontal
   flip crops, each AugMix-ed on the ten fine-grained sets only (the reference's
   ``AugMixAugmenter(use_augmix=dataset in generalization_dataset_names)``);
2. every view's L2-normalised image feature ``f_v`` and logits ``s f_v T^T`` (``s`` the
   logit scale, ``T`` the text head);
3. the ``int(64 * 0.1) = 6`` views of lowest entropy of ``softmax(logits)`` are kept (the
   original only when it is among them);
4. prediction ``s mean_v(f_v) T^T`` over the kept views: the mean of their *features*, not
   renormalised, so exactly the mean of their logits (not of their probabilities).

Text head (``text_head``): ``protocol`` (default) the run's zero-shot head; ``official``
the reference's prompt ensemble (``PROMPT_MODE: ensemble``): the templates of
``<dataset prefix before the first '_'>_templates`` in its datasets/prompts.py, CLIP's 80
ImageNet templates when there is no such list (``official_templates``). Either is the
method's own tensor: the shared model is never changed.

What differs:
* Head: the protocol's templates by default (``text_head=protocol``, the zero-shot head
  every method here starts from; on the default suite itself a prompt ensemble), the
  reference's per-dataset ensemble with ``text_head=official``.
* Views: torchvision's RandomResizedCrop boxes drawn on the image at the model's size and
  resized by one batched bilinear ``grid_sample`` (augment.py), not PIL crops of the raw
  image before Resize + CenterCrop; AugMix is augment.py's (the 9 operations of the
  reference's augmix_ops at severity 1). The reference's 32 px rule (RandomCrop with
  padding 4 on "cifar" sets at crop size 32) never applies to its CLIP runs (224 px);
  here the crops are RandomResizedCrop at any size. The fine-grained rule is the
  catalogue's ``dataset_flags: {augmix: fine_grained}``.
* ``k = max(1, int(V * selection))``: the reference's ``int`` alone keeps no view (a NaN
  mean) below 10 views.
* Precision: fp16 autocast over fp32 weights on CUDA (the reference converts the weights
  to fp16); the view logits, entropies, the feature mean and the output in float32; CPU
  float32. Views of equal entropy are ordered by index (stable sort).
* All views of the batch's images are drawn at once and encoded in chunks of whole images
  within ``view_memory_mb`` (``_view_budget.encode_in_chunks``), not one image at a time:
  the same outputs.

Measured effect: docs/methods.md#vte.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mura_plugin.losses import view_entropy
from mura_plugin.methods._text_heads import TEXT_HEADS as TEXT_HEAD_CHOICES
from mura_plugin.methods._text_heads import OwnHead, class_head
from mura_plugin.methods._view_budget import encode_flat, encode_in_chunks
from mura_plugin.methods._view_config import ViewFields
from tta_bench.bounds import bounded, one_of
from tta_bench.method import PRECISIONS, Method, autocast_context
from tta_bench.text_head import resolve_templates

__all__ = ["VTE", "VTEConfig", "official_templates", "vte_ensemble"]

#: The CIFAR-10/100 prompt ensemble (CLIP's published CIFAR templates), 18 templates.
_CIFAR = tuple(
    f"a {adj}photo of {art} {size}{{}}."
    for art in ("a", "the")
    for adj, size in [
        ("", ""),
        ("blurry ", ""),
        ("black and white ", ""),
        ("low contrast ", ""),
        ("high contrast ", ""),
        ("bad ", ""),
        ("good ", ""),
        ("", "small "),
        ("", "big "),
    ]
)
#: Caltech101's ensemble: 17 forms with "a", then the same with "the" (the reference's order).
_CALTECH_FORMS = (
    "a photo of {a} {{}}.",
    "a painting of {a} {{}}.",
    "{a} plastic {{}}.",
    "a sculpture of {a} {{}}.",
    "a sketch of {a} {{}}.",
    "a tattoo of {a} {{}}.",
    "{a} toy {{}}.",
    "a rendition of {a} {{}}.",
    "{a} embroidered {{}}.",
    "{a} cartoon {{}}.",
    "{a} {{}} in a video game.",
    "{a} plushie {{}}.",
    "{a} origami {{}}.",
    "art of {a} {{}}.",
    "graffiti of {a} {{}}.",
    "a drawing of {a} {{}}.",
    "a doodle of {a} {{}}.",
)
_CALTECH = tuple(form.format(a=a) for a in ("a", "the") for form in _CALTECH_FORMS)
#: The reference's datasets/prompts.py lists a dataset prefix can name (others: ImageNet's).
OFFICIAL_TEMPLATES: dict[str, tuple[str, ...]] = {
    "cifar10": _CIFAR,
    "cifar100": _CIFAR,
    "caltech101": _CALTECH,
    "dtd": tuple(
        f"a photo of {a} {{}} {what}."
        for a in ("a", "the")
        for what in ("texture", "pattern", "thing", "object")
    ),
    "eurosat": tuple(f"a centered satellite photo of {a}{{}}." for a in ("", "a ", "the ")),
    "food101": ("a photo of {}, a type of food.",),
    "sun397": ("a photo of a {}.", "a photo of the {}."),
}


def official_templates(dataset: str | None) -> list[str]:
    """The reference's ``PROMPT_MODE: ensemble`` head for ``dataset``: the list its
    ``<prefix>_templates`` names (prefix: the name before the first ``_``), else (as its
    ``NameError`` fallback: ImageNet and its variants, the digits, the sets whose list has
    another name there) CLIP's 80 ImageNet templates."""
    prefix = (dataset or "").split("_")[0]
    if prefix in OFFICIAL_TEMPLATES:
        return list(OFFICIAL_TEMPLATES[prefix])
    return resolve_templates("clip-imagenet-80")


def vte_ensemble(
    features: torch.Tensor, head: torch.Tensor, scale: float, selection: float
) -> torch.Tensor:
    """VTE's logits ``[B, C]`` from the L2-normalised features of V views of B images,
    ``features [V, B, D]``, and the text head ``[C, D]``: the ``k = max(1, int(V *
    selection))`` views of lowest entropy of ``softmax(scale f T^T)`` give ``scale *
    mean(f) T^T`` (their mean feature, not renormalised)."""
    feats = features.float()
    head = head.float()
    logits = scale * feats @ head.t()  # [V, B, C]
    k = max(1, int(feats.shape[0] * selection))
    chosen = view_entropy(logits).argsort(dim=0, stable=True)[:k]  # [k, B]
    kept = feats.gather(0, chosen[..., None].expand(-1, -1, feats.shape[-1]))
    return scale * kept.mean(dim=0) @ head.t()


@dataclass
class VTEConfig(ViewFields):
    views: int = bounded(63, ge=0)  # augmented views besides the original (64 in all)
    include_original: bool = True
    augmix: bool = False  # AugMix each crop (the reference: on the fine-grained sets only)
    selection: float = bounded(0.1, gt=0, le=1)  # share of lowest-entropy views kept
    text_head: str = one_of(
        "protocol", TEXT_HEAD_CHOICES
    )  # protocol | official (the reference's ensemble: official_templates)
    precision: str = one_of(
        "fp16", PRECISIONS
    )  # autocast on CUDA (the reference's CLIP weights are fp16); CPU: fp32


class VTE(OwnHead, Method):
    Config = VTEConfig
    stream_kind = "episodic"  # one ensemble over each image's own views

    def setup(self) -> None:
        cfg = self.config
        if cfg.views + int(cfg.include_original) < 1:
            raise ValueError("vte needs a view: views=0 keeps only the image (include_original)")
        # the method's own head: the shared model is never changed (adapts = False)
        self.head = class_head(self.model, cfg.text_head, official_templates(self.model.dataset))

    @torch.no_grad()
    def step(self, images: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        scale = float(self.model.logit_scale)

        def encode(views: torch.Tensor) -> torch.Tensor:
            with autocast_context(cfg.precision, self.device):
                return encode_flat(self.model.encode_image, views, cfg.chunk_views).float()

        def reduce(feats: torch.Tensor) -> torch.Tensor:  # [V, b, D] -> [b, C], per sample
            return vte_ensemble(feats, self.head, scale, cfg.selection)

        return encode_in_chunks(
            images, cfg, self.generator, encode, cfg.view_memory_mb, reduce=reduce
        )
