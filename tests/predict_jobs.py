"""What the predict tests share: writing a job file and reading a job's per-batch results."""

from __future__ import annotations

import json
from pathlib import Path


def write_job(tmp_path: Path, **kw) -> Path:
    """A job file in ``tmp_path`` (digits class names, batches of 8, no progress bar);
    each call writes a new ``job-<n>.json``."""
    cfg = {"dataset": "digits", "batch_size": 8, "progress": False, **kw}
    path = tmp_path / f"job-{len(list(tmp_path.glob('job-*.json')))}.json"
    path.write_text(json.dumps(cfg))
    return path


def batch_results(out: Path) -> dict[str, dict]:
    """``{batch name: its result}`` of a job's output folder."""
    return {
        p.name.removesuffix("_result.json"): json.loads(p.read_text())
        for p in sorted(out.glob("*_result.json"))
    }
