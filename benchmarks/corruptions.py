"""Throughput of our batched corruption kernels vs the reference (PyPI ``corrupt-tta``,
numpy, one image at a time) on the same batches.

    python benchmarks/corruptions.py [--batch 64] [--ref-images 16] [--sizes 224 32]

For each size (224 px with the ``imagenet`` table, 32 px with ``cifar``) and each
corruption the reference implements, ``--repeats`` pairs are timed back to back: one call of
ours on the whole batch, then the reference image by image on ``--ref-images`` images of
it. It prints images/s of both (median over the pairs), the median ratio with its range
over the pairs, and the totals (every corruption once, summed, per pair; median and
range). Adds the CUDA figure when a GPU is present. A kernel with a
``from_uint8`` entry (``jpeg_compression``: its codec is 8-bit) is timed through it on the
uint8 batch, as the runner calls it and as the reference gets it; its float-input figure is
printed under the table.

Thread setting (printed): both sides run with ``--threads`` CPU threads (default 1):
``torch.set_num_threads`` for ours, ``cv2.setNumThreads`` and threadpoolctl's BLAS/OpenMP
limit for the reference (numpy, scipy, scikit-image, OpenCV, Pillow), so the comparison is
per core. The reference is timed on the first ``--ref-images`` images of the batch.

Allocator: both sides run in one process with the C library's allocator as the process
has it (glibc's default unless the environment sets ``MALLOC_*``; the harness sets no
policy): our kernels take their batch-sized outputs and scratch from
``tta_bench.buffers`` (recycled from one call to the next). Each size ends with the time
of a fresh output batch written once, the floor under any
batched kernel that returns a new batch (the reference's per-image arrays are small enough
for the allocator to reuse either way).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

try:
    from tta_bench.run.inputs import uint8_entry
except ImportError:  # an older tree (before/after comparisons): it lived in the runner
    from tta_bench.run.inputs import uint8_entry
from tta_bench.registry import registry
from tta_bench.rng import SampleGenerator

TABLE_FOR_SIZE = {224: "imagenet", 32: "cifar"}
ORDER = [
    "gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur",
    "motion_blur", "zoom_blur", "snow", "frost", "fog", "brightness", "contrast",
    "elastic_transform", "pixelate", "jpeg_compression",
    "speckle_noise", "gaussian_blur", "spatter", "saturate",
]  # fmt: skip


def make_batch(batch: int, size: int) -> np.ndarray:
    """``[batch, size, size, 3]`` uint8 crops of scikit-image's bundled photographs."""
    from PIL import Image
    from skimage import data

    photos = [data.astronaut(), data.coffee(), data.chelsea(), data.rocket()]
    rng = np.random.default_rng(0)
    out = []
    for i in range(batch):
        img = photos[i % len(photos)]
        h, w = img.shape[:2]
        side = int(rng.integers(min(h, w) // 2, min(h, w)))
        top, left = int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1))
        crop = Image.fromarray(img[top : top + side, left : left + side])
        out.append(np.asarray(crop.resize((size, size), Image.BILINEAR)))
    return np.stack(out)


def time_ours(
    name: str, x: torch.Tensor, table: str, device: torch.device, uint8: bool = False
) -> float:
    """Wall time (s) of one batched call, generator construction included; with ``uint8``
    the kernel's ``from_uint8`` entry on ``x`` (uint8 ``[B, H, W, C]``)."""
    kernel = registry("shifts").get(name)
    if uint8:
        kernel = uint8_entry(kernel)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    gen = SampleGenerator.for_samples(range(len(x)), 0, name, 3, device=device)
    kernel(x, 3, generator=gen, table=table)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def time_reference(name: str, u8: np.ndarray) -> float:
    """Mean wall time (s) per image of corrupt-tta on ``u8`` images."""
    import corrupt_tta

    t0 = time.perf_counter()
    for im in u8:
        corrupt_tta.corrupt(im, 3, corruption_name=name)
    return (time.perf_counter() - t0) / len(u8)


def warm_up(name: str, src: torch.Tensor, u8: np.ndarray, table: str, direct: bool) -> None:
    """One untimed call of each side (caches: textures, filters, coefficients)."""
    import corrupt_tta

    np.random.seed(0)
    time_ours(name, src, table, torch.device("cpu"), uint8=direct)
    corrupt_tta.corrupt(u8[0], 3, corruption_name=name)


