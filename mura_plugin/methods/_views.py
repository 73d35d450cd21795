"""The names of the multi-view machinery, from the modules that hold them by job:
``_text_heads`` (the text head a method classifies with), ``_view_budget`` (the views of a
batch within the view memory budget), ``_view_config`` (the view fields of the configs),
``_loss_scaler`` (fp16 loss scaling per episode), ``_episodes`` (the episode engine
``MultiViewMethod``) and ``_episode_groups`` (its batched per-sample episodes). Import from
those modules; this one re-exports their names for code that imports them from here.
"""

from __future__ import annotations

from mura_plugin.methods._episodes import (
    EPISODIC,
    SEPARABLE_LOSSES,
    MultiViewConfig,
    MultiViewMethod,
)
from mura_plugin.methods._loss_scaler import LossScaler
from mura_plugin.methods._text_heads import SINGLE_PROMPT, TEXT_HEADS, check_text_head, class_head
from mura_plugin.methods._view_budget import (
    COPIES_WAIT,
    VIEW_MEMORY_MB,
    LazyViews,
    WaitingCopies,
    configured_views,
    encode_flat,
    encode_in_chunks,
    image_chunks,
    plan_configured,
    view_bytes_per_image,
)

__all__ = [
    "COPIES_WAIT",
    "EPISODIC",
    "VIEW_MEMORY_MB",
    "LazyViews",
    "SEPARABLE_LOSSES",
    "SINGLE_PROMPT",
    "TEXT_HEADS",
    "LossScaler",
    "WaitingCopies",
    "MultiViewConfig",
    "MultiViewMethod",
    "check_text_head",
    "class_head",
    "configured_views",
    "encode_flat",
    "encode_in_chunks",
    "image_chunks",
    "plan_configured",
    "view_bytes_per_image",
]
