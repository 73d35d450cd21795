"""The method contract of ``tta-bench validate method NAME`` (``method_checks``): it builds
and sets up; ``step`` takes images only; logits ``[B, C]``, floating and finite; no
label-like attribute; ``reset()`` restores the state; only declared trainable parameters
change; a classifier it shares is unchanged; the same seed gives the same logits.
"""

from __future__ import annotations

import copy
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tta_bench.cli.checks import (
    ATOL,
    FAIL,
    SKIP,
    Check,
    CheckFailed,
    _max_diff,
    _require,
    run_check,
)

if TYPE_CHECKING:
    import torch

#: Attribute and parameter names that would hold ground truth: never on a method.
LABEL_LIKE = re.compile(r"^_*(y|y_true|gt|ground_truths?|true_labels?|labels?|targets?)$")


def _fresh(
    method_cls: type,
    classifier: Any,
    config: Any,
    source: Callable[..., Any] | None,
) -> Any:
    """A set-up instance as the runner makes one: on a copy of ``classifier`` when the class
    adapts (else on ``classifier`` itself), given source images when it asks for them."""
    import torch

    model = copy.deepcopy(classifier) if method_cls.adapts else classifier
    method = method_cls(model, copy.deepcopy(config))
    n = method.source_images_needed()
    if n and source is not None:
        if method.needs_source_labels:  # source(n, labels=True) -> (images, labels)
            method.set_source(*source(int(n), labels=True))
        else:
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
    source: Callable[..., Any] | None = None,
) -> list[Check]:
    """The method contract on ``method_cls`` with ``classifier`` (a ``ZeroShotClassifier``)
    and ``images`` (``[2B, C, H, W]`` in [0, 1]: a batch and another one). ``source(n)``
    gives the clean source images a method asks for (``source(n, labels=True)``: with their
    labels, for a method that ``needs_source_labels``). Each check builds its own instances."""
    config = config if config is not None else method_cls.Config()
    probe = _MethodProbe(method_cls, classifier, config, source, images)
    checks = [run_check("builds with its default config and sets up", lambda: _setup(probe.fresh))]
    if checks[0].status == FAIL:
        return checks + [Check(n, SKIP, "not run: setup failed") for n in METHOD_CHECKS]
    impl = (
        probe.step_signature,
        probe.logits,
        probe.no_labels,
        probe.reset_restores,
        probe.declared_only,
        probe.shared_untouched,
        probe.same_seed,
    )
    return checks + [run_check(name, fn) for name, fn in zip(METHOD_CHECKS, impl)]


@dataclass
class _MethodProbe:
    """What the method checks share: the class, the classifier and config it is built with,
    the source images it may ask for, and two batches (``x``, then ``other``). Each check
    (a method, in ``METHOD_CHECKS`` order) builds its own instances."""

    method_cls: type
    classifier: Any
    config: Any
    source: Callable[..., Any] | None
    images: torch.Tensor
    x: torch.Tensor = field(init=False)
    other: torch.Tensor = field(init=False)
    num_classes: int = field(init=False)

    def __post_init__(self) -> None:
        half = self.images.shape[0] // 2
        self.x, self.other = self.images[:half], self.images[half:]
        self.num_classes = self.classifier.num_classes

    def fresh(self) -> Any:
        return _fresh(self.method_cls, self.classifier, self.config, self.source)

    def _two_steps(self, method: Any) -> None:
        """Adapt ``method`` on the other batch, then on ``x`` (seeds 1 and 2)."""
        for seed, batch in ((1, self.other), (2, self.x)):
            method.reseed(seed)
            method.step(batch)

    def step_signature(self) -> str:
        out = _images_only(self.method_cls.step, "step")
        if hasattr(self.method_cls, "compute_loss"):
            _images_only(self.method_cls.compute_loss, "compute_loss")
        return out

    def logits(self) -> str:
        import torch

        x = self.x
        method = self.fresh()
        method.reseed(0)
        out = method.step(x)
        _require(isinstance(out, torch.Tensor), f"step returned {type(out).__name__}, not a tensor")
        expected = (x.shape[0], self.num_classes)
        _require(tuple(out.shape) == expected, f"logits {tuple(out.shape)}, expected {expected}")
        _require(out.is_floating_point(), f"logits dtype {out.dtype} is not floating")
        bad = int((~torch.isfinite(out)).sum())
        _require(bad == 0, f"{bad} non-finite logit(s)")
        return f"[{expected[0]}, {expected[1]}] {str(out.dtype).removeprefix('torch.')}, finite"

    def no_labels(self) -> str:
        method = self.fresh()
        method.reseed(0)
        method.step(self.x)
        found = _label_like_attributes(method)
        _require(not found, f"label-like attribute(s) {found}: labels never reach a method")
        return "none of its attributes is label-like"

    def reset_restores(self) -> str:
        import torch

        first = self.fresh()
        first.reseed(7)
        expected = first.step(self.x)
        used = self.fresh()
        self._two_steps(used)
        used.reset()
        used.reseed(7)
        got = used.step(self.x)
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

    def declared_only(self) -> str:
        import torch

        method = self.fresh()
        declared = {id(p) for p in method.trainable_parameters()}
        names = {k for k, p in method.model.named_parameters() if id(p) in declared}
        before = {k: v.detach().clone() for k, v in method.model.state_dict().items()}
        self._two_steps(method)
        after = method.model.state_dict()
        changed = [
            k
            for k, v in before.items()
            if k not in names and (k not in after or not torch.equal(v, after[k]))
        ]
        _require(not changed, f"undeclared state changed: {changed[:5]}")
        moved = sum(not torch.equal(before[k], after[k]) for k in names if k in after)
        return f"{len(names)} declared tensor(s), {moved} changed; the rest identical"

    def shared_untouched(self) -> str:
        import torch

        method_cls, classifier = self.method_cls, self.classifier
        base = copy.deepcopy(classifier) if method_cls.adapts else classifier
        before = {k: v.detach().clone() for k, v in base.state_dict().items()}
        self._two_steps(_fresh(method_cls, base, self.config, self.source))
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

    def same_seed(self) -> str:
        outs = []
        for _ in range(2):
            method = self.fresh()
            method.reseed(3)
            outs.append(method.step(self.x))
        diff = _max_diff(outs[0], outs[1])
        _require(diff == 0.0, f"two fresh instances after reseed(3) differ by {diff:.3g}")
        return "two fresh instances after reseed(3): identical logits"


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
