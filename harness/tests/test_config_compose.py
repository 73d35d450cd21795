"""``tta_bench.config.compose``: the run config Hydra composes, set up without
``hydra.initialize``'s read of the call stack, and Hydra's config store written only when
what a run needs changed."""

from __future__ import annotations

import inspect

import pytest
from hydra import compose as hydra_compose
from hydra import initialize
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from tta_bench import config

CASES = [
    ([], "zeroshot", "tiny-clip"),
    (["seeds=[0,1]", "protocol.batch_size=3", "method.lr=0.5"], "norm_tent", "tiny-clip"),
    (["protocol.shifts=[noise]", "protocol.max_images=4"], "spy", "tiny-clip"),
]


def _with_initialize(overrides: list[str], method: str, model: str):
    """The config as ``hydra.initialize(config_path=None)`` composes it (the code before)."""
    config._register([method], [model])
    with initialize(config_path=None, version_base="1.3"):
        return hydra_compose(
            config_name="tta_bench_run", overrides=config.hydra_overrides(overrides, method, model)
        )


@pytest.mark.parametrize(("overrides", "method", "model"), CASES)
def test_compose_equals_hydras_initialize(overrides, method, model):
    got = config.compose(list(overrides), method, model)
    want = _with_initialize(list(overrides), method, model)
    assert OmegaConf.to_container(got) == OmegaConf.to_container(want)
    assert OmegaConf.get_type(got.method) is OmegaConf.get_type(want.method)


def test_an_unknown_key_is_refused_as_before():
    for compose in (config.compose, _with_initialize):
        with pytest.raises(ConfigCompositionException, match="no_such_key"):
            compose(["method.no_such_key=1"], "norm_tent", "tiny-clip")


def test_compose_reads_no_call_stack(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("compose read the call stack")

    monkeypatch.setattr(inspect, "stack", refuse)
    cfg = config.compose(["seeds=[3]"], "norm_tent", "tiny-clip")
    assert list(cfg.seeds) == [3]


def test_the_store_is_written_only_when_a_node_changed(monkeypatch):
    config.compose([], "norm_tent", "tiny-clip")
    cs = ConfigStore.instance()
    stored: list[tuple[str | None, str]] = []
    real_store = cs.store

    def spy(*args, **kwargs):
        stored.append((kwargs.get("group"), kwargs["name"]))
        return real_store(*args, **kwargs)

    monkeypatch.setattr(cs, "store", spy)
    config.compose(["seeds=[1]"], "norm_tent", "tiny-clip")
    assert stored == []
    # a node written over by someone else is stored again
    real_store(group="method", name="norm_tent", node={"lr": 7.0})
    cfg = config.compose([], "norm_tent", "tiny-clip")
    assert stored == [("method", "norm_tent")]
    assert cfg.method.lr != 7.0
    # a changed default run config (another catalogue's defaults) is stored again
    monkeypatch.setattr(config, "run_config", lambda: config.RunConfig(suite="other"))
    config._register([], [])
    assert stored[-1] == (None, "tta_bench_run")


def test_a_run_naming_one_of_hydras_unread_groups_keeps_it(monkeypatch):
    """compose leaves Hydra's logging, help, output and env groups out of its defaults
    list (the run config never reads them), except a group the run's overrides choose."""
    import hydra

    seen: list[list[str]] = []
    real = hydra.compose

    def spy(*args, **kwargs):
        seen.append(list(kwargs["overrides"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(hydra, "compose", spy)
    plain = config.compose([], "norm_tent", "tiny-clip")
    assert {f"~{g}" for g in config.UNREAD_HYDRA_GROUPS} <= set(seen[-1])
    chosen = config.compose(["hydra/job_logging=disabled"], "norm_tent", "tiny-clip")
    assert "~hydra/job_logging" not in seen[-1] and "~hydra/help" in seen[-1]
    assert OmegaConf.to_container(chosen) == OmegaConf.to_container(plain)


def test_the_store_holds_only_the_runs_nodes_while_composing_and_all_after(monkeypatch, request):
    """Hydra copies its whole config store at each composition: while composing, the store's
    method and model groups hold the run's own nodes and the nodes others stored, not the
    other methods' and models' this module stored; everything is back afterwards, and the
    config is the one composed with them all in the store."""
    import hydra

    from tta_bench.registry import registry

    methods = registry("methods").names()
    assert len(methods) > 2
    want = _with_initialize(["seeds=[2]"], "norm_tent", "tiny-clip")
    config._register(methods, registry("models").names())
    cs = ConfigStore.instance()
    # a second model node of this module's (this plugin registers one model)
    config._store(cs, "model", "another", {"size": 1})
    request.addfinalizer(lambda: cs.repo["model"].pop("another.yaml"))
    request.addfinalizer(lambda: config._STORED.pop(("model", "another")))
    cs.store(group="method", name="someone_elses", node={"lr": 1.0})
    before = {g: dict(cs.repo[g]) for g in ("method", "model")}
    during: dict[str, set[str]] = {}
    real = hydra.compose

    def spy(*args, **kwargs):
        during.update({g: set(cs.repo[g]) for g in ("method", "model")})
        return real(*args, **kwargs)

    monkeypatch.setattr(hydra, "compose", spy)
    got = config.compose(["seeds=[2]"], "norm_tent", "tiny-clip")
    assert during == {
        "method": {"norm_tent.yaml", "someone_elses.yaml"},
        "model": {"tiny-clip.yaml"},
    }
    assert "another.yaml" in before["model"]
    assert {g: dict(cs.repo[g]) for g in ("method", "model")} == before
    assert OmegaConf.to_container(got) == OmegaConf.to_container(want)


def test_threads_composing_at_once_each_get_their_own_config():
    """compose sets Hydra's global state and narrows the store: one thread at a time."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [("norm_tent", f"seeds=[{i}]") if i % 2 else ("zeroshot", f"seeds=[{i}]")
            for i in range(12)]  # fmt: skip
    with ThreadPoolExecutor(4) as pool:
        cfgs = list(pool.map(lambda job: config.compose([job[1]], job[0], "tiny-clip"), jobs))
    for (method, seeds), cfg in zip(jobs, cfgs):
        assert list(cfg.seeds) == [int(seeds[7:-1])]
        assert OmegaConf.get_type(cfg.method) is OmegaConf.get_type(
            config.compose([], method, "tiny-clip").method
        )
