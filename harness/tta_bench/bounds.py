"""Declared bounds of config values: one mechanism for every method, protocol and loader
config. A dataclass field declares its range with ``bounded(default, ge=..., gt=..., le=...,
lt=...)``, or its options with ``one_of(default, choices)`` (kept in the field's metadata,
which Hydra and OmegaConf ignore); ``check_values`` refuses a value outside them, and any
number that is not finite, naming the key, the value and the range, before anything is
built. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["Bounds", "bounded", "check_values", "field_bounds", "one_of"]


@dataclass(frozen=True)
class Bounds:
    """An interval: ``ge``/``gt`` below, ``le``/``lt`` above (None: open)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def holds(self, value: float) -> bool:
        return not (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
            or (self.lt is not None and value >= self.lt)
        )

    def __str__(self) -> str:
        low = _first_set((">=", self.ge), (">", self.gt))
        high = _first_set(("<=", self.le), ("<", self.lt))
        return " and ".join(p for p in (low, high) if p) or "finite"


def _first_set(*limits: tuple[str, float | None]) -> str:
    """``"OP VALUE"`` of the first ``(OP, VALUE)`` whose value is set, else ``""``."""
    return next((f"{op} {value:g}" for op, value in limits if value is not None), "")


def bounded(
    default: Any = dataclasses.MISSING,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field with ``default`` (or ``default_factory``) whose value (each
    element, for a list) must lie in the declared interval."""
    return dataclasses.field(
        default=default,
        default_factory=default_factory,
        metadata={"bounds": Bounds(ge, gt, le, lt)},
    )


def one_of(default: str, choices: tuple[str, ...]) -> Any:
    """A dataclass field with ``default`` whose value must be one of ``choices``."""
    return dataclasses.field(default=default, metadata={"choices": tuple(choices)})


def _declared(config_cls: type, name: str, what: str) -> Any:
    for cls in config_cls.__mro__:
        fields = cls.__dict__.get("__dataclass_fields__", {})
        if name in fields and what in fields[name].metadata:
            return fields[name].metadata[what]
    return None


def field_bounds(config_cls: type, name: str) -> Bounds | None:
    """The bounds of field ``name``: its own declaration's, else those of the same field in
    the nearest base dataclass that declares them (a subclass that only changes a default,
    ``lr: float = 5e-3``, keeps its base's range)."""
    return _declared(config_cls, name, "bounds")


def _numbers(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [v for item in value for v in _numbers(item)]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [value]
    return []


def check_values(config: Any, prefix: str) -> None:
    """Every numeric value of dataclass instance ``config`` (lists included) is finite and
    within its field's declared ``Bounds``; a ``ValueError`` names ``prefix.key``, the value
    and the range otherwise. Nested dataclasses are checked under their own key."""
    if not dataclasses.is_dataclass(config):
        return
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        key = f"{prefix}.{f.name}"
        if dataclasses.is_dataclass(value):
            check_values(value, key)
            continue
        choices = _declared(type(config), f.name, "choices")
        if choices is not None and value not in choices:
            raise ValueError(f"unknown {key}={value!r}; available: {', '.join(choices)}")
        bounds = field_bounds(type(config), f.name)
        for number in _numbers(value):
            if isinstance(number, float) and not math.isfinite(number):
                raise ValueError(f"{key}={value!r}: not a finite number")
            if bounds is not None and not bounds.holds(number):
                raise ValueError(f"{key}={value!r} is out of range: it must be {bounds}")
