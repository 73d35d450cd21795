"""The ``tta-bench`` commands that list and inspect the installation: ``ls`` (components,
suites, presets, defaults, published figures), ``env`` (versions, device, caches, plugin
distributions) and ``cache`` (list or clear the decoded-image and text-head caches).
``ls`` imports no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tta_bench import catalog
from tta_bench.registry import KINDS, SINGULAR, registry
from tta_bench.run.resolve import NO_PLUGINS, UsageError, check_cache_budget

LIST_KINDS = (
    *[k for k in KINDS if k != "configs"],
    *("suites", "configs", "defaults", "published", "profiles"),
)
#: Listed only when asked for by name (``tta-bench ls configs``, ``ls defaults``).
_ON_REQUEST = ("configs", "defaults", "published", "profiles")


def cmd_ls(args: argparse.Namespace) -> int:
    kinds = [args.kind] if args.kind else [k for k in LIST_KINDS if k not in _ON_REQUEST]
    as_json: dict[str, Any] = {}
    into = as_json if args.json else None  # --json: each kind's listing goes there
    for kind in kinds:
        if kind == "defaults":
            _ls_defaults(into)
        elif kind == "published":
            _ls_published(into)
        elif kind == "profiles":
            _ls_profiles(into)
        elif kind == "configs":
            _ls_configs(into, heading=len(kinds) > 1)
        else:
            _ls_components(kind, into, heading=len(kinds) > 1)
    if args.json:
        print(json.dumps(as_json if not args.kind else as_json[args.kind], indent=1))
    return 0


def _ls_defaults(into: dict[str, Any] | None) -> None:
    """The catalogues' default for each choice (``catalog.DEFAULT_KEYS``)."""
    from tabulate import tabulate

    found = catalog.catalog()["defaults"]
    if into is not None:
        into["defaults"] = {k: found.get(k) for k in catalog.DEFAULT_KEYS}
        return
    rows = [[k, found.get(k, "-")] for k in catalog.DEFAULT_KEYS]
    print(tabulate(rows, headers=["choice", "default"], tablefmt="simple"))


def _ls_published(into: dict[str, Any] | None) -> None:
    """Figures papers publish, per method and dataset (percent)."""
    from tabulate import tabulate

    found = catalog.catalog()["published"]
    if into is not None:
        into["published"] = found
        return
    for name, entry in sorted(found.items()):
        acc = entry.get("accuracy") or {}
        sets = list(dict.fromkeys(d for row in acc.values() for d in row))
        print(f"{name}: {entry.get('description', '')}\nsource: {entry.get('source')}")
        heads = entry.get("prompts") or {}
        rows = [[m, _published_head(heads.get(m)), *(row.get(d, "-") for d in sets)]
                for m, row in acc.items()]  # fmt: skip
        print(tabulate(rows, headers=["row", "text head", *sets], tablefmt="simple"), end="\n\n")
    if not found:
        print("no published figures in the installed catalogues")


def _published_head(head: Any) -> str:
    """The text head a published row used (its ``prompts:``): one name, or per set grouped
    as ``name (n sets)``, ``not published`` for null."""
    if head is None or isinstance(head, str):
        return head or "not published"
    counts: dict[str, int] = {}
    for value in head.values():
        counts[value or "not published"] = counts.get(value or "not published", 0) + 1
    return "; ".join(f"{k} ({n} sets)" for k, n in counts.items())


def _ls_profiles(into: dict[str, Any] | None) -> None:
    """The protocol profiles (``profile=NAME``) and the methods with settings for each."""
    from tabulate import tabulate

    found = catalog.catalog()["profiles"]
    methods = catalog.catalog()["methods"]
    listed = {
        name: {
            "switch": (entry or {}).get("switch"),
            "methods": sorted(
                m for m, e in methods.items() if name in ((e or {}).get("profiles") or {})
            ),
            "description": str((entry or {}).get("description", "")).strip(),
        }
        for name, entry in sorted(found.items())
    }
    if into is not None:
        into["profiles"] = listed
        return
    rows = []
    for n, p in listed.items():
        switch = f"{p['switch']}=true" if p["switch"] else "-"
        rows.append([f"profile={n}", switch, ", ".join(p["methods"]) or "-", p["description"]])
    headers = ["profile", "switch", "methods with own settings", "description"]
    print(tabulate(rows, headers=headers, tablefmt="simple") if rows else "no profiles")


