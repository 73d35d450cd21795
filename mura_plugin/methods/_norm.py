"""Norm-layer adaptation helpers shared by the TENT family of methods.

One job: say which normalisation layers of a CLIP model adapt and hand over their affine
parameters, and put the model in the state norm adaptation needs. Users: TENT and ETA/EATA
(``norm_parameters``), SAR and DeYO (``top_excluded_norm_parameters``), TENT, ETA/EATA,
SAR, DeYO and CoTTA (``use_batch_statistics``), CLIPArTT/WATT and BATCLIP
(``vision_layer_norm_parameters``, ``text_layer_norm_parameters``); ``masked_mean`` is the
mean over the samples ETA/EATA's and SAR's entropy filters keep. Method files import these
from here, never from each other's files.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from tta_bench.model import ZeroShotClassifier

__all__ = [
    "NORM_LAYERS",
    "masked_mean",
    "norm_parameters",
    "text_layer_norm_parameters",
    "top_excluded_norm_parameters",
    "tower_blocks",
    "use_batch_statistics",
    "vision_layer_norm_parameters",
]

#: The normalisation layers whose affine parameters TENT-style methods adapt.
NORM_LAYERS = (nn.LayerNorm, nn.BatchNorm2d, nn.GroupNorm)


def norm_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Affine parameters of every LayerNorm / BatchNorm / GroupNorm in ``module``."""
    params: list[nn.Parameter] = []
    for m in module.modules():
        if isinstance(m, NORM_LAYERS):
            params += [p for p in (m.weight, m.bias) if p is not None]
    return params


def use_batch_statistics(module: nn.Module) -> None:
    """Make every BatchNorm2d in ``module`` normalise with the statistics of the batch it
    sees, in train and eval mode alike, and keep no running statistics (the official
    ``configure_model`` of TENT, EATA, SAR, DeYO and CoTTA). Other layers are untouched."""
    for m in module.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.train()
            m.track_running_stats = False
            m.running_mean, m.running_var = None, None


def tower_blocks(visual: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """``(blocks input to output, final norm layers)`` of an open_clip vision tower:
    ``VisionTransformer`` (``transformer.resblocks``, ``ln_post``), ``ModifiedResNet``
    (``layer1``-``layer4``) or a timm-backed tower (``trunk.blocks`` with ``trunk.norm`` /
    ``trunk.fc_norm``, or ``trunk.layer1``-``layer4``)."""
    transformer = getattr(visual, "transformer", None)
    if transformer is not None and hasattr(transformer, "resblocks"):
        blocks = list(transformer.resblocks)
        finals = [getattr(visual, "ln_post", None)]
    else:
        trunk = getattr(visual, "trunk", visual)
        if hasattr(trunk, "blocks"):
            blocks = list(trunk.blocks)
            finals = [getattr(trunk, "norm", None), getattr(trunk, "fc_norm", None)]
        elif all(hasattr(trunk, f"layer{i}") for i in range(1, 5)):
            blocks = [getattr(trunk, f"layer{i}") for i in range(1, 5)]
            finals = []
        else:
            raise ValueError(
                f"cannot find the blocks of vision tower {type(visual).__name__}; supported: "
                "open_clip VisionTransformer, ModifiedResNet, timm towers with blocks or "
                "layer1-layer4"
            )
    return blocks, [m for m in finals if isinstance(m, NORM_LAYERS)]


def top_excluded_norm_parameters(
    visual: nn.Module, exclude_top: float, exclude_final_norm: bool = True
) -> list[nn.Parameter]:
    """Norm-layer affine parameters of ``visual`` outside the deepest
    ``round(n_blocks * exclude_top)`` blocks (and the final norm when
    ``exclude_final_norm``): SAR's and DeYO's official choice."""
    if not 0.0 <= exclude_top < 1.0:
        raise ValueError(f"exclude_top must be in [0, 1), got {exclude_top}")
    blocks, finals = tower_blocks(visual)
    n_top = int(math.floor(len(blocks) * exclude_top + 0.5))
    excluded = {id(m) for block in blocks[len(blocks) - n_top :] for m in block.modules()}
    if exclude_final_norm:
        excluded |= {id(m) for m in finals}
    params: list[nn.Parameter] = []
    for m in visual.modules():
        if isinstance(m, NORM_LAYERS) and id(m) not in excluded:
            params += [p for p in (m.weight, m.bias) if p is not None]
    return params


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


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values[mask]``; an empty mask gives 0 with zero gradients (the official
    code's empty ``mean`` is NaN with zero gradients)."""
    if not bool(mask.any()):
        return (values * 0.0).sum()
    return values[mask].mean()
