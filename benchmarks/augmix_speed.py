"""Per-core throughput of TPT's / TDA's AugMix views: the official PIL pipeline, one view at a
time, vs our batched ``make_views(..., augmix_views=True)``, on the same photographs.

    python benchmarks/augmix_speed.py [--batches 8 1] [--views 63] [--repeats 5]
                                      [--official-input 224|original]

Inputs: scikit-image's bundled photographs (astronaut, coffee, chelsea, rocket, cycled over
the batch), each brought to 224 px by the official loader's ``base_transform``
(``Resize(224, BICUBIC)`` of the shorter side + ``CenterCrop(224)``, on PIL). Ours gets these
224 px images as a float ``[B, 3, 224, 224]`` batch in [0, 1], as the runner hands them over.

Official side (azshue/TPT data/datautils.py ``AugMixAugmenter`` with ``augmix=True``, as
kdiAAA/TDA uses it; written here, not imported), per image: the original
``preprocess(base_transform(x))``, then ``--views`` times: a fresh ``preaugment`` =
``RandomResizedCrop(224)`` (torchvision's default interpolation, BILINEAR, on PIL: the
official ``get_preaugment`` passes none; BICUBIC is only ``base_transform``'s) +
``RandomHorizontalFlip()``, ``preprocess`` of the crop, w ~ Dirichlet(1, 1, 1) and
m ~ Beta(1, 1) (numpy, float32), 3 chains of 1-3 operations drawn with ``np.random.choice``
from the 9 of data/augmix_ops.py at severity 1 (level ~ U(0.1, 1), the same PIL calls as
``mura_plugin.augmix.pil_reference_op``), each chain ``preprocess``-ed and added with its
weight, then ``m * crop + (1 - m) * mix``. ``preprocess`` = ``ToTensor()`` +
``Normalize(CLIP mean, std)``: the official output is normalised float tensors, so those
conversions are timed. The official preaugment crops from the loader's *original* image, not
from the 224 px one: by default (``--official-input 224``) the official side gets the same
224 px PIL images as ours, so both do the same work on the same pixels (on a 224 px image
``base_transform`` returns it unchanged); ``--official-input original`` gives it the whole
photographs (512x512, 400x600, 300x451, 427x640) instead, its real input, where every crop is
resized from the full resolution and ``base_transform`` resizes once per image.

Ours: one ``make_views(images, views, generator, augmix_views=True)`` call per batch (the
original first, then the views), ``torch.Generator`` construction included; it returns float
views in [0, 1] (the CLIP normalisation happens in the model's preprocessing, not here). Each
batch size in ``--batches`` is timed on the first B images, so B=1 is one image per call.

Timing: one untimed warm-up of each side, then ``--repeats`` back-to-back pairs: the official
side on the largest batch's images one by one, then ours at each batch size. Views/s counts
the ``--views`` augmented views per image; the original (one per image, on both sides) is
inside the time. It prints the median views/s of each side with its range over the pairs,
and the ratio ours/official per pair (median and range).

Thread setting (printed): 1 CPU thread (``torch.set_num_threads(1)`` and 1 inter-op
thread); the official side's PIL operations and numpy draws are single-threaded, its
``ToTensor``/``Normalize`` and mixing run in torch with that setting. The official loaders
run this in ``DataLoader`` workers (several processes); per-core throughput leaves that out
on both sides. Allocator: glibc's, as the process has it (the harness sets no policy), for both
sides in this process.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import numpy as np
import torch
from PIL import Image
from torchvision import transforms

from mura_plugin.augment import make_views
from mura_plugin.augmix import pil_reference_op

SIZE = 224
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
OPS = [
    "autocontrast", "equalize", "posterize", "rotate", "solarize",
    "shear_x", "shear_y", "translate_x", "translate_y",
]  # fmt: skip
SEVERITY = 1


def photographs() -> list[Image.Image]:
    """scikit-image's bundled photographs, full resolution, as RGB PIL images."""
    from skimage import data

    return [
        Image.fromarray(p) for p in (data.astronaut(), data.coffee(), data.chelsea(), data.rocket())
    ]


