"""``tta-bench verify``: re-run some cells of a results file and say whether they come out the
same.

``verify_results(path, cells=K, seed=S)`` picks ``K`` cells of the file (``choose_cells``: a
seeded sample of its cell keys, so the same ``S`` picks the same cells anywhere), re-creates
the run from its record (``record_spec``: the recorded method config, preset, suite and
protocol overrides, model and its arguments, through the same resolution as ``tta-bench
run``), refuses when the run here would not be the recorded one (protocol id, method config
hash, model arguments, weights: ``VerifyError`` naming the field, before anything runs), and
runs the cells with the runner (``tta_bench.run.runner.Evaluation``) into a temporary folder,
with the recorded thread count. The results file and its folder are only read.

Which cells can run alone is the protocol's reset policy (``Protocol.stateful``):

* independent policies (a reset at the start of every cell, or every batch): each chosen cell
  runs alone. The temporary output starts as the file's record without the chosen cells, so
  the runner's resume skips every other cell;
* stateful policies (``continual``, ``gradual``, ``mixed_domains`` and their class-sorted
  kinds: the state is carried from cell to cell): a cell depends on every batch of its seed
  before it, so the seed's stream runs from its start up to the last batch of its last
  chosen cell (``Prefix``); the cost is said. A method that schedules over the stream's
  length (``method_resolved.stream_length`` in the record) runs its whole stream.

Each re-run cell is compared with the file's field by field (``compare_cell``): every field
the file stores except those that measure the machine (``measured``: times, memory, the
finish time); "identical" means equal exactly. The environment (torch, threads, CPU kernels,
device, packages) is compared too, as context: a forward-only method's predictions must
match on any machine, while float metrics (NLL, ECE) and an adapting method's predictions can
differ by float rounding between instruction sets or thread counts (docs/submitting.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tta_bench.run import results
from tta_bench.run.results import cell_key

__all__ = [
    "CellCheck",
    "Prefix",
    "Verification",
    "VerifyError",
    "choose_cells",
    "compare_cell",
    "hydra_literal",
    "measured",
    "record_spec",
    "verify_results",
]

#: Cells checked when ``--cells`` is not given (fewer when the file holds fewer).
DEFAULT_CELLS = 3
#: Cell fields that measure the machine rather than the method (besides every ``*_s``
#: figure: seconds per sample, samples per second).
_MACHINE_FIELDS = frozenset(
    {"data_wait_share", "peak_memory_bytes", "peak_memory_kind", "finished"}
)
_ABSENT = "<absent>"


class VerifyError(ValueError):
    """A results file that cannot be verified here; the message names the field."""


def measured(name: str) -> bool:
    """Whether a cell field measures the machine (never compared)."""
    return name.endswith("_s") or name in _MACHINE_FIELDS


# -- choosing cells ----------------------------------------------------------------------
def choose_cells(record: dict[str, Any], k: int, seed: int) -> list[dict[str, Any]]:
    """``k`` cells of ``record`` chosen by ``seed`` from its cell keys (so the choice depends
    on the file's cells only, not on their order in it), in run order: by seed, then the
    protocol's order of shifts and severities."""
    cells = {cell_key(c): c for c in record["cells"]}
    if not 1 <= k <= len(cells):
        raise VerifyError(
            f"--cells {k}: expected 1 to {len(cells)} (the number of cells the file holds)"
        )
    # ranked by a digest of (seed, key): the same cells for a seed on any machine or Python,
    # and a larger k adds cells to a smaller one's
    ranked = sorted(cells, key=lambda key: hashlib.sha256(repr((seed, key)).encode()).digest())
    picked = ranked[:k]
    proto = record["protocol"]
    shifts = {s: i for i, s in enumerate(proto.get("shifts") or [])}
    return [
        cells[key]
        for key in sorted(picked, key=lambda x: (x[2], shifts.get(x[0], len(shifts)), x[1], x[0]))
    ]


# -- re-creating the run -------------------------------------------------------------------
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def hydra_literal(value: Any, where: str = "value") -> str:
    """``value`` (JSON-like) in Hydra's override grammar, parsed back to the same value:
    strings always quoted (a backslash escaped only before a quote, as the grammar wants),
    lists, dicts with identifier keys, numbers, booleans, null."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        text = re.sub(
            r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), value
        )
        return f"'{text}'"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_literal(v, where) for v in value) + "]"
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str) or not _KEY.fullmatch(k)]
        if bad:
            raise VerifyError(f"{where}: key {bad[0]!r} cannot be given as a Hydra override")
        return "{" + ",".join(f"{k}:{hydra_literal(v, where)}" for k, v in value.items()) + "}"
    raise VerifyError(f"{where}: {value!r} ({type(value).__name__}) is not a JSON value")


#: Recorded run settings that change what a run computes, passed again as they were.
_SETTINGS = ("reference", "per_class_accuracy", "flops", "profile", "feature_cache")


def rerun_arguments(record: dict[str, Any], seeds: list[int]) -> dict[str, Any]:
    """``resolve_run``'s arguments that re-create ``record``'s run for ``seeds``: the method
    (its preset, when it came from one), suite (or ad-hoc dataset), model, and as overrides
    every recorded method and model value, every protocol override, the settings that change
    numbers (``_SETTINGS``); no per-sample files, batch log or progress bars."""
    config = record.get("config") or {}
    overrides: list[str] = []
    for node in ("method", "model", "protocol"):
        for key, value in (config.get(node) or {}).items():
            if key == "name" or (node == "protocol" and value is None):
                continue
            overrides.append(f"{node}.{key}={hydra_literal(value, f'config.{node}.{key}')}")
    for key in _SETTINGS:
        if config.get(key) is not None:
            overrides.append(f"{key}={hydra_literal(config[key], f'config.{key}')}")
    overrides += [
        f"seeds=[{','.join(str(int(s)) for s in seeds)}]",
        "log_samples=false",
        "progress=false",
        "batch_log=null",
    ]
    dataset = config.get("dataset")
    if isinstance(dataset, dict) and dataset.get("name"):  # an ad-hoc suite (--dataset)
        for key, value in dataset.items():
            if key != "name":
                overrides.append(f"dataset.{key}={hydra_literal(value, f'config.dataset.{key}')}")
    return {
        "method": record.get("method_preset") or record["method"],
        "suite": None if isinstance(dataset, dict) and dataset.get("name") else record["suite"],
        "model": record["model"]["name"],
        "dataset": dataset.get("name") if isinstance(dataset, dict) else None,
        "overrides": overrides,
    }


#: Run-key fields, as ``verify`` names them in a refusal.
_KEY_FIELDS = {
    "model": "model.name",
    "model_args": "model.args",
    "method": "method",
    "method_config_hash": "method_config_hash",
    "protocol_id": "protocol.id",
    "shard": "shard",
}


def record_spec(
    record: dict[str, Any], seeds: list[int], *, device: str, data_dir: str | None = None
) -> Any:
    """The ``RunSpec`` that re-runs ``record``'s ``seeds`` on ``device``, resolved as
    ``tta-bench run`` resolves its arguments; a ``VerifyError`` naming the first run-key
    field (``protocol.id``, ``method_config_hash``, ``model.args``, ...) that comes out
    otherwise here, with both values."""
    from tta_bench.run.resolve import resolve_run
    from tta_bench.run.resume import spec_key

    args = rerun_arguments(record, seeds)
    config = record.get("config") or {}
    _, spec = resolve_run(
        args["method"],
        args["suite"],
        args["model"],
        [*args["overrides"], f"device={device}"],
        data_dir=data_dir if data_dir is not None else config.get("data_dir"),
        dataset=args["dataset"],
    )
    here, recorded = spec_key(spec), results.record_key(record)
    for key in recorded.keys() | here.keys():
        if recorded.get(key) != here.get(key):
            raise VerifyError(
                f"{_KEY_FIELDS.get(key, key)}: the file records {recorded.get(key)!r}, this "
                f"installation makes {here.get(key)!r} from the same settings, so its run "
                "cannot be re-created here (verify with the tta-bench and plugin versions "
                "the file's provenance names)"
            )
    return spec


def check_weights(record: dict[str, Any], bundle: Any) -> None:
    """A ``VerifyError`` naming ``model.weights_sha256`` or ``model.state_sha256`` when the
    weights here are not the recorded ones."""
    from tta_bench.model import state_sha256

    model = record["model"]
    here = {
        "weights_sha256": getattr(bundle, "weights_sha256", None),
        "state_sha256": state_sha256(bundle.clip),
    }
    for key, value in here.items():
        if model.get(key) is not None and model.get(key) != value:
            raise VerifyError(
                f"model.{key}: the file's model {model['name']!r} ({model.get('weights')}) "
                f"has {model[key]}, the weights here have {value}: another model, whose "
                "numbers are not the file's"
            )


# -- comparing -----------------------------------------------------------------------------
@dataclass
class CellCheck:
    """One re-run cell against the file's: equal in every compared field, or the first
    field (dotted for nested ones, e.g. ``per_class_accuracy.3``) that differs."""

    shift: str
    severity: int
    seed: int
    compared: int
    field: str | None = None
    recorded: Any = None
    rerun: Any = None

    @property
    def identical(self) -> bool:
        return self.field is None

    @property
    def name(self) -> str:
        return f"{self.shift} sev {self.severity} seed {self.seed}"

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "shift": self.shift,
            "severity": self.severity,
            "seed": self.seed,
            "identical": self.identical,
            "fields_compared": self.compared,
        }
        if not self.identical:
            out["first_difference"] = {
                "field": self.field,
                "recorded": self.recorded,
                "rerun": self.rerun,
            }
        return out


def _differences(name: str, a: Any, b: Any) -> tuple[int, tuple[str, Any, Any] | None]:
    """``(fields compared, first (field, a, b) that differs or None)``; nested dicts field by
    field (``a``'s order first), everything else by exact equality."""
    if isinstance(a, dict) and isinstance(b, dict):
        count, first = 0, None
        for key in [*a, *(k for k in b if k not in a)]:
            n, diff = _differences(f"{name}.{key}", a.get(key, _ABSENT), b.get(key, _ABSENT))
            count += n
            first = first or diff
        return count, first
    same = type(a) is type(b) or (isinstance(a, (int, float)) and isinstance(b, (int, float)))
    return 1, None if same and a == b else (name, a, b)


def compare_cell(recorded: dict[str, Any], rerun: dict[str, Any]) -> CellCheck:
    """``rerun`` against ``recorded``: every field ``recorded`` stores but the ``measured``
    ones, accuracy first, then in the file's order."""
    shift, severity, seed = cell_key(recorded)
    check = CellCheck(shift, severity, seed, 0)
    names = ["accuracy", *(k for k in recorded if k != "accuracy")]
    for name in names:
        if measured(name) or name in ("shift", "severity", "seed"):
            continue
        n, diff = _differences(name, recorded.get(name, _ABSENT), rerun.get(name, _ABSENT))
        check.compared += n
        if diff is not None and check.field is None:
            check.field, check.recorded, check.rerun = diff
    return check


def environment_differences(record: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """What differs between the recorded environment and ``here`` (``environment``): torch,
    thread count, CPU kernels, device, package versions; each as ``name: here (recorded X)``."""
    prov = record.get("provenance") or {}
    device = prov.get("device") or {}
    recorded = {
        "torch": prov.get("torch"),
        "threads": _recorded_threads(record),
        "CPU kernels": device.get("cpu_capability"),
        "device": device.get("type"),
        "device name": device.get("name"),
        **{f"package {k}": v for k, v in (prov.get("packages") or {}).items()},
    }
    return [
        f"{name}: {here.get(name)} (recorded {value})"
        for name, value in recorded.items()
        if value is not None and here.get(name) != value
    ]


def environment(device: Any) -> dict[str, Any]:
    """This machine's side of ``environment_differences``."""
    import torch

    info = results.device_info(device)
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "CPU kernels": info.get("cpu_capability"),
        "device": info.get("type"),
        "device name": info.get("name"),
        **{f"package {k}": v for k, v in results.package_versions().items()},
    }


# -- running ------------------------------------------------------------------------------
@dataclass
class Prefix:
    """A seed of a stateful protocol: its stream runs from the start through ``batches`` of
    its ``total`` batches, which finishes ``cells`` of its ``of_cells`` cells."""

    seed: int
    batches: int
    total: int
    cells: int
    of_cells: int
    whole_because: str = ""

    def describe(self, policy: str) -> str:
        if self.whole_because:
            return (
                f"seed {self.seed}: {policy} carries the method's state from cell to cell, and "
                f"{self.whole_because}: its whole stream runs ({self.total} batches, "
                f"{self.of_cells} cells)"
            )
        return (
            f"seed {self.seed}: {policy} carries the method's state from cell to cell, so the "
            f"stream runs from its start: {self.batches} of its {self.total} batches "
            f"({self.cells} of {self.of_cells} cells) to reach its chosen cell(s)"
        )


@dataclass
class Verification:
    """The outcome of ``verify_results``."""

    path: Path
    digest: str
    record: dict[str, Any]
    chosen: list[dict[str, Any]]
    seed: int
    checks: list[CellCheck] = field(default_factory=list)
    prefixes: list[Prefix] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)
    differences: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return len(self.checks) == len(self.chosen) and all(c.identical for c in self.checks)

    def report(self) -> dict[str, Any]:
        """The verification report (``tta_bench.run.verify_report``)."""
        from tta_bench._version import __version__
        from tta_bench.run.verify_report import REPORT_FORMAT

        return {
            "format": REPORT_FORMAT,
            "results_file": self.path.name,
            "results_sha256": self.digest,
            "run_key": results.record_key(self.record, with_weights=True),
            "created": results.now_iso(),
            "seed": self.seed,
            "cells_in_file": len(self.record["cells"]),
            "identical": sum(c.identical for c in self.checks),
            "cells": [c.as_dict() for c in self.checks],
            "stateful_prefixes": [dataclasses.asdict(p) for p in self.prefixes],
            "environment": self.environment,
            "environment_differences": self.differences,
            "notes": self.notes,
            "tta_bench": __version__,
            "git_sha": results.git_sha(),
        }


def _say(message: str) -> None:
    print(f"verify: {message}", file=sys.stderr, flush=True)


def _read(path: Path) -> tuple[dict[str, Any], str]:
    """The record and the SHA-256 of the file's bytes; a ``VerifyError`` for what is no
    results file."""
    from tta_bench.paths import file_sha256

    if not path.is_file():
        raise VerifyError(f"results file {str(path)!r} does not exist")
    digest = file_sha256(path)
    try:
        record = results.load_results(path)
    except ValueError as exc:
        raise VerifyError(str(exc)) from exc
    if not record["cells"]:
        raise VerifyError(f"{path}: the file holds no cells to verify")
    return record, digest


def _recorded_threads(record: dict[str, Any]) -> int | None:
    prov = record.get("provenance") or {}
    threads = prov.get("torch_threads", (prov.get("device") or {}).get("threads"))
    return int(threads) if threads else None


def verify_results(
    path: str | Path,
    cells: int | None = None,
    seed: int = 0,
    *,
    device: str | None = None,
    data_dir: str | None = None,
    threads: int | None = None,
    progress: Callable[[str], None] = _say,
) -> Verification:
    """Re-run ``cells`` cells of the results file ``path`` (default ``DEFAULT_CELLS``, or all
    of a smaller file), chosen with ``seed``, on ``device`` (default: the recorded device's
    type) with ``threads`` intra-op threads (default: the recorded count), and compare each
    with the file's. ``progress`` receives a line per step and per cell. Bad input (no such
    file, not a results file, ``cells`` out of range, a run that cannot be re-created here,
    other weights) is a ``VerifyError`` (a ``ValueError``) raised before anything runs; the
    file and its folder are never written."""
    import torch

    from tta_bench.run.runner import seed_torch
    from tta_bench.run.spec import resolve_device

    path = Path(path)
    record, digest = _read(path)
    k = min(DEFAULT_CELLS, len(record["cells"])) if cells is None else int(cells)
    chosen = choose_cells(record, k, seed)
    if threads is not None and threads < 1:
        raise VerifyError(f"--threads {threads}: expected 1 or more")
    prov_device = (record.get("provenance") or {}).get("device") or {}
    seeds = sorted({int(c["seed"]) for c in chosen})
    spec = record_spec(
        record, seeds, device=device or prov_device.get("type") or "auto", data_dir=data_dir
    )
    dev = resolve_device(spec.device)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or _recorded_threads(record) or previous)
    try:
        seed_torch(0, dev)  # as the runner builds its model: independent of ambient state
        from tta_bench.registry import registry

        bundle = registry("models").get(spec.model)(**spec.model_args)
        check_weights(record, bundle)
        verification = Verification(path, digest, record, chosen, seed)
        verification.environment = environment(dev)
        verification.differences = environment_differences(record, verification.environment)
        _run(verification, spec, bundle, dev, progress)
    finally:
        torch.set_num_threads(previous)
    return verification


