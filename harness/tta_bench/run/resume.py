"""Resume: which cells of a run an existing results file already holds.

A results file holds one run: the *run key* (model and its weights, method + config hash,
protocol id) must match, or the file is refused (``ResumeMismatchError``). Cells are keyed
by ``(shift, severity, seed)`` within it; a diverged cell counts as done (the same inputs
diverge again). A group (``tta_bench.run.stream``: one cell, or a whole
seed for the stateful protocols) counts as done only when every cell of it is there and
scored; a partial stateful seed is dropped and redone, since its cells depend on each
other.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tta_bench.method import config_dict
from tta_bench.run import results
from tta_bench.run.results import cell_key, record_key
from tta_bench.run.stream import Stream

CellKey = tuple[str, int, int]
__all__ = ["cell_key", "record_key", "ResumeMismatchError", "finished_record"]


class ResumeMismatchError(ValueError):
    """The output file exists but holds a different run."""


def method_config_hash(method_config: Any, by_dataset: dict[str, Any] | None = None) -> str:
    """A short hash of the resolved method config (part of the run key).

    A Config class may name fields added after results were recorded whose defaults
    reproduce the earlier behaviour exactly (``hash_omit_at_default``, a tuple of names):
    while such a field holds its default it is left out of the hash, so the run key of
    every earlier run still holds; any other value is hashed as usual. ``by_dataset``: the
    per-dataset configs of a multi-dataset suite (``RunSpec.method_configs``)."""
    import dataclasses

    data = config_dict(method_config)
    omit = getattr(type(method_config), "hash_omit_at_default", ())
    if omit and dataclasses.is_dataclass(method_config):
        defaults = type(method_config)()
        for name in omit:
            if name in data and getattr(method_config, name) == getattr(defaults, name):
                data.pop(name)
    if by_dataset:  # per-dataset configs (RunSpec.method_configs): hashed with the base
        data = {"base": data, "by_dataset": {d: config_dict(c) for d, c in by_dataset.items()}}
    blob = json.dumps(data, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def spec_key(spec: Any, state_sha256: str | None = None) -> dict[str, Any]:
    """The run key of a ``RunSpec`` (``state_sha256``: the loaded weights, once known)."""
    key = {
        "model": spec.model,
        "model_args": spec.model_args,
        "method": spec.method,
        "method_config_hash": method_config_hash(
            spec.method_config, getattr(spec, "method_configs", None)
        ),
        "protocol_id": spec.protocol.id,
    }
    if state_sha256 is not None:
        key["state_sha256"] = state_sha256
    if getattr(spec, "shard", None) is not None:
        key["shard"] = spec.shard.as_dict()
    return key


def wanted_cells(spec: Any) -> set[CellKey]:
    p = spec.protocol
    sevs = sorted(set(p.severities)) if p.order_policy == "gradual" else p.severities
    return {(s, int(v), int(seed)) for seed in spec.seeds for s in p.shifts for v in sevs}


def finished_record(spec: Any, output: Path) -> dict[str, Any] | None:
    """The record in ``output`` when it already holds every cell of ``spec``, else None.

    Lets a rerun of a finished run (or sweep job) return before building the model or
    touching the data. Raises ``ValueError`` for a corrupt or foreign-schema file."""
    output = Path(output)
    if not spec.resume or not output.exists():
        return None
    old = results.load_results(output)
    if record_key(old) != spec_key(spec):
        return None  # a different run: the evaluation reports it
    have = {cell_key(c) for c in old["cells"]}
    if not wanted_cells(spec) <= have:
        return None
    old["skipped_cells"] = len(wanted_cells(spec))
    return old


def previous_record(output: Path, fresh: dict[str, Any], resume: bool) -> dict[str, Any] | None:
    """The existing record to continue, or None to start afresh; raises
    ``ResumeMismatchError`` when ``output`` holds another run (weights included)."""
    output = Path(output)
    # Temporary files of a write that a killed run left behind are never results. Only
    # when the file's lock is free: a live writer holds it while its temporary file exists
    # (a killed one's lock dies with it), so what is found then is stale.
    if output.parent.exists():
        try:
            with results.results_lock(output, timeout=0):
                for stale in output.parent.glob(f".{output.name}.*.tmp"):
                    stale.unlink(missing_ok=True)
        except OSError:
            pass  # another run is writing this file now: its temporary file is live
    if not resume or not output.exists():
        return None
    old = results.load_results(output)  # raises on a corrupt file: never overwrite it
    mine, theirs = record_key(fresh, with_weights=True), record_key(old, with_weights=True)
    if mine != theirs:
        differs = sorted(k for k in mine if mine[k] != theirs.get(k))
        raise ResumeMismatchError(
            f"{output} holds a different run (differs in {', '.join(differs)}: "
            f"{ {k: theirs.get(k) for k in differs} } vs { {k: mine[k] for k in differs} }); "
            "choose another --output or set resume=false"
        )
    return old


def done_groups(stream: Stream, done: set[CellKey]) -> set[int]:
    """The groups of ``stream`` whose every cell is in ``done``."""
    seed = stream.seed
    return {
        g
        for g, doms in enumerate(stream.groups)
        if all((*stream.domains[d], seed) in done for d in doms)
    }


def drop_unfinished(
    cells: list[dict[str, Any]], streams: list[Stream], finished: dict[int, set[int]]
) -> list[dict[str, Any]]:
    """``cells`` without those of groups that are not finished (``finished[seed]`` = the
    done groups of that seed's stream): a partial group is redone whole."""
    redo: set[CellKey] = set()
    for stream in streams:
        for g, doms in enumerate(stream.groups):
            if g not in finished[stream.seed]:
                redo |= {(*stream.domains[d], stream.seed) for d in doms}
    return [c for c in cells if cell_key(c) not in redo]
