"""Text-side helpers of the CLIP batch baselines (CLIPArTT, WATT, BATCLIP).

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

from tta_bench.model import ZeroShotClassifier
from tta_bench.text_head import encode_text_cut

__all__ = [
    "TEXT_HEADS",
    "check_text_head",
    "encode_text",
    "ensemble_features",
    "names_per_chunk",
    "prompt_features",
    "prompt_tokens",
    "text_layer_norm_parameters",
    "vision_layer_norm_parameters",
]

TEXT_HEADS = ("protocol", "official")


def check_text_head(text_head: str, method: str) -> None:
    if text_head not in TEXT_HEADS:
        raise ValueError(
            f"{method}: unknown text_head {text_head!r}; available: {', '.join(TEXT_HEADS)}"
        )


def _layer_norm_parameters(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    params: list[nn.Parameter] = []
    for m in modules:
        if isinstance(m, nn.LayerNorm):
            params += [p for p in (m.weight, m.bias) if p is not None]
    return params


def vision_layer_norm_parameters(model: ZeroShotClassifier, method: str) -> list[nn.Parameter]:
    """Affine parameters of every LayerNorm of the image tower (ViT CLIPs); ValueError when
    the tower has none (e.g. a ResNet CLIP, which normalises with BatchNorm)."""
    params = _layer_norm_parameters(list(model.visual.modules()))
    if not params:
        raise ValueError(
            f"{method} adapts the image tower's LayerNorm affine parameters, but "
            f"{type(model.visual).__name__} has no LayerNorm with affine parameters "
            "(supported: ViT image towers, open_clip's or timm's)"
        )
    return params


def text_layer_norm_parameters(model: ZeroShotClassifier, method: str) -> list[nn.Parameter]:
    """Affine parameters of every LayerNorm of the text tower: all LayerNorms of the CLIP
    model outside its image tower (open_clip: the text transformer blocks and ``ln_final``;
    HF text towers: their LayerNorms). ValueError when there are none."""
    visual = {id(m) for m in model.visual.modules()}
    params = _layer_norm_parameters([m for m in model.clip.modules() if id(m) not in visual])
    if not params:
        raise ValueError(
            f"{method} adapts the text tower's LayerNorm affine parameters, but "
            f"{type(model.clip).__name__} has no LayerNorm outside its image tower"
        )
    return params


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
