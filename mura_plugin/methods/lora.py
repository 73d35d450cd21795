"""Single-rank LoRA test-time adaptation in TTL's setting (the baseline MuRA must beat).

Paper: Imam et al., "Test-Time Low Rank Adaptation via Confidence Maximization for
Zero-Shot Generalization of Vision-Language Models", WACV 2025 (arXiv 2407.15913).
Official code: https://github.com/Razaimam45/TTL-Test-Time-Low-Rank-Adaptation, read at
commit cc754dfdfeee0c85d0364b89112271714e43ce49 (ttl.py, deyo.py, clip/custom_clip.py,
data/datautils.py, scripts/test_ttl.sh).

Setting (defaults = the official script): peft ``LoraConfig(r=16, lora_alpha=32,
target_modules=["q_proj", "v_proj"], bias="none")``, so scale ``alpha / r = 2``; trained in
the last 3 vision blocks (``layer_range 9,11`` of ViT-B/16's 12); ``LoRA_AB`` re-initialises
A xavier-normal (``init_method=xavier``), B = 0; 64 views (original + 63
RandomResizedCrop + horizontal flip); loss = per-view entropy weighted by the detached
``exp(-(H - 0.4))`` (deyo.py with ``reweight_ent=1, deyo_margin_e0=0.4``; its entropy filter
``H <= ln 1000`` keeps every view when C <= 1000, PLPD filtering is off): ``weighted_entropy``;
AdamW lr 5e-3 with torch's defaults (weight decay 0.01, betas (0.9, 0.999), eps 1e-8),
1 step; before every sample the adapters go back to the same initial A and B and the
optimiser state is reloaded; the prediction is made on the original image after the
update; on CUDA fp16 autocast over fp32 weights with ``GradScaler(init_scale=1000)``.
The first update is therefore ``dW = 2 (1 - lr wd) B A0`` with ``|B| = lr`` entry-wise
(Adam's first step; tests/test_methods.py pins it).
Official head (``text_head=official``): "a photo of a {}." (the prompt learner's prefix
"a photo of a" + class + "."); the default ``protocol`` is the protocol's templates.

What differs and why:
* ``lora_dropout=0.05`` is inert in the official run (``model.eval()`` before adapting;
  DeYO's ``configure_model``, which would call ``train()``, is never called): no dropout.
* peft also places adapters (B = 0, never trained) in the 9 frozen blocks: they compute
  nothing, so only the 3 trained ones exist here. ``prepare_model_for_int8_training``
  changes nothing for fp32 weights.
* The tower is open_clip's (the official adapts HF ``CLIPModel``): the adapters sit beside
  the q and v linears of ``SplitAttention``, numerically ``nn.MultiheadAttention``.
* Views: torchvision's RandomResizedCrop boxes drawn on the image at the model's size and
  resized by one bilinear ``grid_sample`` (augment.py); the official crops the raw image
  and resizes with PIL. Its views are never AugMix: ttl.py passes ``augmix=True`` on the
  fine-grained sets, but ``AugMixAugmenter`` (data/datautils.py) then sets an empty
  operation list (``aug_list = []``), so every view is a crop and flip on every set, as
  here.
* Loss scaling per episode (``_loss_scaler.LossScaler``) instead of one GradScaler over the
  sample stream: the same unless an fp16 step overflows (see _episodes.py).
* Implementation: MuRA's adapter machinery with one component and fixed weight 1
  (``fusion=none``, ``init=zero``), so MuRA with ``ranks=[16]`` and the same placement
  computes exactly this (tests/test_methods.py checks it). The 64 per-sample episodes of a
  batch run in parallel, each with its own adapter copy, and the blocks below the adapted
  ones run once per batch without gradients (see mura.py and _episodes.py): the same
  computation as the per-sample loop, to ~1e-6 (``method.episode_batching=false`` runs it).

Measured effect (the first update, the official head): docs/methods.md#lora.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mura_plugin.methods.mura import MuRA, MuRAConfig

__all__ = ["LoRA", "LoRAConfig"]


@dataclass
class LoRAConfig(MuRAConfig):
    ranks: list[int] = field(default_factory=lambda: [16])
    blocks: int = 3
    targets: list[str] = field(default_factory=lambda: ["attn.q", "attn.v"])
    alpha: float = 32.0  # peft lora_alpha: scale alpha / r = 2
    init: str = "zero"
    fusion: str = "none"
    router_persist: bool = False
    lr: float = 5e-3  # TTL's AdamW learning rate (MuRA's own default is lower)


class LoRA(MuRA):
    Config = LoRAConfig
    stream_kind = "episodic"  # the adapters and optimiser reset before every sample
