"""ECALP: efficient, context-aware label propagation over a graph that grows with the stream.

Paper: Li et al., "Efficient and Context-Aware Label Propagation for Zero-/Few-Shot
Training-Free Adaptation of Vision-Language Model", ICLR 2025
(https://arxiv.org/abs/2412.18303). Official code: https://github.com/Yushu-Li/ECALP, read at
commit 96ddf0bd482a44bcca460b6ff58eaa2597512851 (main.py, utils/iterative_label_propagation.py,
README.md). TTA-VLM's implementation (https://github.com/TomSheng21/tta-vlm at commit
bcc735fe49cbd2ab5b683781c41c66e1d3f78589: online_method/ecalp.py, online_method/ecalp_utils.py,
online_tta.py, clip/custom_clip.py) was read for ``tta_vlm``.

The rule (zero-shot mode, as ``iterative_label_propagation`` computes it). At test sample i
the graph has the C text nodes (the class embeddings), one node per image seen so far
(0 .. i) and one more copy of image i (the official code appends the newest feature twice,
``cat((features[:i+1], features[i]))``; the prediction is read off that copy):

* image-image edges: each image node keeps its ``k = min(k_image, N)`` (N = image nodes, the
  copy included) nearest image nodes, itself included, by the context-aware re-weighted
  cosine ``s(u, v) = <normalize(f_u * w), normalize(f_v)>`` with ``w = normalize(var_c(t_c))``
  the per-dimension variance of the text embeddings over classes (``edge_reweighting``,
  ``force_1=True``); the older node of a pair carries the weights (the official incremental
  update computes every edge with the new node as ``s(old, new)``). A node's list is updated
  with each new node from its candidate store, as ``dynamic_graph_expansion`` does
  (``LabelGraph``: the previous copy's entry marked -1, the best ``k + 2`` kept, fewer
  while the older nodes number at most ``k + 1``, so an entry dropped early never returns);
* image-text edges: the ``min(k_text, C)`` text nodes of largest plain cosine ``<f, t_c>``;
* edge weights ``sim ** gamma``; ``W`` (image rows only) symmetrised ``W + W^T``, normalised
  ``D^-1/2 W D^-1/2`` with ``D^-1/2 = 1 / (sqrt(deg) + 1e-6)``;
* labels: text nodes the identity; image nodes start from ``Y0``: zero for the new node and
  its copy, and for every older node its one-hot prediction of the previous step scaled by
  its score / 5 (``top3_values / 5``; all image nodes are re-labelled at every step);
* ``num_iterations`` steps of ``Y_img <- alpha * W~[img, :] @ [I; Y_img] + (1 - alpha) * Y0``;
  the prediction is the copy's row, the official output ``softmax(10000 * y)``.

Setting (defaults = the official main.py argparse defaults, which its README runs on every
task and TTA-VLM hard-codes): ``k_text`` 3, ``k_image`` 8, ``gamma`` 10, ``alpha`` 1, 3
iterations, pseudo-label scale 1/5, output scale 10000 (``pred * 10000``). The graph
persists along the stream (online, one sample at a time in stream order, the samples of a
batch in batch order) and ``reset()`` empties it.

What differs and why:
* Input: the official code reads pre-extracted feature files (made with DMN's pipeline; not
  part of its repository), averaging a ``[N, V, D]`` file over its views when given one. Here
  the feature of the image itself (one view), L2-normalised, as TTA-VLM's implementation
  feeds it. Text nodes: the protocol head by default (``text_head=protocol``);
  ``text_head=official`` is TTA-VLM's single prompt "a photo of a {}." (the official
  features' head is DMN's extraction, not reproducible from the ECALP repository). Either
  head is the method's own tensor: the shared model is never changed (``adapts = False``).
* Output: logits ``output_scale * y`` of the copy's row, whose softmax is the official
  output ``softmax(y * 10000)``. These are scores, not a probability model: the propagated
  labels ``y`` are not log-probabilities and the scale 10000 makes the softmax one-hot
  (the default suite's NLL was 151 nats and ECE 39%, numbers that say nothing). So
  ``scores_are_logits = False``: the results record it and the tables print "n/a
  (scores)" for NLL and ECE (accuracy reads only the argmax).
* The adjacency is built from edge lists (``index_add``, ``torch.sparse.mm`` on a dense
  label matrix) instead of sparse-sparse products: the same sums in another order (checked
  against the official functions: docs/methods.md#ecalp).
* Precision: the official features are whatever its files hold; TTA-VLM computes features
  under fp16 autocast and the similarities in float32 (its ``.float()`` in
  ``edge_reweighting``); here the image tower runs under fp16 autocast on CUDA
  (``precision``), float32 on the CPU, and the graph is float32.
* Few-shot mode (labelled support images) is left out: the benchmark gives no labels.

TTA-VLM departs from the official code in nothing this configuration holds (``tta_vlm =
{}``; its single-image input and single prompt are the ``text_head=official`` setting).

Measured effect: docs/methods.md#ecalp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mura_plugin.methods._text_heads import SINGLE_PROMPT, class_head
from tta_bench.bounds import bounded, one_of
from tta_bench.method import PRECISIONS, Method, autocast_context, effective_precision

__all__ = ["ECALP", "ECALPConfig", "LabelGraph", "propagate"]


@dataclass
class ECALPConfig:
    k_text: int = bounded(3, ge=1)  # text neighbours per image node
    k_image: int = bounded(8, ge=1)  # image neighbours per image node (itself included)
    gamma: float = bounded(10.0, gt=0)  # edge weight = similarity ** gamma
    alpha: float = bounded(1.0, ge=0, le=1)
    num_iterations: int = bounded(3, ge=1)
    pseudo_label_scale: float = bounded(0.2, ge=0)  # Y0 of older nodes: score / 5
    output_scale: float = bounded(10000.0, gt=0)  # official output softmax(10000 * y)
    text_head: str = one_of(
        "protocol", ("protocol", "official")
    )  # official: ("a photo of a {}.", TTA-VLM's)
    precision: str = one_of(
        "fp16", PRECISIONS
    )  # image tower autocast on CUDA; CPU: fp32. The graph: fp32


def propagate(
    img_idx: torch.Tensor,
    img_sim: torch.Tensor,
    txt_idx: torch.Tensor,
    txt_sim: torch.Tensor,
    y0: torch.Tensor,
    gamma: float,
    alpha: float,
    iterations: int,
) -> torch.Tensor:
    """ECALP's label propagation on a kNN graph of ``n`` image nodes and ``C`` text nodes:
    image node u has directed edges to image nodes ``img_idx[u] [k]`` and text nodes
    ``txt_idx[u] [kt]`` with similarities ``img_sim``, ``txt_sim``; ``y0 [n, C]`` the initial
    image labels (text node c's label is one-hot c). Weights ``sim ** gamma``, symmetrised
    ``W + W^T``, normalised ``D^-1/2 W D^-1/2`` (``1 / (sqrt(deg) + 1e-6)``), then
    ``iterations`` steps of ``Y <- alpha * W~[img] @ [I; Y] + (1 - alpha) * y0``. Returns
    ``Y [n, C]`` (float32)."""
    n, c = y0.shape
    dev = y0.device
    k, kt = img_idx.shape[1], txt_idx.shape[1]
    # node ids: text nodes 0 .. C-1, image nodes C .. C+n-1
    rows = torch.arange(n, device=dev) + c
    src = torch.cat([rows.repeat_interleave(k), rows.repeat_interleave(kt)])
    dst = torch.cat([img_idx.reshape(-1) + c, txt_idx.reshape(-1)])
    w = torch.cat([img_sim.reshape(-1), txt_sim.reshape(-1)]).float().pow(gamma)
    deg = torch.zeros(n + c, device=dev).index_add_(0, src, w).index_add_(0, dst, w)
    scale = 1.0 / (deg.sqrt() + 1e-6)
    # W_sym = W + W^T: every directed edge gives (src, dst) and (dst, src)
    r, col = torch.cat([src, dst]), torch.cat([dst, src])
    val = torch.cat([w, w]) * scale[r] * scale[col]
    keep = r >= c  # the rows of image nodes: text labels stay fixed
    r, col, val = r[keep] - c, col[keep], val[keep]
    to_text = col < c
    text_part = torch.zeros(n, c, device=dev).index_put_(
        (r[to_text], col[to_text]), val[to_text], accumulate=True
    )  # W~[img, text] @ I
    img = ~to_text
    a_img = torch.sparse_coo_tensor(
        torch.stack([r[img], col[img] - c]), val[img], (n, n), device=dev, check_invariants=False
    ).coalesce()
    y0 = y0.float()
    y = y0
    for _ in range(iterations):
        y = alpha * (text_part + torch.sparse.mm(a_img, y)) + (1 - alpha) * y0
    return y


class LabelGraph:
    """The growing ECALP graph of one stream; ``add(f)`` inserts one normalised image
    feature ``[D]`` (with the official's temporary copy), propagates and returns the copy's
    scores ``[C]``.

    Per image node it keeps its feature, re-weighted feature, text neighbours, pseudo-label
    and the official's *candidate store*: its best image neighbours with a margin, as
    ``dynamic_graph_expansion`` keeps them. With N image nodes (the copy included) and
    ``k = min(k_image, N)``, an older node's store is renewed at each step from its previous
    store (the entry of the previous copy marked -1) plus the new node and its copy, keeping
    the best ``k + 2`` (``k + 1`` when the older nodes number ``k + 1``, ``k`` when they
    number at most ``k``); its graph edges are the first k. Entries dropped while the store
    had no margin never come back, so a list is not always the top k of the nodes present.
    """

    def __init__(self, text: torch.Tensor, cfg: ECALPConfig):
        self.text = text.float()  # [C, D], L2-normalised class embeddings
        self.cfg = cfg
        c, d = self.text.shape
        self.weights = F.normalize(self.text.var(dim=0), dim=0)  # context-aware re-weighting
        dev = self.text.device
        self.n = 0
        self.kt = min(cfg.k_text, c)
        cap = 64
        self.feats = torch.zeros(cap, d, device=dev)
        self.wfeats = torch.zeros(cap, d, device=dev)
        self.txt_idx = torch.zeros(cap, self.kt, dtype=torch.long, device=dev)
        self.txt_sim = torch.zeros(cap, self.kt, device=dev)
        self.y_val = torch.zeros(cap, device=dev)
        self.y_cls = torch.zeros(cap, dtype=torch.long, device=dev)
        # the candidate stores of the nodes 0 .. n-1 (their width changes with n)
        self.store_sim = torch.zeros(0, 0, device=dev)
        self.store_idx = torch.zeros(0, 0, dtype=torch.long, device=dev)

    def _grow(self) -> None:
        for name in ("feats", "wfeats", "txt_idx", "txt_sim", "y_val", "y_cls"):
            t = getattr(self, name)
            setattr(self, name, torch.cat([t, torch.zeros_like(t)]))

    def _image_edges(self, f: torch.Tensor, wf: torch.Tensor):
        """Image-image lists ``[n + 2, k]`` (indices, similarities) of the graph with the
        new node n and its copy n + 1, updating the stores (``dynamic_graph_expansion``)."""
        n, dev = self.n, f.device
        big_n = n + 2
        k = min(self.cfg.k_image, big_n)
        s_self = (wf @ f).view(1)
        if n == 0:  # the first sample and its copy
            sim, idx = s_self.expand(2).topk(k)
            self.store_sim, self.store_idx = sim[None], idx[None]
            return idx.expand(2, k), sim.expand(2, k)
        s_old = self.wfeats[:n] @ f  # s(q, new) for every older node q: q carries the weights
        row = torch.cat([s_old, s_self, s_self])  # the new node's (and its copy's) candidates
        new_sim, new_idx = row.topk(k)
        stale = self.store_idx == n  # the previous copy, now the new node's index
        store_sim = self.store_sim.masked_fill(stale, -1.0)
        ext_sim = torch.cat([store_sim, s_old[:, None].expand(n, 2)], dim=1)
        pair = torch.tensor([n, n + 1], device=dev)
        ext_idx = torch.cat([self.store_idx, pair.expand(n, 2)], dim=1)
        width = k + 1 if n == k + 1 else k + 2 if n > k else k
        kept_sim, pos = ext_sim.topk(width, dim=1)
        kept_idx = ext_idx.gather(1, pos)
        if n > k:
            mine_sim, mine_idx = row.topk(width)
        else:
            mine_sim, mine_idx = new_sim, new_idx
        self.store_sim = torch.cat([kept_sim, mine_sim[None]])
        self.store_idx = torch.cat([kept_idx, mine_idx[None]])
        img_idx = torch.cat([kept_idx[:, :k], new_idx.expand(2, k)])
        img_sim = torch.cat([kept_sim[:, :k], new_sim.expand(2, k)])
        return img_idx, img_sim

    def add(self, f: torch.Tensor) -> torch.Tensor:
        cfg, n = self.cfg, self.n
        if n + 1 >= self.feats.shape[0]:
            self._grow()
        dev = f.device
        f = f.float()
        wf = F.normalize(f * self.weights, dim=0)
        img_idx, img_sim = self._image_edges(f, wf)
        t_sim, t_idx = (self.text @ f).topk(self.kt)
        txt_idx = torch.cat([self.txt_idx[:n], t_idx.expand(2, -1)])
        txt_sim = torch.cat([self.txt_sim[:n], t_sim.expand(2, -1)])
        y0 = torch.zeros(n + 2, self.text.shape[0], device=dev)
        y0[torch.arange(n, device=dev), self.y_cls[:n]] = self.y_val[:n]
        y = propagate(
            img_idx, img_sim, txt_idx, txt_sim, y0, cfg.gamma, cfg.alpha, cfg.num_iterations
        )
        # everyone's new pseudo-label (the official ``topk(1)``); the copy is dropped
        top_val, top_cls = y.topk(1, dim=1)
        self.y_val[: n + 1] = top_val[: n + 1, 0] * cfg.pseudo_label_scale
        self.y_cls[: n + 1] = top_cls[: n + 1, 0]
        self.feats[n], self.wfeats[n] = f, wf
        self.txt_idx[n], self.txt_sim[n] = t_idx, t_sim
        self.n = n + 1
        return y[n + 1]


class ECALP(Method):
    Config = ECALPConfig
    stream_kind = "online"
    #: one forward of the image per sample, no backward: sweeps pack its jobs
    light = True
    #: propagated label scores times 10000, not a probability model: no NLL/ECE in tables
    scores_are_logits = False

    def setup(self) -> None:
        cfg = self.config
        # the method's own head: the shared model is never changed (adapts = False)
        self.head = class_head(self.model, cfg.text_head, SINGLE_PROMPT)
        self.reset()

    def class_embeddings(self) -> torch.Tensor:
        """The text nodes ``[C, D]`` (``text_head``)."""
        return self.head

    def reset(self) -> None:
        self.graph = LabelGraph(self.head, self.config)

    @torch.no_grad()
    def step(self, images: torch.Tensor) -> torch.Tensor:
        with autocast_context(self.config.precision, self.device):
            feats = self.model.encode_image(images)
        return self.step_features(feats)

    def features_only(self) -> bool:
        return effective_precision(self.config.precision, self.device) == "fp32"

    @torch.no_grad()
    def step_features(self, features: torch.Tensor) -> torch.Tensor:
        feats = F.normalize(features.float(), dim=-1)
        scores = torch.stack([self.graph.add(f) for f in feats])
        return self.config.output_scale * scores
