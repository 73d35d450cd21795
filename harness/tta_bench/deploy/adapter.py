"""A standalone test-time adapter: one registered method around one zero-shot classifier.

The same ``Method`` objects the benchmark runs, outside the benchmark (docs/deploy.md)::

    adapter = Adapter.from_open_clip(model, tokenizer, classnames, method=name)
    pred = adapter(images)          # float [B, 3, S, S] in [0, 1], or PIL images / paths
    pred.labels, pred.scores, pred.top_k(5)
    adapter.reset()                 # back to the state right after setup

``adapter(images)`` adapts exactly as the method does in a run (``step``), then returns
its predictions. Images at another size go through ``preprocess``: the harness's own
resize (bicubic, shorter side to the model's size) and centre crop, so a file predicts
the same here as in a benchmark run.

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
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tta_bench.bounds import check_values
from tta_bench.deploy.backbone import (  # noqa: F401 - _named_tensors: tests import it here
    SharedBackbone,
    _named_tensors,
    default_method,
)
from tta_bench.method import config_dict
from tta_bench.model import ModelBundle, Preprocess, ZeroShotClassifier
from tta_bench.registry import registry
from tta_bench.rng import stable_seed
from tta_bench.text_head import resolve_templates

__all__ = [
    "Adapter",
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

    def top_k(self, k: int = 5) -> list[list[tuple[str, float]]]:
        """Per image, the ``k`` most probable classes (at most C) as ``(label, prob)``."""
        k = max(1, min(int(k), self.logits.shape[1]))
        vals, idx = self.probs.topk(k, dim=-1)
        return [
            [(self.classnames[int(i)], float(v)) for v, i in zip(vr, ir)]
            for vr, ir in zip(vals, idx)
        ]

    def records(self, k: int = 5) -> list[dict[str, Any]]:
        """JSON-ready rows: ``{label, index, score, top_k: [{label, index, score}]}``."""
        k = max(1, min(int(k), self.logits.shape[1]))
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
        if classnames is None:
            if dataset is None:
                raise ValueError("give classnames (and templates), or a dataset name")
            classnames, ds_templates = dataset_text_head(dataset)
            templates = ds_templates if templates is None else templates
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
        catalogues' default method). The method and its overrides are checked before the
        model is built."""
        from tta_bench import catalog

        model = model if model is not None else catalog.default("model")
        factory = registry("models").get(model)
        method = default_method(kwargs.get("method"))
        kwargs["overrides"] = method_config(method, kwargs.get("overrides"))
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
        """A fresh, independent adapter over the same shared frozen backbone."""
        return Adapter(self.backbone)

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

    # -- use -------------------------------------------------------------------------------
    def preprocess(self, images: Any) -> torch.Tensor:
        """PIL images, uint8 ``[H, W, 3]`` arrays or image file paths (one or a sequence)
        -> float ``[B, 3, S, S]`` in [0, 1] on the adapter's device, as the harness decodes:
        8-bit upright RGB by ``tta_bench.run.images.decode_rgb`` (any mode PIL reads), then a
        bicubic resize of the shorter side to the model's size S and a centre crop. A file
        that cannot be decoded raises ``tta_bench.run.images.ImageDecodeError`` naming it."""
        from PIL import Image

        from tta_bench.run.cache import to_rgb_array
        from tta_bench.run.images import decode_rgb

        if isinstance(images, (Image.Image, np.ndarray, str, Path)):
            images = [images]
        arrays = []
        for img in images:
            if isinstance(img, (str, Path)):
                img = decode_rgb(img)
            arrays.append(to_rgb_array(img, self.image_size))
        if not arrays:
            raise ValueError("no images to preprocess")
        batch = torch.from_numpy(np.stack(arrays)).to(self.device)
        return batch.permute(0, 3, 1, 2).float().div_(255.0).contiguous()

    def _as_batch(self, images: Any) -> torch.Tensor:
        if not isinstance(images, torch.Tensor):
            return self.preprocess(images)
        x = images.unsqueeze(0) if images.dim() == 3 else images
        size = self.image_size
        if x.dim() != 4 or x.shape[1] != 3 or tuple(x.shape[-2:]) != (size, size):
            raise ValueError(
                f"expected float images [B, 3, {size}, {size}] in [0, 1], got shape "
                f"{tuple(images.shape)}; Adapter.preprocess(...) resizes PIL images or paths"
            )
        if not x.is_floating_point():
            raise ValueError(
                f"expected float images in [0, 1], got dtype {x.dtype}; divide uint8 by 255"
            )
        if x.numel() and (float(x.min()) < 0.0 or float(x.max()) > 1.0):
            raise ValueError(
                f"expected images in [0, 1] (the classifier normalises them itself), got values "
                f"in [{float(x.min()):.3g}, {float(x.max()):.3g}]"
            )
        return x.to(self.device, torch.float32)

    def step(self, images: Any, *, seed: int | None = None) -> torch.Tensor:
        """Adapt (as the method does) and return the logits ``[B, C]`` (float32, CPU).

        ``seed``: the method's seed for this call (default: derived from the adapter's seed
        and the number of calls since the last reset)."""
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
