"""The contracts of a model and of what scores it: a model factory (``model_checks``: a
``ModelBundle`` with a valid ``Preprocess``, finite zero-shot logits, the same state on
every build), a loss (``loss_checks``: one finite, differentiable value per sample) and a
metric (``metric_checks``: a finite float, deterministic, inputs unchanged).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tta_bench.cli.checks import (
    Check,
    CheckSkipped,
    _declared_check_args,
    _require,
    run_check,
)

if TYPE_CHECKING:
    import torch


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


# -- models ------------------------------------------------------------------------------
def model_checks(factory: Callable[..., Any]) -> list[Check]:
    """The model contract on ``factory`` (its default arguments)."""
    import torch

    from tta_bench.model import ModelBundle, Preprocess, ZeroShotClassifier, state_sha256

    built: dict[str, Any] = {}

    def check_args() -> str:
        _declared_check_args(factory)()
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

    def made() -> Any:
        """The bundle the build check made; SKIP for the checks after a failed build."""
        if "bundle" not in built:
            raise CheckSkipped("not run: the model was not built")
        return built["bundle"]

    def logits() -> str:
        bundle = made()
        clf = ZeroShotClassifier(bundle, ["cat", "dog", "bird"], ["a photo of a {}."])
        size = bundle.preprocess.image_size
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            out = clf(torch.rand(2, 3, size, size, generator=g))
        _require(tuple(out.shape) == (2, 3), f"logits {tuple(out.shape)}, expected (2, 3)")
        _require(bool(torch.isfinite(out).all()), "non-finite logits")
        return "[2, 3], finite"

    def same_state() -> str:
        first, again = state_sha256(made().clip), state_sha256(factory().clip)
        _require(first == again, f"two builds differ: {first[:12]} / {again[:12]}")
        return f"state sha256 {first[:12]}"

    return [
        run_check("check_args", check_args),
        run_check("builds a ModelBundle", build),
        run_check("zero-shot logits [B, C], finite", logits),
        run_check("the same state on every build", same_state),
    ]
