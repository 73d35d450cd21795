"""The job config of ``tta-bench predict`` (``PredictJob``, read by ``load_job``): every key
declared once, as a field with its JSON type, default, help and range (``bounded``) or
choices (``one_of``). A job file is checked from that declaration: unknown keys, then each
value's JSON type, then ranges and choices (``tta_bench.bounds.check_values``, as every
config value is), then the method's config, all before anything is built."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tta_bench.bounds import bounded, check_values, one_of
from tta_bench.deploy import DEFAULT_MAX_PIXELS  # the budget the Adapter applies too
from tta_bench.text_head import resolve_templates

__all__ = [
    "PredictJob",
    "load_job",
    "LAYOUTS",
    "RESETS",
    "ON_BAD_IMAGE",
    "DEFAULT_MAX_PIXELS",
    "PREFIX",
]

LAYOUTS = ("auto", "folder", "subfolders", "classes")
RESETS = ("per_batch", "per_folder", "never")
ON_BAD_IMAGE = ("skip", "fail_batch")
#: The key prefix of a job value in an out-of-range message (``predict.top_k=0 is ...``).
PREFIX = "predict"

_TYPE_NAMES = {
    str: "a string",
    int: "an integer",
    bool: "true or false",
    dict: "an object",
    list: "a list",
    type(None): "null",
}


def _key(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    default_factory: Any = dataclasses.MISSING,
    choices: tuple[str, ...] | None = None,
    **bounds: float,
) -> Any:
    """A job key's field: its default (neither ``default`` nor ``default_factory``: the key
    is required), what it is (``help``), and its ``choices`` (``one_of``) or range
    (``bounded``: ``ge=``, ``gt=``, ...)."""
    if choices is not None:
        declared = one_of(default, choices)
    elif bounds:
        declared = bounded(default, **bounds)
    else:
        declared = dataclasses.field()
    return dataclasses.field(
        default=default,
        default_factory=default_factory,
        metadata={**declared.metadata, "help": help},
    )


@dataclass
class PredictJob:
    """A validated job config (see ``tta_bench.deploy.predict``; ``load_job`` reads one).
    Each field's annotation is the JSON type its key takes."""

    input_dir: str = _key(help="a folder of images")
    output_dir: str = _key(help="where results, logs and the summary go")
    # None: the catalogues' default method (set by the checks)
    method: str | None = _key(None, "a registered method (default: the catalogues')")
    overrides: dict[str, Any] | list[str] = _key(
        help="method config overrides, {key: value} or ['key=value']", default_factory=dict
    )
    # None: the catalogues' default model (set by the checks)
    model: str | None = _key(None, "a registered model (default: the catalogues')")
    model_args: dict[str, Any] = _key(
        help="the model factory's arguments, e.g. {arch, pretrained}", default_factory=dict
    )
    dataset: str | None = _key(None, "a registered dataset whose class names to use")
    classnames: list[str] | None = _key(None, "class names (else the dataset's)")
    templates: list[str] | None = _key(None, "prompt templates with one '{}'")
    batch_size: int = _key(64, "images per batch", ge=1)
    device: str = _key("auto", "auto, cpu, cuda or cuda:N")
    max_retry: int = _key(1, "retries of a failing batch", ge=0)
    reset: str = _key("per_batch", f"one of {', '.join(RESETS)}", choices=RESETS)
    on_bad_image: str = _key("skip", f"one of {', '.join(ON_BAD_IMAGE)}", choices=ON_BAD_IMAGE)
    max_pixels: int = _key(DEFAULT_MAX_PIXELS, "pixels per image, checked before decoding", ge=1)
    layout: str = _key("auto", f"one of {', '.join(LAYOUTS)}", choices=LAYOUTS)
    top_k: int = _key(5, "classes listed per image", ge=1)
    seed: int = _key(0, "the method's seed (setup and per-batch randomness)")
    shuffle: bool = _key(False, "shuffle the images (by seed) before batching")
    resume: bool = _key(True, "skip batches finished by an earlier run of the same job")
    progress: bool = _key(True, "show a progress bar")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], base_dir: str | Path | None = None) -> PredictJob:
        """Validate ``data`` (unknown keys, types, ranges and choices, the method's config);
        relative paths are taken relative to ``base_dir`` (the job file's folder)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a predict job is a JSON object, got {type(data).__name__}")
        keys = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(keys))
        if unknown:
            raise ValueError(
                f"unknown predict job key(s) {', '.join(map(repr, unknown))}; known keys: "
                f"{', '.join(keys)}"
            )
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            what = f.metadata["help"]
            if f.name in data:
                _check_type(f.name, data[f.name], _json_types(hints[f.name]), what)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"predict job key {f.name!r} ({what}) is required")
        job = cls(**data)
        job._check(base_dir)
        return job

    def _check(self, base_dir: str | Path | None) -> None:
        from tta_bench import catalog

        for key in ("method", "model"):  # None: the default the installed plugins name
            if getattr(self, key) is None:
                try:
                    setattr(self, key, catalog.default(key))
                except catalog.NoDefaultError as exc:
                    raise ValueError(f"predict job key {key!r}: {exc}") from None
        check_values(self, PREFIX)  # the declared ranges and choices
        for key in ("classnames", "templates"):
            value = getattr(self, key)
            if value is not None and (not value or not all(isinstance(v, str) for v in value)):
                raise ValueError(f"predict job key {key!r} must be a non-empty list of strings")
        if self.templates is not None:
            resolve_templates(self.templates, owner="predict job key 'templates'")
        from tta_bench.deploy.adapter import default_dataset, method_config

        if self.classnames is None and self.dataset is None:
            self.dataset = default_dataset(self.model)  # the classes the model was made for
            if self.dataset is None:
                raise ValueError(
                    "a predict job needs the class names: give 'classnames' (and 'templates'), "
                    f"or 'dataset' (a registered dataset); model {self.model!r} has no default"
                )
        if base_dir is not None:
            base = Path(base_dir)
            self.input_dir = str(base / Path(self.input_dir).expanduser())
            self.output_dir = str(base / Path(self.output_dir).expanduser())
        if not Path(self.input_dir).is_dir():
            raise ValueError(f"input_dir {self.input_dir!r} is not a folder")
        # the method's options and their ranges, as every path checks them (before a model)
        method_config(self.method, self.overrides)


def _json_types(annotation: Any) -> tuple[type, ...]:
    """The JSON types a field's annotation admits: ``str | None`` -> ``(str, NoneType)``,
    ``dict[str, Any] | list[str]`` -> ``(dict, list)``."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    members = typing.get_args(annotation) if union else (annotation,)
    return tuple(typing.get_origin(m) or m for m in members)


def _check_type(key: str, value: Any, accepted: tuple[type, ...], what: str) -> None:
    """ValueError naming ``key`` unless ``value`` is of an ``accepted`` JSON type (true and
    false are no integers)."""
    ok = isinstance(value, accepted) and not (
        isinstance(value, bool) and bool not in accepted and int in accepted
    )
    if not ok:
        expected = " or ".join(_TYPE_NAMES[t] for t in accepted)
        raise ValueError(
            f"predict job key {key!r} must be {expected} ({what}), got {value!r} "
            f"({type(value).__name__})"
        )


def load_job(path: str | Path) -> PredictJob:
    """Read and validate a job file; relative paths in it are relative to its folder."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ValueError(f"job file {str(path)!r} does not exist") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"job file {str(path)!r} is not valid JSON: {exc}") from exc
    return PredictJob.from_dict(data, base_dir=path.parent)