def _run(v: Verification, spec: Any, bundle: Any, dev: Any, progress: Callable) -> None:
    """Run the chosen cells into a temporary folder: all at once under an independent
    policy, each seed's prefix under a stateful one."""
    protocol = spec.protocol
    with tempfile.TemporaryDirectory(prefix="tta-bench-verify-") as tmp:
        if not protocol.stateful:
            progress(
                f"reset policy {protocol.reset}: each cell runs alone; re-running "
                f"{len(v.chosen)} cell(s) of {v.path.name}"
            )
            out = Path(tmp) / "rerun.json"
            chosen = {cell_key(c) for c in v.chosen}
            others = [c for c in v.record["cells"] if cell_key(c) not in chosen]
            if others:  # the runner's resume skips them: only the chosen cells run
                results.write_json_atomic(out, {**v.record, "cells": others})
            _evaluate(v, spec, out, bundle, None, progress)
            return
        from tta_bench.run.inputs import RunInputs

        inputs = RunInputs.build(
            protocol, bundle, dev, data_dir=spec.data_dir, cache=spec.cache,
            loader=spec.loader, progress=False, on_bad_image=spec.on_bad_image,
        )  # fmt: skip
        for seed in spec.seeds:
            prefix = _prefix(v, protocol, inputs.labels, seed)
            v.prefixes.append(prefix)
            progress(prefix.describe(protocol.reset))
            stop = None if prefix.whole_because else prefix.batches
            one = dataclasses.replace(spec, seeds=[seed])
            _evaluate(v, one, Path(tmp) / f"seed{seed}.json", bundle, stop, progress)
    if len(v.checks) != len(v.chosen):
        v.notes.append(f"only {len(v.checks)} of {len(v.chosen)} chosen cells were re-run")


