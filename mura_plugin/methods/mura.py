"""MuRA: Multi-Rank Adaptation at test time.

Paper: "MuRA: Multi-Rank Adaptation for test-time adaptation of vision-language models",
ICLR 2026 submission (OpenReview); no official code is public, so this follows the
published description:
* several low-rank components of *different ranks* (``ranks``, default 4, 8, 16) beside
  the frozen linear layers of the deepest vision block only (``blocks=1``);
* SVD-based orthogonal initialisation (MROD): component k takes its own slice of the frozen
  weight's singular vectors and the frozen path is compensated, so the model starts exactly
  at the source (``init=svd``; ``zero`` is the LoRA init);
* a soft token-level router mixing the components (UCF, ``fusion=router``): one small
  zero-initialised linear per adapted layer, per-token softmax weights over components;
* the router persists across samples (CRU, ``router_persist``) while the adapters reset
  after every sample (``episodic=sample``);
* 63 augmented views + the original in one batched forward, entropy-weighted loss
  (``weighted_entropy``), 1 AdamW step; the prediction is made on the original image
  after the update.
The seed article's sketch is the preset ``mura-seed`` (``--method mura-seed``,
mura_plugin/conf/method/mura-seed.yaml), written as the sketch is: torch's default init of
both low-rank matrices (``init=default``: B is not zero, the layer does not start at the
source), no per-component scale (``scale=none``), one softmax over K mixing logits per
adapted layer (``fusion=softmax_layer``), components beside the MLP linears of the deepest
block (``targets=[mlp.in, mlp.out]``), two augmented views and no original
(RandomResizedCrop scale (0.7, 1.0), then a rotation within +-10 degrees with zero fill, no
flip: ``crop_scale_min=0.7 rotate_degrees=10 flip=false``), 3 Adam steps at 1e-3 without
weight decay on the negative cosine similarity of the two views' features
(``loss=consistency``), the prediction on the image itself after the steps, reset per batch
(``episodic=batch``). Where it cannot follow the sketch:
* batch 16: the batch size is the protocol's (64 on ``digits-c``), not the method's, so the
  preset runs at the suite's batch unless ``protocol.batch_size=16`` is given (measured
  effect: docs/methods.md#mura);
* the rotation is bilinear (RandomAffine's default interpolation is nearest) and, as every
  view here, computed on float tensors (augment.py);
* unspecified by the sketch and kept from ``mura``: the deepest block only (``blocks=1``),
  ranks 4/8/16, the protocol's text head, fp16 autocast with loss scaling on CUDA.

What is assumed where the description is silent (and why):
* projections adapted: ``attn.q`` and ``attn.v`` (TTL's choice, so that MuRA with one rank
  and fixed weight *is* TTL's LoRA: the ablation isolates multi-rank/fusion/init/depth);
* augmentation, optimiser and precision are TTL/TPT's (RandomResizedCrop + flip, AdamW,
  weight decay 0.01 = torch's AdamW default used by their code; fp16 autocast with
  GradScaler(init_scale=1000) on CUDA); the learning rate is MuRA's own (below);
* scale and init per component, consistent with TTL's LoRA (lora.py): ``alpha`` is each
  component's LoRA alpha, 32 as TTL's ``lora_alpha``, so component k is scaled by
  ``alpha / r_k`` (8, 4, 2 for ranks 4, 8, 16) and, with ``init=zero``, has its own
  xavier-normal ``A_k`` (std ``sqrt(2 / (in + r_k))``) and ``B_k = 0``: one component is
  exactly TTL's LoRA (r = 16: scale 2), and K components are K standalone LoRAs mixed by
  the fusion weights. With ``init=svd`` the scale only sets how each component's initial
  product ``U_k S_k V_k^T`` is split between ``A_k`` and ``B_k`` (see adapters.py), hence
  the size of the Adam steps on the product;
* the singular-vector slices are taken from the top, in the order of ``ranks``;
* the official head (``text_head=official``) is TTL's "a photo of a {}."; the default is
  the protocol's templates.
Learning rate (``lr = 5e-4``, TTL's is 5e-3), chosen on the held-out ``digits-c-extra`` only
(grid: results/mura-study/README.md, from ``benchmarks/mura_study.py``). Why it differs from
TTL's: with the SVD init each component's product ``U_k S_k V_k^T`` starts at full size, so
Adam's first step (``lr`` per element of ``A_k`` and ``B_k``) moves it far more than a B = 0
LoRA's (measured against the official TTL's first step, with what TTL's 5e-3 costs MuRA on
``digits-c-extra``: docs/methods.md#mura). ``router_lr`` stays None (= ``lr``).
Cost: the frozen blocks before the first adapted one run once per batch for all V x B views
without gradients (``encode_views``, open_clip ViTs; other towers detach the input of the
first adapted block instead), the adaptation forward/backward covers only the adapted
block(s), and the prediction on the original image restarts from its cached tokens (view 0).
With ``episodic=sample`` the B per-sample episodes of a batch run in batched
forward/backward passes, each sample with its own adapter copy (``episode_batching``,
default; exactly the per-sample loop, see _episodes.py), group by group within the view
memory budget (one image at a time at 224 px, the whole batch at 32 px). Router
persistence in batched mode (CRU, ``router_persist=true``): the shared router is updated
once per batch, by one optimiser step on the gradient of the *sum* of the batch's
per-sample losses (its optimiser state persists across batches), instead of once per
sample: every sample of a batch adapts with the router as it was at the start of the batch
and is predicted with the router after the batch's step. When the batch runs in several
groups (224 px), each sample's adapted copy waits for that step where ``copies_wait``
says: on disk by default (memory stays flat in the batch), in memory, or nowhere
(``recompute``: the episodes run again after the step); the same predictions whichever.
``method.episode_batching=false`` runs the sequential per-sample router updates (the
exact CRU order, slower) for exactness studies.
Variants the article proposes, as options (docs/methods.md#mura-variants): ``towers``
(the components on the vision tower, the text tower or both; on the text tower the class
head is re-encoded through the adapted blocks at every step, one head per episode,
text_adapters.py), persistence (``episodic`` with the protocol's reset policy), the update
period (``adapt_every``), the signal (``loss``, ``augmix``) and the rank set (``ranks``;
``[28]`` matches the parameters of ``[4, 8, 16]``). The held-out study of them:
benchmarks/mura_variants.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from mura_plugin.adapters import (
    INITS,
    SCALES,
    MultiRankLinear,
    attach_adapters,
    split_vision_forward,
    vision_blocks,
)
from mura_plugin.methods._episodes import MultiViewConfig, MultiViewMethod
from mura_plugin.methods._text_heads import SINGLE_PROMPT, OwnHead, class_head
from mura_plugin.methods._view_budget import COPIES_WAIT
from mura_plugin.text_adapters import TextHead, per_sample_logits, prompt_lists, text_blocks
from tta_bench.bounds import bounded, one_of
from tta_bench.model import ZeroShotClassifier

__all__ = ["MuRA", "MuRAConfig", "FUSIONS", "TOWERS"]

#: softmax: learned global weights over components (one softmax over K logits shared by
#: every adapted layer); router: per-token learned weights; none: every component with weight
#: 1 (plain LoRA when there is one component); softmax_layer: like softmax but each adapted
#: layer has its own K logits (the seed article's sketch).
FUSIONS = ("softmax", "router", "none", "softmax_layer")
#: Which towers carry the components (the deepest ``blocks`` of each): vision (the image
#: tower), text (the text tower: the class head is re-encoded at every step,
#: text_adapters.py) or both.
TOWERS = ("vision", "text", "both")
#: Losses that read the image features only (never the logits, hence not the text head).
FEATURE_LOSSES = ("consistency",)


@dataclass
class MuRAConfig(MultiViewConfig):
    #: Options added for the mura-seed preset; at their defaults MuRA computes exactly what
    #: it did before them, so they stay out of the run key (``method_config_hash``) there.
    hash_omit_at_default = (
        "scale",
        "crop_scale_max",
        "rotate_degrees",
        "view_memory_mb",
        "copies_wait",
        "towers",
    )

    ranks: list[int] = bounded(default_factory=lambda: [4, 8, 16], ge=1)
    blocks: int = bounded(1, ge=1)  # adapt the deepest N blocks (of each tower in towers)
    towers: str = one_of("vision", TOWERS)
    targets: list[str] = field(default_factory=lambda: ["attn.q", "attn.v"])
    # each component's LoRA alpha: component k is scaled by alpha / rank_k
    alpha: float = bounded(32.0, gt=0)
    #: per-component scale: alpha_over_rank (alpha / rank_k) or none (1; alpha unused)
    scale: str = one_of("alpha_over_rank", SCALES)
    init: str = one_of("svd", INITS)  # adapters.INITS
    fusion: str = one_of("router", FUSIONS)
    router_persist: bool = True
    loss: str = "weighted_entropy"
    optimizer: str = "adamw"
    lr: float = 5e-4  # chosen on digits-c-extra (module docstring)
    weight_decay: float = 0.01
    steps: int = 1
    #: The router's learning rate (None: ``lr``); the router persists across samples, so
    #: it takes one step per batch where the adapters take one per sample.
    router_lr: Optional[float] = bounded(None, gt=0)
    #: RandomResizedCrop's upper area bound (1.0: torchvision's default)
    crop_scale_max: float = bounded(1.0, gt=0, le=1)
    #: each crop rotated about its centre by an angle uniform in +-rotate_degrees, zero fill
    #: (RandomAffine(degrees) after the crop; 0: no rotation, nothing drawn)
    rotate_degrees: float = bounded(0.0, ge=0, le=180)
    #: Where each sample's adapted copy waits for the router's step when a batch's episodes
    #: run in several groups (224 px): disk (a temporary file; memory stays flat in the
    #: batch), memory (0.34 MB an image on ViT-B-32), recompute (the episodes run again
    #: after the step: twice the adaptation's compute). Changes no cell (_views.COPIES_WAIT).
    copies_wait: str = one_of("disk", COPIES_WAIT)

    def __post_init__(self) -> None:
        """Refuse, when the config is made (before any model is built), components that
        the loss cannot reach."""
        if self.towers == "text" and self.loss in FEATURE_LOSSES:
            raise ValueError(
                f"method.loss={self.loss} reads the image features only, which components on "
                f"the text tower cannot change: use method.towers=vision or both with it, or a "
                f"loss on the logits with method.towers=text"
            )


def _detach_inputs(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)


class MuRA(OwnHead, MultiViewMethod):
    predict_reads_original = True  # predict_episode reads view 0 only
    Config = MuRAConfig
    stream_kind = "episodic"  # adapters reset per sample (episodic=sample) or per batch

    def configure(self, model: ZeroShotClassifier) -> None:
        cfg = self.config
        if not cfg.crop_scale_min <= cfg.crop_scale_max <= 1.0:
            raise ValueError(
                f"crop_scale_max must be in [crop_scale_min, 1] = [{cfg.crop_scale_min}, 1], "
                f"got {cfg.crop_scale_max}"
            )
        self.copies_wait()  # a ValueError naming the options
        # no official code: the official head is TTL's ("a photo of a {}."); encoded before
        # any text adapter exists, so the text-head cache only ever sees the frozen tower
        self.head = class_head(model, cfg.text_head, SINGLE_PROMPT)
        k = len(cfg.ranks)
        self.adapters: dict[str, MultiRankLinear] = {}
        first = self._attach_vision(model) if cfg.towers != "text" else self._frozen_vision(model)
        self._text: TextHead | None = None
        if cfg.towers != "vision":
            blocks = text_blocks(model.clip)
            if not 1 <= cfg.blocks <= len(blocks):
                raise ValueError(f"blocks must be in 1..{len(blocks)}, got {cfg.blocks}")
            for name, adapter in self._attach(blocks[-cfg.blocks :]).items():
                self.adapters[f"text.{name}"] = adapter
            official = SINGLE_PROMPT if cfg.text_head == "official" else None
            self._text = TextHead(model, prompt_lists(model, official), len(blocks) - cfg.blocks)
        # softmax: K logits shared by all layers; softmax_layer: [L, K], row l for the l-th
        # adapted layer (in ``self.adapters`` order)
        shape = {"softmax": (k,), "softmax_layer": (len(self.adapters), k)}.get(cfg.fusion)
        self.merge_logits = (
            None if shape is None else nn.Parameter(torch.zeros(shape, device=model.mean.device))
        )
        # Frozen prefix run once per batch (None: unknown tower, plain forward per step).
        self._split = None if first is None else split_vision_forward(model.visual, first)
        # Batched episodes read tokens as sample-major rows: needs batch-first blocks.
        transformer = getattr(model.visual, "transformer", None)
        self._batch_first = bool(getattr(transformer, "batch_first", True)) and (
            self._text is None or self._text.batch_first
        )
        self._episode_merge: torch.Tensor | None = None  # copies in use ([n, K])
        self._episode_merge_all: torch.Tensor | None = None
        self._episodes_n: int | None = None  # episodes in use (text heads per sample)

    def _attach(self, blocks: list[nn.Module]) -> dict[str, MultiRankLinear]:
        cfg = self.config
        k = len(cfg.ranks)
        return attach_adapters(
            blocks,
            cfg.targets,
            cfg.ranks,
            cfg.alpha,
            init=cfg.init,
            router=cfg.fusion == "router",
            init_weights=torch.full((k,), 1.0 / k if cfg.fusion != "none" else 1.0),
            scale=cfg.scale,
        )

    def _attach_vision(self, model: ZeroShotClassifier) -> int:
        """Components beside the deepest ``blocks`` vision blocks; returns the index of the
        first adapted one (where the frozen prefix stops)."""
        cfg = self.config
        try:
            blocks = vision_blocks(model.visual)
        except ValueError as exc:  # a convolutional tower: no attention to adapt
            raise ValueError(
                f"mura adapts attention in the transformer blocks of a ViT image tower "
                f"(open_clip's VisionTransformer or a timm ViT trunk: ViT-*, EVA02-*, "
                f"*-SigLIP*, coca_*); the {type(model.visual).__name__} tower of "
                f"{model.model_name} has none, as no convolutional tower (ModifiedResNet: "
                f"RN*; ConvNeXt: convnext_*) has (method.towers=text adapts the text tower "
                f"only): {exc}"
            ) from exc
        if not 1 <= cfg.blocks <= len(blocks):
            raise ValueError(f"blocks must be in 1..{len(blocks)}, got {cfg.blocks}")
        adapted = blocks[-cfg.blocks :]
        self.adapters.update(self._attach(adapted))
        # Autograd stops at the first adapted block: backward covers only adapted blocks.
        self._hook = adapted[0].register_forward_pre_hook(_detach_inputs)
        return len(blocks) - cfg.blocks

    def _frozen_vision(self, model: ZeroShotClassifier) -> int | None:
        """``towers=text``: the whole image tower is frozen, so a ViT's blocks all run once
        per batch (the suffix is the pooling and projection); None for other towers."""
        self._hook = None
        try:
            return len(vision_blocks(model.visual))
        except ValueError:
            return None

    def class_embeddings(self) -> torch.Tensor:
        """The text head this method classifies with ``[C, D]``: the adapted one when the
        text tower carries components."""
        if self._text is None:
            return self.head
        with torch.no_grad():
            return self._text.head()

    def _class_head(self) -> torch.Tensor:
        """``[C, D]``, or one head per running episode ``[n, C, D]`` (text components)."""
        return self.head if self._text is None else self._text.head(self._episodes_n)

    def _logits(self, feats: torch.Tensor) -> torch.Tensor:
        head = self._class_head()
        if head.dim() == 3:
            return per_sample_logits(self.model, feats, head)
        return self.model.logits_from_features(feats, head)

    def collect_params(self, model: ZeroShotClassifier) -> list[nn.Parameter]:
        params: list[nn.Parameter] = [] if self.merge_logits is None else [self.merge_logits]
        for adapter in self.adapters.values():
            params += adapter.adapter_parameters() + adapter.router_parameters()
        return params

    def param_groups(self) -> list[Any]:
        """One group, or two when the router has its own learning rate (``router_lr``)."""
        router = {id(p) for a in self.adapters.values() for p in a.router_parameters()}
        if self.config.router_lr is None or not router:
            return list(self.params)
        return [
            {"params": [p for p in self.params if id(p) not in router]},
            {"params": [p for p in self.params if id(p) in router], "lr": self.config.router_lr},
        ]

    def episode_parameters(self) -> list[nn.Parameter]:
        """Adapters (and softmax fusion weights) reset per episode; the router persists
        across episodes when ``router_persist`` (restored only by ``reset()``)."""
        if self.config.router_persist:
            keep = {id(p) for a in self.adapters.values() for p in a.router_parameters()}
            return [p for p in self.params if id(p) not in keep]
        return list(self.params)

    def _set_fusion(self) -> None:
        logits = self.merge_logits if self._episode_merge is None else self._episode_merge
        # [K] or [n, K]; softmax_layer: [L, K] or [n, L, K]
        weights = None if logits is None else logits.softmax(dim=-1)
        per_layer = self.config.fusion == "softmax_layer"
        for layer, adapter in enumerate(self.adapters.values()):
            adapter.set_weights(weights[..., layer, :] if per_layer else weights)

    # -- batched episodes ----------------------------------------------------------------
    def supports_episode_batching(self) -> bool:
        return self._batch_first

    def begin_episodes(self, n: int) -> list[torch.Tensor]:
        episode = {id(p) for p in self.episode_parameters()}
        copies: list[torch.Tensor] = []
        if self.merge_logits is not None and id(self.merge_logits) in episode:
            logits = self.merge_logits.detach()
            merge = logits.unsqueeze(0).repeat(n, *([1] * logits.dim()))
            self._episode_merge = self._episode_merge_all = merge.requires_grad_(True)
            copies.append(merge)
        self._episodes_n = n
        for adapter in self.adapters.values():
            router = any(id(p) in episode for p in adapter.router_parameters())
            copies += adapter.begin_episodes(n, router=router)
        return copies

    def select_episodes(self, rows: slice) -> None:
        self._episodes_n = rows.stop - rows.start
        if self._episode_merge_all is not None:
            self._episode_merge = self._episode_merge_all[rows]
        for adapter in self.adapters.values():
            adapter.select_episodes(rows)

    def end_episodes(self) -> None:
        self._episode_merge = self._episode_merge_all = None
        self._episodes_n = None
        for adapter in self.adapters.values():
            adapter.end_episodes()

    # -- views -----------------------------------------------------------------------------
    @torch.no_grad()
    def encode_views(self, views: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{"tokens": [V, B, T, D]}``, the tokens entering the first adapted block (frozen
        prefix, run once, computed sample-major so that ``view_loss`` reads them without a
        copy), or ``{"images": views}`` when the tower cannot be split."""
        if self._split is None:
            return {"images": views}
        v, b = views.shape[:2]
        flat = views.transpose(0, 1).flatten(0, 1)  # sample-major [B * V, C, H, W]
        chunk = self.config.chunk_views
        with self.autocast():
            tokens = torch.cat(
                [
                    self._split[0](self.model.normalize(flat[i : i + chunk]))
                    for i in range(0, len(flat), chunk)
                ]
            )
        return {"tokens": tokens.view(b, v, *tokens.shape[1:]).transpose(0, 1)}

    def _features(self, inputs: dict[str, torch.Tensor], flat: torch.Tensor) -> torch.Tensor:
        """L2-normalised image features of sample-major ``flat`` tokens or images."""
        if "tokens" in inputs:
            return F.normalize(self._split[1](flat), dim=-1)
        return self.model.encode_image(flat)

    def view_loss(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        self._set_fusion()
        x = inputs["tokens"] if "tokens" in inputs else inputs["images"]
        v, b = x.shape[:2]
        feats = self._features(inputs, x.transpose(0, 1).flatten(0, 1))  # [B * V, D]
        logits = self._logits(feats)
        feats = feats.view(b, v, -1).transpose(0, 1)
        logits = logits.view(b, v, -1).transpose(0, 1)
        return self.loss_fn(logits, features=feats), logits

    @torch.no_grad()
    def predict_episode(
        self, images: torch.Tensor, inputs: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        if "tokens" not in inputs or not self.config.include_original:
            return self.predict(images)
        self._set_fusion()
        with self.autocast():  # view 0 is the original image: restart from its tokens
            feats = self._features(inputs, inputs["tokens"][0])
            return self._logits(feats).float()

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        self._set_fusion()
        with self.autocast():
            feats = self.model.encode_image(images)
            return self._logits(feats).float()
