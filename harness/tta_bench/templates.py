"""Prompt templates, the text head's other half: one resolver with one rule for every place
that takes them (suites, dataset factories, ``Adapter``, ``predict``, ``serve``).

A template set is either the name of a catalogue set (``templates:`` in a ``registry.yaml``;
``tta-bench ls`` lists the datasets that use them) or a list of format strings. Each
template holds exactly one ``{}``, where the class name goes. Reads YAML only: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["resolve_templates"]


def resolve_templates(value: str | Sequence[str], *, owner: str = "") -> list[str]:
    """The templates of ``value`` (a catalogue set's name, or a list of format strings).

    An unknown set's name, an empty list, a non-string entry, or a template without exactly
    one ``{}`` is a ``ValueError`` naming ``owner`` (e.g. ``"suite 'my-suite'"``), the bad
    templates and the catalogue's sets."""
    from tta_bench import catalog

    where = f" of {owner}" if owner else ""
    sets = catalog.catalog()["templates"]
    if isinstance(value, str):
        if value not in sets:
            raise ValueError(
                f"unknown template set {value!r}{where}; available: "
                f"{', '.join(sorted(sets)) or 'none'} (or a list of format strings with one '{{}}')"
            )
        value = sets[value]["templates"]
    if not isinstance(value, Sequence) or not all(isinstance(t, str) for t in value):
        raise ValueError(
            f"prompt templates{where} must be a template set's name or a list of strings, "
            f"got {value!r}"
        )
    out = list(value)
    bad = [t for t in out if t.count("{}") != 1]
    if not out or bad:
        raise ValueError(
            f"prompt templates{where} need exactly one '{{}}' each (where the class name "
            f"goes); got {bad or out}"
        )
    return out
