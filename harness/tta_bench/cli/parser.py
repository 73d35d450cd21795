"""The ``tta-bench`` argument parser: ``build_parser``, one ``_add_*`` function per group
of subcommands (each sets its command function as ``func``), the global options every
command takes after its name (``-v``, ``-q``, ``--include``) and each command's ``--help``
example (``EXAMPLES``). Building it imports no torch.
"""

from __future__ import annotations

import argparse
from typing import Any

from tta_bench.cli.list_commands import LIST_KINDS, cmd_cache, cmd_env, cmd_ls
from tta_bench.cli.report_commands import (
    cmd_compare,
    cmd_leaderboard,
    cmd_rescore,
    cmd_table,
    cmd_validate,
)
from tta_bench.cli.run_commands import (
    cmd_merge,
    cmd_predict,
    cmd_profile,
    cmd_run,
    cmd_serve,
    cmd_sweep,
)

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
    "compare": ["tta-bench compare results/METHOD.json", "tta-bench compare a.json b.json --json"],
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
    _add_verify(sub)
    _add_data(sub)
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


def _command(
    sub: Any, name: str, func: Any, help: str, description: str | None = None, **defaults: Any
) -> argparse.ArgumentParser:
    """Subcommand ``name``, run by ``func`` (``help``: its line in ``tta-bench --help``;
    ``description``: the top of its own ``--help``; ``defaults``: values no option sets)."""
    command = sub.add_parser(name, help=help, description=description)
    command.set_defaults(func=func, **defaults)
    return command


def _add_target(p: argparse.ArgumentParser, *, listed: bool) -> None:
    """``--method``, ``--suite``, ``--model`` and ``--dataset``: what ``run`` and ``profile``
    evaluate (``listed``: each help names the ``tta-bench ls`` list of its names)."""
    for kind, default in (
        ("method", _CATALOGUE_DEFAULT),
        ("suite", _CATALOGUE_DEFAULT),
        ("model", "default: the suite's"),
    ):
        listing = f" (tta-bench ls {kind}s)" if listed else ""
        p.add_argument(f"--{kind}", help=f"{kind} name{listing}; {default}")
    p.add_argument("--dataset", help=_DATASET_HELP)


def _add_pairing(p: argparse.ArgumentParser) -> None:
    """``--baseline`` and ``--test``: what ``table`` and ``leaderboard`` compare runs against,
    and how."""
    p.add_argument("--baseline", help=BASELINE_HELP)
    p.add_argument("--test", default="t", choices=("t", "bootstrap"), help="paired test")


def _add_run(sub: Any) -> None:
    r = _command(
        sub,
        "run",
        cmd_run,
        "evaluate one method on a suite",
        "Evaluate a method on a shifted test stream. Extra "
        "arguments are Hydra overrides, e.g. method.lr=1e-3 seeds=[0,1,2].",
    )
    _add_target(r, listed=True)
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


