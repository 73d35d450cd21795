"""GPU check: do the shift kernels, the text head and every method run right on a GPU?

One command, under 10 minutes on one H100/H200-class card, from the repository root after
``pip install -e ./harness -e .``::

    python benchmarks/gpu_check.py [--quick] [--methods a,b] [--shifts a,b]
        [--checks shifts,text_head,methods] [--out results/gpu/gpu_check.json]

Checks (each gets a status; the command exits 1 unless every one passes):

* ``shifts``: every registered shift kernel on the device against its CPU output, on a
  fixed batch of 8-bit synthetic images (224 px), every severity 1-5 of every severity
  table a suite in the catalogue uses, through the runner's own ``apply_shift`` (and the
  ``from_uint8`` entry where a kernel has one). Random draws come from
  ``SampleGenerator``, which draws on the CPU for every device, so no kernel's draws differ
  by device; only float rounding does. Tolerances (``TOLERANCES``): a *float* kernel
  passes when max |GPU - CPU| <= 5e-4; a *thresholded* kernel (a decision on computed
  floats: a threshold, an 8-bit floor/round, a Poisson inversion) passes when at most 1%
  of the values differ by more than 5e-4 and the mean |diff| is <= 1e-4.
* ``text_head``: the protocol's 1,000-class ImageNet head (80 CLIP templates) built on the
  device in bounded chunks, its time and peak memory, the cached rebuild equal bit for bit,
  and a subset of classes against the same head computed on the CPU.
* ``golden``: one cross-domain set (``--data-dir`` with CoOp's layout; the smallest found,
  or ``--golden-set``) through ``tta-bench run`` with CLIP RN50 and its OpenAI weights from
  the local open_clip cache, zeroshot and TDA (``--golden-methods``, TPT too) beside the
  official TDA README's figures (the catalogue's ``published: tda-readme-rn50``); skipped,
  not failed, without the data or the weights.
* ``methods``: every registered method runs one short cell (gaussian_noise, severity 5)
  through the harness's real runner (``tta_bench.run.runner.run`` with a prebuilt open_clip
  ViT-B-16 bundle, random weights, 224 px, 1,000 ImageNet classes): images/s (over the
  whole cell, and from its second batch on), peak CUDA memory, data-wait share.

``--quick`` cuts each check down (fewer severities and images, one template, smaller
cells: about a third of the time). ``--tiny`` swaps in a tiny random CLIP at 32 px and 16
classes, so ``--device cpu --quick --tiny`` is a CPU smoke test of this script's logic
(tests/test_gpu_check.py); it hands the source-set methods 64 source images, not 2,000.
Everything runs under a temporary cache directory unless ``--cache-dir`` names one, so a
text head is always built once before it is read back.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its siblings, however it is loaded
from gpu_check_methods import (  # noqa: E402, F401 - the names the command and its tests use
    GOLDEN_SOURCE,
    check_golden,
    check_methods,
    golden_set,
    head_overrides,
    imagenet_classnames,
    published_head,
    run_method,
    synthetic_images,
)
from gpu_check_report import (  # noqa: E402
    _finite,
    _tf32_flags,
    environment,
    overall_status,
    print_summary,
)

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)

#: |GPU - CPU| below which two values count as equal: an eighth of one 8-bit level. Every
#: image source and every reference corruption is 8-bit, so a difference below it is
#: invisible in the data, while float32 rounding on values in [0, 1] (reduction order of
#: the unit-gain sums, FFTs and matmuls; fused multiply-adds; a few ulps of exp/log/sin)
#: stays around 1e-6 (worst case for the ~1e4-term sums ~1e4 * 2^-24 = 6e-4). A wrong GPU
#: code path (a wrong tap, index or draw) shows up at 1e-2 and more.
FLOAT_TOL = 5e-4
#: Kernels that take a decision on computed floats: a rounding-level difference at the
#: decision flips it, moving one value by a whole step (an 8-bit level after floor/round,
#: a Poisson count 1/c, a threshold's jump), which a later blur spreads over its taps. The
#: chance of a value landing within rounding of a boundary is ~1e-6, so a handful of flips
#: per batch at most: these pass on the share of differing values and the mean difference.
THRESHOLDED = {
    "glass_blur": "8-bit floor of the blurred image before the pixel shuffle",
    "snow": "grain threshold, 8-bit floor and round around the motion blur",
    "spatter": "liquid threshold, 8-bit floor, Canny edges, histogram equalisation",
    "pixelate": "8-bit rounding of the image and of both box passes",
    "jpeg_compression": "8-bit codec (runs on the CPU for every device)",
    "shot_noise": "Poisson counts by inversion of computed CDFs",
}
SHARE_TOL = 0.01
MEAN_TOL = 1e-4
TOLERANCES = {
    "float": {"max_abs": FLOAT_TOL},
    "thresholded": {"share_above": SHARE_TOL, "above": FLOAT_TOL, "mean_abs": MEAN_TOL},
}


@dataclass(frozen=True)
class Settings:
    """What each check runs on (``settings_for``)."""

    image_size: int
    shift_images: int
    severities: tuple[int, ...]
    arch: str | None  # open_clip architecture; None: the tiny custom CLIP
    classes: int  # the first N ImageNet class names
    templates: str | tuple[str, ...]  # a catalogue template set, or the templates
    batch_size: int
    max_images: int
    text_subset: tuple[int, int]  # (classes, templates) compared against the CPU
    text_tol: float  # max |device - CPU| of the subset's unit-norm embeddings
    #: Clean source images written for the methods that ask for some (EATA's Fisher, RMT's
    #: warm-up): None, as many as the most demanding default asks (2,000); a number caps it
    source_images: int | None = None


FULL = Settings(
    image_size=224,
    shift_images=4,
    severities=(1, 2, 3, 4, 5),
    arch="ViT-B-16",
    classes=1000,
    templates="clip-imagenet-80",
    batch_size=64,  # the ImageNet-C suites' batch size
    max_images=128,  # two batches: the second shows the steady rate
    text_subset=(10, 8),
    # float32 on both sides (TF32 off for matmuls, torch's default; the report records the
    # flags): rounding through 12 layers at random init is expected near 1e-6
    text_tol=1e-4,
)
QUICK = replace(
    FULL, shift_images=2, severities=(1, 5), templates="simple", batch_size=32, max_images=64
)
TINY = replace(
    FULL,
    image_size=32,
    shift_images=2,
    arch=None,
    classes=16,
    batch_size=2,
    max_images=4,
    text_subset=(4, 3),
)
TINY_QUICK = replace(
    TINY, severities=(5,), templates=("a photo of a {}.", "art of the {}."), source_images=64
)


def settings_for(quick: bool, tiny: bool) -> Settings:
    if tiny:
        return TINY_QUICK if quick else TINY
    return QUICK if quick else FULL


def suite_tables() -> list[str]:
    """Severity tables named by the catalogue's suites (synthetic shifts or not)."""
    from tta_bench.catalog import catalog

    suites = catalog()["suites"].values()
    return sorted({s.get("severity_table", "cifar") for s in suites})


