"""The TTA-VLM profile (profile=tta_vlm, or its switch tta_vlm=true; tta_bench.run.profiles,
data in the plugin's catalogue): TTA-VLM's single prompt, episodic methods per image, online
methods on a stream of batch size 1, and each method's own TTA-VLM settings, each only where
the run does not set it."""

from __future__ import annotations

import pytest

from tta_bench.run import runner
from tta_bench.run.resolve import resolve_run

PROMPT = "a photo of a {}."  # TTA-VLM's one prompt (the profile's protocol.templates)

SMALL = ["protocol.shifts=[contrast]", "protocol.max_images=12", "seeds=[0]", "progress=false"]


def test_episodic_methods_run_per_image_with_the_single_prompt():
    _, plain = resolve_run(method="tpt")
    _, spec = resolve_run(method="tpt", overrides=["tta_vlm=true"])
    p = spec.protocol
    assert (p.reset, p.batch_size, p.templates) == ("episodic_sample", 1, (PROMPT,))
    assert p.id != plain.protocol.id  # rows under the option never mix with the default's
    assert spec.config["profile_applied"] == {
        "protocol.templates": [PROMPT],
        "protocol.reset": "episodic_sample",
    }
    assert spec.method_config == plain.method_config  # TPT: TTA-VLM follows the official


def test_online_methods_get_a_batch_1_stream_and_their_tta_vlm_settings():
    _, plain = resolve_run(method="tda")
    _, spec = resolve_run(method="tda", overrides=["tta_vlm=true"])
    assert (spec.protocol.reset, spec.protocol.batch_size) == ("reset_each_shift", 1)
    assert plain.method_config.views == "official" and spec.method_config.views == "single"
    assert spec.config["method"]["views"] == "single"  # the record says what ran
    # what the run sets itself wins over the option
    _, own = resolve_run(
        method="tda", overrides=["tta_vlm=true", "method.views=multi", "protocol.batch_size=4"]
    )
    assert own.method_config.views == "multi" and own.protocol.batch_size == 4


def test_methods_tta_vlm_does_not_run_keep_the_suite_stream():
    _, plain = resolve_run(method="tent")
    _, spec = resolve_run(method="tent", overrides=["tta_vlm=true"])
    assert spec.protocol.templates == (PROMPT,)
    assert (spec.protocol.reset, spec.protocol.batch_size) == (
        plain.protocol.reset,
        plain.protocol.batch_size,
    )


def test_a_run_under_the_option_is_scored(tmp_path):
    _, spec = resolve_run(method="tda", overrides=["tta_vlm=true", *SMALL])
    record = runner.run(spec, tmp_path / "r.json")
    cell = record["cells"][0]
    assert cell["n"] == 12 and cell["batches"] == 12 and 0.0 <= cell["accuracy"] <= 1.0
    assert record["config"]["profile"] == "tta_vlm"


def test_the_profile_and_its_switch_are_the_same_run():
    """``profile=tta_vlm`` (the catalogue's profile) and ``tta_vlm=true`` (its switch, the
    option's first spelling) resolve to the same spec; ``tta_vlm=false`` is no profile."""
    _, named = resolve_run(method="dmn", overrides=["profile=tta_vlm"])
    _, switched = resolve_run(method="dmn", overrides=["tta_vlm=true"])
    _, off = resolve_run(method="dmn", overrides=["tta_vlm=false"])
    _, plain = resolve_run(method="dmn")
    assert named.config == switched.config and named.protocol.id == switched.protocol.id
    assert named.method_config == switched.method_config != plain.method_config
    assert off.config == plain.config


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("profile=tta_vml", "unknown profile='tta_vml'; available: tta_vlm"),
        ("tta_vlm=maybe", "tta_vlm='maybe': expected true or false"),
    ],
)
def test_a_bad_profile_exits_2_naming_it(capsys, override, message):
    from tta_bench.cli import main

    assert main(["run", "--method", "tpt", override]) == 2
    assert message in capsys.readouterr().err


TTA_VLM_METHODS = ("ctpt", "mta", "tps", "rtpt", "rlcf", "dmn", "boostadapter", "dpe",
                   "onzeta", "ecalp", "dynaprompt", "tpt", "zero", "lora", "tda")  # fmt: skip


@pytest.mark.parametrize("name", TTA_VLM_METHODS)
def test_each_tta_vlm_method_runs_under_the_option(name, tmp_path):
    """Every method of TTA-VLM's benchmark declares its kind and runs on digits-c under the
    option with its defaults (4 images: batch size 1, reset as its kind says)."""
    from tta_bench.registry import registry

    cls = registry("methods").get(name)
    assert cls.stream_kind in ("episodic", "online"), name
    overrides = ["tta_vlm=true", "protocol.shifts=[contrast]", "protocol.max_images=4",
                 "seeds=[0]", "progress=false", "reference=false"]  # fmt: skip
    _, spec = resolve_run(method=name, overrides=overrides)
    assert spec.protocol.batch_size == 1 and spec.protocol.templates == (PROMPT,)
    cell = runner.run(spec, tmp_path / "r.json")["cells"][0]
    assert cell["n"] == 4 and cell["accuracy"] is not None


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:tiny-clip-digits was pretrained on the digits prompts")
def test_multi_dataset_suite_sets_augmix_per_dataset(tmp_path, tmp_cache, monkeypatch):
    """vlm-15 mixes ImageNet sets and fine-grained ones: under the option each domain's
    method gets its own dataset's AugMix rule (on for DTD, off for ImageNet-R), the record
    says so, and the run key differs from a run without the option. On the shipped tiny
    model: TPT re-encodes ImageNet-R's 200 class prompts at every step, which a random
    ViT-S-32 text tower took most of the test's time for."""
    import fixtures_data as fx

    from tta_bench.catalog import entry

    data = tmp_path / "data"
    fx.coop_layout(data, "dtd", (0, 1))
    fx.tree(data / "imagenet-r", entry("datasets", "imagenet_r")["wnids"][:2], per_folder=1)
    args = ["protocol.shifts=[imagenet_r,dtd]", "method.views=3", "seeds=[0]",
            "progress=false", "protocol.max_images=1", "device=cpu"]  # fmt: skip
    model = "tiny-clip-digits"
    _, spec = resolve_run("tpt", "vlm-15", model, ["tta_vlm=true", *args], data_dir=str(data))
    assert spec.method_config.augmix is False
    assert {d: c.augmix for d, c in spec.method_configs.items()} == {"dtd": True}
    assert spec.config["profile_applied"]["method.augmix@dtd"] is True
    seen = {}
    fresh = runner.Evaluation._fresh_method

    def spy(self, base, seed, stream_length=None):
        method = fresh(self, base, seed, stream_length)
        seen[base.dataset] = method.config.augmix
        return method

    monkeypatch.setattr(runner.Evaluation, "_fresh_method", spy)
    record = runner.run(spec, tmp_path / "r.json")
    assert seen == {"imagenet_r": False, "dtd": True}
    assert record["method_config_by_dataset"]["dtd"]["augmix"] is True
    _, plain = resolve_run("tpt", "vlm-15", model, args, data_dir=str(data))
    # without the option TPT's own official rule gives the same per-dataset AugMix ...
    assert {d: c.augmix for d, c in plain.method_configs.items()} == {"dtd": True}
    from tta_bench.run.resume import spec_key

    # ... but the option's stream (per image, its prompt) is another protocol: another run
    assert spec_key(spec)["protocol_id"] != spec_key(plain)["protocol_id"]
