"""ZS-NTTA (AdaND): a frozen zero-shot classifier beside an online noise detector (online).

Paper: Cao, Zhong, Zhou, Liu, Liu, Zhang, Han, "Noisy Test-Time Adaptation in
Vision-Language Models", ICLR 2025, https://arxiv.org/abs/2502.14604. Official code:
https://github.com/tmlr-group/ZS-NTTA, read at commit
7db30e9389aaa6875fe70664dd5b7d9482ff0094 (no licence file: read only). Files read:
ttda_method/zs_noisytta.py (``ZeroShotNTTA.__init__``, ``get_unseen_mask``,
``update_detector``), ttda_method/zs_clip.py (``ZeroShotCLIP.get_unseen_mask``,
``get_output``), clip/classifier.py (``OODDetector``), clip/custom_clip.py
(``ClipTestTimeTuning.inference``, ``PromptLearner``), clip/get_model.py, main.py
(``main_worker``, ``test_time_adapt_eval``), data/build_dataset.py (``NoiseDataset``,
``build_test_data``), utils/utils.py (``compute_os_variance``, ``get_optimizer``,
``get_measures``), configs/default_configs.py, configs/zs_noisytta_configs.py,
scripts/*.sh. CLIPTTA's library (MarcLafon/cliptta) has no port of it: the defaults
follow the official code and its ``zs_noisytta_configs.py`` (CLIP ViT-B/16, the same
values on every dataset; the official code has no corruption-specific setting).

The classifier (CLIP image and text towers, the text head) stays frozen: the returned
logits are the zero-shot logits. Beside it, AdaND, a noise detector ``Linear(D, 2)`` (bias,
torch's default initialisation) over the image features, learns along the stream. Per
batch (the official batch path; ``t`` = 0-based batch index since the last reset):

1. injection: Gaussian-noise images join the batch as extra noise, ``gaussian_rate``
   (0.125) of them per real image (the official ``NoiseDataset``: ``(N_id + N_ood) * 0.125``
   images mixed into the whole stream). Each is ``randn(3, S, S)`` min-max scaled per
   image to [0, 255], truncated to bytes, over 255 (what its PIL round trip and
   ``ToTensor`` give); they are encoded with the batch and take part in everything below
   but are never returned;
2. zero-shot OOD score (MCM): ``s = 1 - max softmax(logits)`` with the model's own logit
   scale (CLIP's 100 officially); the last ``queue_length`` (512) scores, this batch's
   included, give the threshold ``tau`` of Otsu's rule (``otsu_threshold``: over the grid
   0, 0.01, ..., 0.99 the first minimiser of ``w0 var0 + w1 var1``, the upper class being
   the scores ``>= th``, a split leaving a class empty skipped; none valid: 0.0);
   ``noisy = s > tau``;
3. pseudo-labels (``pseudo_labels``): 1 (ID) where not noisy, 0 where noisy, 0 for every
   injected image whatever its score;
4. the detector's logits on the batch, then one Adam step (lr 5e-4, betas (0.9, 0.999), no
   weight decay) on the mean cross-entropy to the pseudo-labels;
5. decision: for ``t <= warmup_steps`` (10; the official ``i * bs > 10 * bs``, so 11
   batches) the MCM rule of step 2 decides (``noisy``); after it, the detector's noise
   probability ``p0 = softmax(out)[:, 0]`` of the logits of step 4 (before this step's
   update) enters a second queue (512, only filled after warm-up) whose Otsu threshold
   decides: noisy where ``p0 > tau_det``.

Own OOD score (higher = more ID, the official ``conf`` its AUROC is computed from): the
detector's ID probability ``softmax(out)[:, 1]`` after warm-up, the maximum softmax
probability of the zero-shot logits during it. ``last_ood_decision``: True = judged ID.

The official batch-size-1 path: the first stream batch of one image (after a reset) selects
it. Each image (and each injected one, after it) is one step; the detector is updated only
when ``t != 0 and t % update_queue == 0`` (64), on the last 64 steps' rows (their logits are
recomputed: the detector has not moved since they were taken, so they are the same); the
warm-up lasts while ``t <= warmup_steps * update_queue``.

Official head (``text_head=official``): the single prompt "a photo of a {}." (its CoOp-style
``ctx_init`` "a_photo_of_a" + class + "."); the default ``protocol`` is the protocol's head.
The head is the method's own tensor; the shared model is never changed (``adapts = False``:
the detector is the method's own module). ``reset()`` restores the detector's initial
weights, a new Adam, empty queues, and the step and injection counters.

What differs and why:

* Injection is per batch, not shuffled into the dataset: ``floor(n_seen * rate)`` noise
  images have been added after ``n_seen`` real ones (the official count over the stream),
  appended after the batch's real images (officially at random positions of random
  batches, which also makes its batches of 128 hold about 114 real images). Noise images
  are drawn at the model's input size from the method's generator (the runner seeds it
  per batch), not at 224 from torch's global generator. A constant image (salt-and-pepper
  without salt) scales to zeros (officially a division by zero).
* Detector input: ``detector_features=raw`` (default) feeds the un-normalised projected
  image features, as officially; ``normalized`` feeds the L2-normalised ones, which lets
  the runner replay cached features (``features_only``) but makes each Adam step move the
  detector's logits about ``1 / |f|`` as much. Not measured.
* Precision: the detector, its loss and its update in float32 (officially under fp16
  autocast); the image tower under fp16 autocast on CUDA (officially fp16 weights), float32
  on the CPU.
* The batch-size-1 path is chosen by the first batch's size (officially by the configured
  batch size), and an injected image is the step after the real image it follows.
* The cross-entropy is the mean over the batch in row order (officially the ID rows first,
  then the noisy ones: the same mean up to float summation order).
* ``update_classifier='TDA'`` (a TDA head on top, not the default and not runnable in the
  official code: ``ZeroShotNTTA`` has no ``run_test_tda``) is not provided.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mura_plugin.methods._score_split import THRESHOLD_GRID, score_threshold
from mura_plugin.methods._text_heads import SINGLE_PROMPT, TEXT_HEADS, OwnHead, class_head
from tta_bench.bounds import bounded, one_of
from tta_bench.method import PRECISIONS, Method, autocast_context, effective_precision

__all__ = [
    "NOISE_TYPES",
    "THRESHOLD_GRID",
    "ZSNTTA",
    "ZSNTTAConfig",
    "noise_images",
    "otsu_threshold",
    "pseudo_labels",
]

#: The official ``inject_noise_type`` choices (``NoiseDataset``).
NOISE_TYPES = ("gaussian", "uniform", "salt_and_pepper", "poisson")
#: adaptive: Otsu's rule over the score queue; fixed: ``fixed_threshold``.
THRESHOLDS = ("adaptive", "fixed")
#: What the detector reads: the raw projected image features (official) or normalised ones.
DETECTOR_FEATURES = ("raw", "normalized")


@dataclass
class ZSNTTAConfig:
    lr: float = bounded(5e-4, gt=0)  # Adam on the detector (optim.lr)
    beta1: float = bounded(0.9, ge=0, lt=1)  # Adam's first beta (optim.beta1); second 0.999
    weight_decay: float = bounded(0.0, ge=0)
    #: batches (0-based index) decided by the zero-shot score (inference.using_ttda_step)
    warmup_steps: int = bounded(10, ge=0)
    queue_length: int = bounded(512, ge=1)  # scores the threshold is computed over
    #: batch-size-1 path: one detector update per this many steps (ttda_queue_length)
    update_queue: int = bounded(64, ge=1)
    gaussian_rate: float = bounded(0.125, ge=0)  # injected noise images per real image
    noise_type: str = one_of("gaussian", NOISE_TYPES)
    threshold: str = one_of("adaptive", THRESHOLDS)
    fixed_threshold: float = bounded(0.5, ge=0, le=1)  # threshold=fixed only
    detector_features: str = one_of("raw", DETECTOR_FEATURES)
    text_head: str = one_of("protocol", TEXT_HEADS)  # protocol | official ("a photo of a {}.")
    precision: str = one_of("fp16", PRECISIONS)  # image tower under autocast on CUDA


def otsu_threshold(scores: Any) -> float:
    """Otsu's threshold of ``scores`` (1-d, in [0, 1]) as the official
    ``compute_os_variance`` search: for each ``th`` of ``THRESHOLD_GRID`` the scores
    ``>= th`` form the upper class; the criterion is ``w0 var0 + w1 var1`` (class shares,
    population variances), a split leaving a class empty is skipped; the first minimiser is
    returned, 0.0 when no split is valid (the official ``argmin`` of all-infinite values).
    ROSITA's official code carries the same search: ``_score_split.score_threshold``."""
    s = torch.as_tensor(np.asarray(scores, dtype=np.float64))
    return score_threshold(s).tau


