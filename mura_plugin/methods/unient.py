"""UniEnt: unified entropy optimisation for open-set test-time adaptation (Tent + UniEnt).

Paper: Gao, Zhang, Liu, "Unified Entropy Optimization for Open-Set Test-Time Adaptation",
CVPR 2024, https://arxiv.org/abs/2404.06065.
Official code: https://github.com/gaozhengqing/UniEnt, read at commit
af7faa8c674b61f0ce3741a6e265fd202d8a6656 (MIT licence; cifar/tent.py: forward_and_adapt,
configure_model, collect_params; cifar/ostta.py and cifar/eata.py: the same filter on the
other base methods; cifar/main.py: arguments, optimiser, evaluation; cifar/run.sh: the
hyperparameter grid). CLIP port: MarcLafon/cliptta, read at commit
f4221f4f2b3bfbd220f8836411bbd3774758933d (ttavlm/methods/unient.py,
ttavlm/methods/abstract_model.py: optimiser, parameters, scores;
ttavlm/methods/__init__.py: class prototypes = text embeddings;
ttavlm/configuration.py; ttavlm/scripts/open_set/cifar10/unient.sh).

Per batch (the official rule on Tent, the paper's main base method):

1. filter score: the cosine between each image's feature under the *source* image tower
   (official ``model0``, the model before adaptation) and every class prototype; ``s`` its
   maximum over classes. On CLIP the prototypes are the run's text head (the class text
   embeddings: the official uses the weights of the final linear layer, the CLIP port its
   text embeddings). ``s`` is the method's own OOD score (higher = more in-distribution);
2. csOOD score ``o = 1 - (s - min s) / (max s - min s)`` over the batch; a two-component
   Gaussian mixture (scikit-learn's ``GaussianMixture(n_components=2)``, its defaults: full
   covariance, k-means initialisation, tolerance 1e-3, 100 iterations) is fitted to ``o``;
   the component with the smaller mean is csID;
3. loss, ``H_i`` the entropy of sample ``i``'s softmax and ``H(p_bar)`` that of the batch's
   mean softmax:

   * ``weighting="soft"`` (UniEnt+, official ``--criterion ent_unf``): ``mean_i(w_i H_i)
     - ood_weight * mean_i((1 - w_i) H_i) - marginal_weight * H(p_bar)``, ``w_i`` the
     posterior of the csID component;
   * ``weighting="hard"`` (UniEnt, ``ent_ind_ood``): the mean of ``H`` over the samples the
     mixture assigns to csID minus ``ood_weight`` times its mean over the csOOD ones, minus
     ``marginal_weight * H(p_bar)`` (an empty side adds nothing, as the official empty
     mean, whose gradient is zero);

4. ``steps`` optimiser steps on that loss (the split is fixed for the batch: the source
   score does not change); the prediction is a forward of the updated model.

Parameters: the affine parameters of every norm layer of the image tower, BatchNorm with
test-batch statistics (the official Tent ``configure_model``/``collect_params``; the CLIP
port adapts every LayerNorm/BatchNorm/GroupNorm of the image tower). The text tower and the
head are frozen.

Which code the defaults follow: the rules (source-tower cosine filter, both weightings, the
OOD term) follow the official repository; the optimisation follows the CLIP port, the only
CLIP setting of UniEnt (ttavlm/scripts/open_set/cifar10/unient.sh on CIFAR-10-C + SVHN-C):
Adam lr 1e-4 with ``eps`` 1e-6, 10 steps per batch, the prediction after the update,
soft weights (its only rule), marginal-entropy weight 1.0 (``--beta_reg 1.0``). The
official code has no default pair of weights (run.sh grid-searches ``alpha`` over
{1.0, 0.5, 0.2, 0.1}^2 and ``criterion`` over both weightings, on the test set); 1.0 for the
marginal term and 0.1 for the OOD term lie in that grid and equal the CLIP port's values
(``beta_reg`` 1.0 in its script, ``beta_ood`` default 0.1). float32.

What differs and why:
* Filter score: the CLIP port scores with the *adapting* model's maximum softmax
  probability (logit scale 100), recomputed at each of its 10 steps; the official rule
  (source tower, cosine) is used here, once per batch, since the source score cannot change
  within a batch.
* The CLIP port leaves the OOD term off in its script (``--use_ood_loss`` not given), so
  it runs UniEnt+ without entropy maximisation; it is on here (the method's core rule),
  weighted 0.1.
* The official Tent + UniEnt runs one Adam step (lr 1e-3, eps 1e-8) per batch and returns
  the logits of the forward before the step; the CLIP setting (10 steps, lr 1e-4, eps 1e-6,
  prediction after the update) is used here; ``steps``, ``lr`` and ``adam_eps`` give the
  official one.
* The source tower is run by putting the snapshot's values into the adapted parameters for
  one no-grad forward (official: a deep copy of the whole model): the same features.
* The mixture's random state is drawn from the method's generator (official: the global
  NumPy state), so a seed reproduces the split. A batch of one image, or one whose scores
  are all equal, cannot be split (officially scikit-learn raises, or the min-max division
  gives NaN): every sample is then csID (weight 1).
* The own OOD score is the raw maximum cosine ``s``, not the batch's min-max rescaling
  (which is only comparable within a batch); the official evaluation scores with the
  energy (logsumexp of the logits) and the CLIP port with the maximum softmax, both of which
  the harness computes from the logits itself.
* Only Tent is the base method (the official code also wraps EATA and OSTTA with the same
  filter and loss; the CLIP port wraps Tent).
* Precision: float32, the official code's; the CLIP port's CLIP holds fp16 weights on CUDA
  (its ``build_model`` converts them); ``precision=fp16`` gives fp16 autocast here.
* ``reset()`` restores the parameters and the optimiser, as the official ``reset``; there
  is no other state (the split is made afresh for every batch).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mura_plugin.losses import view_entropy
from mura_plugin.methods._norm import masked_mean, norm_parameters, use_batch_statistics
from tta_bench.bounds import bounded, one_of
from tta_bench.method import OPTIMIZERS, PRECISIONS, GradientConfig, GradientMethod
from tta_bench.model import ZeroShotClassifier

__all__ = ["UniEnt", "UniEntConfig", "UniEntSplit", "gmm_split", "unient_loss"]

WEIGHTINGS = ("soft", "hard")


@dataclass
class UniEntConfig(GradientConfig):
    """Tent + UniEnt+ with the CLIP port's optimisation (see the module docstring)."""

    optimizer: str = one_of("adam", OPTIMIZERS)
    lr: float = bounded(1e-4, gt=0)
    weight_decay: float = bounded(0.0, ge=0)
    momentum: float = bounded(0.9, ge=0, le=1)  # SGD only
    steps: int = bounded(10, ge=1)
    precision: str = one_of("fp32", PRECISIONS)
    #: Adam/AdamW epsilon (the CLIP port's 1e-6; torch's and the official code's 1e-8).
    adam_eps: float = bounded(1e-6, gt=0)
    #: ``soft``: UniEnt+ (posterior weights); ``hard``: UniEnt (the mixture's assignment).
    weighting: str = one_of("soft", WEIGHTINGS)
    #: Weight of the entropy maximisation on csOOD samples (official ``alpha[1]``).
    ood_weight: float = bounded(0.1, ge=0)
    #: Weight of the batch's marginal entropy, maximised (official ``alpha[0]``).
    marginal_weight: float = bounded(1.0, ge=0)