# -- (a) shift kernels -------------------------------------------------------------------
def compare(cpu_out: torch.Tensor, dev_out: torch.Tensor) -> dict[str, float]:
    diff = (dev_out.detach().cpu().double() - cpu_out.detach().double()).abs()
    return {
        "max_abs": float(diff.max()),
        "mean_abs": float(diff.mean()),
        "share_above": float((diff > FLOAT_TOL).double().mean()),
    }


def verdict(kind: str, stats: dict[str, float]) -> bool:
    if not all(math.isfinite(v) for v in stats.values()):
        return False
    if kind == "float":
        return stats["max_abs"] <= FLOAT_TOL
    return stats["share_above"] <= SHARE_TOL and stats["mean_abs"] <= MEAN_TOL


def _shift_case(
    kernel: Callable[..., torch.Tensor],
    kind: str,
    inputs: tuple[torch.Tensor, torch.Tensor],
    name: str,
    table: str,
    severity: int,
    seconds: dict[str, float],
) -> dict[str, Any]:
    """One (table, severity, input) case: the kernel through the runner's ``apply_shift``
    on the CPU input and on the device input, with the same per-sample generators."""
    from tta_bench.rng import SampleGenerator
    from tta_bench.run.inputs import apply_shift

    outs = []
    try:
        for side, x in zip(("cpu", "device"), inputs):
            gen = SampleGenerator.for_samples(range(len(x)), 0, name, severity, device=x.device)
            start = time.perf_counter()
            outs.append(apply_shift(kernel, x.clone(), severity, gen, table))
            _sync(x.device)
            seconds[side] += time.perf_counter() - start
    except ValueError as exc:
        if "severity table" in str(exc):  # the kernel has no such table
            return {"status": "n/a"}
        return {"status": "fail", "error": f"{type(exc).__name__}: {exc}"}
    except Exception as exc:  # noqa: BLE001 - a crash on the device is this check's finding
        return {"status": "fail", "error": f"{type(exc).__name__}: {exc}"}
    stats = compare(*outs)
    return {**stats, "status": "pass" if verdict(kind, stats) else "fail"}


