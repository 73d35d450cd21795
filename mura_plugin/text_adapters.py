"""The text side of MuRA's components (``towers=text`` or ``both``): a class head that is
re-encoded through the adapted deepest blocks of the text tower at every step.

The class prompts never change during a run, so the part of the text forward below the
first adapted block is computed once (``TextHead.__init__``, no gradients): token and
positional embeddings, then the frozen blocks, on sequences cut after the longest prompt's
end token (the tower is causal and pools at the end token, as ``encode_text_cut`` in the
harness). Each ``TextHead.head()`` runs the adapted blocks, ``ln_final``, the end-token
pooling and the projection on those cached tokens, then builds the class head exactly as
the protocol's head is built: per class, the normalised mean of the normalised features of
its prompts (templates and, under the prompt modes, its own sentences).

Batched episodes: ``head(n)`` repeats the cached tokens ``n`` times, sample-major, so each
episode's adapter copy (``MultiRankLinear.begin_episodes``) encodes its own head: the
result is ``[n, C, D]``, one head per sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mura_plugin.methods._clip_text import _causal_open_clip, end_positions
from tta_bench.model import ZeroShotClassifier
from tta_bench.prompts import class_prompt_lists

__all__ = ["TextHead", "per_sample_logits", "prompt_lists", "text_blocks"]


def text_blocks(clip: nn.Module) -> list[nn.Module]:
    """The blocks of a causal open_clip text transformer pooled at its end token, shallowest
    first; ValueError naming the tower for any other text tower."""
    blocks = getattr(getattr(clip, "transformer", None), "resblocks", None)
    if not _causal_open_clip(clip) or not isinstance(blocks, nn.ModuleList):
        raise ValueError(
            f"towers=text/both adapts the blocks of a causal open_clip text transformer "
            f"pooled at its end token (open_clip's CLIP class: ViT-*, RN*, convnext_*); "
            f"{type(clip).__name__} (text pooling "
            f"{getattr(clip, 'text_pool_type', None)!r}) is not one"
        )
    return list(blocks)


def prompt_lists(model: ZeroShotClassifier, templates: Sequence[str] | None) -> list[list[str]]:
    """Each class's prompts: ``templates`` formatted with its name (None: the protocol's
    head, i.e. the model's templates and, under the prompt modes, its own sentences)."""
    if templates is not None:
        return [[t.format(c) for t in templates] for c in model.classnames]
    if model.class_prompts is None:
        return [[t.format(c) for t in model.templates] for c in model.classnames]
    return class_prompt_lists(model.classnames, model.templates, model.class_prompts)


class TextHead:
    """See the module docstring. ``first``: index of the first adapted text block."""

    def __init__(self, model: ZeroShotClassifier, lists: Sequence[Sequence[str]], first: int):
        clip = model.clip
        blocks = text_blocks(clip)
        if not 0 <= first <= len(blocks):
            raise ValueError(f"first must be in 0..{len(blocks)}, got {first}")
        self.clip, self.first = clip, first
        self.batch_first = bool(getattr(clip.transformer, "batch_first", True))
        flat = [(c, text) for c, texts in enumerate(lists) for text in texts]
        device = next(clip.parameters()).device
        tokens = model.tokenizer([t for _, t in flat]).to(device)
        positions = end_positions(clip, tokens)
        length = int(positions.max()) + 1
        self.positions = positions
        self.mask = clip.attn_mask[:length, :length]
        self.class_index = torch.tensor([c for c, _ in flat], device=device)
        self.counts = torch.tensor([len(t) for t in lists], device=device, dtype=torch.float32)
        self.num_classes = len(lists)
        with torch.no_grad():
            cast = clip.transformer.get_cast_dtype()
            x = clip.token_embedding(tokens[:, :length]).to(cast)
            x = x + clip.positional_embedding[:length].to(cast)
            self.tokens = self._run(x, 0, first)  # [P, L, D], batch first

    def _run(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        if not self.batch_first:
            x = x.transpose(0, 1)
        for block in list(self.clip.transformer.resblocks)[start:stop]:
            x = block(x, attn_mask=self.mask)
        return x if self.batch_first else x.transpose(0, 1)

    def head(self, n: int | None = None) -> torch.Tensor:
        """The class head ``[C, D]`` through the adapted blocks as they are now, or with
        ``n`` episodes running, one head per episode ``[n, C, D]``."""
        reps = 1 if n is None else n
        x = self.tokens if reps == 1 else self.tokens.repeat(reps, 1, 1)
        x = self.clip.ln_final(self._run(x, self.first, len(self.clip.transformer.resblocks)))
        x = x[torch.arange(x.shape[0], device=x.device), self.positions.repeat(reps)]
        proj = self.clip.text_projection
        if proj is not None:
            x = proj(x) if isinstance(proj, nn.Linear) else x @ proj
        x = x.to(torch.promote_types(x.dtype, torch.float32))  # fp16 autocast: float32 sums
        feats = F.normalize(x, dim=-1).view(reps, -1, x.shape[-1])  # [n, P, D]
        sums = feats.new_zeros(reps, self.num_classes, feats.shape[-1])
        sums = sums.index_add(1, self.class_index, feats)
        out = F.normalize(sums / self.counts[:, None], dim=-1)
        return out[0] if n is None else out


def per_sample_logits(
    model: ZeroShotClassifier, feats: torch.Tensor, heads: torch.Tensor
) -> torch.Tensor:
    """``model.logits_from_features`` with one head per sample: ``feats [n * V, D]``
    (sample-major), ``heads [n, C, D]`` -> ``[n * V, C]``."""
    n = heads.shape[0]
    grouped = feats.view(n, -1, feats.shape[-1])
    logits = model.logit_scale * torch.bmm(grouped, heads.transpose(1, 2).to(grouped.dtype))
    bias = model.logit_bias
    logits = logits if bias is None else logits + bias
    return logits.reshape(-1, logits.shape[-1])
