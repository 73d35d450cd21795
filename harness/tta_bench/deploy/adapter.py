"""A standalone test-time adapter: one registered method around one zero-shot classifier.

The same ``Method`` objects the benchmark runs, outside the benchmark (docs/deploy.md)::

    adapter = Adapter.from_open_clip(model, tokenizer, classnames, method=name)
    pred = adapter(images)          # float [B, 3, S, S] in [0, 1], or PIL images / paths /
                                    # numpy [H, W, 3] arrays (``Adapter.preprocess``)
    pred.labels, pred.scores, pred.top_k(5)
    adapter.reset()                 # back to the state right after setup

``adapter(images)`` adapts exactly as the method does in a run (``step``), then returns
its predictions. Images at another size go through ``preprocess``: the harness's own
resize (bicubic, shorter side to the model's size) and centre crop, so a file predicts
the same here as in a benchmark run.

Bad input fails before the method sees it, so a refused call leaves the adapter as it
was: NaN and infinity (in tensors, arrays and float images), values outside [0, 1],
images over ``max_pixels`` (the budget ``predict`` shares, ``tta_bench.deploy``'s
``DEFAULT_MAX_PIXELS``; checked from a file's header before decoding) are ``ValueError``s
naming the value; an argument of the wrong type is an ``ArgumentError`` (a ``ValueError``
and a ``TypeError``) naming the argument.

State sharing. The frozen backbone is never copied per adapter: every adapter of one
``SharedBackbone`` (``tta_bench.deploy.backbone``) copies only the tensors its method
changes and shares the rest; ``state_bytes()`` measures what it owns.

Determinism. ``setup()`` runs under a forked, seeded global RNG (the runner's seed
``stable_seed(method, "setup", seed)``; a lock serialises setups across threads, and the
caller's RNG state is left as it was). Before each call the method is reseeded with
``stable_seed("adapter", seed, calls)``, where ``calls`` counts calls since the last
``reset()``: a fresh adapter and a reset one predict identically.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from tta_bench.bounds import check_values
from tta_bench.deploy import DEFAULT_MAX_PIXELS
from tta_bench.deploy.backbone import (  # noqa: F401 - _named_tensors: tests import it here
    ArgumentError,
    SharedBackbone,
    _named_tensors,
    check_seed,
    default_method,
    name_or_none,
)
from tta_bench.deploy.inputs import check_max_pixels, preprocess_images, tensor_batch
from tta_bench.method import config_dict
from tta_bench.model import ModelBundle, Preprocess, ZeroShotClassifier
from tta_bench.registry import registry
from tta_bench.rng import stable_seed
from tta_bench.text_head import resolve_templates

__all__ = [
    "Adapter",
    "ArgumentError",
    "Prediction",
    "SharedBackbone",
    "method_config",
    "dataset_text_head",
    "DEFAULT_TEMPLATES",
    "resolve_device",
    "default_dataset",
]

#: Templates used when none are given (CLIP's plain prompt).
DEFAULT_TEMPLATES = ("a photo of a {}.",)
#: The ``from_bundle`` arguments ``Adapter.from_settings`` reads from its settings.
_SETTINGS = ("classnames", "templates", "dataset", "method", "overrides", "device", "seed")


# -- configuration -------------------------------------------------------------------------
def method_config(
    method: str | None, overrides: Mapping[str, Any] | Sequence[str] | None = None
) -> Any:
    """The ``Config`` dataclass of registered ``method`` with ``overrides`` applied: a mapping
    (``{"lr": 1e-3, "ranks": [4, 8]}``), ``key=value`` strings (``"ranks=[4,8]"``; a
    leading ``method.`` is accepted) or a ``Config`` instance (returned as is). Unknown
    keys and values of the wrong type raise ``ValueError`` naming them and the known keys."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cls = registry("methods").get(default_method(method))
    if isinstance(overrides, cls.Config):
        check_values(overrides, "method")  # a Config instance: its types are its own
        return overrides
    known = [f.name for f in dataclasses.fields(cls.Config)]
    if overrides is None:
        items: dict[str, Any] = {}
    elif isinstance(overrides, Mapping):
        items = {str(k): v for k, v in overrides.items()}
    elif isinstance(overrides, (list, tuple)) and all(isinstance(o, str) for o in overrides):
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ValueError(f"method overrides must be key=value, got {bad}")
        dotlist = [o.removeprefix("method.") for o in overrides]
        try:
            items = OmegaConf.to_container(OmegaConf.from_dotlist(dotlist))  # type: ignore[assignment]
        except OmegaConfBaseException as exc:
            raise ValueError(f"cannot parse method overrides {list(overrides)}: {exc}") from exc
    else:
        raise ValueError(
            f"method overrides must be a mapping or a list of key=value strings, got "
            f"{type(overrides).__name__}: {overrides!r}"
        )
    items = {k.removeprefix("method."): v for k, v in items.items()}
    unknown = sorted(set(items) - set(known))
    if unknown:
        raise ValueError(
            f"unknown {method} option(s) {', '.join(map(repr, unknown))}; known: "
            f"{', '.join(known) or '(none: the method has no options)'}"
        )
    try:
        merged = OmegaConf.merge(OmegaConf.structured(cls.Config), items)
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        msg = str(exc).splitlines()[0]
        raise ValueError(f"bad {method} option: {msg} (known options: {', '.join(known)})") from exc
    check_values(config, "method")
    return config