def pseudo_labels(noisy: torch.Tensor, injected: torch.Tensor) -> torch.Tensor:
    """The detector's targets ``[N]`` (int64): 1 (ID) where the zero-shot rule judged the
    row clean, 0 (noise) where it judged it noisy and for every injected noise image."""
    return (~(noisy.bool() | injected.bool())).long()


def noise_images(n: int, size: int, kind: str, generator: torch.Generator) -> torch.Tensor:
    """``n`` noise images ``[n, 3, size, size]`` in [0, 1] as the official ``NoiseDataset``
    makes them: a raw draw (``kind``), min-max scaled per image to [0, 255], truncated to
    bytes, over 255. A constant draw gives zeros."""
    shape = (n, 3, size, size)
    if kind == "gaussian":
        raw = torch.randn(shape, generator=generator)
    elif kind == "uniform":
        raw = torch.rand(shape, generator=generator)
    elif kind == "salt_and_pepper":  # 2.5% salt at 255 on a black image (pepper stays 0)
        raw = (torch.rand(shape, generator=generator) < 0.025).float() * 255
    elif kind == "poisson":
        raw = torch.poisson(torch.ones(shape), generator=generator)
    else:
        raise ValueError(f"unknown noise_type {kind!r}; available: {', '.join(NOISE_TYPES)}")
    flat = raw.flatten(1)
    low = flat.min(dim=1).values.view(n, 1, 1, 1)
    span = (flat.max(dim=1).values.view(n, 1, 1, 1) - low).clamp_min(1e-12)
    return torch.floor((raw - low) / span * 255).clamp(0, 255) / 255


