"""``tta-bench verify``: re-run some cells of a results file and report each as identical to
the file's or not (``tta_bench.run.verify``), optionally keeping a verification report that
the leaderboard shows (``tta_bench.run.verify_report``).

Exit status: 0 every re-run cell identical, 1 one differs, 2 bad input (no such file, not a
results file, ``--cells`` out of range, a run that cannot be re-created here, other weights),
found before anything runs.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from tta_bench.cli.errors import usage_errors
from tta_bench.run.resolve import UsageError

#: ``tta-bench verify --help``'s description.
DESCRIPTION = (
    "Re-run K cells of a results file, chosen reproducibly by --seed from the file's cells, "
    "with the recorded method config, protocol, model and thread count (the run is resolved "
    "as tta-bench run resolves it), and compare every stored field of each cell with the "
    "file's but the timings and memory: identical means equal exactly. Under a stateful reset "
    "policy (continual, gradual, mixed_domains: the state is carried across cells) a cell's "
    "seed runs from its start up to the cell. Nothing is written into the results folder "
    "unless --record is given. Exit status: 0 every re-run cell identical, 1 one differs, "
    "2 bad input (no such file, not a results file, K out of range, a protocol id, method "
    "config or model weights that differ here), before anything runs. docs/submitting.md"
)


def _value(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else repr(value)


def cmd_verify(args: argparse.Namespace) -> int:
    from tta_bench.run.verify import verify_results
    from tta_bench.run.verify_report import report_path, write_report

    if args.cells is not None and args.cells < 1:
        raise UsageError(f"--cells {args.cells}: expected 1 or more")
    with usage_errors():  # VerifyError, a device or data that is not here: exit 2
        v = verify_results(
            args.results,
            args.cells,
            args.seed,
            device=args.device,
            data_dir=args.data_dir,
            threads=args.threads,
        )
    _print(v)
    for path in _report_paths(args, report_path):
        print(f"report: {write_report(v.report(), path)}")
    return 0 if v.identical else 1


def _report_paths(args: argparse.Namespace, report_path: Any) -> list[Any]:
    paths = []
    if args.record:
        paths.append(report_path(args.results))
    if args.report_dir:
        paths.append(report_path(args.results, args.report_dir))
    return paths


def _print(v: Any) -> None:
    """The verification on stdout: what ran, the environment, a line per cell, the outcome."""
    r = v.record
    label = r.get("method_preset") or r["method"]
    print(
        f"{v.path}: {label} on {r['protocol']['id']}, model {r['model']['name']}; "
        f"{len(v.chosen)} of {len(r['cells'])} cells chosen with --seed {v.seed}"
    )
    for prefix in v.prefixes:
        print(f"  {prefix.describe(r['protocol'].get('reset'))}")
    env = v.environment
    here = (
        f"torch {env['torch']}, {env['threads']} thread(s), CPU kernels {env['CPU kernels']}, "
        f"device {env['device']}"
    )
    if v.differences:
        print(f"environment: {here}; differs from the recorded one in:")
        for line in v.differences:
            print(f"  {line}")
        print(
            "  (a forward-only method's predictions must still match; float metrics such as "
            "NLL and ECE, and an adapting method's predictions, may differ by float rounding "
            "across CPU kernels or thread counts: docs/submitting.md)"
        )
    else:
        print(f"environment: as recorded ({here})")
    width = max(len(c.name) for c in v.checks) if v.checks else 0
    for c in v.checks:
        if c.identical:
            print(f"  {c.name:<{width}}  identical ({c.compared} fields)")
        else:
            print(
                f"  {c.name:<{width}}  DIFFERS in {c.field}: recorded {_value(c.recorded)}, "
                f"re-run {_value(c.rerun)}"
            )
    for note in v.notes:
        print(f"note: {note}")
    same = sum(c.identical for c in v.checks)
    verdict = "identical" if v.identical else "NOT identical"
    print(f"{same} of {len(v.chosen)} cell(s) identical: {verdict}")
