"""WATT: weight-average test-time adaptation of CLIP over text templates.

Paper: Osowiechi et al., "WATT: Weight Average Test-Time Adaptation of CLIP", NeurIPS 2024
(arXiv 2406.13875). Official code: https://github.com/Mehrdad-Noori/WATT, read at commit
40e3faebeaafe422a6b922ed5565500af2272982 (adapt/watt.py, main.py, templates.yaml,
bash/watt_{p,s}/CIFAR/*.sh).

The rule, per batch (the weights and the optimiser start from the source state every batch):
for each of ``meta_iterations`` (M) rounds, adapt the image tower's LayerNorm affine
parameters with each template t of the template set for ``iterations`` (L) CLIPArTT-style
iterations - pseudo-label = the top-1 class under template t's class embeddings, prompt
feature = that class's template-t embedding, loss = ``clipartt_loss`` (targets from the
image-image and text-text similarities, temperature 0.01) - snapshot the weights after each
template, and average the snapshots (``weight_average``, LayerNorm parameters only). The
batch is predicted with the final average and the ensemble head of the template set.

* ``mode="parallel"`` (WATT-P): every template of a round starts from the same weights (the
  source weights in round 1, the previous average afterwards);
* ``mode="sequential"`` (WATT-S): the templates of a round follow one another, each from the
  weights the previous one left; round m > 1 starts from the previous average.

Optimiser state, as the official code keeps it: one Adam whose moments are reset only to
the source state together with the weights - before every template of round 1 (parallel)
or at the start of round 1 (sequential) - and otherwise carry on across templates and
rounds (loading an average replaces the weights, not the moments).

Official setting (defaults): WATT-S (the official ``--watt_type`` default and the better row
of the paper's CIFAR tables), L = 2, M = 5; WATT-P uses L = 2, M = 50 (bash/watt_p);
``meta_iterations=None`` picks the official M of the mode. Adam lr 1e-3 (betas 0.9/0.999,
no weight decay), batch 128 (here the protocol's batch size), precision fp16 on CUDA (the
official ``clip.load`` fp16 weights; CPU: fp32). The 8 official templates are
``WATT_TEMPLATES``.

Text head and templates: WATT's template set is both what it adapts over and what predicts
(the normalised mean of the per-template class embeddings). ``text_head="official"`` uses the
8 official templates for both. ``text_head="protocol"`` (default) uses the protocol's
templates (``model.templates``) for both, so the prediction head is exactly the protocol's
head and WATT averages one model per protocol template (4 on digits-c; with a single-template
protocol WATT reduces to CLIPArTT with K = 1 and no averaging).

What differs from the official code and why:
* One image forward per iteration instead of two (the official no-grad forward for the
  pseudo-labels sees the same weights as the gradient forward that follows): same values.
* The average covers the adapted (image tower) LayerNorm parameters; the official code also
  "averages" the text tower's LayerNorms, which never change (only float rounding there).
* The loss is computed in float32 (official fp16 similarities): rounding only.
* WATT-P's official CIFAR scripts leave ``LR`` unset (the other datasets use 1e-4, main.py's
  default is 1e-4); 1e-3 is WATT-S's CIFAR value, used for both modes here.
* The official ``--watt_reference_for_evaluation`` (predict with "a photo of a {}" only) is
  not offered; ViT image towers only (LayerNorm), as in the official code.

Cost per batch: M x T x L forward + backward passes plus one prediction forward: WATT-S with
the 8 official templates 80 (40 with digits-c's 4 protocol templates), WATT-P 800 (400),
against tent's 1 in the official setting.

Measured effect: docs/methods.md#watt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from mura_plugin.methods._clip_text import TEXT_HEADS as TEXT_HEAD_CHOICES
from mura_plugin.methods._clip_text import clipartt_loss
from mura_plugin.methods.clipartt import CLIPArTT
from mura_plugin.methods.tda import IMAGENET_7
from tta_bench.bounds import bounded, one_of
from tta_bench.method import PRECISIONS
from tta_bench.model import ZeroShotClassifier

__all__ = ["MODES", "WATT", "WATTConfig", "WATT_TEMPLATES", "weight_average"]

#: The official templates.yaml, in its order: CLIP's 7-template ImageNet ensemble (TDA's
#: ``IMAGENET_7``) after "a photo of a {}", its first template without the full stop.
WATT_TEMPLATES = ("a photo of a {}", "itap of a {}", *IMAGENET_7[1:])
MODES = ("parallel", "sequential")
#: Official meta-iterations M per mode (bash/watt_p and bash/watt_s).
OFFICIAL_META_ITERATIONS = {"parallel": 50, "sequential": 5}


@dataclass
class WATTConfig:
    mode: str = "sequential"  # sequential (WATT-S) | parallel (WATT-P)
    iterations: int = bounded(2, ge=1)  # L: iterations per template between averages
    meta_iterations: Optional[int] = bounded(None, ge=1)  # M; None: official per mode (S 5, P 50)
    temperature: float = bounded(0.01, gt=0)
    optimizer: str = "adam"
    lr: float = bounded(1e-3, gt=0)
    weight_decay: float = bounded(0.0, ge=0)
    momentum: float = bounded(0.9, ge=0, le=1)  # SGD only
    text_head: str = one_of(
        "protocol", TEXT_HEAD_CHOICES
    )  # protocol | official (the 8 WATT templates)
    # The official code runs CLIP's fp16 weights on CUDA: fp16 autocast there; CPU: fp32.
    precision: str = one_of("fp16", PRECISIONS)


def weight_average(snapshots: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Element-wise mean of K snapshots of the same parameter list, summed in snapshot order
    and divided by K as the official ``weight_average`` does."""
    if not snapshots:
        raise ValueError("weight_average needs at least one snapshot")
    return [sum(tensors) / len(snapshots) for tensors in zip(*snapshots)]