def _add_ls(sub: Any) -> None:
    ls = _command(sub, "ls", cmd_ls, "list registered components, suites and presets")
    ls.add_argument("kind", nargs="?", choices=LIST_KINDS)
    ls.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _add_sweep(sub: Any) -> None:
    sw = _command(
        sub,
        "sweep",
        cmd_sweep,
        "run a grid of runs as Hydra multirun jobs (resumable)",
        "Hydra multirun over run overrides, e.g. method=NAME1,NAME2 seeds=[0,1,2] "
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
    mg = _command(
        sub,
        "merge",
        cmd_merge,
        "combine the shard parts of a run (protocol.shard=i/N) into its results file",
        "Combine the N parts of one run, written with protocol.shard=i/N, into "
        "the results file the unsharded run writes: each cell's metrics computed once over "
        "all its samples (from the parts' per-sample logits). Refuses parts of different "
        "runs (model weights, method config, protocol, seeds, settings), a missing or "
        "repeated part, and unfinished parts.",
    )
    mg.add_argument("parts", nargs="+", help="the parts' results files")
    mg.add_argument("--output", "-o", required=True, help="the merged results file")
    mg.add_argument("--force", action="store_true", help="replace --output if it exists")


def _add_profile(sub: Any) -> None:
    pr = _command(
        sub,
        "profile",
        cmd_profile,
        "run a few batches and report where the time goes",
        "Run the first batches of a run (first seed) and report the time split "
        "(data wait / shift / model), the data-wait share and a recommendation.",
        output=None,
        cfg=False,
        quiet=True,
    )
    pr.add_argument("--batches", type=int, default=20, help="batches to run (default 20)")
    _add_target(pr, listed=False)
    pr.add_argument("--data-dir", help="root of local data for hub-backed datasets")
    pr.add_argument("overrides", nargs="*", help="Hydra overrides (key=value)")


def _add_env_and_cache(sub: Any) -> None:
    e = _command(sub, "env", cmd_env, "versions, device, cache dir, plugin distributions")
    e.add_argument("--json", action="store_true", help="print JSON instead of a table")
    c = _command(sub, "cache", cmd_cache, "list or clear the decoded-image and text-head caches")
    c.add_argument("action", choices=("list", "clear"))
    c.add_argument("names", nargs="*", help="clear: only these domains' decoded images")
    c.add_argument("--kind", choices=("all", "decoded", "text"), default="all")


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
    t = _command(sub, "table", cmd_table, "render tables from results files")
    t.add_argument("results", nargs="+", help="results JSON files (one protocol)")
    t.add_argument(
        "--format",
        default="github",
        help="formatted: github | markdown | latex | html | plain | csv-formatted; numbers for "
        "programs: json (cells and summary) | csv (one row per cell) | csv-summary (one row "
        "per run, interval bounds as columns)",
    )
    _add_pairing(t)
    lb = _command(
        sub, "leaderboard", cmd_leaderboard, "write a ranked leaderboard of a results directory"
    )
    lb.add_argument("results_dir", help="directory of results JSON files")
    lb.add_argument("--suite", required=True, help="suite to rank (tta-bench ls suites)")
    lb.add_argument("--protocol", help="protocol id to rank; default: the suite's current one")
    _add_pairing(lb)
    lb.add_argument("--no-plots", action="store_true", help="tables only")
    rs = _command(
        sub,
        "rescore",
        cmd_rescore,
        "recompute every registered metric from a run's per-sample outputs",
        "Recompute every registered metric from the per-sample files a run wrote "
        "with log_samples=logits (<results stem>.samples/), without adapting again: stored "
        "metrics are checked, metrics registered later are computed. Example: tta-bench "
        "rescore results/run.json --write",
    )
    rs.add_argument("results", help="a results JSON file whose run used log_samples=logits")
    rs.add_argument("--write", action="store_true", help="store the values in the results file")
    _add_compare(sub)


def _add_compare(sub: Any) -> None:
    cp = _command(
        sub,
        "compare",
        cmd_compare,
        "compare two runs per sample (McNemar, bootstraps, detectable effect)",
        "Compare run A with run B (default: the frozen model A scored on its own stream) "
        "on every sample both classified, from their per-sample files (log_samples=true): "
        "both accuracies, the seed-level paired t, McNemar's exact test, a bootstrap over "
        "samples and one over whole stream batches, and the smallest difference the "
        "samples can detect.",
    )
    cp.add_argument("a", metavar="A.json", help="results file of run A (with per-sample files)")
    cp.add_argument(
        "b",
        metavar="B.json",
        nargs="?",
        help="results file of run B, same protocol and weights; default: A's own reference",
    )
    cp.add_argument("--json", action="store_true", help="print the numbers as JSON")
    cp.add_argument(
        "--resamples", type=int, default=10_000, metavar="N", help="bootstrap resamples"
    )
    cp.add_argument(
        "--confidence", type=float, default=0.95, metavar="C", help="interval level in (0, 1)"
    )


def _add_deployment(sub: Any) -> None:
    pd = _command(
        sub,
        "predict",
        cmd_predict,
        "adapt and predict over an image folder (a resumable batch job)",
        "Run a method over the images of a folder, batch by batch, as the "
        "--config job.json describes (keys: tta_bench.deploy.predict). Writes <batch>_result.json "
        "files, logs/ and summary.json into output_dir; a rerun skips finished batches.",
    )
    pd.add_argument("--config", required=True, help="the job's JSON file")
    pd.add_argument("--quiet", action="store_true", help="no progress bar")

    from tta_bench.deploy.serve import add_arguments as serve_arguments  # argparse only, no torch

    sv = _command(
        sub,
        "serve",
        cmd_serve,
        "serve a method over HTTP (pip install 'tta-bench[serve]')",
        "HTTP service: POST /predict, /sessions; GET /health, /info. Per-session "
        "adaptation state over one shared frozen backbone. Ctrl-C stops it.",
    )
    serve_arguments(sv)


def _add_validate(sub: Any) -> None:
    from tta_bench.cli.validate import KIND_NAMES

    v = _command(
        sub,
        "validate",
        cmd_validate,
        "check one component against its contract (a line per check)",
        "Run the contract checks on one component and print PASS, FAIL or SKIP "
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


def _add_verify(sub: Any) -> None:
    from tta_bench.cli.verify_commands import DESCRIPTION, cmd_verify

    vf = _command(
        sub, "verify", cmd_verify, "re-run cells of a results file: identical or not", DESCRIPTION
    )
    vf.epilog = "example: tta-bench verify results/SUITE/METHOD.json --cells 3 --seed 0 --record"
    vf.add_argument("results", help="the results JSON file to verify (it is only read)")
    vf.add_argument(
        "--cells", type=int, metavar="K", help="cells to re-run (default 3, or all of fewer)"
    )
    vf.add_argument(
        "--seed", type=int, default=0, metavar="S", help="seed choosing the cells (default 0)"
    )
    vf.add_argument(
        "--record",
        action="store_true",
        help="write the verification report beside the file (<file>.verify), which the "
        "leaderboard marks while the file is unchanged",
    )
    vf.add_argument("--report-dir", metavar="DIR", help="also write the report into DIR")
    vf.add_argument("--threads", type=int, metavar="N", help="default: the recorded count")
    vf.add_argument("--device", help="default: the recorded device's type (cpu, cuda)")
    vf.add_argument("--data-dir", help="root of local data; default: the recorded one")


def _add_data(sub: Any) -> None:
    from tta_bench.cli.data_commands import DATA_CHECK_HELP, cmd_data

    d = _command(sub, "data", cmd_data, "check a suite's local data before a run", DATA_CHECK_HELP)
    d.epilog = "example: tta-bench data check --suite SUITE --data-dir /data --json"
    d.add_argument("action", choices=("check",), help="check: what of the suite's data is there")
    d.add_argument("--suite", help="suite whose data to check; default: the catalogues'")
    d.add_argument("--data-dir", help="root of local data, as tta-bench run takes it")
    d.add_argument("--json", action="store_true", help="print JSON instead of tables")
