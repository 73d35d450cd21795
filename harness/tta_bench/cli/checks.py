"""What every contract check of ``tta-bench validate`` is made of: a ``Check`` (PASS, FAIL
or SKIP with its reason), ``run_check`` that turns a check function's return or exception
into one, and the helpers the checks share (``_require``, ``_max_diff``). The checks
themselves are in ``cli.checks_method``, ``cli.checks_data`` and ``cli.checks_model``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
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


def _declared_check_args(factory: Any) -> Callable[..., Any]:
    """A factory's ``check_args`` (optional: SKIP where it defines none)."""
    check = getattr(factory, "check_args", None)
    if not callable(check):
        raise CheckSkipped("the factory defines none (optional)")
    return check