def span(values: list[float], fmt: str = ".1f") -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def set_threads(n: int) -> str:
    """Limit both sides to ``n`` CPU threads; returns a description of what was set."""
    import cv2
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(n)
    cv2.setNumThreads(n)
    threadpool_limits(n)
    return f"{n} CPU thread(s) for both sides (torch, OpenCV, BLAS/OpenMP)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ref-images", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5, help="(ours, reference) pairs")
    parser.add_argument("--sizes", type=int, nargs="+", default=[224, 32])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    print(set_threads(args.threads))
    from tta_bench import buffers

    print(buffers.describe())
    print(
        f"batch {args.batch} (ours: whole batch); reference: first {args.ref_images} images "
        f"one by one; {args.repeats} pairs each, back to back; severity 3; CUDA {cuda}"
    )
    cpu = torch.device("cpu")
    for size in args.sizes:
        table = TABLE_FOR_SIZE.get(size, "imagenet" if size > 100 else "cifar")
        u8 = make_batch(args.batch, size)
        x = torch.from_numpy(u8).permute(0, 3, 1, 2).float().div(255.0).contiguous()
        print(f"\n{size} px, table {table!r}")
        rows, notes = [], []
        tot_ours, tot_ref = [0.0] * args.repeats, [0.0] * args.repeats
        for name in ORDER:
            # A kernel with a ``from_uint8`` entry is timed through it on the uint8 batch
            # (the reference's input, and what the runner hands it); its float entry is
            # printed below the table.
            direct = uint8_entry(registry("shifts").get(name)) is not None
            src = torch.from_numpy(u8) if direct else x
            warm_up(name, src, u8, table, direct)
            ours, ref = [], []
            for r in range(args.repeats):
                ours.append(time_ours(name, src, table, cpu, uint8=direct) / len(x))
                ref.append(time_reference(name, u8[: args.ref_images]))
                tot_ours[r] += ours[-1]
                tot_ref[r] += ref[-1]
            ratios = [b / a for a, b in zip(ours, ref)]
            label = name + ("*" if direct else "")
            rows.append(
                [label, f"{1 / statistics.median(ours):.1f}", f"{1 / statistics.median(ref):.1f}"]
                + [span(ratios) + "x"]
            )
            print(" | ".join(rows[-1]), flush=True)
            if direct:
                t_float = statistics.median(
                    time_ours(name, x, table, cpu) / len(x) for _ in range(args.repeats)
                )
                notes.append(
                    f"* {name}: from the uint8 batch (its from_uint8 entry, the runner's "
                    f"path); from float input {1 / t_float:.1f} img/s "
                    f"({statistics.median(ref) / t_float:.1f}x)"
                )
        totals = [b / a for a, b in zip(tot_ours, tot_ref)]
        rows.append(
            [
                "TOTAL",
                f"{1 / statistics.median(tot_ours):.1f}",
                f"{1 / statistics.median(tot_ref):.1f}",
                span(totals) + "x",
            ]
        )
        from tabulate import tabulate

        headers = ["corruption", "ours img/s", "ref img/s", "ratio: median (range)"]
        print(tabulate(rows, headers=headers, tablefmt="github"))
        slower = [r[0] for r in rows[:-1] if float(r[3].split()[0]) < 1.0]
        print("slower than the reference: " + (", ".join(slower) if slower else "none"))
        for note in notes:
            print(note)
        touch = fresh_batch_seconds(x.shape, args.repeats)
        print(
            f"a fresh float batch of this shape, allocated and written once (the least a "
            f"batched kernel's output costs): {1e3 * statistics.median(touch):.1f} ms "
            f"({1e3 * min(touch):.1f}-{1e3 * max(touch):.1f}), "
            f"{len(x) / statistics.median(touch):.0f} img/s"
        )


def fresh_batch_seconds(shape: torch.Size, repeats: int) -> list[float]:
    """Wall seconds of allocating a float tensor of ``shape`` and writing it once, each time
    a new one (what any kernel returning a new batch pays before its arithmetic: above
    glibc's 32 MiB mapping threshold, fresh zero pages touched for the first time)."""
    out = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        torch.empty(shape).fill_(0.5)
        out.append(time.perf_counter() - t0)
    return out[1:]


if __name__ == "__main__":
    main()
