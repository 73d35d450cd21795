"""OGA: online Gaussian adaptation of CLIP, a training-free memory of low-entropy features
turned into Gaussian class likelihoods combined with the zero-shot prediction (online).

Paper: Fuchs, Zanella, De Vleeschouwer, "Online Gaussian Adaptation of Vision-Language
Models", CVPR 2025, https://arxiv.org/abs/2501.04352. Official code:
https://github.com/cfuchs2023/OGA, read at commit b91d449a28d0958849c43dc7f698405b9fcfe4b4
(MIT licence; OGA/OGA_core.py: ``GaussAdapt`` with ``update_memory``, ``__update_memory_entropy``,
``__update_mu``, ``__update_sigma``, ``get_log_probs``, ``get_MAP``; runner.py: ``run``;
main.py: the arguments and their defaults; utils.py: ``clip_classifier``,
``load_clip_classifier``, ``pre_load_features``, ``datasets``; compute_features.py;
datasets/*.py templates). The official code runs CLIP itself on precomputed features
(there is no CLIPTTA port of OGA); the defaults follow it.

Per batch (``--batch_size`` 32 officially; here the protocol's), with ``W`` the head
``[K, D]``, ``s`` the logit scale and the L2-normalised image features ``f``:

1. zero-shot ``y = softmax(s f . W)``, entropy ``H = -sum y log(y + 1e-9)``, pseudo-label
   ``argmax y``;
2. memory (``shots`` 8 per class, every slot's entropy starting at ``ln K``): each sample in
   batch order replaces the highest-entropy slot of its pseudo-class (the first of tied
   ones) if ``H`` is below that entropy; empty slots fill in order;
3. when the batch wrote anything: the mean of class ``k`` is ``mu_k = sum of its stored
   features / shots`` (divided by the capacity, not by the count, as released) once it has
   at least 2 of them, else it keeps its previous value (at first ``W_k``); and, once some
   class has at least 3, the shared covariance ``S`` of the stored features centred on
   their class means (``n`` stored, the centred vectors' own mean removed, divided by
   ``n - 1``) gives the precision matrix (``sig_type=RidgeMoorePenrose``): ``D pinv((n -
   1) S + tr(S) I)`` (the empirical-Bayes ridge) while ``n <= 4 D``, ``pinv(S)`` beyond;
   before that the precision is ``D I``;
4. prediction: ``log p_k(f) = -(f - mu_k)^T P (f - mu_k) / 2`` (shared covariance: no log
   determinant), and the MAP ``z = y * softmax(tau log p) / sum``, ``tau`` 0.05 (``--tau``).
   The output is ``log z = log_softmax(s f . W + tau log p)`` (a log-probability).

Setting (defaults = main.py's, the same for every dataset and backbone): ``shots`` 8
(``--shot_capacity``), ``tau`` 0.05, ``sig_type`` RidgeMoorePenrose, ``normalize_mu`` off.
The memory persists across batches (online); ``reset()`` empties it and restores the
means and precision. The head is the method's own tensor (``adapts = False``). Official
head (``text_head=official``, main.py's ``--prompts_types standard``): each loader's single
template (``OFFICIAL_TEMPLATES``, keyed by the catalogue's dataset names, which are
OGA's own dataset keys; only its data folders differ, e.g. ``Flower102`` for
``oxford_flowers``); "a photo of a {}." on the sets it has no loader for.

What differs and why:
* Logit scale: the official zero-shot logits use a hard-coded 100 (CLIP's scale); here the
  model's ``s``. ``tau`` is not rescaled (it weighs the Gaussian term, which does not depend
  on ``s``), so on a model with a small ``s`` (the tiny digits model's is about 13) the
  Gaussian term weighs more against the flatter zero-shot prediction.
* Precision: the official features, text head, memory and stored entropies are fp16 (its
  CLIP runs in fp16), the zero-shot logits float64, the means and precision float32; here
  fp16 autocast for the image tower on CUDA and float32 everywhere after it (float32 on the
  CPU); the stored entropies start at ``ln K`` exactly (the official fp16 value rounds it,
  upwards for some ``K``). Entropy ties and comparisons near fp16 rounding may differ.
* Stream: the protocol's batch size and order (officially batches of 32 in 100 random
  orders per set, ``--n_runs``, averaged); the memory is written by the whole batch before
  the batch is predicted, as officially (a batch of 1 predicts a sample after its write).
* ``predict`` (the realtime track's batches while busy) is the MAP under the memory as it
  stands, writing nothing (the official ``--check_on_fullset`` evaluation does the same).
* Not modelled (unused at the defaults): the stored soft labels and ``use_soft_labels``
  (never set by the official code), the few-shot CoOp/TaskRes prompts and the CuPL head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mura_plugin.methods._text_heads import SINGLE_PROMPT, TEXT_HEADS, OwnHead, class_head
from tta_bench.bounds import bounded, one_of
from tta_bench.method import PRECISIONS, Method, autocast_context, effective_precision

__all__ = [
    "OFFICIAL_TEMPLATES",
    "OGA",
    "OGAConfig",
    "SIG_TYPES",
    "GaussianMemory",
    "class_means",
    "gaussian_log_probs",
    "official_templates",
    "precision_matrix",
    "shared_covariance",
]

#: The official covariance estimators (``sig_type``).
SIG_TYPES = ("RidgeMoorePenrose", "Ridge", "MoorePenrose")
#: The single template of each official loader (datasets/*.py), by catalogue dataset name.
OFFICIAL_TEMPLATES = {
    "imagenet": "a photo of a {}.",
    "caltech101": "a photo of a {}.",
    "dtd": "{} texture",
    "eurosat": "a centered satellite photo of {}.",
    "fgvc_aircraft": "a photo of a {}, a type of aircraft.",
    "food101": "a photo of {}, a type of food.",
    "oxford_flowers": "a photo of a {}, a type of flower.",
    "oxford_pets": "a photo of a {}, a type of pet.",
    "stanford_cars": "a photo of a {}.",
    "sun397": "a photo of a {}.",
    "ucf101": "a photo of a person doing {}.",
}


def official_templates(dataset: str | None) -> list[str]:
    """OGA's head for ``dataset``: its loader's template, else "a photo of a {}."."""
    if dataset in OFFICIAL_TEMPLATES:
        return [OFFICIAL_TEMPLATES[dataset]]
    return list(SINGLE_PROMPT)


@dataclass
class OGAConfig:
    shots: int = bounded(8, ge=1)  # --shot_capacity
    tau: float = bounded(0.05, gt=0)  # --tau: weight of the Gaussian log-likelihoods
    sig_type: str = one_of("RidgeMoorePenrose", SIG_TYPES)  # --sig_type
    normalize_mu: bool = False  # --normalize_mu
    text_head: str = one_of("protocol", TEXT_HEADS)  # protocol | official
    precision: str = one_of("fp16", PRECISIONS)  # autocast on CUDA; CPU: fp32


def class_means(
    features: torch.Tensor, filled: torch.Tensor, previous: torch.Tensor, normalize: bool
) -> torch.Tensor:
    """``__update_mu``: per class, the sum of its stored ``features [K, S, D]`` (slots where
    ``filled [K, S]``) divided by ``S``, where it has at least 2; ``previous [K, D]``
    elsewhere; ``normalize``: the new means L2-normalised."""
    means = (features * filled[..., None]).sum(dim=1) / features.shape[1]
    if normalize:
        means = means / means.norm(dim=-1, keepdim=True)
    ready = filled.sum(dim=1) >= 2
    return torch.where(ready[:, None], means, previous)


def shared_covariance(
    features: torch.Tensor, filled: torch.Tensor, means: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """``(S [D, D], n)``: the covariance of the stored features centred on their class means
    (class after class, slot order), their own mean removed, over ``n - 1``."""
    labels = torch.arange(features.shape[0], device=features.device)[:, None].expand_as(filled)
    centred = features[filled] - means[labels[filled]]
    n = centred.shape[0]
    centred = centred - centred.mean(dim=0)
    return centred.t() @ centred / (n - 1), n


def precision_matrix(cov: torch.Tensor, n: int, sig_type: str) -> torch.Tensor:
    """The inverse covariance the official ``__update_sigma`` derives from ``cov``: the
    empirical-Bayes ridge ``D pinv((n - 1) cov + tr(cov) I)`` (``Ridge``; and
    ``RidgeMoorePenrose`` while ``n <= 4 D``) or ``pinv(cov)``."""
    d = cov.shape[0]
    if sig_type == "MoorePenrose" or (sig_type == "RidgeMoorePenrose" and n > 4 * d):
        return torch.linalg.pinv(cov)
    if sig_type not in SIG_TYPES:
        raise ValueError(f"unknown sig_type {sig_type!r}; available: {', '.join(SIG_TYPES)}")
    eye = torch.eye(d, device=cov.device, dtype=cov.dtype)
    return d * torch.linalg.pinv((n - 1) * cov + torch.trace(cov) * eye)


def gaussian_log_probs(x: torch.Tensor, means: torch.Tensor, precision: torch.Tensor):
    """``get_log_probs``: ``-(x - mu_k)^T P (x - mu_k) / 2`` for each row of ``x [B, D]``
    and class ``k`` (``[B, K]``), expanded as ``x P mu^T - mu P mu / 2 - x P x / 2``."""
    linear = x @ precision @ means.t()
    bias = -0.5 * ((means @ precision) * means).sum(dim=-1)
    quad = -0.5 * ((x @ precision) * x).sum(dim=-1)
    return linear + bias + quad[:, None]


class GaussianMemory:
    """The official ``GaussAdapt`` state: per class ``shots`` slots of (feature, entropy),
    the class means and the shared precision matrix."""

    def __init__(self, head: torch.Tensor, shots: int):
        k, d = head.shape
        self.features = torch.zeros(k, shots, d, device=head.device)
        self.filled = torch.zeros(k, shots, dtype=torch.bool, device=head.device)
        # entropies on the CPU (float64: ln K exactly): one comparison per sample, no device
        # round trip
        self.entropy = torch.full((k, shots), math.log(k), dtype=torch.float64)
        self.means = head.float().clone()
        self.precision = d * torch.eye(d, device=head.device)

    def offer(self, feature: torch.Tensor, ent: float, label: int) -> bool:
        """``__update_memory_entropy``: replace the pseudo-class's highest-entropy slot (the
        first of tied ones) if ``ent`` is lower. Returns whether it wrote."""
        row = self.entropy[label]
        slot = int(row.argmax())
        if not ent < float(row[slot]):
            return False
        self.features[label, slot] = feature
        self.entropy[label, slot] = ent
        self.filled[label, slot] = True
        return True

    def refresh(self, sig_type: str, normalize_mu: bool) -> None:
        """``__update_mu`` then ``__update_sigma`` (once some class holds 3 features)."""
        self.means = class_means(self.features, self.filled, self.means, normalize_mu)
        if bool((self.filled.sum(dim=1) > 2).any()):
            cov, n = shared_covariance(self.features, self.filled, self.means)
            self.precision = precision_matrix(cov, n, sig_type)

    def log_probs(self, x: torch.Tensor) -> torch.Tensor:
        return gaussian_log_probs(x, self.means, self.precision)


class OGA(OwnHead, Method):
    Config = OGAConfig
    stream_kind = "online"
    #: one forward of the image per sample, no backward: sweeps pack its jobs
    light = True

    def setup(self) -> None:
        cfg = self.config
        # the method's own head: the shared model is never changed (adapts = False)
        self.head = class_head(
            self.model, cfg.text_head, official_templates(self.model.dataset)
        ).float()
        self.reset()

    def reset(self) -> None:
        self.memory = GaussianMemory(self.head, self.config.shots)

    def _zero_shot(self, feats: torch.Tensor) -> torch.Tensor:
        feats = feats.float()
        feats = feats / feats.norm(dim=-1, keepdim=True)
        return float(self.model.logit_scale) * feats @ self.head.t()

    def _predict(self, feats: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """``get_MAP(simplex_p=True)`` as a log-probability."""
        log_p = self.memory.log_probs(feats / feats.norm(dim=-1, keepdim=True))
        return (logits + self.config.tau * log_p).log_softmax(dim=-1)

    @torch.no_grad()
    def step_features(self, features: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        feats = features.float()
        feats = feats / feats.norm(dim=-1, keepdim=True)
        logits = self._zero_shot(feats)
        with self.timed("adapt"):
            probs = logits.softmax(dim=-1)
            ent = -(torch.log(probs + 1e-9) * probs).sum(dim=-1)
            written = [
                self.memory.offer(f, h, label)
                for f, h, label in zip(feats, ent.tolist(), logits.argmax(dim=-1).tolist())
            ]
            if any(written):
                self.memory.refresh(cfg.sig_type, cfg.normalize_mu)
        return self._predict(feats, logits)

    @torch.no_grad()
    def step(self, images: torch.Tensor) -> torch.Tensor:
        with autocast_context(self.config.precision, self.device):
            feats = self.model.encode_image(images)
        return self.step_features(feats)

    def features_only(self) -> bool:
        return effective_precision(self.config.precision, self.device) == "fp32"

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """The realtime track's prediction while busy: the MAP under the memory as it
        stands, writing nothing."""
        with autocast_context(self.config.precision, self.device):
            feats = self.model.encode_image(images).float()
        feats = feats / feats.norm(dim=-1, keepdim=True)
        return self._predict(feats, self._zero_shot(feats))
