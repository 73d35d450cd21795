"""DMN-ZS: the training-free zero-shot form of Dual Memory Networks (online).

Paper: Zhang et al., "Dual Memory Networks: A Versatile Adaptation Approach for
Vision-Language Models", CVPR 2024, https://arxiv.org/abs/2403.17589. Official code:
https://github.com/YBZh/DMN, read at commit c6c218c70ebbc701b31cc3d7f7b9597117daad8e
(dmn_main.py: ``DualMem.update_memory_bank``, ``DualMem.get_image_pred``,
``select_confident_samples``, ``direct_inference``, ``main_worker``; clip/fix_clip.py:
``ClipFixed.get_text_features`` / ``get_image_features``; data/datautils.py:
``AugMixAugmenter``, ``augmix``, ``get_preaugment``; data/imagnet_prompts.py;
scripts/run.sh; the logs camera_ready_dmn_tf_searched_vit_0.txt and
camera_ready_dmn_tf_shift_0.txt). TTA-VLM's implementation read too:
https://github.com/TomSheng21/tta-vlm at commit bcc735fe49cbd2ab5b683781c41c66e1d3f78589
(online_method/dmn.py, online_tta.py, data/datautils.py, clip/custom_clip.py).

Only the dynamic memory is used: in the zero-shot setting (``--n_shot 0``, no ``--ft``) the
static memory holds nothing but the text features and DMN's learnable projections stay at
their zero initialisation (``--position all`` adds zero biases: no effect), so DMN-ZS is
training-free. Per test image, in stream order (batch size 1 in the official loop):

1. the image and ``n_views`` augmented views are encoded; ``p_v = softmax(s * f_v . t_c)``
   per view; the ``int(V * 0.1)`` views of lowest entropy ``-sum p log(p + 1e-6)`` give the
   mean probability ``p_bar`` (``select_confident_samples``); pseudo-label ``argmax p_bar``
   and entropy ``-sum p_bar log(p_bar + 1e-8)``;
2. write (``update_memory_bank``): the original image's normalised feature goes to the
   pseudo-class's next free slot (``memory_size`` 50 per class); a full class replaces its
   highest-entropy slot only if the new entropy is lower than that (else nothing);
3. read-out (``get_image_pred``, ``similarity_weighted``): each class's memory is its
   stored features plus its text feature (``fixed_global_feat_vanilla``); with the
   normalised query ``f`` (the original image), weights ``exp(-beta (1 - f . m))``
   (sharpness ``beta`` 5.5, ``--beta``) over the class's filled slots, the class
   prototype is the normalised weighted sum of those normalised slots, and
   ``p_mem = softmax(s * f . prototype)``;
4. fusion: ``p_zs + w * p_mem`` with ``p_zs = softmax(s * f . t)`` of the original image.

Setting (defaults = the official scripts/run.sh zero-shot runs): ``-b 32`` (the image + 31
views), ``--selection_p 0.1`` (3 views), ``--memory_size 50``, ``--beta 5.5``. Views
(data/datautils.py): ``RandomResizedCrop(224, scale=(0.5, 1))`` + horizontal flip of the
image, AugMix-ed on its fine-grained sets (``augmix=len(set_id) > 1``: every set but the
ImageNet family I/A/V/R/K); ``augmix=None`` follows that rule through the dataset's
catalogue entry (``fine_grained: true``, as TTA-VLM's option does): digits, CIFAR and the
ImageNet sets get none. Official head (``text_head=official``):
``tip_cupl`` = the 7 TIP-Adapter templates (``tip_imagenet_templates``) on the ImageNet
family plus CuPL's GPT-3 descriptions; on sets it has no loader for, "a photo of a {}."
(its ``simple`` template). The CuPL files are not shipped: ``prompts`` names such a JSON
file ``{classname: [description, ...]}`` (any head + descriptions, ``_dmn_dpe_prompts``);
None (default) uses the templates alone. The head is the method's own tensor: the shared
model is never changed (``adapts = False``). Memory persists across batches (online) and
``reset()`` empties it. fp16 autocast on CUDA (the official ``clip.load`` runs fp16).

Fusion weight: the official code has no fixed one. ``direct_inference`` stores every test
image's ``p_zs`` and ``p_mem`` and, at the end, searches ``w`` over {0.001, 0.003, ..., 300,
1000} for the best accuracy *on the test labels*; its published numbers are those searched
accuracies. The fixed default here is ``w = 1.0``: in that grid, and the median of the
weights its own camera-ready zero-shot logs chose (ViT-B/16: 0.3 on six sets, 1.0 on five
incl. ImageNet, -V2 and -Sketch, 3 on two, 10 on two). ``fusion_weight=None`` takes the
searched value of those logs for the set, i.e. the published, test-label-chosen setting:
``SEARCHED_FUSION`` is keyed by the registered dataset names (the log's ``set_id`` beside
each: ``oxford_flowers`` is its ``Flower102`` and fuses with 10, ``stanford_cars`` its
``Cars`` with 0.3, ``oxford_pets`` its ``Pets``, ``fgvc_aircraft`` its ``Aircraft``); 1.0 on
the sets its logs do not cover (digits, CIFAR, ImageNet-C).

What differs and why:
* Output: ``log((p_zs + w p_mem) / (1 + w))`` instead of the unnormalised probability sum
  (same argmax; a proper log-probability for NLL/ECE), clamped at the smallest float.
* Views: torchvision's RandomResizedCrop boxes on the image at the model's size, one
  batched ``grid_sample`` and the official AugMix on tensors (augment.py), not PIL
  transforms of the raw image; all views of a batch are encoded together, then the
  samples update the memory one by one in stream order, as in the official loop.
* ``int(V * selection)`` is at least 1 (the official selects no view, and fails, below 10
  views). A full class whose highest entropy is tied replaces the last of the tied slots
  (the official ``torch.sort`` leaves the order of ties unspecified).
* The memory is fixed-size tensors with fill counts; an empty slot is masked by the count
  (the official masks slots whose feature sums to 0, which are the same slots).
* Logit scale ``s``: the official code reads the loaded model's own scale
  (``ClipFixed`` keeps ``clip.logit_scale``; ``get_text_prediction`` and ``get_image_pred``
  use ``model.logit_scale.exp()``), which is 100 for the released CLIP weights its
  ``beta``, views and searched weights were chosen with; here the same rule, the model's
  own ``logit_scale`` (the tiny digits model's is about 13). Not a difference in the rule,
  but on a model with a smaller scale ``p_zs`` and ``p_mem`` are flatter, which changes the
  effect of ``w`` (not rescaled: ``w`` mixes probabilities). The fixed 100 in the official
  code is the temperature of the few-shot local-feature attention, not used zero-shot.
* Precision: fp16 autocast over fp32 weights on CUDA (read-out and fusion in float32);
  the official model is fp16 throughout. float32 on the CPU.
* Sets the official code does not cover use the nearest rule: no AugMix unless the
  catalogue marks the set fine-grained, the single-prompt head.
* Official head on its fine-grained sets: its own templates (data/imagnet_prompts.py
  ``ID_to_prompts``: one sentence per set, e.g. "a photo of a {}, a type of flower.", the
  7 TIP templates on Caltech101 and SUN397) are not tabulated: ``text_head=official``
  gives them the single prompt (plus the descriptions of ``prompts``). Not measured.

TTA-VLM (``tta_vlm``): 63 views + the image (``aug_bs = 64``) with TPT's crop scale
(``RandomResizedCrop(224)``: 0.08), the same AugMix rule (set by the option itself); the
confident views' *logits* are averaged and their softmax gives the pseudo-label and
entropy (``+1e-5``; ``confident_mean=logit``); a full class always replaces its
highest-entropy slot (``replace=always``); fusion weight 1.0 (the default here too, so
not in ``tta_vlm``); head "a photo of a {}." (``--ctx_init a_photo_of_a``), which the
option sets as the protocol's templates itself.

Measured effect: docs/methods.md#dmn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from mura_plugin.methods._dmn_dpe_prompts import method_head
from mura_plugin.methods._text_heads import SINGLE_PROMPT, TEXT_HEADS, OwnHead
from mura_plugin.methods._view_budget import encode_flat, encode_in_chunks
from mura_plugin.methods._view_config import ViewFields, original_first
from tta_bench.bounds import bounded, one_of
from tta_bench.catalog import dataset_flag, fine_grained
from tta_bench.method import PRECISIONS, Method, autocast_context

__all__ = [
    "DMN",
    "DMNConfig",
    "SEARCHED_FUSION",
    "TIP_TEMPLATES",
    "DynamicMemory",
    "confident_label",
    "fuse",
    "memory_readout",
    "official_augmix",
    "official_templates",
]

#: ``tip_imagenet_templates`` of data/imagnet_prompts.py (the ``tip`` part of ``tip_cupl``),
#: DMN's head on the sets its code loads with single-letter ids (I, A, V, R, K) and the
#: others of the catalogue's ``imagenet_family``.
TIP_TEMPLATES = (
    "a bad photo of the {}.",
    "a {} in a video game.",
    "a origami {}.",
    "a photo of the small {}.",
    "art of the {}.",
    "a photo of the large {}.",
    "itap of a {}.",
)
#: The dynamic-memory fusion weight the official zero-shot runs chose on the test labels
#: (ViT-B/16 camera-ready logs, ``n_shot 0``), keyed by the registered dataset names, each
#: with the log's ``set_id``; ``fusion_weight=None`` uses it, 1.0 for other sets.
SEARCHED_FUSION = {
    "imagenet": 1.0,  # I
    "imagenet_a": 3.0,  # A
    "imagenet_v2": 1.0,  # V
    "imagenet_r": 0.3,  # R
    "imagenet_sketch": 1.0,  # K
    "oxford_flowers": 10.0,  # Flower102
    "dtd": 10.0,  # DTD
    "oxford_pets": 1.0,  # Pets
    "stanford_cars": 0.3,  # Cars
    "ucf101": 0.3,  # UCF101
    "caltech101": 0.3,  # Caltech101
    "food101": 0.3,  # Food101
    "sun397": 3.0,  # SUN397
    "fgvc_aircraft": 1.0,  # Aircraft
    "eurosat": 0.3,  # eurosat
}
REPLACE_RULES = ("lower", "always")
CONFIDENT_MEANS = ("prob", "logit")


def official_templates(dataset: str | None) -> list[str]:
    """DMN's templates for ``dataset``: the 7 TIP templates on the ImageNet family, else
    (no official loader here) its ``simple`` template "a photo of a {}."."""
    return list(TIP_TEMPLATES if dataset_flag(dataset, "imagenet_family") else SINGLE_PROMPT)


def official_augmix(dataset: str | None) -> bool:
    """``AugMixAugmenter(augmix=len(set_id) > 1)``, true on DMN's fine-grained sets: here
    the sets whose catalogue entry says ``fine_grained: true``."""
    return not dataset_flag(dataset, "imagenet_family") and fine_grained(dataset)


@dataclass
class DMNConfig(ViewFields):
    memory_size: int = bounded(50, ge=1)  # --memory_size
    beta: float = bounded(5.5, ge=0)  # --beta: sharpness of the read-out weights
    # p_zs + w * p_mem; None: the per-set weight its logs chose on test labels (SEARCHED_FUSION)
    fusion_weight: Optional[float] = bounded(1.0, ge=0)
    # a full class: replace its highest-entropy slot only if lower (official) | always
    replace: str = one_of("lower", REPLACE_RULES)
    # mean of the confident views' probabilities (official) | logits (TTA-VLM)
    confident_mean: str = one_of("prob", CONFIDENT_MEANS)
    n_views: int = bounded(31, ge=0)  # -b 32: the image + 31 views
    selection: float = bounded(0.1, gt=0, le=1)  # --selection_p
    augmix: Optional[bool] = None  # None: the official rule (on fine-grained sets only)
    crop_scale_min: float = bounded(0.5, gt=0, le=1)  # get_preaugment: scale=(0.5, 1)
    text_head: str = one_of("protocol", TEXT_HEADS)  # protocol | official
    prompts: Optional[str] = None  # JSON {classname: [description, ...]} added to the head
    precision: str = one_of("fp16", PRECISIONS)  # autocast on CUDA; CPU: fp32


class DynamicMemory:
    """Per class ``size`` slots of (normalised feature, entropy), filled in order; ``count``
    says how many are filled (``update_memory_bank``'s ``image_feature_count``)."""

    def __init__(self, classes: int, size: int, dim: int, device: torch.device | str):
        self.features = torch.zeros(classes, size, dim, device=device)
        self.entropy = torch.zeros(classes, size, device=device)
        self.count = [0] * classes

    @property
    def size(self) -> int:
        return self.features.shape[1]

    def filled(self) -> torch.Tensor:
        """``[C, size]`` bool: which slots hold a feature."""
        counts = torch.tensor(self.count, device=self.features.device)
        return torch.arange(self.size, device=counts.device)[None, :] < counts[:, None]

    def write(self, cls: int, feature: torch.Tensor, ent: float, replace: str = "lower") -> None:
        """The next free slot of ``cls``; when full, its highest-entropy slot (the last of
        tied ones) if ``ent`` is lower than that entropy (``replace=lower``) or in any case
        (``replace=always``)."""
        n = self.count[cls]
        if n < self.size:
            slot = n
            self.count[cls] = n + 1
        else:
            ents = self.entropy[cls]
            top = ents.max()
            slot = int(torch.nonzero(ents == top).flatten()[-1])
            if replace == "lower" and not ent < float(top):
                return
        self.features[cls, slot] = feature
        self.entropy[cls, slot] = ent


def memory_readout(
    features: torch.Tensor,
    filled: torch.Tensor,
    text: torch.Tensor,
    query: torch.Tensor,
    beta: float,
    scale: float,
) -> torch.Tensor:
    """``p_mem [C]`` of a normalised ``query [D]``: per class, the memory ``features [C, M,
    D]`` (slots where ``filled [C, M]``) and its ``text [C, D]`` feature, each normalised,
    weighted by ``exp(-beta (1 - query . m))`` and summed, the sum normalised; then
    ``softmax(scale * query . prototype)``."""
    q, feats = query.float(), features.float()
    norms = feats.norm(dim=-1)  # [C, M]; no normalised copy of the memory is made
    inv = torch.where(filled & (norms > 0), 1.0 / norms.clamp_min(1e-30), torch.zeros_like(norms))
    weights = torch.exp(-beta * (1.0 - (feats @ q) * inv)) * inv  # per raw slot: w / |m|
    text = text.float() / text.float().norm(dim=-1, keepdim=True)
    text_weights = torch.exp(-beta * (1.0 - text @ q))
    proto = torch.einsum("cm,cmd->cd", weights, feats) + text_weights[:, None] * text
    proto = proto / proto.norm(dim=-1, keepdim=True)
    return (scale * proto @ q).softmax(dim=-1)


def fuse(p_zs: torch.Tensor, p_mem: torch.Tensor, weight: float) -> torch.Tensor:
    """``log((p_zs + weight * p_mem) / (1 + weight))``: the official fused score as a
    log-probability (same argmax), clamped at the smallest positive float."""
    mixed = (p_zs + weight * p_mem) / (1.0 + weight)
    return mixed.clamp_min(torch.finfo(mixed.dtype).tiny).log()


def confident_label(logits: torch.Tensor, k: int, mean: str) -> tuple[int, float]:
    """Pseudo-label and entropy of one image from its views' logits ``[V, C]`` (the
    original first): the ``k`` lowest-entropy views' mean probability (``prob``, official:
    entropies with ``+1e-6``, the mean's with ``+1e-8``) or the softmax of their mean
    logits (``logit``, TTA-VLM: entropy with ``+1e-5``)."""
    logits = logits.float()
    probs = logits.softmax(dim=-1)
    if mean == "prob":
        ranking = -(probs * torch.log(probs + 1e-6)).sum(dim=-1)
        chosen = torch.argsort(ranking)[:k]
        p_bar = probs[chosen].mean(dim=0)
        return int(p_bar.argmax()), float(-(p_bar * torch.log(p_bar + 1e-8)).sum())
    if mean == "logit":
        ranking = -(probs * logits.log_softmax(dim=-1)).sum(dim=-1)
        chosen = torch.argsort(ranking)[:k]
        mean_logits = logits[chosen].mean(dim=0)
        p_bar = mean_logits.softmax(dim=-1)
        return int(mean_logits.argmax()), float(-(p_bar * torch.log(p_bar + 1e-5)).sum())
    raise ValueError(f"unknown confident_mean {mean!r}; available: {', '.join(CONFIDENT_MEANS)}")


class DMN(OwnHead, Method):
    Config = DMNConfig
    resolved = ("fusion_weight", "augmix")
    stream_kind = "online"

    def setup(self) -> None:
        cfg = self.config
        dataset = self.model.dataset
        self.fusion_weight = (
            SEARCHED_FUSION.get(dataset or "", 1.0)
            if cfg.fusion_weight is None
            else float(cfg.fusion_weight)
        )
        self.augmix = official_augmix(dataset) if cfg.augmix is None else bool(cfg.augmix)
        # the method's own head: the shared model is never changed (adapts = False)
        self.head = method_head(
            self.model, cfg.text_head, official_templates(dataset), cfg.prompts
        ).float()
        self.reset()

    def reset(self) -> None:
        c, d = self.head.shape
        self.memory = DynamicMemory(c, self.config.memory_size, d, self.device)

    def _view_features(self, images: torch.Tensor, reduce: Any = None) -> Any:
        """Normalised features ``[V, B, D]`` of the image (first) and its views, or
        ``reduce`` of each chunk's (``encode_in_chunks``)."""
        cfg = self.config
        settings = original_first(cfg, cfg.n_views, self.augmix)

        def encode(views: torch.Tensor) -> torch.Tensor:
            with autocast_context(cfg.precision, self.device):
                feats = encode_flat(self.model.encode_image, views, cfg.chunk_views).float()
            return feats / feats.norm(dim=-1, keepdim=True)

        return encode_in_chunks(
            images, settings, self.generator, encode, cfg.view_memory_mb, reduce=reduce
        )

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """The realtime track's prediction while busy: the image alone (no views) fused
        with the memory's readout as it stands, writing nothing."""
        cfg = self.config
        scale = float(self.model.logit_scale)
        with autocast_context(cfg.precision, self.device):
            feats = self.model.encode_image(images).float()
        feats = feats / feats.norm(dim=-1, keepdim=True)
        logits = scale * feats @ self.head.t()
        filled = self.memory.filled()
        return torch.stack([
            fuse(logits[i].softmax(dim=-1),
                 memory_readout(self.memory.features, filled, self.head, f, cfg.beta, scale),
                 self.fusion_weight)
            for i, f in enumerate(feats)
        ])  # fmt: skip

    @torch.no_grad()
    def step(self, images: torch.Tensor) -> torch.Tensor:
        """Each chunk of images (the view budget's) is read into the memory and predicted
        in sample order as soon as its views are encoded."""
        cfg = self.config
        scale = float(self.model.logit_scale)

        def predict(feats: torch.Tensor) -> torch.Tensor:  # [V, b, D] -> [b, C]
            logits = scale * feats @ self.head.t()  # [V, b, C]
            k = max(1, int(feats.shape[0] * cfg.selection))
            out = []
            for i in range(feats.shape[1]):
                label, ent = confident_label(logits[:, i], k, cfg.confident_mean)
                query = feats[0, i]
                self.memory.write(label, query, ent, cfg.replace)
                p_mem = memory_readout(
                    self.memory.features, self.memory.filled(), self.head, query, cfg.beta, scale
                )
                out.append(fuse(logits[0, i].softmax(dim=-1), p_mem, self.fusion_weight))
            return torch.stack(out)

        return self._view_features(images, reduce=predict)