def check_shifts(
    device: torch.device,
    settings: Settings,
    names: Sequence[str] | None = None,
    kernels: dict[str, Callable[..., torch.Tensor]] | None = None,
    tables: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Every kernel (``kernels``, default: the registered ones, filtered by ``names``) on
    ``device`` against the CPU for each table and severity; see the module docstring."""
    from tta_bench.data import to_float_images
    from tta_bench.registry import registry
    from tta_bench.run.inputs import uint8_entry

    if kernels is None:
        reg = registry("shifts")
        kernels = {n: reg.get(n) for n in (names or sorted(reg.names()))}
    tables = list(tables or suite_tables())
    u8 = synthetic_images(settings.shift_images, settings.image_size)
    x_cpu = to_float_images(u8)
    x_dev = x_cpu.to(device)
    per_shift: dict[str, dict[str, Any]] = {}
    for name, kernel in kernels.items():
        kind = "thresholded" if name in THRESHOLDED else "float"
        cases, seconds = [], {"cpu": 0.0, "device": 0.0}
        paths = [("float", x_cpu, x_dev)]
        if uint8_entry(kernel) is not None:
            paths.append(("uint8", u8, u8.to(device)))
        for table in tables:
            for severity in settings.severities:
                for path, a, b in paths:
                    case = {"table": table, "severity": severity, "input": path}
                    case.update(_shift_case(kernel, kind, (a, b), name, table, severity, seconds))
                    cases.append(case)
        ran = [c for c in cases if c["status"] != "n/a"]
        summary: dict[str, Any] = {
            "kind": kind,
            "tolerance": TOLERANCES[kind],
            "why": THRESHOLDED.get(name, "float arithmetic only"),
            "cases": len(ran),
            "status": "pass" if ran and all(c["status"] == "pass" for c in ran) else "fail",
            "cpu_s": seconds["cpu"],
            "device_s": seconds["device"],
        }
        for stat in ("max_abs", "mean_abs", "share_above"):
            values = [c[stat] for c in ran if stat in c]
            summary[stat] = max(values) if values else None
        errors = [c["error"] for c in ran if "error" in c]
        if errors:
            summary["error"] = errors[0]
        if not ran:
            summary["error"] = f"no severity table of {tables} applies"
        summary["detail"] = cases
        per_shift[name] = summary
    status = (
        "pass" if per_shift and all(s["status"] == "pass" for s in per_shift.values()) else "fail"
    )
    return {
        "status": status,
        "tables": tables,
        "severities": list(settings.severities),
        "images": settings.shift_images,
        "image_size": settings.image_size,
        "tolerances": TOLERANCES,
        "per_shift": per_shift,
    }


# -- the model ---------------------------------------------------------------------------
def build_bundle(settings: Settings, device: torch.device) -> Any:
    """open_clip ``settings.arch`` with random weights (seed 0), or the tiny CLIP; on
    ``device``, so the runner's classifiers encode their text heads there."""
    from tta_bench.model import ModelBundle, Preprocess

    torch.manual_seed(0)
    if settings.arch is not None:
        from tta_bench.registry import registry

        bundle = registry("models").get("openclip")(arch=settings.arch, allow_random=True)
    else:
        import open_clip
        from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

        size = settings.image_size
        vision = CLIPVisionCfg(layers=3, width=64, head_width=32, patch_size=8, image_size=size)
        text = CLIPTextCfg(context_length=77, width=64, heads=2, layers=2)
        bundle = ModelBundle(
            clip=CLIP(embed_dim=64, vision_cfg=vision, text_cfg=text).eval(),
            tokenizer=open_clip.get_tokenizer("ViT-B-32"),
            preprocess=Preprocess(size, OPENAI_MEAN, OPENAI_STD),
            name="tiny-clip-random",
            weights="random-init",
        )
    if bundle.preprocess.image_size != settings.image_size:
        raise ValueError(
            f"{bundle.name} takes {bundle.preprocess.image_size} px images, "
            f"the check uses {settings.image_size} px"
        )
    bundle.clip.to(device)
    return bundle


# -- (b0) the text head ------------------------------------------------------------------
def check_text_head(bundle: Any, device: torch.device, settings: Settings) -> dict[str, Any]:
    """Build the classifier's head on ``device`` (time, peak memory), rebuild it from the
    cache (bit-equal), and compare a subset of classes with the CPU's computation."""
    from tta_bench import text_head
    from tta_bench.model import ZeroShotClassifier
    from tta_bench.run.cost import PeakMemory

    names = imagenet_classnames(settings.classes)
    from tta_bench.text_head import resolve_templates

    templates = resolve_templates(settings.templates)
    key = text_head.head_key(bundle.clip, bundle.tokenizer, names, templates)
    was_cached = text_head.entry_path(key).exists()
    with PeakMemory(device) as mem:
        start = time.perf_counter()
        first = ZeroShotClassifier(bundle, names, templates).class_embeddings
        _sync(device)
        build_s = time.perf_counter() - start
    start = time.perf_counter()
    again = ZeroShotClassifier(bundle, names, templates).class_embeddings
    _sync(device)
    hit_s = time.perf_counter() - start
    # a subset of the head on the CPU: same float32 computation, another device's rounding
    n_cls, n_tmpl = settings.text_subset
    sub_names, sub_templates = names[:n_cls], templates[:n_tmpl]
    cpu_clip = copy.deepcopy(bundle.clip).cpu()
    on_cpu = text_head.encode_class_embeddings(cpu_clip, bundle.tokenizer, sub_names, sub_templates)
    on_dev = text_head.encode_class_embeddings(
        bundle.clip, bundle.tokenizer, sub_names, sub_templates
    )
    del cpu_clip
    diff = float((on_dev.cpu().double() - on_cpu.double()).abs().max())
    cosine = float((on_dev.cpu().double() * on_cpu.double()).sum(-1).min())
    equal = bool(torch.equal(first, again))
    finite = bool(torch.isfinite(first).all())
    ok = equal and finite and diff <= settings.text_tol and tuple(first.shape[:1]) == (len(names),)
    return {
        "status": "pass" if ok else "fail",
        "classes": len(names),
        "templates": len(templates),
        "prompts": len(names) * len(templates),
        "chunk_size": text_head.DEFAULT_CHUNK_PROMPTS,
        "build_s": build_s,
        "first_build_was_cached": was_cached,
        "cached_rebuild_s": hit_s,
        "cached_equals_built": equal,
        "peak_memory_bytes": mem.peak_bytes,
        "peak_memory_kind": mem.kind,
        "cpu_subset": {"classes": n_cls, "templates": n_tmpl},
        "cpu_max_abs_diff": diff,
        "cpu_min_cosine": cosine,
        "cpu_tolerance": settings.text_tol,
        "tf32": _tf32_flags(),
    }


# -- the report --------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- the command -------------------------------------------------------------------------
CHECKS = ("shifts", "text_head", "methods", "golden")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="device to check (default cuda)")
    ap.add_argument("--quick", action="store_true", help="a cut-down run (~1/3 of the time)")
    ap.add_argument("--tiny", action="store_true", help="tiny random CLIP at 32 px (CPU smoke)")
    ap.add_argument("--methods", help="comma-separated subset of the registered methods")
    ap.add_argument("--shifts", help="comma-separated subset of the registered shifts")
    ap.add_argument("--checks", default=",".join(CHECKS), help=f"subset of {','.join(CHECKS)}")
    ap.add_argument("--out", default="results/gpu/gpu_check.json", help="the JSON report")
    ap.add_argument("--cache-dir", help="tta-bench cache to use (default: a temporary one)")
    ap.add_argument(
        "--data-dir", help="golden: the folder holding a cross-domain set in CoOp's layout"
    )
    ap.add_argument(
        "--golden-set", help="golden: the cross-domain set (default: the smallest found)"
    )
    ap.add_argument(
        "--golden-methods",
        default="zeroshot,tda",
        help="golden: the methods run beside the published rows (zeroshot, tpt, tda)",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=540.0,
        help="start no further method after this many seconds (default 540)",
    )
    return ap.parse_args(argv)


