"""The harness stands alone (docs/design.md#layers): it never imports the plugin, its
listing commands import no torch, its modules import each other without cycles, and with no
plugin installed it says so and how to add one."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import tta_bench

from .helpers import cli, subprocess_env

HARNESS = Path(tta_bench.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(HARNESS.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(HARNESS.rglob("*.py"))}


def _imported(module: str, path: Path) -> set[str]:
    """Every module ``module`` imports, at any depth of its code (function bodies too):
    ``from a import b`` counts as ``a.b`` when that is a module, else as ``a``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                full = f"{source}.{alias.name}"
                out.add(full if full in MODULES else source)
    return out


def test_the_harness_never_imports_the_plugin():
    offenders = {
        m: sorted(n for n in _imported(m, p) if n.split(".")[0] == "mura_plugin")
        for m, p in MODULES.items()
    }
    assert not {m: v for m, v in offenders.items() if v}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, ..., a]``, or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_import_graph_of_the_harness_has_no_cycle():
    graph = {m: {n for n in _imported(m, p) if n in MODULES and n != m} for m, p in MODULES.items()}
    assert len(graph) > 20 and graph["tta_bench.run.runner"], "the graph was not read"
    cycle = _cycle(graph)
    assert cycle is None, f"import cycle (function-level imports count): {' -> '.join(cycle)}"


def test_importing_the_harness_and_its_cli_loads_no_torch_and_no_plugin():
    code = (
        "import sys, tta_bench, tta_bench.cli, tta_bench.registry, tta_bench.catalog\n"
        "from tta_bench.registry import registry\n"
        "names = registry('methods').names()\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'mura_plugin', 'tta_bench_testplugin'))\n"
        "print(names, bad)\n"
        "assert 'zeroshot' in names and not bad, bad\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_with_the_harness_alone_ls_says_no_methods_and_how_to_add_some(plugins_env, capsys):
    plugins_env("tta-bench")
    rc, out, _ = cli(capsys, "ls", "methods")
    assert rc == 0
    assert "no methods are installed" in out
    assert "pip install" in out and "tta_bench.*" in out
    rc, out, _ = cli(capsys, "ls", "metrics")  # the harness's own components still list
    assert rc == 0 and "accuracy" in out and "tta-bench" in out


def test_with_the_harness_alone_run_exits_2_saying_no_methods(plugins_env, capsys, tmp_path):
    plugins_env("tta-bench")
    rc, out, err = cli(capsys, "run", "--output", str(tmp_path / "r.json"), "--quiet")
    assert rc == 2
    assert "no methods are installed" in err and "pip install" in err
    assert not (tmp_path / "r.json").exists()
