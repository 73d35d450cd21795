"""Plugin registries: entry points are the only way installed components are discovered;
local files named with ``--include`` (``tta_bench.include``) join them through the same
checks, and ``Registry.add`` registers an object in-process.

One typed, lazy ``Registry`` per entry-point group. Listing reads entry-point metadata and
the catalogues (``registry.yaml`` files) only, so ``tta-bench ls`` never imports torch.
Loading a component imports it and validates its shape (pluggy-style: at load, not at
call). Duplicate names are an error naming both origins; unknown names answer with
"did you mean ...? available: ...".
"""

from __future__ import annotations

import difflib
import importlib.metadata as md
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")

GROUP_PREFIX = "tta_bench."
KINDS = ("methods", "losses", "shifts", "datasets", "models", "configs", "metrics")
SINGULAR = {
    "methods": "method",
    "losses": "loss",
    "shifts": "shift",
    "datasets": "dataset",
    "models": "model",
    "configs": "config",
    "metrics": "metric",
    "suites": "suite",
}
#: Set to 1 to ignore every installed plugin (only explicitly added ones remain); tests use it.
DISABLE_ENV = "TTA_BENCH_DISABLE_PLUGIN_AUTOLOAD"
#: Comma-separated distribution names: load components of these distributions only (e.g.
#: ``TTA_BENCH_PLUGINS=tta-bench,my-plugin``); unset: every installed one.
ALLOW_ENV = "TTA_BENCH_PLUGINS"


def distribution_allowed(name: str) -> bool:
    """Whether components of distribution ``name`` are loaded (``TTA_BENCH_PLUGINS``)."""
    allowed = os.environ.get(ALLOW_ENV)
    if not allowed:
        return True
    return name in {a.strip() for a in allowed.split(",") if a.strip()}


class RegistryError(LookupError):
    """A component name that is unknown, duplicated, or fails validation."""