def _ls_configs(into: dict[str, Any] | None, heading: bool) -> None:
    """The method presets (``method=<preset>``) the installed distributions ship."""
    from tabulate import tabulate

    from tta_bench.config import presets

    found = presets()
    rows = [
        [f"method={p.name}", p.method, p.distribution, p.description]
        for p in sorted(found.values(), key=lambda p: p.name)
    ]
    headers = ["preset", "method", "from", "description"]
    if into is not None:
        listed = [dict(zip(("name", "method", "from", "description"), r)) for r in rows]
        into["configs"] = [{**r, "name": r["name"].removeprefix("method=")} for r in listed]
        return
    if heading:
        print("\nconfigs:")
    print(tabulate(rows, headers=headers, tablefmt="simple") if rows else "no presets")


def _ls_components(kind: str, into: dict[str, Any] | None, heading: bool) -> None:
    """The suites, or the registered components of ``kind``, with where each comes from."""
    from tabulate import tabulate

    if kind == "suites":
        rows = []
        for name, meta in sorted(catalog.catalog()["suites"].items()):
            shifts = meta.get("shifts") or []
            rows.append(
                [
                    name,
                    f"{len(shifts)} shifts x sev {meta.get('severities')}",
                    str(meta.get("description", "")).strip(),
                ]
            )
        headers = ["suite", "protocol", "description"]
    elif kind == "methods":  # with the family each belongs to (the catalogue's ``family``)
        reg = registry(kind)
        rows = [
            [n, reg.origin(n).distribution, _family(n), catalog.description(kind, n)]
            for n in reg.names()
        ]
        headers = [SINGULAR[kind], "from", "family", "description"]
    else:
        reg = registry(kind)
        rows = [[n, reg.origin(n).distribution, catalog.description(kind, n)] for n in reg.names()]
        headers = [SINGULAR[kind], "from", "description"]
    if into is not None:
        keys = {
            "suites": ("name", "protocol", "description"),
            "methods": ("name", "from", "family", "description"),
        }.get(kind, ("name", "from", "description"))
        into[kind] = [dict(zip(keys, r)) for r in rows]
        return
    if heading:
        print(f"\n{kind}:")
    if not rows:
        print(NO_PLUGINS.format(kind=kind) + ".")
        return
    print(tabulate(rows, headers=headers, tablefmt="simple"))


def _family(method: str) -> str:
    """A method's family in its catalogue entry (``open-set``, ``online``, ``TENT
    family``, ...), or an empty string."""
    return str(catalog.entry("methods", method).get("family") or "")


def _malloc_line() -> str:
    """Where batch-sized CPU tensors come from (``tta_bench.buffers``), in words."""
    from tta_bench import buffers

    return (
        "the C library's, unchanged; shift kernels recycle their batch buffers "
        f"(up to {buffers.MAX_BYTES >> 20} MiB kept)"
    )


def _cache_lines() -> list[tuple[str, str]]:
    """``env``'s cache dir, decoded-cache and text-head lines. A cache path that cannot be
    used (a file, a folder under a file, no permission) is said in the ``cache dir`` line,
    and the other two say ``unknown``: ``env`` reports it instead of failing, so its
    ``--json`` output stays JSON."""
    import os
    from pathlib import Path

    from tta_bench.paths import cache_dir
    from tta_bench.run.cache import BUDGET_ENV, cache_budget_bytes, cache_used_bytes
    from tta_bench.text_head import text_head_entries

    try:
        path = cache_dir()
        used = cache_used_bytes()
        heads = text_head_entries()
    except OSError as exc:
        where = Path(os.environ.get("TTA_BENCH_CACHE") or exc.filename or "?")
        why = exc.strerror or str(exc)
        for p in (where, *where.parents):
            if p.exists():
                why = f"{p} is a file, not a folder" if not p.is_dir() else why
                break
        unknown = "unknown (no usable cache dir)"
        return [
            ("cache dir", f"{where} (not usable: {why}; set TTA_BENCH_CACHE to a writable folder)"),
            ("decoded cache", unknown),
            ("text-head cache", unknown),
        ]
    return [
        ("cache dir", str(path)),
        (
            "decoded cache",
            f"{used / 2**30:.2f} GiB used of a {cache_budget_bytes() / 2**30:.1f} GiB budget "
            f"({BUDGET_ENV})",
        ),
        (
            "text-head cache",
            f"{len(heads)} heads, {sum(h['bytes'] for h in heads) / 2**20:.1f} MiB",
        ),
    ]


