"""The ``tta-bench`` commands that run a method: ``run``, ``sweep``, ``merge`` (a sharded
run's parts), ``profile``, and the deployment front ends ``predict`` and ``serve``
(``tta_bench.deploy``). Each imports what it runs only when called.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tta_bench import log
from tta_bench.cli.errors import usage_errors
from tta_bench.run.output import check_output
from tta_bench.run.resolve import UsageError, check_cache_budget, resolve_run

LOGGER = log.LOGGER


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
    with usage_errors():
        record = runner.run(spec, output)
    if record.get("skipped_cells"):
        print(f"resume: skipped {record['skipped_cells']} finished cell(s) already in {output}")
    _print_skipped_images(record)
    for event in record.get("events", []):
        LOGGER.warning(event)
    seeds = record.get("seeds") or spec.seeds  # what the file holds: merged runs included
    if spec.shard is not None and not record["cells"]:
        from tta_bench.run.samples import method_label

        print(
            f"\npart {spec.shard} of {method_label(record)} on {protocol.name} got no "
            f"batch of the stream (more parts than batches): an empty part, which tta-bench "
            f"merge takes like the others  results: {output}"
        )
        return 0
    print(
        f"\n{spec.method_preset or method} on {protocol.name} ({protocol.id}), model {model}, "
        f"seeds {seeds}: accuracy (%)"
    )
    print(tables.shift_table(record))
    print("\nover seeds (each seed: the mean over its cells)")
    print(tables.summary_table([record]))
    if len(seeds) < 2:
        print("one seed: no interval over seeds; add seeds=[0,1,2] for the 95% CIs")
    _print_orders(record)
    _print_realtime(record)
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


def _print_orders(record: dict[str, Any]) -> None:
    """With ``protocol.orders``: the spread of the suite accuracy over the stream orders and
    its Expected Tail Accuracy, and how the images were encoded."""
    from tta_bench.report.stats import TAIL_FRACTION, order_spread

    spread = order_spread(record)
    if spread is None:
        return
    est = spread.estimate
    ci = "" if est.ci_low is None else f" [{100 * est.ci_low:.2f}, {100 * est.ci_high:.2f}]"
    print(
        f"over {est.n} stream orders: accuracy {100 * est.mean:.2f}%{ci} (95% CI of the mean); "
        f"central 95% of orders {100 * spread.low:.2f}-{100 * spread.high:.2f}%; Expected "
        f"Tail Accuracy (mean of the worst {TAIL_FRACTION:.0%}, {spread.tail_n} orders) "
        f"{100 * spread.tail:.2f}%"
    )
    cache = record.get("feature_cache")
    if cache:
        print(
            f"feature cache: {cache['images_encoded']} images encoded once "
            f"({cache['encode_s']:.1f} s), their features replayed to every order"
        )


def _print_realtime(record: dict[str, Any]) -> None:
    """On the realtime track: the share of samples the method adapted on."""
    books = [c["realtime"] for c in record["cells"] if c.get("realtime")]
    if not books:
        return
    adapted = sum(b["adapted_samples"] for b in books)
    seen = sum(b["samples"] for b in books)
    print(
        f"realtime track: adapted on {adapted} of {seen} samples "
        f"({100 * adapted / max(seen, 1):.1f}%); the others were predicted by the current "
        "state while the method was busy"
    )


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
    from tta_bench.run.profiles import rewrite_switches

    check_cache_budget()
    overrides = list(args.overrides)
    with usage_errors():
        overrides = rewrite_switches(overrides)  # a profile's ``<switch>=true``
        sweep.check_launcher(overrides)  # before anything is composed or submitted
        sweep.check_choices(overrides)  # every method, model and suite of the value lists
        if args.shards is not None:
            overrides = sweep.shard_overrides(overrides, args.shards)
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
    with usage_errors():  # MergeError: parts of different runs, a part missing
        record = shard.merge_parts(args.parts, out)
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
    with usage_errors():
        prof = profile.profile(spec, batches=args.batches)
    print(
        f"{method} on {protocol.id}, model {model}, device {prof.device}: {prof.batches} "
        f"batches, {prof.images} images, loader {prof.loader}"
    )
    print(prof.table())
    print(f"\nsetup (model, data, decoded cache) {prof.setup_s:.2f}s")
    print(f"data-wait share {100 * prof.data_wait_share:.1f}%")
    print(f"recommendation: {prof.recommendation()}")
    return 0


# -- predict / serve (tta_bench.deploy.predict / tta_bench.deploy.serve) --------------------
def cmd_predict(args: argparse.Namespace) -> int:
    from tta_bench.deploy import predict

    with usage_errors():  # the job file, its names and values, the folder layout
        return predict.main(args.config, quiet=args.quiet)


def cmd_serve(args: argparse.Namespace) -> int:
    from tta_bench.deploy import serve

    with usage_errors():  # names, limits, overrides; the missing 'serve' extra
        return serve.main(args)
