"""CLIPArTT: LayerNorm adaptation of CLIP's image tower on transductive pseudo-label targets.

Paper: Hakim et al., "CLIPArTT: Adaptation of CLIP to New Domains at Test Time", WACV 2025
(arXiv 2405.00754). Official code: https://github.com/dosowiechi/CLIPArTT, read at commit
6f439ba1ee895df4935a1b1dbdbc5411a8d48005 (adapt.py, models/tent.py, configuration.py).

The rule, per batch of B images (every iteration recomputes it with the current weights):

1. pseudo-label prompt per image from its ``top_k`` classes under the text head, most
   probable first: ``template.format("c1 or c2 or c3")`` (officially the string
   ``"a photo of a c1 or c2 or c3"``);
2. image features ``I [B, D]`` (with gradients) and the prompt features ``T [B, D]``, both
   L2-normalised; ``S = (I I^T + T T^T) / 2``;
3. targets ``Q = softmax(S / temperature)`` along rows (temperature 0.01); the logits
   ``L = s * T I^T`` (``s`` = CLIP's logit scale); the loss is the official
   ``cross_entropy(L^T, Q^T)``: for image i, ``-sum_j Q[j, i] log softmax_j(s I_i . T_j)``,
   averaged over the batch. Gradients flow through ``I`` in the logits *and* the targets,
   as in the official code (nothing is detached);
4. one Adam step. After ``steps`` iterations the batch is predicted with the adapted model.

Official setting (defaults): the affine parameters of every LayerNorm of the image tower,
K = 3, temperature 0.01, Adam lr 1e-3 (betas 0.9/0.999, no weight decay), 10 iterations per
batch, batch 128 (CIFAR-10/100-C; here the protocol's batch size), and the weights *and* the
optimiser reset before every batch (the official ``Tent(..., episodic=True)`` wrapper, plus an
explicit ``model.reset()`` in the loop): ``episodic="batch"``; ``episodic="online"`` keeps the
adapted weights from batch to batch until the protocol resets. The official code loads CLIP
with ``clip.load`` (fp16 weights on CUDA, LayerNorm in float32), hence ``precision="fp16"``
(autocast on CUDA; the CPU runs float32).

Text head: the official code uses a single template, ``"a photo of a {}"`` (no period), for
the class head and the pseudo-label prompts: ``text_head="official"``. The default,
``text_head="protocol"``, starts from the protocol's head (``model.templates``): top-K classes
from the protocol's class embeddings, pseudo-label prompts built with every protocol template
and ensembled by the head's own rule (normalised mean of normalised features), prediction
with the protocol head. With a single protocol template "a photo of a {}" both are the same.

What differs from the official code and why:
* One image forward per iteration instead of two: the official code computes the top-K
  pseudo-labels with a no-grad forward and then repeats the same forward with gradients;
  both see the same weights, so the pseudo-labels come from the gradient forward's detached
  features here. Same values, one forward fewer.
* The pseudo-label prompts are encoded once per distinct top-K tuple of the batch, under
  ``no_grad`` (the text tower is frozen, so the official gradients into it are never used),
  and their token sequences are cut after the longest end token (exact for causal text
  towers). Same features.
* The loss is computed in float32 from the (autocast) features; the official fp16 model
  computes the similarity matrices in fp16. Expected effect: none beyond rounding.
* Only ViT image towers (LayerNorm) are supported; the official code's ResNet branch
  (BatchNorm2d with batch statistics) is not implemented: a tower without LayerNorm is a
  ValueError.
* The official script repeats every corruption 3 times ("validation = 3") and reports the
  mean; the benchmark's seeds play that role.

Cost per batch: ``steps`` x (one image forward + backward, one text forward of <= B x T
prompts) + one prediction forward: 10 forward/backward passes against tent's 1 in the
official setting.

Measured effect: docs/methods.md#clipartt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mura_plugin.methods._clip_text import clipartt_loss, prompt_features
from mura_plugin.methods._norm import vision_layer_norm_parameters
from tta_bench.bounds import bounded, one_of
from tta_bench.method import PRECISIONS, GradientMethod
from tta_bench.model import ZeroShotClassifier

__all__ = [
    "CLIPARTT_TEMPLATE",
    "CLIPArTT",
    "CLIPArTTConfig",
    "pseudo_label_prompt",
]

#: The single template of the official code (class head and pseudo-label prompts).
CLIPARTT_TEMPLATE = "a photo of a {}"
EPISODIC = ("batch", "online")


@dataclass
class CLIPArTTConfig:
    top_k: int = bounded(3, ge=1)  # classes per pseudo-label prompt (official --K)
    temperature: float = bounded(0.01, gt=0)  # of the target similarity softmax
    steps: int = bounded(10, ge=1)  # iterations per batch (official --niter)
    optimizer: str = "adam"
    lr: float = bounded(1e-3, gt=0)
    weight_decay: float = bounded(0.0, ge=0)
    momentum: float = bounded(0.9, ge=0, le=1)  # SGD only
    text_head: str = one_of("protocol", ("protocol", "official"))  # official: ("a photo of a {}")
    episodic: str = "batch"  # batch: reset before every batch (official) | online
    # The official code runs CLIP's fp16 weights on CUDA: fp16 autocast there; CPU: fp32.
    precision: str = one_of("fp16", PRECISIONS)


def pseudo_label_prompt(names: Sequence[str], template: str = CLIPARTT_TEMPLATE) -> str:
    """The pseudo-label prompt of one image from its top-K class names, most probable first:
    ``template.format("c1 or c2 or ... or cK")`` (official: ``"a photo of a c1 or c2 or c3"``)."""
    return template.format(" or ".join(names))


class CLIPArTT(GradientMethod):
    """See the module docstring. Adapts the image tower's LayerNorm affine parameters and
    predicts each batch after its ``steps`` iterations."""

    #: Encodes its prompts from the protocol's templates (``model.templates``): the
    #: per-class sentence modes of ``protocol.text_head`` are refused before a run.
    text_heads = ("templates",)

    Config = CLIPArTTConfig
    predict_from_last_forward = False

    # -- lifecycle ---------------------------------------------------------------------
    def check_config(self) -> None:
        cfg = self.config
        if cfg.episodic not in EPISODIC:
            raise ValueError(
                f"clipartt: unknown episodic {cfg.episodic!r}; available: {', '.join(EPISODIC)}"
            )
        if not 1 <= cfg.top_k <= self.model.num_classes:
            raise ValueError(
                f"clipartt: top_k must be in 1..{self.model.num_classes} (the number of "
                f"classes), got {cfg.top_k}"
            )
        if cfg.steps < 1:
            raise ValueError(f"clipartt: steps must be >= 1, got {cfg.steps}")
        if not cfg.temperature > 0:
            raise ValueError(f"clipartt: temperature must be > 0, got {cfg.temperature}")

    def setup(self) -> None:
        # The objective (a batch-level cross-entropy against transductive targets) is
        # fixed: the config has no ``loss`` field, so GradientMethod loads none.
        self.check_config()
        super().setup()

    def configure(self, model: ZeroShotClassifier) -> None:
        if self.config.text_head == "official":
            self.templates = [CLIPARTT_TEMPLATE]
            self.head = model.encode_templates(self.templates)
        else:
            self.templates = list(model.templates)
            self.head = model.class_embeddings

    def collect_params(self, model: ZeroShotClassifier) -> list[nn.Parameter]:
        return vision_layer_norm_parameters(model, type(self).__name__.lower())

    # -- adaptation --------------------------------------------------------------------
    @torch.no_grad()
    def pseudo_label_features(self, top: torch.Tensor) -> torch.Tensor:
        """Normalised prompt features ``[B, D]`` of each image's top-K class indices
        ``top [B, K]``, ``pseudo_label_prompt`` under every template of the head, each
        distinct tuple encoded once (frozen text tower)."""
        unique, inverse = torch.unique(top, dim=0, return_inverse=True)
        names = [" or ".join(self.model.classnames[c] for c in row) for row in unique.tolist()]
        return prompt_features(self.model, names, self.templates)[inverse]

    def compute_loss(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        feats = self.model.encode_image(images)
        logits = self.model.logits_from_features(feats, self.head.to(feats.dtype))
        top = logits.detach().topk(self.config.top_k, dim=-1).indices
        text = self.pseudo_label_features(top)
        loss = clipartt_loss(feats, text, self.model.logit_scale, self.config.temperature)
        return loss, logits

    def adapt(self, images: torch.Tensor) -> torch.Tensor:
        if self.config.episodic == "batch":
            self.reset()
        return super().adapt(images)

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            feats = self.model.encode_image(images)
            logits = self.model.logits_from_features(feats, self.head.to(feats.dtype))
        return logits.float()
