"""Adapters and the surgery that places them: SplitAttention equivalence, LoRA algebra,
SVD init starting at the source, router shapes, placement on open_clip and timm ViTs."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from mura_plugin.adapters import (
    MultiRankLinear,
    SplitAttention,
    attach_adapters,
    split_vision_forward,
    vision_blocks,
)


@pytest.mark.parametrize("batch_first", [True, False])
def test_split_attention_matches_multihead_attention(batch_first):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=batch_first).eval()
    split = SplitAttention(mha)
    x = torch.randn(3, 7, 32) if batch_first else torch.randn(7, 3, 32)
    causal = torch.full((7, 7), float("-inf")).triu(1)
    for mask in (None, causal, causal.isinf()):
        ref = mha(x, x, x, need_weights=False, attn_mask=mask)[0]
        out = split(x, x, x, need_weights=False, attn_mask=mask)[0]
        assert torch.allclose(out, ref, atol=1e-5)


def test_single_rank_is_plain_lora():
    torch.manual_seed(0)
    base = nn.Linear(12, 10)
    layer = MultiRankLinear(base, [4], alpha=8.0)
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(5, 12)
    ref = base(x) + (8.0 / 4) * x @ layer.lora_A.t() @ layer.lora_B.t()
    assert torch.allclose(layer(x), ref, atol=1e-5)
    fresh = MultiRankLinear(nn.Linear(12, 10), [2, 3], alpha=1.0)  # B = 0: the source
    assert torch.equal(fresh(x), fresh.base(x))


def test_mura_components_are_standalone_loras():
    """Component k is a LoRA of rank r_k with the shared alpha: scale alpha / r_k and its own
    xavier-normal A_k (std sqrt(2 / (in + r_k)): TTL's re-initialisation), B = 0. The
    sample std of each block is within 5 standard errors (std / sqrt(2n)); kaiming-uniform
    (std 1 / sqrt(3 in)) would be 0.43-0.6x."""
    torch.manual_seed(0)
    layer = MultiRankLinear(nn.Linear(256, 256), [4, 8, 64], alpha=32.0)
    start = 0
    for r in (4, 8, 64):
        rows = slice(start, start + r)
        assert torch.equal(layer.rank_scale[rows], torch.full((r,), 32.0 / r))
        a = layer.lora_A[rows].detach()
        assert not layer.lora_B[:, rows].any()
        assert abs(float(a.std()) / math.sqrt(2 / (256 + r)) - 1) < 5 / math.sqrt(2 * a.numel())
        start += r


@pytest.mark.parametrize("router", [False, True])
def test_svd_init_starts_at_the_source_with_orthogonal_components(router):
    torch.manual_seed(0)
    base = nn.Linear(24, 30)
    ranks = [2, 4, 8]
    layer = MultiRankLinear(base, ranks, alpha=16.0, router=router)
    weights = None if router else torch.tensor([0.2, 0.3, 0.5])
    layer.init_svd(weights)
    layer.set_weights(None if router else weights)
    x = torch.randn(6, 24)
    assert torch.allclose(layer(x), base(x), atol=1e-5)
    assert not torch.allclose(layer.frozen_weight, base.weight)  # residual compensated
    # component k owns its own singular directions: A rows of different components orthogonal
    a = layer.lora_A.detach().double()
    gram = a @ a.t()
    comp = layer.component_index
    off = comp[:, None] != comp[None, :]
    assert gram[off].abs().max() < 1e-4 * gram.diagonal().max()


def test_router_gives_per_token_weights():
    torch.manual_seed(0)
    layer = MultiRankLinear(nn.Linear(16, 16), [2, 4, 8], alpha=4.0, router=True)
    x = torch.randn(3, 5, 16)
    w = layer.router(x).softmax(dim=-1)
    assert w.shape == (3, 5, 3)
    assert torch.allclose(w, torch.full_like(w, 1 / 3))  # zero init: uniform
    with torch.no_grad():
        layer.router.weight.normal_()
        layer.lora_B.normal_()
    w = layer.router(x).softmax(dim=-1)
    assert torch.allclose(w.sum(-1), torch.ones(3, 5))
    assert not torch.allclose(w[0, 0], w[0, 1])  # token-specific
    assert layer(x).shape == (3, 5, 16)


def test_placement_on_open_clip_blocks(classifier):
    visual = copy.deepcopy(classifier.visual)
    blocks = vision_blocks(visual)
    x = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        ref = visual(x)
    adapters = attach_adapters(blocks[-2:], ["attn.q", "attn.v", "mlp.out"], [4], 4.0)
    assert sorted(adapters) == [
        f"block{b}.{n}" for b in (0, 1) for n in ("attn.q_proj", "attn.v_proj", "mlp.c_proj")
    ]
    with torch.no_grad():
        assert torch.allclose(visual(x), ref, atol=1e-5)  # split attention + B = 0
    with pytest.raises(ValueError, match="candidates"):
        attach_adapters(blocks[:1], ["attn.nothing"], [4], 4.0)


def test_fused_qkv_restricted_to_q_and_v_slices_on_timm():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    vit = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2
    ).eval()
    blocks = vision_blocks(vit)
    assert len(blocks) == 2
    x = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        ref = vit(x)
    adapters = attach_adapters(blocks[-1:], ["attn.q", "attn.v", "mlp.in"], [4, 8], 8.0, init="svd")
    assert sorted(adapters) == ["block0.attn.qkv", "block0.mlp.fc1"]
    qkv = adapters["block0.attn.qkv"]
    d = qkv.out_features // 3
    assert qkv.lora_B.shape[0] == 2 * d
    assert torch.equal(qkv.out_index, torch.cat([torch.arange(d), torch.arange(2 * d, 3 * d)]))
    with torch.no_grad():
        assert torch.allclose(vit(x), ref, atol=1e-4)  # svd init: still the source
        qkv.lora_B.normal_()
        tokens = torch.randn(2, 5, qkv.in_features)
        delta = qkv(tokens) - qkv.base(tokens)
    assert delta[..., d : 2 * d].abs().max() < 1e-5  # k slice untouched
    assert delta[..., :d].abs().max() > 1e-2 and delta[..., 2 * d :].abs().max() > 1e-2


@pytest.mark.parametrize("router", [False, True])
def test_batched_episodes_use_one_adapter_copy_per_sample(router):
    """With n episodes, rows of sample i go through copy i: the same as the plain layer
    holding copy i's values; per-copy global weights [n, K] work too."""
    torch.manual_seed(0)
    base = nn.Linear(12, 10)
    layer = MultiRankLinear(base, [2, 3], alpha=4.0, router=router)
    n, views, tokens = 3, 4, 5
    copies = layer.begin_episodes(n, router=router)
    assert [c.shape[0] for c in copies] == [n] * len(copies)
    assert all(c.requires_grad and c.is_leaf for c in copies)
    with torch.no_grad():
        for c in copies:
            c.normal_()
    weights = None if router else torch.rand(n, 2)
    layer.set_weights(weights)
    x = torch.randn(n * views, tokens, 12)  # sample-major rows
    out = layer(x)
    layer.select_episodes(slice(1, 3))
    layer.set_weights(None if router else weights[1:3])  # the owner slices its weights
    part = layer(x[views:])
    layer.set_weights(weights)
    layer.end_episodes()
    for i in range(n):
        ref = MultiRankLinear(base, [2, 3], alpha=4.0, router=router)
        with torch.no_grad():
            ref.lora_A.copy_(copies[0][i])
            ref.lora_B.copy_(copies[1][i])
            if router:
                ref.router.weight.copy_(copies[2][i])
                ref.router.bias.copy_(copies[3][i])
        ref.set_weights(None if router else weights[i])
        rows = slice(i * views, (i + 1) * views)
        torch.testing.assert_close(out[rows], ref(x[rows]), rtol=0, atol=1e-5)
    torch.testing.assert_close(part, out[views:], rtol=0, atol=1e-6)
    assert layer.episode is None
    layer.set_weights(None)
    torch.testing.assert_close(layer(x), base(x))  # shared adapter untouched (B = 0)
    with pytest.raises(ValueError, match="do not split into 3 episodes"):
        layer.begin_episodes(3)
        layer(torch.randn(4, 12))


def test_split_vision_forward_reproduces_the_tower(classifier):
    visual = copy.deepcopy(classifier.visual)
    x = torch.rand(3, 3, 32, 32)
    with torch.no_grad():
        ref = visual(x)
        depth = len(vision_blocks(visual))
        for k in (0, depth - 1, depth):
            prefix, suffix = split_vision_forward(visual, k)
            tokens = prefix(x)
            assert tokens.shape[0] == 3 and tokens.dim() == 3
            torch.testing.assert_close(suffix(tokens), ref, rtol=0, atol=1e-6)
        # adapters attached after the split are used by the suffix
        prefix, suffix = split_vision_forward(visual, depth - 1)
        adapters = attach_adapters(vision_blocks(visual)[-1:], ["attn.q"], [4], 4.0)
        next(iter(adapters.values())).lora_B.normal_()
        assert not torch.allclose(suffix(prefix(x)), ref, atol=1e-3)
    seen = []
    handle = visual.register_forward_hook(lambda _m, args, out: seen.append(len(args[0])))
    with torch.no_grad():
        suffix(prefix(x))
    handle.remove()
    assert seen == [3]  # a pass counter on the tower counts each image once
    with pytest.raises(ValueError, match="k must be in"):
        split_vision_forward(visual, depth + 1)
    assert split_vision_forward(nn.Sequential(nn.Linear(2, 2)), 0) is None
