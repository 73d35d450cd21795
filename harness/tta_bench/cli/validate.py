"""``tta-bench validate KIND NAME``: the contract checks (docs/design.md#contracts) on one
component, each reported as PASS, FAIL or SKIP with its reason.

The checks per kind (``CHECKS`` names them in order):

* **method**: it loads (a ``Method`` subclass with a dataclass ``Config``); it builds with
  its default config and sets up; ``step`` takes images only (no label-like or further
  required parameter); logits ``[B, C]``, floating and finite; no label-like attribute on
  the instance or its class; ``reset()`` restores the state (step, reset, step equals a
  fresh instance's first step); only declared trainable parameters change (state dicts
  compared); a classifier the method does not copy (``adapts = False``: the runner shares
  it) is unchanged; ``reseed(s)`` on two fresh instances gives identical logits.
* **shift**: it loads; the output has the input's shape at severities 1..5; finite and in
  [0, 1] after the harness's clamp (``tta_bench.run.inputs.apply_shift``; the kernel's own range
  is reported); the same per-sample generator seeds give the same output whatever torch's
  and numpy's global RNG state; per-sample seeding (a sample shifted alone, with its own
  generator, equals its row of the batch); a ``from_uint8`` entry matches the float path.
* **loss**: it loads; one value per sample ``[B]`` from logits ``[B, C]``; finite;
  differentiable (backward gives finite gradients); context it does not use (``features=``)
  is accepted.
* **dataset**: it loads; the factory's ``check_args``, when it has one; it builds a
  ``DomainStream``; labels in ``0..C-1``; class names present (non-empty, unique);
  templates present (one ``{}`` each, ``tta_bench.text_head.resolve_templates``), the
  catalogue's too; the size of each split the catalogue lists; a stable fingerprint; the
  first image decodes. A dataset that needs local data it was not given (``--data-dir``)
  is SKIP, "needs data (...)", not FAIL.
* **model**: it loads; its ``check_args``; it builds a ``ModelBundle`` with a valid
  ``Preprocess``; zero-shot logits ``[B, C]``, finite; a second build has the same state.
* **metric**: a finite float on random logits and labels (no bounds assumed; an open-set
  metric's cell has a quarter of its rows labelled -1, out of distribution); the same
  value twice; its inputs left unchanged.

Methods (and shifts) run on a few images of the suite's dataset (``--suite``, default the
catalogues' suite) at the model's input size (``--model``, default the catalogues' model),
with the suite's text head; when that dataset is not available, on random images with the
catalogue's class names for it. ``validate(...)`` returns a ``Report``; the CLI prints it and
exits 0 when no check failed, 1 when one did, 2 for an unknown kind or name.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import inspect
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tta_bench.registry import RegistryError, UnknownNameError, registry

if TYPE_CHECKING:
    import torch

#: The kinds ``validate`` checks, singular (plurals are accepted too), and their registries.
KINDS = {
    "method": "methods",
    "shift": "shifts",
    "loss": "losses",
    "dataset": "datasets",
    "model": "models",
    "metric": "metrics",
}
KIND_NAMES = tuple(KINDS)
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
#: Attribute and parameter names that would hold ground truth: never on a method.
LABEL_LIKE = re.compile(r"^_*(y|y_true|gt|ground_truths?|true_labels?|labels?|targets?)$")
#: Tolerance of the checks that compare a recomputation (reset, per-sample seeding).
ATOL = 1e-5
#: Images per batch of the method and shift checks (two batches are drawn).
BATCH = 8


class CheckFailed(Exception):
    """Raised inside a check: FAIL with this reason."""


class CheckSkipped(Exception):
    """Raised inside a check: SKIP with this reason."""


@dataclass
class Check:
    """One check's outcome: ``status`` is PASS, FAIL or SKIP, ``reason`` says why (or what
    was measured)."""

    name: str
    status: str
    reason: str = ""

    def line(self) -> str:
        return f"{self.status}  {self.name}" + (f": {self.reason}" if self.reason else "")


@dataclass
class Report:
    """The checks of one component, with what they ran on."""

    kind: str
    name: str
    origin: str
    context: str = ""
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no check failed (skipped checks do not fail)."""
        return all(c.status != FAIL for c in self.checks)

    def counts(self) -> dict[str, int]:
        return {s: sum(c.status == s for c in self.checks) for s in (PASS, FAIL, SKIP)}

    def text(self) -> str:
        head = f"validate {self.kind} {self.name} ({self.origin})"
        lines = [head] + ([f"  on {self.context}"] if self.context else [])
        lines += [c.line() for c in self.checks]
        n = self.counts()
        verdict = "ok" if self.ok else "FAILED"
        lines.append(
            f"{verdict}: {n[PASS]} passed, {n[FAIL]} failed, {n[SKIP]} skipped "
            f"of {len(self.checks)} checks"
        )
        return "\n".join(lines)


