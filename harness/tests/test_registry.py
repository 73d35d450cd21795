"""Registries: entry points are the only discovery; names are checked ("did you mean"),
duplicates name both origins, components are validated when they load, the allowlist
selects distributions, and every result records who supplied each component."""

from __future__ import annotations

import json
import textwrap

import pytest

from tta_bench import catalog
from tta_bench.registry import (
    RegistryError,
    UnknownNameError,
    provenance,
    registry,
    reset_registries,
)

from .helpers import PLUGINS, cli, run, write_distribution

TEST_DIST = "tta-bench-testplugin"


def test_components_are_discovered_through_entry_points_with_their_origin():
    assert {"zeroshot", "norm_tent", "spy", "diverge"} <= set(registry("methods").names())
    assert registry("models").names() == ["tiny-clip"]
    assert registry("shifts").names() == ["dim", "noise"]
    assert registry("datasets").names() == ["folder", "synthetic"]
    origin = registry("methods").origin("norm_tent")
    assert (origin.distribution, origin.version) == (TEST_DIST, "0.1")
    assert origin.value == "tta_bench_testplugin.methods:NormTent"
    assert origin.group == "tta_bench.methods"
    # the harness's own metrics come through the same path as any plugin's
    assert registry("metrics").origin("accuracy").distribution == "tta-bench"


def test_a_scan_reads_each_distributions_name_and_version_once(monkeypatch):
    """Reading a distribution's name or version parses its metadata file again; one
    distribution declares many entry points, and a scan reads each once."""
    import importlib.metadata as md

    from tta_bench import registry as registry_module

    reads: list[str] = []

    class Dist:
        def __init__(self, name: str, version: str):
            self._name, self._version = name, version

        @property
        def metadata(self):
            reads.append(self._name)
            return {"Name": self._name}

        @property
        def version(self):
            reads.append(self._name)
            return self._version

    one, other = Dist("dist-one", "1.0"), Dist("dist-two", "2.0")
    eps = []
    for name, dist in [("a", one), ("b", one), ("c", one), ("d", other), ("e", other)]:
        ep = md.EntryPoint(name, f"pkg:{name}", "tta_bench.methods")
        eps.append(ep._for(dist))  # as importlib.metadata binds an entry point to its dist
    monkeypatch.setattr(registry_module, "_entry_points", lambda group: eps)
    monkeypatch.delenv("TTA_BENCH_INCLUDE", raising=False)
    monkeypatch.delenv("TTA_BENCH_PLUGINS", raising=False)
    reset_registries()
    try:
        found = registry("methods")
        origins = {n: (found.origin(n).distribution, found.origin(n).version) for n in "abcde"}
    finally:
        monkeypatch.undo()
        reset_registries()
    assert origins == {
        "a": ("dist-one", "1.0"), "b": ("dist-one", "1.0"), "c": ("dist-one", "1.0"),
        "d": ("dist-two", "2.0"), "e": ("dist-two", "2.0"),
    }  # fmt: skip
    assert sorted(reads) == ["dist-one", "dist-one", "dist-two", "dist-two"]


def test_listing_imports_nothing_loading_imports_the_component():
    import sys

    for name in [m for m in sys.modules if m.startswith("tta_bench_testplugin.shifts")]:
        del sys.modules[name]
    reset_registries()
    assert "noise" in registry("shifts").names()
    assert "tta_bench_testplugin.shifts" not in sys.modules
    kernel = registry("shifts").get("noise")
    assert kernel.__module__ == "tta_bench_testplugin.shifts"


def test_an_unknown_name_answers_did_you_mean_and_lists_the_available():
    with pytest.raises(UnknownNameError) as info:
        registry("methods").get("norm_tnet")
    message = str(info.value)
    assert "unknown method 'norm_tnet'" in message
    assert "Did you mean 'norm_tent'?" in message
    assert "Available: colour_oracle, diverge" in message
    with pytest.raises(UnknownNameError, match="Did you mean 'noise'"):
        registry("shifts").origin("nosie")
    with pytest.raises(UnknownNameError, match="registry kinds"):
        registry("method")