def dataset_text_head(dataset: str) -> tuple[list[str], list[str]]:
    """``(classnames, templates)`` of a registered dataset from the catalogue (a named
    template set is resolved). Raises ``ValueError`` when the catalogue lacks either."""
    from tta_bench import catalog

    known = catalog.catalog()["datasets"]
    if dataset not in known:
        from tta_bench.registry import UnknownNameError

        raise UnknownNameError("datasets", dataset, list(known))
    meta = catalog.entry("datasets", dataset)
    classnames = meta.get("classnames")
    if not classnames or not isinstance(classnames, list):
        raise ValueError(
            f"the catalogue lists no class names for dataset {dataset!r}; give classnames "
            "(and templates) explicitly"
        )
    templates = resolve_templates(
        meta.get("templates") or list(DEFAULT_TEMPLATES), owner=f"dataset {dataset!r}"
    )
    return [str(c) for c in classnames], templates


def default_dataset(model: str) -> str | None:
    """The dataset of the first catalogue suite whose default model is ``model`` (the
    classes a model was made for, e.g. the dataset of its pretraining), or None."""
    from tta_bench import catalog

    for meta in catalog.catalog()["suites"].values():
        if meta.get("default_model") == model and meta.get("dataset"):
            return str(meta["dataset"])
    return None


def resolve_device(device: str | torch.device | None, fallback: torch.device | None = None):
    """``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda``, ``cuda:N`` or a device;
    None means ``fallback`` (the model's own device)."""
    if device is None:
        return fallback if fallback is not None else torch.device("cpu")
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available; use cpu or auto")
    return dev


def _check_classnames(classnames: Any) -> list[str]:
    """``classnames`` as a list: a non-empty sequence of non-empty strings (a string is
    not one: ``"cat,dog"`` would be 7 classes of one letter); else an ``ArgumentError``."""
    if isinstance(classnames, str):
        raise ArgumentError(
            f"classnames must be a list of class names, got the string {classnames!r}; "
            "e.g. ['cat', 'dog']"
        )
    if not isinstance(classnames, Sequence) or not classnames:
        raise ArgumentError(
            "classnames must be a non-empty list of class names (strings), got "
            f"{type(classnames).__name__} {classnames!r}"
        )
    bad = [c for c in classnames if not isinstance(c, str) or not c.strip()]
    if bad:
        raise ArgumentError(
            f"classnames must be non-empty strings; got {', '.join(map(repr, bad[:5]))}"
        )
    return list(classnames)


