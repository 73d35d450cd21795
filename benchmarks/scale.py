"""ImageNet scale: time to first batch, streaming decode throughput, disk and memory.

Builds (once, under the cache dir) a synthetic folder in the published ImageNet-C layout,
``<root>/<corruption>/<severity>/<wnid>/<n>.JPEG`` at 224 px (15 corruptions, severity 5,
1,000 class folders, ``--per-class`` images each), then measures:

* **time to first batch** of ``tta-bench run --suite imagenet-c-50k --model openclip
  model.allow_random=true`` (``cache=auto``: large splits are streamed, small ones decoded
  into the cache when the stream reaches them), from the start of the run to the first
  corrupted batch reaching the method, in a cache directory of its own: with both caches
  empty (the text head, 1,000 classes x one template, is encoded and written), with the
  text head cached and no decoded image, and with both warm;
* **steady decode throughput** vs loader workers: the harness's streaming source
  (``tta_bench.run.sources.DecodingSource`` through ``tta_bench.run.loader``) against a plain
  ``torch.utils.data.DataLoader`` whose workers read the same files and decode them with
  ``torchvision.io.decode_jpeg`` (the reference), median and range over ``--repeats``;
* **disk used** by the decoded cache during the run, and **peak RSS**;
* the **projection** to full ImageNet-C (50,000 x 15 x 5 = 3.75 M images) on 2 and 16
  cores from the per-worker streaming rate (decoding only; the model's time comes on top).

Usage::

    python benchmarks/scale.py [--per-class 1] [--workers 0,1,2] [--repeats 3]

Run it on an idle machine (``uptime``): the figures are timings. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def corruptions() -> tuple[str, ...]:
    """The ImageNet-C corruptions in their pinned order (the suite's own list)."""
    from tta_bench.run.protocol import load_protocol

    return load_protocol("imagenet-c-50k").shifts


FULL_IMAGES = 50_000 * 15 * 5
TEMPLATE = "a photo of a {}."


def build(root: Path, per_class: int) -> Path:
    """The synthetic ImageNet-C folder (written once; a marker file says it is whole)."""
    from PIL import Image, ImageFilter

    from tta_bench.catalog import entry

    marker = root / ".complete"
    if marker.exists():
        return root
    wnids = entry("datasets", "imagenet")["wnids"]
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for k, corruption in enumerate(corruptions()):
        for c, wnid in enumerate(wnids):
            folder = root / corruption / "5" / wnid
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                small = (rng.random((28, 28, 3)) * 255).astype(np.uint8)
                img = Image.fromarray(small).resize((224, 224), Image.BILINEAR)
                img = img.filter(ImageFilter.GaussianBlur(1 + (c + k + i) % 3))
                img.save(folder / f"ILSVRC2012_val_{c * per_class + i:08d}.JPEG", quality=85)
        print(f"  built {corruption} ({time.perf_counter() - start:.0f} s)", flush=True)
    marker.write_text("ok")
    return root


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def time_to_first_batch(root: Path, arch: str) -> dict[str, float]:
    """Seconds from the start of a run to its first batch, in a cache directory of its own:
    with both caches empty, with the text head cached but no decoded image, and with both
    warm; and the decoded cache's growth over each (one batch: only what it reads)."""
    import torch

    from tta_bench.config import compose
    from tta_bench.run import cache as decoded_cache
    from tta_bench.run import runner
    from tta_bench.run.spec import spec_from_config

    cfg = compose(
        [
            "suite=imagenet-c-50k",
            f"data_dir={root}",
            f"model.arch={arch}",
            "model.allow_random=true",
            "reference=false",
            "progress=false",
            "cache=auto",
            # one template: the text head is measured, and cached, but 1,000 x 80 prompts
            # through a CPU text tower would dominate the first-batch figure (see README)
            f"protocol.templates=['{TEMPLATE}']",
        ],
        method="zeroshot",
        model="openclip",
    )
    spec = spec_from_config(cfg, "zeroshot", "openclip")
    out: dict[str, float] = {}
    previous = os.environ.get("TTA_BENCH_CACHE")
    with tempfile.TemporaryDirectory(prefix="tta-scale-cache-") as cache:
        os.environ["TTA_BENCH_CACHE"] = cache
        decoded = Path(cache) / "decoded"
        try:
            for label, clear_decoded in (
                ("empty caches", False),
                ("text head cached, no decoded image", True),
                ("both caches warm", False),
            ):
                if clear_decoded:
                    decoded_cache.clear_cache()
                first: list[float] = []
                disk_before = _dir_bytes(decoded) if decoded.exists() else 0
                start = time.perf_counter()

                def observer(_seed, _batch, _x, first=first):
                    if not first:
                        first.append(time.perf_counter())

                with tempfile.TemporaryDirectory() as tmp:
                    runner.Evaluation(
                        spec, Path(tmp) / "r.json", observer=observer, max_batches=1
                    ).run()
                out[f"first batch, {label} (s)"] = first[0] - start
                grown = (_dir_bytes(decoded) if decoded.exists() else 0) - disk_before
                out[f"decoded cache growth, {label} (MB)"] = grown / 2**20
        finally:
            if previous is None:
                os.environ.pop("TTA_BENCH_CACHE", None)
            else:
                os.environ["TTA_BENCH_CACHE"] = previous
    out["torch threads"] = float(torch.get_num_threads())
    return out


class _PlainJpegFiles:
    """The reference: read a file and ``decode_jpeg`` it, nothing else (all at 224 px)."""

    def __init__(self, files: list[str]):
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        from torchvision.io import ImageReadMode, decode_jpeg, read_file

        return decode_jpeg(read_file(self.files[i]), ImageReadMode.RGB)


def _steady_rate(loader, images_of) -> float:
    """Images per second after the first batch (worker start-up and first imports are
    paid once per run, not per batch)."""
    it = iter(loader)
    next(it)
    start, got = time.perf_counter(), 0
    for item in it:
        got += len(images_of(item))
    return got / (time.perf_counter() - start)


def decode_throughput(
    root: Path, workers: list[int], repeats: int, images: int
) -> list[dict[str, object]]:
    """img/s of the harness's streaming source and of the plain reference, per worker count."""
    import torch

    from tta_bench.registry import registry
    from tta_bench.run.loader import LoaderSettings, StreamBatches, make_loader
    from tta_bench.run.sources import DecodingSource
    from tta_bench.run.stream import Batch

    stream = registry("datasets").get("imagenet_c")(
        shift="gaussian_noise", severity=5, data_dir=str(root)
    )
    n = min(images, len(stream))
    bs = 64
    batches = [
        Batch(k, np.arange(s, min(n, s + bs)), np.zeros(min(n, s + bs) - s, np.int64), False, 0)
        for k, s in enumerate(range(0, n, bs))
    ]
    files = [r["path"] for r in DecodingSource(stream, 224).dataset[:n]["image"]]
    rows = []
    for w in workers:
        ours, plain = [], []
        for _ in range(repeats):
            settings = LoaderSettings(w, False, 2 if w else None, False)
            data = StreamBatches(batches, [DecodingSource(stream, 224)], [0], [stream.labels])
            start = time.perf_counter()
            got = sum(len(item["images"]) for item in make_loader(data, settings))
            ours.append(got / (time.perf_counter() - start))
            loader = torch.utils.data.DataLoader(
                _PlainJpegFiles(files),
                batch_size=bs,
                num_workers=w,
                prefetch_factor=2 if w else None,
            )
            start = time.perf_counter()
            got = sum(len(b) for b in loader)
            plain.append(got / (time.perf_counter() - start))
        ratio = [a / b for a, b in zip(ours, plain)]
        rows.append(
            {
                "workers": w,
                "harness img/s": statistics.median(ours),
                "harness range": (min(ours), max(ours)),
                "plain decode_jpeg img/s": statistics.median(plain),
                "plain range": (min(plain), max(plain)),
                "ratio": statistics.median(ratio),
                "ratio range": (min(ratio), max(ratio)),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-class", type=int, default=1, help="images per class folder")
    parser.add_argument("--workers", default="0,1,2", help="loader worker counts to measure")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--images", type=int, default=1000, help="images per throughput pass")
    parser.add_argument("--arch", default="ViT-B-32", help="open_clip architecture (random)")
    parser.add_argument("--skip-first-batch", action="store_true")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    from tabulate import tabulate

    from tta_bench import buffers

    print(buffers.describe())

    from tta_bench.paths import cache_dir

    print(f"cores {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}")
    root = build(cache_dir() / "scale" / f"imagenet-c-synthetic-{args.per_class}pc", args.per_class)
    n_files = sum(1 for _ in root.rglob("*.JPEG"))
    print(f"synthetic ImageNet-C: {root} ({n_files} JPEGs, {_dir_bytes(root) / 2**20:.0f} MB)")
    report: dict[str, object] = {"files": n_files}
    if not args.skip_first_batch:
        first = time_to_first_batch(root, args.arch)
        report["first_batch"] = first
        print(tabulate([[k, f"{v:.2f}"] for k, v in first.items()], headers=["", "value"]))
    workers = [int(w) for w in args.workers.split(",")]
    rows = decode_throughput(root, workers, args.repeats, args.images)
    report["throughput"] = rows

    def span(value: float, rng: tuple[float, float], fmt: str) -> str:
        return f"{value:{fmt}} ({rng[0]:{fmt}}-{rng[1]:{fmt}})"

    table = [
        [
            r["workers"],
            span(r["harness img/s"], r["harness range"], ".0f"),
            span(r["plain decode_jpeg img/s"], r["plain range"], ".0f"),
            span(r["ratio"], r["ratio range"], ".2f"),
        ]
        for r in rows
    ]
    headers = ["workers", "harness img/s (range)", "plain img/s (range)", "ratio (range)"]
    print("\n" + tabulate(table, headers=headers))
    per_worker = max(r["harness img/s"] / max(1, r["workers"]) for r in rows if r["workers"])
    best2 = max(r["harness img/s"] for r in rows)
    projection = {
        "2 cores (measured best), minutes": FULL_IMAGES / best2 / 60,
        "16 cores (15 workers x the per-worker rate), minutes": FULL_IMAGES
        / (15 * per_worker)
        / 60,
    }
    report["projection"] = projection
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    peak_children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    report["peak_rss_mb"] = {"main": peak, "largest worker": peak_children}
    print(
        f"\nprojection, decoding full ImageNet-C ({FULL_IMAGES:,} images) while streaming: "
        + "; ".join(f"{k} {v:.1f}" for k, v in projection.items())
    )
    print(f"peak RSS: main process {peak:.0f} MB, largest loader worker {peak_children:.0f} MB")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=list))
    return 0


if __name__ == "__main__":
    sys.exit(main())
