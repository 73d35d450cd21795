"""The report of ``benchmarks/gpu_check.py``: the environment it ran in, strict JSON, the
overall status and the printed summary tables."""

from __future__ import annotations

import math
import platform
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    pass


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


def print_summary(report: dict[str, Any], float_tol: float) -> None:
    """The report's tables: golden rows, shift kernels (``float_tol``: the equality
    tolerance), the text head and the methods, then the overall status."""
    checks = report["checks"]
    _print_golden(checks.get("golden") or {})
    if "shifts" in checks:
        _print_shifts(checks["shifts"], float_tol)
    if "text_head" in checks:
        _print_text_head(checks["text_head"])
    if "methods" in checks:
        _print_methods(checks["methods"])
    print(f"\noverall: {report['status']}  ({report['wall_s']:.0f} s)")


def _print_golden(golden: dict[str, Any]) -> None:
    from tabulate import tabulate

    if golden.get("rows"):
        rows = [
            [
                m,
                r["dataset"],
                r["images"],
                f"{r['accuracy']:.2f}",
                _fmt(r["published"], ".2f"),
                _fmt(r["difference"], "+.2f"),
                r.get("text_head", "-"),
                "yes" if r.get("like_for_like") else "no (published head unknown)",
            ]  # fmt: skip
            for m, r in golden["rows"].items()
        ]
        print(f"\ngolden: ours beside {golden['source']}")
        headers = [
            "method",
            "set",
            "images",
            "ours %",
            "published %",
            "diff",
            "head",
            "like for like",
        ]
        print(tabulate(rows, headers=headers))
    elif golden:
        print(f"\ngolden: {golden['status']} ({golden.get('reason') or golden.get('error')})")


def _print_shifts(check: dict[str, Any], float_tol: float) -> None:
    from tabulate import tabulate

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
        for n, s in check["per_shift"].items()
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
                f"share > {float_tol:g}",
                "cpu s",
                "device s",
                "status",
            ],
        )
    )


def _print_text_head(t: dict[str, Any]) -> None:
    if "build_s" in t:
        print(
            f"\ntext head: {t['classes']} x {t['templates']} prompts in {t['build_s']:.1f} s "
            f"(peak {t['peak_memory_bytes'] / 2**20:.0f} MiB {t['peak_memory_kind']}), "
            f"cached rebuild {t['cached_rebuild_s']:.2f} s, equal {t['cached_equals_built']}, "
            f"vs CPU max |d| {t['cpu_max_abs_diff']:.2e}: {t['status']}"
        )
    else:
        print(f"\ntext head: {t['status']} ({t.get('error')})")


def _print_methods(check: dict[str, Any]) -> None:
    from tabulate import tabulate

    rows = []
    for n, r in check["per_method"].items():
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


def _fmt(value: Any, spec: str = ".2e") -> str:
    return "-" if value is None else format(value, spec)