# -- predictions -------------------------------------------------------------------------
@dataclass
class Prediction:
    """Logits ``[B, C]`` (float32, CPU) of one call and the class names they index."""

    logits: torch.Tensor
    classnames: list[str]
    #: The method's last adaptation loss (None for parameter-free methods).
    loss: float | None = None

    @property
    def probs(self) -> torch.Tensor:
        return self.logits.softmax(dim=-1)

    @property
    def indices(self) -> torch.Tensor:
        return self.logits.argmax(dim=-1)

    @property
    def scores(self) -> torch.Tensor:
        """Softmax probability of each image's predicted class."""
        return self.probs.max(dim=-1).values

    @property
    def labels(self) -> list[str]:
        return [self.classnames[int(i)] for i in self.indices]

    def __len__(self) -> int:
        return int(self.logits.shape[0])

    def _k(self, k: Any) -> int:
        """``k`` checked (an integer >= 1; ValueError naming it otherwise) and clipped at
        the number of classes C."""
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(
                f"k must be an integer >= 1 (how many of the {self.logits.shape[1]} classes to "
                f"list per image), got {k!r}"
            )
        return min(int(k), int(self.logits.shape[1]))

    def top_k(self, k: int = 5) -> list[list[tuple[str, float]]]:
        """Per image, the ``k`` most probable classes as ``(label, prob)``, most probable
        first. ``k``: an integer >= 1 (ValueError naming it otherwise: 0, -1 and 1.5 are no
        counts); a ``k`` beyond the C classes is clipped to C (every class, ranked)."""
        k = self._k(k)
        vals, idx = self.probs.topk(k, dim=-1)
        return [
            [(self.classnames[int(i)], float(v)) for v, i in zip(vr, ir)]
            for vr, ir in zip(vals, idx)
        ]

    def records(self, k: int = 5) -> list[dict[str, Any]]:
        """JSON-ready rows: ``{label, index, score, top_k: [{label, index, score}]}``;
        ``k`` as ``top_k``'s (an integer >= 1, clipped to the C classes)."""
        k = self._k(k)
        probs = self.probs
        vals, idx = probs.topk(k, dim=-1)
        out = []
        for vr, ir in zip(vals, idx):
            top = [
                {"label": self.classnames[int(i)], "index": int(i), "score": float(v)}
                for v, i in zip(vr, ir)
            ]
            out.append(
                {
                    "label": top[0]["label"],
                    "index": top[0]["index"],
                    "score": top[0]["score"],
                    "top_k": top,
                }
            )
        return out