def run_check(name: str, fn: Callable[[], str | None]) -> Check:
    """Run one check: PASS with what ``fn`` returns, FAIL or SKIP when it raises
    ``CheckFailed``/``CheckSkipped``, FAIL naming any other exception."""
    try:
        return Check(name, PASS, fn() or "")
    except CheckFailed as exc:
        return Check(name, FAIL, str(exc))
    except CheckSkipped as exc:
        return Check(name, SKIP, str(exc))
    except Exception as exc:  # the component raised: that is the finding
        return Check(name, FAIL, f"raised {type(exc).__name__}: {exc}")


def _require(condition: bool, reason: str) -> None:
    if not condition:
        raise CheckFailed(reason)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|, NaN where only one of them is NaN (NaN in both counts as equal)."""
    import torch

    if not a.numel():
        return 0.0
    a, b = a.detach().double(), b.detach().double()
    diff = (a - b).abs()
    diff[torch.isnan(a) & torch.isnan(b)] = 0.0
    diff[torch.isinf(a) & (a == b)] = 0.0
    return float(diff.max())


# -- methods -----------------------------------------------------------------------------
def _fresh(
    method_cls: type,
    classifier: Any,
    config: Any,
    source: Callable[[int], torch.Tensor] | None,
) -> Any:
    """A set-up instance as the runner makes one: on a copy of ``classifier`` when the class
    adapts (else on ``classifier`` itself), given source images when it asks for them."""
    import torch

    if method_cls.adapts:
        model = copy.deepcopy(classifier, memo={id(classifier.tokenizer): classifier.tokenizer})
    else:
        model = classifier
    method = method_cls(model, copy.deepcopy(config))
    n = method.source_images_needed()
    if n and source is not None:
        method.set_source(source(int(n)))
    torch.manual_seed(0)
    method.setup()
    return method


def _images_only(fn: Callable[..., Any], what: str) -> str:
    params = list(inspect.signature(fn).parameters.values())[1:]  # after self
    named = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    label = [n for n in named if LABEL_LIKE.match(n)]
    if label:
        raise CheckFailed(f"{what} takes {label[0]!r}: labels never reach a method")
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not positional and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise CheckFailed(f"{what} takes no images parameter")
    required = [
        p.name
        for p in params[1:]
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    _require(not required, f"{what} requires {required}: the harness passes the images only")
    return f"{what}{inspect.signature(fn)}"


def _label_like_attributes(method: Any) -> list[str]:
    names = set(vars(method))
    for cls in type(method).__mro__:
        if cls.__module__ != "tta_bench.method" and cls is not object:
            names |= set(vars(cls))
    return sorted(n for n in names if LABEL_LIKE.match(n))


def method_checks(
    method_cls: type,
    classifier: Any,
    images: torch.Tensor,
    *,
    config: Any = None,
    source: Callable[[int], torch.Tensor] | None = None,
) -> list[Check]:
    """The method contract on ``method_cls`` with ``classifier`` (a ``ZeroShotClassifier``)
    and ``images`` (``[2B, C, H, W]`` in [0, 1]: a batch and another one). ``source(n)``
    gives the clean source images a method asks for. Each check builds its own instances."""
    import torch

    config = config if config is not None else method_cls.Config()
    half = images.shape[0] // 2
    x, other = images[:half], images[half:]
    num_classes = classifier.num_classes

    def fresh() -> Any:
        return _fresh(method_cls, classifier, config, source)

    checks = [run_check("builds with its default config and sets up", lambda: _setup(fresh))]
    if checks[0].status == FAIL:
        return checks + [Check(n, SKIP, "not run: setup failed") for n in METHOD_CHECKS]

    def step_signature() -> str:
        out = _images_only(method_cls.step, "step")
        if hasattr(method_cls, "compute_loss"):
            _images_only(method_cls.compute_loss, "compute_loss")
        return out

    def logits() -> str:
        method = fresh()
        method.reseed(0)
        out = method.step(x)
        _require(isinstance(out, torch.Tensor), f"step returned {type(out).__name__}, not a tensor")
        expected = (x.shape[0], num_classes)
        _require(tuple(out.shape) == expected, f"logits {tuple(out.shape)}, expected {expected}")
        _require(out.is_floating_point(), f"logits dtype {out.dtype} is not floating")
        bad = int((~torch.isfinite(out)).sum())
        _require(bad == 0, f"{bad} non-finite logit(s)")
        return f"[{expected[0]}, {expected[1]}] {str(out.dtype).removeprefix('torch.')}, finite"

    def no_labels() -> str:
        method = fresh()
        method.reseed(0)
        method.step(x)
        found = _label_like_attributes(method)
        _require(not found, f"label-like attribute(s) {found}: labels never reach a method")
        return "none of its attributes is label-like"

    def reset_restores() -> str:
        first = fresh()
        first.reseed(7)
        expected = first.step(x)
        used = fresh()
        for seed, batch in ((1, other), (2, x)):
            used.reseed(seed)
            used.step(batch)
        used.reset()
        used.reseed(7)
        got = used.step(x)
        _require(
            tuple(got.shape) == tuple(expected.shape),
            f"after reset(), logits {tuple(got.shape)}; a fresh instance's {tuple(expected.shape)}",
        )
        _require(
            bool(torch.isfinite(got).all()) or not bool(torch.isfinite(expected).all()),
            "after two steps and reset(), step gives non-finite logits where a fresh "
            "instance's first step is finite: state survives reset()",
        )
        diff = _max_diff(got, expected)
        _require(
            diff <= ATOL,
            f"after two steps and reset(), step differs from a fresh instance's first step "
            f"by {diff:.3g} (> {ATOL:g}): state survives reset()",
        )
        return f"max |after reset - fresh| = {diff:.3g}"

    def declared_only() -> str:
        method = fresh()
        declared = {id(p) for p in method.trainable_parameters()}
        names = {k for k, p in method.model.named_parameters() if id(p) in declared}
        before = {k: v.detach().clone() for k, v in method.model.state_dict().items()}
        for seed, batch in ((1, other), (2, x)):
            method.reseed(seed)
            method.step(batch)
        after = method.model.state_dict()
        changed = [
            k
            for k, v in before.items()
            if k not in names and (k not in after or not torch.equal(v, after[k]))
        ]
        _require(not changed, f"undeclared state changed: {changed[:5]}")
        moved = sum(not torch.equal(before[k], after[k]) for k in names if k in after)
        return f"{len(names)} declared tensor(s), {moved} changed; the rest identical"

    def shared_untouched() -> str:
        if method_cls.adapts:
            base = copy.deepcopy(classifier, memo={id(classifier.tokenizer): classifier.tokenizer})
        else:
            base = classifier
        before = {k: v.detach().clone() for k, v in base.state_dict().items()}
        method = _fresh(method_cls, base, config, source)
        for seed, batch in ((1, other), (2, x)):
            method.reseed(seed)
            method.step(batch)
        if method_cls.adapts:
            base_after = base.state_dict()
            changed = [k for k, v in before.items() if not torch.equal(v, base_after[k])]
            _require(not changed, f"the classifier it was copied from changed: {changed[:5]}")
            return "adapts on its own copy; the original is unchanged"
        changed = [k for k, v in before.items() if not torch.equal(v, base.state_dict()[k])]
        _require(
            not changed,
            f"adapts = False, so the runner shares the frozen classifier, but it changed "
            f"{changed[:5]}; declare adapts = True",
        )
        return "adapts = False and the shared classifier is unchanged"

    def same_seed() -> str:
        outs = []
        for _ in range(2):
            method = fresh()
            method.reseed(3)
            outs.append(method.step(x))
        diff = _max_diff(outs[0], outs[1])
        _require(diff == 0.0, f"two fresh instances after reseed(3) differ by {diff:.3g}")
        return "two fresh instances after reseed(3): identical logits"

    impl = (
        step_signature,
        logits,
        no_labels,
        reset_restores,
        declared_only,
        shared_untouched,
        same_seed,
    )
    return checks + [run_check(name, fn) for name, fn in zip(METHOD_CHECKS, impl)]


def _setup(fresh: Callable[[], Any]) -> str:
    method = fresh()
    n = len(method.trainable_parameters())
    kind = "adapts" if type(method).adapts else "parameter-free (adapts = False)"
    return f"{kind}, {n} declared trainable tensor(s)"


#: The method checks after "builds with its default config and sets up", in order.
METHOD_CHECKS = (
    "step takes images only",
    "logits [B, C], finite",
    "labels never reach it (no label-like attribute)",
    "reset() restores the state",
    "only declared trainable parameters change",
    "the frozen backbone is unchanged",
    "same seed, same logits",
)


# -- shifts ------------------------------------------------------------------------------
def shift_checks(
    kernel: Callable[..., torch.Tensor], images: torch.Tensor, *, name: str, table: str
) -> list[Check]:
    """The shift contract on ``kernel`` with ``images`` (``[B, C, H, W]`` in [0, 1]) and the
    severity table ``table`` (passed when the kernel takes one)."""
    import numpy as np
    import torch

    from tta_bench.rng import SampleGenerator
    from tta_bench.run.inputs import apply_shift

    x = images[:BATCH].float().clamp(0, 1)
    index = list(range(100, 100 + x.shape[0]))
    takes_table = "table" in inspect.signature(kernel).parameters

    def gen(rows: Sequence[int], severity: int) -> SampleGenerator:
        return SampleGenerator.for_samples(rows, 0, name, severity, device=x.device)

    def raw(images_: torch.Tensor, severity: int, rows: Sequence[int]) -> torch.Tensor:
        kwargs: dict[str, Any] = {"generator": gen(rows, severity)}
        if takes_table:
            kwargs["table"] = table
        return kernel(images_.clone(), severity, **kwargs)

    def shape() -> str:
        for severity in range(1, 6):
            out = raw(x, severity, index)
            _require(isinstance(out, torch.Tensor), f"returned {type(out).__name__}")
            _require(
                tuple(out.shape) == tuple(x.shape),
                f"severity {severity}: shape {tuple(out.shape)}, expected {tuple(x.shape)}",
            )
            _require(out.is_floating_point(), f"severity {severity}: dtype {out.dtype}")
        return f"{list(x.shape)} at severities 1..5"

    def in_range() -> str:
        lo, hi = math.inf, -math.inf
        for severity in range(1, 6):
            out = raw(x, severity, index)
            lo, hi = min(lo, float(out.min())), max(hi, float(out.max()))
            clamped = apply_shift(kernel, x.clone(), severity, gen(index, severity), table)
            bad = int((~torch.isfinite(clamped)).sum())
            _require(bad == 0, f"severity {severity}: {bad} non-finite value(s) (NaN survives)")
        own = "within [0, 1]" if lo >= 0 and hi <= 1 else "clamped by the harness"
        return f"kernel's own range [{lo:.3g}, {hi:.3g}], {own}"

    def deterministic() -> str:
        outs = []
        for global_seed in (1, 2):
            torch.manual_seed(global_seed)
            np.random.seed(global_seed)
            outs.append(raw(x, 3, index))
        diff = _max_diff(outs[0], outs[1])
        _require(
            diff == 0.0,
            f"same generator seeds, different output ({diff:.3g}): randomness must come "
            "from `generator` only",
        )
        return "same seeds: identical output under other global RNG states"

    def per_sample() -> str:
        batch = raw(x, 3, index)
        worst = 0.0
        for i in range(x.shape[0]):
            alone = raw(x[i : i + 1], 3, index[i : i + 1])
            worst = max(worst, _max_diff(alone[0], batch[i]))
        _require(
            worst <= ATOL,
            f"a sample shifted alone differs from its row of the batch by {worst:.3g}: its "
            "corruption depends on the other samples (draw per sample from `generator`)",
        )
        return f"each sample alone equals its batch row (max diff {worst:.3g})"

    def uint8_entry() -> str:
        from tta_bench.data import to_float_images
        from tta_bench.run.inputs import uint8_entry

        if uint8_entry(kernel) is None:
            raise CheckSkipped("no from_uint8 entry (optional)")
        u8 = (x * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()
        via_u8 = apply_shift(kernel, u8, 3, gen(index, 3), table)
        via_float = apply_shift(kernel, to_float_images(u8), 3, gen(index, 3), table)
        diff = _max_diff(via_u8, via_float)
        _require(diff <= 1.5 / 255, f"from_uint8 differs from the float path by {diff:.3g}")
        return f"matches the float path (max diff {diff:.3g})"

    return [
        run_check("output has the input's shape", shape),
        run_check("finite, in [0, 1] after the harness's clamp", in_range),
        run_check("same generator seeds, same output", deterministic),
        run_check("per-sample seeding (independent of the batch)", per_sample),
        run_check("from_uint8 entry matches", uint8_entry),
    ]


# -- losses ------------------------------------------------------------------------------
def loss_checks(
    fn: Callable[..., torch.Tensor], *, batch: int = 6, classes: int = 5
) -> list[Check]:
    """The loss contract on ``fn`` with random logits ``[batch, classes]``."""
    import torch

    g = torch.Generator().manual_seed(0)

    def logits() -> torch.Tensor:
        return (3 * torch.randn(batch, classes, generator=g)).requires_grad_(True)

    def per_sample() -> str:
        out = fn(logits())
        _require(isinstance(out, torch.Tensor), f"returned {type(out).__name__}, not a tensor")
        _require(
            tuple(out.shape) == (batch,),
            f"shape {tuple(out.shape)} from logits [{batch}, {classes}], expected [{batch}]",
        )
        return f"[{batch}] from [{batch}, {classes}]"

    def finite() -> str:
        out = fn(logits()).detach()
        bad = int((~torch.isfinite(out)).sum())
        _require(bad == 0, f"{bad} non-finite value(s)")
        return f"values in [{float(out.min()):.3g}, {float(out.max()):.3g}]"

    def differentiable() -> str:
        z = logits()
        out = fn(z)
        _require(out.requires_grad, "the output does not require grad (detached from the logits?)")
        out.sum().backward()
        _require(z.grad is not None, "backward gave the logits no gradient")
        bad = int((~torch.isfinite(z.grad)).sum())
        _require(bad == 0, f"{bad} non-finite gradient value(s)")
        return f"finite gradients, max |grad| {float(z.grad.abs().max()):.3g}"

    def context() -> str:
        fn(logits(), features=torch.randn(batch, 8, generator=g))
        return "accepts features=... it may ignore"

    return [
        run_check("one value per sample", per_sample),
        run_check("finite", finite),
        run_check("differentiable", differentiable),
        run_check("accepts context keywords", context),
    ]


# -- metrics -----------------------------------------------------------------------------
def metric_checks(fn: Callable[..., Any], *, n: int = 40, classes: int = 5) -> list[Check]:
    """The metric contract on ``fn`` with random logits ``[n, classes]`` and labels ``[n]``
    (no bounds assumed: a metric need not be accuracy-like)."""
    import torch

    g = torch.Generator().manual_seed(0)
    logits = 2 * torch.randn(n, classes, generator=g)
    labels = torch.randint(0, classes, (n,), generator=g)
    if getattr(fn, "open_set", False):  # an open-set metric: a quarter of the rows are OOD
        labels[: n // 4] = -1

    def value() -> float:
        out = fn(logits, labels)
        if isinstance(out, torch.Tensor):
            _require(out.numel() == 1, f"returned a tensor of shape {tuple(out.shape)}")
            out = out.item()
        _require(
            isinstance(out, (int, float)) and not isinstance(out, bool),
            f"returned {type(out).__name__}, not a float",
        )
        return float(out)

    def finite() -> str:
        v = value()
        _require(math.isfinite(v), f"returned {v}")
        return f"{v:.6g} on random logits [{n}, {classes}]"

    def same() -> str:
        a, b = value(), value()
        _require(a == b, f"two calls on the same inputs gave {a} and {b}")
        return "the same value twice"

    def unchanged() -> str:
        x, y = logits.clone(), labels.clone()
        fn(x, y)
        _require(torch.equal(x, logits) and torch.equal(y, labels), "it modified its inputs")
        return "logits and labels left as they were"

    return [
        run_check("a finite float", finite),
        run_check("deterministic", same),
        run_check("inputs unchanged", unchanged),
    ]


# -- datasets ----------------------------------------------------------------------------
def dataset_checks(factory: Callable[..., Any], *, name: str, data_dir: str | None) -> list[Check]:
    """The dataset contract on ``factory`` (``data_dir`` passed when it takes one; a
    factory that must be given a ``shift`` and whose catalogue entry lists ``domains`` gets
    the first of them). A factory that needs local data it was not given is SKIP, not
    FAIL."""
    from tta_bench import catalog
    from tta_bench.data import DataUnavailableError, DomainStream
    from tta_bench.run.cache import to_rgb_array
    from tta_bench.text_head import resolve_templates

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
    built: dict[str, Any] = {}

    def needs_data(exc: Exception) -> CheckSkipped:
        hint = "; give --data-dir" if needs_dir else ""
        return CheckSkipped(f"skipped: needs data ({exc}{hint})")

    def check_args() -> str:
        check = getattr(factory, "check_args", None)
        if not callable(check):
            raise CheckSkipped("the factory defines none (optional)")
        try:
            check(**kwargs)
        except DataUnavailableError as exc:
            raise needs_data(exc) from None
        except ValueError as exc:
            if needs_dir:
                raise needs_data(exc) from None
            raise CheckFailed(f"check_args raised ValueError: {exc}") from None
        return "accepts the default arguments"

    def build() -> str:
        try:
            stream = factory(**kwargs)
        except DataUnavailableError as exc:
            raise needs_data(exc) from None
        except (ValueError, OSError) as exc:
            if needs_dir:
                raise needs_data(exc) from None
            raise
        _require(
            isinstance(stream, DomainStream),
            f"returned {type(stream).__name__}, not a tta_bench.data.DomainStream",
        )
        built["stream"] = stream
        return f"{stream.name!r}: {len(stream)} images, {len(stream.classnames)} classes"

    def stream() -> Any:
        if "stream" not in built:
            raise CheckSkipped("not run: the dataset was not built")
        return built["stream"]

    def labels() -> str:
        s = stream()
        y = s.labels
        c = len(s.classnames)
        bad = int(((y < 0) | (y >= c)).sum())
        _require(bad == 0, f"{bad} label(s) outside 0..{c - 1}")
        return f"{len(set(y.tolist()))} of {c} classes present, all labels in 0..{c - 1}"

    def classnames() -> str:
        names = stream().classnames
        _require(bool(names), "no class names")
        bad = [n for n in names if not isinstance(n, str) or not n.strip()]
        _require(not bad, f"empty or non-string class name(s): {bad[:5]}")
        dup = sorted({n for n in names if names.count(n) > 1})
        _require(not dup, f"repeated class name(s): {dup[:5]}")
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        return f"{len(names)}: {shown}"

    def templates() -> str:
        own = resolve_templates(stream().templates, owner=f"dataset {name!r}")
        if meta.get("templates") is not None:
            cat = resolve_templates(meta["templates"], owner=f"dataset {name!r}'s catalogue")
            return f"{len(own)} from the stream, {len(cat)} in the catalogue (the protocol's)"
        return f"{len(own)} from the stream"

    def splits() -> str:
        declared = meta.get("splits") or []
        if not declared or "split" not in params:
            return f"{len(stream())} images (one split)"
        sizes = []
        for split in declared:
            s = factory(**kwargs, split=split)
            sizes.append(f"{split}: {len(s)}")
        return ", ".join(sizes)

    def fingerprint() -> str:
        first = stream().fingerprint
        _require(isinstance(first, str) and bool(first), f"fingerprint {first!r} is empty")
        again = factory(**kwargs).fingerprint
        _require(again == first, f"fingerprint changed between two builds: {first} / {again}")
        return first

    def decodes() -> str:
        s = stream()
        if not len(s):
            raise CheckFailed("the dataset is empty")
        image = to_rgb_array(s.dataset[0]["image"], 32)
        return f"row 0 decodes ({image.shape[1]}x{image.shape[0]} after resizing)"

    checks = [run_check("check_args", check_args), run_check("builds a DomainStream", build)]
    if checks[-1].status != PASS:
        reason = "not run: " + ("needs data" if checks[-1].status == SKIP else "build failed")
        rest = ("labels in range", "class names", "templates", "split sizes", "fingerprint")
        return checks + [Check(n, SKIP, reason) for n in (*rest, "an image decodes")]
    return checks + [
        run_check("labels in range", labels),
        run_check("class names", classnames),
        run_check("templates", templates),
        run_check("split sizes", splits),
        run_check("fingerprint", fingerprint),
        run_check("an image decodes", decodes),
    ]


# -- models ------------------------------------------------------------------------------
def model_checks(factory: Callable[..., Any]) -> list[Check]:
    """The model contract on ``factory`` (its default arguments)."""
    import torch

    from tta_bench.model import ModelBundle, Preprocess, ZeroShotClassifier, state_sha256

    built: dict[str, Any] = {}

    def check_args() -> str:
        check = getattr(factory, "check_args", None)
        if not callable(check):
            raise CheckSkipped("the factory defines none (optional)")
        check()
        return "accepts the default arguments"

    def build() -> str:
        bundle = factory()
        _require(isinstance(bundle, ModelBundle), f"returned {type(bundle).__name__}")
        pre = bundle.preprocess
        _require(isinstance(pre, Preprocess), f"preprocess is {type(pre).__name__}")
        _require(pre.image_size > 0, f"image_size {pre.image_size}")
        _require(len(pre.mean) == 3 and len(pre.std) == 3, "mean and std need 3 values each")
        _require(all(s > 0 for s in pre.std), f"std {pre.std} must be positive")
        built["bundle"] = bundle
        return f"{bundle.name}, weights {bundle.weights}, {pre.image_size} px"

    def logits() -> str:
        if "bundle" not in built:
            raise CheckSkipped("not run: the model was not built")
        bundle = built["bundle"]
        clf = ZeroShotClassifier(bundle, ["cat", "dog", "bird"], ["a photo of a {}."])
        size = bundle.preprocess.image_size
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            out = clf(torch.rand(2, 3, size, size, generator=g))
        _require(tuple(out.shape) == (2, 3), f"logits {tuple(out.shape)}, expected (2, 3)")
        _require(bool(torch.isfinite(out).all()), "non-finite logits")
        return "[2, 3], finite"

    def same_state() -> str:
        if "bundle" not in built:
            raise CheckSkipped("not run: the model was not built")
        first, again = state_sha256(built["bundle"].clip), state_sha256(factory().clip)
        _require(first == again, f"two builds differ: {first[:12]} / {again[:12]}")
        return f"state sha256 {first[:12]}"

    return [
        run_check("check_args", check_args),
        run_check("builds a ModelBundle", build),
        run_check("zero-shot logits [B, C], finite", logits),
        run_check("the same state on every build", same_state),
    ]


# -- what the method and shift checks run on ---------------------------------------------
@dataclass
class Sample:
    """The model and images the method and shift checks use."""

    model: str
    bundle: Any
    images: torch.Tensor  # [2 * BATCH, 3, S, S] in [0, 1]
    classnames: list[str]
    templates: list[str]
    table: str
    about: str


def _default_model(model: str | None, suite: str | None) -> str:
    from tta_bench import catalog
    from tta_bench.run.resolve import UsageError

    if model:
        return model
    suites = catalog.catalog()["suites"]
    if suite and suites.get(suite, {}).get("default_model"):
        return str(suites[suite]["default_model"])
    found = catalog.default_or_none("model")
    if found:
        return found
    default_suite = catalog.default_or_none("suite")
    if default_suite and suites.get(default_suite, {}).get("default_model"):
        return str(suites[default_suite]["default_model"])
    raise UsageError("no installed catalogue names a default model; pass --model NAME")


def sample(
    model: str | None = None,
    suite: str | None = None,
    data_dir: str | None = None,
    device: str = "cpu",
) -> Sample:
    """The model (``model``, else the catalogues' default) and ``2 * BATCH`` images of the
    suite's dataset (``suite``, else the catalogues' default) at its input size, flattened
    towards each image's mean so adaptation has something to do; random images with the
    catalogue's class names when the dataset cannot be read."""
    import numpy as np
    import torch

    from tta_bench import catalog
    from tta_bench.data import to_float_images
    from tta_bench.run.inputs import dataset_stream
    from tta_bench.run.protocol import load_protocol
    from tta_bench.run.sources import open_source

    name = _default_model(model, suite)
    bundle = registry("models").get(name)()
    size = bundle.preprocess.image_size
    n = 2 * BATCH
    suite = suite or catalog.default_or_none("suite")
    classnames: list[str] = ["class a", "class b", "class c", "class d"]
    templates: list[str] = ["a photo of a {}."]
    table, images, about = "cifar", None, ""
    if suite is not None:
        protocol = load_protocol(suite)
        table = protocol.severity_table
        meta = catalog.entry("datasets", protocol.dataset)
        classnames = list(meta.get("classnames") or classnames)
        if protocol.templates:
            templates = list(protocol.templates)
        try:
            domain: tuple[Any, ...] = ()
            if protocol.shift_source == "dataset":
                domain = (protocol.shifts[0], protocol.severities[0])
            stream = dataset_stream(protocol, data_dir, *domain)
            rows = np.arange(min(n, len(stream)))
            src = open_source(stream, size, cache="never", on_bad_image="skip")
            images = to_float_images(torch.from_numpy(src.fetch(rows).images))
            classnames = list(stream.classnames)
            templates = list(protocol.templates or stream.templates)
            about = f"{len(rows)} images of suite {suite} (dataset {protocol.dataset})"
        except (ValueError, OSError) as exc:
            about = f"random images (suite {suite}'s dataset is not available: {exc})"
    if images is None or not len(images):
        g = torch.Generator().manual_seed(0)
        images = torch.rand(n, 3, size, size, generator=g)
        about = about or "random images (no suite)"
    while images.shape[0] < n:
        images = torch.cat([images, images])[:n]
    mean = images.mean(dim=(1, 2, 3), keepdim=True)
    images = ((images - mean) * 0.2 + mean).clamp(0, 1)
    bundle.clip.to(device)
    return Sample(
        name, bundle, images.to(device), classnames, templates, table, f"model {name}, {about}"
    )