def _subset(arg: str | None, available: Sequence[str], what: str) -> list[str] | None:
    if arg is None:
        return None
    names = [n.strip() for n in arg.split(",") if n.strip()]
    unknown = [n for n in names if n not in available]
    if unknown or not names:
        raise SystemExit(
            f"gpu_check: unknown {what} {unknown or names}; available: {', '.join(available)}"
        )
    return names


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from tta_bench.paths import atomic_write_text
    from tta_bench.registry import registry
    from tta_bench.run.spec import resolve_device

    checks_wanted = _subset(args.checks, CHECKS, "checks") or list(CHECKS)
    methods = _subset(args.methods, sorted(registry("methods").names()), "methods")
    shifts = _subset(args.shifts, sorted(registry("shifts").names()), "shifts")
    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        raise SystemExit(f"gpu_check: {exc}") from None
    settings = settings_for(args.quick, args.tiny)
    start = time.perf_counter()
    deadline = start + args.budget_s
    report: dict[str, Any] = {
        "schema": "tta-bench/gpu-check/1",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": list(sys.argv[1:] if argv is None else argv),
        "settings": asdict(settings),
        "env": environment(device),
        "checks": {},
    }
    print(
        f"gpu_check on {report['env']['device_name']} ({device}), torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}; {'quick' if args.quick else 'full'}"
        f"{', tiny model' if args.tiny else ''}",
        flush=True,
    )
    with contextlib.ExitStack() as stack:
        if args.cache_dir is None:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu-check-"))
            cache = Path(tmp) / "cache"
        else:
            cache = Path(args.cache_dir)
        stack.enter_context(_env("TTA_BENCH_CACHE", str(cache)))
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu-check-runs-")))
        checks = report["checks"]
        if "shifts" in checks_wanted:
            print("shifts ...", flush=True)
            checks["shifts"] = _guarded(lambda: check_shifts(device, settings, shifts))
        bundle = None
        if {"text_head", "methods"} & set(checks_wanted):
            print("model ...", flush=True)
            try:
                bundle = build_bundle(settings, device)
            except Exception as exc:  # noqa: BLE001
                failed = {"status": "fail", "error": f"model: {type(exc).__name__}: {exc}"}
                for name in ("text_head", "methods"):
                    if name in checks_wanted:
                        checks[name] = dict(failed)
        if bundle is not None and "text_head" in checks_wanted:
            print("text head ...", flush=True)
            checks["text_head"] = _guarded(lambda: check_text_head(bundle, device, settings))
        if bundle is not None and "methods" in checks_wanted:
            print("methods ...", flush=True)
            names = methods or sorted(registry("methods").names())
            checks["methods"] = _guarded(
                lambda: check_methods(bundle, device, settings, names, workdir, deadline)
            )
        if "golden" in checks_wanted:
            print("golden ...", flush=True)
            golden_methods = _subset(args.golden_methods, ("zeroshot", "tpt", "tda"), "methods")
            checks["golden"] = _guarded(
                lambda: check_golden(
                    device, args.data_dir, args.golden_set, golden_methods or [], workdir
                )
            )
    report["status"] = overall_status(report["checks"])
    report["wall_s"] = time.perf_counter() - start
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(_finite(report), indent=1, allow_nan=False) + "\n")
    print_summary(report, FLOAT_TOL)
    print(f"wrote {out}")
    return 0 if report["status"] == "pass" else 1


def _guarded(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A check's result, or a failed status naming the exception it raised."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - reported, and the other checks still run
        return {
            "status": "fail",
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(limit=8),
        }


@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


if __name__ == "__main__":
    sys.exit(main())
