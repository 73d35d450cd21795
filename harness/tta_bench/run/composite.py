"""Composite shifts: two registered shifts applied one after the other, their severities
walking from the first to the second, the building block of a CCC-style stream
(Continually Changing Corruptions, Press et al., NeurIPS 2023: a long stream whose
corruption moves from one pair to the next at a fixed speed).

A protocol names a composite shift ``"<A>><B>"`` (e.g. ``gaussian_noise>fog``). At severity
``k`` (1..5) it applies ``A`` at severity ``6 - k`` and then ``B`` at severity ``k``, each
through ``apply_shift`` (checked and clamped to [0, 1]), with the per-sample generator of
the domain ``(A>B, k)``. Severities 1..5 in order therefore walk from ``A`` strong and ``B``
weak to ``A`` weak and ``B`` strong; a stream of composite shifts ``A>B, B>C, ...`` under
the ``continual`` policy moves along a chain of corruptions at one step per severity, the
step holding every image of the split once (the speed). ``shift_kernel`` resolves any
shift name, plain or composite; ``check_shift`` checks one before anything is built.
"""

from __future__ import annotations

from typing import Any

from tta_bench.registry import registry

#: Separates the two shifts of a composite name.
SEPARATOR = ">"


def parts(name: str) -> tuple[str, str] | None:
    """``(A, B)`` of a composite shift name ``"A>B"``; None for a plain name."""
    if SEPARATOR not in name:
        return None
    pieces = name.split(SEPARATOR)
    if len(pieces) != 2 or not all(pieces) or pieces[0] == pieces[1]:
        raise ValueError(
            f"composite shift {name!r}: expected two different registered shifts joined by "
            f"{SEPARATOR!r}, e.g. 'gaussian_noise{SEPARATOR}fog'"
        )
    return pieces[0], pieces[1]


class CompositeShift:
    """``B(A(x, 6 - k), k)`` at severity ``k``: see the module docstring."""

    def __init__(self, name: str, first: Any, second: Any):
        self.name, self.first, self.second = name, first, second

    def __call__(
        self, images: Any, severity: int, *, generator: Any, table: str | None = None
    ) -> Any:
        from tta_bench.run.inputs import apply_shift

        k = int(severity)
        if not 1 <= k <= 5:
            raise ValueError(f"composite shift {self.name!r}: severity must be in 1..5, got {k}")
        x = apply_shift(self.first, images, 6 - k, generator, table)
        return apply_shift(self.second, x, k, generator, table)

    def __repr__(self) -> str:
        return f"CompositeShift({self.name!r})"


def shift_kernel(name: str) -> Any:
    """The kernel of a registered shift, or the ``CompositeShift`` of ``"A>B"``."""
    pair = parts(name)
    if pair is None:
        return registry("shifts").get(name)
    first, second = (registry("shifts").get(p) for p in pair)
    return CompositeShift(name, first, second)


def check_shift(name: str) -> None:
    """A ``RegistryError``/``ValueError`` naming the options when ``name`` (or a part of a
    composite name) is not a registered shift."""
    for part in parts(name) or (name,):
        registry("shifts").origin(part)