def test_a_duplicate_name_from_another_distribution_names_both_origins(
    tmp_path, monkeypatch, plugins_env
):
    write_distribution(
        tmp_path,
        "other-plugin",
        {"tta_bench.methods": {"zeroshot": "other_plugin:ZeroShot"}},
        {"other_plugin/__init__.py": "ZeroShot = None\n"},
        version="2.5",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins_env(PLUGINS + ",other-plugin")
    with pytest.raises(RegistryError) as info:
        registry("methods").names()
    message = str(info.value)
    assert "duplicate method name 'zeroshot'" in message
    assert "tta_bench_testplugin.methods:ZeroShot (from tta-bench-testplugin 0.1)" in message
    assert "other_plugin:ZeroShot (from other-plugin 2.5)" in message
    # Left out by the allowlist, the other distribution clashes with nothing.
    plugins_env(PLUGINS)
    assert registry("methods").origin("zeroshot").distribution == TEST_DIST


BROKEN = textwrap.dedent(
    '''
    """Components of the wrong shape."""


    class NotAMethod:
        pass


    def no_generator(images, severity):
        return images


    def positional_factory(split):
        return None
    '''
)


@pytest.mark.parametrize(
    ("kind", "name", "expected"),
    [
        ("methods", "not_a_method", "expected a subclass of tta_bench.method.Method"),
        ("shifts", "no_generator", "keyword-only parameter 'generator'"),
        ("datasets", "positional_factory", "keyword-only arguments; positional parameters"),
        ("methods", "missing", "failed to import: AttributeError"),
    ],
)
def test_components_are_validated_when_they_load(
    tmp_path, monkeypatch, plugins_env, kind, name, expected
):
    write_distribution(
        tmp_path,
        "broken-plugin",
        {
            "tta_bench.methods": {
                "not_a_method": "broken_plugin:NotAMethod",
                "missing": "broken_plugin:DoesNotExist",
            },
            "tta_bench.shifts": {"no_generator": "broken_plugin:no_generator"},
            "tta_bench.datasets": {"positional_factory": "broken_plugin:positional_factory"},
        },
        {"broken_plugin/__init__.py": BROKEN},
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins_env(PLUGINS + ",broken-plugin")
    reg = registry(kind)
    assert name in reg.names()  # listed from metadata: nothing is loaded yet
    with pytest.raises(RegistryError) as info:
        reg.get(name)
    message = str(info.value)
    assert expected in message
    assert f"{name!r}" in message and "broken-plugin" in message


def test_the_allowlist_loads_only_the_named_distributions(plugins_env):
    plugins_env("tta-bench")
    for kind in ("methods", "models", "shifts", "datasets", "losses", "metrics"):
        for name in registry(kind).names():
            assert registry(kind).origin(name).distribution == "tta-bench", (kind, name)
    assert registry("methods").names() == []
    assert "accuracy" in registry("metrics").names()
    assert catalog.catalog()["suites"] == {}  # the test plugin's catalogue is left out too
    plugins_env(PLUGINS)
    assert "tiny-shifts" in catalog.catalog()["suites"]
    for name in registry("methods").names():  # an installed mura-plugin stays out
        assert registry("methods").origin(name).distribution == TEST_DIST


def test_disabling_autoload_ignores_every_installed_plugin(monkeypatch, plugins_env):
    monkeypatch.setenv("TTA_BENCH_DISABLE_PLUGIN_AUTOLOAD", "1")
    plugins_env(PLUGINS)
    assert registry("methods").names() == [] and registry("metrics").names() == []


def test_results_record_the_distribution_and_version_of_every_component(tmp_path):
    record = run(tmp_path / "r.json", "norm_tent")
    plugins = {(p["group"], p["name"]): p for p in record["provenance"]["plugins"]}
    expected = {
        ("tta_bench.methods", "norm_tent"),
        ("tta_bench.models", "tiny-clip"),
        ("tta_bench.datasets", "synthetic"),
        ("tta_bench.shifts", "noise"),
        ("tta_bench.shifts", "dim"),
        ("tta_bench.losses", "entropy"),
    }
    assert set(plugins) == expected
    for key in expected:
        assert plugins[key]["distribution"] == TEST_DIST
        assert plugins[key]["version"] == "0.1"
    assert plugins[("tta_bench.methods", "norm_tent")] == provenance("methods", "norm_tent")


def test_ls_lists_each_component_with_its_distribution_and_catalogue_description(capsys):
    rc, out, _ = cli(capsys, "ls", "methods")
    assert rc == 0
    for name in registry("methods").names():
        line = next(x for x in out.splitlines() if x.split()[:1] == [name])
        assert TEST_DIST in line and catalog.description("methods", name) in line
    # the catalogue's family beside each method
    line = next(x for x in out.splitlines() if x.split()[:1] == ["own_score_oracle"])
    assert line.split()[2] == "open-set"
    rc, out, _ = cli(capsys, "ls", "methods", "--json")
    listed = {m["name"]: m for m in json.loads(out)}
    assert listed["own_score_oracle"]["family"] == "open-set"
    rc, out, _ = cli(capsys, "ls", "suites")
    assert rc == 0
    for suite in ("tiny-shifts", "tiny-continual", "tiny-folder", "tiny-domains"):
        assert suite in out
    assert "2 shifts x sev [1, 3]" in out
