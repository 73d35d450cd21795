"""DeYO: destroy your object, then adapt on the samples whose prediction depends on its shape.

Paper: Lee et al., "Entropy is not Enough for Test-Time Adaptation: From the Perspective of
Disentangled Factors", ICLR 2024.
Official code: https://github.com/Jhyun17/DeYO, commit
3d7d2897d864907571ef75edf31f0028d53f1432 (methods/deyo.py: forward_and_adapt_deyo,
collect_params, configure_model; config.py: defaults; main.py: learning rates;
exp_deyo.sh: the published runs).

One step per batch, as officially:

1. forward (the batch's prediction), entropy ``H_i``; entropy filter ``H_i < 0.5 ln C``
   (``deyo_margin``; official ``0.5 ln 1000``); no step when no sample passes;
2. the kept images are "destroyed" by patch shuffling: resized to a multiple of
   ``patch_len`` (4, so a 4 x 4 grid of patches) when needed, the 16 patches of each image
   permuted at random (each image its own permutation), resized back; a no-grad forward;
3. PLPD (pseudo-label probability difference) ``p(x)[y] - p(x')[y]``, ``y = argmax p(x)``;
   PLPD filter ``PLPD > 0.2`` (``plpd_threshold``: config.py's default and exp_deyo.sh's
   value for the ViT and wild settings; the mild ResNet-50-BN run uses 0.3); no step when
   none passes;
4. loss = mean over the kept samples of ``w_i H_i`` with the detached weight
   ``w_i = exp(-(H_i - 0.4 ln C)) + exp(PLPD_i)`` (``reweight_ent`` and ``reweight_plpd``
   on; ``deyo_margin_e0`` = 0.4), one SGD step.

Defaults (official): SGD, momentum 0.9, no weight decay, float32, and ``lr=None`` = main.py's
rule: ViT ``0.001 * bs / 64``, ResNet 0.00025 (``0.00025 * 2 * bs / 64`` below batch 32),
doubled at batch size 1; the batch size is the first batch's after ``setup()``/``reset()``.
Parameters: as SAR (the same official ``collect_params``: norm affine parameters outside the
top quarter of the blocks and the final norm; see sar.py for the mapping to CLIP towers),
BatchNorm on batch statistics.

What differs:
* Shuffling draws from the method's generator (official: the global torch RNG), so runs
  reproduce per seed. Resizing, when the input is not a multiple of ``patch_len``, is
  bilinear with antialiasing (torchvision ``Resize``'s tensor default); at the tiny model's
  32 px and CLIP's 224 px it does not happen (both divide by 4).
* ``aug_type`` ``patch`` (default) and ``pixel`` (one pixel permutation for the batch, as
  officially) are implemented; ``occ`` (a 112 px mean-colour window at pixel 56, defined
  for 224 px inputs only) is not.
* The official ``lr_mul`` (5 for Waterbirds/ColoredMNIST only) is not a field: set ``lr``.

Measured effect: docs/methods.md#deyo.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mura_plugin.methods.eta import ReliableEntropyConfig, ReliableEntropyMethod
from mura_plugin.methods.sar import sar_parameters
from tta_bench.bounds import bounded, one_of
from tta_bench.model import ZeroShotClassifier

__all__ = [
    "DeYO",
    "DeYOConfig",
    "AUG_TYPES",
    "patch_shuffle",
    "pixel_shuffle",
    "plpd",
    "deyo_weights",
]

AUG_TYPES = ("patch", "pixel")


@dataclass
class DeYOConfig(ReliableEntropyConfig):
    """The official DeYO setting."""

    #: Entropy filter threshold as a fraction of ln C (official deyo_margin 0.5).
    e_margin: float = 0.5
    #: Entropy margin of the sample weights as a fraction of ln C (deyo_margin_e0 0.4).
    reweight_margin: float = bounded(0.4, gt=0)
    plpd_threshold: float = 0.2
    #: Patches per row and column of the shuffled image (4 x 4 grid).
    patch_len: int = bounded(4, ge=1)
    aug_type: str = one_of("patch", AUG_TYPES)
    filter_ent: bool = True
    filter_plpd: bool = True
    reweight_ent: bool = True
    reweight_plpd: bool = True
    exclude_top: float = bounded(0.25, ge=0, le=1)
    exclude_final_norm: bool = True


def _resize(images: torch.Tensor, size: int) -> torch.Tensor:
    if images.shape[-1] == size and images.shape[-2] == size:
        return images
    return F.interpolate(images, size=(size, size), mode="bilinear", antialias=True)


def patch_shuffle(images: torch.Tensor, patch_len: int, generator: torch.Generator) -> torch.Tensor:
    """DeYO's object destruction: each image of ``[B, C, S, S]`` cut into a
    ``patch_len x patch_len`` grid (after resizing to a multiple of ``patch_len``), its
    patches permuted by its own random permutation (``argsort`` of uniform draws from
    ``generator``), resized back to ``S``."""
    b, c, h, w = images.shape
    if h != w:
        raise ValueError(f"patch_shuffle needs square images, got {h}x{w}")
    if not 1 <= patch_len <= h:
        raise ValueError(f"patch_len must be in [1, {h}], got {patch_len}")
    side = (w // patch_len) * patch_len
    x = _resize(images, side)
    p, n = side // patch_len, patch_len
    patches = x.reshape(b, c, n, p, n, p).permute(0, 2, 4, 1, 3, 5).reshape(b, n * n, c, p, p)
    order = torch.rand(b, n * n, generator=generator).argsort(dim=-1).to(images.device)
    patches = patches[torch.arange(b, device=images.device).unsqueeze(-1), order]
    x = patches.reshape(b, n, n, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, side, side)
    return _resize(x, w)


def pixel_shuffle(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """DeYO's ``pixel`` destruction: one random permutation of pixel positions, shared by
    every image and channel of the batch (as officially)."""
    b, c, h, w = images.shape
    order = torch.randperm(h * w, generator=generator).to(images.device)
    return images.reshape(b, c, h * w)[:, :, order].reshape(b, c, h, w)


def plpd(probs: torch.Tensor, probs_destroyed: torch.Tensor) -> torch.Tensor:
    """Pseudo-label probability difference ``p[y] - p'[y]``, ``y = argmax p``: ``[B]``."""
    label = probs.argmax(dim=1, keepdim=True)
    return (probs.gather(1, label) - probs_destroyed.gather(1, label)).squeeze(1)