@dataclass
class UniEntSplit:
    """The filter's verdict on a batch: csID weights ``[B]`` (the posterior of the csID
    component), the hard csID assignment ``[B]`` and whether the mixture could be fitted."""

    id_weight: torch.Tensor
    is_id: torch.Tensor
    fitted: bool


def gmm_split(max_cosine: torch.Tensor, random_state: int) -> UniEntSplit:
    """UniEnt's distribution-aware filter: a two-component Gaussian mixture on the csOOD
    score ``1 - minmax(max_cosine)`` of the batch; the component with the smaller mean
    is csID. A batch of fewer than two samples or of equal scores is all csID."""
    from sklearn.mixture import GaussianMixture

    s = max_cosine.detach().float().cpu().numpy().reshape(-1)
    n = s.shape[0]
    low, high = (float(s.min()), float(s.max())) if n else (0.0, 0.0)
    if n < 2 or not high > low:
        ones = torch.ones(n, dtype=torch.float32)
        return UniEntSplit(ones, ones.bool(), False)
    o = (1.0 - (s - low) / (high - low)).astype(np.float32).reshape(-1, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ConvergenceWarning on degenerate batches
        gm = GaussianMixture(n_components=2, random_state=random_state).fit(o)
        proba = gm.predict_proba(o)
        labels = gm.predict(o)
    id_component = 0 if gm.means_[0, 0] < gm.means_[1, 0] else 1  # official tie: flip
    weight = torch.from_numpy(np.ascontiguousarray(proba[:, id_component])).float()
    return UniEntSplit(weight, torch.from_numpy(labels == id_component), True)


def marginal_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the batch's mean softmax (float32)."""
    mean = logits.float().softmax(dim=1).mean(dim=0)
    return -(mean * torch.log(mean)).sum()


def unient_loss(
    logits: torch.Tensor,
    split: UniEntSplit,
    *,
    weighting: str,
    ood_weight: float,
    marginal_weight: float,
) -> torch.Tensor:
    """UniEnt's objective on ``logits [B, C]`` for the batch's ``split`` (scalar): csID
    entropy minimisation, csOOD entropy maximisation, marginal entropy maximisation."""
    entropy = view_entropy(logits)
    if weighting == "soft":
        w = split.id_weight.to(entropy.device)
        id_term = (w * entropy).mean()
        ood_term = ((1.0 - w) * entropy).mean()
    elif weighting == "hard":
        is_id = split.is_id.to(entropy.device)
        id_term = masked_mean(entropy, is_id)
        ood_term = masked_mean(entropy, ~is_id)
    else:
        raise ValueError(f"unknown weighting {weighting!r}; available: {', '.join(WEIGHTINGS)}")
    return id_term - ood_weight * ood_term - marginal_weight * marginal_entropy(logits)


class UniEnt(GradientMethod):
    """Tent with UniEnt's csID/csOOD split: entropy down on csID, up on csOOD."""

    Config = UniEntConfig
    own_ood_score: ClassVar[str | None] = (
        "unient: max cosine of the source-tower image feature to the class text embeddings"
    )

    def setup(self) -> None:
        if self.config.loss is not None:
            raise ValueError(
                f"unient's objective is fixed (unient_loss): method.loss must be null, "
                f"got {self.config.loss!r}"
            )
        self._split: UniEntSplit | None = None
        #: Batches whose mixture was fitted / could not be fitted since setup or reset.
        self.counts = {"fitted": 0, "unsplit": 0}
        super().setup()

    def reset(self) -> None:
        super().reset()
        self.counts = {"fitted": 0, "unsplit": 0}

    def configure(self, model: ZeroShotClassifier) -> None:
        use_batch_statistics(model.visual)

    def collect_params(self, model: ZeroShotClassifier) -> list[nn.Parameter]:
        params = norm_parameters(model.visual)
        if not params:
            raise ValueError("unient found no normalisation layers in the vision tower")
        return params

    def param_groups(self) -> list[Any]:
        if self.config.optimizer.lower() in ("adam", "adamw"):
            return [{"params": list(self.params), "eps": float(self.config.adam_eps)}]
        return list(self.params)

    # -- the filter ----------------------------------------------------------------------
    @contextlib.contextmanager
    def _source_weights(self) -> Iterator[None]:
        """The adapted parameters at their values right after ``setup()`` for the block."""
        with torch.no_grad():
            current = [p.detach().clone() for p in self.params]
            for p, saved in zip(self.params, self._snapshot["params"]):
                p.copy_(saved)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, value in zip(self.params, current):
                    p.copy_(value)

    @torch.no_grad()
    def source_score(self, images: torch.Tensor) -> torch.Tensor:
        """``[B]`` maximum cosine of each image's source-tower feature to the class
        embeddings (float32, detached): the filter's input and the own OOD score."""
        with self._source_weights(), self.autocast():
            features = self.model.encode_image(images)
        feats = F.normalize(features.float(), dim=-1)
        protos = F.normalize(self.model.class_embeddings.float(), dim=-1)
        return (feats @ protos.t()).max(dim=1).values

    def _random_state(self) -> int:
        return int(torch.randint(0, 2**31 - 1, (1,), generator=self.generator))

    # -- adaptation ----------------------------------------------------------------------
    def compute_loss(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, logits)`` of one forward for the batch's split (set by ``adapt``)."""
        if self._split is None:
            raise RuntimeError("UniEnt.compute_loss needs the batch's split: call adapt")
        cfg = self.config
        logits = self.model(images)
        loss = unient_loss(
            logits,
            self._split,
            weighting=cfg.weighting,
            ood_weight=cfg.ood_weight,
            marginal_weight=cfg.marginal_weight,
        )
        return loss, logits

    def adapt_scored(self, images: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
        """Split the batch by ``score`` (``source_score``), then ``steps`` updates."""
        self._split = gmm_split(score, self._random_state())
        self.counts["fitted" if self._split.fitted else "unsplit"] += 1
        try:
            return super().adapt(images)
        finally:
            self._split = None

    def adapt(self, images: torch.Tensor) -> torch.Tensor:
        return self.adapt_scored(images, self.source_score(images))

    def step(self, images: torch.Tensor) -> torch.Tensor:
        with self.timed("adapt"):
            score = self.source_score(images)
            self.adapt_scored(images, score)
        with self.timed("predict"):
            logits = super().predict(images)
        self.last_ood_score = score.detach().float()
        return logits

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        self.last_ood_score = self.source_score(images).detach().float()
        return super().predict(images)
