"""Verification reports: what ``tta-bench verify`` found about a results file, kept as a small
JSON file that a leaderboard can show beside the run.

A report names the results file it checked by the SHA-256 of its bytes (``results_sha256``):
a report whose digest is not the file's (the file was edited, resumed or rescored after it)
is stale and never counts. ``verify --record`` writes it beside the results file as
``<results file>.verify`` (e.g. ``run.json.verify``: not ``*.json``, so a leaderboard never
reads it as a results file); ``verify --report-dir DIR`` writes it into ``DIR`` under the same
name. Reading reports imports neither torch nor the runner.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tta_bench.paths import file_sha256

__all__ = [
    "REPORT_FORMAT",
    "REPORT_SUFFIX",
    "report_path",
    "verified_mark",
    "write_report",
]

#: Version of the report's layout.
REPORT_FORMAT = 1
#: The report of ``<results file>`` is ``<results file><REPORT_SUFFIX>``.
REPORT_SUFFIX = ".verify"


def report_path(results_path: str | Path, folder: str | Path | None = None) -> Path:
    """Where the report of ``results_path`` goes: beside it, or in ``folder``."""
    results_path = Path(results_path)
    name = results_path.name + REPORT_SUFFIX
    return (Path(folder) if folder is not None else results_path.parent) / name


def write_report(report: dict[str, Any], path: Path) -> Path:
    """Write ``report`` (``Verification.report()``) to ``path`` atomically; returns it."""
    from tta_bench.paths import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(report, indent=1, allow_nan=False) + "\n")
    return path


def _matching_report(results_path: Path) -> dict[str, Any] | None:
    """The report beside ``results_path`` when it is one and names this file's bytes."""
    path = report_path(results_path)
    if not path.is_file():
        return None
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(report, dict) or report.get("format") != REPORT_FORMAT:
        return None
    cells = report.get("cells")
    if not isinstance(cells, list) or not cells:
        return None
    try:
        digest = file_sha256(results_path)
    except OSError:
        return None
    return report if report.get("results_sha256") == digest else None


def verified_mark(results_path: str | Path) -> dict[str, str] | None:
    """What a leaderboard shows beside a run whose results file has a matching report:
    ``{"text": "✓ 3/3", "title": ...}`` when every re-run cell was identical, ``"✗ 2/3"``
    when one was not; None without a report, or with a stale one (another digest)."""
    report = _matching_report(Path(results_path))
    if report is None:
        return None
    cells = report["cells"]
    same = sum(1 for c in cells if isinstance(c, dict) and c.get("identical") is True)
    sign = "✓" if same == len(cells) else "✗"
    when = str(report.get("created") or "")[:10]
    title = (
        f"tta-bench verify{f' ({when})' if when else ''}: {same} of {len(cells)} re-run "
        f"cell(s) identical to the file's"
    )
    first = next((c for c in cells if isinstance(c, dict) and not c.get("identical")), None)
    if first is not None and isinstance(first.get("first_difference"), dict):
        title += f"; first difference: {first['first_difference'].get('field')}"
    return {"text": f"{sign} {same}/{len(cells)}", "title": title}
