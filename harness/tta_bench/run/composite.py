"""Shift kernels applied (``apply_shift``, checked and clamped; ``uint8_entry``), and
composite shifts: two registered shifts applied one after the other, their severities
walking from the first to the second, the building block of a CCC-style stream
(Continually Changing Corruptions, Press et al., NeurIPS 2023: a long stream whose
corruption moves from one pair to the next at a fixed speed).

A protocol names a composite shift ``"A>B"`` (A and B registered shifts). At severity
``k`` (1..5) it applies ``A`` at severity ``6 - k`` and then ``B`` at severity ``k``, each
through ``apply_shift`` (checked and clamped to [0, 1]), with the per-sample generator of
the domain ``(A>B, k)``. Severities 1..5 in order therefore walk from ``A`` strong and ``B``
weak to ``A`` weak and ``B`` strong; a stream of composite shifts ``A>B, B>C, ...`` under
the ``continual`` policy moves along a chain of corruptions at one step per severity, the
step holding every image of the split once (the speed). ``shift_kernel`` resolves any
shift name, plain or composite; ``check_shift`` checks one before anything is built.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from tta_bench.data import to_float_images
from tta_bench.registry import registry
from tta_bench.rng import SampleGenerator

Kernel = Callable[..., torch.Tensor]


def uint8_entry(kernel: Kernel) -> Kernel | None:
    """The kernel's optional ``from_uint8`` entry: the same corruption of an 8-bit
    ``[B, H, W, C]`` batch, the decoded images' own format, returning what the kernel
    returns for ``images.permute(0, 3, 1, 2).float() / 255``. Kernels whose work is 8-bit
    anyway (a JPEG codec) offer it to skip a float -> 8-bit pass; None when absent."""
    entry = getattr(kernel, "from_uint8", None)
    return entry if callable(entry) else None


_TAKES_TABLE: dict[Kernel, bool] = {}


def apply_shift(
    kernel: Kernel,
    images: torch.Tensor,
    severity: int,
    generator: SampleGenerator,
    table: str | None,
) -> torch.Tensor:
    """``kernel(images, severity, generator=..., table=...)``, checked and clamped to [0, 1];
    ``table=None`` passes no table (the kernel's own default).

    uint8 ``[B, H, W, C]`` images go to the kernel's ``from_uint8`` entry (``uint8_entry``)
    when it has one, else they are converted (``to_float_images``) first."""
    expected = images.shape
    if images.dtype == torch.uint8:
        b, h, w, c = images.shape
        expected = torch.Size((b, c, h, w))
        entry = uint8_entry(kernel)
        if entry is None:
            images = to_float_images(images)
        else:
            kernel = entry
    takes_table = _TAKES_TABLE.get(kernel)
    if takes_table is None:  # inspect once per kernel, not per batch
        takes_table = _TAKES_TABLE[kernel] = "table" in inspect.signature(kernel).parameters
    kwargs: dict[str, Any] = {"generator": generator}
    if takes_table and table is not None:
        kwargs["table"] = table
    out = kernel(images, severity, **kwargs)
    if out.shape != expected:
        raise ValueError(f"shift kernel changed the batch shape {expected} -> {out.shape}")
    return out.clamp_(0.0, 1.0)


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
            f"{SEPARATOR!r}: 'A{SEPARATOR}B' (see tta-bench ls shifts)"
        )
    return pieces[0], pieces[1]


class CompositeShift:
    """``B(A(x, 6 - k), k)`` at severity ``k``: see the module docstring."""

    def __init__(self, name: str, first: Any, second: Any):
        self.name, self.first, self.second = name, first, second

    def __call__(
        self, images: Any, severity: int, *, generator: Any, table: str | None = None
    ) -> Any:
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