def _prefix(v: Verification, protocol: Any, labels: Any, seed: int) -> Prefix:
    """How much of ``seed``'s stream must run for its chosen cells: through the last batch
    that holds a sample of one of them."""
    from tta_bench.run.stream import build_stream

    stream = build_stream(protocol, seed, labels)
    last: dict[int, int] = {}
    for batch in stream.batches:
        for d in {int(x) for x in batch.domains.tolist()}:
            last[d] = batch.number
    ids = {dom: i for i, dom in enumerate(stream.domains)}
    wanted = [ids[(c["shift"], int(c["severity"]))] for c in v.chosen if int(c["seed"]) == seed]
    stop = 1 + max(last[d] for d in wanted)
    prefix = Prefix(
        seed, stop, len(stream.batches), sum(1 for b in last.values() if b < stop), len(last)
    )
    if "stream_length" in (v.record.get("method_resolved") or {}):
        prefix.whole_because = (
            "the method schedules over the stream's length (method_resolved.stream_length)"
        )
        prefix.batches, prefix.cells = prefix.total, prefix.of_cells
    return prefix


def _evaluate(
    v: Verification,
    spec: Any,
    output: Path,
    bundle: Any,
    max_batches: int | None,
    progress: Callable[[str], None],
) -> None:
    """One run of the runner; each chosen cell compared as its group finishes."""
    from tta_bench.run.runner import Evaluation

    wanted = {cell_key(c): c for c in v.chosen if int(c["seed"]) in spec.seeds}

    def on_cells(cells: list[dict[str, Any]], _record: dict[str, Any]) -> None:
        for cell in json.loads(json.dumps(cells)):  # as a results file stores it
            recorded = wanted.get(cell_key(cell))
            if recorded is None:  # a cell of a stateful prefix that was not chosen
                continue
            check = compare_cell(recorded, cell)
            v.checks.append(check)
            outcome = "identical" if check.identical else f"differs in {check.field}"
            progress(f"[{len(v.checks)}/{len(v.chosen)}] {check.name}: {outcome}")

    record = Evaluation(
        spec, output, bundle=bundle, on_cells=on_cells, max_batches=max_batches
    ).run()
    recorded = v.record.get("method_resolved")
    if recorded is not None and record.get("method_resolved") != recorded:
        _, diff = _differences("method_resolved", recorded, record.get("method_resolved"))
        if diff is not None:
            v.notes.append(
                f"{diff[0]}: recorded {diff[1]!r}, re-run {diff[2]!r} (the method resolved "
                "its settings otherwise in this run)"
            )