def deyo_weights(
    entropy: torch.Tensor,
    plpd_values: torch.Tensor,
    e_margin: float,
    *,
    reweight_ent: bool = True,
    reweight_plpd: bool = True,
) -> torch.Tensor:
    """DeYO's detached sample weights ``[reweight_ent] exp(-(H - E0)) + [reweight_plpd]
    exp(PLPD)`` (Eq. 10)."""
    weights = torch.zeros_like(entropy)
    if reweight_ent:
        weights = weights + torch.exp(-(entropy.detach() - e_margin))
    if reweight_plpd:
        weights = weights + torch.exp(plpd_values.detach())
    return weights


class DeYO(ReliableEntropyMethod):
    """Entropy- and PLPD-filtered, re-weighted entropy minimisation."""

    Config = DeYOConfig
    double_lr_at_batch_one = True

    def setup(self) -> None:
        #: Samples past the entropy filter / both filters since setup or reset.
        self.counts = {"entropy": 0, "selected": 0}
        super().setup()

    def reset(self) -> None:
        super().reset()
        self.counts = {"entropy": 0, "selected": 0}

    def collect_params(self, model: ZeroShotClassifier) -> list[nn.Parameter]:
        return sar_parameters(model, self.config, "deyo")

    def destroy(self, images: torch.Tensor) -> torch.Tensor:
        """The configured object destruction of ``images`` (drawn from ``self.generator``)."""
        if self.config.aug_type == "patch":
            return patch_shuffle(images, self.config.patch_len, self.generator)
        return pixel_shuffle(images, self.generator)

    def adapt(self, images: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        log_c = math.log(self.model.num_classes)
        logits = None
        for _ in range(cfg.steps):
            self.apply_lr(images.shape[0])
            self.last_loss = torch.zeros(())
            with torch.enable_grad(), self.autocast():
                entropy, logits = self.compute_loss(images)
                # official: without the entropy filter, every sample (H <= ln 1000) is kept
                keep = entropy.detach() < (self.e_threshold if cfg.filter_ent else math.inf)
                if not bool(keep.any()):
                    continue
                with torch.no_grad():
                    destroyed = self.model(self.destroy(images[keep]))
                diff = plpd(
                    logits.detach()[keep].float().softmax(dim=1),
                    destroyed.float().softmax(dim=1),
                )
                shape_dependent = diff > cfg.plpd_threshold if cfg.filter_plpd else diff >= -2.0
                self.counts["entropy"] += int(keep.sum())
                if not bool(shape_dependent.any()):
                    continue
                self.counts["selected"] += int(shape_dependent.sum())
                kept_entropy = entropy[keep][shape_dependent]
                if cfg.reweight_ent or cfg.reweight_plpd:
                    kept_entropy = kept_entropy * deyo_weights(
                        kept_entropy,
                        diff[shape_dependent],
                        cfg.reweight_margin * log_c,
                        reweight_ent=cfg.reweight_ent,
                        reweight_plpd=cfg.reweight_plpd,
                    )
                loss = kept_entropy.mean()
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.last_loss = loss.detach()
        return logits
