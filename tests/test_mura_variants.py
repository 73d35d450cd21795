"""MuRA's variants as options of the one method: which towers carry the components
(``towers``), and the rank sets, persistence, update period and signals the study compares.
Each option leaves the default run key alone and computes what it says."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import yaml
from method_runs import (
    assert_batched_episodes_equal_sequential,
    assert_params_at_snapshot,
    assert_reset_then_reseed_reproduces,
    build_method,
)

from mura_plugin.adapters import MultiRankLinear
from mura_plugin.methods.mura import TOWERS, MuRA
from mura_plugin.text_adapters import TextHead, prompt_lists
from tta_bench.run.resume import method_config_hash as config_hash

_build = functools.partial(build_method, MuRA)
ROOT = Path(__file__).resolve().parents[1]


def _adapted(mura: MuRA, tower: str) -> list[str]:
    prefix = "clip.visual." if tower == "vision" else "clip.transformer."
    return [
        name
        for name, m in mura.model.named_modules()
        if isinstance(m, MultiRankLinear) and name.startswith(prefix)
    ]


@pytest.mark.parametrize("towers", TOWERS)
def test_towers_place_the_components(classifier, towers):
    mura = _build(classifier, towers=towers, views=3)
    vision, text = _adapted(mura, "vision"), _adapted(mura, "text")
    assert bool(vision) == (towers != "text")
    assert bool(text) == (towers != "vision")
    # the deepest block of each tower only (blocks=1), q and v
    for names in (vision, text):
        assert len(names) in (0, 2) and all(".resblocks." in n for n in names)
    assert len(mura.adapters) == len(vision) + len(text)
    assert sum(k.startswith("text.") for k in mura.adapters) == len(text)


@pytest.mark.parametrize("towers", ["text", "both"])
def test_text_components_start_at_the_source(classifier, batch, towers):
    """The SVD init compensates the frozen path, so before any step the re-encoded head is
    the protocol's head and the logits are zero-shot's (float rounding)."""
    mura = _build(classifier, towers=towers, views=3, steps=0)
    torch.testing.assert_close(
        mura.class_embeddings(), classifier.class_embeddings, rtol=0, atol=2e-5
    )
    with torch.no_grad():
        torch.testing.assert_close(mura.step(batch), classifier(batch), rtol=0, atol=2e-4)


def test_text_head_rebuilds_the_protocol_head_from_cached_tokens(classifier):
    """``TextHead`` with no adapted block (first = all blocks) is the protocol head."""
    import copy

    model = copy.deepcopy(classifier)
    n = len(model.clip.transformer.resblocks)
    for first in (0, n - 1, n):
        head = TextHead(model, prompt_lists(model, None), first)
        with torch.no_grad():
            torch.testing.assert_close(head.head(), classifier.class_embeddings, rtol=0, atol=1e-5)
            per_sample = head.head(3)
        assert per_sample.shape == (3, *classifier.class_embeddings.shape)
        torch.testing.assert_close(per_sample[2], head.head(), rtol=0, atol=1e-6)


def test_official_text_head_is_the_single_prompt(classifier):
    mura = _build(classifier, towers="text", text_head="official", steps=0, views=3)
    want = classifier.encode_templates(["a photo of a {}."])
    torch.testing.assert_close(mura.class_embeddings(), want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("towers", ["text", "both"])
def test_text_components_adapt_and_reset(classifier, batch, towers):
    online = _build(classifier, towers=towers, views=3, episodic="online", lr=5e-3)
    before = online.class_embeddings().clone()
    online.reseed(0)
    online.step(batch)
    assert (online.class_embeddings() - before).abs().max() > 1e-4  # the head moved
    online.reset()
    torch.testing.assert_close(online.class_embeddings(), before, rtol=0, atol=0)
    assert_reset_then_reseed_reproduces(
        functools.partial(_build, classifier, towers=towers, views=3, episodic="online"), batch
    )


@pytest.fixture()
def float64():
    """Default dtype float64 for the test (restored after)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def _episode_config(towers: str, fusion: str) -> dict:
    return {
        "towers": towers,
        "fusion": fusion,
        "router_persist": False,
        "views": 5,
        "lr": 5e-3,
        "episodic": "sample",
    }


@pytest.mark.parametrize("fusion", ["router", "softmax"])
def test_text_batched_episodes_equal_the_sequential_loop(classifier, batch, fusion):
    """Each episode re-encodes its own head through its own copy of the text components
    (``head(n)``, [n, C, D]): the parallel episodes are the per-sample loop."""
    config = _episode_config("text", fusion)
    parallel, _, out = assert_batched_episodes_equal_sequential(
        functools.partial(_build, classifier, **config), batch, loss_atol=1e-6
    )
    with torch.no_grad():
        assert not torch.allclose(out, parallel.predict(batch), atol=1e-4)  # it adapted
    assert_params_at_snapshot(parallel)
    assert parallel._episodes_n is None


