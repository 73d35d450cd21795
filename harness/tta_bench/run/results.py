"""Results JSON: one file per run, one entry per cell, written atomically after every group.

Schema (``schema_version`` 2, declared in ``tta_bench.run.schema`` and checked on every load)::

    {schema_version, created, method, method_config, model: {name, weights, weights_sha256,
     state_sha256, args}, suite, protocol: {id, ...}, seeds, config, provenance: {git_sha,
     packages, device, threads, cpu_capability, plugins: [...]}, cells: [...], summary}

A cell holds at least ``shift, severity, seed, n, accuracy`` (a fraction, or null for a
diverged cell, which then carries ``diverged: {batch, reason}``), ``error``, the reference
(source model) accuracy and the cost breakdown. Files are strict JSON (no NaN/Infinity).

Writes go through ``ResultsFile``: under a lock (``<file>.lock``), the file on disk is read
back and every cell it holds that this writer does not (another run writing the same file,
e.g. another seed) is kept, so concurrent runs lose nothing.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import importlib.metadata as md
import json
import platform
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tta_bench.paths import atomic_write_text

PACKAGES = (
    "tta-bench",
    "torch",
    "torchvision",
    "open_clip_torch",
    "timm",
    "numpy",
    "datasets",
    "hydra-core",
    "scikit-learn",
)


def package_versions() -> dict[str, str | None]:
    """The installed versions of ``PACKAGES`` (None: not installed), as this process first
    read them: the packages it has imported do not change while it runs, and each record
    asks (nine metadata scans of ``sys.path``)."""
    return dict(_package_versions())


@functools.cache
def _package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def git_sha() -> str | None:
    """The commit of the tta_bench source tree, when it is a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(device: Any) -> dict[str, Any]:
    """What a number may depend on about the machine: device, CPU model and the instruction
    set torch's CPU kernels dispatch to (AVX-512 and AVX2 kernels round differently), and
    the intra-op thread count."""
    import torch

    info: dict[str, Any] = {
        "type": device.type,
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        info["name"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    else:
        info["name"] = info["cpu"]
    return info


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def default_output(results_dir: str, method: str, suite: str) -> Path:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(results_dir) / f"{suite}_{method}_{stamp}.json"


def _dumps(data: dict[str, Any]) -> str:
    # allow_nan=False: a NaN reaching a results file is a bug to surface, not a literal that
    # most JSON parsers reject.
    return json.dumps(data, indent=1, sort_keys=False, allow_nan=False) + "\n"


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON through ``atomic_path`` (fsynced): a reader (or a killed run)
    sees the old file or the new one, never a truncated one."""
    atomic_write_text(path, _dumps(data), fsync=True)


#: Seconds a writer waits for another process's lock on the same results file.
LOCK_TIMEOUT_S = 120.0


@contextlib.contextmanager
def results_lock(path: Path, timeout: float | None = None) -> Iterator[None]:
    """Hold the exclusive lock of a results file (``<file>.lock``), as every write does;
    an ``OSError`` naming the file and the lock when another process holds it longer than
    ``timeout`` (default ``LOCK_TIMEOUT_S``)."""
    from filelock import FileLock, Timeout

    path = Path(path)
    lock_path = path.with_name(path.name + ".lock")
    wait = LOCK_TIMEOUT_S if timeout is None else timeout
    try:
        lock = FileLock(str(lock_path), timeout=wait)
        lock.acquire()
    except Timeout as exc:
        raise OSError(
            f"results file {path} is locked by another process ({lock_path}) for over "
            f"{wait:g} s; nothing was written"
        ) from exc
    try:
        yield
    finally:
        lock.release()


class ResultsFile:
    """One results file written by one run, possibly alongside other runs of the same run
    key (other seeds): every write merges what is on disk under an exclusive lock."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self._written = False
        #: Things that went wrong but lost nothing (the file vanished and was rewritten).
        self.events: list[str] = []

    def write(self, record: dict[str, Any]) -> dict[str, Any]:
        """Merge ``record`` with the file's other cells and write it atomically; returns
        the merged record. Raises ``OSError`` when the lock cannot be had."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with results_lock(self.path):
            merged = self._merge(record)
            write_json_atomic(self.path, merged)
        self._written = True
        return merged

    def _merge(self, record: dict[str, Any]) -> dict[str, Any]:
        if not self.path.exists():
            if self._written:
                self.events.append(
                    f"{now_iso()}: {self.path} disappeared during the run; rewritten with "
                    "every cell this run holds"
                )
                record.setdefault("events", []).extend(self.events[-1:])
            return record
        disk = load_results(self.path)
        if record_key(disk, with_weights=True) != record_key(record, with_weights=True):
            raise ValueError(
                f"{self.path} now holds another run ({record_key(disk)}): it was replaced "
                "while this run was writing it; this run's cells were not written"
            )
        mine = {cell_key(c) for c in record["cells"]}
        extra = [c for c in disk["cells"] if cell_key(c) not in mine]
        merged = dict(record)
        merged["cells"] = list(record["cells"]) + extra
        # the file's seeds: every seed its cells hold, and every seed a writer runs
        merged["seeds"] = sorted(
            set(record["seeds"]) | set(disk["seeds"]) | {int(c["seed"]) for c in merged["cells"]}
        )
        if extra:
            merged["summary"] = summarize(merged["cells"])
        return merged


class SnapshotWriter:
    """Successive snapshots of one results file, written by a background thread with
    ``write_json_atomic``'s guarantees (atomic replace, fsynced), so the evaluation loop
    does not wait on the disk after every cell.

    ``submit`` serialises the snapshot at once (later changes to ``data`` do not leak into
    it) and queues it; a snapshot still waiting when a newer one arrives is dropped, since
    the newer one holds every cell the older one did. ``close`` writes what is queued and
    waits. A failed write is raised by the next ``submit`` or by ``close``. A run killed
    with SIGKILL loses at most the snapshot being written or queued: the file on disk is
    always a complete earlier snapshot.
    """

    def __init__(self, path: Path, results_file: ResultsFile | None = None):
        self.path = Path(path)
        self.file = results_file or ResultsFile(self.path)
        self._cond = threading.Condition()
        self._pending: dict[str, Any] | None = None
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="results-writer", daemon=True)
        self._thread.start()

    def submit(self, data: dict[str, Any]) -> None:
        snapshot = json.loads(_dumps(data))  # a frozen copy, checked for strict JSON now
        with self._cond:
            self._raise_error()
            if self._closed:
                raise RuntimeError(f"results writer for {self.path} is closed")
            self._pending = snapshot
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        with self._cond:
            self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise OSError(f"could not write results file {self.path}: {error}") from error

    def _work(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:  # closed, nothing left
                    return
                snapshot, self._pending = self._pending, None
            try:
                self.file.write(snapshot)
            except Exception as exc:  # handed to the loop's thread
                with self._cond:
                    self._error = exc


def record_key(record: dict[str, Any], with_weights: bool = False) -> dict[str, Any]:
    """The run key of a results record: model (+ its weights' state hash), method + config
    hash, protocol id. Two records of one key hold cells of the same run."""
    key = {
        "model": record["model"]["name"],
        "model_args": record["model"].get("args"),
        "method": record["method"],
        "method_config_hash": record.get("method_config_hash"),
        "protocol_id": record["protocol"]["id"],
    }
    if with_weights:
        key["state_sha256"] = record["model"].get("state_sha256")
    if record.get("shard"):  # a part of each cell (tta_bench.run.shard): never another part's
        key["shard"] = record["shard"]
    return key


def cell_key(cell: dict[str, Any]) -> tuple[str, int, int]:
    """A cell's key within its run: ``(shift, severity, seed)``."""
    return (cell["shift"], int(cell["severity"]), int(cell["seed"]))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name} (results files are strict JSON)")


#: The sha256 digests of the file contents that passed ``validate`` in this process (at
#: most ``_VALID_MAX``; then forgotten all at once): validation is a pure function of the
#: bytes, and a leaderboard, a merge, a resumed run or a service reads the same files again
#: and again; each read parses the file anew.
_VALID: dict[bytes, None] = {}
_VALID_MAX = 4096


def load_results(path: str | Path) -> dict[str, Any]:
    """A results file, parsed as strict JSON and validated against the declared schema
    (``tta_bench.run.schema``); raises ``ValueError`` naming the file and the bad field."""
    import hashlib

    from tta_bench.run.schema import ResultsFormatError, validate

    try:
        with open(path, "rb") as fh:
            raw = fh.read()
        data = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise ResultsFormatError(f"{path}: not valid JSON ({exc})") from exc
    except ValueError as exc:
        raise ResultsFormatError(f"{path}: {exc}") from exc
    except OSError as exc:
        raise ResultsFormatError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    if not isinstance(data, dict):
        raise ResultsFormatError(
            f"{path}: (top level): expected a results object, got a JSON {type(data).__name__}"
        )
    digest = hashlib.sha256(raw).digest()
    if digest not in _VALID:
        validate(data, str(path))
        if len(_VALID) >= _VALID_MAX:
            _VALID.clear()
        _VALID[digest] = None
    return data


def summarize(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Suite-level figures: mean accuracy over cells (per seed, then over seeds) with its
    sample std and 95% Student t interval over seeds (``tta_bench.report.stats``), the mean of
    every other metric the cells hold (``mean_<metric>``), mean time per sample and the
    largest peak memory."""
    if not cells:
        return {"mean_accuracy": None, "n_cells": 0}
    diverged = [c for c in cells if c.get("diverged")]
    if diverged:  # a diverged cell has no accuracy: the run's means are undefined
        times = [c["time_per_sample_s"] for c in cells if c.get("time_per_sample_s") is not None]
        return {
            "mean_accuracy": None,
            "n_cells": len(cells),
            "n_diverged": len(diverged),
            "diverged_cells": [
                {"shift": c["shift"], "severity": c["severity"], "seed": c["seed"], **c["diverged"]}
                for c in diverged
            ],
            "mean_time_per_sample_s": sum(times) / len(times) if times else None,
            "max_peak_memory_bytes": max(int(c["peak_memory_bytes"]) for c in cells),
        }
    by_seed: dict[int, list[float]] = {}
    for c in cells:
        by_seed.setdefault(int(c["seed"]), []).append(float(c["accuracy"]))
    per_seed = {s: sum(v) / len(v) for s, v in sorted(by_seed.items())}
    out: dict[str, Any] = {
        "mean_accuracy": sum(per_seed.values()) / len(per_seed),
        "mean_accuracy_per_seed": {str(s): a for s, a in per_seed.items()},
        "n_cells": len(cells),
    }
    refs = [c["reference_accuracy"] for c in cells if c.get("reference_accuracy") is not None]
    if len(refs) == len(cells):
        out["mean_reference_accuracy"] = sum(refs) / len(refs)
    # None: a cell whose only batch was FLOP-counted has no timing
    times = [c["time_per_sample_s"] for c in cells if c.get("time_per_sample_s") is not None]
    out["mean_time_per_sample_s"] = sum(times) / len(times) if times else None
    out["max_peak_memory_bytes"] = max(int(c["peak_memory_bytes"]) for c in cells)
    from tta_bench.report import stats  # scipy: only once there are cells to summarise

    acc = stats.suite_estimate({"cells": cells}, "accuracy")
    if acc is not None:
        out["accuracy_std"] = acc.std
        out["accuracy_ci95"] = [acc.ci_low, acc.ci_high] if acc.ci_low is not None else None
    from tta_bench.report.columns import table_columns

    for col in table_columns(cells):
        est = stats.suite_estimate({"cells": cells}, col.name)
        if est is not None:
            out[f"mean_{col.name}"] = est.mean
    return out
