"""The ``tta-bench`` commands that report: ``table``, ``leaderboard`` and ``rescore``, from
results files only (``tta_bench.report``, ``tta_bench.run.rescore``), and ``validate``, the
contract checks on one component (``tta_bench.cli.validate``).
"""

from __future__ import annotations

import argparse

from tta_bench import log
from tta_bench.cli.errors import usage_errors

LOGGER = log.LOGGER


def _baseline(args: argparse.Namespace) -> str | None:
    """``--baseline``: unset means the catalogues' reference method, '' means none."""
    from tta_bench.report.tables import REFERENCE

    return REFERENCE if args.baseline is None else (args.baseline or None)


def cmd_table(args: argparse.Namespace) -> int:
    from tta_bench.report import leaderboard as report

    with usage_errors():
        text = report.render_tables(args.results, args.format, _baseline(args), args.test)
    print(text, end="")
    return 0


def cmd_rescore(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from tta_bench.run.rescore import rescore

    with usage_errors():
        checks = rescore(args.results, write=args.write)
    rows = [
        [
            c.name,
            c.cells,
            c.stored,
            "-" if c.max_difference is None else f"{c.max_difference:.3g}",
            f"{c.mean:.6f}",
        ]
        for c in checks
    ]
    headers = ["metric", "cells", "stored in", "max |stored - recomputed|", "mean over cells"]
    print(tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True))
    if args.write:
        print(f"written: {args.results}")
    return 0


def cmd_leaderboard(args: argparse.Namespace) -> int:
    from tta_bench.report import leaderboard as report

    with usage_errors():
        board, written = report.write_leaderboard(
            args.results_dir,
            args.suite,
            args.protocol,
            _baseline(args),
            args.test,
            with_plots=not args.no_plots,
        )
    for name, reason in board.left_out:
        LOGGER.warning(f"left out {name}: {reason}")
    print(f"ranked {len(board.entries)} runs under {board.protocol_id}")
    for path in written:
        print(f"wrote {path}")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from tta_bench.cli import validate

    with usage_errors():  # an unknown kind, model or suite; no default model
        report = validate.validate(
            args.kind,
            args.name,
            model=args.model,
            suite=args.suite,
            data_dir=args.data_dir,
            device=args.device,
        )
    print(report.text())
    return 0 if report.ok else 1
