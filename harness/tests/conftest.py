"""The harness's suite runs against its own tiny test plugin (``plugin/``), never the real
one: the plugin folder is put on ``sys.path`` (a ``*.dist-info`` makes its entry points
real), ``TTA_BENCH_PLUGINS`` admits only the harness and the test plugin (so an installed
mura-plugin is ignored), the registries are rescanned, and the cache is private.

The settings hold for this package's tests only and are undone after them, so the plugin's
own suite can run in the same pytest session.
"""

from __future__ import annotations

import pytest

from .helpers import PLUGIN_DIR, PLUGINS


@pytest.fixture(scope="package", autouse=True)
def _test_plugin(tmp_path_factory):
    from tta_bench.registry import reset_registries

    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(PLUGIN_DIR))
    mp.setenv("TTA_BENCH_PLUGINS", PLUGINS)
    mp.setenv("TTA_BENCH_CACHE", str(tmp_path_factory.mktemp("tta-bench-cache")))
    mp.setenv("TQDM_DISABLE", "1")
    for name in ("TTA_BENCH_DISABLE_PLUGIN_AUTOLOAD", "TTA_BENCH_CACHE_BUDGET_GB"):
        mp.delenv(name, raising=False)
    reset_registries()
    yield
    mp.undo()
    reset_registries()


@pytest.fixture()
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache directory of this test's own (tests of caching itself)."""
    path = tmp_path / "cache"
    monkeypatch.setenv("TTA_BENCH_CACHE", str(path))
    return path


@pytest.fixture()
def plugins_env(monkeypatch):
    """Set ``TTA_BENCH_PLUGINS`` for one test: ``plugins_env("tta-bench")``; the registries
    are rescanned now and after the test."""
    from tta_bench.registry import reset_registries

    def use(value: str) -> None:
        monkeypatch.setenv("TTA_BENCH_PLUGINS", value)
        reset_registries()

    yield use
    reset_registries()
