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
(tests/test_gpu_check.py). Everything runs under a temporary cache directory unless
``--cache-dir`` names one, so a text head is always built once before it is read back.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

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
TINY_QUICK = replace(TINY, severities=(5,), templates=("a photo of a {}.", "art of the {}."))


def settings_for(quick: bool, tiny: bool) -> Settings:
    if tiny:
        return TINY_QUICK if quick else TINY
    return QUICK if quick else FULL


# -- inputs ------------------------------------------------------------------------------
def synthetic_images(n: int, size: int, seed: int = 0) -> torch.Tensor:
    """``n`` fixed 8-bit RGB images ``[n, size, size, 3]`` (the decoded cache's format):
    smooth colour fields plus fine texture and a few hard edges, so blurs, thresholds and
    8-bit steps all have something to act on."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    low = F.interpolate(torch.rand(n, 3, 6, 6, generator=g), size=(size, size), mode="bicubic")
    texture = torch.rand(n, 3, size, size, generator=g)
    img = 0.75 * low + 0.25 * texture
    edge = size // 3
    img[:, :, edge : 2 * edge, edge : 2 * edge] = torch.rand(n, 3, 1, 1, generator=g)
    u8 = img.clamp(0, 1).mul(255).round().to(torch.uint8)
    return u8.permute(0, 2, 3, 1).contiguous()


def suite_tables() -> list[str]:
    """Severity tables named by the catalogue's suites (synthetic shifts or not)."""
    from tta_bench.catalog import catalog

    suites = catalog()["suites"].values()
    return sorted({s.get("severity_table", "cifar") for s in suites})


def imagenet_classnames(n: int) -> list[str]:
    from tta_bench.catalog import catalog

    return list(catalog()["datasets"]["imagenet"]["classnames"])[:n]


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


# -- (b) methods through the runner ------------------------------------------------------
def write_dataset(path: Path, settings: Settings, n: int, seed: int) -> Path:
    """``n`` synthetic JPEG images with random ImageNet labels as a parquet file (the
    plugin's ``parquet`` dataset reads it like any local set)."""
    import io

    import datasets
    from PIL import Image

    datasets.disable_progress_bars()
    u8 = synthetic_images(n, settings.image_size, seed=seed).numpy()
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, settings.classes, (n,), generator=gen).tolist()
    blobs = []
    for img in u8:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=95)
        blobs.append({"bytes": buf.getvalue(), "path": None})
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    ds = datasets.Dataset.from_dict({"image": blobs, "label": labels}, features=features)
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.to_parquet(str(path))
    return path


def source_images_needed(names: Sequence[str]) -> int:
    """The most clean source images any of these methods asks for with its default config
    (EATA: its Fisher information's official 2,000); 0 when none asks."""
    from tta_bench.method import Method
    from tta_bench.registry import registry

    needed = 0
    for name in names:
        cls = registry("methods").get(name)
        if cls.source_images_needed is Method.source_images_needed:
            continue
        # the contract: __init__ only stores, so the question needs no model
        needed = max(needed, int(cls(None, cls.Config()).source_images_needed()))
    return needed


def check_protocol(settings: Settings, data: Path, source: Path | None) -> Any:
    """The cell every method runs: ``gaussian_noise`` at severity 5 on the synthetic set,
    the suite's batch size and reset policy (``reset_each_shift``), the text head of
    ``settings.templates``; ``source`` is the declared clean source split."""
    from dataclasses import fields

    from tta_bench.run.protocol import Protocol

    classnames = imagenet_classnames(settings.classes)
    templates = settings.templates
    templates = templates if isinstance(templates, str) else list(templates)
    extra: dict[str, Any] = {}
    if source is not None and "source" in {f.name for f in fields(Protocol)}:
        extra["source"] = {
            "dataset": "parquet",
            "dataset_args": {"data_dir": str(source), "classnames": classnames},
        }
    return Protocol(
        name="gpu-check",
        version=1,
        dataset="parquet",
        dataset_args={"data_dir": str(data), "classnames": classnames, "templates": templates},
        shifts=("gaussian_noise",),
        severities=(5,),
        batch_size=settings.batch_size,
        reset="reset_each_shift",
        shift_source="synthetic",
        severity_table="imagenet" if settings.image_size >= 128 else "cifar",
        max_images=settings.max_images,
        **extra,
    )


