"""The generic harness never imports the plugin (docs/design.md#layers)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import tta_bench

HARNESS = Path(tta_bench.__file__).parent


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_harness_source_never_imports_the_plugin():
    offenders = {
        str(p.relative_to(HARNESS)): sorted(n for n in _imports(p) if n.startswith("mura_plugin"))
        for p in HARNESS.rglob("*.py")
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"tta_bench imports mura_plugin: {offenders}"


def test_importing_the_harness_loads_neither_plugin_nor_torch():
    code = (
        "import sys, tta_bench, tta_bench.registry, tta_bench.catalog, tta_bench.cli\n"
        "bad = [m for m in sys.modules if m.startswith(('mura_plugin', 'torch'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


#: The harness modules a plugin may import: the contracts at the harness's top level
#: (docs/design.md#layers states the same list). The rooms (run/, report/, deploy/, cli/)
#: are the harness's own.
PLUGIN_API = {
    "tta_bench",
    "tta_bench.bounds",
    "tta_bench.buffers",
    "tta_bench.catalog",
    "tta_bench.config",
    "tta_bench.data",
    "tta_bench.method",
    "tta_bench.metrics",
    "tta_bench.model",
    "tta_bench.paths",
    "tta_bench.prompts",
    "tta_bench.registry",
    "tta_bench.rng",
    "tta_bench.text_head",
}


def _imported_modules(path: Path) -> set[str]:
    """Every ``tta_bench`` module ``path`` imports (``from tta_bench import x`` counts as
    ``tta_bench.x`` when x is a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("tta_bench"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tta_bench"):
            out.add(node.module)
            if node.module == "tta_bench":
                out.update(
                    f"tta_bench.{a.name}" for a in node.names if (HARNESS / f"{a.name}.py").exists()
                )
    return out


def test_the_plugin_imports_only_the_harness_contracts():
    plugin = Path(__file__).resolve().parents[1] / "mura_plugin"
    offenders = {
        str(p.relative_to(plugin)): sorted(_imported_modules(p) - PLUGIN_API)
        for p in plugin.rglob("*.py")
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"mura_plugin imports harness internals: {offenders}"


def test_the_plugin_api_list_is_the_one_the_design_doc_states():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    section = doc.split("## Layers", 1)[1].split("\n## ", 1)[0]
    stated = set(
        re.findall(
            r"`(tta_bench(?:\.[a-z_]+)?)`",
            section.split("A plugin imports", 1)[1].split("\n\n", 1)[0],
        )
    )
    assert stated == PLUGIN_API


def test_every_harness_module_is_a_contract_or_in_a_room():
    top = {p.stem for p in HARNESS.glob("*.py")}
    rooms = {p.name for p in HARNESS.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == {"run", "report", "deploy", "cli"}
    contracts = {m.split(".", 1)[1] for m in PLUGIN_API if "." in m}
    others = {"__init__", "__main__", "_version", "_moved", "api", "include", "log"}
    assert top == contracts | others, sorted(top - contracts - others)


def test_the_old_import_paths_reach_the_moved_modules():
    import importlib

    from tta_bench._moved import MOVED

    for new in MOVED.values():  # a module, or a package (tta_bench.deploy.serve)
        where = HARNESS.parent / new.replace(".", "/")
        assert where.with_suffix(".py").exists() or (where / "__init__.py").exists(), new
    for old in ("tta_bench.adapter", "tta_bench.results", "tta_bench.templates"):
        assert importlib.import_module(old) is importlib.import_module(MOVED[old])
