"""``tta_bench.config.compose`` reusing compositions: a run config made from Hydra's
composition of its group choices, kept per process, with the run's other overrides applied
by Hydra's own function, equals Hydra's composition of the whole list, and a bad override
fails alike; a node stored since, or an edited config file, composes afresh."""

from __future__ import annotations

import os
import sys

import pytest
from hydra import compose as hydra_compose
from omegaconf import OmegaConf

from tta_bench import config

METHOD, MODEL = "norm_tent", "tiny-clip"

GOOD = [
    [],
    ["seeds=[0,1]", "protocol.batch_size=3", "method.lr=0.5"],
    ["suite=tiny-shifts", "output=/tmp/x y/r.json", "progress=false", "device=cpu"],
    ["protocol.shifts=[noise,fog]", "protocol.severities=[1,5]", "seeds=[]"],
    ["+extra=1", "++seeds=[4]", "~protocol.shifts", "protocol.batch_size=null"],
    ["protocol.batch_size=3", "protocol.batch_size=5", "logger=[wandb]"],
    ["data_dir='a,b'", "log_samples=logits", "protocol.ood_dataset_args={a: 1, b: [2]}"],
    ["hydra/job_logging=disabled", "seeds=[2]"],
    ["hydra.job.name=x", "seeds=[2]"],
]

BAD = [
    ["method.no_such_key=1"],
    ["protocol.batch_size=abc"],
    ["+seeds=[1]"],
    ["~protocol.no_such"],
    ["seeds=0,1"],  # a sweep: Hydra refuses it in a run
    ["seeds=["],  # does not parse
    ["method@x=norm_tent"],
    ["model=no_such_model"],
    ["seeds=[0]", "protocol.reset=1,2"],
]


def _hydra_whole(overrides: list[str], method: str = METHOD, model: str = MODEL):
    """Hydra's composition of the whole override list, as ``compose`` asked for it before."""
    names = [o.lstrip("~+").split("=", 1)[0] for o in overrides]
    unread = [f"~{g}" for g in config.UNREAD_HYDRA_GROUPS if g not in names]
    with config._COMPOSING:
        config._register([method], [model])
        with config._hydra_without_config_dir(), config._store_narrowed_to(method, model):
            return hydra_compose(
                config_name="tta_bench_run",
                overrides=[*config.hydra_overrides(overrides, method, model), *unread],
            )


def _outcome(compose, overrides):
    try:
        cfg = compose(list(overrides), METHOD, MODEL)
    except Exception as exc:  # noqa: BLE001 - compared below
        cause = exc.__cause__
        return ("raised", type(exc), str(exc), type(cause), str(cause))
    return (
        "config",
        OmegaConf.to_yaml(cfg),
        OmegaConf.is_struct(cfg),
        OmegaConf.get_type(cfg.method),
        OmegaConf.get_type(cfg.protocol),
    )


@pytest.fixture(autouse=True)
def _fresh_memo():
    config.clear_compose_memo()
    yield
    config.clear_compose_memo()


@pytest.mark.parametrize("overrides", GOOD + BAD)
def test_memo_equals_hydras_composition_of_the_whole_list(overrides):
    want = _outcome(_hydra_whole, overrides)
    for _ in range(2):  # the first composes its group choices, the second reuses them
        assert _outcome(config.compose, overrides) == want


def test_a_bad_override_fails_alike_after_a_good_run_of_the_same_choices():
    config.compose(["seeds=[1]"], METHOD, MODEL)
    for overrides in BAD:
        assert _outcome(config.compose, overrides) == _outcome(_hydra_whole, overrides)


@pytest.fixture()
def hydra_calls(monkeypatch):
    """The override lists Hydra composes (``hydra.compose`` as ``config.compose`` calls it)."""
    import hydra

    calls: list[list[str]] = []
    real = hydra.compose

    def spy(config_name=None, overrides=None, **kwargs):
        calls.append(list(overrides))
        return real(config_name=config_name, overrides=overrides, **kwargs)

    monkeypatch.setattr(hydra, "compose", spy)
    return calls


def test_hydra_composes_each_group_choice_once(hydra_calls):
    for seeds in ("[0]", "[1]", "[0,1]"):
        cfg = config.compose([f"seeds={seeds}", "protocol.batch_size=2"], METHOD, MODEL)
        assert OmegaConf.to_container(cfg.seeds) == [int(s) for s in seeds[1:-1].split(",")]
    assert len(hydra_calls) == 1
    assert not any("seeds" in line for line in hydra_calls[0])
    config.compose(["seeds=[0]"], "zeroshot", MODEL)  # another method: its own
    config.compose(["hydra/job_logging=disabled"], METHOD, MODEL)  # another group choice
    assert len(hydra_calls) == 3


def test_a_returned_config_is_the_callers_own(hydra_calls):
    first = config.compose(["seeds=[0]"], METHOD, MODEL)
    first.seeds.append(9)
    first.method.lr = 123.0
    again = config.compose([], METHOD, MODEL)
    assert again.seeds is None and again.method.lr != 123.0
    assert len(hydra_calls) == 1


def test_a_node_stored_since_composes_afresh(hydra_calls):
    """Anyone's node in Hydra's config store (here a new one, then one stored again under
    the same name) is part of what a composition came from."""
    from hydra.core.config_store import ConfigStore

    repo = ConfigStore.instance().repo
    config.compose([], METHOD, MODEL)
    try:
        ConfigStore.instance().store(name="memo_user_node", node={"a": 1})
        config.compose([], METHOD, MODEL)
        config.compose([], METHOD, MODEL)
        ConfigStore.instance().store(name="memo_user_node", node={"a": 1})
        config.compose([], METHOD, MODEL)
    finally:
        repo.pop("memo_user_node.yaml", None)
    assert len(hydra_calls) == 3


def test_an_edited_config_file_composes_afresh(hydra_calls, monkeypatch):
    files = [("pkg", "a.yaml", 1, 1)]
    monkeypatch.setattr(config, "_config_files", lambda folders: tuple(files))
    config.compose([], METHOD, MODEL)
    config.compose([], METHOD, MODEL)
    files[0] = ("pkg", "a.yaml", 1, 2)
    config.compose([], METHOD, MODEL)
    assert len(hydra_calls) == 2


def test_config_files_see_a_touched_file(tmp_path, monkeypatch):
    package = tmp_path / "memo_conf_pkg"
    (package / "method").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    preset = package / "method" / "p.yaml"
    preset.write_text("defaults: [norm_tent, _self_]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    folders = config._folders("memo_conf_pkg")
    before = config._config_files(folders)
    assert [name for _, name, _, _ in before] == ["__init__.py", "p.yaml"]
    os.utime(preset, ns=(1, 1))
    assert config._config_files(folders) != before
    sys.modules.pop("memo_conf_pkg", None)
