"""The Method contract (docs/design.md#contracts) and the GradientMethod base.

The harness builds a method with ``Method(model, config)`` (store only), calls ``setup()``
once, ``reseed(seed)`` + ``step(images)`` per batch, and ``reset()`` where the protocol says.
Methods never receive labels: the runner keeps them.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
from torch import nn

from tta_bench.bounds import bounded, one_of
from tta_bench.model import ZeroShotClassifier


@dataclass
class NoConfig:
    """A method without hyperparameters."""


OPTIMIZERS = ("adam", "adamw", "sgd")
#: Compute precision on CUDA (autocast dtype); on the CPU every method runs in float32.
PRECISIONS = ("fp32", "fp16", "bf16")
_AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; available: {', '.join(PRECISIONS)}")


def effective_precision(precision: str, device: torch.device) -> str:
    """What a method configured with ``precision`` computes in on ``device`` (autocast is
    applied on CUDA only; the CPU always runs float32)."""
    check_precision(precision)
    return precision if device.type == "cuda" else "fp32"


def autocast_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for ``precision`` on CUDA, a no-op context otherwise."""
    effective = effective_precision(precision, device)
    if effective == "fp32":
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=_AUTOCAST_DTYPES[effective])


@dataclass
class GradientConfig:
    """Hyperparameters every gradient-based method shares. ``loss``: a registered loss
    (``tta-bench ls losses``) that ``compute_loss`` applies as ``self.loss_fn``; None for a
    method whose objective is fixed in its ``compute_loss``."""

    loss: Optional[str] = None
    optimizer: str = one_of("adam", OPTIMIZERS)
    lr: float = bounded(1e-3, gt=0)
    weight_decay: float = bounded(0.0, ge=0)
    momentum: float = bounded(0.9, ge=0, le=1)  # SGD only
    steps: int = bounded(1, ge=1)
    #: Autocast precision on CUDA (``fp32`` = none); each method defaults to its official
    #: code's precision. Ignored on the CPU (float32). Recorded in the results.
    precision: str = one_of("fp32", PRECISIONS)
    #: fp16 on CUDA only: the initial scale of a ``torch.amp.GradScaler`` (some official
    #: code scales its loss by 1000); None: no loss scaling.
    grad_scale: Optional[float] = bounded(None, gt=0)