@pytest.mark.parametrize("fusion", ["router", "softmax"])
def test_both_towers_batched_episodes_equal_the_sequential_loop(classifier, batch, fusion, float64):
    """Both towers at once: in float32 the two orders of summation differ by up to 8e-5
    in the logits after AdamW's sign-like first step (elements whose gradient is near
    Adam's eps); in float64 the parallel episodes are the per-sample loop to 1e-9."""
    import copy

    model = copy.deepcopy(classifier).double()
    config = _episode_config("both", fusion)
    parallel = _build(model, **config)
    sequential = _build(model, episode_batching=False, **config)
    assert parallel.batched_episodes() and not sequential.batched_episodes()
    images = batch.double()
    parallel.reseed(4)
    out = parallel.step(images)
    sequential.reseed(4)
    torch.testing.assert_close(out, sequential.step(images), rtol=0, atol=1e-9)
    with torch.no_grad():
        assert not torch.allclose(out, parallel.predict(images), atol=1e-4)  # it adapted
    assert_params_at_snapshot(parallel)


def test_single_rank_matched_to_the_multi_rank_set(classifier):
    """ranks=[28] has exactly the adapter parameters of [4, 8, 16] (sum of ranks): the
    matched single-rank arm of the study (its router, one output, is inert)."""
    multi = _build(classifier, views=3)
    single = _build(classifier, views=3, ranks=[28])

    def count(m: MuRA) -> int:
        return sum(p.numel() for a in m.adapters.values() for p in a.adapter_parameters())

    assert count(multi) == count(single) > 0


def test_update_period_adapts_every_nth_batch_only(classifier, batch):
    every = _build(classifier, views=3, episodic="online", adapt_every=2, lr=5e-3)
    snap = [p.detach().clone() for p in every.params]
    every.reseed(0)
    every.step(batch)  # batch 0: adapts
    moved = [p.detach().clone() for p in every.params]
    assert any(not torch.equal(a, b) for a, b in zip(snap, moved))
    every.step(batch)  # batch 1: predicts only
    assert all(torch.equal(a, b) for a, b in zip(moved, every.params))


def test_default_run_key_is_unchanged():
    """``towers`` at its default stays out of the run key: the committed default results
    keep their key."""
    committed = json.loads((ROOT / "results/digits-c/mura.json").read_text())
    assert config_hash(MuRA.Config()) == committed["method_config_hash"]
    assert config_hash(MuRA.Config(towers="both")) != committed["method_config_hash"]


def test_text_towers_refuse_a_tower_without_causal_text(classifier):
    import copy

    model = copy.deepcopy(classifier)
    model.clip.text_pool_type = "first"
    mura = MuRA(model, MuRA.Config(towers="text"))
    with pytest.raises(ValueError, match="causal open_clip text transformer"):
        mura.setup()


# -- the command line --------------------------------------------------------------------
CLI_SMALL = ["protocol.shifts=[contrast]", "protocol.max_images=64", "seeds=[0]", "--quiet"]


@pytest.mark.parametrize(
    "options",
    [
        ["method.towers=both", "method.episodic=online", "method.adapt_every=2"],
        ["method.towers=text", "method.loss=marginal_entropy", "method.ranks=[28]"],
        ["method.loss=consistency", "method.views=2", "method.include_original=false",
         "method.crop_scale_min=0.7", "method.rotate_degrees=10", "method.flip=false"],
        ["method.augmix=true", "method.episodic=batch", "protocol.reset=continual"],
    ],
)  # fmt: skip
def test_cli_runs_each_option(tmp_path, options):
    from tta_bench.cli import main

    out = tmp_path / "r.json"
    views = [] if "method.views=2" in options else ["method.views=3"]
    args = ["run", "--method", "mura", *CLI_SMALL, *views, *options, "--output", str(out)]
    assert main(args) == 0
    record = json.loads(out.read_text())
    cfg = record["method_config"]
    for option in options:
        key, value = option.split("=", 1)
        if key.startswith("method."):
            assert cfg[key[len("method.") :]] == yaml.safe_load(value), option
    assert record["cells"][0]["n"] == 64 and 0 <= record["cells"][0]["accuracy"] <= 1


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("method.towers=cnn", "towers"),
        ("method.adapt_every=0", "adapt_every"),
        ("method.episodic=forever", "episodic"),
        ("method.ranks=[0]", "ranks"),
    ],
)
def test_cli_bad_option_exits_2_before_the_model_is_built(tmp_path, capsys, option, message):
    from tta_bench.cli import main

    out = tmp_path / "r.json"
    assert main(["run", "--method", "mura", *CLI_SMALL, option, "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and not out.exists()


def test_text_components_refuse_a_loss_that_never_reads_the_logits(tmp_path, capsys):
    with pytest.raises(ValueError, match="loss=consistency reads the image features only"):
        MuRA.Config(towers="text", loss="consistency")
    from tta_bench.cli import main

    out = tmp_path / "r.json"
    args = ["method.towers=text", "method.loss=consistency", "--output", str(out)]
    assert main(["run", "--method", "mura", *CLI_SMALL, *args]) == 2
    assert "reads the image features only" in capsys.readouterr().err and not out.exists()