def cmd_env(args: argparse.Namespace) -> int:
    import importlib.metadata as md

    check_cache_budget()

    import torch

    from tta_bench.run.spec import resolve_device

    device = resolve_device("auto")
    lines = [
        ("tta-bench", md.version("tta-bench")),
        ("python", sys.version.split()[0]),
        ("torch", torch.__version__),
        ("CUDA available", str(torch.cuda.is_available())),
        ("CUDA (torch build)", str(torch.version.cuda)),
        (
            "cuDNN",
            str(torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None),
        ),
        (
            "device used",
            str(device)
            + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        ),
        ("CPU threads", str(torch.get_num_threads())),
        ("CPU kernels", str(torch.backends.cpu.get_cpu_capability())),
        ("allocator (CPU runs)", _malloc_line()),
        *_cache_lines(),
    ]
    for name in ("torchvision", "open_clip_torch", "timm", "datasets", "hydra-core"):
        try:
            lines.append((name, md.version(name)))
        except md.PackageNotFoundError:
            lines.append((name, "not installed"))
    dists: dict[str, tuple[str, list[str]]] = {}
    for kind in KINDS:
        reg = registry(kind)
        for n in reg.names():
            o = reg.origin(n)
            dists.setdefault(o.distribution, (o.version, []))[1].append(f"{kind}:{n}")
    if args.json:
        plugins = {d: {"version": v, "components": len(i)} for d, (v, i) in sorted(dists.items())}
        print(json.dumps({**dict(lines), "plugin distributions": plugins}, indent=1))
        return 0
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        print(f"{k:<{width}}  {v}")
    print("\nplugin distributions:")
    for dist, (version, items) in sorted(dists.items()):
        print(f"  {dist} {version}: {len(items)} components")
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    """List or clear the decoded-image and text-head cache entries."""
    from tabulate import tabulate

    from tta_bench import text_head
    from tta_bench.run import cache

    check_cache_budget()
    decoded = args.kind in ("all", "decoded")
    heads = args.kind in ("all", "text")
    if args.action == "list":
        if decoded:
            entries = cache.cache_entries()
            rows = [
                [e["name"], e["kind"], e["images"], f"{e['bytes'] / 2**20:.1f}", e["path"]]
                for e in entries
            ]  # decoded splits, and the shifted-image cache's corrupted domains
            print("images (decoded splits and shifted domains):")
            headers = ["domain", "kind", "images", "MB", "file"]
            print(tabulate(rows, headers=headers) if rows else "empty")
            used, budget = cache.cache_used_bytes(), cache.cache_budget_bytes()
            print(f"{used / 2**30:.2f} GiB used of {budget / 2**30:.1f} GiB ({cache.BUDGET_ENV})")
        if heads:
            rows = [
                [
                    (e.get("about") or {}).get("model", "?"),
                    f"{e.get('classes')} x {e.get('templates')}",
                    e.get("device"),
                    f"{e['bytes'] / 2**10:.1f}",
                    "ok" if e.get("ok") else "unreadable",
                ]
                for e in text_head.text_head_entries()
            ]
            print("\ntext heads:")
            print(
                tabulate(rows, headers=["model", "classes x templates", "device", "KiB", "state"])
                if rows
                else "empty"
            )
        return 0
    if args.names and not decoded:
        raise UsageError("domain names select decoded-cache entries; drop them with --kind text")
    if decoded:
        removed = cache.clear_cache(args.names or None)
        freed = sum(e["bytes"] for e in removed)
        print(f"removed {len(removed)} image-cache entries ({freed / 2**20:.1f} MB)")
    if heads and not args.names:
        removed = text_head.clear_text_heads()
        print(f"removed {len(removed)} text-head entries")
    return 0
