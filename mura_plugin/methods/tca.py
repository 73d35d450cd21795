"""TCA: token condensation as training-free test-time adaptation (online).

Paper: Wang, Gong, Wang, Huang, Luo, "Is Less More? Exploring Token Condensation as
Training-free Test-time Adaptation", ICCV 2025, https://arxiv.org/abs/2410.14729.
Official code: https://github.com/Jo-wang/TCA, read at commit
0f846d6619a3adf4c4a0d9b7b83260dc6fed8bd5 (runner.py: ``get_arguments``,
``update_reservoir_sim``, ``compute_reservoir_logits``, ``run_test_tca``; utils.py:
``cls_feature_similarity``, ``complement_idx``, ``get_clip_logits``, ``softmax_entropy``;
clip/model.py: ``ResidualAttentionBlock_Ours``, ``Transformer_drop``, ``VisionTransformer``,
``CLIP.update_cls_token``, ``convert_weights``; clip/utils.py: ``coreset_averaging``,
``k_center_greedy``; clip/clip.py ``load``; configs/*.yaml; datasets/*.py). The repository
has no licence file: read only, nothing copied.

Setting (defaults = the official runner: ``--token_pruning Ours-0.1``, ``--reservoir-sim``,
``--div``, ``--token_sim``, ``--flag`` all on; its per-dataset configs/*.yaml, ImageNet's on
other sets; one image per step; fp16 CLIP). Per test image:

1. Forward with token condensation at the condensation blocks (officially blocks 3, 6, 9
   of ViT-B/16's 12). With N tokens entering (class token first): ``left = ceil((1 - R)
   (N - 1))``, ``m = N - left`` (R = ``drop_rate``). The class token's attention to each
   patch token, averaged over heads, ranks the patches: the top ``left - 2m`` are kept as
   they are; the next ``2m`` are condensed into ``centers`` (4) tokens by coreset
   averaging (k-center greedy from a random first token; each token joins its nearest
   centre; per cluster the mean weighted by 1 / distance to the centre, the centre itself
   weight 1); the remaining ``N - 1 - left`` are fused into one token, their sum weighted
   by that attention (EViT's). The block's MLP runs on the ``1 + (left - 2m) + 4 + 1``
   tokens that remain: tokens are really dropped (ViT-B/16 at R 0.1: 197 -> 143 -> 104 ->
   77), so the forward costs fewer FLOPs. Once every class's reservoir holds at least two
   entries, domain anchors exist: per class, the mean of its entries' class tokens at every
   block. At condensation block i each image takes the anchor (at block i - 1, the block's
   input) most cosine-similar to its class token, prepended to the block's attention as an
   extra token (it attends and is attended); its row is dropped afterwards and the ranking
   reads the class row's attention to the patches as it is (not renormalised).
2. Reservoir: the image's class tokens after every block and its entropy (nats) join the
   reservoir of its pseudo-class (argmax of the CLIP logits). Over capacity (3), the entry
   with the highest ``entropy + mean cosine similarity`` of its layer-averaged class token
   to the class's other entries is dropped (the first in the class's order on ties); a
   class's entries stay sorted by entropy (stable).
3. Logits: ``clip_logits + lambda * sum_c-entries exp(-beta (1 - a))`` per class, with
   ``a = sum_l w_l cos(t_l, e_l)`` over the blocks and ``w = softmax(linspace(0, 1, L) /
   scale)`` (the official exponential layer weights, normalised).
The reservoir and anchors persist across batches (online); ``reset()`` empties them.

What differs and why:
* ``scale_lambda`` (default on) multiplies lambda by ``logit_scale / 100``: the official
  code assumes CLIP's logit scale 100 (as TDA's ``scale_alpha``).
* Condensation blocks: the official code hard-codes blocks 3, 6, 9 (its ViT-L/14 too);
  the same on towers deeper than 9 blocks, ``k * depth // 4`` for k = 1, 2, 3 on shallower
  ones (the 4-block tiny ViT: 1, 2, 3); ``drop_layers`` names them.
* A split with ``left - 2m < 0`` or fewer than ``centers`` tokens to condense makes the
  official code fail (``topk`` of a negative count) or append zero tokens; here such a
  block runs unpruned. The rule saves ``3m - 6`` tokens a block: the tiny ViT's 16 patches
  at R 0.1 give m = 2, so it saves nothing there (17 tokens stay 17; the anchor token even
  adds attention work); R 0.2 gives 17 -> 11 -> 8 -> 8.
* Ranking: one stable descending sort of the class attention (officially two ``topk``
  calls, ties in unspecified order). The fused token sums its tokens in ranking order.
* The random first centre comes from the method's generator (seeded per batch by the
  runner), drawn per image and condensation block in stream order (officially torch's
  global generator).
* ``update=sample`` (default) forwards the images of a batch one at a time, each with the
  anchors left by the images before it, as the official one-image loop; ``update=batch``
  forwards the batch at once with the anchors at its start (faster; not the official
  order). The reservoir is updated image by image in both.
* Precision: fp16 autocast over fp32 weights on CUDA; class tokens, anchors, reservoir
  and logits in float32 (officially an fp16 model, class tokens kept in float32, anchors in
  fp16, the affinity in float64 and the reservoir logits in fp16). CPU: float32.
* CLIP logits (and the entropy the reservoir keeps) use the model's own logit scale, as
  every method here (officially a fixed 100, CLIP's own).
* Condensation blocks compute their attention from the block's fused in-projection (the
  same arithmetic as ``nn.MultiheadAttention`` with ``need_weights``) to read the weights;
  other blocks are the model's own.
* Heads (``text_head``): ``protocol`` by default; ``official``: TCA's loaders' templates,
  CLIP's 80 ImageNet templates on the ImageNet family and ImageNet-C, CLIP's per-dataset
  lists on the ten cross-domain sets, the single prompt elsewhere (digits, CIFAR).
* ``drop_rate`` 0.1 is the runner's default (``Ours-0.1``); its README's table says 0.035.
* The reservoir is fixed tensors per class with the official list order kept as slot
  lists; the image feature the official entries carry (never read with ``token_sim``) is
  not kept. The ``token_sim=False`` / ``div=False`` variants are not implemented.
* Towers: an open_clip ``VisionTransformer`` with class-token pooling and standard blocks;
  anything else (ResNets, timm trunks, attention pooling) is refused with a ValueError.

Cost: the condensed blocks run on fewer tokens, so the harness's FLOP counter
(``FlopCounterMode``) sees the smaller matrix products (tested on the tiny ViT).

Measured effect: docs/methods.md#tca.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from mura_plugin.losses import view_entropy
from mura_plugin.methods._text_heads import SINGLE_PROMPT, OwnHead, class_head
from mura_plugin.methods._text_heads import TEXT_HEADS as TEXT_HEAD_CHOICES
from mura_plugin.methods.vte import OFFICIAL_TEMPLATES as CLIP_DATASET_TEMPLATES
from tta_bench.bounds import bounded, one_of
from tta_bench.catalog import dataset_flag
from tta_bench.method import PRECISIONS, Method, autocast_context
from tta_bench.model import ZeroShotClassifier
from tta_bench.text_head import resolve_templates

__all__ = [
    "TCA",
    "TCAConfig",
    "Reservoir",
    "Split",
    "coreset_average",
    "default_drop_layers",
    "eviction_scores",
    "layer_weights",
    "official_templates",
    "rank_tokens",
    "token_plan",
]

UPDATES = ("sample", "batch")
#: (reservoir_size, scale, lambd, beta) of the official configs/*.yaml (imagenet.yaml
#: elsewhere), keyed by the registered dataset names.
OFFICIAL = {
    "imagenet": (3, 0.1, 3.0, 5.0),
    "imagenet_a": (3, 0.01, 3.0, 5.0),
    "imagenet_v2": (3, 0.1, 4.0, 9.0),
    "imagenet_r": (3, 0.1, 3.0, 8.0),
    "imagenet_sketch": (3, 0.1, 4.0, 8.0),
    "caltech101": (3, 1.0, 7.0, 6.0),
    "dtd": (3, 1.0, 2.0, 6.0),
    "eurosat": (2, 5.0, 8.0, 7.0),
    "fgvc_aircraft": (3, 0.02, 2.0, 2.0),
    "food101": (3, 0.01, 2.0, 5.0),
    "oxford_flowers": (3, 0.01, 7.0, 7.0),
    "oxford_pets": (3, 5.5, 2.0, 6.0),
    "stanford_cars": (3, 0.1, 1.5, 8.0),
    "sun397": (3, 0.01, 4.0, 3.0),
    "ucf101": (3, 0.01, 6.0, 8.0),
}
_UCF = tuple(
    f"a {kind} of {who} person {verb}{{}}."
    for verb in ("", "using ", "doing ", "during ", "performing ", "practicing ")
    for who in ("a", "the")
    for kind in ("photo", "video", "example", "demonstration")
)
#: CLIP's per-dataset prompt lists, as TCA's cross-domain loaders hold them (datasets/*.py).
CROSS_DOMAIN_TEMPLATES: dict[str, tuple[str, ...]] = {
    **{k: CLIP_DATASET_TEMPLATES[k] for k in ("caltech101", "dtd", "eurosat", "food101")},
    "sun397": CLIP_DATASET_TEMPLATES["sun397"],
    "fgvc_aircraft": tuple(f"a photo of {a} {{}}, a type of aircraft." for a in ("a", "the")),
    "oxford_flowers": ("a photo of a {}, a type of flower.",),
    "oxford_pets": ("a photo of a {}, a type of pet.",),
    "stanford_cars": (
        "a photo of a {}.",
        "a photo of the {}.",
        "a photo of my {}.",
        "i love my {}!",
        "a photo of my dirty {}.",
        "a photo of my clean {}.",
        "a photo of my new {}.",
        "a photo of my old {}.",
    ),
    "ucf101": _UCF,
}


def official_templates(dataset: str | None) -> list[str]:
    """TCA's head for ``dataset``: CLIP's 80 ImageNet templates on the ImageNet family
    (its I/A/V/R/S loaders) and ImageNet-C, CLIP's per-dataset lists on the ten
    cross-domain sets, else (no official loader) the single prompt."""
    if dataset in CROSS_DOMAIN_TEMPLATES:
        return list(CROSS_DOMAIN_TEMPLATES[dataset])
    if dataset_flag(dataset, "imagenet_family") or dataset in ("imagenet_c", "imagenet_ood"):
        return resolve_templates("clip-imagenet-80")
    return list(SINGLE_PROMPT)


class Split(NamedTuple):
    """One condensation: patches kept as they are, condensed into the centres, fused."""

    keep: int
    cluster: int
    rest: int


def default_drop_layers(depth: int) -> list[int]:
    """The official blocks 3, 6, 9 on towers deeper than 9 blocks, else ``k * depth // 4``
    for k = 1, 2, 3 (distinct, at least 1)."""
    if depth > 9:
        return [3, 6, 9]
    return sorted({max(1, k * depth // 4) for k in (1, 2, 3)})


def token_plan(
    tokens: int, depth: int, layers: list[int], rate: float, centers: int
) -> list[Split | None]:
    """Per block the ``Split`` it applies (None: the block runs on all its tokens), for
    ``tokens`` entering the first block (class token included): at a condensation block
    with N tokens, ``left = ceil((1 - rate)(N - 1))``, ``m = N - left``; keep ``left - 2m``,
    condense ``2m`` into ``centers``, fuse the other ``N - 1 - left``. A split with a
    negative keep or fewer than ``centers`` tokens to condense is skipped."""
    plan: list[Split | None] = []
    n = tokens
    for i in range(depth):
        split = None
        if i in layers:
            left = math.ceil((1 - rate) * (n - 1))
            m = n - left
            if left - 2 * m >= 0 and 2 * m >= centers:
                split = Split(left - 2 * m, 2 * m, n - 1 - left)
                n = 1 + split.keep + centers + 1
        plan.append(split)
    return plan


def layer_weights(depth: int, scale: float) -> torch.Tensor:
    """``exp(linspace(0, 1, depth) / scale)`` normalised to sum 1 (float64 arithmetic, as
    the official numpy; a softmax, so no overflow at small ``scale``), float32."""
    return torch.softmax(torch.linspace(0, 1, depth, dtype=torch.float64) / scale, 0).float()


def rank_tokens(
    cls_attn: torch.Tensor, split: Split
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Patch indices ``(keep, cluster, rest)`` from the class token's head-averaged
    attention ``cls_attn [B, N - 1]``: a stable descending sort, sliced by ``split``."""
    order = torch.sort(cls_attn, dim=1, descending=True, stable=True).indices
    a, b = split.keep, split.keep + split.cluster
    return order[:, :a], order[:, a:b], order[:, b:]


