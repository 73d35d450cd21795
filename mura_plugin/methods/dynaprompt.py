"""DynaPrompt: dynamic test-time prompt tuning with an online prompt buffer.

Paper: Xiao et al., "DynaPrompt: Dynamic Test-Time Prompt Tuning", ICLR 2025
(https://arxiv.org/abs/2501.16404). Official code: https://github.com/zzzx1224/DynaPrompt, read
at commit acd33cf71f5be817512f99ba3b81ec019595ad59 (dynap_classification.py,
clip/custom_clip_lessctx.py, clip/clip.py, clip/model.py, data/datautils.py, run_dynap.sh,
scripts/test_dynap.sh). TTA-VLM's implementation (https://github.com/TomSheng21/tta-vlm at
commit bcc735fe49cbd2ab5b683781c41c66e1d3f78589: online_method/dynaprompt.py, online_tta.py,
clip/custom_clip.py) was read for ``tta_vlm``.

The method (``test_time_tuning`` and its caller, batch size 1, ``--onlinetpt``):

* A buffer of ``buffer_size`` prompts, each the learnable offset ``delta_p`` of the
  context from its initialisation (the official prompt learner adds ``init_ctx`` to a
  zero-initialised ``ctx``), so every unused prompt is the initial prompt. ``order`` lists
  the prompts least recently used first (unused ones, in index order, lead), ``uses``
  counts each prompt's selections.
* Before each sample, when no prompt is unused, the least recently used one (``order[0]``)
  is deleted and a fresh initial prompt takes its place (its offset set to zero, its count
  to zero). The *initial prompt* of the sample is ``order[0]``: always a fresh one.
* On the 64 views (the image + 63 crops) every prompt predicts; per prompt p the mean
  entropy over all views ``H_p`` and the mean over the 63 crops of the original view's max
  logit minus the crop's max logit, ``D_p`` (the probability-difference criterion, computed
  on logits as the official ``plpd``). With the prompts sorted by decreasing entropy and r
  the initial prompt's rank, the candidates are those ranked after it (lower entropy;
  ``ent_order[min(r + 1, P - 1):]``) that are among the r prompts of largest ``D``; the
  official code then takes ``ent_order[j]`` for each candidate *index* j (``select_prompts``,
  ``prompt_rule=official``) and adds the initial prompt. No candidate: the initial prompt
  alone, a new prompt entering the buffer. Each selected prompt moves to the end of
  ``order`` and gets a use.
* Loss (TPT's, over the selected prompts): the ``int(64 * 0.1) = 6`` views of lowest mean
  entropy over the selected prompts; per selected prompt the entropy of its mean prediction
  over them, averaged over the prompts. AdamW (lr 5e-3, torch's weight decay 0.01) over the
  whole buffer, its state reset before every sample (``optimizer.load_state_dict``), so
  only the selected prompts move (the others' offsets only decay); 1 step.
* Prediction: the original image under the selected prompts after the step, logits averaged
  over them.

Setting (defaults = run_dynap.sh / scripts/test_dynap.sh, the README's "default
hyperparameters"; its argparse default ``num_prompts`` is 1): buffer of 12 prompts, lr 5e-3,
``selection_p`` 0.1, 1 step (with more, the selection and the bookkeeping run again at every
step, as the official loop does), ``n_ctx`` 4 with ``ctx_init`` "a photo of a"; views as TPT's
(``AugMixAugmenter``: 63 RandomResizedCrop + flip, AugMix only on its fine-grained sets); on
CUDA fp16 autocast over fp32 weights (its ``clip.load`` keeps fp32) with one
``GradScaler(init_scale=1000)`` along the stream. The buffer, its bookkeeping and the loss
scale persist along the stream (online); ``reset()`` returns to ``setup()``'s state.

Text head (``text_head``), as tpt.py (``PromptTextEncoder``, imported from it): ``protocol``
(default) gives every prompt one context per protocol template, initialised from the
template's words; ``official`` the 4-token "a photo of a" before "{class}.".

What differs and why:
* Ties: prompts with equal entropy or difference (every unused prompt equals the initial
  one) are ordered by index (a stable sort); the official ``topk`` on CUDA leaves their
  order unspecified. The criteria are computed in float32 (the official in fp16 under
  autocast, where near-equal values tie more often).
* ``prompt_rule=ids`` is an option that selects the candidate prompts themselves (and the
  initial prompt once); the default ``official`` keeps the official indexing, which can
  select a prompt twice (it then counts twice in the loss, the prediction and ``uses``).
* The image tower is frozen and prompts change the text side only: all views of a batch are
  encoded once, without gradients; the selection criteria come from a gradient-free forward
  over the buffer and the loss from a second forward over the selected prompts (the
  official backpropagates one forward over all prompts: the same gradient). Sequences are
  cut after the end token (tpt.py).
* ``adapts = True`` and ``trainable_parameters()`` is the buffer of offsets, as tpt.py's
  context: the method's own prompts; the shared CLIP model is never changed.
* Loss scaling with ``_loss_scaler.LossScaler`` (GradScaler's rule, one scale along the stream),
  on CUDA fp16 only. ``int(V * 0.1)`` is at least one view (the official none below 10).
* Views: torchvision's RandomResizedCrop boxes on the image at the model's size, one batched
  ``grid_sample`` (augment.py); AugMix on the fine-grained sets only, per dataset as for
  tpt.py (its catalogue entry's ``dataset_flags``).

TTA-VLM (``tta_vlm``): a buffer of 10 prompts; lr 5e-3 on ImageNet and its variants, 3e-3
elsewhere (``lr=None``); the AdamW state is never reset (its ``optim_state`` is saved, not
loaded), so unselected prompts keep moving with their momentum.

Measured effect: docs/methods.md#dynaprompt.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from mura_plugin.losses import view_entropy
from mura_plugin.methods._loss_scaler import LossScaler
from mura_plugin.methods._view_budget import encode_flat, encode_in_chunks
from mura_plugin.methods._view_config import ViewFields, original_first
from mura_plugin.methods.tpt import PromptTextEncoder
from tta_bench.bounds import bounded, one_of
from tta_bench.catalog import dataset_flag
from tta_bench.method import (
    PRECISIONS,
    Method,
    autocast_context,
    effective_precision,
    release_optimizer,
)

__all__ = [
    "PROMPT_RULES",
    "DynaPrompt",
    "DynaPromptConfig",
    "PromptBuffer",
    "buffer_loss",
    "select_prompts",
]

#: official: the official code's ``ent_order[candidates]`` (a candidate's index read as an
#: entropy rank); ids: the candidate prompts themselves.
PROMPT_RULES = ("official", "ids")


@dataclass
class DynaPromptConfig(ViewFields):
    buffer_size: int = bounded(12, ge=1)  # run_dynap.sh: num_p=12
    # None: TTA-VLM's rule (5e-3 on ImageNet and its variants, 3e-3 elsewhere)
    lr: Optional[float] = bounded(5e-3, gt=0)
    weight_decay: float = bounded(0.01, ge=0)  # torch's AdamW default, as the official
    steps: int = bounded(1, ge=1)
    selection: float = bounded(0.1, gt=0, le=1)  # fraction of confident views in the loss
    prompt_rule: str = one_of("official", PROMPT_RULES)
    reset_optimizer: bool = True  # a fresh AdamW state per sample (official); TTA-VLM: no
    ctx_init: str = "a photo of a"  # the official head's context (text_head=official)
    views: int = bounded(63, ge=1)  # augmented views besides the original (always first)
    augmix: bool = False  # AugMix each crop (the official: on its fine-grained sets only)
    text_head: str = one_of(
        "protocol", ("protocol", "official")
    )  # official: ("a photo of a" + "{class}.")
    precision: str = one_of("fp16", PRECISIONS)  # autocast on CUDA, as the official; CPU: fp32
    grad_scale: Optional[float] = bounded(1000.0, gt=0)  # GradScaler(init_scale=1000), fp16


def select_prompts(
    entropy: Sequence[float] | torch.Tensor,
    difference: Sequence[float] | torch.Tensor,
    init: int,
    rule: str = "official",
) -> list[int]:
    """The prompts DynaPrompt tunes and predicts with for one sample, from each prompt's
    mean entropy and probability difference and the initial prompt ``init``: with
    ``ent_order`` the prompts by decreasing entropy (ties by index) and ``r`` the rank of
    ``init`` in it, the candidates ``j`` are in ``ent_order[min(r + 1, P - 1):]`` and among
    the first ``r`` of the prompts by decreasing difference (ties by index), in increasing
    order. None: ``[init]``. Else ``[ent_order[j] for j in candidates] + [init]`` (``rule =
    "official"``, as the official code indexes) or the candidates other than ``init``
    followed by ``init`` (``"ids"``)."""
    if rule not in PROMPT_RULES:
        raise ValueError(f"unknown prompt_rule {rule!r}; available: {', '.join(PROMPT_RULES)}")
    ent = torch.as_tensor(entropy, dtype=torch.float64).flatten()
    diff = torch.as_tensor(difference, dtype=torch.float64).flatten()
    p = ent.numel()
    if diff.numel() != p or not 0 <= init < p:
        raise ValueError(f"{p} entropies, {diff.numel()} differences, initial prompt {init}")
    ent_order = torch.sort(ent, descending=True, stable=True).indices.tolist()
    rank = ent_order.index(init)
    diff_order = torch.sort(diff, descending=True, stable=True).indices.tolist()
    lower = set(ent_order[min(rank + 1, p - 1) :])
    sharper = set(diff_order[:rank])
    candidates = sorted(lower & sharper)
    if not candidates:
        return [init]
    if rule == "official":
        return [ent_order[j] for j in candidates] + [init]
    return [j for j in candidates if j != init] + [init]


class PromptBuffer:
    """DynaPrompt's bookkeeping of ``size`` prompts: ``order`` (least recently used first),
    ``uses`` (selections per prompt; 0 = unused, i.e. the initial prompt)."""

    def __init__(self, size: int):
        self.order = list(range(size))
        self.uses = [0] * size

    @property
    def init(self) -> int:
        """The sample's initial prompt: the first of ``order`` (an unused prompt)."""
        return self.order[0]

    def recycle(self) -> int | None:
        """Before a sample: when every prompt has been used, the least recently used one is
        deleted for a fresh initial prompt (its count set to 0); returns its index (the
        caller zeroes its offset), or None when an unused prompt is left."""
        if 0 in self.uses:
            return None
        lru = self.order[0]
        self.uses[lru] = 0
        return lru

    def use(self, chosen: Sequence[int]) -> None:
        """Each chosen prompt (in order, repeats included) moves to the end of ``order`` and
        gets one more use."""
        for i in chosen:
            self.order.remove(i)
            self.uses[i] += 1
            self.order.append(i)

    def state(self) -> dict[str, list[int]]:
        return {"order": list(self.order), "uses": list(self.uses)}


