"""What many stream orders cost from the feature cache: zero-shot and TDA with
``protocol.orders=100`` on ``digits-c`` against one TDA run of three seeds today.

Each run is ``tta-bench run`` in a fresh process (the text heads and decoded images come
from the run's cache folder, warmed by one untimed run first, as on a user's second run).
The figure is the run's own ``wall_time_s`` (the loop, set-up included; Python's start-up
excluded), and the ratio of each 100-order run to the three-seed TDA run, all three
measured in turn in each repeat. The orders runs write no per-sample files
(``log_samples=auto`` writes none for orders).

``--check K`` also runs TDA's first K orders without the cache (``feature_cache=never``:
every order decodes, corrupts and encodes its images) and compares every metric of every
cell with the cached run's: they must be equal, bit for bit.

Usage::

    python benchmarks/orders.py [--repeats 3] [--orders 100] [--check 3]

Run it on an idle machine (``uptime``): the figures are timings. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE = "digits-c"
METRICS = ("n", "accuracy", "reference_accuracy", "ece", "nll")


def run(out: Path, method: str, *overrides: str) -> dict:
    cmd = [sys.executable, "-m", "tta_bench.cli", "run", "--method", method, "--suite", SUITE]
    cmd += ["--output", str(out), "--quiet", "resume=false", "log_samples=false", *overrides]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def span(values: list[float], digits: int = 1) -> str:
    med = statistics.median(values)
    return f"{med:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def check(tmp: Path, cached: dict, k: int, orders: int) -> str:
    """Cells of the first ``k`` orders without the cache, against the cached run's."""
    seeds = "seeds=[" + ",".join(str(s) for s in range(k)) + "]"
    plain = run(tmp / "plain.json", "tda", f"protocol.orders={orders}", seeds,
                "feature_cache=never")  # fmt: skip
    mine = {(c["shift"], c["severity"], c["seed"]): c for c in cached["cells"]}
    differ = [
        (c["shift"], c["seed"], m)
        for c in plain["cells"]
        for m in METRICS
        if c.get(m) != mine[(c["shift"], c["severity"], c["seed"])].get(m)
    ]
    shown = f" {differ[:3]}" if differ else ""
    return f"{len(plain['cells'])} cells of orders 0..{k - 1}: {len(differ)} differ{shown}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--orders", type=int, default=100)
    parser.add_argument("--check", type=int, default=3, help="orders checked uncached (0: none)")
    args = parser.parse_args(argv)
    times: dict[str, list[float]] = {"tda3": [], "zeroshot": [], "tda": []}
    encode: dict[str, list[float]] = {"zeroshot": [], "tda": []}
    with tempfile.TemporaryDirectory(prefix="tta-orders-") as name:
        tmp = Path(name)
        run(tmp / "warm.json", "zeroshot", "seeds=[0]")  # text heads, decoded images
        for r in range(args.repeats):
            print(f"repeat {r + 1}/{args.repeats}", file=sys.stderr)
            times["tda3"].append(run(tmp / "tda3.json", "tda")["wall_time_s"])
            for method in ("zeroshot", "tda"):
                rec = run(tmp / f"{method}.json", method, f"protocol.orders={args.orders}")
                times[method].append(rec["wall_time_s"])
                encode[method].append(rec["feature_cache"]["encode_s"])
        checked = check(tmp, rec, args.check, args.orders) if args.check else "not checked"
    base = statistics.median(times["tda3"])
    print(f"{SUITE}, {args.repeats} repeats; seconds: median (range)")
    print(f"  tda, 3 seeds (today):              {span(times['tda3'])}")
    for method in ("zeroshot", "tda"):
        ratio = [t / b for t, b in zip(times[method], times["tda3"])]
        print(
            f"  {method:8s} {args.orders} orders, cached: {span(times[method])}  "
            f"(encoding {span(encode[method])})  ratio to tda 3 seeds {span(ratio, 2)} "
            f"[median/median {statistics.median(times[method]) / base:.2f}]"
        )
    print(f"  uncached check: {checked}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
