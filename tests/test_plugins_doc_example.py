"""docs/plugins.md is enough to add components: its worked example (a method, a dataset, a
shift, a loss and a metric in one package ``my_tta``) is built here from the doc's own code
blocks, exactly as written, made visible to the registries as pip would install it (a
``*.dist-info`` with the doc's entry points), and run end to end through the CLI."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml
from processes import on_sys_path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "plugins.md"
BLOCK = re.compile(r"```(python|toml|yaml)\n# file: (\S+)\n(.*?)```", re.S)


def example_files(text: str) -> dict[str, str]:
    """``{relative path: content}`` of the doc's ``# file: PATH`` code blocks."""
    files: dict[str, str] = {}
    for _, path, body in BLOCK.findall(text):
        assert path not in files, f"docs/plugins.md gives {path} twice"
        files[path] = body
    return files


def install(files: dict[str, str], root: Path) -> dict[str, dict[str, str]]:
    """Write the files under ``root`` and a ``*.dist-info`` from the doc's pyproject.toml
    (what ``pip install`` would record); return its entry points by group."""
    for path, body in files.items():
        dest = root / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(body, encoding="utf-8")
    project = tomllib.loads(files["pyproject.toml"])["project"]
    name, version = project["name"], project.get("version", "0.1")
    groups = project["entry-points"]
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", encoding="utf-8"
    )
    lines = []
    for group, eps in groups.items():
        lines.append(f"[{group}]")
        lines += [f"{k} = {v}" for k, v in eps.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return groups


def _cli(root: Path, *args: str, cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root), TTA_BENCH_CACHE=str(cache), TQDM_DISABLE="1")
    env.pop("TTA_BENCH_PLUGINS", None)
    return subprocess.run(
        [sys.executable, "-m", "tta_bench.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _here(root: Path, capsys, *args: str, cache: Path) -> tuple[int, str, str]:
    """``tta-bench ARGS`` in this process as ``_cli`` runs it in a new one: ``root`` on
    ``sys.path``, the registries scanned again (and again after), the cache under
    ``cache``; the exit code, stdout and stderr."""
    from tta_bench.cli import main

    capsys.readouterr()
    env = {"TTA_BENCH_CACHE": str(cache), "TQDM_DISABLE": "1", "TTA_BENCH_PLUGINS": None}
    with on_sys_path(root, env):
        code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    files = example_files(DOC.read_text(encoding="utf-8"))
    root = tmp_path_factory.mktemp("my_tta_site")
    groups = install(files, root)
    return root, groups, tmp_path_factory.mktemp("cache")


def test_the_doc_gives_one_of_each_kind():
    files = example_files(DOC.read_text(encoding="utf-8"))
    groups = tomllib.loads(files["pyproject.toml"])["project"]["entry-points"]
    for kind in ("methods", "datasets", "shifts", "losses", "metrics", "catalogs"):
        assert groups.get(f"tta_bench.{kind}"), f"the example registers no {kind}"


def test_the_example_runs_end_to_end(example, tmp_path, capsys):
    """Listed by ``tta-bench ls`` in a new interpreter (the package on ``PYTHONPATH``), then
    run and tabulated in this process."""
    root, groups, cache = example
    method = next(iter(groups["tta_bench.methods"]))
    metric = next(iter(groups["tta_bench.metrics"]))
    listed = _cli(root, "ls", "methods", cache=cache)
    assert listed.returncode == 0, listed.stderr
    assert method in listed.stdout
    catalogue = yaml.safe_load(next(root.rglob("registry.yaml")).read_text(encoding="utf-8"))
    suite = next(iter(catalogue["suites"]))
    out = tmp_path / "run.json"
    code, stdout, stderr = _here(
        root, capsys, "run", "--suite", suite, "--method", method, "--output", str(out),
        "seeds=[0]", cache=cache,
    )  # fmt: skip
    assert code == 0, stdout + stderr
    record = json.loads(out.read_text(encoding="utf-8"))
    assert record["method"] == method and record["cells"]
    shifts = set(groups["tta_bench.shifts"])
    assert {c["shift"] for c in record["cells"]} <= shifts | {"none"}
    for cell in record["cells"]:
        assert cell["accuracy"] is not None and metric in cell
    # the new metric reaches the tables without touching them, shown as its entry says
    shown = catalogue["metrics"][metric].get("table") or {}
    label = shown.get("label", metric)
    mean = sum(c[metric] for c in record["cells"]) / len(record["cells"])
    value = f"{shown.get('scale', 1) * mean:.{shown.get('decimals', 3)}f}"
    code, stdout, stderr = _here(
        root, capsys, "table", "--format", "csv-formatted", str(out), cache=cache
    )
    assert code == 0, stderr
    summary = stdout.split("# Suite summary")[1].strip().splitlines()
    headers, row = list(csv.reader(summary[1:3]))
    assert row[headers.index(label)] == value
    assert f"mean_{metric}" in record["summary"]
