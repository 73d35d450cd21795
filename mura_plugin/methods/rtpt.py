"""R-TPT: pointwise-entropy prompt tuning and a reliability-weighted ensemble of the views.

Paper: Sheng et al., "R-TPT: Improving Adversarial Robustness of Vision-Language Models
through Test-Time Prompt Tuning", CVPR 2025 (https://arxiv.org/abs/2504.11195).
Official code: https://github.com/TomSheng21/R-TPT, read at commit
e085f134eb299083ccc97327b316272fc40393b8 (rtpt.py, clip/custom_clip.py, clip/clip.py,
clip/model.py, data/datautils.py, data/augmix_ops.py, README.md).
TTA-VLM's implementation read too: https://github.com/TomSheng21/tta-vlm at commit
bcc735fe49cbd2ab5b683781c41c66e1d3f78589 (instance_method/rtpt.py, instance_tta.py,
clip/custom_clip.py).

Setting (defaults = the official rtpt.py with its README command, ``-b 64 --ctx_init
a_photo_of_a --eps 0.0``, i.e. clean images, no attack): TPT's prompt learner and views (64
= original + 63 RandomResizedCrop + horizontal flip; AugMix only on its fine-grained sets,
``augmix=len(set_id)>1``, applied per dataset as for tpt.py), AdamW lr 5e-3 (weight decay
0.01), 1 step (``--tta_steps``), prompt and optimiser state reset before every sample; as in
tpt.py the ``int(64 * 0.1) = 6`` lowest-entropy views (on the initial prompt, kept for later
steps) enter the loss, which is their *mean per-view entropy* (``entropy_avg``, the loss
``entropy``), not the entropy of their mean. Prediction (``reliability_ensemble``): the
logits of **all** 64 views under the **updated** prompt, averaged with weights ``softmax(r /
0.01)`` over views, where a view's reliability ``r`` is the mean of its 20 highest cosine
similarities to the other views' image features (``get_top_sim``, k = 20). Full float32: no
autocast and no loss scaling (the official ``clip.load`` keeps fp32 weights and rtpt.py runs
without ``torch.cuda.amp``). The text head (``text_head``) is TPT's: ``protocol`` (default)
learns one context per protocol template; ``official`` is the official prompt "a photo of a"
+ class + ".".

TTA-VLM (``tta_vlm``): fp16 autocast with ``GradScaler(init_scale=1000)`` for the tuning
step and the ensemble (its similarities then in fp16); otherwise the same rule.

What differs and why:
* The official masks similarities ``>= 1.0`` before taking the top 20 (meaning a view's
  similarity to itself); in float arithmetic the self-similarity of a normalised feature
  lands just below or just above 1, so the official sometimes counts it. Here exactly the
  diagonal is masked (the other views, the paper's definition), and exact duplicates of a
  view still count. With fewer than 21 views the mean is over all ``V - 1`` others.
* Everything tpt.py lists (views drawn on the image at the model's size, the frozen image
  tower run once per batch and its features reused by the ensemble, batched per-sample
  episodes); the per-view entropy is separable per sample, so batched episodes are exact.
* The official also offers a PGD attack (``--eps > 0``) on the input and a TeCoA robust
  image encoder: not part of the method; the protocol's shifts are the inputs here.

Measured effect: docs/methods.md#rtpt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mura_plugin.methods.tpt import TPT, TPTConfig
from tta_bench.bounds import bounded, one_of
from tta_bench.method import PRECISIONS

__all__ = ["RTPT", "RTPTConfig", "reliability_ensemble", "reliability_weights"]


def reliability_weights(
    features: torch.Tensor, neighbours: int = 20, temperature: float = 0.01
) -> torch.Tensor:
    """R-TPT's ensemble weights ``[V, B]`` (summing to 1 over views) from normalised image
    features of V views of B samples ``[V, B, D]``: view v's reliability is the mean of its
    ``min(neighbours, V - 1)`` highest cosine similarities to the other views, and the
    weights are ``softmax(reliability / temperature)`` over views (a single view: weight 1)."""
    v = features.shape[0]
    f = features.float()
    k = min(neighbours, v - 1)
    if k < 1:
        return torch.ones(f.shape[:2], device=f.device)
    sim = torch.einsum("vbd,wbd->bvw", f, f)  # [B, V, V]
    eye = torch.eye(v, dtype=torch.bool, device=f.device)
    sim = sim.masked_fill(eye, float("-inf"))
    score = sim.topk(k, dim=-1).values.mean(dim=-1)  # [B, V]
    return (score / temperature).softmax(dim=-1).t()


def reliability_ensemble(
    logits: torch.Tensor,
    features: torch.Tensor,
    neighbours: int = 20,
    temperature: float = 0.01,
) -> torch.Tensor:
    """The reliability-weighted mean ``[B, C]`` of the views' logits ``[V, B, C]``
    (``reliability_weights`` of their features ``[V, B, D]``)."""
    weights = reliability_weights(features, neighbours, temperature)
    return (weights[..., None] * logits.float()).sum(dim=0)


@dataclass
class RTPTConfig(TPTConfig):
    loss: str = "entropy"  # entropy_avg: the mean per-view entropy of the confident views
    neighbours: int = bounded(20, ge=1)  # get_top_sim's k
    temperature: float = bounded(0.01, gt=0)  # of the softmax over reliabilities
    precision: str = one_of("fp32", PRECISIONS)  # rtpt.py runs without autocast, on fp32 weights
    grad_scale: float | None = None  # and without a GradScaler


class RTPT(TPT):
    predict_reads_original = False  # the prediction ensembles every view
    Config = RTPTConfig
    stream_kind = "episodic"

    @torch.no_grad()
    def predict_episode(self, images: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """The reliability-weighted ensemble of every view's logits under the updated
        prompt (``feats [V, B, D]``: the frozen image features of the views)."""
        cfg = self.config
        with self.autocast():
            logits = self._logits(feats)  # [V, B, C]
        return reliability_ensemble(logits, feats, cfg.neighbours, cfg.temperature)

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """Without adaptation (``adapt_every`` > 1 skips it): the same ensemble over fresh
        views of ``images`` under the current prompt."""
        return self._predict_chunks(images, self.view_inputs(images), episodes=False)
