"""``tta-bench``: run, ls, validate, env, and the commands each section below names; every
command takes ``--include FILE_OR_DIR`` (local components, ``tta_bench.include``).

Exit status: 0 success, 1 runtime failure, 2 bad input (unknown name, bad override, bad
value); every bad-input message names the value and lists the options.
Listing commands import no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from tta_bench import catalog, log
from tta_bench.registry import KINDS, SINGULAR, RegistryError, registry
from tta_bench.run.resolve import NO_PLUGINS, UsageError, check_output, resolve_run

LOGGER = log.LOGGER

LIST_KINDS = (*[k for k in KINDS if k != "configs"], "suites", "configs", "defaults", "published")
#: Listed only when asked for by name (``tta-bench ls configs``, ``ls defaults``).
_ON_REQUEST = ("configs", "defaults", "published")


def _resolve_run(args: argparse.Namespace) -> tuple[Any, Any]:
    """``(composed config, RunSpec)`` of ``run``/``profile`` from the parsed arguments."""
    return resolve_run(
        args.method,
        args.suite,
        args.model,
        args.overrides,
        output=args.output,
        data_dir=args.data_dir,
        dataset=getattr(args, "dataset", None),
    )


def cmd_run(args: argparse.Namespace) -> int:
    from omegaconf import OmegaConf

    cfg, spec = _resolve_run(args)
    protocol, method, model = spec.protocol, spec.method, spec.model
    if args.cfg:
        print(OmegaConf.to_yaml(OmegaConf.create(spec.config)), end="")
        print(f"# protocol: {protocol.id}")
        return 0

    import dataclasses
    from pathlib import Path

    from tta_bench.report import tables
    from tta_bench.run import results, runner

    output = (
        Path(cfg.output)
        if cfg.output
        else results.default_output(cfg.results_dir, method, protocol.name)
    )
    check_output(output, spec)
    spec = dataclasses.replace(
        spec, progress=spec.progress and not args.quiet, on_bad_image=args.on_bad_image
    )
    try:
        record = runner.run(spec, output)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if record.get("skipped_cells"):
        print(f"resume: skipped {record['skipped_cells']} finished cell(s) already in {output}")
    _print_skipped_images(record)
    for event in record.get("events", []):
        LOGGER.warning(event)
    seeds = record.get("seeds") or spec.seeds  # what the file holds: merged runs included
    print(
        f"\n{spec.method_preset or method} on {protocol.name} ({protocol.id}), model {model}, "
        f"seeds {seeds}: accuracy (%)"
    )
    print(tables.shift_table(record))
    print("\nover seeds (each seed: the mean over its cells)")
    print(tables.summary_table([record]))
    if len(seeds) < 2:
        print("one seed: no interval over seeds; add seeds=[0,1,2] for the 95% CIs")
    print("\ncost")
    print(tables.cost_table(record))
    mean = record["summary"]["mean_accuracy"]
    wall = f"wall {record['wall_time_s']:.1f}s  results: {output}"
    if mean is None:
        diverged = record["summary"].get("n_diverged", 0)
        print(f"\nmean accuracy: not scored ({diverged} cell(s) diverged)  {wall}")
    else:
        print(f"\nmean accuracy {100 * mean:.2f}%  {wall}")
    return 0


def _print_skipped_images(record: dict[str, Any]) -> None:
    """What ``--on-bad-image=skip`` left out: a count and the first paths, per domain."""
    for name, bad in sorted((record.get("skipped_images") or {}).items()):
        shown = ", ".join(str(b.get("path") or f"index {b['index']}") for b in bad[:3])
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        print(
            f"skipped {len(bad)} unreadable image(s) in {name}: {shown}{more} "
            "(listed under 'skipped_images' in the results)",
            file=sys.stderr,
        )


# -- sweep / profile ---------------------------------------------------------------------
def cmd_sweep(args: argparse.Namespace) -> int:
    from tta_bench.run import sweep

    overrides = list(args.overrides)
    try:
        sweep.check_launcher(overrides)  # before anything is composed or submitted
        if args.shards is not None:
            overrides = sweep.shard_overrides(overrides, args.shards)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if args.pack < 1:
        raise UsageError(f"--pack {args.pack}: expected 1 (no packing) or more")
    if not args.seeds_per_job_all:
        overrides = sweep.split_seed_overrides(overrides)
    return sweep.main(overrides, args.dir, cfg=args.cfg, pack=args.pack)


def cmd_merge(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tta_bench.run import shard

    out = Path(args.output)
    if out.exists() and not args.force:
        raise UsageError(f"--output {str(out)!r} exists; choose another path or pass --force")
    try:
        record = shard.merge_parts(args.parts, out)
    except ValueError as exc:  # MergeError: parts of different runs, a part missing
        raise UsageError(str(exc)) from exc
    n = sum(int(c["n"]) for c in record["cells"])
    print(
        f"merged {len(args.parts)} parts of {record['method']} on {record['protocol']['id']}: "
        f"{len(record['cells'])} cells, {n} samples, mean accuracy "
        f"{100 * record['summary']['mean_accuracy']:.2f}% -> {out}"
    )
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    import dataclasses

    from tta_bench.run import profiler as profile

    _, spec = _resolve_run(args)
    protocol, method, model = spec.protocol, spec.method, spec.model
    # A slice of the first seed, measured, never written as results or logs.
    spec = dataclasses.replace(spec, seeds=spec.seeds[:1], batch_log=None, flops=False)
    try:
        prof = profile.profile(spec, batches=args.batches)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    print(
        f"{method} on {protocol.id}, model {model}, device {prof.device}: {prof.batches} "
        f"batches, {prof.images} images, loader {prof.loader}"
    )
    print(prof.table())
    print(f"\nsetup (model, data, decoded cache) {prof.setup_s:.2f}s")
    print(f"data-wait share {100 * prof.data_wait_share:.1f}%")
    print(f"recommendation: {prof.recommendation()}")
    return 0


# -- ls / env ----------------------------------------------------------------------------
def cmd_ls(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    kinds = [args.kind] if args.kind else [k for k in LIST_KINDS if k not in _ON_REQUEST]
    as_json: dict[str, Any] = {}
    for kind in kinds:
        if kind == "defaults":
            found = catalog.catalog()["defaults"]
            rows = [[k, found.get(k, "-")] for k in catalog.DEFAULT_KEYS]
            if args.json:
                as_json[kind] = {k: found.get(k) for k in catalog.DEFAULT_KEYS}
                continue
            print(tabulate(rows, headers=["choice", "default"], tablefmt="simple"))
            continue
        if kind == "published":  # figures papers publish, per method and dataset (percent)
            found = catalog.catalog()["published"]
            if args.json:
                as_json[kind] = found
                continue
            for name, entry in sorted(found.items()):
                acc = entry.get("accuracy") or {}
                sets = list(dict.fromkeys(d for row in acc.values() for d in row))
                print(f"{name}: {entry.get('description', '')}\nsource: {entry.get('source')}")
                rows = [[m, *(row.get(d, "-") for d in sets)] for m, row in acc.items()]
                print(tabulate(rows, headers=["method", *sets], tablefmt="simple"), end="\n\n")
            if not found:
                print("no published figures in the installed catalogues")
            continue
        if kind == "configs":
            from tta_bench.config import presets

            found = presets()
            rows = [
                [f"method={p.name}", p.method, p.distribution, p.description]
                for p in sorted(found.values(), key=lambda p: p.name)
            ]
            headers = ["preset", "method", "from", "description"]
            if args.json:
                as_json[kind] = [
                    dict(zip(("name", "method", "from", "description"), r)) for r in rows
                ]
                as_json[kind] = [
                    {**r, "name": r["name"].removeprefix("method=")} for r in as_json[kind]
                ]
                continue
            if len(kinds) > 1:
                print(f"\n{kind}:")
            print(tabulate(rows, headers=headers, tablefmt="simple") if rows else "no presets")
            continue
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
        else:
            reg = registry(kind)
            rows = [
                [n, reg.origin(n).distribution, catalog.description(kind, n)] for n in reg.names()
            ]
            headers = [SINGULAR[kind], "from", "description"]
        if args.json:
            keys = (
                ("name", "protocol", "description")
                if kind == "suites"
                else ("name", "from", "description")
            )
            as_json[kind] = [dict(zip(keys, r)) for r in rows]
            continue
        if len(kinds) > 1:
            print(f"\n{kind}:")
        if not rows:
            print(NO_PLUGINS.format(kind=kind) + ".")
            continue
        print(tabulate(rows, headers=headers, tablefmt="simple"))
    if args.json:
        print(json.dumps(as_json if not args.kind else as_json[args.kind], indent=1))
    return 0


def _malloc_line() -> str:
    """What a run does with glibc's thresholds (``tta_bench.run.allocator``), in words."""
    from tta_bench.run.allocator import OPT_OUT_ENV, reuse_large_blocks

    state = reuse_large_blocks()
    if state["policy"] == "reuse":
        return (
            f"blocks up to {state['mmap_threshold'] >> 20} MiB reused from the heap, "
            f"{state['trim_threshold'] >> 20} MiB kept ({OPT_OUT_ENV}=system: glibc's default)"
        )
    return f"the C library's default ({state['reason']})"