def _push(queue: torch.Tensor, scores: torch.Tensor, length: int) -> torch.Tensor:
    """``queue`` (float64, CPU) with ``scores`` appended, cut to its last ``length``."""
    return torch.cat([queue, scores.detach().double().cpu()])[-length:]


class ZSNTTA(OwnHead, Method):
    Config = ZSNTTAConfig
    adapts = False  # the detector is the method's own module; the shared model is frozen
    stream_kind = "online"
    #: injected noise images (about 12.5% more forwards) and a backward through the detector
    light = False
    own_ood_score: ClassVar[str | None] = (
        "zsntta: AdaND detector's ID probability (max softmax probability during warm-up)"
    )

    def setup(self) -> None:
        cfg = self.config
        self.head = class_head(self.model, cfg.text_head, SINGLE_PROMPT)
        dim = self.head.shape[1]
        # torch's default Linear initialisation from the global generator (seeded by the
        # runner before setup), as the official OODDetector is made once per run
        self.detector = nn.Linear(dim, 2).to(self.device).float()
        self._initial = {k: v.detach().clone() for k, v in self.detector.state_dict().items()}
        self.optimizer: torch.optim.Optimizer | None = None
        self.reset()

    def reset(self) -> None:
        cfg = self.config
        with torch.no_grad():
            for k, v in self.detector.state_dict().items():
                v.copy_(self._initial[k])
        self.detector.zero_grad(set_to_none=True)
        self.optimizer = torch.optim.Adam(
            self.detector.parameters(),
            lr=cfg.lr,
            betas=(cfg.beta1, 0.999),
            weight_decay=cfg.weight_decay,
        )
        self.mcm_queue = torch.zeros(0, dtype=torch.float64)
        self.det_queue = torch.zeros(0, dtype=torch.float64)
        self.window: collections.deque = collections.deque(maxlen=cfg.update_queue)
        self.t = 0  # official steps since the last reset
        self.seen = 0  # real images since the last reset
        self.injected = 0  # noise images injected since the last reset
        self.single_path: bool | None = None  # the batch-size-1 path (first batch decides)
        self.last_loss = None

    def trainable_parameters(self) -> list[nn.Parameter]:
        return list(self.detector.parameters())

    # -- features ------------------------------------------------------------------------
    def _encode(self, images: torch.Tensor) -> torch.Tensor:
        """The image features the method reads: raw (``detector_features=raw``) or
        L2-normalised, float32."""
        raw = self.config.detector_features == "raw"
        with autocast_context(self.config.precision, self.device):
            feats = self.model.encode_image(images, normalize=not raw)
        return feats.float()

    def _logits(self, feats: torch.Tensor) -> torch.Tensor:
        """The frozen zero-shot logits of (raw or normalised) features, float32."""
        normed = F.normalize(feats.float(), dim=-1)
        return self.model.logits_from_features(normed, self.head.float()).float()

    def features_only(self) -> bool:
        return (
            self.config.detector_features == "normalized"
            and effective_precision(self.config.precision, self.device) == "fp32"
        )

    def step_features(self, features: torch.Tensor) -> torch.Tensor:
        return self._run(features.float())

    def step(self, images: torch.Tensor) -> torch.Tensor:
        return self._run(self._encode(images))

    # -- the stream ------------------------------------------------------------------------
    def _noise_count(self, b: int) -> int:
        """How many noise images join a batch of ``b`` real images: the official share
        ``gaussian_rate`` of the real images seen so far, less those already injected."""
        self.seen += b
        due = math.floor(self.seen * self.config.gaussian_rate + 1e-9)
        n, self.injected = max(0, due - self.injected), max(self.injected, due)
        return n

    @torch.no_grad()
    def _run(self, feats: torch.Tensor) -> torch.Tensor:
        """The batch's zero-shot logits; on the way, one official step (or one per row on
        the batch-size-1 path) of the detector, and the batch's own score and decision."""
        b = feats.shape[0]
        if self.single_path is None:
            self.single_path = b == 1
        n = self._noise_count(b)
        if n:
            size = self.model.preprocess.image_size
            noise = noise_images(n, size, self.config.noise_type, self.generator)
            feats = torch.cat([feats, self._encode(noise.to(self.device))])
        injected = torch.arange(b + n, device=feats.device) >= b
        logits = self._logits(feats)
        if self.single_path:
            parts = [self._official_step(feats[i : i + 1], logits[i : i + 1], injected[i : i + 1])
                     for i in range(b + n)]  # fmt: skip
            score = torch.cat([p[0] for p in parts])
            keep = torch.cat([p[1] for p in parts])
        else:
            score, keep = self._official_step(feats, logits, injected)
        self.last_ood_score = score[:b].float().detach()
        self.last_ood_decision = keep[:b].detach()
        return logits[:b]

    def _threshold(self, queue: torch.Tensor) -> float:
        if self.config.threshold == "fixed":
            return float(self.config.fixed_threshold)
        return otsu_threshold(queue.numpy())

    def _past_warmup(self) -> bool:
        """The official ``step * bs > using_ttda_step * ttda_queue_length``: in batches on
        the batch path, in ``update_queue`` steps on the batch-size-1 path."""
        span = self.config.update_queue if self.single_path else 1
        return self.t > self.config.warmup_steps * span

    def _official_step(
        self, feats: torch.Tensor, logits: torch.Tensor, injected: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One official step on its rows: the zero-shot rule, the pseudo-labels, the
        detector's logits and update, the decision. Returns (own score, judged ID)."""
        cfg = self.config
        msp = logits.softmax(dim=-1).max(dim=-1).values
        mcm = 1.0 - msp
        self.mcm_queue = _push(self.mcm_queue, mcm, cfg.queue_length)
        # the float32 score against the threshold, as the official tensor comparison
        noisy = mcm > self._threshold(self.mcm_queue)
        labels = pseudo_labels(noisy, injected)
        out = self.detector(feats).detach()  # before this step's update
        with self.timed("adapt"):
            self._learn(feats, labels)
        if not self._past_warmup():
            self.t += 1
            return msp, ~noisy
        probs = out.softmax(dim=-1)
        self.det_queue = _push(self.det_queue, probs[:, 0], cfg.queue_length)
        flagged = probs[:, 0] > self._threshold(self.det_queue)
        self.t += 1
        return probs[:, 1], ~flagged

    def _learn(self, feats: torch.Tensor, labels: torch.Tensor) -> None:
        """One Adam step on the mean cross-entropy of the detector to ``labels``: on these
        rows (batch path), or on the window of the last ``update_queue`` steps when ``t``
        is a nonzero multiple of it (batch-size-1 path; otherwise only remembered)."""
        if self.single_path:
            self.window.append((feats, labels))
            if self.t == 0 or self.t % self.config.update_queue != 0:
                return
            feats = torch.cat([f for f, _ in self.window])
            labels = torch.cat([y for _, y in self.window])
        with torch.enable_grad():
            loss = F.cross_entropy(self.detector(feats), labels)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
        self.last_loss = loss.detach()

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """The realtime track's prediction while busy: the zero-shot logits and the current
        rule's score and decision (queues read with this batch appended, not stored), no
        injection, no update."""
        feats = self._encode(images)
        logits = self._logits(feats)
        length = self.config.queue_length
        if self.single_path is None or not self._past_warmup():
            msp = logits.softmax(dim=-1).max(dim=-1).values
            tau = self._threshold(_push(self.mcm_queue, 1.0 - msp, length))
            score, keep = msp, ~((1.0 - msp) > tau)
        else:
            probs = self.detector(feats).softmax(dim=-1)
            tau = self._threshold(_push(self.det_queue, probs[:, 0], length))
            score, keep = probs[:, 1], ~(probs[:, 0] > tau)
        self.last_ood_score = score.float()
        self.last_ood_decision = keep
        return logits
