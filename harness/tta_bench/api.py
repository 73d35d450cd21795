"""The Python API of a benchmark run: ``tta_bench.evaluate(...)`` is ``tta-bench run``.

    record = tta_bench.evaluate(method=name, suite=suite,   # tta-bench ls methods / suites
                                overrides=["method.lr=1e-3", "protocol.max_images=64"],
                                seeds=[0, 1])

The config is composed exactly as the CLI composes it (``tta_bench.config.compose``:
Hydra overrides, unknown keys are errors), turned into a ``RunSpec``
(``tta_bench.run.spec.spec_from_config``) and run (``tta_bench.run.runner.run``), so the record is
the one ``tta-bench run`` writes for the same arguments. Bad input raises ``ValueError``
(or ``tta_bench.registry.RegistryError`` for unknown names), naming the value and the options.

For adapting your own model outside a suite, see ``tta_bench.deploy.adapter.Adapter``.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["evaluate"]


def evaluate(
    method: str | None = None,
    suite: str | None = None,
    model: str | None = None,
    overrides: Sequence[str] = (),
    seeds: Sequence[int] | None = None,
    output: str | Path | None = None,
    *,
    device: str | None = None,
    data_dir: str | Path | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Run ``method`` on ``suite`` and return the results record.

    ``method``/``suite``: default the catalogues' (``tta-bench ls defaults``).
    ``model``: a registered model (default: the suite's). ``overrides``: Hydra overrides as
    on the command line (``method.lr=1e-3``, ``protocol.max_images=32``, ``model.arch=...``).
    ``seeds``: default the config's (``[0, 1, 2]``). ``output``: the results JSON to write (and
    resume from, as the CLI does); None runs into a temporary file that is removed after."""
    from tta_bench.run import runner
    from tta_bench.run.output import check_output
    from tta_bench.run.resolve import resolve_run

    _check_arguments(method, suite, model, overrides, seeds)
    _check_paths_and_flags(output=output, data_dir=data_dir, device=device, progress=progress)
    overrides = [str(o) for o in overrides]
    for key in ("method", "model", "suite"):
        clash = [o for o in overrides if o.startswith(f"{key}=")]
        if clash:
            raise ValueError(f"pass {key} as the {key}= argument, not as the override {clash[0]!r}")
    extra = []
    if seeds is not None:
        seeds = [int(s) for s in seeds]  # integers already (checked): numpy ones too
        extra.append(f"seeds=[{','.join(map(str, seeds))}]")
    if device is not None:
        extra.append(f"device={device}")
    # the CLI's own resolution and checks: what `tta-bench run` refuses, this refuses
    _, spec = resolve_run(
        method,
        suite,
        model,
        [*overrides, *extra],
        output=None if output is None else str(output),
        data_dir=None if data_dir is None else str(data_dir),
    )
    if output is not None:
        check_output(output, spec)
    spec = dataclasses.replace(spec, progress=bool(progress))
    if output is not None:
        return _run(runner, spec, Path(output))
    with tempfile.TemporaryDirectory(prefix="tta-bench-evaluate-") as tmp:
        return _run(runner, spec, Path(tmp) / "results.json")


def _check_arguments(method: Any, suite: Any, model: Any, overrides: Any, seeds: Any) -> None:
    """Types and values of ``evaluate``'s arguments, as ``ValueError`` naming the argument:
    nothing is converted silently (``seeds=[1.7]`` is not seed 1, ``"01"`` not seeds 0
    and 1, and a string of overrides is not a list of one-letter overrides)."""
    for name, value in (("method", method), ("suite", suite), ("model", model)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(
                f"{name} must be a registered {name}'s name (a non-empty string) or None for "
                f"the default, got {value!r}"
            )
    if isinstance(overrides, (str, bytes)) or not isinstance(overrides, (list, tuple)):
        raise ValueError(
            f"overrides must be a list of 'key=value' strings, got {overrides!r} "
            f"(e.g. overrides=['method.lr=1e-3'])"
        )
    bad = [o for o in overrides if not isinstance(o, str) or "=" not in o]
    if bad:
        raise ValueError(f"overrides must be 'key=value' strings; got {bad!r}")
    if seeds is None:
        return
    if isinstance(seeds, (str, bytes)) or not isinstance(seeds, (list, tuple, range)):
        raise ValueError(f"seeds must be a list of integers, e.g. [0, 1, 2]; got {seeds!r}")
    wrong = [
        s for s in seeds if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 0
    ]
    if wrong:  # an empty list: resolve_run's own message (seeds=[] names no seed)
        raise ValueError(f"seeds must be a list of non-negative integers; got {list(seeds)!r}")


def _check_paths_and_flags(**given: Any) -> None:
    """``output`` / ``data_dir``: a path (``str`` or ``os.PathLike``) or None; ``device``: a
    string or None; ``progress``: a bool. A ``ValueError`` naming the argument otherwise."""
    for name in ("output", "data_dir"):
        value = given[name]
        if value is not None and (not isinstance(value, (str, os.PathLike)) or value == ""):
            raise ValueError(f"{name} must be a path (str or os.PathLike) or None, got {value!r}")
    if given["device"] is not None and (
        not isinstance(given["device"], str) or not given["device"]
    ):
        raise ValueError(
            f"device must be a string such as 'cpu', 'cuda' or 'auto', or None; got "
            f"{given['device']!r}"
        )
    if not isinstance(given["progress"], bool):
        raise ValueError(f"progress must be True or False, got {given['progress']!r}")


def _run(runner: Any, spec: Any, output: Path) -> dict[str, Any]:
    """Run, then read the record back from the file: exactly what the CLI writes (strict
    JSON: lists, not tuples), plus the run's ``skipped_cells`` when it resumed."""
    record = runner.run(spec, output)
    written = json.loads(output.read_text(encoding="utf-8"))
    if "skipped_cells" in record:
        written.setdefault("skipped_cells", record["skipped_cells"])
    return written