class UnknownNameError(RegistryError, ValueError):
    """An unknown name: a ``LookupError`` for the registries, and a ``ValueError`` as every
    bad input to the Python API is."""

    def __init__(self, kind: str, name: str, available: list[str]):
        self.kind, self.name, self.available = kind, name, available
        close = difflib.get_close_matches(name, available, n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        singular = SINGULAR.get(kind, kind)
        super().__init__(
            f"unknown {singular} {name!r}.{hint} Available: {', '.join(sorted(available))}"
        )


@dataclass(frozen=True)
class Origin:
    """Where a registered component comes from: recorded in every result."""

    group: str
    name: str
    value: str
    distribution: str
    version: str

    def as_dict(self) -> dict[str, str]:
        return {
            "group": self.group,
            "name": self.name,
            "object": self.value,
            "distribution": self.distribution,
            "version": self.version,
        }


def _entry_points(group: str) -> list[md.EntryPoint]:
    if os.environ.get(DISABLE_ENV) == "1":
        return []
    return list(md.entry_points(group=group))


def _origin(group: str, ep: md.EntryPoint, seen: dict[int, tuple[str, str]]) -> Origin:
    """``ep``'s origin; ``seen`` holds the (name, version) of each distribution object met
    in this scan: reading them parses the distribution's metadata file again at each
    access, and one distribution declares many entry points."""
    dist = getattr(ep, "dist", None)
    if dist is None:
        label = ("unknown", "unknown")
    elif id(dist) in seen:
        label = seen[id(dist)]
    else:
        label = seen[id(dist)] = (dist.metadata["Name"], dist.version)
    return Origin(
        group=group, name=ep.name, value=ep.value, distribution=label[0], version=label[1]
    )


class Registry(Generic[T]):
    """The components of one entry-point group, by canonical name.

    ``validate`` is called on the loaded object and returns an error message or None.
    """

    def __init__(self, kind: str, validate: Callable[[Any], str | None] | None = None):
        if kind not in KINDS:
            raise ValueError(f"unknown registry kind {kind!r}; expected one of {KINDS}")
        self.kind = kind
        self.group = GROUP_PREFIX + kind
        self._validate = validate
        self._entries: dict[str, tuple[Origin, Callable[[], Any]]] | None = None
        self._loaded: dict[str, T] = {}

    # -- discovery (metadata only) -------------------------------------------------------
    def _scan(self) -> dict[str, tuple[Origin, Callable[[], Any]]]:
        if self._entries is None:
            from tta_bench import include  # --include: local files; imports no harness module

            found: list[tuple[Origin, Callable[[], Any]]] = []
            eps = _entry_points(self.group)  # holds each distribution object while scanning
            seen: dict[int, tuple[str, str]] = {}
            for ep in eps:
                origin = _origin(self.group, ep, seen)
                if distribution_allowed(origin.distribution):
                    found.append((origin, ep.load))
            try:  # included files are explicit: never filtered out
                local = include.declared(self.kind)
            except include.IncludeError as exc:
                raise RegistryError(str(exc)) from None
            for d in local:
                origin = Origin(self.group, d.name, d.value, d.distribution, d.version)
                found.append((origin, d.load))
            entries: dict[str, tuple[Origin, Callable[[], Any]]] = {}
            for origin, load in found:
                if origin.name in entries:
                    first = entries[origin.name][0]
                    # The same distribution seen twice on sys.path (e.g. an editable install
                    # plus a build dir) pointing at the same object is not a conflict.
                    if (first.distribution, first.value) == (origin.distribution, origin.value):
                        continue
                    raise RegistryError(
                        f"duplicate {SINGULAR[self.kind]} name {origin.name!r} in group "
                        f"{self.group}: {first.value} (from {first.distribution} "
                        f"{first.version}) and {origin.value} (from {origin.distribution} "
                        f"{origin.version})"
                    )
                entries[origin.name] = (origin, load)
            self._entries = entries
        return self._entries

    def names(self) -> list[str]:
        return sorted(self._scan())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._scan()

    def origin(self, name: str) -> Origin:
        return self._lookup(name)[0]

    def _lookup(self, name: str) -> tuple[Origin, Callable[[], Any]]:
        entries = self._scan()
        if name not in entries:
            raise UnknownNameError(self.kind, name, list(entries))
        return entries[name]

    # -- loading -------------------------------------------------------------------------
    def get(self, name: str) -> T:
        if name not in self._loaded:
            origin, load = self._lookup(name)
            try:
                obj = load()
            except Exception as exc:  # a broken plugin should say which one broke
                raise RegistryError(
                    f"{SINGULAR[self.kind]} {name!r} ({origin.value} from {origin.distribution}) "
                    f"failed to import: {type(exc).__name__}: {exc}"
                ) from exc
            if self._validate is not None:
                problem = self._validate(obj)
                if problem:
                    raise RegistryError(
                        f"{SINGULAR[self.kind]} {name!r} ({origin.value} from "
                        f"{origin.distribution}) is invalid: {problem}"
                    )
            self._loaded[name] = obj
        return self._loaded[name]

    def add(self, name: str, obj: T, distribution: str = "__local__", version: str = "0") -> None:
        """Register an object directly, in this process only (in-process plugins, tests,
        the harness's own ``clean`` shift): validated like an entry point, a name already
        registered is an error naming both origins; ``distribution`` and ``version`` are
        what results record as its origin. Forgotten by ``reset_registries``."""
        entries = self._scan()
        if name in entries:
            first = entries[name][0]
            raise RegistryError(
                f"duplicate {SINGULAR[self.kind]} name {name!r}: {first.value} (from "
                f"{first.distribution}) and an object added by {distribution}"
            )
        if self._validate is not None and (problem := self._validate(obj)):
            raise RegistryError(f"{SINGULAR[self.kind]} {name!r} is invalid: {problem}")
        value = f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', repr(obj))}"
        origin = Origin(self.group, name, value, distribution, version)
        entries[name] = (origin, lambda: obj)


# -- validators (shape checks at load time) ---------------------------------------------
def _validate_method(obj: Any) -> str | None:
    # The base class is recognised by name in the MRO: importing tta_bench.method here
    # would make registry and method import each other (method resolves losses here).
    is_method = inspect.isclass(obj) and any(
        (c.__module__, c.__qualname__) == ("tta_bench.method", "Method") for c in obj.__mro__
    )
    if not is_method:
        return f"expected a subclass of tta_bench.method.Method, got {obj!r}"
    import dataclasses

    if not dataclasses.is_dataclass(getattr(obj, "Config", None)):
        return "a Method must define a dataclass `Config` with its hyperparameters"
    return None


def _validate_callable_with(*required: str, keyword_only: tuple[str, ...] = ()):
    def check(obj: Any) -> str | None:
        if not callable(obj):
            return f"expected a callable, got {obj!r}"
        try:
            params = inspect.signature(obj).parameters
        except (TypeError, ValueError):
            return None
        positional = [
            p.name
            for p in params.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        if len(positional) < len(required):
            return f"expected parameters ({', '.join(required)}, ...), got {list(params)}"
        for kw in keyword_only:
            if kw not in params and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
                return f"expected a keyword-only parameter {kw!r}, got {list(params)}"
        return None

    return check


def _validate_keyword_only_factory(obj: Any) -> str | None:
    if not callable(obj):
        return f"expected a callable, got {obj!r}"
    params = inspect.signature(obj).parameters.values()
    bad = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if bad:
        return f"a factory takes keyword-only arguments; positional parameters: {bad}"
    return None


def _validate_config_package(obj: Any) -> str | None:
    if not inspect.ismodule(obj):
        return f"expected a package holding Hydra configs, got {obj!r}"
    return None


_VALIDATORS: dict[str, Callable[[Any], str | None]] = {
    "methods": _validate_method,
    "losses": _validate_callable_with("logits"),
    "shifts": _validate_callable_with("images", "severity", keyword_only=("generator",)),
    "datasets": _validate_keyword_only_factory,
    "models": _validate_keyword_only_factory,
    "configs": _validate_config_package,
    "metrics": _validate_callable_with("logits", "labels"),
}

_REGISTRIES: dict[str, Registry[Any]] = {}


#: ``tta_bench.include.state()`` when the registries were last scanned.
_INCLUDE_STATE = [""]


def registry(kind: str) -> Registry[Any]:
    """The process-wide registry of one kind (``methods``, ``losses``, ``shifts``, ...);
    every registry is rescanned when the included files (``--include``) change."""
    from tta_bench.include import state

    if state() != _INCLUDE_STATE[0]:
        _INCLUDE_STATE[0] = state()
        reset_registries()
    if kind not in _REGISTRIES:
        if kind not in KINDS:
            raise UnknownNameError("registry kinds", kind, list(KINDS))
        _REGISTRIES[kind] = Registry(kind, _VALIDATORS[kind])
    return _REGISTRIES[kind]


#: Called by ``reset_registries`` (the catalogue registers its own reset here, so that this
#: module never imports it).
RESET_HOOKS: list[Callable[[], None]] = []


def reset_registries() -> None:
    """Forget every scanned and loaded component and the merged catalogue (tests that
    change sys.path use it)."""
    _REGISTRIES.clear()
    for hook in RESET_HOOKS:
        hook()


def provenance(kind: str, name: str) -> dict[str, str]:
    return registry(kind).origin(name).as_dict()