def buffer_loss(logits: torch.Tensor, selection: float) -> torch.Tensor:
    """The official loss on ``logits [V, S, C]`` (V views under S selected prompts): the
    ``max(1, int(V * selection))`` views of lowest entropy averaged over the prompts; per
    prompt the entropy of its mean probability over them; the mean over prompts (scalar)."""
    v = logits.shape[0]
    k = max(1, int(v * selection))
    order = view_entropy(logits.detach()).mean(dim=-1).argsort()[:k]
    kept = logits[order].float().log_softmax(dim=-1)  # [k, S, C]
    log_mean = kept.logsumexp(dim=0) - math.log(k)
    return -(log_mean.exp() * log_mean).sum(dim=-1).mean()


class DynaPrompt(Method):
    #: Encodes its prompts from the protocol's templates (``model.templates``): the
    #: per-class sentence modes of ``protocol.text_head`` are refused before a run.
    text_heads = ("templates",)

    Config = DynaPromptConfig
    #: the prompt buffer is this method's own (as TPT's context): ``trainable_parameters``
    adapts = True
    stream_kind = "online"

    def setup(self) -> None:
        cfg = self.config
        if cfg.text_head == "protocol":
            templates = self.model.templates
        else:
            words = cfg.ctx_init.strip()
            if not words:
                raise ValueError("ctx_init must be a non-empty phrase, e.g. 'a photo of a'")
            templates = [f"{words} {{}}."]
        self.prompt = PromptTextEncoder(self.model, templates)
        self.prompt.ctx.requires_grad_(False)
        self.base = self.prompt.ctx.detach().clone()  # the initial context [N, width]
        self.delta = nn.Parameter(
            torch.zeros(cfg.buffer_size, *self.base.shape, device=self.device)
        )
        if cfg.lr is not None:
            self.lr = float(cfg.lr)
        else:
            self.lr = 5e-3 if dataset_flag(self.model.dataset, "imagenet_family") else 3e-3
        self.reset()

    def reset(self) -> None:
        cfg = self.config
        with torch.no_grad():
            self.delta.zero_()
        self.delta.grad = None
        self.buffer = PromptBuffer(cfg.buffer_size)
        fp16 = effective_precision(cfg.precision, self.device) == "fp16"
        self.loss_scaler = LossScaler(cfg.grad_scale or 0.0, enabled=fp16)
        self.optimizer = self._new_optimizer()

    def _new_optimizer(self) -> torch.optim.Optimizer:
        """A fresh AdamW over the prompt deltas; the one it replaces is released now."""
        old = getattr(self, "optimizer", None)
        if old is not None:
            release_optimizer(old)
        return torch.optim.AdamW([self.delta], lr=self.lr, weight_decay=self.config.weight_decay)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [self.delta]

    def resolved_settings(self) -> dict[str, Any]:
        return {"lr": self.lr} if self.config.lr is None else {}

    def autocast(self):
        return autocast_context(self.config.precision, self.device)

    @torch.no_grad()
    def class_embeddings(self, prompt: int = 0) -> torch.Tensor:
        """The text head of buffer prompt ``prompt`` ``[C, D]`` (initially the head TPT starts
        from)."""
        return self.prompt(self.base + self.delta[prompt])

    # -- text side -------------------------------------------------------------------------
    def _text(self, rows: Sequence[int]) -> torch.Tensor:
        """Class embeddings ``[S, C, D]`` of buffer prompts ``rows`` (repeats allowed)."""
        index = torch.tensor(list(rows), device=self.delta.device)
        return self.prompt(self.base + self.delta[index])

    @torch.no_grad()
    def _all_text(self) -> torch.Tensor:
        """Class embeddings ``[P, C, D]`` of the whole buffer, in chunks of whole prompts of
        at most ``model.text_chunk_size`` sequences. The prompts at their initialisation
        (zero offset: the unused ones) are encoded once."""
        zero = (self.delta.flatten(1) == 0).all(dim=1).tolist()
        rows = [i for i, z in enumerate(zero) if not z]
        first_zero = zero.index(True) if any(zero) else None
        if first_zero is not None:
            rows.append(first_zero)
        per = self.prompt.n_templates * self.prompt.n_classes
        step = max(1, int(getattr(self.model, "text_chunk_size", 256)) // per)
        feats = torch.cat([self._text(rows[i : i + step]) for i in range(0, len(rows), step)])
        where = {r: j for j, r in enumerate(rows)}
        pick = [where.get(i, len(rows) - 1) for i in range(len(zero))]  # zero rows: the last
        return feats[torch.tensor(pick, device=feats.device)]

    # -- the loop --------------------------------------------------------------------------
    def encode_views(self, images: torch.Tensor, reduce: Any = None) -> Any:
        """Image features ``[V, B, D]`` of the image and its crops (frozen tower, chunked),
        or ``reduce`` of each chunk's (``encode_in_chunks``, with gradients: DynaPrompt's
        episodes). Encoding counts as ``adapt`` and runs without gradients."""
        cfg = self.config

        @torch.no_grad()
        def encode(views: torch.Tensor) -> torch.Tensor:
            with self.autocast():
                return encode_flat(self.model.encode_image, views, cfg.chunk_views).float()

        return encode_in_chunks(
            images,
            original_first(cfg, cfg.views, cfg.augmix),
            self.generator,
            encode,
            cfg.view_memory_mb,
            reduce=reduce,
            phase=lambda: self.timed("adapt"),
        )

    def criteria(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per prompt, from its logits ``[V, P, C]`` (view 0 the original): the mean entropy
        over all views ``[P]`` and the mean over the crops of the original's max logit minus
        the crop's max logit ``[P]`` (the official ``p_ent`` and ``plpd``)."""
        logits = logits.float()
        entropy = view_entropy(logits).mean(dim=0)
        top = logits.max(dim=-1).values  # [V, P]
        return entropy, (top[:1] - top[1:]).mean(dim=0)

    def _sample(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Adapt on one sample's view features ``[V, D]``; its logits ``[C]`` and loss."""
        cfg = self.config
        scale = self.model.logit_scale
        with self.timed("adapt"):
            fresh = self.buffer.recycle()
            if fresh is not None:
                with torch.no_grad():
                    self.delta[fresh].zero_()
            if cfg.reset_optimizer:
                self.optimizer = self._new_optimizer()
            for _ in range(cfg.steps):
                with torch.no_grad(), self.autocast():
                    everyone = scale * torch.einsum("vd,pcd->vpc", feats, self._all_text())
                entropy, difference = self.criteria(everyone)
                chosen = select_prompts(entropy, difference, self.buffer.init, cfg.prompt_rule)
                self.buffer.use(chosen)
                with torch.enable_grad(), self.autocast():
                    text = self._text(chosen)
                    logits = scale * torch.einsum("vd,scd->vsc", feats, text.to(feats.dtype))
                    loss = buffer_loss(logits, cfg.selection)
                self.optimizer.zero_grad(set_to_none=True)
                (loss * self.loss_scaler.scale).backward()
                skipped = self.loss_scaler.unscale([self.delta])
                if not bool(skipped.any()):
                    self.optimizer.step()
                self.loss_scaler.update(skipped)
        with self.timed("predict"), torch.no_grad(), self.autocast():
            text = self._text(chosen).to(feats.dtype)
            out = (scale * torch.einsum("d,scd->sc", feats[0], text)).float().mean(dim=0)
        return out, loss.detach()

    def step(self, images: torch.Tensor) -> torch.Tensor:
        """Online, one sample after the other: the samples of each chunk of images (the
        view budget's) as soon as the chunk's views are encoded."""
        losses: list[torch.Tensor] = []

        def adapt(feats: torch.Tensor) -> torch.Tensor:  # [V, b, D] -> [b, C]
            out = []
            for i in range(feats.shape[1]):
                logits, loss = self._sample(feats[:, i])
                out.append(logits)
                losses.append(loss)
            return torch.stack(out)

        logits = self.encode_views(images, reduce=adapt)
        self.last_loss = torch.stack(losses).mean()
        return logits
