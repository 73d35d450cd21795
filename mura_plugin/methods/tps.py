"""TPS: test-time prototype shifting (per-class shift vectors on cached class prototypes).

Paper: Sui et al., "Just Shift It: Test-Time Prototype Shifting for Zero-Shot
Generalization with Vision-Language Models", WACV 2025, https://arxiv.org/abs/2403.12952.
Official code: https://github.com/elaine-sui/TPS, read at commit
556db0fe310f029fc7b796ffa83eaa64c578b505 (shift_classification.py, model/learnable_shift.py,
model/shifter.py, model/clip.py, model/model.py, run_utils.py, args.py,
data/datautils.py, data/prompt_embeds.py, data/imagenet_prompts_clean.py,
utils/save_class_embeds.py, utils/save_concepts.py, scripts/shift/*.sh, README.md).
TTA-VLM's implementation read too: https://github.com/TomSheng21/tta-vlm at commit
bcc735fe49cbd2ab5b683781c41c66e1d3f78589 (instance_method/tps.py, instance_tta.py,
clip/custom_clip.py: ``ClipShifterTestTimeTuning_v2``, ``Shifter``).

Per test image (an episode: the shifts and the optimiser are reset before every image):
the class prototypes ``P_c`` are computed once (cached); the image's 64 views (the original
+ 63) go through the frozen image tower once; the shifted class embeddings are
``t_c = normalize(normalize(P_c) + s_c)`` (``get_text_features`` normalises, the
``Shifter`` adds, ``forward`` normalises again) and the logits ``logit_scale * x . t_c``;
the ``int(64 * 0.1) = 6`` views of lowest entropy under the current shifts are kept
(``select_confident_samples``, recomputed at every step as ``run_shift_iter`` does) and the
loss is the entropy of their mean prediction (``avg_entropy``); AdamW (torch's default
weight decay 0.01) takes one step; the prediction is the original image's logits under the
updated shifts (``model(image, test=True)``).

Setting (the optimisation of the README's command, ``scripts/shift/
shift_text_per_class_mean_init_template_and_gpt4_micro.sh I/A/V/R/K 5e-3``; its prototypes
are not the default's, see below): per-class shifts (``--per_label``) initialised at zero
(``Shifter``: ``torch.zeros``, fp32 as the model's weights: ``convert_weights`` is
commented out in its ``model.py``), lr 5e-3 (the
README's and ``args.py``'s value; the scripts take it as an argument), 1 step
(``--tta_steps 1``), 64 views (``-b 64 --img_aug``: original + 63 ``RandomResizedCrop(224)`` +
flip, AugMix on the fine-grained sets only: ``augmix=len(set_id) > 1``, which the harness
applies per dataset as for tpt.py), selection 0.1, fp16 autocast over
fp32 weights on CUDA with ``GradScaler(init_scale=1e3)``.

Prototypes (``text_head``, ``prompts``):
* ``text_head=protocol`` (default): the protocol's template ensemble (``model.templates``);
  ``official``: CLIP's 80 ImageNet templates (``--with_templates``: the mean of the
  normalised features of ``imagenet_templates``, identical to ``clip-imagenet-80``).
* ``prompts`` (a JSON file ``{classname: [descriptor, ...]}``, e.g. the official
  ``gpt4_descriptors/*.json``): the official "micro" pooling (``--with_concepts
  --with_templates``): ``P_c = (mean_j normalize(f(descriptor prompt_j)) + mean_t
  normalize(f(template_t(c)))) / 2``, both means unnormalised, the templates those of
  ``text_head``. A descriptor prompt is ``"{classname}, " + make_descriptor_sentence(d)``
  (``utils/save_concepts.py``: "which is ..." for a descriptor starting with "a"/"an" or
  "used", "which ..." for "has"/"often"/"typically"/"may"/"can", else "which has ...",
  case-sensitive prefix tests as written), or the description itself with
  ``descriptor_sentence=false`` (sentences written as full prompts). None: no descriptors
  (the ``shift_text_per_class_mean_init_template`` variant). Nothing is downloaded.
* The README's command is not the default: its prototypes pool the GPT-4 descriptors
  (``--with_concepts --concept_type gpt4``: the ``gpt4_descriptors/<set>-gpt4.json`` files
  published in the official repository, MIT licence; not shipped here) with CLIP's 80
  templates (``--with_templates``). The defaults use neither: the protocol's templates and
  no descriptors (``prompts=None``), the repository's
  ``scripts/shift/shift_text_per_class_mean_init_template.sh`` with the protocol's head in
  place of the 80 templates. The README's setting is ``text_head=official`` with
  ``prompts`` naming that set's descriptor file (its keys must be the protocol's class
  names: a class without descriptors is refused, naming it). Not measured (no descriptor
  file exists for the digits).

TTA-VLM (``tta_vlm = {"lr": None}``): its prototypes are the single prompt's features (the
harness's option sets the protocol's templates to it), its views the same pipeline (AugMix
on the fine-grained sets, which the option sets), its selection is kept from the first step
(identical at 1 step), and its learning rate is 5e-3 on the ImageNet sets and 1e-3
elsewhere: ``lr=None`` takes 1e-3 where the dataset's catalogue entry says ``fine_grained:
true`` and 5e-3 otherwise (so 5e-3 on every shipped suite); ``resolved_settings`` records
the rate used.

What differs and why:
* Prototypes: the README's command uses the GPT-4 descriptors and CLIP's 80 templates; the
  defaults use the protocol's templates alone (above: the descriptor files are the official
  repository's and are not shipped; a benchmark protocol names one head for every method).
* The prototype shift, the logits, the selection and the loss are computed in float32 on
  the image features the tower returns under fp16 autocast (CUDA); the official computes
  the matmul and the loss under autocast (fp16 matmul) and scales the loss by a GradScaler
  (1e3). With AdamW's first step ``lr * g / (|g| + eps)`` only gradients that fp16 would
  flush to zero can differ. Not measured.
* The B episodes of a batch run in parallel (``chunk_episodes`` at a time): each sample has
  its own shift copy, one AdamW over all copies steps on the sum of the per-sample losses;
  Adam and decoupled weight decay act element-wise and every copy starts from zero with a
  fresh state, so this is the per-image loop.
* The official ``avg_entropy`` clamps the log of the mean probability at the dtype's
  minimum; here it is computed in float32 log space (no clamp is reached).
* Prototypes with descriptors are encoded here from the JSON at setup (the official caches
  them in pickles made by ``utils/save_*.py`` from the same rule); class names are the
  protocol's (the official replaces "_" by " ").
* Views: torchvision's RandomResizedCrop boxes drawn on the image at the model's size and
  resized by one batched bilinear ``grid_sample`` (augment.py), not PIL transforms of the
  raw image; the frozen tower runs once per batch without gradients (the official
  re-encodes the views at every step under ``no_grad``: the same features).
* ``adapts = False``: the shifts live in the method, the shared model is never changed.

Measured effect: docs/methods.md#tps.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from mura_plugin.losses import view_entropy
from mura_plugin.methods._clip_text import encode_text
from mura_plugin.methods._view_budget import encode_flat, encode_in_chunks
from mura_plugin.methods._view_config import ViewFields
from tta_bench.bounds import bounded, one_of
from tta_bench.catalog import fine_grained
from tta_bench.method import (
    PRECISIONS,
    Method,
    autocast_context,
    release_optimizer,
)
from tta_bench.model import ZeroShotClassifier
from tta_bench.text_head import resolve_templates

__all__ = [
    "TPS",
    "TPSConfig",
    "descriptor_prompt",
    "load_descriptions",
    "marginal_entropy",
    "shifted_logits",
    "tta_vlm_lr",
]

#: The official head's template set (TPS's ``imagenet_templates`` = CLIP's 80).
OFFICIAL_TEMPLATES = "clip-imagenet-80"


@dataclass
class TPSConfig(ViewFields):
    views: int = bounded(63, ge=0)  # augmented views per image, besides the original
    include_original: bool = True  # predict on the original (else: one more forward)
    augmix: bool = False  # official: AugMix on its fine-grained sets only
    selection: float = bounded(0.1, gt=0, le=1)  # fraction of lowest-entropy views kept
    #: AdamW learning rate; None: TTA-VLM's rule (1e-3 on fine-grained sets, else 5e-3)
    lr: Optional[float] = bounded(5e-3, gt=0)
    weight_decay: float = bounded(0.01, ge=0)  # torch's AdamW default, as the official
    steps: int = bounded(1, ge=0)
    per_class: bool = True  # one shift per class (--per_label); False: one shared shift
    #: JSON {classname: [description, ...]}: the official "micro" pooling with the head
    prompts: Optional[str] = None
    descriptor_sentence: bool = True  # "{classname}, which ... {description}" (official)
    chunk_episodes: int = bounded(16, ge=1)  # episodes optimised together
    text_head: str = one_of("protocol", ("protocol", "official"))  # official: CLIP's 80
    precision: str = one_of("fp16", PRECISIONS)  # autocast on CUDA, as the official; CPU: fp32


def descriptor_prompt(classname: str, descriptor: str) -> str:
    """The official descriptor prompt (``utils/save_concepts.py``, after Menon & Vondrick):
    ``"{classname}, " + make_descriptor_sentence(descriptor)``, its prefix tests as written."""
    if descriptor.startswith("a") or descriptor.startswith("an"):
        sentence = f"which is {descriptor}"
    elif descriptor.startswith(("has", "often", "typically", "may", "can")):
        sentence = f"which {descriptor}"
    elif descriptor.startswith("used"):
        sentence = f"which is {descriptor}"
    else:
        sentence = f"which has {descriptor}"
    return f"{classname}, {sentence}"


def load_descriptions(path: str | Path, classnames: list[str]) -> list[list[str]]:
    """Per class name (in order), its descriptions from a JSON ``{classname: [str, ...]}``;
    ValueError when a class is missing or has none."""
    with open(path, encoding="utf-8") as f:
        table = json.load(f)
    if not isinstance(table, dict):
        raise ValueError(f"{path}: expected a JSON object {{classname: [description, ...]}}")
    missing = [c for c in classnames if not table.get(c)]
    if missing:
        raise ValueError(f"{path}: no descriptions for classes {missing}")
    out = []
    for c in classnames:
        items = table[c]
        if isinstance(items, str) or not all(isinstance(d, str) for d in items):
            raise ValueError(f"{path}: descriptions of {c!r} must be a list of strings")
        out.append(list(items))
    return out


@torch.no_grad()
def mean_text_features(model: ZeroShotClassifier, prompts: list[list[str]]) -> torch.Tensor:
    """``[C, D]``: per class, the (unnormalised) mean of the L2-normalised text features of
    its prompts, encoded in chunks of ``model.text_chunk_size`` prompts."""
    flat = [p for group in prompts for p in group]
    owner = torch.tensor([i for i, group in enumerate(prompts) for _ in group])
    device = model.class_embeddings.device
    chunk = max(1, int(getattr(model, "text_chunk_size", 256)))
    feats = []
    for i in range(0, len(flat), chunk):
        tokens = model.tokenizer(flat[i : i + chunk]).to(device)
        feats.append(F.normalize(encode_text(model.clip, tokens).float(), dim=-1))
    feats = torch.cat(feats)
    total = torch.zeros(len(prompts), feats.shape[-1], device=device)
    total.index_add_(0, owner.to(device), feats)
    counts = torch.tensor([len(g) for g in prompts], device=device, dtype=total.dtype)
    return total / counts[:, None]


def shifted_logits(
    features: torch.Tensor,
    prototypes: torch.Tensor,
    shift: torch.Tensor,
    logit_scale: torch.Tensor | float,
) -> torch.Tensor:
    """TPS logits ``[V, B, C]`` of image features ``[V, B, D]`` (L2-normalised) under
    prototypes ``[C, D]`` shifted per episode by ``shift [B, C or 1, D]``:
    ``logit_scale * x . normalize(normalize(P_c) + s_c)``."""
    text = F.normalize(F.normalize(prototypes, dim=-1)[None] + shift, dim=-1)  # [B, C, D]
    return logit_scale * torch.einsum("vbd,bcd->vbc", features, text)


def marginal_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the mean softmax over views: ``[K, B, C] -> [B]`` (the official
    ``avg_entropy``, in float32 log space)."""
    logp = logits.float().log_softmax(dim=-1)
    log_mean = logp.logsumexp(dim=0) - math.log(logits.shape[0])
    return -(log_mean.exp() * log_mean).sum(dim=-1)


