"""The method and golden checks of ``benchmarks/gpu_check.py``: a synthetic dataset written in
the published layout, one cell per method on it (throughput, peak memory, data-wait share),
and our accuracy beside the published figures on a real set when its data and weights are
there."""

from __future__ import annotations

import gc
import json
import math
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from gpu_check import Settings


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


def imagenet_classnames(n: int) -> list[str]:
    from tta_bench.catalog import catalog

    return list(catalog()["datasets"]["imagenet"]["classnames"])[:n]


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
            "dataset_args": {"data_dir": str(source), "classnames": classnames, "split": "train"},
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
    if settings.source_images is not None:
        n_source = min(n_source, settings.source_images)
    source = (
        write_dataset(workdir / "source" / "train.parquet", settings, n_source, 2)
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


#: The published figures ``golden`` prints ours beside (the catalogue's ``published:``).
GOLDEN_SOURCE = "tda-readme-rn50"


#: The cross-domain sets ``golden`` looks for under ``--data-dir``, smallest test split
#: first (DTD 1,692 images, Flowers 2,463, Caltech101 2,465).
GOLDEN_ORDER = ("dtd", "oxford_flowers", "caltech101", "fgvc_aircraft", "oxford_pets",
                "ucf101", "stanford_cars", "eurosat", "sun397", "food101")  # fmt: skip


#: Per method, the settings of the row it is compared with beside its text head (TPT's
#: AugMix views on the fine-grained sets).
GOLDEN_OVERRIDES = {"tpt": ["method.augmix=true"]}


def published_head(entry: dict[str, Any], row: str, dataset: str) -> str | None:
    """The text head the published ``row`` used on ``dataset`` (its ``prompts:``): a
    catalogue template set, ``official`` (the method's own head), or None (not published)."""
    head = (entry.get("prompts") or {}).get(row)
    return head.get(dataset) if isinstance(head, dict) else head


def head_overrides(head: str | None) -> list[str]:
    """The run settings that give a method the published text head ``head``: the method's
    own (``method.text_head=official``) or a template set as the protocol's head; none for
    an unpublished head (the suite's own head runs, and the row is not like for like)."""
    if head is None:
        return []
    if head == "official":
        return ["method.text_head=official"]
    return [f"protocol.templates={head}"]


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
    official TDA README publishes, run with the text head that row used (``published_head``;
    a row whose head is not published is run with the suite's head and marked not like for
    like). Skipped (not failed) without the data or the weights."""
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
        head = published_head(published, method, name)
        try:
            record = api.evaluate(
                method,
                "cross-domain-10",
                model["name"],
                [*overrides, *head_overrides(head), *GOLDEN_OVERRIDES.get(method, [])],
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
            # the published row's head, and whether ours ran with it
            "text_head": head or "not published",
            "like_for_like": head is not None,
            "wall_s": time.perf_counter() - start,
        }
    return {"status": "pass", "source": published["source"], "model": model, "rows": rows}
