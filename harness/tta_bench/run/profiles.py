"""Protocol profiles and per-dataset method settings, read from the catalogues.

A **profile** is the way another benchmark runs methods, written as data in a catalogue's
``profiles:`` section and chosen with ``profile=NAME`` (``tta-bench ls profiles`` lists
them). An entry may hold:

* ``protocol``: protocol fields it sets (e.g. ``templates``);
* ``stream_kind``: ``{episodic: {...}, online: {...}}``, protocol fields set for methods
  of that ``Method.stream_kind`` (the method's own code resets per image, or carries state
  along the stream); methods of neither kind keep the suite's stream;
* ``dataset_flags``: ``{config field: dataset flag}``, a method config field set, per
  domain, to whether the domain's dataset has that flag in its catalogue entry
  (``tta_bench.catalog.dataset_flag``), for every method whose config has the field;
* ``switch``: a name whose ``<switch>=true`` override means ``profile=NAME`` (a profile's
  earlier spelling keeps working).

A method's departures under a profile live in the method's catalogue entry,
``profiles: {NAME: {field: value}}``; its own per-dataset rule (what its official code
sets per dataset, applied with or without a profile) is ``dataset_flags: {field: flag}``.

Each value is set only where the run leaves the field at its default: a method config
value or a protocol field the run sets itself wins. On a suite whose domains are several
datasets whose configs differ, the configs are kept per dataset (``RunSpec.method_configs``,
recorded as ``method.<field>@<dataset>``). The record says what was set: under a profile,
``profile_applied``; a method's own rule outside a profile, ``per_dataset_applied``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

SECTION = "profiles"
#: The keys a profile entry may hold (any other is an error naming it).
KEYS = ("description", "source", "switch", "protocol", "stream_kind", "dataset_flags")


def names() -> list[str]:
    from tta_bench.catalog import catalog

    return sorted(catalog()[SECTION])


def profile(name: str) -> dict[str, Any]:
    """The catalogue entry of profile ``name``; an unknown name or a malformed entry is a
    ``ValueError`` naming it and the options."""
    from tta_bench.catalog import entry

    if name not in names():
        available = ", ".join(names()) or "none (no catalogue has a profiles: section)"
        raise ValueError(f"unknown profile={name!r}; available: {available}")
    data = entry(SECTION, name)
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise ValueError(f"profile {name!r} has unknown keys {unknown}; known: {list(KEYS)}")
    return data


def switches() -> dict[str, str]:
    """``{switch: profile name}``: the ``<switch>=true`` spellings of the profiles."""
    from tta_bench.catalog import catalog

    return {str(e["switch"]): n for n, e in catalog()[SECTION].items() if e and e.get("switch")}


def rewrite_switches(overrides: Sequence[str]) -> list[str]:
    """``<switch>=true`` -> ``profile=NAME``, ``<switch>=false`` -> ``profile=null`` (and a
    sweep's ``<switch>=true,false`` -> ``profile=NAME,null``); other overrides as given."""
    table = switches()
    out = []
    for o in overrides:
        key, eq, value = str(o).partition("=")
        if not eq or key.strip() not in table:
            out.append(str(o))
            continue
        name, parts = table[key.strip()], [v.strip().lower() for v in value.split(",")]
        if not parts or any(v not in ("true", "false") for v in parts):
            raise ValueError(f"{key.strip()}={value!r}: expected true or false")
        out.append("profile=" + ",".join(name if v == "true" else "null" for v in parts))
    return out


def protocol_overrides(name: str, given: dict[str, Any], stream_kind: str | None) -> dict[str, Any]:
    """``given`` (the run's protocol overrides) completed with the profile's settings."""
    entry = profile(name)
    out = dict(given)
    for key, value in (entry.get("protocol") or {}).items():
        out.setdefault(key, value)
    for key, value in ((entry.get("stream_kind") or {}).get(stream_kind) or {}).items():
        out.setdefault(key, value)
    return out


def method_settings(name: str, method: str) -> dict[str, Any]:
    """The method's departures under profile ``name`` (its catalogue entry's
    ``profiles: {NAME: {...}}``)."""
    from tta_bench.catalog import entry

    return dict((entry("methods", method).get(SECTION) or {}).get(name) or {})


Rule = Callable[[Any], tuple[Any, dict[str, Any]]]


def method_rule(method: str, mcfg: Any, name: str | None) -> Rule | None:
    """``dataset -> (method config, {field: value set})`` for the domains of a run, or None
    when nothing is set per dataset: the method's own ``dataset_flags``, then (under profile
    ``name``) the profile's ``dataset_flags`` for the fields the config has and the method's
    settings for the profile; each only where ``mcfg`` still holds the class default."""
    from tta_bench.catalog import dataset_flag, entry
    from tta_bench.registry import registry

    if not dataclasses.is_dataclass(mcfg):
        return None
    fields = {f.name for f in dataclasses.fields(mcfg)}
    flags = dict(entry("methods", method).get("dataset_flags") or {})
    settings: dict[str, Any] = {}
    if name is not None:
        own = profile(name).get("dataset_flags") or {}
        flags.update({k: v for k, v in own.items() if k in fields})
        settings = method_settings(name, method)
    unknown = sorted((set(flags) | set(settings)) - fields)
    if unknown:
        raise ValueError(
            f"the catalogue entry of method {method!r} names fields its config lacks: {unknown}"
        )
    if not flags and not settings:
        return None
    defaults = registry("methods").get(method).Config()

    def rule(dataset: Any) -> tuple[Any, dict[str, Any]]:
        wanted = {k: dataset_flag(dataset, flag) for k, flag in flags.items()}
        wanted.update(settings)
        applied = {
            k: v
            for k, v in wanted.items()
            if getattr(mcfg, k) == getattr(defaults, k) and getattr(mcfg, k) != v
        }
        return (dataclasses.replace(mcfg, **applied) if applied else mcfg), applied

    return rule
