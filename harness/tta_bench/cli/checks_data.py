"""The contracts of what a test stream is made of: a shift kernel (``shift_checks``: the
input's shape at severities 1..5, finite and in [0, 1] after the harness's clamp, randomness
from its generator only, per-sample seeding, a ``from_uint8`` entry matching the float path)
and a dataset factory (``dataset_checks``: it builds a ``DomainStream`` whose labels, class
names, templates, split sizes, fingerprint and first image are sound; SKIP where it needs
local data it was not given).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tta_bench.cli.checks import (
    ATOL,
    BATCH,
    PASS,
    SKIP,
    Check,
    CheckFailed,
    CheckSkipped,
    _declared_check_args,
    _max_diff,
    _require,
    run_check,
)

if TYPE_CHECKING:
    import torch

    from tta_bench.rng import SampleGenerator


# -- shifts ------------------------------------------------------------------------------
def shift_checks(
    kernel: Callable[..., torch.Tensor], images: torch.Tensor, *, name: str, table: str | None
) -> list[Check]:
    """The shift contract on ``kernel`` with ``images`` (``[B, C, H, W]`` in [0, 1]) and the
    severity table ``table`` (passed when the kernel takes one)."""
    probe = _ShiftProbe(kernel, name, table, images[:BATCH].float().clamp(0, 1))
    return [
        run_check("output has the input's shape", probe.shape),
        run_check("finite, in [0, 1] after the harness's clamp", probe.in_range),
        run_check("same generator seeds, same output", probe.deterministic),
        run_check("per-sample seeding (independent of the batch)", probe.per_sample),
        run_check("from_uint8 entry matches", probe.uint8_entry),
    ]


@dataclass
class _ShiftProbe:
    """What the shift checks share: the kernel, its name (it seeds the generators) and
    severity table, and the batch ``x`` it shifts as the samples ``index``."""

    kernel: Callable[..., torch.Tensor]
    name: str
    table: str | None
    x: torch.Tensor
    index: list[int] = field(init=False)
    takes_table: bool = field(init=False)

    def __post_init__(self) -> None:
        self.index = list(range(100, 100 + self.x.shape[0]))
        self.takes_table = "table" in inspect.signature(self.kernel).parameters

    def gen(self, rows: Sequence[int], severity: int) -> SampleGenerator:
        from tta_bench.rng import SampleGenerator

        return SampleGenerator.for_samples(rows, 0, self.name, severity, device=self.x.device)

    def raw(self, images: torch.Tensor, severity: int, rows: Sequence[int]) -> torch.Tensor:
        """The kernel's own output, before the harness clamps it."""
        kwargs: dict[str, Any] = {"generator": self.gen(rows, severity)}
        if self.takes_table and self.table is not None:
            kwargs["table"] = self.table
        return self.kernel(images.clone(), severity, **kwargs)

    def shape(self) -> str:
        import torch

        x = self.x
        for severity in range(1, 6):
            out = self.raw(x, severity, self.index)
            _require(isinstance(out, torch.Tensor), f"returned {type(out).__name__}")
            _require(
                tuple(out.shape) == tuple(x.shape),
                f"severity {severity}: shape {tuple(out.shape)}, expected {tuple(x.shape)}",
            )
            _require(out.is_floating_point(), f"severity {severity}: dtype {out.dtype}")
        return f"{list(x.shape)} at severities 1..5"

    def in_range(self) -> str:
        import torch

        from tta_bench.run.inputs import apply_shift

        lo, hi = math.inf, -math.inf
        for severity in range(1, 6):
            out = self.raw(self.x, severity, self.index)
            lo, hi = min(lo, float(out.min())), max(hi, float(out.max()))
            clamped = apply_shift(
                self.kernel, self.x.clone(), severity, self.gen(self.index, severity), self.table
            )
            bad = int((~torch.isfinite(clamped)).sum())
            _require(bad == 0, f"severity {severity}: {bad} non-finite value(s) (NaN survives)")
        own = "within [0, 1]" if lo >= 0 and hi <= 1 else "clamped by the harness"
        return f"kernel's own range [{lo:.3g}, {hi:.3g}], {own}"

    def deterministic(self) -> str:
        import numpy as np
        import torch

        outs = []
        for global_seed in (1, 2):
            torch.manual_seed(global_seed)
            np.random.seed(global_seed)
            outs.append(self.raw(self.x, 3, self.index))
        diff = _max_diff(outs[0], outs[1])
        _require(
            diff == 0.0,
            f"same generator seeds, different output ({diff:.3g}): randomness must come "
            "from `generator` only",
        )
        return "same seeds: identical output under other global RNG states"

    def per_sample(self) -> str:
        x, index = self.x, self.index
        batch = self.raw(x, 3, index)
        worst = 0.0
        for i in range(x.shape[0]):
            alone = self.raw(x[i : i + 1], 3, index[i : i + 1])
            worst = max(worst, _max_diff(alone[0], batch[i]))
        _require(
            worst <= ATOL,
            f"a sample shifted alone differs from its row of the batch by {worst:.3g}: its "
            "corruption depends on the other samples (draw per sample from `generator`)",
        )
        return f"each sample alone equals its batch row (max diff {worst:.3g})"

    def uint8_entry(self) -> str:
        import torch

        from tta_bench.data import to_float_images
        from tta_bench.run.inputs import apply_shift, uint8_entry

        kernel, table, gen = self.kernel, self.table, self.gen
        if uint8_entry(kernel) is None:
            raise CheckSkipped("no from_uint8 entry (optional)")
        u8 = (self.x * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()
        via_u8 = apply_shift(kernel, u8, 3, gen(self.index, 3), table)
        via_float = apply_shift(kernel, to_float_images(u8), 3, gen(self.index, 3), table)
        diff = _max_diff(via_u8, via_float)
        _require(diff <= 1.5 / 255, f"from_uint8 differs from the float path by {diff:.3g}")
        return f"matches the float path (max diff {diff:.3g})"


# -- datasets ----------------------------------------------------------------------------
def dataset_checks(factory: Callable[..., Any], *, name: str, data_dir: str | None) -> list[Check]:
    """The dataset contract on ``factory`` (``data_dir`` passed when it takes one; a
    factory that must be given a ``shift`` and whose catalogue entry lists ``domains`` gets
    the first of them). A factory that needs local data it was not given is SKIP, not
    FAIL."""
    from tta_bench import catalog

    params = inspect.signature(factory).parameters
    kwargs: dict[str, Any] = {}
    if data_dir is not None and "data_dir" in params:
        kwargs["data_dir"] = data_dir
    needs_dir = "data_dir" in params and data_dir is None
    meta = catalog.entry("datasets", name)
    shift = params.get("shift")
    if shift is not None and shift.default is inspect.Parameter.empty and meta.get("domains"):
        # a dataset that serves other datasets as its domains: checked on its first one
        kwargs["shift"] = meta["domains"][0]
    probe = _DatasetProbe(factory, name, kwargs, needs_dir, meta, "split" in params)
    checks = [
        run_check("check_args", probe.check_args),
        run_check("builds a DomainStream", probe.build),
    ]
    after_build = (
        ("labels in range", probe.labels),
        ("class names", probe.classnames),
        ("templates", probe.templates),
        ("split sizes", probe.splits),
        ("fingerprint", probe.fingerprint),
        ("an image decodes", probe.decodes),
    )
    if checks[-1].status != PASS:
        reason = "not run: " + ("needs data" if checks[-1].status == SKIP else "build failed")
        return checks + [Check(n, SKIP, reason) for n, _ in after_build]
    return checks + [run_check(n, fn) for n, fn in after_build]


@dataclass
class _DatasetProbe:
    """What the dataset checks share: the factory, the arguments it is called with, whether
    it lacks the ``data_dir`` it takes, its catalogue entry, whether it takes a ``split``,
    and the stream the build check made (the later checks read it)."""

    factory: Callable[..., Any]
    name: str
    kwargs: dict[str, Any]
    needs_dir: bool
    meta: dict[str, Any]
    takes_split: bool
    built: dict[str, Any] = field(default_factory=dict)

    def needs_data(self, exc: Exception) -> CheckSkipped:
        hint = "; give --data-dir" if self.needs_dir else ""
        return CheckSkipped(f"skipped: needs data ({exc}{hint})")

    def check_args(self) -> str:
        from tta_bench.data import DataUnavailableError

        check = _declared_check_args(self.factory)
        try:
            check(**self.kwargs)
        except DataUnavailableError as exc:
            raise self.needs_data(exc) from None
        except ValueError as exc:
            if self.needs_dir:
                raise self.needs_data(exc) from None
            raise CheckFailed(f"check_args raised ValueError: {exc}") from None
        return "accepts the default arguments"

    def build(self) -> str:
        from tta_bench.data import DataUnavailableError, DomainStream

        try:
            stream = self.factory(**self.kwargs)
        except DataUnavailableError as exc:
            raise self.needs_data(exc) from None
        except (ValueError, OSError) as exc:
            if self.needs_dir:
                raise self.needs_data(exc) from None
            raise
        _require(
            isinstance(stream, DomainStream),
            f"returned {type(stream).__name__}, not a tta_bench.data.DomainStream",
        )
        self.built["stream"] = stream
        return f"{stream.name!r}: {len(stream)} images, {len(stream.classnames)} classes"

    def stream(self) -> Any:
        if "stream" not in self.built:
            raise CheckSkipped("not run: the dataset was not built")
        return self.built["stream"]

    def labels(self) -> str:
        s = self.stream()
        y = s.labels
        c = len(s.classnames)
        bad = int(((y < 0) | (y >= c)).sum())
        _require(bad == 0, f"{bad} label(s) outside 0..{c - 1}")
        return f"{len(set(y.tolist()))} of {c} classes present, all labels in 0..{c - 1}"

    def classnames(self) -> str:
        names = self.stream().classnames
        _require(bool(names), "no class names")
        bad = [n for n in names if not isinstance(n, str) or not n.strip()]
        _require(not bad, f"empty or non-string class name(s): {bad[:5]}")
        dup = sorted({n for n in names if names.count(n) > 1})
        _require(not dup, f"repeated class name(s): {dup[:5]}")
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        return f"{len(names)}: {shown}"

    def templates(self) -> str:
        from tta_bench.text_head import resolve_templates

        name = self.name
        own = resolve_templates(self.stream().templates, owner=f"dataset {name!r}")
        if self.meta.get("templates") is not None:
            cat = resolve_templates(self.meta["templates"], owner=f"dataset {name!r}'s catalogue")
            return f"{len(own)} from the stream, {len(cat)} in the catalogue (the protocol's)"
        return f"{len(own)} from the stream"

    def splits(self) -> str:
        declared = self.meta.get("splits") or []
        if not declared or not self.takes_split:
            return f"{len(self.stream())} images (one split)"
        sizes = []
        for split in declared:
            s = self.factory(**self.kwargs, split=split)
            sizes.append(f"{split}: {len(s)}")
        return ", ".join(sizes)

    def fingerprint(self) -> str:
        first = self.stream().fingerprint
        _require(isinstance(first, str) and bool(first), f"fingerprint {first!r} is empty")
        again = self.factory(**self.kwargs).fingerprint
        _require(again == first, f"fingerprint changed between two builds: {first} / {again}")
        return first

    def decodes(self) -> str:
        from tta_bench.run.cache import to_rgb_array

        s = self.stream()
        if not len(s):
            raise CheckFailed("the dataset is empty")
        image = to_rgb_array(s.dataset[0]["image"], 32)
        return f"row 0 decodes ({image.shape[1]}x{image.shape[0]} after resizing)"