# -- the command -------------------------------------------------------------------------
def kind_of(kind: str) -> str:
    """The singular kind ``kind`` names (``method`` or ``methods``); a ``ValueError`` with
    "did you mean" and the kinds otherwise."""
    for singular, plural in KINDS.items():
        if kind in (singular, plural):
            return singular
    from tta_bench.run.resolve import UsageError

    singular = {**{k: k for k in KINDS}, **{v: k for k, v in KINDS.items()}}
    close = difflib.get_close_matches(kind, list(singular), n=1)
    hint = f" Did you mean {singular[close[0]]!r}?" if close else ""
    raise UsageError(f"unknown kind {kind!r}.{hint} Available: {', '.join(KIND_NAMES)}")


def validate(
    kind: str,
    name: str,
    *,
    model: str | None = None,
    suite: str | None = None,
    data_dir: str | None = None,
    device: str = "cpu",
) -> Report:
    """Run the checks of one component (module docstring). An unknown kind, name, model or
    suite is a ``ValueError`` (``UnknownNameError`` with "did you mean" for names); a
    component that fails to load is a FAIL of the report's first check."""
    from tta_bench.run.spec import resolve_device

    kind = kind_of(kind)
    device = str(resolve_device(device))  # unknown or unavailable: a ValueError naming it
    plural = KINDS[kind]
    if kind == "metric":
        return _validate_metric(name)
    reg = registry(plural)
    origin = reg.origin(name)  # UnknownNameError: did you mean, available
    where = f"{origin.value} from {origin.distribution} {origin.version}"
    report = Report(kind, name, where)
    try:
        obj = reg.get(name)
    except RegistryError as exc:
        report.checks.append(Check("loads and passes the load-time checks", FAIL, str(exc)))
        return report
    report.checks.append(Check("loads and passes the load-time checks", PASS, _loaded(kind, obj)))
    if kind == "dataset":
        report.context = f"data dir {data_dir}" if data_dir else ""
        report.checks += dataset_checks(obj, name=name, data_dir=data_dir)
    elif kind == "model":
        report.checks += model_checks(obj)
    elif kind == "loss":
        report.checks += loss_checks(obj)
    else:
        if suite is not None:
            from tta_bench import catalog

            if suite not in catalog.catalog()["suites"]:
                raise UnknownNameError("suites", suite, list(catalog.catalog()["suites"]))
        if model is not None:
            registry("models").origin(model)
        s = sample(model, suite, data_dir, device)
        report.context = f"{s.about}, device {device}"
        if kind == "shift":
            report.checks += shift_checks(obj, s.images, name=name, table=s.table)
        else:
            from tta_bench.model import ZeroShotClassifier

            classifier = ZeroShotClassifier(s.bundle, s.classnames, s.templates).to(device)
            pool = s.images

            def source(k: int) -> torch.Tensor:
                reps = -(-k // pool.shape[0])
                return pool.repeat(reps, 1, 1, 1)[:k].clone()

            report.checks += method_checks(obj, classifier, s.images, source=source)
    return report


def _loaded(kind: str, obj: Any) -> str:
    if kind == "method":
        fields = [f.name for f in dataclasses.fields(obj.Config)]
        return f"a Method subclass, Config fields: {', '.join(fields) or 'none'}"
    try:
        return f"{getattr(obj, '__name__', type(obj).__name__)}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        return repr(obj)


def _validate_metric(name: str) -> Report:
    from tta_bench.metrics import METRICS

    reg = registry("metrics")
    names = sorted({*reg.names(), *METRICS})
    if name not in names:
        raise UnknownNameError("metrics", name, names)
    if name in METRICS:
        fn, where = METRICS[name], "registered in-process (register_metric)"
    else:
        origin = reg.origin(name)
        where = f"{origin.value} from {origin.distribution} {origin.version}"
        fn = None
    report = Report("metric", name, where)
    try:
        fn = fn if fn is not None else reg.get(name)
    except RegistryError as exc:
        report.checks.append(Check("loads and passes the load-time checks", FAIL, str(exc)))
        return report
    report.checks.append(
        Check("loads and passes the load-time checks", PASS, _loaded("metric", fn))
    )
    report.checks += metric_checks(fn)
    return report
