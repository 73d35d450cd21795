"""How a ``tta-bench`` command turns bad input into exit status 2: a ``ValueError`` raised
below a command (a name, a value, a file the user gave) becomes a ``UsageError`` with the
same message, which ``cli.commands.main`` prints as ``tta-bench: error: ...``;
``check_cache_budget`` refuses a bad ``TTA_BENCH_CACHE_BUDGET_GB`` up front.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tta_bench.run.resolve import UsageError


@contextlib.contextmanager
def usage_errors() -> Iterator[None]:
    """A ``ValueError`` inside the block is bad input: re-raised as a ``UsageError``."""
    try:
        yield
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def check_cache_budget() -> None:
    """``TTA_BENCH_CACHE_BUDGET_GB`` read once (``tta_bench.run.cache.cache_budget_gb``): a bad
    value is a ``UsageError`` naming it. Each command that reads the decoded cache calls
    this first, before anything is composed or built."""
    from tta_bench.run.cache import cache_budget_gb

    with usage_errors():
        cache_budget_gb()
