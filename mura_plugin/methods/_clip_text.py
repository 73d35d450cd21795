"""Text-side helpers of the CLIP batch baselines (CLIPArTT, WATT, BATCLIP).

Two kinds: prompt encoding, and CLIPArTT's loss over image and prompt features
(``clipartt_targets``, ``clipartt_loss``), which WATT reuses under each of its templates.
(The LayerNorm parameters these methods adapt come from ``_norm``.)

These methods re-encode prompts during adaptation: CLIPArTT the pseudo-label prompts of every
iteration, WATT one class head per template, BATCLIP the class prompts of every step (with
gradients into the text tower's LayerNorms). Everything goes through ``encode_text``, which
drives open_clip's text tower; the text head is chosen with ``text_head``:

* ``protocol`` - the protocol's templates (``model.templates``), the head every method of the
  benchmark starts from;
* ``official`` - the method's own template(s), recorded in the results as its config.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mura_plugin.methods._text_heads import TEXT_HEADS
from tta_bench.model import ZeroShotClassifier
from tta_bench.text_head import encode_text_cut

__all__ = [
    "TEXT_HEADS",
    "clipartt_loss",
    "clipartt_targets",
    "encode_text",
    "end_positions",
    "ensemble_features",
    "names_per_chunk",
    "prompt_features",
    "prompt_tokens",
]


def _causal_open_clip(clip: nn.Module) -> bool:
    """Whether ``clip`` is an open_clip ``CLIP`` with a causal text transformer pooled at the
    end token: then the end-token feature never depends on later (padding) positions."""
    needed = ("token_embedding", "positional_embedding", "transformer", "ln_final")
    return (
        all(hasattr(clip, a) for a in needed)
        and getattr(clip, "attn_mask", None) is not None
        and getattr(clip, "text_pool_type", None) in ("argmax", "eos")
        and hasattr(clip.transformer, "get_cast_dtype")
    )


def end_positions(clip: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Where an open_clip text tower pools each of ``tokens [N, L]``: the end token (the
    largest id under ``text_pool_type="argmax"``, ``text_eos_id`` under ``"eos"``)."""
    if getattr(clip, "text_pool_type", "argmax") == "eos":
        return (tokens == clip.text_eos_id).int().argmax(dim=-1)
    return tokens.argmax(dim=-1)


def encode_text(clip: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Unnormalised text features ``[N, D]`` of token ids ``[N, L]``, differentiable with
    respect to the text tower: the harness's ``encode_text_cut`` (a causal open_clip text
    transformer is cut after the longest prompt's end token; other towers run
    ``encode_text``). ValueError when the model has no text tower to drive."""
    if not _causal_open_clip(clip) and not hasattr(clip, "encode_text"):
        raise ValueError(
            f"{type(clip).__name__} has no text tower (encode_text) to encode prompts with"
        )
    return encode_text_cut(clip, tokens)


def prompt_tokens(
    model: ZeroShotClassifier, names: Sequence[str], templates: Sequence[str]
) -> torch.Tensor:
    """Token ids ``[N * T, L]`` of ``template.format(name)``, name-major (the T prompts of a
    name are consecutive), on the model's device."""
    device = next(model.clip.parameters()).device
    return model.tokenizer([t.format(n) for n in names for t in templates]).to(device)


def ensemble_features(clip: nn.Module, tokens: torch.Tensor, n_templates: int) -> torch.Tensor:
    """Template-ensemble features ``[N, D]`` of name-major prompt tokens ``[N * T, L]``: per
    name, the normalised mean over its T prompts of their normalised features, the rule the
    protocol head is built with. Differentiable; one text forward."""
    feats = F.normalize(encode_text(clip, tokens), dim=-1)
    feats = feats.view(-1, n_templates, feats.shape[-1]).mean(dim=1)
    return F.normalize(feats, dim=-1)


def names_per_chunk(model: ZeroShotClassifier, n_templates: int) -> int:
    """How many names' prompts fit one text forward of at most ``model.text_chunk_size``
    prompts (at least one name: its templates are ensembled together)."""
    return max(1, int(getattr(model, "text_chunk_size", 256)) // n_templates)


def prompt_features(
    model: ZeroShotClassifier, names: Sequence[str], templates: Sequence[str]
) -> torch.Tensor:
    """Template-ensemble text features ``[N, D]`` of ``names`` (class names, or CLIPArTT's
    joined pseudo-label names) under ``templates`` (``ensemble_features``), encoded in chunks
    of whole names of at most ``model.text_chunk_size`` prompts: under ``no_grad`` the peak
    memory is one chunk's. Differentiable when called with gradients enabled."""
    names, templates = list(names), list(templates)
    step = names_per_chunk(model, len(templates))
    return torch.cat(
        [
            ensemble_features(
                model.clip, prompt_tokens(model, names[i : i + step], templates), len(templates)
            )
            for i in range(0, len(names), step)
        ]
    )


def clipartt_targets(
    image_features: torch.Tensor, text_features: torch.Tensor, temperature: float
) -> torch.Tensor:
    """``softmax(((I I^T + T T^T) / 2) / temperature, dim=-1)`` ``[B, B]`` of normalised image
    features ``I [B, D]`` and pseudo-label prompt features ``T [B, D]`` (float32)."""
    i, t = image_features.float(), text_features.float()
    return torch.softmax(((i @ i.t() + t @ t.t()) / 2) / temperature, dim=-1)


def clipartt_loss(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    logit_scale: torch.Tensor | float,
    temperature: float,
) -> torch.Tensor:
    """Per-image loss ``[B]`` whose mean is the official ``cross_entropy(L^T, Q^T)`` with
    ``L = s T I^T`` and ``Q = clipartt_targets(I, T)``: image i's term is
    ``-sum_j Q[j, i] log softmax_j(s I_i . T_j)``. Inputs are normalised ``[B, D]``."""
    i, t = image_features.float(), text_features.float()
    targets = clipartt_targets(i, t, temperature)
    logp = (logit_scale * i @ t.t()).log_softmax(dim=-1)  # [image, text] = L^T
    return -(targets.t() * logp).sum(dim=-1)
