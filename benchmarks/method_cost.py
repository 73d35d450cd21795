"""Cost of every registered method on the same inputs: time per sample, peak memory,
trainable parameters, and ratios to zero-shot.

Two settings, measured in one run:
  (a) the tiny default model (tiny-clip-digits), a batch of 64 noisy digits;
  (b) an open_clip ViT-B-32 with random weights at 224 px and a 1,000-class text head
      (random class names, prompt "a photo of a {}."), 1 image; multi-view methods use
      their default 63 views + the original. CPU unless --device says otherwise.
Each method is set up, warmed up with one step, then reset, reseeded and timed on one
``step`` ``--repeats`` times: the median and the range are reported (TPT on ViT-B-32,
~1 min a step, twice); peak memory is the CPU RSS growth (or the CUDA allocator peak)
during those steps. Methods that ask for clean source images (EATA's Fisher) get that
many random images of the setting's size, outside the timing.

Usage: python benchmarks/method_cost.py [--methods a,b] [--skip-tiny] [--skip-vit]

Peak memory against the batch (``--memory``): TDA's multi-view input, TPT, TTL (``lora``),
ZERO and MuRA on ViT-B-32 (random weights) at 224 px with their default views (63 + the
original), batches of 1, 8, 32 and 64 random images (``--batches``), a ``--memory-classes``
class head (10: TPT re-encodes its prompts per sample, and the head is not what grows).
Each (method, batch) runs one ``step`` in a fresh process (no allocator reuse between
cells, no warm-up; glibc's allocator as the environment sets it); it prints the peak
RSS growth of the step (MB), seconds per image (first-call set-up included), and the
growth from batch 1. With ``--live`` each cell runs
a second time with glibc told to return freed blocks at once
(``MALLOC_MMAP_THRESHOLD_=131072 MALLOC_TRIM_THRESHOLD_=131072``, for that process only):
the peak of the memory the step holds, without what the allocator keeps for reuse;
``--only-live`` runs those cells only, and ``--warm`` first takes one step on another
image in each of them, then ``reset()``, so that first-call state (kernel caches, the
first backward's buffers) is in the base rather than in the growth.

    python benchmarks/method_cost.py --memory [--live] [--batches 1,8,32,64] [--methods tda,mura]
        [--view-memory-mb 8]

``--view-memory-mb`` sets the methods' view budget (``view_memory_mb``). MuRA's adapted
copies wait for its router's step where ``copies_wait`` says (``--copies-wait``, default
``disk``); the table's last column gives the bytes they took there (on disk: not in RSS).

Compute rate (``--flops``), on the tiny model (batch of 64 at 32 px): the GFLOP/s of a
plain 2048 x 2048 float32 matmul on the same threads (the machine's compute limit), and
for MuRA, TTL (``lora``) and TPT one ``step``'s FLOPs (torch's ``FlopCounterMode``:
matmuls, convolutions and attention, forward and backward) over its median time
(``--repeats``), as GFLOP/s and as a share of the matmul rate; and the TENT loop: the
harness's ``tent`` step against a bare loop of the same computation (forward, entropy,
backward, Adam step on the same LayerNorm parameters), median of paired repeats.

    python benchmarks/method_cost.py --flops [--repeats 5]
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import string
import time
from typing import Any

import torch

from mura_plugin.methods._views import COPIES_WAIT
from tta_bench.model import ModelBundle, Preprocess, ZeroShotClassifier
from tta_bench.registry import registry
from tta_bench.run.cost import PeakMemory

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


def tiny_setting(device: torch.device) -> tuple[ZeroShotClassifier, torch.Tensor]:
    from mura_plugin.datasets.digits import digits_arrays

    bundle = registry("models").get("tiny-clip-digits")()
    stream = registry("datasets").get("digits")(split="test")
    from tta_bench.run.protocol import load_protocol

    templates = list(load_protocol("digits-c").templates)
    model = ZeroShotClassifier(bundle, stream.classnames, templates).to(device)
    x, _ = digits_arrays("test")
    images = torch.from_numpy(x[:64]).permute(0, 3, 1, 2).float() / 255.0
    noise = torch.randn(images.shape, generator=torch.Generator().manual_seed(0))
    return model, (images + 0.3 * noise).clamp(0, 1).to(device)


def random_classnames(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(
            "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 9)))
            for _ in range(rng.randint(1, 2))
        )
        for _ in range(n)
    ]


def vit_setting(device: torch.device, classes: int) -> tuple[ZeroShotClassifier, torch.Tensor]:
    import open_clip

    torch.manual_seed(0)
    clip = open_clip.create_model("ViT-B-32")  # random weights, no download
    bundle = ModelBundle(
        clip=clip,
        tokenizer=open_clip.get_tokenizer("ViT-B-32"),
        preprocess=Preprocess(224, OPENAI_MEAN, OPENAI_STD),
        name="ViT-B-32",
        weights="random",
    )
    start = time.perf_counter()
    model = ZeroShotClassifier(bundle, random_classnames(classes), ["a photo of a {}."])
    print(f"  ({classes}-class text head built in {time.perf_counter() - start:.1f} s)")
    images = torch.rand(1, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    return model.to(device), images.to(device)


def measure(
    name: str, model: ZeroShotClassifier, images: torch.Tensor, repeats: int
) -> dict[str, float]:
    method_cls = registry("methods").get(name)
    torch.manual_seed(0)
    method = method_cls(copy.deepcopy(model), method_cls.Config())
    needed = method.source_images_needed()
    if needed:  # EATA's Fisher information: set up outside the timing
        gen = torch.Generator().manual_seed(1)
        method.set_source(torch.rand(needed, *images.shape[1:], generator=gen).to(images.device))
    method.setup()
    method.reseed(0)
    method.step(images)  # warm-up: lazy allocations, kernel selection
    device = images.device
    times, peak = [], 0
    for rep in range(max(1, repeats)):
        method.reset()
        method.reseed(1 + rep)
        with PeakMemory(device) as mem:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            method.step(images)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        peak = max(peak, mem.peak_bytes)
    n = images.shape[0]
    return {
        "s_per_sample": statistics.median(times) / n,
        "min": min(times) / n,
        "max": max(times) / n,
        "peak_mb": peak / 2**20,
        "trainable": sum(p.numel() for p in method.trainable_parameters()),
    }


def report(title: str, rows: dict[str, dict[str, float]]) -> None:
    from tabulate import tabulate

    ref = rows.get("zeroshot", {}).get("s_per_sample")
    table = [
        [
            name,
            f"{r['s_per_sample'] * 1000:.1f} ({r['min'] * 1000:.1f}-{r['max'] * 1000:.1f})",
            f"{r['s_per_sample'] / ref:.1f}x" if ref else "-",
            f"{r['peak_mb']:.0f}",
            f"{r['trainable']:,}",
        ]
        for name, r in rows.items()
    ]
    print(f"\n{title}")
    headers = ["method", "ms/sample: median (range)", "vs zeroshot", "peak MB", "trainable"]
    print(tabulate(table, headers=headers, tablefmt="github"))
    if {"mura", "tpt", "lora"} <= rows.keys():
        m, t, lo = (rows[k]["s_per_sample"] for k in ("mura", "tpt", "lora"))
        print(f"mura/tpt = {m / t:.2f} (target <= 0.5), mura/lora = {m / lo:.2f} (target < 1)")


#: The multi-view methods of the memory table, with what makes each build views.
MEMORY_METHODS = {
    "tda": {"views": "multi"},
    "tpt": {},
    "lora": {},
    "zero": {},
    "mura": {},
}


def memory_cell(
    name: str,
    batch: int,
    classes: int,
    view_memory_mb: float | None = None,
    copies_wait: str | None = None,
    warm: bool = False,
) -> dict[str, float]:
    """One ``step`` of ``name`` on ``batch`` random 224 px images (ViT-B-32), the first of
    the process (no warm-up: memory freed by an earlier step would be reused unseen): its
    peak RSS growth and time (first-call kernel set-up included, the same at every
    batch). ``view_memory_mb`` overrides the method's default budget, ``copies_wait``
    MuRA's (``waited_mb``: what its copies took there, 0 when none waited). ``warm``: one
    step on one other image first, then ``reset()``, so that first-call state (kernel
    caches, the first backward's buffers) is in the base, not in the step's growth: only
    meaningful where freed blocks go back to the system. The process keeps
    glibc's allocator as its environment sets it (``RETURN_FREED`` or the default)."""
    import dataclasses
    import os

    policy = "return-freed" if "MALLOC_MMAP_THRESHOLD_" in os.environ else "system"
    model, _ = vit_setting(torch.device("cpu"), classes)
    cls = registry("methods").get(name)
    cfg = dataclasses.replace(cls.Config(), **MEMORY_METHODS.get(name, {}))
    if view_memory_mb is not None:
        cfg = dataclasses.replace(cfg, view_memory_mb=view_memory_mb)
    if copies_wait is not None and any(f.name == "copies_wait" for f in dataclasses.fields(cfg)):
        cfg = dataclasses.replace(cfg, copies_wait=copies_wait)
    torch.manual_seed(0)
    method = cls(model, cfg)
    method.setup()
    images = torch.rand(batch, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    if warm:
        method.reseed(2)
        method.step(torch.rand(1, 3, 224, 224, generator=torch.Generator().manual_seed(1)))
        method.reset()
    method.reseed(1)
    with PeakMemory(torch.device("cpu")) as mem:
        start = time.perf_counter()
        method.step(images)
        seconds = time.perf_counter() - start
    waited = getattr(method, "copies_waited", ("", 0))
    return {
        "peak_mb": mem.peak_bytes / 2**20,
        "s_per_image": seconds / batch,
        "malloc": policy,
        "waited": f"{waited[1] / 2**20:.1f} ({waited[0]})" if waited[0] else "-",
    }


#: glibc settings under which freed blocks go back to the system at once (``--live``).
RETURN_FREED = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def memory_table(
    names: list[str],
    batches: list[int],
    classes: int,
    live: bool,
    view_memory_mb: float | None = None,
    copies_wait: str | None = None,
    warm: bool = False,
    only_live: bool = False,
) -> None:
    import json
    import os
    import subprocess
    import sys

    from tabulate import tabulate

    def cell(name: str, batch: int, env: dict[str, str], warm: bool = False) -> dict[str, float]:
        code = (
            "import json, sys; sys.path.insert(0, 'benchmarks'); import method_cost as m; "
            f"print(json.dumps(m.memory_cell({name!r}, {batch}, {classes}, {view_memory_mb!r}, "
            f"{copies_wait!r}, {warm!r})))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, **env},
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    rows, policies = [], set()
    live = live or only_live
    for name in names:
        base = base_live = None
        for batch in batches:
            row, note, waited = [name, batch], f"  {name} batch {batch}:", "-"
            if not only_live:
                got = cell(name, batch, {})
                policies.add(got["malloc"])
                base = got["peak_mb"] if base is None else base
                row += [f"{got['peak_mb']:.0f}", f"{got['peak_mb'] - base:+.0f}",
                        f"{got['s_per_image']:.2f}"]  # fmt: skip
                note += f" {got['peak_mb']:.0f} MB"
                waited = got["waited"]
            if live:
                held = cell(name, batch, RETURN_FREED, warm)
                base_live = held["peak_mb"] if base_live is None else base_live
                row += [f"{held['peak_mb']:.0f}", f"{held['peak_mb'] - base_live:+.0f}"]
                note += f" {held['peak_mb']:.0f} MB returning freed blocks"
                if only_live:
                    row.append(f"{held['s_per_image']:.2f}")
                waited = held["waited"]
            row.append(waited)
            rows.append(row)
            print(note, flush=True)
    budget = "at its default" if view_memory_mb is None else view_memory_mb
    print(f"\nPeak RSS growth of one step, ViT-B-32 at 224 px, {classes} classes, "
          f"view_memory_mb {budget}")  # fmt: skip
    headers = ["method", "batch"]
    if not only_live:
        print(f"'peak MB' with glibc's allocator as the process had it: "
              f"{', '.join(sorted(policies))}")  # fmt: skip
        headers += ["peak MB", "vs batch 1", "s/image"]
    if live:
        warmed = ", after a warm-up step" if warm else ""
        headers += [f"peak MB, freed blocks returned{warmed}", "vs batch 1"]
        if only_live:
            headers.append("s/image")
    headers.append("copies waited, MB (where)")
    print(tabulate(rows, headers=headers, tablefmt="github"))


def matmul_gflops(n: int = 2048, repeats: int = 10) -> float:
    """GFLOP/s of an ``n x n`` float32 matmul (median of ``repeats``, after a warm-up)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times) / 1e9


def step_flops(method, images: torch.Tensor) -> int:
    """FLOPs of one ``step`` (forward and backward), counted by ``FlopCounterMode`` with
    the attention fast path off (the fused kernel is invisible to the counter), as a run
    counts them (``tta_bench.run.accounting``)."""
    from torch.utils.flop_counter import FlopCounterMode

    method.reset()
    method.reseed(0)
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with FlopCounterMode(display=False) as counter:
            method.step(images)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    return int(counter.get_total_flops())


def record_matmuls(method, images: torch.Tensor) -> list[tuple[Any, Any, Any]]:
    """The matrix products of one ``step`` (every op torch's FLOP counter counts: mm,
    addmm, bmm, baddbmm, convolutions, attention; forward and backward), each as ``(op,
    args, kwargs)`` with its tensors replaced by ``(shape, stride, dtype)``; with the
    attention fast path off, as the FLOP count has it (``tta_bench.run.accounting``)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map
    from torch.utils.flop_counter import flop_registry

    def spec(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return ("tensor", tuple(a.shape), tuple(a.stride()), a.dtype)
        return a

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[Any, Any, Any]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = kwargs or {}
            if getattr(func, "overloadpacket", None) in flop_registry:
                self.calls.append((func, tree_map(spec, args), tree_map(spec, kwargs)))
            return func(*args, **kwargs)

    method.reset()
    method.reseed(0)
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with Recorder() as recorder:
            method.step(images)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    return recorder.calls


def same_shape_rate(calls: list[tuple[Any, Any, Any]], repeats: int) -> tuple[float, int]:
    """``(GFLOP/s, FLOPs)`` of the recorded matrix products run alone, one after the other
    on random tensors of the same shapes, strides and dtypes (median over ``repeats``
    passes, after a warm-up): the rate the step's own matrix shapes allow on this machine."""
    from torch.utils._pytree import tree_map
    from torch.utils.flop_counter import FlopCounterMode

    gen = torch.Generator().manual_seed(0)

    def make(a: Any) -> Any:
        if _is_spec(a):
            _, shape, stride, dtype = a
            # one storage of the size the strides reach (expanded operands share values)
            size = 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else 0
            if dtype.is_floating_point:
                base = torch.randn(size, generator=gen).to(dtype)
            else:
                base = torch.zeros(size, dtype=dtype)
            return base.as_strided(shape, stride)
        return a

    ready = [
        (op, tree_map(make, args, is_leaf=_is_spec), tree_map(make, kw, is_leaf=_is_spec))
        for op, args, kw in calls
    ]

    def run_all() -> None:
        for op, args, kw in ready:
            op(*args, **kw)

    with FlopCounterMode(display=False) as counter:
        run_all()
    times = []
    run_all()  # warm-up
    for _ in range(repeats):
        start = time.perf_counter()
        run_all()
        times.append(time.perf_counter() - start)
    flops = int(counter.get_total_flops())
    return flops / statistics.median(times) / 1e9, flops


def _is_spec(a: Any) -> bool:
    return isinstance(a, tuple) and len(a) == 4 and a[0] == "tensor"


def flops_table(repeats: int) -> None:
    from tabulate import tabulate

    model, images = tiny_setting(torch.device("cpu"))
    peak = matmul_gflops()
    print(f"2048 x 2048 float32 matmul: {peak:.1f} GFLOP/s")
    rows = []
    for name in ("mura", "lora", "tpt"):
        cls = registry("methods").get(name)
        torch.manual_seed(0)
        method = cls(copy.deepcopy(model), cls.Config())
        method.setup()
        method.reseed(0)
        method.step(images)  # warm-up
        flops = step_flops(method, images)
        times = []
        for rep in range(repeats):
            method.reset()
            method.reseed(1 + rep)
            start = time.perf_counter()
            method.step(images)
            times.append(time.perf_counter() - start)
        rates = sorted(flops / t / 1e9 for t in times)
        med = statistics.median(rates)
        same, same_flops = same_shape_rate(record_matmuls(method, images), max(3, repeats))
        shares = sorted(r / same for r in rates)
        rate = f"{med:.1f} ({rates[0]:.1f}-{rates[-1]:.1f})"
        rows.append(
            [name, f"{flops / len(images) / 1e9:.2f}", rate, f"{same:.1f}",
             f"{statistics.median(shares):.0%} ({shares[0]:.0%}-{shares[-1]:.0%})",
             f"{med / peak:.0%}"]
        )  # fmt: skip
        if abs(same_flops - flops) > 0.01 * flops:
            print(f"  note: {name}'s replayed products count {same_flops} FLOPs, its step {flops}")
        print(f"  {name}: {med:.1f} GFLOP/s, its own matrix shapes alone {same:.1f}", flush=True)
    print(f"\nTiny model, batch of 64 at 32 px; 2048 x 2048 matmul {peak:.1f} GFLOP/s")
    headers = [
        "method", "GFLOP/sample", "GFLOP/s: median (range)", "same-shape products GFLOP/s",
        "share of same-shape rate (target 70%)", "share of 2048^2 matmul",
    ]  # fmt: skip
    print(tabulate(rows, headers=headers, tablefmt="github"))
    tent_vs_bare(model, images, repeats)


def tent_vs_bare(model: ZeroShotClassifier, images: torch.Tensor, repeats: int) -> None:
    """The harness's ``tent`` step against the same computation written as a bare loop."""
    cls = registry("methods").get("tent")
    torch.manual_seed(0)
    tent = cls(copy.deepcopy(model), cls.Config())
    tent.setup()
    bare_model = copy.deepcopy(tent.model)  # the same surgery (batch statistics, grads)
    params = [p for p in bare_model.parameters() if p.requires_grad]
    cfg = tent.config
    opt = torch.optim.Adam(
        params, lr=cfg.lr, betas=(cfg.momentum, 0.999), weight_decay=cfg.weight_decay
    )

    def bare_step() -> torch.Tensor:
        with torch.enable_grad():
            logits = bare_model(images)
            loss = -(logits.softmax(1) * logits.log_softmax(1)).sum(1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return logits.detach()

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    steps = 20
    for fn in (bare_step, lambda: tent.step(images)):
        fn()  # warm-up
    ratios, harness, bare = [], [], []
    for _ in range(repeats):
        h = sum(timed(lambda: tent.step(images)) for _ in range(steps))
        b = sum(timed(bare_step) for _ in range(steps))
        harness.append(h / steps)
        bare.append(b / steps)
        ratios.append(b / h)
    ratios.sort()
    print(
        f"\nTENT: harness step {statistics.median(harness) * 1000:.2f} ms, bare loop "
        f"{statistics.median(bare) * 1000:.2f} ms per batch of {len(images)}; bare/harness "
        f"{statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f}) (target >= 0.95)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", help="comma-separated subset (default: all registered)")
    parser.add_argument("--skip-tiny", action="store_true")
    parser.add_argument("--skip-vit", action="store_true")
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps; the minimum")
    parser.add_argument("--memory", action="store_true", help="peak memory vs batch size")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--memory-classes", type=int, default=10)
    parser.add_argument("--live", action="store_true", help="--memory: also freeing at once")
    parser.add_argument(
        "--only-live", action="store_true", help="--memory: only the cells freeing at once"
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="--memory: the cells freeing at once first take one step on another image",
    )
    parser.add_argument(
        "--view-memory-mb", type=float, help="--memory: the methods' view budget (default theirs)"
    )
    parser.add_argument(
        "--copies-wait",
        choices=COPIES_WAIT,
        help="--memory: where MuRA's adapted copies wait for its router's step (default disk)",
    )
    parser.add_argument("--flops", action="store_true", help="GFLOP/s vs the matmul limit")
    args = parser.parse_args()
    if args.view_memory_mb is not None and not args.view_memory_mb > 0:
        parser.error(f"--view-memory-mb must be > 0, got {args.view_memory_mb}")
    from tta_bench import buffers

    print(buffers.describe())
    if args.flops:
        print(f"torch threads: {torch.get_num_threads()}")
        flops_table(args.repeats)
        return
    if args.memory:
        names = args.methods.split(",") if args.methods else list(MEMORY_METHODS)
        print(f"torch threads: {torch.get_num_threads()}")
        batches = [int(b) for b in args.batches.split(",")]
        memory_table(
            names,
            batches,
            args.memory_classes,
            args.live,
            args.view_memory_mb,
            args.copies_wait,
            warm=args.warm,
            only_live=args.only_live,
        )
        return
    device = torch.device(args.device)
    names = args.methods.split(",") if args.methods else sorted(registry("methods").names())
    names = sorted(names, key=lambda n: (n != "zeroshot", n))
    print(f"torch threads: {torch.get_num_threads()}, device: {device}")
    settings = []
    if not args.skip_tiny:
        settings.append(("(a) tiny-clip-digits, batch of 64 at 32 px", tiny_setting))
    if not args.skip_vit:
        settings.append(
            (
                f"(b) ViT-B-32 (random weights), 1 image at 224 px, {args.classes} classes",
                lambda d: vit_setting(d, args.classes),
            )
        )
    for title, build in settings:
        print(f"\n{title}: building")
        model, images = build(device)
        rows = {}
        for name in names:
            repeats = 2 if name == "tpt" and "ViT" in title else args.repeats  # tpt: ~1 min
            rows[name] = measure(name, model, images, repeats)
            print(f"  {name}: {rows[name]['s_per_sample'] * 1000:.1f} ms/sample", flush=True)
        report(title, rows)


if __name__ == "__main__":
    main()
