"""COSMIC: clique-oriented semantic multi-space integration (online, training-free).

Paper: Huang, Jiang, Jiang, Li, Khan, Wang, "COSMIC: Clique-Oriented Semantic Multi-space
Integration for Robust CLIP Test-Time Adaptation", CVPR 2025,
https://arxiv.org/abs/2503.23388. Official code: https://github.com/hf618/COSMIC, read at
commit 34fde0738cd94d9a1df2f303ddfa25a541c32c57 (MIT licence; cosmic_main.py:
``direct_inference``, ``main_worker``, the argument defaults; utils/DualMems.py:
``update_memory_bank``, ``get_image_pred``, ``get_text_prediction``;
utils/utils_cosmic.py: ``select_confident_samples``, ``avg_entropy``, ``update_cache``,
``build_graph_by_degree``, ``make_max_cliques``, ``compute_clique_logits``,
``make_prototype_features``, ``search_best_weights``; clip/fix_clip.py:
``get_text_features``, ``get_image_features``, ``get_image_features_aux``;
data/datautils.py: ``AugMixAugmenter``, ``augmix``, ``get_preaugment``;
scripts/cosmic_ood.sh, scripts/cosmic_cd.sh; configs_l/*.yaml). Nothing copied.

Setting (defaults = scripts/cosmic_ood.sh, the ImageNet-family run; per dataset its
configs_l/*.yaml): ``-b 8`` (the image + 7 views), ``--selection_p 0.1``, ``--beta 5.5``,
``--CLIP_Cache_shot 16 --DINO_Cache_shot 16`` (8 in cosmic_cd.sh: here on the sets the
catalogue marks fine-grained), ``--clip_is_DMN --center_type_clip attn``,
``--center_type_dino default``, ``--use_clip_clique --use_dino_clique --is_SOG``, ``--r
0.2``, ``--target_avg_degree 5.0`` (``--control_type degree``: the CLIP graph aims at 0.8 x
5), ``--mac_step 100``, ``--text_prompt tip_cupl``. Per test image, in stream order
(official batch size 1):

1. CLIP (DMN's dynamic memory): the image and its views (RandomResizedCrop scale 0.5-1 +
   flip; AugMix on the fine-grained sets) give softmax probabilities; the
   ``max(1, int(V * 0.1))`` lowest-entropy views' mean probability gives the pseudo-label
   and entropy; the mean of those views' features is written to the pseudo-class's memory
   (16 slots; a full class replaces its highest-entropy slot if the new entropy is lower).
   The original image's feature reads every class's memory plus its text feature by
   attention (``exp(-5.5 (1 - cos))``): normalised class prototypes P and ``p_mem =
   softmax(s q P^T)``.
2. Auxiliary encoder (DINOv2 officially): the image's normalised auxiliary feature joins a
   TDA-style cache (16 shots per class, lowest entropy kept) under the pseudo-label of
   ``p_zs + p_mem``, its entropy the cache's score; the class prototypes are the means of
   the cached features (zero for a class with none).
3. Graphs: over the 2C nodes [text features; P] (CLIP) and over the C auxiliary
   prototypes, the threshold on cosine similarity is bisected (at most 500 steps, tolerance
   0.01) for an average degree of 4 (CLIP) or 5 (aux); the second-order graph keeps an edge
   whose ends share at least two neighbours; its maximal cliques (isolated nodes included)
   with their mean features as anchors. A graph is rebuilt when its memory changed while
   fewer than ``C x shots`` images were seen, then every 100 images.
4. Clique scores: the ``max(1, int(K * 0.2))`` cliques whose anchors are most similar to the
   image's feature; each node in them scores ``alpha exp(-(beta - beta cos))`` (the
   per-dataset positive-cache alpha, beta), other nodes 0; the CLIP scores of a class's
   text node and prototype node are averaged.
5. Output: ``p_zs + w_clip * s_clip + w_aux * s_aux`` (``p_zs`` the original image's
   zero-shot probabilities).
The memory stores the confident views' mean feature (COSMIC passes ``selected_idx`` to
DMN's ``update_memory_bank``; DMN's own runs store the original image's). The per-dataset
alpha, beta of configs_l/*.yaml are TDA's positive-cache table (``tda.POSITIVE``, equal
values); their ``Mac: lambda1/lambda2`` only serve ``--control_type threshold``, which no
script uses: not carried.
Memory, cache and graphs persist across batches (online); ``reset()`` clears them.

What differs and why:
* Fusion weights: the official code has none fixed. ``direct_inference`` keeps every
  image's ``p_zs`` and clique scores and finally searches the two weights over {0, 0.001,
  0.003, ..., 300, 1000} for the best accuracy *on the test labels*
  (``search_best_weights``); its published accuracies are those searched ones, and no
  searched value is published. Here fixed, 1.0 each (``clip_weight``, ``aux_weight``):
  in that grid, with the clique scores (at most alpha, typically a few tenths) on the
  scale of the probabilities. Not measured.
* Auxiliary encoder (``aux_model``): a registered model (``tta-bench ls models``) named as
  RLCF's ``teacher`` (``aux_model_args`` its factory's arguments), whose image tower's
  normalised features stand in for DINOv2's normalised class token; nothing is downloaded,
  so the default None is the run's own model (the auxiliary space is then CLIP's image
  space: a different method from the official two-space one). Images reach it at its own
  size (bicubic resize, as RLCF's teacher) with its own normalisation (officially DINOv2
  is fed CLIP-normalised 224 px images). Only the original image is encoded by it (the
  official encodes every view and reads the first: the same features).
* Output: the fused score, not a probability model's logits (``scores_are_logits =
  False``: no NLL or ECE in the tables).
* Cliques: own Bron-Kerbosch (pivoting) over the second-order graph, cliques in sorted
  order (officially networkx ``find_cliques`` order, which only matters for ties in the
  clique ranking: a stable sort here). The bisection stops early once its threshold no
  longer moves (the remaining official iterations change nothing).
* Views: torchvision's RandomResizedCrop boxes on the image at the model's size, one
  batched ``grid_sample``; AugMix (fine-grained sets) is the plugin's 9-operation AugMix at
  severity 1, the official ``augmentations_all`` adds colour, contrast, brightness and
  sharpness at ``severity=50``. Views of equal entropy: stable order (official
  ``argsort``: unspecified).
* Head (``text_head``): ``protocol`` by default; ``official`` is ``tip_cupl``'s templates
  (the 7 TIP templates on the ImageNet family, else the single prompt; the official one
  sentence per fine-grained set is not tabulated). CuPL sentences are not shipped:
  ``prompts=FILE`` (CuPL's JSON, read with ``tta_bench.prompts.load_class_prompts``) adds
  them to the head's templates (``tip_cupl``); None: templates alone.
* Logit scale: the model's own (100 for CLIP, the official's), as DMN here.
* Precision: fp16 autocast on CUDA for both encoders; memory, cache, graphs and scores in
  float32 (officially mixed fp16). CPU: float32.
* The official also computes TDA-style CLIP and auxiliary cache logits that only its
  ablation rows use (weights 0 in COSMIC's search): not computed.

Measured effect: docs/methods.md#cosmic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F

from mura_plugin.losses import view_entropy
from mura_plugin.methods._aux_model import aux_classifier
from mura_plugin.methods._cache import EntropyCache
from mura_plugin.methods._text_heads import TEXT_HEADS, OwnHead, check_text_head, class_head
from mura_plugin.methods._view_budget import encode_flat, encode_in_chunks
from mura_plugin.methods._view_config import ViewFields, original_first
from mura_plugin.methods.dmn import DynamicMemory, official_augmix, official_templates
from mura_plugin.methods.tda import POSITIVE
from tta_bench.bounds import bounded, one_of
from tta_bench.catalog import fine_grained
from tta_bench.method import PRECISIONS, Method, autocast_context
from tta_bench.model import ZeroShotClassifier

__all__ = [
    "COSMIC",
    "COSMICConfig",
    "aux_encoder",
    "build_cliques",
    "clique_scores",
    "confident_views",
    "degree_graph",
    "maximal_cliques",
    "readout_prototypes",
    "second_order",
]

#: Bisection of ``build_graph_by_degree``: tolerance and the iteration cap of its call.
DEGREE_TOL = 1e-2
DEGREE_ITERS = 500


def readout_prototypes(
    features: torch.Tensor,
    filled: torch.Tensor,
    text: torch.Tensor,
    query: torch.Tensor,
    beta: float,
) -> torch.Tensor:
    """DMN's attention read-out prototypes ``[C, D]`` (``get_image_pred``, ``attn``): per
    class, its filled memory slots ``features [C, M, D]`` (``filled [C, M]``) and its
    ``text [C, D]`` feature, each normalised, weighted by ``exp(-beta (1 - query . m))``,
    summed and normalised. ``softmax(scale * P @ query)`` is ``dmn.memory_readout``."""
    q, feats = query.float(), features.float()
    norms = feats.norm(dim=-1)
    inv = torch.where(filled & (norms > 0), 1.0 / norms.clamp_min(1e-30), torch.zeros_like(norms))
    weights = torch.exp(-beta * (1.0 - (feats @ q) * inv)) * inv
    text = text.float() / text.float().norm(dim=-1, keepdim=True)
    text_weights = torch.exp(-beta * (1.0 - text @ q))
    proto = torch.einsum("cm,cmd->cd", weights, feats) + text_weights[:, None] * text
    return proto / proto.norm(dim=-1, keepdim=True)


def confident_views(logits: torch.Tensor, k: int) -> tuple[int, float, torch.Tensor]:
    """``select_confident_samples`` + ``update_memory_bank`` of one image's view logits
    ``[V, C]``: the ``k`` views of lowest ``-sum p log(p + 1e-6)`` (stable order), the
    pseudo-label and entropy (``+1e-8``) of their mean probability, and their indices
    (``dmn.confident_label``'s label and entropy, with the views it keeps)."""
    probs = logits.float().softmax(dim=-1)
    ranking = -(probs * torch.log(probs + 1e-6)).sum(dim=-1)
    chosen = torch.argsort(ranking, stable=True)[:k]
    p_bar = probs[chosen].mean(dim=0)
    return int(p_bar.argmax()), float(-(p_bar * torch.log(p_bar + 1e-8)).sum()), chosen


def degree_graph(
    sim: torch.Tensor, target: float, tol: float = DEGREE_TOL, max_iter: int = DEGREE_ITERS
) -> tuple[torch.Tensor, float]:
    """``(adjacency [n, n] float, threshold)`` of ``build_graph_by_degree``: bisect the
    threshold between the similarities' min and max; an edge where ``sim > threshold``
    (no self-loops); stop when the average degree is within ``tol`` of ``target`` (fewer
    edges: lower the upper end, more: raise the lower one), or after ``max_iter`` steps
    (here also once the threshold stops moving: the rest would repeat it)."""
    n = sim.shape[0]
    low, high = float(sim.min()), float(sim.max())
    eye = torch.eye(n, dtype=torch.bool, device=sim.device)
    adj, last = None, None
    for _ in range(max_iter):
        mid = (low + high) / 2
        if mid == last and adj is not None:
            break
        adj = ((sim > mid) & ~eye).float()
        degree = adj.sum() / n  # float32, as the official tensor arithmetic
        last = mid
        if bool((degree - target).abs() < tol):
            break
        if bool(degree < target):
            high = mid
        else:
            low = mid
    return adj, last


def second_order(adj: torch.Tensor) -> torch.Tensor:
    """``is_SOG``: keep an edge whose ends share at least two neighbours."""
    return ((adj * (adj @ adj)) > 1).float()


def maximal_cliques(adj: torch.Tensor) -> list[list[int]]:
    """Every maximal clique of the undirected graph ``adj [n, n]`` (isolated nodes are
    cliques of one), each sorted, in sorted order: Bron-Kerbosch with Tomita's pivot."""
    rows = (adj.detach().cpu() > 0).tolist()
    nbrs = [{j for j, e in enumerate(row) if e and j != i} for i, row in enumerate(rows)]
    out: list[list[int]] = []
    stack: list[tuple[set[int], set[int], set[int]]] = [(set(), set(range(len(rows))), set())]
    while stack:
        r, p, x = stack.pop()
        if not p:
            if not x:
                out.append(sorted(r))
            continue
        pivot = max(sorted(p | x), key=lambda u: len(p & nbrs[u]))
        for v in sorted(p - nbrs[pivot]):
            stack.append((r | {v}, p & nbrs[v], x & nbrs[v]))
            p = p - {v}
            x = x | {v}
    return sorted(out)


def build_cliques(
    feats: torch.Tensor, target: float, sog: bool = True
) -> tuple[list[list[int]], torch.Tensor]:
    """``make_max_cliques``: the degree-targeted graph over ``feats [n, D]`` (cosine of
    the rows as given: ``feats @ feats^T``), second-order when ``sog``, its maximal cliques
    and their anchors (the mean of their nodes' features) ``[K, D]``."""
    feats = feats.float()
    adj, _ = degree_graph(feats @ feats.t(), target)
    if sog:
        adj = second_order(adj)
    cliques = maximal_cliques(adj)
    anchors = torch.stack([feats[c].mean(dim=0) for c in cliques])
    return cliques, anchors


def clique_scores(
    query: torch.Tensor,
    anchors: torch.Tensor,
    space: torch.Tensor,
    cliques: list[list[int]],
    r: float,
    alpha: float,
    beta: float,
) -> torch.Tensor:
    """``compute_clique_logits``: per node of ``space [N, D]`` (``[N]``), for the nodes of
    the ``max(1, int(K * r))`` cliques whose anchors are most similar to ``query [D]``
    (stable order on ties), ``alpha * exp(-(beta - beta * query . node))``; 0 elsewhere."""
    q = query.float()
    top = max(1, int(len(cliques) * r))
    chosen = torch.sort(anchors.float() @ q, descending=True, stable=True).indices[:top]
    nodes = sorted({v for c in chosen.tolist() for v in cliques[c]})
    index = torch.tensor(nodes, device=space.device)
    affinity = space.float()[index] @ q
    scores = torch.zeros(space.shape[0], device=space.device)
    scores[index] = alpha * torch.exp(-(beta - beta * affinity))
    return scores


def aux_encoder(
    model: ZeroShotClassifier, name: str | None, args: dict[str, Any], device: Any
) -> tuple[ZeroShotClassifier | None, dict[str, Any]]:
    """The auxiliary encoder ``name`` built as RLCF builds its ``teacher``
    (``_aux_model.aux_classifier`` over the run's classes and templates) and what the
    results record of it; None: the run's own model (nothing built)."""
    if name is None:
        info = {"aux_model": None, "aux_model_name": model.model_name}
        return None, {**info, "aux_weights": model.weights, "aux_weights_sha256": None}
    aux, bundle = aux_classifier(model, name, args, model.templates, device)
    info = {"aux_model": name, "aux_model_name": bundle.name, "aux_weights": bundle.weights}
    return aux, {**info, "aux_weights_sha256": bundle.weights_sha256}


def cosmic_head(
    model: ZeroShotClassifier, text_head: str, official: list[str], prompts: str | None
) -> torch.Tensor:
    """The head: ``class_head`` without ``prompts``; with it, the head's templates and
    each class's sentences of the CuPL file (``tip_cupl``), looked up by the class name,
    else with underscores as spaces (the official ``replace('_', ' ')``)."""
    from tta_bench.prompts import load_class_prompts

    if prompts is None:
        return class_head(model, text_head, official)
    check_text_head(text_head)
    if text_head == "protocol" and model.class_prompts is not None:
        raise ValueError(
            "method.prompts adds sentences to the protocol's templates, but this protocol's "
            "head already has per-class sentences (protocol.text_head); give one or the other"
        )
    sentences = load_class_prompts(prompts, owner="method.prompts")
    keys = {c: c if c in sentences else c.replace("_", " ") for c in model.classnames}
    missing = [c for c, k in keys.items() if k not in sentences]
    if missing:
        shown = ", ".join(repr(m) for m in missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise ValueError(f"method.prompts={prompts!r} has no sentences for class(es) {shown}")
    templates = list(model.templates) if text_head == "protocol" else list(official)
    per_class = {c: sentences[k] for c, k in keys.items()}
    return model.encode_templates(templates, per_class).to(model.class_embeddings)


@dataclass
class COSMICConfig(ViewFields):
    n_views: int = bounded(7, ge=0)  # -b 8: the image + 7 views
    selection: float = bounded(0.1, gt=0, le=1)  # --selection_p
    crop_scale_min: float = bounded(0.5, gt=0, le=1)  # get_preaugment: scale=(0.5, 1)
    augmix: Optional[bool] = None  # None: the official rule (on fine-grained sets only)
    beta: float = bounded(5.5, ge=0)  # --beta: sharpness of the memory read-out
    # None: 16 (cosmic_ood.sh), 8 on the fine-grained sets (cosmic_cd.sh)
    clip_shots: Optional[int] = bounded(None, ge=1)  # --CLIP_Cache_shot
    aux_shots: Optional[int] = bounded(None, ge=1)  # --DINO_Cache_shot
    # clique scores alpha exp(-(beta - beta cos)); None: the dataset's configs_l/*.yaml
    alpha: Optional[float] = bounded(None, ge=0)
    clique_beta: Optional[float] = bounded(None, ge=0)
    r: float = bounded(0.2, gt=0, le=1)  # --r: share of cliques scored
    target_degree: float = bounded(5.0, gt=0)  # --target_avg_degree (CLIP graph: 0.8 x)
    graph_step: int = bounded(100, ge=1)  # --mac_step
    sog: bool = True  # --is_SOG
    clip_weight: float = bounded(1.0, ge=0)  # officially searched on the test labels
    aux_weight: float = bounded(1.0, ge=0)  # idem
    #: A registered model name for the auxiliary image encoder (None: the run's own model).
    aux_model: Optional[str] = None
    #: Keyword arguments of the auxiliary model's factory (e.g. openclip's arch/pretrained).
    aux_model_args: dict[str, Any] = field(default_factory=dict)
    text_head: str = one_of("protocol", TEXT_HEADS)  # protocol | official (tip templates)
    prompts: Optional[str] = None  # CuPL JSON {class: [sentence, ...]} added to the head
    precision: str = one_of("fp16", PRECISIONS)  # autocast on CUDA; CPU: fp32


class COSMIC(OwnHead, Method):
    Config = COSMICConfig
    scores_are_logits = False  # p_zs + weighted clique scores
    stream_kind = "online"
    resolved = ("clip_shots", "aux_shots", "alpha", "clique_beta", "augmix")

    def setup(self) -> None:
        cfg = self.config
        dataset = self.model.dataset
        shots = 8 if fine_grained(dataset) else 16
        self.clip_shots = shots if cfg.clip_shots is None else cfg.clip_shots
        self.aux_shots = shots if cfg.aux_shots is None else cfg.aux_shots
        alpha, beta = POSITIVE.get(dataset or "", POSITIVE["imagenet"])
        self.alpha = alpha if cfg.alpha is None else cfg.alpha
        self.clique_beta = beta if cfg.clique_beta is None else cfg.clique_beta
        self.augmix = official_augmix(dataset) if cfg.augmix is None else bool(cfg.augmix)
        self.head = cosmic_head(
            self.model, cfg.text_head, official_templates(dataset), cfg.prompts
        ).float()
        self.aux, self._aux_info = aux_encoder(
            self.model, cfg.aux_model, cfg.aux_model_args, self.device
        )
        self.reset()

    def resolved_settings(self) -> dict[str, Any]:
        return {**super().resolved_settings(), **self._aux_info}

    def reset(self) -> None:
        c, d = self.head.shape
        self.memory = DynamicMemory(c, self.clip_shots, d, self.device)
        self.aux_cache: EntropyCache | None = None
        self.clip_graph: tuple[list[list[int]], torch.Tensor] | None = None
        self.aux_graph: tuple[list[list[int]], torch.Tensor] | None = None
        self.seen = 0  # images of the stream so far (the official loop index)

    def _aux_features(self, images: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        """Normalised auxiliary features ``[B, D']`` of the original images (``own``: the
        run's model's features of them, the auxiliary space when ``aux_model`` is None)."""
        if self.aux is None:
            return own
        size = self.aux.preprocess.image_size
        if images.shape[-1] != size or images.shape[-2] != size:
            images = F.interpolate(images, size=size, mode="bicubic", align_corners=True)
        with autocast_context(self.config.precision, self.device):
            feats = self.aux.encode_image(images).float()
        return feats / feats.norm(dim=-1, keepdim=True)

    def _cache(self, dim: int) -> EntropyCache:
        if self.aux_cache is None:
            c = self.head.shape[0]
            self.aux_cache = EntropyCache(c, self.aux_shots, dim, 1, self.device)
        return self.aux_cache

    def _rebuild(self, updated: bool, shots: int) -> bool:
        """``situation2 or situation3`` of the official loop (``always_update_G`` off)."""
        t, limit = self.seen, self.head.shape[0] * shots
        return (t % self.config.graph_step == 0 and t > limit) or (updated and t <= limit)

    def _aux_prototypes(self) -> torch.Tensor:
        """``make_prototype_features``: per class the mean of its cached features (zero
        without any)."""
        cache = self.aux_cache
        filled = torch.isfinite(cache.entropy).float()  # [C, S]
        total = (cache.keys * filled[..., None]).sum(dim=1)
        return total / filled.sum(dim=1).clamp_min(1)[:, None]

    def _scores(self, q: torch.Tensor, protos: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """``w_clip * s_clip + w_aux * s_aux`` of query ``q``, read-out prototypes
        ``protos`` and auxiliary feature ``a`` with the graphs as they stand (0 without)."""
        cfg, c = self.config, self.head.shape[0]
        out = torch.zeros(c, device=q.device)
        if self.clip_graph is not None:
            space = torch.cat([self.head, protos])
            s = clique_scores(
                q,
                self.clip_graph[1],
                space,
                self.clip_graph[0],
                cfg.r,
                self.alpha,
                self.clique_beta,
            )
            out = out + cfg.clip_weight * (s[:c] + s[c:]) / 2
        if self.aux_graph is not None:
            s = clique_scores(
                a,
                self.aux_graph[1],
                self._aux_prototypes(),
                self.aux_graph[0],
                cfg.r,
                self.alpha,
                self.clique_beta,
            )
            out = out + cfg.aux_weight * s
        return out

    def _sample(self, feats: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        """One image in stream order: its views' normalised features ``[V, D]`` (the
        original first) and auxiliary feature ``[D']`` -> its fused scores ``[C]``."""
        cfg, scale = self.config, float(self.model.logit_scale)
        logits = scale * feats @ self.head.t()
        label, ent, chosen = confident_views(logits, max(1, int(len(feats) * cfg.selection)))
        memory = self.memory
        full = memory.count[label] == memory.size
        updated = not full or ent < float(memory.entropy[label].max())
        memory.write(label, feats[chosen].mean(dim=0), ent)
        q = feats[0]
        protos = readout_prototypes(memory.features, memory.filled(), self.head, q, cfg.beta)
        p_zs = logits[0].softmax(dim=-1)
        mixed = p_zs + (scale * protos @ q).softmax(dim=-1)
        cache = self._cache(aux.shape[-1])
        before = cache.inserted
        cache.offer(int(mixed.argmax()), aux, float(view_entropy(mixed)), aux.new_zeros(1))
        if self.clip_graph is None or self._rebuild(updated, self.clip_shots):
            space = torch.cat([self.head, protos])
            self.clip_graph = build_cliques(space, 0.8 * cfg.target_degree, cfg.sog)
        if self.aux_graph is None or self._rebuild(cache.inserted != before, self.aux_shots):
            self.aux_graph = build_cliques(self._aux_prototypes(), cfg.target_degree, cfg.sog)
        self.seen += 1
        return p_zs + self._scores(q, protos, aux)

    def _view_features(self, images: torch.Tensor, reduce: Any) -> Any:
        """``reduce`` of each chunk's normalised view features ``[V, b, D]`` (the original
        first), chunked within the view budget (``encode_in_chunks``)."""
        cfg = self.config
        settings = original_first(cfg, cfg.n_views, self.augmix)

        def encode(views: torch.Tensor) -> torch.Tensor:
            with autocast_context(cfg.precision, self.device):
                feats = encode_flat(self.model.encode_image, views, cfg.chunk_views).float()
            return feats / feats.norm(dim=-1, keepdim=True)

        return encode_in_chunks(
            images, settings, self.generator, encode, cfg.view_memory_mb, reduce=reduce
        )

    @torch.no_grad()
    def step(self, images: torch.Tensor) -> torch.Tensor:
        done = [0]

        def reduce(feats: torch.Tensor) -> torch.Tensor:  # [V, b, D] -> [b, C], in order
            start, b = done[0], feats.shape[1]
            aux = self._aux_features(images[start : start + b], feats[0])
            done[0] += b
            return torch.stack([self._sample(feats[:, i], aux[i]) for i in range(b)])

        return self._view_features(images, reduce)

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """The realtime track's prediction while busy: the image alone (no views), its
        read-out prototypes and clique scores with the state as it stands, writing
        nothing."""
        cfg, scale = self.config, float(self.model.logit_scale)
        with autocast_context(cfg.precision, self.device):
            feats = self.model.encode_image(images).float()
        feats = feats / feats.norm(dim=-1, keepdim=True)
        aux = self._aux_features(images, feats)
        filled = self.memory.filled()
        out = []
        for q, a in zip(feats, aux):
            protos = readout_prototypes(self.memory.features, filled, self.head, q, cfg.beta)
            scores = self._scores(q, protos, a) if self.aux_cache is not None else 0.0
            out.append((scale * q @ self.head.t()).softmax(dim=-1) + scores)
        return torch.stack(out)
