"""ZERO: test-time augmentation with zero temperature (no backpropagation).

Paper: Farina et al., "Frustratingly Easy Test-Time Adaptation of Vision-Language Models",
NeurIPS 2024. Official code: https://github.com/FarinaMatteo/zero, read at commit
c609f7c27bd83a9c898c5bb0256f8272e4d973e3 (ttas/zero.py, ttas/base.py, utils/tools.py,
data/augs.py, clip/custom_clip.py, run.py, scripts/zero.sh).

Setting (defaults = scripts/zero.sh): 64 views (original + 63 RandomResizedCrop +
horizontal flip, ``MultiViewCropAndFlip``); the ``int(64 * 0.3) = 19`` views of lowest
entropy of ``softmax(logit_scale * cos)`` vote, each with ``softmax(cos / eps)`` (zero
temperature: ``eps`` is the machine epsilon of the logits' dtype), and the class with most
votes wins; ties are broken as ``zero_votes`` describes (greedy over the non-voting views
by increasing entropy, then the official fallback with its masking of classes
``C - 1 - t``). Official head: "a photo of a {}." (``--ctx_init a_photo_of_a``, no
``--templates``); on CUDA fp16 autocast over fp32 weights, as its ``clip.load`` and run.py.

What differs and why:
* Head: the protocol's templates by default (``text_head=protocol``, the zero-shot head);
  ``text_head=official`` is the single prompt. Either is the method's own tensor: the
  shared model is never changed.
* Output: the official returns the vote counts; here ``log((1 - tie_eps) * votes / sum +
  tie_eps * mean_probs)`` (mean probability of the voting views), finite for NLL/ECE with
  the same argmax whenever the official's is determined. A tie the official fallback
  leaves unresolved (its extra vote goes to an untied class) is decided here by
  ``mean_probs``; the official ``accuracy`` takes ``topk``, whose order among equal counts
  is unspecified.
* ``k = max(1, int(V * selection))``: the official ``int()`` alone gives no voter (and an
  error) below 4 views at gamma 0.3. With every view voting there is none left to break a
  tie: counts stay tied (the official indexes an empty tensor).
* The confidence entropy is computed from ``log_softmax`` (the official ``p * log p`` is
  NaN where a probability underflows to 0, which sorts that view last).
* Views: torchvision's RandomResizedCrop boxes drawn on the image at the model's size and
  resized by one batched bilinear ``grid_sample`` (augment.py), not PIL transforms of the
  raw image; all views of the whole batch go through the frozen tower in chunked,
  gradient-free forwards. run.py's ``torch.set_float32_matmul_precision("medium")`` is not
  set (it only affects fp32 matmuls outside autocast).

Measured effect (the crop boxes, the official head): docs/methods.md#zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mura_plugin.losses import view_entropy
from mura_plugin.methods._text_heads import SINGLE_PROMPT, OwnHead, class_head
from mura_plugin.methods._text_heads import TEXT_HEADS as TEXT_HEAD_CHOICES
from mura_plugin.methods._view_budget import encode_flat, encode_in_chunks
from mura_plugin.methods._view_config import ViewFields
from tta_bench.bounds import bounded, one_of
from tta_bench.method import PRECISIONS, Method, autocast_context

__all__ = ["Zero", "ZeroConfig", "zero_votes"]


@dataclass
class ZeroConfig(ViewFields):
    views: int = bounded(63, ge=0)  # 0 with include_original: the image alone
    include_original: bool = True
    selection: float = bounded(0.3, gt=0, le=1)  # fraction of most confident views that vote
    tie_eps: float = bounded(1e-3, gt=0, lt=1)
    text_head: str = one_of(
        "protocol", TEXT_HEAD_CHOICES
    )  # protocol | official ("a photo of a {}.")
    precision: str = one_of(
        "fp16", PRECISIONS
    )  # autocast on CUDA, as the official code runs CLIP; CPU: fp32


def zero_votes(cosines: torch.Tensor, logit_scale: float, selection: float) -> torch.Tensor:
    """ZERO's vote counts ``[B, C]`` (the official ``p_bar``) from the unscaled logits
    (cosine similarities) of V views of B samples, ``cosines [V, B, C]``, as
    ``ttas/zero.py: Zero.zero`` computes them:

    * the ``k = max(1, int(V * selection))`` views whose ``softmax(logit_scale * cosines)``
      has the lowest entropy vote, each with ``softmax(cosines / eps)``, eps the machine
      epsilon of ``cosines``' dtype (a one-hot vote, softened only by near-equal cosines:
      for float16 eps is ~1e-3);
    * when several classes share the most votes, the first of the other views (by
      increasing entropy) whose argmax is one of them gives that class one more vote;
    * when none of them votes for a tied class, the official fallback
      (``utils/tools.py: break_sample_tie``) masks ``logit[~ties]``: ``~`` of its int
      tensor of tied classes t is ``-t - 1``, so it masks classes ``C - 1 - t`` (not the
      untied ones) and gives one more vote to the argmax of the first other view's
      remaining cosines. This is reproduced as written.
    """
    v, b, c = cosines.shape
    k = max(1, int(v * selection))
    order = view_entropy(logit_scale * cosines.float()).argsort(dim=0)  # [V, B] ascending
    sorted_cos = cosines.gather(0, order[..., None].expand(-1, -1, c))
    eps = torch.finfo(cosines.dtype).eps
    votes = (sorted_cos[:k] / eps).float().softmax(dim=-1).sum(dim=0)  # [B, C]
    tied = votes == votes.max(dim=-1, keepdim=True).values
    tie = tied.sum(dim=-1) > 1
    if not bool(tie.any()) or k == v:  # no tie, or no other view to break it
        return votes
    rest = sorted_cos[k:]  # the views that did not vote, most confident first
    preds = rest.argmax(dim=-1).t()  # [B, V - k]
    hit = tied.gather(1, preds)
    greedy = preds.gather(1, hit.int().argmax(dim=1, keepdim=True))[:, 0]
    fallback = rest[0].float().masked_fill(tied.flip(-1), float("-inf")).argmax(dim=-1)
    winner = torch.where(hit.any(dim=1), greedy, fallback)
    rows = tie.nonzero()[:, 0]
    votes[rows, winner[rows]] += 1
    return votes


class Zero(OwnHead, Method):
    Config = ZeroConfig
    stream_kind = "episodic"  # one vote over each image's own views

    def setup(self) -> None:
        cfg = self.config
        if cfg.views + int(cfg.include_original) < 1:
            raise ValueError("zero needs a view: views=0 keeps only the image (include_original)")
        # the method's own head: the shared model is never changed (adapts = False)
        self.head = class_head(self.model, cfg.text_head, SINGLE_PROMPT)

    @torch.no_grad()
    def step(self, images: torch.Tensor) -> torch.Tensor:
        cfg = self.config

        def encode(views: torch.Tensor) -> torch.Tensor:
            with autocast_context(cfg.precision, self.device):
                return encode_flat(
                    lambda x: self.model.encode_image(x) @ self.head.t(), views, cfg.chunk_views
                )

        scale = float(self.model.logit_scale)

        def reduce(cos: torch.Tensor) -> torch.Tensor:  # [V, b, C] -> [b, C], per sample
            v = cos.shape[0]
            votes = zero_votes(cos, scale, cfg.selection)
            k = max(1, int(v * cfg.selection))
            logits = scale * cos.float()
            order = view_entropy(logits).argsort(dim=0)[:k, :, None]
            kept = logits.gather(0, order.expand(-1, -1, logits.shape[-1]))
            mean_probs = kept.softmax(dim=-1).mean(dim=0)
            votes = votes / votes.sum(dim=-1, keepdim=True)
            return torch.log((1 - cfg.tie_eps) * votes + cfg.tie_eps * mean_probs)

        return encode_in_chunks(
            images, cfg, self.generator, encode, cfg.view_memory_mb, reduce=reduce
        )
