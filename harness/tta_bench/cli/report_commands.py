"""The ``tta-bench`` commands that report: ``table``, ``leaderboard``, ``rescore`` and
``compare``, from results files only (``tta_bench.report``, ``tta_bench.run.rescore``), and
``validate``, the contract checks on one component (``tta_bench.cli.validate``).
"""

from __future__ import annotations

import argparse
from typing import Any

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


def cmd_compare(args: argparse.Namespace) -> int:
    import json

    from tta_bench.report import paired
    from tta_bench.report.leaderboard import load_many

    with usage_errors():
        if args.resamples < 1:
            raise ValueError(f"--resamples {args.resamples}: expected a positive integer")
        if not 0 < args.confidence < 1:
            raise ValueError(f"--confidence {args.confidence}: expected a level in (0, 1)")
        paths = [args.a] if args.b is None else [args.a, args.b]
        records = load_many(paths)
        b_record, b_path = (records[1], args.b) if args.b is not None else (None, None)
        found = paired.compare(
            records[0],
            args.a,
            b_record,
            b_path,
            confidence=args.confidence,
            n_resamples=args.resamples,
        )
    print(json.dumps(found, indent=2) if args.json else _comparison_text(found))
    return 0


def _comparison_text(found: dict[str, Any]) -> str:
    """``compare``'s table: accuracies, the difference, one row per test, the MDE line."""
    from tabulate import tabulate

    from tta_bench.report.tables import _p

    def pts(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:+.2f}"

    def test_row(name: str, test: dict[str, Any]) -> list[str]:
        interval = "-"
        if test.get("ci_low") is not None:
            interval = f"[{pts(test['ci_low'])}, {pts(test['ci_high'])}]"
        return [name, pts(test["difference"]), interval, _p(test["p_value"])]

    mc, seed = found["mcnemar"], found["seed_t"]
    sample, batch = found["bootstrap_sample"], found["bootstrap_batch"]
    acc = found["accuracy"]
    rows = [
        [f"accuracy {found['method']} %", f"{100 * acc['method']:.2f}", "", ""],
        [f"accuracy {found['baseline']} %", f"{100 * acc['baseline']:.2f}", "", ""],
        ["difference (points)", pts(found["difference"]), "", ""],
        test_row(f"seed-level paired t ({seed['n_pairs']} seeds)", seed),
        test_row(f"McNemar exact (b={mc['a_only']}, c={mc['b_only']})", mc),
        test_row(f"sample bootstrap ({sample['n_units']:,} samples)", sample),
        test_row(f"batch block bootstrap ({batch['n_units']:,} batches)", batch),
    ]
    level = f"{100 * found['confidence']:g}% interval"
    table = tabulate(
        rows, headers=["", "estimate", level, "p"], tablefmt="simple", disable_numparse=True
    )
    mde = found["mde"]
    by_batch = "" if mde["batch"] is None else f"; {100 * mde['batch']:.2f} by stream batches"
    head = (
        f"{found['method']} vs {found['baseline']} ({found['protocol_id']}): {found['n']:,} "
        f"paired samples in {found['cells']} cells, seeds {found['seeds']}; b: only A right, "
        "c: only B right"
    )
    tail = (
        f"minimum detectable effect (level {mde['alpha']:g}, power {mde['power']:g}, "
        f"discordance {100 * mde['discordance']:.1f}%): {100 * mde['sample']:.2f} points{by_batch}"
    )
    return f"{head}\n\n{table}\n\n{tail}"


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
