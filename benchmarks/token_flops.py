"""Forward FLOPs per sample of TCA's token condensation beside TDA's full forward (issue 43:
TCA is the one cache method that also changes the cost of a forward).

Counted by the harness's own counter (``tta_bench.run.accounting._flop_counter``: torch's
``FlopCounterMode`` with the fused attention fast path off, as ``protocol.flops=true``
counts a run), one ``step`` of each method after ``setup``, on:
  (a) the tiny default model (tiny-clip-digits, 17 tokens), 8 noisy digits at 32 px, TCA at
      its default rate 0.1 and at 0.2;
  (b) an open_clip ViT-B-16 with random weights at 224 px (197 tokens), 1 random image,
      a 10-class head (the head is not what the forward's tokens change).
TDA's step is its default (the image alone on these sets: ``views=official``), zero-shot's
the frozen forward. FLOPs do not depend on timing, so one step is counted (``--repeats``
repeats it and prints the median and range anyway, to show they are exact).

Usage: python benchmarks/token_flops.py [--skip-vit] [--repeats 2]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tta_bench.model import ZeroShotClassifier
from tta_bench.registry import registry
from tta_bench.run.accounting import _flop_counter


def count(fn, n: int) -> float:
    counter = _flop_counter(True)
    with torch.no_grad(), counter:
        fn()
    return counter.get_total_flops() / n


def method(name: str, model: ZeroShotClassifier, **overrides):
    cls = registry("methods").get(name)
    m = cls(copy.deepcopy(model), dataclasses.replace(cls.Config(), **overrides))
    m.setup()
    m.reseed(0)
    return m


def setting_rows(model: ZeroShotClassifier, images: torch.Tensor, rates: list[float], repeats: int):
    n = images.shape[0]
    rows = [("zero-shot", lambda: model(images)), ("tda", None)]
    rows += [(f"tca (rate {r:g})", r) for r in rates]
    out = []
    for label, what in rows:
        values = []
        for _ in range(repeats):
            if label == "tda":
                m = method("tda", model)
                fn = lambda m=m: m.step(images)  # noqa: E731
            elif label.startswith("tca"):
                m = method("tca", model, drop_rate=what)
                fn = lambda m=m: m.step(images)  # noqa: E731
            else:
                fn = what
            values.append(count(fn, n))
        out.append((label, statistics.median(values), min(values), max(values)))
    return out


def tiny_setting() -> tuple[ZeroShotClassifier, torch.Tensor]:
    from method_cost import tiny_setting as cost_tiny

    model, images = cost_tiny(torch.device("cpu"))  # the cost benchmark's noisy digits
    return model, images[:8]


def vit_setting() -> tuple[ZeroShotClassifier, torch.Tensor]:
    import open_clip
    from method_cost import OPENAI_MEAN, OPENAI_STD

    from tta_bench.model import ModelBundle, Preprocess

    torch.manual_seed(0)
    bundle = ModelBundle(
        clip=open_clip.create_model("ViT-B-16"),  # random weights, no download
        tokenizer=open_clip.get_tokenizer("ViT-B-16"),
        preprocess=Preprocess(224, OPENAI_MEAN, OPENAI_STD),
        name="ViT-B-16",
        weights="random",
    )
    model = ZeroShotClassifier(bundle, [f"class {i}" for i in range(10)], ["a photo of a {}."])
    images = torch.rand(1, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    return model, images


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--skip-vit", action="store_true")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    settings = [("tiny-clip-digits, 32 px", tiny_setting, [0.1, 0.2])]
    if not args.skip_vit:
        settings.append(("ViT-B-16 (random weights), 224 px", vit_setting, [0.1]))
    print("| model | method | forward FLOPs per sample (median [min, max]) | vs zero-shot |")
    print("|---|---|---|---|")
    for title, build, rates in settings:
        model, images = build()
        rows = setting_rows(model, images, rates, args.repeats)
        base = rows[0][1]
        for label, med, lo, hi in rows:
            print(
                f"| {title} | {label} | {med / 1e6:,.2f} M [{lo / 1e6:,.2f}, {hi / 1e6:,.2f}] "
                f"| {med / base:.3f}x |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
