"""The import paths of the modules that moved into the harness's rooms (``run/``,
``report/``, ``deploy/``, ``cli/``) keep working: ``import tta_bench.adapter`` or
``from tta_bench.results import load_results`` gives the module at its new place (the same
module object, so a patch through either name patches both). ``MOVED`` is the table; a
test holds it to the tree. Imports nothing of the harness until an old path is imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

#: old path -> new path. ``tta_bench.report`` and ``tta_bench.cli`` are rooms now, so their
#: old modules are reached as ``tta_bench.report.leaderboard`` and ``tta_bench.cli.commands``.
MOVED = {
    **{
        f"tta_bench.{old}": f"tta_bench.run.{new}"
        for old, new in {
            "accounting": "accounting",
            "cost": "cost",
            "images": "images",
            "inputs": "inputs",
            "loader": "loader",
            "loggers": "trackers",
            "openset": "openset",
            "profile": "profiler",
            "protocol": "protocol",
            "record": "record",
            "rescore": "rescore",
            "resolve": "resolve",
            "results": "results",
            "resume": "resume",
            "runner": "runner",
            "samples": "samples",
            "schema": "schema",
            "shard": "shard",
            "spec": "spec",
            "stream": "stream",
            "sweep": "sweep",
        }.items()
    },
    **{
        f"tta_bench.{old}": f"tta_bench.report.{new}"
        for old, new in {
            "export": "export",
            "metric_columns": "columns",
            "plots": "plots",
            "stats": "stats",
            "tables": "tables",
        }.items()
    },
    **{
        f"tta_bench.{m}": f"tta_bench.deploy.{m}"
        for m in ("adapter", "predict", "serve", "uploads")
    },
    "tta_bench.validate": "tta_bench.cli.validate",
    "tta_bench.templates": "tta_bench.text_head",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module at its new path."""

    def __init__(self) -> None:
        self.specs: dict[str, Any] = {}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        module = importlib.import_module(MOVED[spec.name])
        self.specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: Any) -> None:
        # the import system set the old name's spec on the shared module: give it its own back
        module.__spec__ = self.specs.pop(module.__spec__.name)


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