# -- the adapter -------------------------------------------------------------------------
class Adapter:
    """A method adapting at test time around a frozen zero-shot classifier.

    Build it with ``from_open_clip`` (your own open_clip model), ``from_bundle`` (a
    ``ModelBundle``), ``from_registry`` (a registered model) or ``from_backbone``.
    ``spawn()`` gives an independent adapter over the same shared backbone (one per user
    session in ``tta-bench serve``). Not thread-safe by itself: one call at a time per
    adapter; different adapters of one backbone may run in different threads.
    """

    def __init__(self, backbone: SharedBackbone):
        self.backbone = backbone
        self.method = backbone.instantiate()
        self.calls = 0
        self._max_pixels = DEFAULT_MAX_PIXELS

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_backbone(cls, backbone: SharedBackbone) -> Adapter:
        return cls(backbone)

    @classmethod
    def from_classifier(
        cls,
        classifier: ZeroShotClassifier,
        method: str | None = None,
        overrides: Mapping[str, Any] | Sequence[str] | None = None,
        *,
        seed: int = 0,
        source_images: torch.Tensor | None = None,
    ) -> Adapter:
        config = method_config(method, overrides)
        return cls(
            SharedBackbone(classifier, method, config, seed=seed, source_images=source_images)
        )

    @classmethod
    def from_bundle(
        cls,
        bundle: ModelBundle,
        classnames: Sequence[str] | None = None,
        templates: Sequence[str] | None = None,
        *,
        dataset: str | None = None,
        method: str | None = None,
        overrides: Mapping[str, Any] | Sequence[str] | None = None,
        device: str | torch.device | None = "auto",
        seed: int = 0,
        source_images: torch.Tensor | None = None,
    ) -> Adapter:
        """Around a model factory's bundle. ``classnames``/``templates`` default to those
        of the registered ``dataset`` in the catalogue; templates else to CLIP's plain
        prompt. ``device`` ("auto", "cpu", "cuda:0", ...): the model is moved there."""
        check_seed(seed)
        if classnames is None:
            if dataset is None:
                raise ValueError("give classnames (and templates), or a dataset name")
            classnames, ds_templates = dataset_text_head(dataset)
            templates = ds_templates if templates is None else templates
        else:
            classnames = _check_classnames(classnames)
        templates = resolve_templates(DEFAULT_TEMPLATES if templates is None else templates)
        current = next(bundle.clip.parameters()).device
        target = resolve_device(device, current)
        clf = ZeroShotClassifier(bundle, list(classnames), templates, dataset=dataset)
        clf = clf.to(target)
        return cls.from_classifier(clf, method, overrides, seed=seed, source_images=source_images)

    @classmethod
    def from_registry(
        cls,
        model: str | None = None,
        model_args: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> Adapter:
        """Around a registered model (``tta-bench ls models``; default: the catalogues'
        ``defaults: model``); ``kwargs`` as ``from_bundle`` (``method`` default: the
        catalogues' default method). The names, the method's overrides, the seed and the
        class names are checked before the model is built (an argument of the wrong type
        is an ``ArgumentError``, a ``ValueError`` and ``TypeError`` naming it)."""
        from tta_bench import catalog

        model = name_or_none(model, "model", "a registered model (tta-bench ls models)")
        model = model if model is not None else catalog.default("model")
        factory = registry("models").get(model)
        method = default_method(kwargs.get("method"))
        kwargs["overrides"] = method_config(method, kwargs.get("overrides"))
        check_seed(kwargs.get("seed", 0))
        if kwargs.get("classnames") is not None:
            kwargs["classnames"] = _check_classnames(kwargs["classnames"])
        torch_state = torch.random.get_rng_state()
        torch.manual_seed(0)  # model construction must not depend on ambient state
        try:
            bundle = factory(**dict(model_args or {}))
        except TypeError as exc:
            raise ValueError(
                f"bad arguments {dict(model_args or {})} for model {model!r}: {exc}"
            ) from exc
        finally:
            torch.random.set_rng_state(torch_state)
        return cls.from_bundle(bundle, **kwargs)

    @classmethod
    def from_settings(cls, settings: Any) -> Adapter:
        """``from_registry`` with the arguments ``settings`` holds as attributes (``model``,
        ``model_args`` and ``_SETTINGS``): a predict job, serve's parsed command line."""
        kwargs = {key: getattr(settings, key) for key in _SETTINGS}
        return cls.from_registry(settings.model, settings.model_args, **kwargs)

    @classmethod
    def from_open_clip(
        cls,
        model: nn.Module,
        tokenizer: Any,
        classnames: Sequence[str],
        templates: Sequence[str] | None = None,
        *,
        method: str | None = None,
        overrides: Mapping[str, Any] | Sequence[str] | None = None,
        device: str | torch.device | None = None,
        image_size: int | None = None,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        name: str | None = None,
        seed: int = 0,
        source_images: torch.Tensor | None = None,
    ) -> Adapter:
        """Around your own open_clip model (``open_clip.create_model_and_transforms``) and
        tokenizer (``open_clip.get_tokenizer``). Input size, mean and std default to the
        model's open_clip preprocessing config (OpenAI's mean/std where it names none, as
        open_clip does). ``device``: default the model's own; another one moves it."""
        cfg: dict[str, Any] = {}
        try:
            import open_clip

            cfg = dict(open_clip.get_model_preprocess_cfg(model))
            default_mean, default_std = open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD
        except ImportError:  # a CLIP-like model without open_clip installed
            default_mean = (0.48145466, 0.4578275, 0.40821073)
            default_std = (0.26862954, 0.26130258, 0.27577711)
        size = image_size or cfg.get("size") or getattr(model.visual, "image_size", None)
        if isinstance(size, (tuple, list)):
            if len(set(size)) != 1:
                raise ValueError(f"non-square input size {tuple(size)} is not supported")
            size = size[0]
        if not size:
            raise ValueError("cannot tell the model's input size; pass image_size=")
        preprocess = Preprocess(
            image_size=int(size),
            mean=tuple(float(v) for v in (mean or cfg.get("mean") or default_mean)),
            std=tuple(float(v) for v in (std or cfg.get("std") or default_std)),
        )
        bundle = ModelBundle(
            clip=model,
            tokenizer=tokenizer,
            preprocess=preprocess,
            name=name or f"open_clip:{type(model).__name__}",
            weights="user-supplied",
        )
        return cls.from_bundle(
            bundle,
            classnames,
            templates,
            method=method,
            overrides=overrides,
            device=device,
            seed=seed,
            source_images=source_images,
        )

    def spawn(self) -> Adapter:
        """A fresh, independent adapter over the same shared frozen backbone (with this
        one's ``max_pixels``)."""
        other = Adapter(self.backbone)
        other.max_pixels = self.max_pixels
        return other

    # -- properties ------------------------------------------------------------------------
    @property
    def model(self) -> ZeroShotClassifier:
        """The shared frozen classifier (never changed by adaptation)."""
        return self.backbone.model

    @property
    def method_name(self) -> str:
        return self.backbone.method_name

    @property
    def config(self) -> Any:
        return self.backbone.config

    @property
    def config_dict(self) -> dict[str, Any]:
        return config_dict(self.backbone.config)

    @property
    def classnames(self) -> list[str]:
        return list(self.model.classnames)

    @property
    def image_size(self) -> int:
        return int(self.model.preprocess.image_size)

    @property
    def device(self) -> torch.device:
        return self.backbone.device

    def state_bytes(self) -> int:
        """Bytes of tensors this adapter owns (not shared with the backbone) right now."""
        return self.backbone.owned_bytes(self.method)

    @property
    def max_pixels(self) -> int:
        """The per-image pixel budget of ``preprocess`` (default ``DEFAULT_MAX_PIXELS`` of
        ``tta_bench.deploy``, the one ``predict``'s ``max_pixels`` defaults to): an image
        with more pixels, or whose resize to the model's size would make more, is an
        ``ImageTooLargeError``, checked from a file's header before any pixel is decoded.
        Set it to an integer >= 1 (ValueError naming the value otherwise)."""
        return self._max_pixels

    @max_pixels.setter
    def max_pixels(self, value: int) -> None:
        self._max_pixels = check_max_pixels(value)

    # -- use -------------------------------------------------------------------------------
    def preprocess(self, images: Any, *, max_pixels: int | None = None) -> torch.Tensor:
        """Images -> float ``[B, 3, S, S]`` in [0, 1] on the adapter's device, decoded as
        the harness decodes (``tta_bench.run.images.decode_rgb``: 8-bit upright RGB from any
        mode PIL reads), then a bicubic resize of the shorter side to the model's size S and
        a centre crop.

        ``images``: one image or a list of them, each a path (``str`` or ``Path``), an
        encoded file's ``bytes``, a PIL image, or a numpy array ``[H, W, 3]`` (or gray
        ``[H, W]``), uint8 or float on the 0..1 scale (rounded to 8 bits, as float image
        files are: ``round(v * 255)``); a numpy array ``[B, H, W, 3]`` is a batch of them.
        Anything else, ``None`` in a list included, is an ``ArgumentError`` naming it (e.g.
        ``images[1] is None``); a float array with NaN, infinite or out-of-range values, or
        an array of another dtype or shape, a ``ValueError`` naming it. Float tensors
        ``[B, 3, S, S]`` go to ``adapter(images)`` as they are, not through here.

        ``max_pixels``: the per-image pixel budget for this call (default
        ``self.max_pixels``): over it, or resized past it (a 1 x 4,000,000 image at S = 224
        would resize to 224 x 896,000,000), an image is refused (``ImageTooLargeError``),
        from a file's header before it is decoded. A file that cannot be decoded raises
        ``tta_bench.run.images.ImageDecodeError`` naming it."""
        budget = self.max_pixels if max_pixels is None else check_max_pixels(max_pixels)
        return preprocess_images(images, self.image_size, self.device, budget, "Adapter.max_pixels")

    def _as_batch(self, images: Any) -> torch.Tensor:
        if not isinstance(images, torch.Tensor):
            return self.preprocess(images)
        return tensor_batch(images, self.image_size).to(self.device, torch.float32)

    def step(self, images: Any, *, seed: int | None = None) -> torch.Tensor:
        """Adapt (as the method does) and return the logits ``[B, C]`` (float32, CPU).

        ``images``: float ``[B, 3, S, S]`` (or one ``[3, S, S]``) in [0, 1], or what
        ``preprocess`` takes; bad input is refused before the method sees it (NaN and
        infinity too), so a refused call changes nothing. ``seed``: the method's seed for
        this call (an integer; default: derived from the adapter's seed and the number of
        calls since the last reset)."""
        if seed is not None:
            seed = check_seed(seed)
        x = self._as_batch(images)
        if seed is None:
            seed = stable_seed("adapter", self.backbone.seed, self.calls) % 2**63
        self.calls += 1
        self.method.reseed(int(seed))
        return self.method.step(x).detach().float().cpu()

    def __call__(self, images: Any, *, seed: int | None = None) -> Prediction:
        logits = self.step(images, seed=seed)
        loss = self.method.last_loss if self.method.adapts else None
        return Prediction(logits, self.classnames, None if loss is None else float(loss))

    def reset(self) -> None:
        """Back to exactly the state right after setup (and the call counter to 0)."""
        self.method.reset()
        self.calls = 0
