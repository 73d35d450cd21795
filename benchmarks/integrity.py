"""What the integrity checks of derived results cost: ``rescore`` and ``merge`` with and
without them, on the digits per-sample files.

The checks (``tta_bench.run.samples.verify_cell``: identity, cell, method, row count, and
the SHA-256 of the file's data pages, ``samples.data_digest``; in ``merge`` also the counts
of each part's entry against its rows, ``shard._check_counts``) are switched off by
replacing those functions with no-ops in this process, so "off" is the same code path
minus the checks. (The batch-layout check of ``merge`` stays on: it is a set comparison
of batch numbers the merge needs anyway.)

* **rescore**: ``tta_bench.run.rescore.recompute`` of the committed
  ``results/digits-c-samples/{zeroshot,tent}.json`` (45 cells of 1,797 samples each).
* **merge**: ``tta_bench.run.shard.merge_parts`` of 4 parts of zeroshot on digits-c reset
  per batch (seed 0, the 15 corruptions: 15 cells), written first into a temporary folder
  with ``protocol.shard=i/4`` (their per-sample files hold the logits, as parts always do),
  merged with ``--output`` (the merged per-sample files written too, as the CLI does).

Each measurement alternates on and off ``--repeats`` times and prints the median and range
of each and the overhead of the median on over the median off.

Usage::

    python benchmarks/integrity.py [--repeats 7]

Run it on an idle machine (``uptime``): the figures are timings. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = [ROOT / "results" / "digits-c-samples" / f"{m}.json" for m in ("zeroshot", "tent")]


@contextlib.contextmanager
def checks_off() -> Iterator[None]:
    """The integrity checks replaced by no-ops (restored on exit)."""
    from tta_bench.run import samples, shard

    saved = samples.verify_cell, samples.data_digest, shard._check_counts
    samples.verify_cell = lambda *a, **k: None
    samples.data_digest = lambda raw: ""
    shard._check_counts = lambda *a, **k: None
    try:
        yield
    finally:
        samples.verify_cell, samples.data_digest, shard._check_counts = saved


def timed(fn: Callable[[], object], repeats: int) -> tuple[list[float], list[float]]:
    """Seconds of ``fn`` with the checks on and off, alternating, after one warm-up each."""
    fn()
    with checks_off():
        fn()
    on, off = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        on.append(time.perf_counter() - t)
        with checks_off():
            t = time.perf_counter()
            fn()
            off.append(time.perf_counter() - t)
    return on, off


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def write_parts(folder: Path, count: int = 4) -> list[Path]:
    """``count`` parts of zeroshot on digits-c reset per batch, seed 0."""
    from tta_bench.run.resolve import resolve_run
    from tta_bench.run.runner import run

    parts = []
    for i in range(count):
        overrides = ["protocol.reset=episodic_batch", "seeds=[0]", "progress=false"]
        _, spec = resolve_run(method="zeroshot", overrides=[*overrides, f"protocol.shard={i}/4"])
        run(spec, folder / f"part{i}.json")
        parts.append(folder / f"part{i}.json")
    return parts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    from tabulate import tabulate

    from tta_bench.run.rescore import recompute
    from tta_bench.run.shard import merge_parts

    rows = []
    for path in COMMITTED:
        on, off = timed(lambda p=path: recompute(p), args.repeats)
        rows.append([f"rescore {path.stem} (45 cells of 360)", _fmt(on), _fmt(off), on, off])
    with tempfile.TemporaryDirectory(prefix="tta-integrity-") as tmp:
        parts = write_parts(Path(tmp))
        out = Path(tmp) / "merged.json"
        on, off = timed(lambda: merge_parts(parts, out), args.repeats)
        rows.append(["merge zeroshot, 4 parts (15 cells)", _fmt(on), _fmt(off), on, off])
    table = [
        [
            r[0],
            r[1],
            r[2],
            f"{100 * (statistics.median(r[3]) / statistics.median(r[4]) - 1):+.1f}%",
        ]
        for r in rows
    ]
    headers = ["what", "checks on, s: median (range)", "checks off, s", "overhead"]
    print(tabulate(table, headers=headers, tablefmt="github"))
    print(f"{args.repeats} alternating repeats each, after one warm-up of each")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
