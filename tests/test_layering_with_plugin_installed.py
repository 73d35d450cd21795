"""The generic harness never imports the plugin (docs/design.md#layers)."""

from __future__ import annotations

import ast
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
