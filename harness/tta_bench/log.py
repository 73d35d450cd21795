"""The harness's messages to the user go through ``logging`` (logger ``tta_bench``): the
CLI shows warnings by default, ``-v`` adds progress notes and ``-vv`` debug detail, ``-q``
leaves errors only. Library users configure the logger as any other."""

from __future__ import annotations

import logging
import sys

LOGGER = logging.getLogger("tta_bench")
#: -q, default, -v, -vv
LEVELS = (logging.ERROR, logging.WARNING, logging.INFO, logging.DEBUG)


class _StderrHandler(logging.Handler):
    """Writes to the ``sys.stderr`` of the moment (tests replace it per call)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
            sys.stderr.write(f"tta-bench: {level}{record.getMessage()}\n")
        except Exception:  # never let a message break the command
            self.handleError(record)


_HANDLER = _StderrHandler()


def configure(verbosity: int) -> None:
    """Show messages at the level ``verbosity`` selects (-1: -q, 0: default, 1: -v, 2:
    -vv) on stderr, once per process however often it is called."""
    LOGGER.setLevel(LEVELS[max(-1, min(verbosity, 2)) + 1])
    if _HANDLER not in LOGGER.handlers:
        LOGGER.addHandler(_HANDLER)
    LOGGER.propagate = False
