"""Low-rank adapters beside frozen linear layers, and the surgery that places them.

* ``vision_blocks(visual)`` finds the transformer blocks of an open_clip or timm ViT.
* ``split_attention(block)`` replaces ``nn.MultiheadAttention`` (fused ``in_proj``, whose
  projections are not modules) by an equivalent module with ``q_proj / k_proj / v_proj /
  out_proj`` linears, so adapters can sit beside each projection.
* ``MultiRankLinear`` wraps a frozen ``nn.Linear`` with K low-rank components of possibly
  different ranks, mixed by global (softmax) weights or per-token weights from its own
  router. With one component and weight 1 it is plain LoRA. It can adapt a subset of the
  output rows only (the q and v slices of a fused timm ``qkv``). Inits (``INITS``): LoRA's
  ``zero``, MuRA's ``svd``, torch's ``default``; scales (``SCALES``): ``alpha / r`` or 1.
* ``split_vision_forward(visual, k)`` cuts an open_clip ViT's forward before block ``k``,
  so multi-view methods run the frozen prefix once per batch and only the adapted suffix
  per step.
* ``attach_adapters`` places them by name patterns, matched against each linear's name
  inside its block *and* a role alias shared by open_clip and timm (``attn.q``, ``attn.k``,
  ``attn.v``, ``attn.out``, ``mlp.in``, ``mlp.out``), so one target list fits both.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "INITS",
    "ROLE_ALIASES",
    "SCALES",
    "MultiRankLinear",
    "SplitAttention",
    "vision_blocks",
    "split_attention",
    "attach_adapters",
    "split_vision_forward",
]

#: zero: LoRA's (xavier-normal A, B = 0; starts at the source); svd: MuRA's orthogonal init
#: (starts at the source); default: torch's nn.Linear init of both A and B (does not).
INITS = ("zero", "svd", "default")
#: Per-component scale ``s_k``: alpha_over_rank = ``alpha / r_k`` (LoRA's); none = 1.
SCALES = ("alpha_over_rank", "none")

#: Projection names of open_clip (after ``split_attention``) and timm blocks -> role.
ROLE_ALIASES = {
    "attn.q_proj": "attn.q",
    "attn.k_proj": "attn.k",
    "attn.v_proj": "attn.v",
    "attn.out_proj": "attn.out",
    "attn.proj": "attn.out",
    "mlp.c_fc": "mlp.in",
    "mlp.fc1": "mlp.in",
    "mlp.c_proj": "mlp.out",
    "mlp.fc2": "mlp.out",
}


class SplitAttention(nn.Module):
    """Drop-in, numerically equivalent replacement of ``nn.MultiheadAttention`` (self- or
    cross-attention, batch-first or not) with separate q/k/v/out ``nn.Linear`` modules."""

    def __init__(self, mha: nn.MultiheadAttention):
        super().__init__()
        if not mha._qkv_same_embed_dim:
            raise ValueError("SplitAttention needs an nn.MultiheadAttention with kdim == vdim")
        d = mha.embed_dim
        self.num_heads = mha.num_heads
        self.batch_first = mha.batch_first
        bias = mha.in_proj_bias is not None
        # Views of the frozen fused weights, not copies: the split costs no memory, and
        # adapters built over a shared backbone (tta_bench.deploy.adapter) keep sharing it.
        weight = mha.in_proj_weight.detach()
        self.q_proj, self.k_proj, self.v_proj = (
            _frozen_linear(
                weight[i * d : (i + 1) * d],
                mha.in_proj_bias.detach()[i * d : (i + 1) * d] if bias else None,
            )
            for i in range(3)
        )
        self.out_proj = _frozen_linear(
            mha.out_proj.weight.detach(),
            None if mha.out_proj.bias is None else mha.out_proj.bias.detach(),
        )

    def forward(
        self, query, key, value, need_weights=False, attn_mask=None, key_padding_mask=None, **_
    ):
        if key_padding_mask is not None:
            raise NotImplementedError("SplitAttention does not support key_padding_mask")
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        b, n, d = query.shape
        h = self.num_heads

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, t.shape[1], h, d // h).transpose(1, 2)

        q, k, v = heads(self.q_proj(query)), heads(self.k_proj(key)), heads(self.v_proj(value))
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros_like(attn_mask, dtype=q.dtype).masked_fill(
                attn_mask, float("-inf")
            )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        out = self.out_proj(out.transpose(1, 2).reshape(b, n, d))
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, None


def _frozen_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` whose parameters are (views of) ``weight`` and ``bias``, frozen."""
    out_f, in_f = weight.shape
    linear = nn.Linear(in_f, out_f, bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear


def vision_blocks(visual: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a ViT image tower, shallowest first (open_clip
    ``transformer.resblocks``, timm ``blocks``; else the longest ModuleList of blocks)."""
    for path in ("transformer.resblocks", "trunk.blocks", "blocks"):
        mod: nn.Module | None = visual
        for part in path.split("."):
            mod = getattr(mod, part, None)
            if mod is None:
                break
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) > 0:
            return list(mod)
    lists = [m for m in visual.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(f"no transformer blocks found in {type(visual).__name__}")
    return list(max(lists, key=len))


def split_vision_forward(
    visual: nn.Module, k: int
) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]] | None:
    """``(prefix, suffix)`` with ``suffix(prefix(x)) == visual(x)`` for an open_clip
    ``VisionTransformer``: ``prefix`` maps normalised images ``[N, 3, H, W]`` to the tokens
    entering block ``k`` (``[N, T, D]``, batch first whatever the tower's layout: patch
    embedding, class/positional embedding, ``ln_pre``, blocks ``0..k-1``); ``suffix`` runs
    blocks ``k..`` then pooling, ``ln_post`` and the projection, returning ``[N, D_out]``.
    Blocks are looked up at call time, so adapters attached later are used; the tower's
    forward hooks run after ``suffix`` (pass counters count images once). None for
    towers this does not know (timm trunks, towers returning tokens, attention pooling):
    callers then run the plain forward."""
    transformer = getattr(visual, "transformer", None)
    blocks = getattr(transformer, "resblocks", None)
    known = all(hasattr(visual, a) for a in ("_embeds", "_pool", "proj"))
    if not known or not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        return None
    if getattr(visual, "output_tokens", False) or getattr(visual, "attn_pool", None) is not None:
        return None
    if not 0 <= k <= len(blocks):
        raise ValueError(f"k must be in 0..{len(blocks)}, got {k}")
    batch_first = getattr(transformer, "batch_first", True)

    def run(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        if not batch_first:
            x = x.transpose(0, 1)
        for block in list(transformer.resblocks)[start:stop]:
            x = block(x)
        return x if batch_first else x.transpose(0, 1)

    def prefix(images: torch.Tensor) -> torch.Tensor:
        return run(visual._embeds(images), 0, k)

    def suffix(tokens: torch.Tensor) -> torch.Tensor:
        pooled, _ = visual._pool(run(tokens, k, len(transformer.resblocks)))
        out = pooled @ visual.proj if visual.proj is not None else pooled
        # Forward hooks on the tower (the runner's pass counter) see each image once, when
        # its features come out, as they would for ``visual(images)``.
        for hook_id, hook in list(visual._forward_hooks.items()):
            with_kwargs = visual._forward_hooks_with_kwargs.get(hook_id, False)
            result = (
                hook(visual, (tokens,), {}, out) if with_kwargs else hook(visual, (tokens,), out)
            )
            out = out if result is None else result
        return out

    return prefix, suffix


def split_attention(block: nn.Module) -> None:
    """Replace every ``nn.MultiheadAttention`` child of ``block`` by ``SplitAttention``."""
    for name, child in list(block.named_children()):
        if isinstance(child, nn.MultiheadAttention):
            setattr(block, name, SplitAttention(child))


class MultiRankLinear(nn.Module):
    """``y = W' x + b + P(sum_k w_k(x) * s_k * B_k A_k x)`` beside a frozen linear layer.

    ``A_k: [r_k, in]``, ``B_k: [out', r_k]``, ``s_k = alpha / r_k`` (``alpha`` is each
    component's LoRA alpha, as peft's ``lora_alpha``: component k alone is a standard LoRA of
    rank ``r_k`` and scale ``alpha / r_k``; ``scale="none"``: ``s_k = 1``, alpha unused);
    all components share one
    matmul into the concatenated rank space (``lora_A: [R, in]``, ``lora_B: [out', R]``,
    ``R = sum r_k``). ``P`` scatters the ``out'`` adapted rows into the output (identity
    unless ``out_index`` restricts the adapter to some rows, e.g. the q and v slices of a
    fused qkv). ``W'`` is the frozen weight, or after ``init_svd`` the frozen weight minus
    the initial adapter product (kept as the buffer ``frozen_weight``; the wrapped layer's
    own weight is never modified).

    Mixing weights ``w``: with ``router=True`` a zero-initialised ``nn.Linear(in, K)`` on each
    token's input gives per-token softmax weights (uniform at initialisation); otherwise
    the owner sets global weights ``[K]`` with ``set_weights`` (None means 1 for each).

    Batched episodes (``begin_episodes(n)``): the layer then uses ``n`` independent copies of
    its adapter (``A [n, R, in]``, ``B [n, out', R]``, and the router's weights when it is
    included), initialised from the current values, and reads its input as sample-major:
    the leading ``N`` rows of ``x [N, ..., in]`` are ``n`` consecutive groups, group ``i``
    (all its views and tokens) going through copy ``i``. Global weights may then be
    per-copy, ``[n, K]``. ``select_episodes(rows)`` restricts the layer to a chunk of the
    copies (the input then holds those samples only); ``end_episodes()`` drops the copies.
    The shared parameters are never touched by an episode.
    """

    def __init__(
        self,
        base: nn.Linear,
        ranks: Sequence[int],
        alpha: float,
        *,
        out_index: torch.Tensor | None = None,
        router: bool = False,
        scale: str = "alpha_over_rank",
    ):
        super().__init__()
        if not ranks or any(int(r) < 1 for r in ranks):
            raise ValueError(f"ranks must be positive integers, got {list(ranks)}")
        if scale not in SCALES:
            raise ValueError(f"unknown scale {scale!r}; available: {', '.join(SCALES)}")
        self.base = base
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.ranks = [int(r) for r in ranks]
        total = sum(self.ranks)
        dev, dt = base.weight.device, base.weight.dtype
        n_out = base.out_features if out_index is None else int(out_index.numel())
        self.lora_A = nn.Parameter(torch.zeros(total, base.in_features, device=dev, dtype=dt))
        self.lora_B = nn.Parameter(torch.zeros(n_out, total, device=dev, dtype=dt))
        scales = torch.cat(
            [torch.full((r,), alpha / r if scale == "alpha_over_rank" else 1.0) for r in self.ranks]
        )
        self.register_buffer("rank_scale", scales.to(dev, dt))
        self.register_buffer(
            "component_index",
            torch.repeat_interleave(torch.arange(len(self.ranks)), torch.tensor(self.ranks)).to(
                dev
            ),
        )
        self.register_buffer(
            "out_index", None if out_index is None else out_index.to(dev, torch.long)
        )
        self.register_buffer("frozen_weight", None)
        self.router = (
            nn.Linear(base.in_features, len(self.ranks), device=dev, dtype=dt) if router else None
        )
        if self.router is not None:
            with torch.no_grad():  # uniform weights at initialisation
                self.router.weight.zero_()
                self.router.bias.zero_()
        self.weights: torch.Tensor | None = None  # global weights [K] or [n, K], by the owner
        self.episode: dict[str, torch.Tensor] | None = None  # copies in use, if active
        self._episodes: dict[str, torch.Tensor] | None = None  # all per-sample copies
        self.init_zero()

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def adapter_parameters(self) -> list[nn.Parameter]:
        return [self.lora_A, self.lora_B]

    def router_parameters(self) -> list[nn.Parameter]:
        return [] if self.router is None else list(self.router.parameters())

    def init_zero(self) -> None:
        """LoRA init as TTL's official code re-initialises it (``LoRA_AB``): each component's
        ``A_k [r_k, in]`` ~ xavier-normal (std ``sqrt(2 / (in + r_k))``), ``B_k = 0``, so the
        layer starts exactly at the source. One component draws like one standalone LoRA."""
        with torch.no_grad():
            start = 0
            for r in self.ranks:
                nn.init.xavier_normal_(self.lora_A[start : start + r])
                start += r
            self.lora_B.zero_()
        self.frozen_weight = None

    def init_default(self) -> None:
        """torch's default init of both matrices (the seed article's sketch): each component's
        ``A_k [r_k, in]`` and ``B_k [out', r_k]`` drawn as ``nn.Linear`` draws a weight of that
        shape (``kaiming_uniform_(a=sqrt(5))``: uniform in ``+-1 / sqrt(fan_in)``, fan_in
        ``in`` for ``A_k`` and ``r_k`` for ``B_k``), component by component, ``A_k`` first.
        ``B`` is not zero, so the layer does *not* start at the source."""
        with torch.no_grad():
            start = 0
            for r in self.ranks:
                nn.init.kaiming_uniform_(self.lora_A[start : start + r], a=math.sqrt(5))
                nn.init.kaiming_uniform_(self.lora_B[:, start : start + r], a=math.sqrt(5))
                start += r
        self.frozen_weight = None

    def init_svd(self, init_weights: torch.Tensor | None = None) -> None:
        """Rank-specific orthogonal init from the frozen weight's SVD ``W = U S V^T``.

        Component k takes its own consecutive slice of singular triplets (component 0 the
        top ``r_0``, component 1 the next ``r_1``, ...), split symmetrically:
        ``B_k = U_k sqrt(S_k) / sqrt(c_k)``, ``A_k = sqrt(S_k) V_k^T / sqrt(c_k)`` with
        ``c_k = w_k * s_k`` the component's initial mixing weight times its scale, so its
        initial contribution is exactly ``U_k S_k V_k^T``. The frozen path uses
        ``W - sum_k U_k S_k V_k^T`` (computed in float64): the layer starts at the source.
        ``init_weights`` [K]: the mixing weights at initialisation (1 each if None; a router
        starts uniform, 1/K).
        """
        k = len(self.ranks)
        if init_weights is None:
            init_weights = torch.full((k,), 1.0 / k if self.router is not None else 1.0)
        init_weights = init_weights.detach().double().cpu()
        if init_weights.shape != (k,) or bool((init_weights <= 0).any()):
            raise ValueError(f"init_weights must be {k} positive values, got {init_weights}")
        weight = self.base.weight.detach().double()
        rows = weight if self.out_index is None else weight.index_select(0, self.out_index)
        total = sum(self.ranks)
        if total > min(rows.shape):
            raise ValueError(
                f"svd init needs sum(ranks)={total} <= min{tuple(rows.shape)} of the weight"
            )
        u, s, vh = torch.linalg.svd(rows, full_matrices=False)
        a = torch.empty(total, rows.shape[1], dtype=torch.float64, device=rows.device)
        b = torch.empty(rows.shape[0], total, dtype=torch.float64, device=rows.device)
        start = 0
        for comp, r in enumerate(self.ranks):
            sl = slice(start, start + r)
            c = float(init_weights[comp]) * float(self.rank_scale[start])
            root = s[sl].sqrt() / math.sqrt(c)
            a[sl] = root[:, None] * vh[sl]
            b[:, sl] = u[:, sl] * root[None, :]
            start += r
        principal = (u[:, :total] * s[:total]) @ vh[:total]  # sum of the initial products
        frozen = weight.clone()
        if self.out_index is None:
            frozen -= principal
        else:
            frozen.index_add_(0, self.out_index, -principal)
        with torch.no_grad():
            self.lora_A.copy_(a.to(self.lora_A.dtype))
            self.lora_B.copy_(b.to(self.lora_B.dtype))
        self.frozen_weight = frozen.to(self.base.weight.dtype)

    def set_weights(self, weights: torch.Tensor | None) -> None:
        self.weights = weights

    def begin_episodes(self, n: int, *, router: bool = False) -> list[torch.Tensor]:
        """Start ``n`` independent episodes: per-sample leaf copies of ``lora_A`` and
        ``lora_B`` (and of the router's weight and bias when ``router``), returned in that
        order, each ``[n, *shape]`` with ``requires_grad``. See the class docstring."""
        if n < 1:
            raise ValueError(f"need at least one episode, got n={n}")

        def copies(p: torch.Tensor) -> torch.Tensor:
            return p.detach().unsqueeze(0).repeat(n, *([1] * p.dim())).requires_grad_(True)

        episode = {"A": copies(self.lora_A), "B": copies(self.lora_B)}
        if router:
            if self.router is None:
                raise ValueError("router=True but this layer has no router")
            episode["router_w"] = copies(self.router.weight)
            episode["router_b"] = copies(self.router.bias)
        self._episodes = episode
        self.episode = episode
        return list(episode.values())

    def select_episodes(self, rows: slice) -> None:
        """Use copies ``rows`` only (a chunk of samples); call under the autograd mode of
        the forward, since the slices are views of the leaf copies."""
        if self._episodes is None:
            raise RuntimeError("select_episodes() before begin_episodes()")
        self.episode = {k: v[rows] for k, v in self._episodes.items()}

    def end_episodes(self) -> None:
        self.episode = self._episodes = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.frozen_weight is None:
            y = self.base(x)
        else:
            y = F.linear(x, self.frozen_weight, self.base.bias)
        ep = self.episode
        if ep is None:
            h = F.linear(x, self.lora_A)  # [..., R]
        else:
            n = ep["A"].shape[0]
            if x.shape[0] % n:
                raise ValueError(f"{x.shape[0]} input rows do not split into {n} episodes")
            x = x.reshape(n, -1, x.shape[-1])  # [n, M, in]: sample-major groups
            h = torch.bmm(x, ep["A"].transpose(1, 2))  # [n, M, R]
        if self.router is not None:
            if ep is not None and "router_w" in ep:
                r = torch.baddbmm(ep["router_b"].unsqueeze(1), x, ep["router_w"].transpose(1, 2))
            else:
                r = self.router(x)
            w = r.float().softmax(dim=-1)  # [..., K] per token
            scale = w.index_select(-1, self.component_index) * self.rank_scale
        elif self.weights is not None:
            scale = self.weights.index_select(-1, self.component_index) * self.rank_scale
            if scale.dim() == 2:  # per-episode global weights [n, R]
                scale = scale.unsqueeze(1)
        else:
            scale = self.rank_scale
        h = h * scale.to(h.dtype)
        if ep is None:
            delta = F.linear(h, self.lora_B)
        else:
            delta = torch.bmm(h, ep["B"].transpose(1, 2)).reshape(*y.shape[:-1], -1)
        if self.out_index is None:
            return y + delta.to(y.dtype)
        return y.index_add(-1, self.out_index, delta.to(y.dtype))


def _matches(names: Sequence[str], targets: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(n, pat) for n in names for pat in targets)


def _fused_qkv_rows(name: str, module: nn.Linear, targets: Sequence[str]) -> torch.Tensor | None:
    """For a fused ``...qkv`` linear: the output rows of the q/k/v slices that ``targets``
    name (by ``attn.q``, ``attn.q_proj``, ...); None if no slice is named."""
    prefix = name[: -len("qkv")]
    if module.out_features % 3:
        return None
    d = module.out_features // 3
    rows = [
        torch.arange(i * d, (i + 1) * d)
        for i, part in enumerate("qkv")
        if _matches([prefix + part, prefix + part + "_proj"], targets)
    ]
    return torch.cat(rows) if rows else None


def attach_adapters(
    blocks: Sequence[nn.Module],
    targets: Sequence[str],
    ranks: Sequence[int],
    alpha: float,
    *,
    init: str = "zero",
    router: bool = False,
    init_weights: torch.Tensor | None = None,
    scale: str = "alpha_over_rank",
) -> dict[str, MultiRankLinear]:
    """Wrap every ``nn.Linear`` in ``blocks`` whose name inside its block (``attn.q_proj``,
    ``mlp.c_fc``, timm ``attn.qkv``, ``mlp.fc1``) or role alias (``attn.q``, ``attn.v``,
    ``attn.out``, ``mlp.in``, ``mlp.out``, see ``ROLE_ALIASES``) matches a pattern of
    ``targets``. A fused ``attn.qkv`` matched only through its q/k/v roles gets an adapter
    restricted to those output slices. ``init``: ``zero``, ``svd`` or ``default`` and
    ``scale``: ``alpha_over_rank`` or ``none`` (see ``MultiRankLinear``).
    Returns ``{"block<i>.<name>": adapter}`` with ``i`` the position in ``blocks``."""
    if init not in INITS:
        raise ValueError(f"unknown init {init!r}; available: {', '.join(INITS)}")
    wrapped: dict[str, MultiRankLinear] = {}
    for bi, block in enumerate(blocks):
        split_attention(block)
        for name, module in list(block.named_modules()):
            if not isinstance(module, nn.Linear):
                continue
            if any(isinstance(m, MultiRankLinear) for m in _parents(block, name)):
                continue
            out_index = None
            if not _matches([name, ROLE_ALIASES.get(name, name)], targets):
                if not name.endswith("qkv"):
                    continue
                out_index = _fused_qkv_rows(name, module, targets)
                if out_index is None:
                    continue
            parent_name, _, child = name.rpartition(".")
            parent = block.get_submodule(parent_name) if parent_name else block
            adapter = MultiRankLinear(
                module, ranks, alpha, out_index=out_index, router=router, scale=scale
            )
            if init == "svd":
                adapter.init_svd(init_weights)
            elif init == "default":
                adapter.init_default()
            setattr(parent, child, adapter)
            wrapped[f"block{bi}.{name}"] = adapter
    if not wrapped:
        names = sorted(
            {n for b in blocks for n, m in b.named_modules() if isinstance(m, nn.Linear)}
        )
        raise ValueError(
            f"no linear layer matches targets {list(targets)}; candidates: {names} "
            f"(role aliases: {sorted(set(ROLE_ALIASES.values()))})"
        )
    return wrapped


def _parents(root: nn.Module, name: str) -> list[nn.Module]:
    """The modules on the path from ``root`` to ``name`` (excluded)."""
    out, mod = [], root
    for part in name.split(".")[:-1]:
        mod = getattr(mod, part)
        out.append(mod)
    return out
