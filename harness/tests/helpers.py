"""What the harness tests share: running the CLI and the runner on the test plugin, reading
results, and writing image folders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PLUGIN_DIR = HERE / "plugin"
#: Fixed results and the tables/leaderboard they render to (``test_tables``,
#: ``test_stats``, ``test_report_golden``); ``TTA_BENCH_UPDATE_GOLDEN=1`` rewrites the renders.
GOLDEN = HERE / "golden"
#: The distributions the harness tests load: the harness and its test plugin.
PLUGINS = "tta-bench,tta-bench-testplugin"
#: The fields of a cell that are numbers about the predictions (not timings).
SCORES = ("n", "accuracy", "error", "reference_accuracy", "ece", "nll")


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment of a ``tta-bench`` subprocess: this process's (``TTA_BENCH_PLUGINS``,
    ``TTA_BENCH_CACHE``) with the test plugin on ``PYTHONPATH``."""
    path = os.pathsep.join(p for p in (str(PLUGIN_DIR), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


def tta_bench_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "tta_bench.cli", *args]


def run_subprocess(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        tta_bench_cmd(*args),
        env=subprocess_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def cli(capsys: Any, *argv: str) -> tuple[int, str, str]:
    """``tta-bench *argv`` in this process: (exit status, stdout, stderr)."""
    from tta_bench.cli import main

    capsys.readouterr()
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def spec(
    method: str = "zeroshot",
    suite: str = "tiny-shifts",
    seeds: Sequence[int] = (0,),
    *,
    method_args: dict[str, Any] | None = None,
    model_args: dict[str, Any] | None = None,
    protocol: dict[str, Any] | None = None,
    dataset_args: dict[str, Any] | None = None,
    **fields: Any,
):
    """A ``RunSpec`` of the test plugin on the CPU, without progress bars; the model's
    arguments are complete (defaults filled in), as ``tta-bench run`` records them.
    ``protocol``: overrides of the suite; ``dataset_args``: replace the suite's."""
    import dataclasses
    import inspect

    from tta_bench.registry import registry
    from tta_bench.run.protocol import load_protocol
    from tta_bench.run.spec import RunSpec

    config = registry("methods").get(method).Config(**(method_args or {}))
    factory = registry("models").get("tiny-clip")
    defaults = {
        p.name: p.default
        for p in inspect.signature(factory).parameters.values()
        if p.default is not inspect.Parameter.empty
    }
    resolved = load_protocol(suite, **(protocol or {}))
    if dataset_args is not None:
        resolved = dataclasses.replace(resolved, dataset_args=dict(dataset_args))
    return RunSpec(
        method=method,
        method_config=config,
        model="tiny-clip",
        model_args={**defaults, **(model_args or {})},
        protocol=resolved,
        seeds=list(seeds),
        device="cpu",
        progress=False,
        **fields,
    )


def run(output: Path, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """``runner.run(spec(*args, **kwargs), output)``."""
    from tta_bench.run import runner

    return runner.run(spec(*args, **kwargs), Path(output))


def _no_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def strict_json(path: Path) -> Any:
    """The file parsed as strict JSON: NaN/Infinity literals raise."""
    return json.loads(Path(path).read_text(encoding="utf-8"), parse_constant=_no_constant)


def scores(record: dict[str, Any]) -> dict[tuple[str, int, int], tuple[Any, ...]]:
    """``{(shift, severity, seed): (n, accuracy, ...)}`` of a record's cells."""
    return {
        (c["shift"], c["severity"], c["seed"]): tuple(c.get(k) for k in SCORES)
        for c in record["cells"]
    }


def write_folder(
    root: Path, per_class: int = 2, size: tuple[int, int] = (24, 20)
) -> dict[str, list[Path]]:
    """``root/<class>/img<i>.png``: uncompressed PNGs (``compress_level=0``: the byte size
    depends on the pixel count only) of the test plugin's class colours at ``size`` (width,
    height), not the model's 16 px, so decoding resizes and crops."""
    from PIL import Image
    from tta_bench_testplugin.data import CLASSNAMES, colour_image

    out: dict[str, list[Path]] = {}
    for k, name in enumerate(CLASSNAMES):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            path = root / name / f"img{i}.png"
            Image.fromarray(colour_image(k, ("folder", i), size)).save(path, compress_level=0)
            out.setdefault(name, []).append(path)
    return out


def write_distribution(
    root: Path,
    name: str,
    entry_points: dict[str, dict[str, str]],
    modules: dict[str, str] | None = None,
    version: str = "1.0",
) -> Path:
    """An installed-looking distribution under ``root`` (put ``root`` on ``sys.path``):
    ``<name>-<version>.dist-info/{METADATA, entry_points.txt}`` and ``modules``
    (``{"pkg/__init__.py": source}``)."""
    for rel, source in (modules or {}).items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source, encoding="utf-8")
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    text = "".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in items.items()) + "\n"
        for group, items in entry_points.items()
    )
    (info / "entry_points.txt").write_text(text)
    return root
