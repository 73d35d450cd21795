"""Harness overhead: end-to-end throughput of ``zeroshot`` through the runner vs the model
alone on the same, already corrupted batches (docs/design.md#data-pipeline).

For each model the harness runs the real loop (stream, loader over the decoded cache,
transfer, shift kernels on the device, method step, scoring, one atomic results write per
cell); in a first, untimed run an observer keeps a copy of every corrupted batch the method
received, and the model-only figure is the classifier's forward over exactly those tensors
(already on the device), right after each timed harness run; the ratio is the median over
``--repeats`` such pairs. Setup (model build, decoding into the cache) is excluded from
both. Both sides run in this process with the default allocator. The ratio is printed with
its range over the pairs, not asserted. Usage::

    python benchmarks/pipeline.py [--repeats 5] [--vit-repeats 3]

The runs use a fresh cache folder (``TTA_BENCH_CACHE``, removed at the end): the untimed
first run of each figure decodes the split and, on the CPU under ``cache=auto`` (a run's
default), corrupts each domain once into the shifted-image cache
(``tta_bench.run.shifted``); the timed runs read the corrupted batches from it, as every
later run of the suite does. ``shift_cache=never`` runs the shift kernels in the loop instead.

Models: the default tiny model on the default suite (every corruption; once with the
shifted-image cache, once with ``shift_cache=never``, where the kernels are part of the loop),
the tiny model on one cheap shift (``contrast``, severities 1-5:
the harness overhead alone), and an open_clip ViT-B-32 with random weights at 224 px
(batch 64) over 1,800 images (``contrast`` at severities 1-5: five cells of the 360 digits
test images upscaled to 224 px).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tta_bench.method import NoConfig
from tta_bench.registry import registry
from tta_bench.run import runner
from tta_bench.run.protocol import load_protocol
from tta_bench.run.spec import RunSpec


def forward_seconds(model: torch.nn.Module, x: torch.Tensor) -> float:
    """Wall seconds of one no-grad forward of ``model`` on ``x`` (synchronised)."""
    cuda = x.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(x.device)
    start = time.perf_counter()
    with torch.no_grad():
        model(x).float()
    if cuda:
        torch.cuda.synchronize(x.device)
    return time.perf_counter() - start


def model_only_seconds(model: torch.nn.Module, batches: list[torch.Tensor]) -> float:
    """Seconds of ``model``'s forward over ``batches``, after one warm-up forward."""
    forward_seconds(model, batches[0])  # first-call allocations, as the harness had them
    return sum(forward_seconds(model, x) for x in batches)


def measure(
    label: str,
    model: str,
    model_args: dict[str, Any],
    repeats: int,
    shift_cache: str = "auto",
    **protocol: Any,
) -> dict[str, Any]:
    """``repeats`` pairs of (harness run, model-only pass over the same tensors), after one
    warm-up pair; the ratio is the median of the pairs' ratios (each pair runs back to
    back, so a change of load on a shared machine mostly hits both sides of one pair),
    printed with its range."""
    proto = load_protocol("digits-c", **protocol)
    spec = RunSpec(
        method="zeroshot",
        method_config=NoConfig(),
        model=model,
        model_args=model_args,
        protocol=proto,
        seeds=[0],
        progress=False,
        reference=False,
        resume=False,
        shift_cache=shift_cache,
    )
    registry("methods").get("zeroshot")  # fail early on a missing plugin
    # One model for every pair, and a first pair thrown away: freshly built weights run
    # measurably slower for a while (on this machine ~10% for ViT-B-32 over its first
    # ~15 s: the kernel collapses them into huge pages in the background), which would
    # otherwise be charged to whichever side runs first.
    torch.manual_seed(0)
    bundle = registry("models").get(model)(**model_args)
    # The warm-up run keeps a copy of every corrupted batch the method received (an
    # observer); the timed runs have no observer (its copies would be charged to the
    # harness) and see the same tensors: the stream and the corruption are functions of
    # the seed.
    seen: list[torch.Tensor] = []
    pairs: list[tuple[float, float]] = []
    for r in range(repeats + 1):
        with tempfile.TemporaryDirectory() as tmp:
            ev = runner.Evaluation(
                spec,
                Path(tmp) / "r.json",
                bundle=bundle,
                observer=(lambda s, b, x: seen.append(x.clone())) if r == 0 else None,
            )
            record = ev.run()
        # The classifier the harness used: zeroshot steps the frozen base of the domain.
        classifier = ev.inputs.base(ev.inputs.domains[0]).eval()
        pairs.append((record["loop"]["wall_s"], model_only_seconds(classifier, seen)))
        sec = ev.phase_seconds
        shift_share = sec.get("shift", 0.0) / max(sum(sec.values()), 1e-12)
    pairs = pairs[1:]  # the warm-up pair
    images = record["loop"]["images"]
    ratios = sorted(m / h for h, m in pairs)
    h_med = statistics.median(h for h, _ in pairs)
    m_med = statistics.median(m for _, m in pairs)
    out = {
        "label": label,
        "images": images,
        "batches": record["loop"]["batches"],
        "harness_img_s": images / h_med,
        "model_img_s": images / m_med,
        "ratio": statistics.median(ratios),
        "ratio_range": (ratios[0], ratios[-1]),
        "shift_share": shift_share,
        "device": str(ev.device),
        "threads": torch.get_num_threads(),
    }
    print(
        f"{label:<44} {images:>6} img  harness {out['harness_img_s']:9.1f} img/s  "
        f"model-only {out['model_img_s']:9.1f} img/s  ratio {out['ratio']:.3f} "
        f"(range {ratios[0]:.3f}-{ratios[-1]:.3f} over {repeats})  "
        f"(shift phase {100 * shift_share:.0f}% of the loop; shifted-image cache "
        f"{record['loop'].get('shift_cache')})",
        flush=True,
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="(harness, model-only) pairs per figure")
    ap.add_argument("--vit-repeats", type=int, default=3, help="pairs for ViT-B-32 (~1 min each)")
    ap.add_argument("--skip-vit", action="store_true")
    args = ap.parse_args()
    import os

    cache = tempfile.TemporaryDirectory(prefix="tta-bench-pipeline-")
    os.environ["TTA_BENCH_CACHE"] = cache.name
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"cuda {torch.cuda.is_available()}, allocator: glibc's as the process has it"
    )
    rows = [
        measure(
            "tiny-clip-digits, default suite (all shifts)", "tiny-clip-digits", {}, args.repeats
        ),
        measure(
            "tiny-clip-digits, default suite, shift_cache=never",
            "tiny-clip-digits",
            {},
            args.repeats,
            shift_cache="never",
        ),
        measure(
            "tiny-clip-digits, contrast only, sev 1-5",
            "tiny-clip-digits",
            {},
            args.repeats,
            shifts=["contrast"],
            severities=[1, 2, 3, 4, 5],
        ),
    ]
    if not args.skip_vit:
        rows.append(
            measure(
                "open_clip ViT-B-32 random init, 224 px, bs 64",
                "openclip",
                {"arch": "ViT-B-32", "allow_random": True},
                args.vit_repeats,
                shifts=["contrast"],
                severities=[1, 2, 3, 4, 5],
                severity_table="imagenet",
            )
        )
    print("\nratio = harness end-to-end throughput / model-only throughput on the same tensors")
    for r in rows:
        target = 0.95 if "ViT" in r["label"] else 0.90
        verdict = "meets" if r["ratio"] >= target else "BELOW"
        print(f"  {r['label']:<44} {r['ratio']:.3f}  ({verdict} target {target})")


if __name__ == "__main__":
    main()