class WATT(CLIPArTT):
    """See the module docstring. Shares CLIPArTT's lifecycle (image-tower LayerNorm, no
    registered loss, prediction with the head after adaptation)."""

    Config = WATTConfig

    def check_config(self) -> None:
        cfg = self.config
        if cfg.mode not in MODES:
            raise ValueError(f"watt: unknown mode {cfg.mode!r}; available: {', '.join(MODES)}")
        if cfg.iterations < 1:
            raise ValueError(f"watt: iterations must be >= 1, got {cfg.iterations}")
        m = cfg.meta_iterations
        if m is not None and m < 1:
            raise ValueError(f"watt: meta_iterations must be >= 1 or null, got {m}")
        if not cfg.temperature > 0:
            raise ValueError(f"watt: temperature must be > 0, got {cfg.temperature}")
        self.meta_iterations = OFFICIAL_META_ITERATIONS[cfg.mode] if m is None else m

    def configure(self, model: ZeroShotClassifier) -> None:
        if self.config.text_head == "official":
            self.templates = list(WATT_TEMPLATES)
            self.head = model.encode_templates(self.templates)
        else:
            self.templates = list(model.templates)
            self.head = model.class_embeddings
        # [T, C, D]: each template's own normalised class embeddings (frozen text tower)
        self.template_heads = torch.stack([model.encode_templates([t]) for t in self.templates])
        self._template = 0

    # -- adaptation --------------------------------------------------------------------
    def compute_loss(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The CLIPArTT-style loss under the template being adapted (``self._template``)."""
        text = self.template_heads[self._template]
        feats = self.model.encode_image(images)
        logits = self.model.logits_from_features(feats, text.to(feats.dtype))
        pred = logits.detach().topk(1, dim=-1).indices[:, 0]
        loss = clipartt_loss(feats, text[pred], self.model.logit_scale, self.config.temperature)
        return loss, logits

    def _load(self, weights: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, w in zip(self.params, weights):
                p.copy_(w)

    def _iterate(self, images: torch.Tensor) -> None:
        for _ in range(self.config.iterations):
            with torch.enable_grad(), self.autocast():
                loss = self.compute_loss(images)[0].mean()
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.last_loss = loss.detach()

    def _start_from(self, average: list[torch.Tensor] | None) -> None:
        """The source state (weights and optimiser) before the first round, else the
        previous round's average (weights only: the optimiser's moments carry on)."""
        if average is None:
            self.reset()
        else:
            self._load(average)

    def adapt(self, images: torch.Tensor) -> None:
        parallel = self.config.mode == "parallel"
        average: list[torch.Tensor] | None = None
        for _ in range(self.meta_iterations):
            if not parallel:
                self._start_from(average)
            snapshots = []
            for t in range(len(self.templates)):
                if parallel:
                    self._start_from(average)
                self._template = t
                self._iterate(images)
                snapshots.append([p.detach().clone() for p in self.params])
            average = weight_average(snapshots)
        self._load(average)
