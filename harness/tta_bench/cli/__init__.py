"""The ``tta-bench`` command line."""

from tta_bench.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
