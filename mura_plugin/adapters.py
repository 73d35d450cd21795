"""Low-rank adapters beside frozen linear layers, and the surgery that places them.

* ``vision_blocks(visual)`` finds the transformer blocks of an open_clip or timm ViT.
* ``split_attention(block)`` replaces ``nn.MultiheadAttention`` (fused ``in_proj``, whose
  projections are not modules) by an equivalent module with ``q_proj / k_proj / v_proj /
  out_proj`` linears, so adapters can sit beside each projection.
* ``MultiRankLinear`` wraps a frozen ``nn.Linear`` with K low-rank components of possibly
  different ranks, mixed by global (softmax) or per-token (router) weights. With one
  component and fixed weight 1 it is plain LoRA.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MultiRankLinear",
    "SplitAttention",
    "vision_blocks",
    "split_attention",
    "attach_adapters",
]


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
        dev, dt = mha.in_proj_weight.device, mha.in_proj_weight.dtype
        self.q_proj, self.k_proj, self.v_proj = (
            nn.Linear(d, d, bias=bias, device=dev, dtype=dt) for _ in range(3)
        )
        self.out_proj = nn.Linear(d, d, bias=mha.out_proj.bias is not None, device=dev, dtype=dt)
        with torch.no_grad():
            for i, proj in enumerate((self.q_proj, self.k_proj, self.v_proj)):
                proj.weight.copy_(mha.in_proj_weight[i * d : (i + 1) * d])
                if bias:
                    proj.bias.copy_(mha.in_proj_bias[i * d : (i + 1) * d])
            self.out_proj.weight.copy_(mha.out_proj.weight)
            if mha.out_proj.bias is not None:
                self.out_proj.bias.copy_(mha.out_proj.bias)

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


def split_attention(block: nn.Module) -> None:
    """Replace every ``nn.MultiheadAttention`` child of ``block`` by ``SplitAttention``."""
    for name, child in list(block.named_children()):
        if isinstance(child, nn.MultiheadAttention):
            setattr(block, name, SplitAttention(child))


class MultiRankLinear(nn.Module):
    """``y = W x + b + sum_k w_k(x) * s_k * B_k A_k x`` beside a frozen linear layer.

    ``A_k: [r_k, in]``, ``B_k: [out, r_k]``, ``s_k = alpha / r_k``. All components are
    computed with one matmul into the concatenated rank space. Mixing weights ``w`` are
    set by the owner through ``set_weights``: ``[K]`` (global) or ``[..., K]`` (per token).
    """

    def __init__(self, base: nn.Linear, ranks: Sequence[int], alpha: float):
        super().__init__()
        if not ranks or any(int(r) < 1 for r in ranks):
            raise ValueError(f"ranks must be positive integers, got {list(ranks)}")
        self.base = base
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.ranks = [int(r) for r in ranks]
        total = sum(self.ranks)
        dev, dt = base.weight.device, base.weight.dtype
        self.lora_A = nn.Parameter(torch.zeros(total, base.in_features, device=dev, dtype=dt))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, total, device=dev, dtype=dt))
        scales = torch.cat([torch.full((r,), alpha / r) for r in self.ranks])
        self.register_buffer("rank_scale", scales.to(dev, dt))
        self.register_buffer(
            "component_index",
            torch.repeat_interleave(torch.arange(len(self.ranks)), torch.tensor(self.ranks)).to(
                dev
            ),
        )
        self.weights: torch.Tensor | None = None  # set per forward by the fusion module
        self.init_zero()

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def init_zero(self) -> None:
        """LoRA init: A ~ kaiming-uniform, B = 0, so the layer starts exactly at the source."""
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
            self.lora_B.zero_()

    def set_weights(self, weights: torch.Tensor | None) -> None:
        self.weights = weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.lora_A) * self.rank_scale
        if self.weights is not None:
            w = self.weights
            # [K] global or [..., K] per token -> one weight per rank dimension
            h = h * w.index_select(-1, self.component_index).to(h.dtype)
        return self.base(x) + F.linear(h, self.lora_B)


def attach_adapters(
    blocks: Sequence[nn.Module], targets: Sequence[str], ranks: Sequence[int], alpha: float
) -> dict[str, MultiRankLinear]:
    """Wrap every ``nn.Linear`` in ``blocks`` whose name (relative to its block, e.g.
    ``attn.q_proj``, ``mlp.c_fc``) matches a pattern in ``targets``."""
    wrapped: dict[str, MultiRankLinear] = {}
    for bi, block in enumerate(blocks):
        split_attention(block)
        for name, module in list(block.named_modules()):
            if not isinstance(module, nn.Linear) or isinstance(module, MultiRankLinear):
                continue
            if not any(fnmatch.fnmatchcase(name, pat) for pat in targets):
                continue
            parent_name, _, child = name.rpartition(".")
            parent = block.get_submodule(parent_name) if parent_name else block
            adapter = MultiRankLinear(module, ranks, alpha)
            setattr(parent, child, adapter)
            wrapped[f"block{bi}.{name}"] = adapter
    if not wrapped:
        names = sorted(
            {n for b in blocks for n, m in b.named_modules() if isinstance(m, nn.Linear)}
        )
        raise ValueError(f"no linear layer matches targets {list(targets)}; candidates: {names}")
    return wrapped
