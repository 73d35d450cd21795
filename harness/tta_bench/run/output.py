"""The results path of a run, checked before anything is built: writable, not a folder,
and, when it exists and the run resumes, holding this run (and, with ``log_samples``, the
per-sample files of the cells a resumed run skips)."""

from __future__ import annotations

from typing import Any

from tta_bench.run.resolve import UsageError

__all__ = ["check_output"]


def check_output(path: Any, spec: Any) -> None:
    """The results path must be writable, and an existing file must be this run's."""
    import os
    import tempfile
    from pathlib import Path

    from tta_bench.run import results
    from tta_bench.run.resume import spec_key

    path = Path(path)
    if path.is_dir():
        raise UsageError(f"--output {str(path)!r} is a directory; give a file path")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"--output {str(path)!r}: {str(parent)!r} is a file, not a directory")
    try:  # the real test: create the folder and a file in it (permissions, read-only mounts)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as exc:
        raise UsageError(
            f"--output {str(path)!r}: cannot write in {str(path.parent)!r} ({exc.strerror or exc})"
        ) from None
    if path.exists():
        if not os.access(path, os.W_OK):
            raise UsageError(f"--output {str(path)!r} is not writable")
        if spec.resume:
            try:
                old = results.load_results(path)
            except ValueError as exc:
                raise UsageError(f"--output holds no readable results to resume: {exc}") from exc
            if results.record_key(old) != spec_key(spec):
                raise UsageError(
                    f"--output {str(path)!r} holds a different run ({results.record_key(old)}); "
                    "choose another output or set resume=false"
                )
            _check_resumed_samples(path, old, spec)


def _check_resumed_samples(path: Any, old: dict[str, Any], spec: Any) -> None:
    """``log_samples`` logs the cells a run computes: resuming an output whose finished
    cells have no per-sample file would leave them without one, silently. Refuse it."""
    from tta_bench.run import samples

    if not spec.log_samples or spec.log_samples_auto:  # auto: the runner leaves them off
        return
    folder = samples.samples_dir(path)
    lacking = [
        c for c in old["cells"]
        if not c.get("diverged")
        and not samples.cell_file(folder, c["shift"], c["severity"], c["seed"]).is_file()
    ]  # fmt: skip
    if lacking:
        raise UsageError(
            f"--output {str(path)!r} already holds {len(lacking)} finished cell(s) without "
            f"per-sample files (they were run without log_samples), which a resumed run skips; "
            "log_samples applies to the cells a run computes: choose a new --output, set "
            "resume=false to run every cell again, or log_samples=false (or auto) to go on "
            "without per-sample files"
        )
