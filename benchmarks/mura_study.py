"""MuRA's step size for its SVD init, studied on the held-out shifts only.

Two parts:

1. **First-step size.** On a fixed batch of corrupted digits (``digits-c-extra``'s
   corruptions at severity 5), one adaptation step (AdamW, ``episodic=batch``: Adam's first
   step is ``lr * sign(g)`` per element, so its size does not depend on how the losses are
   batched) changes the image features of the original images by a relative amount
   ``|f1 - f0| / |f0|``, averaged over the batch. It is printed for the official TTL
   (``lora``: r = 16, alpha 32, B = 0, lr 5e-3) and for MuRA's SVD init over learning rates
   and component scales (``alpha``). The principled default is the learning rate at which
   MuRA's first step is as large as TTL's official one.
2. **Accuracy on digits-c-extra** (speckle noise, Gaussian blur, spatter, saturate; never
   the evaluation corruptions), 3 seeds, through ``tta-bench run`` into ``--dir`` (resumable):
   learning rate x alpha, then the router's learning rate at the chosen point, with the
   mean over seeds and its 95% CI, against ``lora`` and zero-shot on the same suite.

Usage::

    python benchmarks/mura_study.py [--dir results/mura-study] [--part 1|2|all]
"""

from __future__ import annotations

import argparse
import copy
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

LRS = (5e-3, 2e-3, 1e-3, 5e-4, 2e-4, 1e-4)
ALPHAS = (8.0, 32.0, 128.0)
ROUTER_LRS = (None, 1e-2, 1e-4)
SEEDS = (0, 1, 2)


def first_step_sizes() -> list[list[object]]:
    """Relative feature change of one step, per configuration (part 1)."""
    from mura_plugin.datasets.digits import digits_arrays
    from tta_bench.model import ZeroShotClassifier
    from tta_bench.registry import registry
    from tta_bench.rng import SampleGenerator
    from tta_bench.run.inputs import apply_shift
    from tta_bench.run.protocol import load_protocol

    torch.set_num_threads(1)
    bundle = registry("models").get("tiny-clip-digits")()
    protocol = load_protocol("digits-c-extra")
    stream = registry("datasets").get("digits")(split="test")
    base = ZeroShotClassifier(bundle, stream.classnames, list(protocol.templates))
    x, _ = digits_arrays("test")
    clean = torch.from_numpy(x[:32]).permute(0, 3, 1, 2).float() / 255.0
    batches = []
    for shift in protocol.shifts:
        gen = SampleGenerator.for_samples(range(32), 0, shift, 5)
        batches.append(apply_shift(registry("shifts").get(shift), clean.clone(), 5, gen, "digits"))
    images = torch.cat(batches)

    def change(method_name: str, **overrides: object) -> float:
        cls = registry("methods").get(method_name)
        cfg = cls.Config(**{"episodic": "batch", **overrides})
        out = []
        for part in images.split(32):
            method = cls(copy.deepcopy(base), cfg)
            torch.manual_seed(0)
            method.setup()
            method.reseed(0)
            with torch.no_grad():
                f0 = method.model.encode_image(part)
            method.adapt_on(method.encode_views(method.make_views(part)))
            with torch.no_grad():
                method._set_fusion()
                f1 = method.model.encode_image(part)
            out.append(((f1 - f0).norm(dim=-1) / f0.norm(dim=-1)).mean().item())
        return float(np.mean(out))

    ttl = change("lora")
    rows: list[list[object]] = [["lora (official TTL)", "-", "5e-3", f"{ttl:.2e}", "1.00"]]
    for alpha in ALPHAS:
        for lr in LRS:
            d = change("mura", lr=lr, alpha=alpha)
            rows.append(["mura (svd)", f"{alpha:g}", f"{lr:g}", f"{d:.2e}", f"{d / ttl:.2f}"])
    return rows


def run_cell(out_dir: Path, name: str, method: str, overrides: list[str]) -> dict:
    from tta_bench.run.results import load_results

    out = out_dir / f"{name}.json"
    cmd = [sys.executable, "-m", "tta_bench.cli", "run", "--method", method, "--quiet"]
    cmd += ["--suite", "digits-c-extra", "--output", str(out), "seeds=[0,1,2]", *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed: {done.stderr[-2000:]}")
    return load_results(out)


def estimate(record: dict) -> tuple[float, float, float]:
    from tta_bench.report import stats

    est = stats.suite_estimate(record)
    return 100 * est.mean, 100 * est.ci_low, 100 * est.ci_high


def accuracy_grid(out_dir: Path) -> list[list[object]]:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, method, overrides in [
        ("zeroshot", "zeroshot", []),
        ("lora", "lora", []),
    ]:
        m, lo, hi = estimate(run_cell(out_dir, name, method, overrides))
        rows.append([name, "-", "-", "-", f"{m:.2f} [{lo:.2f}, {hi:.2f}]"])
    for alpha in ALPHAS:
        for lr in LRS:
            name = f"mura_alpha{alpha:g}_lr{lr:g}"
            rec = run_cell(out_dir, name, "mura", [f"method.lr={lr}", f"method.alpha={alpha}"])
            m, lo, hi = estimate(rec)
            rows.append(["mura", f"{alpha:g}", f"{lr:g}", "lr", f"{m:.2f} [{lo:.2f}, {hi:.2f}]"])
    return rows


def router_grid(out_dir: Path, alpha: float, lr: float) -> list[list[object]]:
    rows = []
    for rlr in ROUTER_LRS:
        if rlr is None:
            continue  # the router at ``lr`` is in the main grid
        name = f"mura_alpha{alpha:g}_lr{lr:g}_router{rlr:g}"
        over = [f"method.lr={lr}", f"method.alpha={alpha}", f"method.router_lr={rlr}"]
        m, lo, hi = estimate(run_cell(out_dir, name, "mura", over))
        rows.append(["mura", f"{alpha:g}", f"{lr:g}", f"{rlr:g}", f"{m:.2f} [{lo:.2f}, {hi:.2f}]"])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="results/mura-study", help="results of part 2")
    parser.add_argument("--part", choices=("1", "2", "all"), default="all")
    parser.add_argument("--alpha", type=float, default=None, help="router grid at this alpha")
    parser.add_argument("--lr", type=float, default=None, help="router grid at this lr")
    args = parser.parse_args(argv)
    from tabulate import tabulate

    if args.part in ("1", "all"):
        print("first-step size: relative change of the original images' features")
        print(
            tabulate(
                first_step_sizes(),
                headers=["method", "alpha", "lr", "|df|/|f|", "vs TTL"],
                tablefmt="github",
            )
        )
    if args.part in ("2", "all"):
        out = Path(args.dir)
        rows = accuracy_grid(out)
        if args.alpha is not None and args.lr is not None:
            rows += router_grid(out, args.alpha, args.lr)
        print("\ndigits-c-extra (held out), mean over seeds 0-2 with its 95% CI, %")
        print(
            tabulate(
                rows,
                headers=["method", "alpha", "lr", "router lr", "accuracy [95% CI]"],
                tablefmt="github",
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
