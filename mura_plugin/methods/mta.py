"""MTA: MeanShift for test-time augmentation, with inlierness scores (no backpropagation).

Paper: Zanella & Ben Ayed, "On the Test-Time Zero-Shot Generalization of Vision-Language
Models: Do We Really Need Prompt Learning?", CVPR 2024, https://arxiv.org/abs/2405.02266.
Official code: https://github.com/MaxZanella/MTA, read at commit
cafafdfa2918d3e9e45eb711f6aed8e3582fcb8d (mta.py, main.py, data/datautils.py,
clip/custom_clip.py, README.md). TTA-VLM's implementation read too:
https://github.com/TomSheng21/tta-vlm at commit bcc735fe49cbd2ab5b683781c41c66e1d3f78589
(instance_method/mta.py, instance_tta.py, data/datautils.py).

Per test image (an episode: nothing is kept between images), with the N = 64 L2-normalised
image embeddings ``x_i`` of the original and 63 augmented views, and their logits
``logit_scale * x_i . t_c`` under the class head:

* bandwidth per view (``solve_mta``): ``h_i = sqrt(0.5 * mean of the k smallest squared
  distances ||x_i - x_j||^2, j != i)``, ``k = int(0.3 * (N - 1)) = 18`` (``torch.cdist``,
  sorted, the first, the point itself, left out); the kernel ``K_i(m) = exp(-||x_i - m||^2
  / (2 h_i^2))``;
* affinity ``A = softmax(logits) softmax(logits)^T`` (temperature 1) ``[N, N]``;
* initialisation: uniform inlierness ``y_i = 1 / N``, mode ``m`` = the original image's
  embedding;
* 5 outer iterations (no stopping test on the outer loop), each:
  1. inlierness step: ``K(m)`` computed once, then up to 5 fixed-point updates
     ``y <- softmax((K(m) + lambda_q A y) / lambda_y)`` (``1/lambda_y * (...)`` as the
     official), stopping early when ``||y_old - y||_2 < 1e-6``;
  2. mode step: up to 5 weighted MeanShift updates ``m <- sum_i K_i(m) y_i x_i / sum_i
     K_i(m) y_i``, then ``m <- m / ||m||``, the kernel recomputed at every update, stopping
     early when ``||m_old - m||_2 < 1e-6``;
  ``y`` and ``m`` carry over from one outer iteration to the next;
* prediction: ``logit_scale * m . t_c``, the logits of the mode.

``mta_solve`` runs the B episodes of a batch together; each keeps its own stopping tests
(an episode whose inner loop has stopped keeps its values while the others continue), so
the result is the per-image loop's.

Setting (defaults = the official ``main.py --mta``, the README's command): lambda_y 0.2,
lambda_q 4 (``--lambda_y`` / ``--lambda_q`` defaults), 64 views (``-b 64``: the original +
63 ``RandomResizedCrop(224)`` + ``RandomHorizontalFlip``; no AugMix on any set:
``augmix=(len(set_id) > 1 and args.tpt)`` is False under ``--mta``), official head "a photo
of a {}." (``--ctx_init a_photo_of_a``: ``prompt_prefix + " " + name + "."``), CLIP under
fp16 autocast over fp32 weights on CUDA (``get_coop`` keeps fp32 weights).

TTA-VLM (``tta_vlm = {}``): its ``solve_mta`` is the official one line for line (same
lambdas, bandwidth rule, iterations and stopping rule); the only departure is its view
pipeline, AugMix on the fine-grained sets (``augmix=len(set_id) > 1`` for every method),
which the harness's TTA-VLM option already applies to every config with an ``augmix``
field (``tta_bench.run.profiles``), and its head, the single prompt, which the option sets as
the protocol's templates.

What differs and why:
* Head: the protocol's templates by default (``text_head=protocol``, the zero-shot head);
  ``text_head=official`` is the single prompt. Either is the method's own tensor: the
  shared model is never changed (``adapts = False``).
* Precision: the official runs the whole MeanShift on the fp16 features autocast returns
  (distances, kernel, softmax, the mode in half precision); here the image tower runs under
  fp16 autocast on CUDA (float32 on the CPU) and the iterations in float32. Not measured.
* A view whose bandwidth is exactly 0 (18 neighbours at distance 0, e.g. identical crops)
  gets ``h = float32 tiny`` instead of the official division by zero (NaN).
* ``k = max(1, int(0.3 * (N - 1)))``: the official ``int()`` alone gives k = 0 (a mean over
  no distances, NaN) below 5 views.
* Views: torchvision's RandomResizedCrop boxes drawn on the image at the model's size and
  resized by one batched bilinear ``grid_sample`` (augment.py), not PIL transforms of the
  raw image; all views of a batch go through the frozen tower in chunked, gradient-free
  forwards.

Measured effect: docs/methods.md#mta.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mura_plugin.methods._text_heads import SINGLE_PROMPT, OwnHead, class_head
from mura_plugin.methods._view_budget import encode_flat, encode_in_chunks
from mura_plugin.methods._view_config import ViewFields
from tta_bench.bounds import bounded, one_of
from tta_bench.method import PRECISIONS, Method, autocast_context

__all__ = ["MTA", "MTAConfig", "mta_bandwidth", "mta_solve"]


@dataclass
class MTAConfig(ViewFields):
    views: int = bounded(63, ge=1)  # augmented views per image, besides the original
    include_original: bool = True  # the original is view 0 and the mode's initialisation
    augmix: bool = False  # the official: no AugMix under --mta on any set
    lambda_y: float = bounded(0.2, gt=0)  # weight of the inlierness entropy term
    lambda_q: float = bounded(4.0, ge=0)  # weight of the affinity (quadratic) term
    max_iter: int = bounded(5, ge=1)  # outer iterations, and the cap of each inner loop
    tol: float = bounded(1e-6, ge=0)  # inner loops stop when the update moves less
    # fraction of the other views whose mean squared distance sets a view's bandwidth
    neighbours: float = bounded(0.3, gt=0, le=1)
    temperature: float = bounded(1.0, gt=0)  # of the affinity's softmax over the logits
    text_head: str = one_of("protocol", ("protocol", "official"))  # official: SINGLE_PROMPT
    precision: str = one_of("fp16", PRECISIONS)  # autocast on CUDA, as the official; CPU: fp32


def mta_bandwidth(features: torch.Tensor, neighbours: float = 0.3) -> torch.Tensor:
    """Per-view Gaussian bandwidths ``[B, N]`` of view embeddings ``[B, N, D]``: ``sqrt(0.5
    * mean of the k smallest squared distances to the other views)``, ``k = max(1,
    int(neighbours * (N - 1)))`` (the sorted row's first entry, the view itself, left out)."""
    n = features.shape[-2]
    k = max(1, int(neighbours * (n - 1)))
    dist = torch.cdist(features, features)
    nearest = dist.sort(dim=-1).values[..., 1 : k + 1]
    h = torch.sqrt(0.5 * (nearest**2).mean(dim=-1))
    return h.clamp_min(torch.finfo(h.dtype).tiny)


def _kernel(features: torch.Tensor, mode: torch.Tensor, bandwidth: torch.Tensor) -> torch.Tensor:
    """``exp(-||x_i - m||^2 / (2 h_i^2))`` ``[B, N]`` (the official ``gaussian_kernel``)."""
    dist = (features - mode[:, None, :]).norm(dim=-1)
    return torch.exp(-(dist**2) / (2 * bandwidth**2))


def mta_solve(
    features: torch.Tensor,
    logits: torch.Tensor,
    *,
    lambda_y: float = 0.2,
    lambda_q: float = 4.0,
    max_iter: int = 5,
    tol: float = 1e-6,
    neighbours: float = 0.3,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The official ``solve_mta`` on B episodes at once: view embeddings ``[B, N, D]``
    (L2-normalised, view 0 the original) and their logits ``[B, N, C]`` -> ``(mode [B, D],
    inlierness [B, N])``. Each episode keeps its own early stops (see the module
    docstring); float32."""
    x = features.float()
    b, n, _ = x.shape
    bandwidth = mta_bandwidth(x, neighbours)
    p = (logits.float() / temperature).softmax(dim=-1)
    affinity = p @ p.transpose(1, 2)  # [B, N, N]
    y = torch.full((b, n), 1.0 / n, device=x.device)
    mode = x[:, 0]
    for _ in range(max_iter):
        density = _kernel(x, mode, bandwidth)  # fixed during the inlierness step
        active = torch.ones(b, dtype=torch.bool, device=x.device)
        for _ in range(max_iter):
            pull = (affinity * y[:, None, :]).sum(dim=-1)
            new = torch.softmax(1 / lambda_y * (density + lambda_q * pull), dim=-1)
            moved = (y - new).norm(dim=-1)
            y = torch.where(active[:, None], new, y)
            active = active & ~(moved < tol)
            if not bool(active.any()):
                break
        active = torch.ones(b, dtype=torch.bool, device=x.device)
        for _ in range(max_iter):
            weights = _kernel(x, mode, bandwidth) * y
            new = (weights[..., None] * x).sum(dim=1) / weights.sum(dim=1, keepdim=True)
            new = new / new.norm(dim=-1, keepdim=True)
            moved = (mode - new).norm(dim=-1)
            mode = torch.where(active[:, None], new, mode)
            active = active & ~(moved < tol)
            if not bool(active.any()):
                break
    return mode, y


class MTA(OwnHead, Method):
    Config = MTAConfig
    stream_kind = "episodic"  # every image is its own MeanShift problem
    adapts = False  # the method's own head; the shared model is never changed

    def setup(self) -> None:
        cfg = self.config
        if cfg.views + int(cfg.include_original) < 2:
            raise ValueError("mta needs at least two views (the MeanShift runs over views)")
        self.head = class_head(self.model, cfg.text_head, SINGLE_PROMPT)

    @torch.no_grad()
    def step(self, images: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        with self.timed("adapt"):

            def encode(views: torch.Tensor) -> torch.Tensor:
                with autocast_context(cfg.precision, self.device):
                    return encode_flat(self.model.encode_image, views, cfg.chunk_views).float()

            head = self.head.float()

            def solve(feats: torch.Tensor) -> torch.Tensor:  # [V, b, D] -> modes [b, D]
                feats = feats.transpose(0, 1)  # [b, V, D]
                logits = self.model.logit_scale * feats @ head.t()
                return mta_solve(
                    feats,
                    logits,
                    lambda_y=cfg.lambda_y,
                    lambda_q=cfg.lambda_q,
                    max_iter=cfg.max_iter,
                    tol=cfg.tol,
                    neighbours=cfg.neighbours,
                    temperature=cfg.temperature,
                )[0]

            # each chunk's episodes are solved as soon as its views are encoded
            mode = encode_in_chunks(
                images, cfg, self.generator, encode, cfg.view_memory_mb, reduce=solve
            )
        with self.timed("predict"):
            return (self.model.logit_scale * mode @ head.t()).float()
