"""Do the committed results reproduce here? Seed 0 of committed runs, cell by cell.

For each committed results file given (default: every method in ``results/digits-c``), the
run's seed 0 is recomputed with ``tta-bench run`` in a fresh process with an empty cache
(``TTA_BENCH_CACHE`` in a temporary folder), under each environment: 1 and 2 intra-op
threads, and (on a CPU whose torch kernels dispatch to AVX-512) the AVX2 kernels
(``ATEN_CPU_CAPABILITY=avx2``, with MKL and oneDNN held to AVX2 too), which is what another
machine of this workplace runs. It prints, per run and environment, how many cells differ
and the largest difference in images per cell, and whether the run printed any
pretraining (it must not: the default model's weights ship with the plugin).

Usage::

    python benchmarks/reproduce.py [results/digits-c/tent.json ...] [--envs 1,2,avx2]

Forward-only methods are expected to match exactly; adapting methods within one image per
cell (float kernels round differently between thread counts and instruction sets, and an
adapted model can flip a borderline image).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENVS = {
    "1": {"OMP_NUM_THREADS": "1"},
    "2": {"OMP_NUM_THREADS": "2"},
    "avx2": {
        "OMP_NUM_THREADS": "2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    },
}


def overrides_of(record: dict) -> list[str]:
    """The ``tta-bench run`` arguments that recompute ``record``'s seed 0."""
    args = ["--method", record.get("method_preset") or record["method"]]
    args += ["--suite", record["suite"], "--model", record["model"]["name"]]
    return args


def recompute(record: dict, env_name: str) -> tuple[dict, str]:
    with tempfile.TemporaryDirectory(prefix="tta-reproduce-") as tmp:
        env = {**os.environ, **ENVS[env_name], "TTA_BENCH_CACHE": str(Path(tmp) / "cache")}
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "tta_bench.cli", "run", *overrides_of(record)]
        cmd += ["--output", str(out), "seeds=[0]"]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text()), done.stdout + done.stderr


def compare(committed: dict, fresh: dict) -> tuple[int, int, float, str]:
    """(cells compared, cells that differ, largest difference in images, the capability)."""
    want = {(c["shift"], c["severity"]): c for c in committed["cells"] if c["seed"] == 0}
    differ, worst = 0, 0.0
    for c in fresh["cells"]:
        old = want[(c["shift"], c["severity"])]
        if c.get("diverged") or old.get("diverged"):
            differ += int(bool(c.get("diverged")) != bool(old.get("diverged")))
            continue
        images = abs(c["accuracy"] - old["accuracy"]) * c["n"]
        if round(images) > 0:
            differ += 1
            worst = max(worst, images)
    return len(fresh["cells"]), differ, worst, fresh["provenance"]["device"]["cpu_capability"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="committed results files")
    parser.add_argument("--envs", default="1,2,avx2", help=f"of {', '.join(ENVS)}")
    args = parser.parse_args(argv)
    from tabulate import tabulate

    from tta_bench.run.results import load_results

    files = [Path(f) for f in args.files] or sorted((ROOT / "results" / "digits-c").glob("*.json"))
    rows = []
    for path in files:
        committed = load_results(path)
        for env_name in args.envs.split(","):
            fresh, log = recompute(committed, env_name)
            n, differ, worst, cap = compare(committed, fresh)
            pretrained = "pretraining" in log.lower()
            rows.append(
                [
                    path.stem,
                    env_name,
                    cap,
                    f"{differ} of {n}",
                    f"{worst:.0f}",
                    "yes" if pretrained else "no",
                ]
            )
            print(" | ".join(str(x) for x in rows[-1]), flush=True)
    print()
    print(
        tabulate(
            rows,
            headers=["run", "env", "CPU kernels", "cells differing", "max images", "pretrained"],
            tablefmt="github",
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