def method_order(names: Sequence[str]) -> list[str]:
    """zeroshot first (the reference), the rest alphabetically."""
    return sorted(names, key=lambda n: (n != "zeroshot", n))


def steady_images_per_s(batch_log: Path) -> float | None:
    """Images/s from the cell's second batch on (the first pays one-time costs: kernel
    selection, allocator growth, lazy initialisation); None with a single batch."""
    lines = [json.loads(x) for x in batch_log.read_text().splitlines() if x.strip()]
    later = lines[1:]
    seconds = sum(sum(line["seconds"].values()) for line in later)
    return sum(line["n"] for line in later) / seconds if later and seconds > 0 else None


def run_method(
    name: str, bundle: Any, protocol: Any, device: torch.device, workdir: Path
) -> dict[str, Any]:
    from tta_bench.method import config_dict
    from tta_bench.registry import registry
    from tta_bench.run import runner
    from tta_bench.run.spec import RunSpec

    method_cls = registry("methods").get(name)
    config = method_cls.Config()
    batch_log = workdir / f"{name}.batches.jsonl"
    spec = RunSpec(
        method=name,
        method_config=config,
        model=bundle.name,
        model_args={"arch": bundle.name},
        protocol=protocol,
        seeds=[0],
        device=str(device),
        progress=False,
        reference=False,
        resume=False,
        batch_log=str(batch_log),
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    record = runner.run(spec, workdir / f"{name}.json", bundle=bundle)
    wall = time.perf_counter() - start
    (cell,) = record["cells"]
    total = cell.get("time_per_sample_s") or 0.0
    wait_only = cell.get("data_wait_time_per_sample_s") or 0.0
    finite = all(
        isinstance(cell.get(k), (int, float)) and math.isfinite(cell[k])
        for k in ("accuracy", "nll")
    )
    ok = cell["n"] == protocol.max_images and finite
    return {
        "status": "pass" if ok else "fail",
        **(
            {}
            if ok
            else {"error": f"cell n={cell['n']} (want {protocol.max_images}), finite={finite}"}
        ),
        "images": cell["n"],
        "batches": cell["batches"],
        "images_per_s": cell.get("samples_per_s"),
        "images_per_s_after_first_batch": steady_images_per_s(batch_log),
        "data_wait_share": cell.get("data_wait_share"),
        "data_wait_only_share": wait_only / total if total else None,
        "peak_memory_bytes": cell.get("peak_memory_bytes"),
        "peak_memory_kind": cell.get("peak_memory_kind"),
        "peak_cuda_bytes_with_setup": (
            int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
        ),
        "accuracy": cell.get("accuracy"),  # random weights: chance level (~1/classes)
        "trainable_parameters": (record.get("parameters") or {}).get("trainable"),
        "precision": record["provenance"].get("precision"),
        "wall_s": wall,
        "method_config": config_dict(config),
    }


def check_methods(
    bundle: Any,
    device: torch.device,
    settings: Settings,
    names: Sequence[str],
    workdir: Path,
    deadline: float,
) -> dict[str, Any]:
    data = write_dataset(workdir / "data" / "stream.parquet", settings, settings.max_images, 1)
    n_source = source_images_needed(names)
    source = (
        write_dataset(workdir / "source" / "clean.parquet", settings, n_source, 2)
        if n_source
        else None
    )
    protocol = check_protocol(settings, data, source)
    per_method: dict[str, dict[str, Any]] = {}
    for name in method_order(names):
        if time.perf_counter() > deadline:
            per_method[name] = {"status": "skipped", "error": "time budget (--budget-s) spent"}
            print(f"  {name}: skipped (time budget)", flush=True)
            continue
        try:
            per_method[name] = run_method(name, bundle, protocol, device, workdir)
        except Exception as exc:  # noqa: BLE001 - an OOM or a crash is this check's finding
            per_method[name] = {
                "status": "fail",
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(limit=8),
            }
        finally:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        r = per_method[name]
        print(
            f"  {name}: {r['status']}"
            + (f" {r['images_per_s']:.1f} img/s" if r.get("images_per_s") else "")
            + (f" ({r['error']})" if r.get("error") else ""),
            flush=True,
        )
    status = "pass" if all(r["status"] == "pass" for r in per_method.values()) else "fail"
    return {
        "status": status,
        "protocol": {
            "id": protocol.id,
            "shift": "gaussian_noise",
            "severity": 5,
            "batch_size": protocol.batch_size,
            "images": protocol.max_images,
            "source_images": n_source,
            "classes": settings.classes,
            "templates": settings.templates,
        },
        "model": {
            "name": bundle.name,
            "weights": bundle.weights,
            "image_size": bundle.preprocess.image_size,
        },
        "per_method": per_method,
    }


# -- the report --------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tf32_flags() -> dict[str, bool]:
    return {
        "matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn": bool(torch.backends.cudnn.allow_tf32),
    }


def environment(device: torch.device) -> dict[str, Any]:
    from tta_bench.run import results

    env: dict[str, Any] = {
        "device": str(device),
        "device_name": (
            torch.cuda.get_device_name(device) if device.type == "cuda" else results.cpu_model()
        ),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_threads": torch.get_num_threads(),
        "tf32": _tf32_flags(),
        "git_sha": results.git_sha(),
        "packages": results.package_versions(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["capability"] = f"{props.major}.{props.minor}"
        env["memory_bytes"] = int(props.total_memory)
        env["multiprocessors"] = int(props.multi_processor_count)
    return env


def _finite(obj: Any) -> Any:
    """The report as strict JSON: NaN/inf floats become None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def overall_status(checks: dict[str, dict[str, Any]]) -> str:
    """``pass`` when some check passed and every other one passed or was skipped (the
    golden step without its data or weights)."""
    statuses = [c.get("status") for c in checks.values()]
    ok = "pass" in statuses and all(s in ("pass", "skip") for s in statuses)
    return "pass" if ok else "fail"


def print_summary(report: dict[str, Any]) -> None:
    from tabulate import tabulate

    checks = report["checks"]
    golden = checks.get("golden") or {}
    if golden.get("rows"):
        rows = [
            [
                m,
                r["dataset"],
                r["images"],
                f"{r['accuracy']:.2f}",
                _fmt(r["published"], ".2f"),
                _fmt(r["difference"], "+.2f"),
            ]  # fmt: skip
            for m, r in golden["rows"].items()
        ]
        print(f"\ngolden: ours beside {golden['source']}")
        print(tabulate(rows, headers=["method", "set", "images", "ours %", "published %", "diff"]))
    elif golden:
        print(f"\ngolden: {golden['status']} ({golden.get('reason') or golden.get('error')})")
    if "shifts" in checks:
        rows = [
            [
                n,
                s["kind"],
                s["cases"],
                _fmt(s["max_abs"]),
                _fmt(s["mean_abs"]),
                _fmt(s["share_above"]),
                f"{s['cpu_s']:.2f}",
                f"{s['device_s']:.2f}",
                s["status"],
            ]
            for n, s in checks["shifts"]["per_shift"].items()
        ]
        print("\nshift kernels, device vs CPU")
        print(
            tabulate(
                rows,
                headers=[
                    "shift",
                    "kind",
                    "cases",
                    "max |d|",
                    "mean |d|",
                    f"share > {FLOAT_TOL:g}",
                    "cpu s",
                    "device s",
                    "status",
                ],
            )
        )
    if "text_head" in checks:
        t = checks["text_head"]
        if "build_s" in t:
            print(
                f"\ntext head: {t['classes']} x {t['templates']} prompts in {t['build_s']:.1f} s "
                f"(peak {t['peak_memory_bytes'] / 2**20:.0f} MiB {t['peak_memory_kind']}), "
                f"cached rebuild {t['cached_rebuild_s']:.2f} s, equal {t['cached_equals_built']}, "
                f"vs CPU max |d| {t['cpu_max_abs_diff']:.2e}: {t['status']}"
            )
        else:
            print(f"\ntext head: {t['status']} ({t.get('error')})")
    if "methods" in checks:
        rows = []
        for n, r in checks["methods"]["per_method"].items():
            peak = r.get("peak_memory_bytes")
            rows.append(
                [
                    n,
                    _fmt(r.get("images_per_s"), ".1f"),
                    _fmt(r.get("images_per_s_after_first_batch"), ".1f"),
                    f"{peak / 2**20:.0f}" if peak is not None else "-",
                    _fmt(r.get("data_wait_share"), ".3f"),
                    _fmt(r.get("wall_s"), ".1f"),
                    r["status"],
                ]
            )
        print("\nmethods, one cell each")
        print(
            tabulate(
                rows,
                headers=[
                    "method",
                    "img/s",
                    "img/s (2nd batch on)",
                    "peak MiB",
                    "data-wait share",
                    "wall s",
                    "status",
                ],
            )
        )
    print(f"\noverall: {report['status']}  ({report['wall_s']:.0f} s)")


def _fmt(value: Any, spec: str = ".2e") -> str:
    return "-" if value is None else format(value, spec)


# -- the command -------------------------------------------------------------------------
CHECKS = ("shifts", "text_head", "methods", "golden")
#: The published figures ``golden`` prints ours beside (the catalogue's ``published:``).
GOLDEN_SOURCE = "tda-readme-rn50"
#: The cross-domain sets ``golden`` looks for under ``--data-dir``, smallest test split
#: first (DTD 1,692 images, Flowers 2,463, Caltech101 2,465).
GOLDEN_ORDER = ("dtd", "oxford_flowers", "caltech101", "fgvc_aircraft", "oxford_pets",
                "ucf101", "stanford_cars", "eurosat", "sun397", "food101")  # fmt: skip
#: Per method, the settings of the row it is compared with: TDA with its loaders' templates.
GOLDEN_OVERRIDES = {"tda": ["method.text_head=official"], "tpt": ["method.augmix=true"]}


def golden_set(data_dir: str | None, wanted: str | None) -> tuple[str | None, str]:
    """The cross-domain set ``golden`` runs (``wanted``, else the first of ``GOLDEN_ORDER``
    whose CoOp layout is under ``data_dir``) and why none, when none."""
    from tta_bench.data import DataUnavailableError
    from tta_bench.registry import registry

    if data_dir is None:
        return None, "no --data-dir: the golden step needs a cross-domain set in CoOp's layout"
    for name in [wanted] if wanted else GOLDEN_ORDER:
        try:
            registry("datasets").get(name).check_args(data_dir=data_dir)
            return name, ""
        except DataUnavailableError as exc:
            last = str(exc)
    return None, f"no cross-domain set under --data-dir {data_dir} ({last})"


def check_golden(
    device: torch.device,
    data_dir: str | None,
    wanted: str | None,
    methods: Sequence[str],
    workdir: Path,
) -> dict[str, Any]:
    """One cross-domain set through ``tta-bench run`` (suite ``cross-domain-10`` restricted to
    it, seed 0) with CLIP RN50 and its OpenAI weights, each method beside the figure the
    official TDA README publishes. Skipped (not failed) without the data or the weights."""
    from tta_bench import api, catalog

    published = catalog.catalog()["published"][GOLDEN_SOURCE]
    name, why = golden_set(data_dir, wanted)
    if name is None:
        return {"status": "skip", "reason": why}
    model = published["model"]
    overrides = [f"model.arch={model['arch']}", f"model.pretrained={model['pretrained']}",
                 f"protocol.shifts=[{name}]"]  # fmt: skip
    rows = {}
    for method in methods:
        start = time.perf_counter()
        try:
            record = api.evaluate(
                method,
                "cross-domain-10",
                model["name"],
                [*overrides, *GOLDEN_OVERRIDES.get(method, [])],
                seeds=[0],
                output=workdir / f"golden-{method}.json",
                device=str(device),
                data_dir=data_dir,
            )
        except (ValueError, OSError) as exc:  # the weights are not in the local cache
            if method == methods[0]:
                return {"status": "skip", "reason": f"{type(exc).__name__}: {exc}"}
            raise
        (cell,) = record["cells"]
        ours = 100 * float(cell["accuracy"])
        target = published["accuracy"].get(method, {}).get(name)
        rows[method] = {
            "dataset": name,
            "images": cell["n"],
            "accuracy": ours,
            "published": target,
            "difference": None if target is None else ours - target,
            "wall_s": time.perf_counter() - start,
        }
    return {"status": "pass", "source": published["source"], "model": model, "rows": rows}


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
    print_summary(report)
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