class Method(abc.ABC):
    """A test-time adaptation method. Subclasses define ``Config`` (a dataclass)."""

    Config: ClassVar[type] = NoConfig
    #: True when ``step`` changes the model; False for parameter-free methods.
    adapts: ClassVar[bool] = False
    #: True for the frozen source model itself (the reference a run is compared with):
    #: its cells' ``reference_accuracy`` is its own accuracy.
    is_reference: ClassVar[bool] = False
    #: True when the softmax of what ``step`` returns is the method's predicted class
    #: probabilities (logits of a probability model); False for outputs that only rank the
    #: classes (scores scaled by an arbitrary constant). Results record it, and tables print
    #: no likelihood or calibration figure (NLL, ECE) for such a method.
    scores_are_logits: ClassVar[bool] = True
    #: True for cheap cells: with its defaults, at most one forward pass per sample and no
    #: backward pass. ``tta-bench sweep`` packs light jobs several to a launcher task, so a
    #: cluster task (and its GPU) is not held for one small cell (docs/cluster.md).
    light: ClassVar[bool] = False
    #: How the method's own code runs it: ``"episodic"`` (its state is reset for every image
    #: or batch), ``"online"`` (it carries state, a cache or a memory, along the stream), or
    #: None (the protocol decides: the TENT family and the CLIP batch methods). A protocol
    #: profile may set the stream by kind (``tta_bench.run.profiles``). A method's settings
    #: per dataset family or per profile are catalogue data (its entry's ``dataset_flags``
    #: and ``profiles``), not attributes.
    stream_kind: ClassVar[str | None] = None
    #: The protocol's prompt modes (``tta_bench.prompts``) the method can run under: every
    #: one for a method that reads the head (``model.class_embeddings``); a method that
    #: encodes prompts from ``model.templates`` itself declares ``("templates",)``, and a run
    #: of another mode is refused before anything is built.
    text_heads: ClassVar[tuple[str, ...]] = ("templates", "cupl", "all")
    #: The name of the method's own out-of-distribution score (higher = more
    #: in-distribution), or None for a method without one. A method that declares one sets
    #: ``last_ood_score`` in every ``step``, ``step_features`` and ``predict``; the runner
    #: records it per sample and scores open-set cells with it beside the protocol's score
    #: (``auroc_own``, ``aupr_own``, ``fpr95_own``: ``tta_bench.run.openset``).
    own_ood_score: ClassVar[str | None] = None
    #: The own OOD score of the batch the last ``step``/``predict`` returned: ``[B]``
    #: floats (``own_ood_score``); the runner clears it before every batch.
    last_ood_score: torch.Tensor | None = None
    #: Optionally, the method's own in/out decision for the same batch (``[B]`` bools, True
    #: = judged in-distribution): a detector that thresholds its score (ZS-NTTA's AdaND).
    #: Open-set cells then also get the noisy-stream accuracies (``acc_id``, ``acc_ood``,
    #: ``acc_h``: ``tta_bench.run.openset.decision_metrics``).
    last_ood_decision: torch.Tensor | None = None
    #: Set by the runner before ``setup()``: how many samples the method sees until its
    #: next reset by the protocol (a schedule over the stream needs it, e.g. OnZeta's).
    stream_length: int | None = None

    def __init__(self, model: ZeroShotClassifier, config: Any = None):
        from tta_bench.bounds import check_values

        self.model = model
        self.config = config if config is not None else self.Config()
        # the declared ranges and choices, as a run checks them before anything is built:
        # a method made directly (tests, notebooks) refuses the same values in the same words
        check_values(self.config, "method")
        self.generator = torch.Generator()

    @property
    def device(self) -> torch.device:
        return self.model.mean.device

    def setup(self) -> None:  # noqa: B027 - parameter-free methods need nothing
        """Model surgery, freezing, optimiser, snapshot. Called once."""

    @abc.abstractmethod
    def step(self, images: torch.Tensor) -> torch.Tensor:
        """Adapt (maybe) on a batch of images in [0, 1] and return its logits ``[B, C]``."""

    def reset(self) -> None:  # noqa: B027 - stateless methods have nothing to reset
        """Return to exactly the state right after ``setup()``."""

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, C]`` of the method's current state without adapting: the batches a
        ``realtime`` protocol reveals while the method is still busy adapting
        (``tta_bench.run.realtime``). Default: the (maybe adapted) model's forward; a
        method whose prediction adds other state (a cache, a memory) overrides it."""
        return self.model(images).float()

    # -- the feature path (``tta_bench.run.features``) -----------------------------------
    def features_only(self) -> bool:
        """True when this instance's ``step(images)`` reads its images only through one
        ``model.encode_image(images)`` in float32, so that ``step(images)`` equals
        ``step_features(model.encode_image(images))``: the runner may then replay cached
        image features instead of decoding, corrupting and encoding the images again
        (``protocol.orders``). Such a method defines ``step_features``."""
        return False

    def step_features(self, features: torch.Tensor) -> torch.Tensor:
        """``step`` on the L2-normalised float32 image features ``[B, D]`` of the batch
        (``model.encode_image``); only called when ``features_only()`` is True."""
        raise NotImplementedError(f"{type(self).__name__} has no feature path")

    def source_images_needed(self) -> int:
        """How many clean, unlabeled source-domain images the method needs before
        ``setup()`` (e.g. EATA's Fisher information); 0 = none. The runner hands them over
        with ``set_source`` from the protocol's declared source split, or refuses the run
        with a clear error when the protocol declares none."""
        return 0

    #: True for a method whose source-domain objective is supervised (RMT's source replay
    #: and class prototypes, GTTA's source mixup): the runner then hands the labels of the
    #: source images too (``set_source(images, labels)``). They are the source split's
    #: labels, never the test stream's.
    needs_source_labels: ClassVar[bool] = False

    def set_source(self, images: torch.Tensor, labels: torch.Tensor | None = None) -> None:
        """Clean source images ``[N, C, H, W]`` in [0, 1] at the model's input size, called
        once before ``setup()`` when ``source_images_needed() > 0``; ``labels`` (int64
        ``[N]``) only for a method that ``needs_source_labels``."""
        self.source = images
        self.source_labels = labels

    #: Set by ``set_source``; None when the method asked for no source images.
    source: torch.Tensor | None = None
    #: The labels of ``source`` (``needs_source_labels``); None otherwise.
    source_labels: torch.Tensor | None = None

    #: The attributes ``resolved_settings`` records by default, in order.
    resolved: ClassVar[tuple[str, ...]] = ()

    def resolved_settings(self) -> dict[str, Any]:
        """Settings the method derived at run time from its config (e.g. a learning rate
        scaled by the batch size when the config says ``lr=None``), recorded in the
        results beside the config; by default the attributes named in ``resolved``
        (empty when there are none)."""
        return {name: getattr(self, name) for name in self.resolved}

    def reseed(self, seed: int) -> None:
        """Seed the method's own randomness (augmented views); the runner calls it per batch."""
        self.generator.manual_seed(int(seed))

    def trainable_parameters(self) -> list[nn.Parameter]:
        return []

    # -- cost accounting (read by the runner, never needed by a method's logic) ------------
    #: The last adaptation loss (a detached scalar tensor) for the runner's per-batch log.
    last_loss: torch.Tensor | float | None = None

    @property
    def timings(self) -> dict[str, float]:
        """Seconds spent per phase of ``step`` (``adapt``: forward + backward + optimiser
        step and resets; ``predict``), accumulated over the method's life. The runner reads
        the growth over a cell and counts the rest of ``step`` as prediction, so a method
        that times nothing counts entirely as prediction."""
        if "_timings" not in self.__dict__:
            self.__dict__["_timings"] = {}
            self.__dict__["_timing_active"] = set()
        return self.__dict__["_timings"]

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the wall time of the block to ``timings[phase]`` (device synchronised before
        and after, like the runner's ``PhaseTimer``); nested blocks of the same phase count
        once."""
        timings = self.timings
        active: set[str] = self.__dict__["_timing_active"]
        if phase in active:
            yield
            return
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        active.add(phase)
        start = time.perf_counter()
        try:
            yield
        finally:
            if cuda:
                torch.cuda.synchronize(self.device)
            timings[phase] = timings.get(phase, 0.0) + time.perf_counter() - start
            active.discard(phase)


def release_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Drop ``optimizer``'s state (its moment buffers) and its references to the parameters
    now. A torch optimiser sits in a reference cycle from its construction (frames of its
    constructor's wrappers refer to it), so one that is only dropped lives, with its state,
    until Python's cyclic collector runs: per-episode optimisers would pile up between
    collections (seen as peak memory creeping over a batch's episodes)."""
    optimizer.state.clear()
    optimizer.param_groups.clear()


def build_optimizer(params: list[Any], config: GradientConfig) -> torch.optim.Optimizer:
    """The config's optimiser over ``params``: tensors, or torch parameter groups (dicts with
    ``params`` and per-group settings such as ``lr``, which override the config's)."""
    name = config.optimizer.lower()
    if name == "adam":
        return torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    if name == "sgd":
        return torch.optim.SGD(
            params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
    raise ValueError(f"unknown optimizer {config.optimizer!r}; available: {', '.join(OPTIMIZERS)}")


class GradientMethod(Method):
    """Adapts a declared set of parameters by gradient steps on a label-free loss.

    A subclass supplies:
      * ``configure(model)`` - surgery (optional), e.g. inserting adapters;
      * ``collect_params(model)`` - the parameters that adapt (everything else is frozen);
      * ``compute_loss(images)`` - per-sample loss ``[B]`` and the logits of that forward.

    The base owns freezing, the optimiser, ``torch.enable_grad()``, autocast, the snapshot
    of all adapted state (parameters, buffers, optimiser, ``extra_state``) and ``reset()``.
    """

    Config: ClassVar[type] = GradientConfig
    adapts: ClassVar[bool] = True
    #: True: return the logits of the last adaptation forward; False: predict again after
    #: the update.
    predict_from_last_forward: ClassVar[bool] = False

    def configure(self, model: ZeroShotClassifier) -> None:  # noqa: B027 - optional hook
        """Model surgery before parameters are collected."""

    @abc.abstractmethod
    def collect_params(self, model: ZeroShotClassifier) -> list[nn.Parameter]:
        """The parameters to adapt."""

    @abc.abstractmethod
    def compute_loss(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(per_sample_loss [B], logits [B, C])`` for one adaptation step."""

    #: Attributes beyond parameters/buffers/optimiser that ``reset()`` restores (the
    #: default ``extra_state``): e.g. a moving average a method keeps across batches.
    state_attributes: ClassVar[tuple[str, ...]] = ()

    def extra_state(self) -> dict[str, Any]:
        """State beyond parameters/buffers/optimiser that ``reset()`` must restore: by
        default the ``state_attributes``."""
        return {name: getattr(self, name) for name in self.state_attributes}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Put back what ``extra_state`` returned (a copy of it)."""
        for name in self.state_attributes:
            setattr(self, name, state[name])

    # -- lifecycle ---------------------------------------------------------------------
    def setup(self) -> None:
        self.model.requires_grad_(False)
        self.configure(self.model)
        self.params = list(self.collect_params(self.model))
        if not self.params:
            raise ValueError(f"{type(self).__name__}.collect_params returned no parameters")
        for p in self.params:
            p.requires_grad_(True)
        # A method with a fixed objective (no ``loss`` field) computes it in compute_loss.
        loss = getattr(self.config, "loss", None)
        self.loss_fn = _load_loss(loss) if loss is not None else None
        self.optimizer = build_optimizer(self.param_groups(), self.config)
        self.scaler = self._new_scaler()
        self._snapshot = self._capture()

    def param_groups(self) -> list[Any]:
        """What the optimiser is built over: ``self.params`` (default), or torch parameter
        groups giving some parameters their own learning rate."""
        return list(self.params)

    def _new_scaler(self) -> Any:
        """A GradScaler when the config asks for one and fp16 autocast is on, else None."""
        scale = getattr(self.config, "grad_scale", None)
        if scale is None:
            return None
        if effective_precision(self.config.precision, self.device) != "fp16":
            return None  # bf16 and fp32 gradients do not underflow: no scaling
        return torch.amp.GradScaler("cuda", init_scale=float(scale))

    def optimizer_step(
        self,
        loss: torch.Tensor,
        optimizer: Any = None,
        after_backward: Callable[[], None] | None = None,
    ) -> None:
        """``loss.backward()`` and one optimiser step, through the GradScaler when fp16
        loss scaling is on (a step with non-finite scaled gradients is skipped, as
        ``GradScaler`` does). ``after_backward``: more gradient to accumulate between the
        two (from the same, maybe scaled, loss), before the scaler unscales it."""
        optimizer = optimizer or self.optimizer
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        if after_backward is not None:
            after_backward()
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def trainable_parameters(self) -> list[nn.Parameter]:
        return list(self.params)

    def _capture(self) -> dict[str, Any]:
        return {
            "params": [p.detach().clone() for p in self.params],
            "buffers": {k: b.detach().clone() for k, b in self.model.named_buffers()},
            "extra": _clone(self.extra_state()),
        }

    def reset(self) -> None:
        with self.timed("adapt"):
            self._restore()

    def _restore(self) -> None:
        snap = self._snapshot
        with torch.no_grad():
            for p, saved in zip(self.params, snap["params"]):
                p.copy_(saved)
            for k, b in self.model.named_buffers():
                # Only buffers that moved are written: the frozen ones (an adapter's are
                # shared with other adapters) must keep their version counter, or a
                # concurrent backward that saved them fails in another thread.
                if k in snap["buffers"] and not torch.equal(b, snap["buffers"][k]):
                    b.copy_(snap["buffers"][k])
        self.load_extra_state(_clone(snap["extra"]))
        release_optimizer(self.optimizer)
        self.optimizer = build_optimizer(self.param_groups(), self.config)
        self.scaler = self._new_scaler()

    # -- adaptation --------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast_context(self.config.precision, self.device)

    def adapt(self, images: torch.Tensor) -> torch.Tensor:
        """``config.steps`` optimisation steps; returns the logits of the last forward."""
        logits = None
        for _ in range(self.config.steps):
            with torch.enable_grad(), self.autocast():
                loss, logits = self.compute_loss(images)
                loss = loss.mean()
            self.optimizer.zero_grad(set_to_none=True)
            self.optimizer_step(loss)
            self.last_loss = loss.detach()
        return logits

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            logits = self.model(images)
        return logits.float()

    def step(self, images: torch.Tensor) -> torch.Tensor:
        with self.timed("adapt"):
            logits = self.adapt(images)
        if self.predict_from_last_forward and logits is not None:
            return logits.detach().float()
        with self.timed("predict"):
            return self.predict(images)


def _load_loss(name: str):
    from tta_bench.registry import registry

    return registry("losses").get(name)


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


def config_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
