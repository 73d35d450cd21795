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
