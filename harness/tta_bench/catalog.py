"""The catalogue: metadata that is not code (descriptions, hub ids, class names, templates,
paper links, default hyperparameters, named suites).

Each plugin distribution ships a ``registry.yaml`` and points at it through the
``tta_bench.catalogs`` entry-point group (the object is the file's path). Reading the
catalogue imports no torch.
"""

from __future__ import annotations

import importlib.metadata as md
import os
from pathlib import Path
from typing import Any

import yaml

from tta_bench.registry import (
    DISABLE_ENV,
    KINDS,
    RESET_HOOKS,
    RegistryError,
    UnknownNameError,
    distribution_allowed,
)

CATALOG_GROUP = "tta_bench.catalogs"
#: The harness's own catalogue (its metrics), registered through the same entry point group.
HARNESS_CATALOG = str(Path(__file__).with_name("registry.yaml"))
#: ``published``: figures a paper or an official repository reports (a source, the model,
#: ``accuracy: {method: {dataset: percent}}``), the targets ``benchmarks/gpu_check.py``
#: prints our runs beside. ``profiles``: the ways other benchmarks run methods, as data
#: (``tta_bench.run.profiles``: a run's ``profile=NAME``).
SECTIONS = (*KINDS, "suites", "templates", "defaults", "published", "profiles")

_CATALOG: dict[str, dict[str, Any]] | None = None
#: ``tta_bench.include.state()`` the merged catalogue was read under.
_INCLUDE_STATE = [""]
_EXTRA: list[dict[str, Any]] = []


#: libyaml's safe loader where PyYAML was built with it: the plugin's catalogue, which
#: every process that resolves anything reads, parses faster (docs/speed.md;
#: benchmarks/read_costs.py); both loaders build the same data from it
#: (tests/test_plugin_registry.py).
SAFE_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _load_file(path: Path, origin: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        data = yaml.load(fh, Loader=SAFE_LOADER) or {}
    return _check_sections(data, path, origin)


def _check_sections(data: dict[str, Any], path: Path, origin: str) -> dict[str, Any]:
    unknown = set(data) - set(SECTIONS) - {"schema_version"}
    if unknown:
        raise RegistryError(
            f"catalogue {path} ({origin}) has unknown sections {sorted(unknown)}; "
            f"expected {list(SECTIONS)}"
        )
    return data


def catalog() -> dict[str, dict[str, Any]]:
    """All catalogues merged: ``{section: {name: metadata}}``: the installed distributions',
    then the included YAML files (``--include``, ``tta_bench.include``), then in-process ones
    (``add_catalog``); one entry in two of them is an error naming both origins."""
    global _CATALOG
    from tta_bench import include  # --include: local YAML catalogues; imports no harness module

    if include.state() != _INCLUDE_STATE[0]:
        _INCLUDE_STATE[0], _CATALOG = include.state(), None
    if _CATALOG is None:
        merged: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
        owner: dict[tuple[str, str], str] = {}
        sources: list[tuple[str, dict[str, Any]]] = []
        if os.environ.get(DISABLE_ENV) != "1":
            for ep in md.entry_points(group=CATALOG_GROUP):
                dist = ep.dist.metadata["Name"] if ep.dist is not None else ep.name
                if distribution_allowed(dist):
                    sources.append((dist, _load_file(Path(ep.load()), dist)))
        try:
            local = include.catalogues()
        except include.IncludeError as exc:
            raise RegistryError(str(exc)) from None
        for f, data in local:
            sources.append((f.distribution, _check_sections(data, f.path, f.distribution)))
        sources.extend(("__local__", extra) for extra in _EXTRA)
        for dist, data in sources:
            for section in SECTIONS:
                for name, meta in (data.get(section) or {}).items():
                    if (section, name) in owner and owner[(section, name)] != dist:
                        raise RegistryError(
                            f"duplicate {section} entry {name!r} in the catalogues of "
                            f"{owner[(section, name)]} and {dist}"
                        )
                    owner[(section, name)] = dist
                    merged[section][name] = meta if meta is not None else {}
        _CATALOG = merged
    return _CATALOG


def entry(section: str, name: str) -> dict[str, Any]:
    """Metadata of one component or suite; empty if the catalogue does not describe it."""
    return dict(catalog()[section].get(name) or {})


def suite(name: str) -> dict[str, Any]:
    """The catalogue's suite ``name`` (its fields as the catalogue lists them); an unknown
    name is an ``UnknownNameError`` ("did you mean ...; available: ...")."""
    suites = catalog()["suites"]
    if name not in suites:
        raise UnknownNameError("suites", name, list(suites))
    return dict(suites[name])


def dataset_flag(dataset: str | None, flag: str) -> bool:
    """Whether the catalogue entry of ``dataset`` says ``<flag>: true`` (a dataset family:
    ``fine_grained``, ``imagenet_family``); an unknown name or None: no."""
    return bool(dataset) and bool(entry("datasets", str(dataset)).get(flag, False))


def fine_grained(dataset: str | None) -> bool:
    """``dataset_flag(dataset, "fine_grained")``: the sets on which several official codes
    turn AugMix views on (the ten cross-domain sets)."""
    return dataset_flag(dataset, "fine_grained")


#: The choices a catalogue's ``defaults:`` section makes: what ``tta-bench run`` uses when
#: no ``--suite`` / ``--method`` / ``--model`` is given (a suite's own ``default_model``
#: comes first), and ``reference``, the method a run is paired with in tables (its cells'
#: own ``reference_accuracy`` when its results are not among the files).
DEFAULT_KEYS = ("suite", "method", "model", "reference")


class NoDefaultError(LookupError):
    """No installed catalogue names a default for a choice."""


def default(name: str) -> str:
    """The catalogues' default ``name`` (one of ``DEFAULT_KEYS``); ``NoDefaultError`` when
    none names it (the harness alone names no component: plugins do)."""
    if name not in DEFAULT_KEYS:
        raise KeyError(f"unknown default {name!r}; known: {', '.join(DEFAULT_KEYS)}")
    value = catalog()["defaults"].get(name)
    if not value:
        raise NoDefaultError(
            f"no installed catalogue names a default {name} (`defaults: {{{name}: ...}}` in a "
            f"plugin's registry.yaml); give the {name} explicitly"
        )
    return str(value)


def default_or_none(name: str) -> str | None:
    """``default(name)``, or None when no catalogue names one."""
    try:
        return default(name)
    except NoDefaultError:
        return None


def description(section: str, name: str) -> str:
    return str(entry(section, name).get("description", "")).strip()


def add_catalog(data: dict[str, Any]) -> None:
    """Add an in-process catalogue (tests, notebooks)."""
    _EXTRA.append(data)
    reset_catalog()


def reset_catalog() -> None:
    global _CATALOG
    _CATALOG = None


RESET_HOOKS.append(reset_catalog)