def tta_vlm_lr(dataset: str | None) -> float:
    """TTA-VLM's TPS learning rate: 5e-3 on the ImageNet sets, 1e-3 on the others (its
    fine-grained sets: a catalogue entry with ``fine_grained: true``)."""
    return 1e-3 if fine_grained(dataset) else 5e-3


class TPS(Method):
    #: Encodes its prompts from the protocol's templates (``model.templates``): the
    #: per-class sentence modes of ``protocol.text_head`` are refused before a run.
    text_heads = ("templates",)

    Config = TPSConfig
    resolved = ("lr",)
    stream_kind = "episodic"  # shifts and optimiser reset before every image
    adapts = False  # the shifts live in the method; the shared model is never changed

    def setup(self) -> None:
        cfg = self.config
        if cfg.views + int(cfg.include_original) < 1:
            raise ValueError("tps needs at least one view")
        self.lr = float(cfg.lr) if cfg.lr is not None else tta_vlm_lr(self.model.dataset)
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        self.prototypes = self._prototypes()
        rows = self.prototypes.shape[0] if cfg.per_class else 1
        #: Every episode's initial shift (zeros, as the official ``Shifter``); never updated:
        #: each episode optimises its own copy.
        self.shift = nn.Parameter(torch.zeros(rows, self.prototypes.shape[1], device=self.device))

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [self.shift]

    def _templates(self) -> list[str]:
        if self.config.text_head == "protocol":
            return list(self.model.templates)
        return list(resolve_templates(OFFICIAL_TEMPLATES))

    @torch.no_grad()
    def _prototypes(self) -> torch.Tensor:
        """The cached class prototypes ``[C, D]`` (float32; only their direction matters
        without descriptors, since the shift is added to the normalised prototype)."""
        cfg, model = self.config, self.model
        templates = self._templates()
        if cfg.prompts is None:
            if cfg.text_head == "protocol":
                return model.class_embeddings.detach().float().clone()
            return model.encode_templates(templates).to(model.class_embeddings).float()
        names = list(model.classnames)
        descriptions = load_descriptions(cfg.prompts, names)
        prompts = [
            [descriptor_prompt(c, d) if cfg.descriptor_sentence else d for d in ds]
            for c, ds in zip(names, descriptions)
        ]
        concept = mean_text_features(model, prompts)
        template = mean_text_features(model, [[t.format(c) for t in templates] for c in names])
        return (concept + template) / 2

    def class_embeddings(self) -> torch.Tensor:
        """The class embeddings before any shift ``[C, D]`` (normalised prototypes)."""
        return F.normalize(self.prototypes, dim=-1)

    def _encode(self, flat: torch.Tensor) -> torch.Tensor:
        chunk = self.config.chunk_views
        with autocast_context(self.config.precision, self.device):
            feats = torch.cat(
                [self.model.encode_image(flat[i : i + chunk]) for i in range(0, len(flat), chunk)]
            )
        return feats.float()

    def adapt_shifts(self, feats: torch.Tensor) -> torch.Tensor:
        """Per-episode shifts ``[B, C or 1, D]`` after ``steps`` AdamW steps on the views'
        features ``[V, B, D]`` (each episode from zero with a fresh optimiser state)."""
        cfg = self.config
        scale = self.model.logit_scale.detach().float()
        v, b = feats.shape[:2]
        k = max(1, int(v * cfg.selection))
        shift = self.shift.detach()[None].repeat(b, 1, 1).requires_grad_(True)
        if cfg.steps == 0:
            return shift.detach()
        optimizer = torch.optim.AdamW([shift], lr=self.lr, weight_decay=cfg.weight_decay)
        for _ in range(cfg.steps):
            with torch.enable_grad():
                logits = shifted_logits(feats, self.prototypes, shift, scale)  # [V, B, C]
                chosen = view_entropy(logits.detach()).argsort(dim=0)[:k]  # [k, B]
                kept = logits.gather(0, chosen[..., None].expand(-1, -1, logits.shape[-1]))
                loss = marginal_entropy(kept)  # [B]
            optimizer.zero_grad(set_to_none=True)
            loss.sum().backward()
            optimizer.step()
            self.last_loss = loss.detach().mean()
        release_optimizer(optimizer)
        return shift.detach()

    def step(self, images: torch.Tensor) -> torch.Tensor:
        """The episodes of each chunk of images (the view budget's) adapt, ``chunk_episodes``
        at a time, and are predicted as soon as the chunk's views are encoded."""
        cfg = self.config
        scale = self.model.logit_scale.detach().float()
        losses: list[torch.Tensor] = []

        def encode(views: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return encode_flat(self._encode, views, len(views.flatten(0, 1)))

        def adapt(feats: torch.Tensor, originals: torch.Tensor) -> torch.Tensor:
            b, out = feats.shape[1], []
            for start in range(0, b, cfg.chunk_episodes):
                rows = slice(start, min(b, start + cfg.chunk_episodes))
                with self.timed("adapt"):
                    shift = self.adapt_shifts(feats[:, rows])
                    if cfg.steps > 0:
                        losses.append(self.last_loss * (rows.stop - rows.start))
                with self.timed("predict"), torch.no_grad():
                    logits = shifted_logits(originals[None, rows], self.prototypes, shift, scale)
                    out.append(logits[0])
            return torch.cat(out)

        if cfg.include_original:
            out = encode_in_chunks(
                images,
                cfg,
                self.generator,
                encode,
                cfg.view_memory_mb,
                reduce=lambda feats: adapt(feats, feats[0]),
                phase=lambda: self.timed("adapt"),
            )
        else:
            feats = encode_in_chunks(
                images,
                cfg,
                self.generator,
                encode,
                cfg.view_memory_mb,
                phase=lambda: self.timed("adapt"),
            )
            with self.timed("predict"), torch.no_grad():
                originals = self._encode(images)
            out = adapt(feats, originals)
        if losses:
            self.last_loss = torch.stack(losses).sum() / images.shape[0]
        return out.float()