def coreset_average(tokens: torch.Tensor, k: int, starts: torch.Tensor) -> torch.Tensor:
    """``[B, k, W]`` from ``tokens [B, n, W]``: k-center greedy centres (first: token
    ``starts [B]``, then each time the token farthest from the chosen ones, first on ties);
    every token joins its nearest centre (first on ties); per cluster the mean of its tokens
    weighted by ``1 / distance`` to the centre (weight 1 at distance 0). An empty cluster
    gives a zero token, as officially."""
    t = tokens.float()
    rows = torch.arange(t.shape[0], device=t.device)
    idx = [starts.to(t.device)]
    near = (t - t[rows, idx[0]][:, None]).norm(dim=-1)
    for _ in range(k - 1):
        idx.append(near.argmax(dim=1))
        near = torch.minimum(near, (t - t[rows, idx[-1]][:, None]).norm(dim=-1))
    centres = t[rows[:, None], torch.stack(idx, dim=1)]  # [B, k, W]
    assign = torch.cdist(t, centres).argmin(dim=-1)  # [B, n]
    dist = (t - centres[rows[:, None], assign]).norm(dim=-1)
    weight = torch.where(dist == 0, torch.ones_like(dist), 1.0 / dist)
    member = F.one_hot(assign, k).to(t.dtype) * weight[..., None]  # [B, n, k]
    total = member.sum(dim=1)  # [B, k]
    merged = torch.einsum("bnk,bnw->bkw", member, t)
    return torch.where(total[..., None] > 0, merged / total.clamp_min(1e-30)[..., None], 0.0)