def cmd_env(args: argparse.Namespace) -> int:
    import importlib.metadata as md

    import torch

    from tta_bench.paths import cache_dir
    from tta_bench.run.cache import BUDGET_ENV, cache_budget_bytes, cache_used_bytes
    from tta_bench.run.spec import resolve_device
    from tta_bench.text_head import text_head_entries

    device = resolve_device("auto")
    heads = text_head_entries()
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
        ("cache dir", str(cache_dir())),
        (
            "decoded cache",
            f"{cache_used_bytes() / 2**30:.2f} GiB used of a {cache_budget_bytes() / 2**30:.1f} "
            f"GiB budget ({BUDGET_ENV})",
        ),
        (
            "text-head cache",
            f"{len(heads)} heads, {sum(h['bytes'] for h in heads) / 2**20:.1f} MiB",
        ),
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

    decoded = args.kind in ("all", "decoded")
    heads = args.kind in ("all", "text")
    if args.action == "list":
        if decoded:
            entries = cache.cache_entries()
            rows = [
                [e["name"], e["images"], f"{e['bytes'] / 2**20:.1f}", e["path"]] for e in entries
            ]
            print("decoded images:")
            print(tabulate(rows, headers=["domain", "images", "MB", "file"]) if rows else "empty")
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
        print(f"removed {len(removed)} decoded-cache entries ({freed / 2**20:.1f} MB)")
    if heads and not args.names:
        removed = text_head.clear_text_heads()
        print(f"removed {len(removed)} text-head entries")
    return 0


