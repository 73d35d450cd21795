"""``tta-bench``: run, ls, validate, env, and the other subcommands; every command takes
``--include FILE_OR_DIR`` (local components, ``tta_bench.include``). ``main`` is the entry
point; the parser is ``cli.parser``, the commands are ``cli.run_commands`` (run, sweep,
merge, profile, predict, serve), ``cli.list_commands`` (ls, env, cache) and
``cli.report_commands`` (table, leaderboard, rescore, validate), ``cli.data_commands``
(data check) and ``cli.verify_commands`` (verify).

Exit status: 0 success, 1 runtime failure, 2 bad input (unknown name, bad override, bad
value); every bad-input message names the value and lists the options.
Listing commands import no torch.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from tta_bench import catalog, log
from tta_bench.cli.parser import build_parser
from tta_bench.registry import RegistryError
from tta_bench.run.resolve import UsageError

__all__ = ["build_parser", "main"]


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
