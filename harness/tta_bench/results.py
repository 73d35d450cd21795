"""Results JSON: one file per run, one entry per cell, written atomically after every cell.

Schema (``schema_version`` 1)::

    {schema_version, created, method, model, suite, protocol: {id, ...}, config,
     provenance: {git_sha, packages, device, plugins: [...]}, cells: [...], summary}

A cell holds at least ``shift, severity, seed, n, accuracy`` (a fraction), ``error``,
``time_per_sample_s``, ``peak_memory_bytes``, plus the reference (source model) accuracy
and the cost breakdown.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata as md
import json
import platform
import subprocess
import threading
from pathlib import Path
from typing import Any

from tta_bench import SCHEMA_VERSION
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


def device_info(device: Any) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"type": device.type, "platform": platform.platform()}
    if device.type == "cuda":
        info["name"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    else:
        info["name"] = platform.processor() or platform.machine()
        info["threads"] = torch.get_num_threads()
    return info


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def default_output(results_dir: str, method: str, suite: str) -> Path:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(results_dir) / f"{suite}_{method}_{stamp}.json"


def _dumps(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=1, sort_keys=False) + "\n"


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON through ``atomic_path`` (fsynced): a reader (or a killed run)
    sees the old file or the new one, never a truncated one."""
    atomic_write_text(path, _dumps(data), fsync=True)


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

    def __init__(self, path: Path):
        self.path = Path(path)
        self._cond = threading.Condition()
        self._pending: str | None = None
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="results-writer", daemon=True)
        self._thread.start()

    def submit(self, data: dict[str, Any]) -> None:
        text = _dumps(data)
        with self._cond:
            self._raise_error()
            if self._closed:
                raise RuntimeError(f"results writer for {self.path} is closed")
            self._pending = text
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
                text, self._pending = self._pending, None
            try:
                atomic_write_text(self.path, text, fsync=True)
            except Exception as exc:  # handed to the loop's thread
                with self._cond:
                    self._error = exc


def load_results(path: str | Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ValueError(
            f"{path}: results schema_version {version!r} is not supported "
            f"(this tta-bench reads {SCHEMA_VERSION})"
        )
    return data


def summarize(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Suite-level figures: mean accuracy over cells (per seed, then over seeds) with its
    sample std and 95% Student t interval over seeds (``tta_bench.stats``), mean ECE and
    NLL, mean time per sample and the largest peak memory."""
    if not cells:
        return {"mean_accuracy": None, "n_cells": 0}
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
    from tta_bench import stats  # scipy: only once there are cells to summarise

    acc = stats.suite_estimate({"cells": cells}, "accuracy")
    if acc is not None:
        out["accuracy_std"] = acc.std
        out["accuracy_ci95"] = [acc.ci_low, acc.ci_high] if acc.ci_low is not None else None
    for key in ("ece", "nll"):
        est = stats.suite_estimate({"cells": cells}, key)
        if est is not None:
            out[f"mean_{key}"] = est.mean
    return out