# -- table / leaderboard (tta_bench.report.leaderboard) --------------------------------------
def _baseline(args: argparse.Namespace) -> str | None:
    """``--baseline``: unset means the catalogues' reference method, '' means none."""
    from tta_bench.report.tables import REFERENCE

    return REFERENCE if args.baseline is None else (args.baseline or None)


def cmd_table(args: argparse.Namespace) -> int:
    from tta_bench.report import leaderboard as report

    try:
        text = report.render_tables(args.results, args.format, _baseline(args), args.test)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    print(text, end="")
    return 0


def cmd_rescore(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from tta_bench.run.rescore import rescore

    try:
        checks = rescore(args.results, write=args.write)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    rows = [
        [
            c.name,
            c.cells,
            c.stored,
            "-" if c.max_difference is None else f"{c.max_difference:.3g}",
            f"{c.mean:.6f}",
        ]
        for c in checks
    ]
    headers = ["metric", "cells", "stored in", "max |stored - recomputed|", "mean over cells"]
    print(tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True))
    if args.write:
        print(f"written: {args.results}")
    return 0


def cmd_leaderboard(args: argparse.Namespace) -> int:
    from tta_bench.report import leaderboard as report

    try:
        board, written = report.write_leaderboard(
            args.results_dir,
            args.suite,
            args.protocol,
            _baseline(args),
            args.test,
            with_plots=not args.no_plots,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    for name, reason in board.left_out:
        LOGGER.warning(f"left out {name}: {reason}")
    print(f"ranked {len(board.entries)} runs under {board.protocol_id}")
    for path in written:
        print(f"wrote {path}")
    return 0


# -- predict / serve (tta_bench.deploy.predict / tta_bench.deploy.serve) --------------------
def cmd_predict(args: argparse.Namespace) -> int:
    from tta_bench.deploy import predict

    try:
        return predict.main(args.config, quiet=args.quiet)
    except ValueError as exc:  # the job file, its names and values, the folder layout
        raise UsageError(str(exc)) from exc


def cmd_serve(args: argparse.Namespace) -> int:
    from tta_bench.deploy import serve

    try:
        return serve.main(args)
    except ValueError as exc:  # names, limits, overrides; the missing 'serve' extra
        raise UsageError(str(exc)) from exc


# -- entry point -------------------------------------------------------------------------
#: Each command's ``--help`` example (the serve command has its own, with the token setup).
#: (METHOD, SUITE, ...: the names ``tta-bench ls`` lists.)
EXAMPLES = {
    "run": [
        "tta-bench run --method METHOD 'seeds=[0,1,2]' method.lr=1e-3",
        "tta-bench run --method METHOD --suite SUITE log_samples=logits --output r.json",
    ],
    "ls": ["tta-bench ls methods", "tta-bench ls --json"],
    "sweep": [
        "tta-bench sweep --dir sweep method=METHOD1,METHOD2 'seeds=[0,1,2]'",
        "tta-bench sweep --dir sweep method=METHOD hydra/launcher=submitit_slurm "
        "hydra.launcher.partition=gpu hydra.launcher.gpus_per_node=1 device=cuda",
        "tta-bench sweep --dir sweep method=METHOD protocol.reset=episodic_batch --shards 4",
    ],
    "merge": ["tta-bench merge part0.json part1.json part2.json part3.json --output whole.json"],
    "profile": ["tta-bench profile --method METHOD --batches 10"],
    "env": ["tta-bench env --json"],
    "cache": ["tta-bench cache list", "tta-bench cache clear --kind text"],
    "table": ["tta-bench table results/SUITE/*.json --format csv-summary"],
    "leaderboard": ["tta-bench leaderboard results/SUITE --suite SUITE"],
    "rescore": ["tta-bench rescore r.json --write"],
    "predict": ["tta-bench predict --config job.json"],
    "validate": ["tta-bench validate method METHOD", "tta-bench validate shift SHIFT"],
}


def build_parser() -> argparse.ArgumentParser:
    from tta_bench import __version__

    p = argparse.ArgumentParser(
        prog="tta-bench",
        description="Test-time adaptation benchmark for CLIP-style models.",
        epilog="example: tta-bench run --method METHOD (tta-bench ls methods); tta-bench "
        "COMMAND --help for each",
    )
    p.add_argument("--version", action="version", version=f"tta-bench {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_add_run, _add_ls, _add_sweep, _add_profile, _add_env_and_cache, _add_reports):
        add(sub)
    _add_deployment(sub)
    _add_validate(sub)
    for name, command in sub.choices.items():  # global options, given after the command
        if name in EXAMPLES and not command.epilog:
            command.epilog = "example:\n" + "\n".join(f"  {e}" for e in EXAMPLES[name])
            command.formatter_class = argparse.RawDescriptionHelpFormatter
        command.add_argument(
            "-v",
            "--verbose",
            action="count",
            default=0,
            help="more messages on stderr (-v progress notes, -vv debug)",
        )
        command.add_argument(
            "--quiet-log", "-q", dest="quiet_log", action="store_true", help="errors only"
        )
        command.add_argument(
            "--include",
            action="append",
            metavar="FILE_OR_DIR",
            help="load local components: a Python file declaring TTA_BENCH = {kind: {name: "
            "object}}, a YAML catalogue, or a directory of them (repeatable; docs/plugins.md)",
        )
    return p


def _add_run(sub: Any) -> None:
    r = sub.add_parser(
        "run",
        help="evaluate one method on a suite",
        description="Evaluate a method on a shifted test stream. Extra "
        "arguments are Hydra overrides, e.g. method.lr=1e-3 seeds=[0,1,2].",
    )
    r.add_argument("--method", help=f"method name (tta-bench ls methods); {_CATALOGUE_DEFAULT}")
    r.add_argument("--suite", help=f"suite name (tta-bench ls suites); {_CATALOGUE_DEFAULT}")
    r.add_argument("--model", help="model name (tta-bench ls models); default: the suite's")
    r.add_argument("--dataset", help=_DATASET_HELP)
    r.add_argument("--output", help="results JSON path; default: a timestamped file")
    r.add_argument("--data-dir", help="root of local data for hub-backed datasets")
    r.add_argument(
        "--on-bad-image",
        choices=("fail", "skip"),
        default="fail",
        help="a corrupt or truncated image file: fail naming it (default), or skip it "
        "(its index and path are recorded in the results)",
    )
    r.add_argument("--cfg", action="store_true", help="print the resolved config and exit")
    r.add_argument("--quiet", action="store_true", help="no progress bars")
    r.add_argument("overrides", nargs="*", help="Hydra overrides (key=value)")
    r.set_defaults(func=cmd_run)


def _add_ls(sub: Any) -> None:
    ls = sub.add_parser("ls", help="list registered components, suites and presets")
    ls.add_argument("kind", nargs="?", choices=LIST_KINDS)
    ls.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ls.set_defaults(func=cmd_ls)


def _add_sweep(sub: Any) -> None:
    sw = sub.add_parser(
        "sweep",
        help="run a grid of runs as Hydra multirun jobs (resumable)",
        description="Hydra multirun over run overrides, e.g. method=NAME1,NAME2 seeds=[0,1,2] "
        "hydra/launcher=joblib hydra.launcher.n_jobs=2. One job per method x model x seed; "
        "each writes a results JSON into --dir; rerunning skips finished cells. Launchers: "
        "basic (default), joblib, submitit_local, submitit_slurm (pip install "
        "'tta-bench[sweep]'); cluster use: docs/cluster.md.",
    )
    sw.add_argument("--dir", default="tta-results/sweep", help="sweep directory (results)")
    sw.add_argument(
        "--seeds-per-job-all",
        action="store_true",
        help="keep all seeds of seeds=[...] in one job instead of one job per seed",
    )
    sw.add_argument(
        "--cfg",
        choices=("job", "hydra", "all"),
        help="print the composed config (Hydra --cfg) and run nothing",
    )
    sw.add_argument(
        "--shards",
        type=int,
        metavar="N",
        help="split every cell into N parts, one job each (protocol.shard=0/N,...; reset "
        "policies episodic_batch/episodic_sample only), combined exactly when the sweep ends",
    )
    sw.add_argument(
        "--pack",
        type=int,
        default=8,
        metavar="N",
        help="run up to N light jobs (methods declaring light: one forward per sample) in "
        "one launcher task (default 8; 1 packs nothing)",
    )
    sw.add_argument("overrides", nargs="*", help="Hydra overrides, sweeps as a,b")
    sw.set_defaults(func=cmd_sweep)
    mg = sub.add_parser(
        "merge",
        help="combine the shard parts of a run (protocol.shard=i/N) into its results file",
        description="Combine the N parts of one run, written with protocol.shard=i/N, into "
        "the results file the unsharded run writes: each cell's metrics computed once over "
        "all its samples (from the parts' per-sample logits). Refuses parts of different "
        "runs (model weights, method config, protocol, seeds, settings), a missing or "
        "repeated part, and unfinished parts.",
    )
    mg.add_argument("parts", nargs="+", help="the parts' results files")
    mg.add_argument("--output", "-o", required=True, help="the merged results file")
    mg.add_argument("--force", action="store_true", help="replace --output if it exists")
    mg.set_defaults(func=cmd_merge)


def _add_profile(sub: Any) -> None:
    pr = sub.add_parser(
        "profile",
        help="run a few batches and report where the time goes",
        description="Run the first batches of a run (first seed) and report the time split "
        "(data wait / shift / model), the data-wait share and a recommendation.",
    )
    pr.add_argument("--batches", type=int, default=20, help="batches to run (default 20)")
    pr.add_argument("--method", help=f"method name; {_CATALOGUE_DEFAULT}")
    pr.add_argument("--suite", help=f"suite name; {_CATALOGUE_DEFAULT}")
    pr.add_argument("--model", help="model name; default: the suite's")
    pr.add_argument("--dataset", help=_DATASET_HELP)
    pr.add_argument("--data-dir", help="root of local data for hub-backed datasets")
    pr.add_argument("overrides", nargs="*", help="Hydra overrides (key=value)")
    pr.set_defaults(func=cmd_profile, output=None, cfg=False, quiet=True)


def _add_env_and_cache(sub: Any) -> None:
    e = sub.add_parser("env", help="versions, device, cache dir, plugin distributions")
    e.add_argument("--json", action="store_true", help="print JSON instead of a table")
    e.set_defaults(func=cmd_env)
    c = sub.add_parser("cache", help="list or clear the decoded-image and text-head caches")
    c.add_argument("action", choices=("list", "clear"))
    c.add_argument("names", nargs="*", help="clear: only these domains' decoded images")
    c.add_argument("--kind", choices=("all", "decoded", "text"), default="all")
    c.set_defaults(func=cmd_cache)


_DATASET_HELP = (
    "run a registered dataset without a suite (tta-bench ls datasets): an ad-hoc suite from "
    "its dataset.<arg>=VALUE overrides (dataset.path=DIR for its data_dir), clean images "
    "unless protocol.shifts=[...] is given (docs/cli.md)"
)
BASELINE_HELP = (
    "method to pair against; default: the catalogues' reference method (defaults: reference "
    "in a plugin's registry.yaml; `tta-bench ls defaults`), '' for none"
)
_CATALOGUE_DEFAULT = "default: the catalogues' (tta-bench ls defaults)"


def _add_reports(sub: Any) -> None:
    t = sub.add_parser("table", help="render tables from results files")
    t.add_argument("results", nargs="+", help="results JSON files (one protocol)")
    t.add_argument(
        "--format",
        default="github",
        help="formatted: github | markdown | latex | html | plain | csv-formatted; numbers for "
        "programs: json (cells and summary) | csv (one row per cell) | csv-summary (one row "
        "per run, interval bounds as columns)",
    )
    t.add_argument("--baseline", help=BASELINE_HELP)
    t.add_argument("--test", default="t", choices=("t", "bootstrap"), help="paired test")
    t.set_defaults(func=cmd_table)
    lb = sub.add_parser("leaderboard", help="write a ranked leaderboard of a results directory")
    lb.add_argument("results_dir", help="directory of results JSON files")
    lb.add_argument("--suite", required=True, help="suite to rank (tta-bench ls suites)")
    lb.add_argument("--protocol", help="protocol id to rank; default: the suite's current one")
    lb.add_argument("--baseline", help=BASELINE_HELP)
    lb.add_argument("--test", default="t", choices=("t", "bootstrap"), help="paired test")
    lb.add_argument("--no-plots", action="store_true", help="tables only")
    lb.set_defaults(func=cmd_leaderboard)
    rs = sub.add_parser(
        "rescore",
        help="recompute every registered metric from a run's per-sample outputs",
        description="Recompute every registered metric from the per-sample files a run wrote "
        "with log_samples=logits (<results stem>.samples/), without adapting again: stored "
        "metrics are checked, metrics registered later are computed. Example: tta-bench "
        "rescore results/run.json --write",
    )
    rs.add_argument("results", help="a results JSON file whose run used log_samples=logits")
    rs.add_argument("--write", action="store_true", help="store the values in the results file")
    rs.set_defaults(func=cmd_rescore)


def _add_deployment(sub: Any) -> None:
    pd = sub.add_parser(
        "predict",
        help="adapt and predict over an image folder (a resumable batch job)",
        description="Run a method over the images of a folder, batch by batch, as the "
        "--config job.json describes (keys: tta_bench.deploy.predict). Writes <batch>_result.json "
        "files, logs/ and summary.json into output_dir; a rerun skips finished batches.",
    )
    pd.add_argument("--config", required=True, help="the job's JSON file")
    pd.add_argument("--quiet", action="store_true", help="no progress bar")
    pd.set_defaults(func=cmd_predict)

    from tta_bench.deploy.serve import add_arguments as serve_arguments  # argparse only, no torch

    sv = sub.add_parser(
        "serve",
        help="serve a method over HTTP (pip install 'tta-bench[serve]')",
        description="HTTP service: POST /predict, /sessions; GET /health, /info. Per-session "
        "adaptation state over one shared frozen backbone. Ctrl-C stops it.",
    )
    serve_arguments(sv)
    sv.set_defaults(func=cmd_serve)


# -- validate (implemented in tta_bench.cli.validate) ------------------------------------------
def cmd_validate(args: argparse.Namespace) -> int:
    from tta_bench.cli import validate

    try:
        report = validate.validate(
            args.kind,
            args.name,
            model=args.model,
            suite=args.suite,
            data_dir=args.data_dir,
            device=args.device,
        )
    except ValueError as exc:  # an unknown kind, model or suite; no default model
        raise UsageError(str(exc)) from exc
    print(report.text())
    return 0 if report.ok else 1


def _add_validate(sub: Any) -> None:
    from tta_bench.cli.validate import KIND_NAMES

    v = sub.add_parser(
        "validate",
        help="check one component against its contract (a line per check)",
        description="Run the contract checks on one component and print PASS, FAIL or SKIP "
        "with the reason for each check. Exit status 0 when none fails, 1 when one does, 2 "
        "for an unknown kind or name. Methods run on --model (default: the catalogues') "
        "with a few images of --suite's dataset (default: the catalogues' suite), or random "
        "images when that dataset is not available.",
    )
    v.add_argument("kind", help=f"the kind of component: {', '.join(KIND_NAMES)}")
    v.add_argument("name", help="the component's name (tta-bench ls KIND)")
    v.add_argument("--model", help="model the method checks run on; default: the catalogues'")
    v.add_argument("--suite", help="suite whose dataset gives the images; default: the catalogues'")
    v.add_argument("--data-dir", help="root of local data (datasets that read local files)")
    v.add_argument("--device", default="cpu", help="device the checks run on (default cpu)")
    v.set_defaults(func=cmd_validate)


def main(argv: Sequence[str] | None = None) -> int:
    import os

    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    # Hydra overrides may come before, between or after options: collect them all.
    stray = [u for u in unknown if u.startswith("-") or "=" not in u]
    if stray or (unknown and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or unknown)}")
    if unknown:
        args.overrides = [*args.overrides, *unknown]
    if getattr(args, "quiet", False) or getattr(args, "quiet_log", False):
        os.environ["TQDM_DISABLE"] = "1"  # also silences plugins' own bars (pretraining)
    log.configure(-1 if getattr(args, "quiet_log", False) else getattr(args, "verbose", 0))
    from tta_bench.include import IncludeError, included

    try:
        with included(*(getattr(args, "include", None) or ())):  # for this command only
            if getattr(args, "include", None):
                catalog.catalog()  # an included catalogue's sections and clashes: up front
            return int(args.func(args) or 0)
    except (UsageError, RegistryError, IncludeError) as exc:
        print(f"tta-bench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tta-bench: interrupted; finished cells are in the results file", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head`: not an error of ours
        sys.stderr.close()
        return 0
    except OSError as exc:  # a failure inside a run (disk, lock): reported, not a traceback
        print(f"tta-bench: run failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
