"""How a ``tta-bench`` command turns bad input into exit status 2: a ``ValueError`` raised
below a command (a name, a value, a file the user gave) becomes a ``UsageError`` with the
same message, which ``cli.commands.main`` prints as ``tta-bench: error: ...``.
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