def _attention(mha: nn.MultiheadAttention, h: torch.Tensor):
    """``nn.MultiheadAttention(h, h, h, need_weights=True, average_attn_weights=False)`` of
    batch-first ``h [B, N, W]``: ``(output [B, N, W], weights [B, heads, N, N])``."""
    b, n, w = h.shape
    heads = mha.num_heads
    q, k, v = F.linear(h, mha.in_proj_weight, mha.in_proj_bias).chunk(3, dim=-1)
    q, k, v = (t.reshape(b, n, heads, w // heads).transpose(1, 2) for t in (q, k, v))
    weights = ((q * (w // heads) ** -0.5) @ k.transpose(-2, -1)).softmax(dim=-1)
    out = (weights.to(v.dtype) @ v).transpose(1, 2).reshape(b, n, w)
    return mha.out_proj(out), weights


def _condense_block(
    block: nn.Module,
    x: torch.Tensor,
    split: Split,
    anchor: torch.Tensor | None,
    centers: int,
    starts: torch.Tensor,
) -> torch.Tensor:
    """One open_clip residual block on batch-first ``x [B, N, W]`` with TCA's condensation
    between its attention and its MLP; ``anchor [B, W]`` (or None) joins the attention."""
    extra = x if anchor is None else torch.cat([anchor[:, None].to(x.dtype), x], dim=1)
    out, weights = _attention(block.attn, block.ln_1(extra))
    if anchor is not None:
        out, weights = out[:, 1:], weights[:, :, 1:, 1:]
    x = x + block.ls_1(out)
    cls_attn = weights[:, :, 0, 1:].float().mean(dim=1)  # [B, N - 1]
    keep, cluster, rest = rank_tokens(cls_attn, split)
    patches = x[:, 1:]

    def take(index: torch.Tensor) -> torch.Tensor:
        return patches.gather(1, index[..., None].expand(-1, -1, patches.shape[-1]))

    merged = coreset_average(take(cluster), centers, starts)
    fused = (take(rest).float() * cls_attn.gather(1, rest)[..., None]).sum(dim=1, keepdim=True)
    x = torch.cat([x[:, :1], take(keep), merged.to(x.dtype), fused.to(x.dtype)], dim=1)
    return x + block.ls_2(block.mlp(block.ln_2(x)))


def _nearest_anchor(anchors: torch.Tensor, cls: torch.Tensor) -> torch.Tensor:
    """Per image the anchor ``[K, W]`` most cosine-similar to its class token ``[B, W]``."""
    sim = F.cosine_similarity(anchors[:, None].float(), cls[None].float(), dim=-1)  # [K, B]
    return anchors[sim.argmax(dim=0)]


def check_vit(model: ZeroShotClassifier) -> nn.Module:
    """The model's open_clip ViT image tower; a ValueError naming the model otherwise."""
    visual = model.visual
    blocks = getattr(getattr(visual, "transformer", None), "resblocks", None)
    ok = (
        all(hasattr(visual, a) for a in ("_embeds", "_pool", "proj", "positional_embedding"))
        and isinstance(blocks, (nn.ModuleList, nn.Sequential))
        and getattr(visual, "attn_pool", None) is None
        and getattr(visual, "pool_type", "tok") == "tok"
        and getattr(visual, "class_embedding", None) is not None
        and all(
            isinstance(getattr(b, "attn", None), nn.MultiheadAttention)
            and b.attn._qkv_same_embed_dim
            and all(hasattr(b, a) for a in ("ln_1", "ln_2", "mlp", "ls_1", "ls_2"))
            for b in blocks
        )
    )
    if not ok:
        raise ValueError(
            f"tca condenses the visual tokens of an open_clip ViT with a class token; the model "
            f"{model.model_name!r} ({type(visual).__name__}) is not one"
        )
    return visual


def condensed_forward(
    visual: nn.Module,
    pixels: torch.Tensor,
    plan: list[Split | None],
    anchors: torch.Tensor | None,
    starts: torch.Tensor,
    centers: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(projected features [B, D], class token after every block [B, L, W] float32)``
    of normalised images, with the condensation of ``plan`` (``starts [B, splits]``: each
    split's first coreset centre) and ``anchors [C, L, W]`` (or None). The tower's forward
    hooks (the runner's pass counter) see the images once, as for ``visual(pixels)``."""
    x = visual._embeds(pixels)
    batch_first = getattr(visual.transformer, "batch_first", True)
    tokens, j = [], 0
    for i, block in enumerate(visual.transformer.resblocks):
        split = plan[i]
        if split is None:
            x = block(x) if batch_first else block(x.transpose(0, 1)).transpose(0, 1)
        else:
            anchor = None if anchors is None else _nearest_anchor(anchors[:, i - 1], x[:, 0])
            x = _condense_block(block, x, split, anchor, centers, starts[:, j])
            j += 1
        tokens.append(x[:, 0].float())
    pooled, _ = visual._pool(x)
    out = pooled @ visual.proj if visual.proj is not None else pooled
    for hook_id, hook in list(visual._forward_hooks.items()):
        if visual._forward_hooks_with_kwargs.get(hook_id, False):
            result = hook(visual, (pixels,), {}, out)
        else:
            result = hook(visual, (pixels,), out)
        out = out if result is None else result
    return out, torch.stack(tokens, dim=1)


def eviction_scores(tokens: torch.Tensor, entropies: list[float]) -> torch.Tensor:
    """Per entry ``[n]`` (float64): its entropy plus the mean cosine similarity of its
    layer-averaged class token (``tokens [n, L, W]``) to the other entries' (official
    ``cls_feature_similarity`` with ``token_sim``, ``div``)."""
    unit = F.normalize(tokens.float().mean(dim=1), dim=1)
    sim = unit @ unit.t()
    mean = (sim.sum(dim=1) - sim.diagonal()) / (len(entropies) - 1)
    return torch.tensor(entropies, dtype=torch.float64) + mean.double().cpu()


class Reservoir:
    """Per class up to ``size`` entries (class tokens ``[L, W]`` of every block, entropy),
    in fixed slots; ``order[c]`` lists class c's slots in the official list order (sorted
    by entropy, stable); ``anchors()`` the per-class means once every class has two."""

    def __init__(self, classes: int, size: int, layers: int, width: int, device):
        self.size = size
        self.tokens = torch.zeros(classes, size, layers, width, device=device)
        self.norms = torch.ones(classes, size, layers, device=device)
        self.filled = torch.zeros(classes, size, device=device)
        self.entropy: list[dict[int, float]] = [{} for _ in range(classes)]
        self.order: list[list[int]] = [[] for _ in range(classes)]
        self.means = torch.zeros(classes, layers, width, device=device)
        self._two = 0  # classes holding at least two entries

    def anchors(self) -> torch.Tensor | None:
        """``[C, L, W]`` the class means, once every class holds two entries; else None."""
        return self.means if self._two == len(self.order) else None

    def _write(self, cls: int, slot: int, tokens: torch.Tensor, ent: float) -> None:
        self.tokens[cls, slot] = tokens
        self.norms[cls, slot] = tokens.norm(dim=-1).clamp_min(1e-8)
        self.filled[cls, slot] = 1.0
        self.entropy[cls][slot] = ent

    def offer(self, cls: int, tokens: torch.Tensor, ent: float) -> None:
        """Append the entry; over capacity drop the highest eviction score (the newcomer
        included); keep the class sorted by entropy; refresh its anchor."""
        order = self.order[cls]
        if len(order) < self.size:
            self._write(cls, len(order), tokens, ent)
            order.append(len(order))
            self._two += int(len(order) == 2)
        else:
            stacked = torch.cat([self.tokens[cls, order], tokens[None]])
            ents = [self.entropy[cls][s] for s in order] + [ent]
            drop = int(torch.argmax(eviction_scores(stacked, ents)))
            if drop < len(order):
                slot = order.pop(drop)
                self._write(cls, slot, tokens, ent)
                order.append(slot)
        order.sort(key=lambda s: self.entropy[cls][s])
        self.means[cls] = self.tokens[cls, order].mean(dim=0)

    def logits(self, tokens: torch.Tensor, weights: torch.Tensor, lambd: float, beta: float):
        """``[C]``: ``lambd * sum`` over each class's entries of ``exp(-(beta - beta a))``,
        ``a = sum_l weights_l cos(tokens_l, entry_l)`` for class tokens ``[L, W]``."""
        unit = tokens.float() / tokens.float().norm(dim=-1, keepdim=True).clamp_min(1e-8)
        cos = torch.einsum("cslw,lw->csl", self.tokens, unit) / self.norms
        affinity = (cos * weights.to(cos.device)).sum(dim=-1)  # [C, S]
        return lambd * (torch.exp(-(beta - beta * affinity)) * self.filled).sum(dim=1)


@dataclass
class TCAConfig:
    drop_rate: float = bounded(0.1, gt=0, lt=1)  # R of --token_pruning Ours-R
    # condensation blocks (0-based); None: 3, 6, 9 (official) or k * depth // 4 on shallow towers
    drop_layers: Optional[list[int]] = bounded(None, ge=0)
    centers: int = bounded(4, ge=1)  # coreset_averaging(num_centers=4)
    anchors: bool = True  # --flag: domain anchor tokens in the condensation blocks
    # None: the official value for the dataset (OFFICIAL: configs/*.yaml)
    reservoir_size: Optional[int] = bounded(None, ge=1)
    scale: Optional[float] = bounded(None, gt=0)  # layer weights exp(linspace(0, 1, L) / scale)
    lambd: Optional[float] = bounded(None, ge=0)
    beta: Optional[float] = bounded(None, ge=0)
    scale_lambda: bool = True  # lambda is tuned for logit scale 100: rescale to the model's
    update: str = one_of("sample", UPDATES)  # sample: official one-image order | batch
    text_head: str = one_of("protocol", TEXT_HEAD_CHOICES)  # protocol | official
    precision: str = one_of("fp16", PRECISIONS)  # autocast on CUDA (official fp16); CPU: fp32


class TCA(OwnHead, Method):
    Config = TCAConfig
    #: one (condensed) forward of each image, no backward: sweeps pack its jobs
    light = True
    stream_kind = "online"
    resolved = ("reservoir_size", "scale", "lambd", "beta", "drop_layers", "token_counts")

    def setup(self) -> None:
        cfg = self.config
        visual = check_vit(self.model)
        dataset = self.model.dataset
        size, scale, lambd, beta = OFFICIAL.get(dataset or "", OFFICIAL["imagenet"])
        self.reservoir_size = size if cfg.reservoir_size is None else cfg.reservoir_size
        self.scale = scale if cfg.scale is None else cfg.scale
        self.lambd = lambd if cfg.lambd is None else cfg.lambd
        self.beta = beta if cfg.beta is None else cfg.beta
        depth = len(visual.transformer.resblocks)
        layers = default_drop_layers(depth) if cfg.drop_layers is None else cfg.drop_layers
        if any(i >= depth for i in layers):
            raise ValueError(f"method.drop_layers={layers}: the tower has {depth} blocks (0-based)")
        self.drop_layers = sorted(set(layers))
        n = int(visual.positional_embedding.shape[0])
        self.plan = token_plan(n, depth, self.drop_layers, cfg.drop_rate, cfg.centers)
        #: tokens entering the first block, then after every block
        self.token_counts = [n]
        for split in self.plan:
            last = self.token_counts[-1]
            self.token_counts.append(last if split is None else 2 + split.keep + cfg.centers)
        self.weights = layer_weights(depth, self.scale).to(self.device)
        self.width = int(visual.positional_embedding.shape[1])
        self.depth = depth
        self.head = class_head(self.model, cfg.text_head, official_templates(dataset))
        self.reset()

    def reset(self) -> None:
        c = self.head.shape[0]
        self.reservoir = Reservoir(c, self.reservoir_size, self.depth, self.width, self.device)

    def _starts(self, b: int) -> torch.Tensor:
        """The first coreset centre of every image and split, ``[b, splits]``, drawn from
        the method's generator image by image (the official one-image order)."""
        highs = [s.cluster for s in self.plan if s is not None]
        draws = [
            int(torch.randint(h, (1,), generator=self.generator)) for _ in range(b) for h in highs
        ]
        return torch.tensor(draws, dtype=torch.long).view(b, len(highs))

    def encode(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normalised features [b, D], class tokens [b, L, W])`` of images in [0, 1],
        condensed with the current anchors."""
        size = self.model.preprocess.image_size
        if images.shape[-1] != size or images.shape[-2] != size:
            raise ValueError(
                f"{self.model.model_name} expects {size}x{size} images, got "
                f"{tuple(images.shape[-2:])}"
            )
        anchors = self.reservoir.anchors() if self.config.anchors else None
        starts = self._starts(images.shape[0]).to(self.device)
        with autocast_context(self.config.precision, self.device):
            out, tokens = condensed_forward(
                self.model.visual,
                self.model.normalize(images),
                self.plan,
                anchors,
                starts,
                self.config.centers,
            )
        feats = out.float()
        return feats / feats.norm(dim=-1, keepdim=True), tokens

    def _lambda(self) -> float:
        ratio = float(self.model.logit_scale) / 100.0 if self.config.scale_lambda else 1.0
        return self.lambd * ratio

    def _logits(self, feats: torch.Tensor) -> torch.Tensor:
        return self.model.logits_from_features(feats, self.head.float()).float()

    @torch.no_grad()
    def step(self, images: torch.Tensor) -> torch.Tensor:
        chunk = 1 if self.config.update == "sample" else max(1, images.shape[0])
        out = []
        for s in range(0, images.shape[0], chunk):
            feats, tokens = self.encode(images[s : s + chunk])
            logits = self._logits(feats)
            ents = view_entropy(logits).tolist()
            for i, pred in enumerate(logits.argmax(dim=1).tolist()):
                self.reservoir.offer(pred, tokens[i], ents[i])
                extra = self.reservoir.logits(tokens[i], self.weights, self._lambda(), self.beta)
                out.append(logits[i] + extra)
        return torch.stack(out)

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """The realtime track's prediction while busy: the condensed forward with the
        anchors as they stand, corrected by the reservoir, offering nothing to it."""
        feats, tokens = self.encode(images)
        logits = self._logits(feats)
        lambd = self._lambda()
        return torch.stack([
            logits[i] + self.reservoir.logits(t, self.weights, lambd, self.beta)
            for i, t in enumerate(tokens)
        ])  # fmt: skip
