"""Throughput of our batched corruption kernels vs the reference (PyPI ``corrupt-tta``,
numpy, one image at a time) on the same batches.

    python benchmarks/corruptions.py [--batch 64] [--ref-images 16] [--sizes 224 32]

For each size (224 px with the ``imagenet`` table, 32 px with ``cifar``) and each
corruption the reference implements, prints images/s of ours (whole batch, best of
``--repeats``) and of the reference (per image, averaged over ``--ref-images`` images of the
batch, best of ``--repeats`` passes), their ratio, and the totals (time for every
corruption once, summed). Adds the CUDA figure when a GPU is present. A kernel with a
``from_uint8`` entry (``jpeg_compression``: its codec is 8-bit) is timed through it on the
uint8 batch, as the runner calls it and as the reference gets it; its float-input figure is
printed under the table.

Thread setting (printed): both sides run with ``--threads`` CPU threads (default 1):
``torch.set_num_threads`` for ours, ``cv2.setNumThreads`` and threadpoolctl's BLAS/OpenMP
limit for the reference (numpy, scipy, scikit-image, OpenCV, Pillow), so the comparison is
per core. The reference is timed on the first ``--ref-images`` images of the batch.

Allocator: both sides run with the default allocator and page size (no tuning on either side).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from tta_bench.inputs import uint8_entry
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
    name: str, x: torch.Tensor, table: str, repeats: int, device: torch.device, uint8: bool = False
) -> float:
    """Best wall time (s) of one batched call, generator construction included; with
    ``uint8`` the kernel's ``from_uint8`` entry on ``x`` (uint8 ``[B, H, W, C]``)."""
    kernel = registry("shifts").get(name)
    if uint8:
        kernel = uint8_entry(kernel)
    best = float("inf")
    for r in range(repeats + 1):  # the first call warms caches (texture, coefficients)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        gen = SampleGenerator.for_samples(range(len(x)), 0, name, 3, device=device)
        kernel(x, 3, generator=gen, table=table)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if r:
            best = min(best, time.perf_counter() - t0)
    return best


def time_reference(name: str, u8: np.ndarray, repeats: int) -> float:
    """Mean wall time (s) per image of corrupt-tta on ``u8`` images (best of ``repeats``)."""
    import corrupt_tta

    np.random.seed(0)
    corrupt_tta.corrupt(u8[0], 3, corruption_name=name)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for im in u8:
            corrupt_tta.corrupt(im, 3, corruption_name=name)
        best = min(best, (time.perf_counter() - t0) / len(u8))
    return best


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
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+", default=[224, 32])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    print(set_threads(args.threads))
    print(
        f"batch {args.batch} (ours: whole batch, best of {args.repeats}); reference: first "
        f"{args.ref_images} images one by one, best of {args.repeats}; severity 3; CUDA {cuda}"
    )
    for size in args.sizes:
        table = TABLE_FOR_SIZE.get(size, "imagenet" if size > 100 else "cifar")
        u8 = make_batch(args.batch, size)
        x = torch.from_numpy(u8).permute(0, 3, 1, 2).float().div(255.0).contiguous()
        xg = x.cuda() if cuda else None
        u8_g = torch.from_numpy(u8).cuda() if cuda else None
        header = f"{'corruption':18s} {'ours img/s':>11s} {'ref img/s':>10s} {'ratio':>7s}"
        print(f"\n{size} px, table {table!r}\n" + header + ("  cuda img/s" if cuda else ""))
        tot_ours = tot_ref = tot_cuda = 0.0
        notes = []
        for name in ORDER:
            # A kernel with a ``from_uint8`` entry is timed through it on the uint8 batch
            # (the reference's input, and what the runner hands it); its float entry is
            # printed below the table.
            direct = uint8_entry(registry("shifts").get(name)) is not None
            cpu = torch.device("cpu")
            src, src_g = (torch.from_numpy(u8), u8_g) if direct else (x, xg)
            t_ours = time_ours(name, src, table, args.repeats, cpu, uint8=direct) / len(x)
            t_ref = time_reference(name, u8[: args.ref_images], args.repeats)
            tot_ours, tot_ref = tot_ours + t_ours, tot_ref + t_ref
            label = name + ("*" if direct else "")
            line = f"{label:18s} {1 / t_ours:11.1f} {1 / t_ref:10.1f} {t_ref / t_ours:7.1f}x"
            if cuda:
                t_cuda = time_ours(
                    name, src_g, table, args.repeats, torch.device("cuda"), uint8=direct
                ) / len(x)
                tot_cuda += t_cuda
                line += f" {1 / t_cuda:11.1f}"
            print(line, flush=True)
            if direct:
                t_float = time_ours(name, x, table, args.repeats, cpu) / len(x)
                notes.append(
                    f"* {name}: from the uint8 batch (its from_uint8 entry, the runner's "
                    f"path); from float input {1 / t_float:.1f} img/s ({t_ref / t_float:.1f}x)"
                )
        line = f"{'TOTAL':18s} {1 / tot_ours:11.1f} {1 / tot_ref:10.1f} {tot_ref / tot_ours:7.1f}x"
        print(line + (f" {1 / tot_cuda:11.1f}" if cuda else ""))
        for note in notes:
            print(note)


if __name__ == "__main__":
    main()