BASE_TRANSFORM = transforms.Compose(
    [
        transforms.Resize(SIZE, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(SIZE),
    ]
)
PREPROCESS = transforms.Compose([transforms.ToTensor(), transforms.Normalize(CLIP_MEAN, CLIP_STD)])


def _random_op(image: Image.Image) -> Image.Image:
    """One operation drawn as the official chain draws it (global numpy state): the
    operation, then its level (all but autocontrast/equalize), then its sign (geometric)."""
    name = OPS[np.random.choice(len(OPS))]
    level = 0.0 if name in ("autocontrast", "equalize") else np.random.uniform(0.1, SEVERITY)
    negative = name in ("rotate", "shear_x", "shear_y", "translate_x", "translate_y") and (
        np.random.uniform() > 0.5
    )
    return pil_reference_op(name, image, level, negative)


def official_view(image: Image.Image) -> torch.Tensor:
    """One official AugMix view of ``image`` (PIL), normalised ``[3, 224, 224]``."""
    preaugment = transforms.Compose(
        [transforms.RandomResizedCrop(SIZE), transforms.RandomHorizontalFlip()]
    )  # built per view, as the official augmix() does
    crop = preaugment(image)
    processed = PREPROCESS(crop)
    w = np.float32(np.random.dirichlet([1.0, 1.0, 1.0]))
    m = np.float32(np.random.beta(1.0, 1.0))
    mix = torch.zeros_like(processed)
    for i in range(3):
        chain = crop.copy()
        for _ in range(np.random.randint(1, 4)):
            chain = _random_op(chain)
        mix += w[i] * PREPROCESS(chain)
    return m * processed + (1 - m) * mix


def official_views(image: Image.Image, n_views: int) -> list[torch.Tensor]:
    """The official ``AugMixAugmenter(base_transform, preprocess, n_views, augmix=True)``
    output for one image: the original, then ``n_views`` AugMix views."""
    return [PREPROCESS(BASE_TRANSFORM(image))] + [official_view(image) for _ in range(n_views)]


def time_official(images: list[Image.Image], n_views: int) -> float:
    """Wall time (s) of the official pipeline on ``images``, one by one."""
    t0 = time.perf_counter()
    for image in images:
        official_views(image, n_views)
    return time.perf_counter() - t0


def time_ours(batch: torch.Tensor, n_views: int, seed: int) -> float:
    """Wall time (s) of one ``make_views`` call on ``batch``, generator construction included."""
    t0 = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    make_views(batch, n_views, generator, augmix_views=True)
    return time.perf_counter() - t0


def span(values: list[float], fmt: str = ".1f") -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def set_threads() -> str:
    from tta_bench import buffers

    print(buffers.describe())
    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):  # already set (parallel work has started)
        torch.set_num_interop_threads(1)
    return (
        f"threads: torch {torch.get_num_threads()} intra-op, "
        f"{torch.get_num_interop_threads()} inter-op; PIL and numpy calls single-threaded"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 1], help="ours: B")
    parser.add_argument("--views", type=int, default=63, help="AugMix views per image")
    parser.add_argument("--repeats", type=int, default=5, help="(official, ours) pairs")
    parser.add_argument(
        "--official-input",
        choices=["224", "original"],
        default="224",
        help="the official side's PIL input: the 224 px images (as ours) or the photographs",
    )
    args = parser.parse_args()
    print(set_threads())
    n_images = max(args.batches)
    photos = photographs()
    sources = [photos[i % len(photos)] for i in range(n_images)]
    small = [BASE_TRANSFORM(p) for p in sources]
    batch = torch.stack([transforms.functional.pil_to_tensor(s) for s in small]).float() / 255
    official_in = small if args.official_input == "224" else sources
    where = "224 px images" if args.official_input == "224" else "full-resolution photographs"
    print(
        f"{args.views} views + the original per image; official: {n_images} images one by "
        f"one ({where}); ours: batches of {', '.join(map(str, args.batches))} at {SIZE} px; "
        f"{args.repeats} pairs, back to back"
    )

    np.random.seed(0)
    torch.manual_seed(0)
    official_views(official_in[0], 2)  # warm-up
    for b in args.batches:
        time_ours(batch[:b], 2, 0)

    official, ours = [], {b: [] for b in args.batches}
    for r in range(args.repeats):
        official.append(n_images * args.views / time_official(official_in, args.views))
        for b in args.batches:
            ours[b].append(b * args.views / time_ours(batch[:b], args.views, r))

    from tabulate import tabulate

    source = "224 px" if args.official_input == "224" else "full-res"
    rows = [[f"official (PIL, {source} input, 1 image)", span(official), ""]]
    for b in args.batches:
        ratios = [o / f for o, f in zip(ours[b], official)]
        rows.append([f"ours make_views B={b}", span(ours[b]), span(ratios, ".2f") + "x"])
    headers = ["pipeline", "views/s: median (range)", "ours/official: median (range)"]
    print(tabulate(rows, headers=headers, tablefmt="github"))
    print(
        "official output: normalised float tensors (ToTensor + Normalize, timed); ours: "
        "float views in [0, 1] (normalisation happens in the model)"
    )


if __name__ == "__main__":
    main()
