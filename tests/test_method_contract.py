"""The Method contract (docs/design.md#contracts), checked on every registered method with the real
default model: reset() returns to the state after setup(); the frozen backbone is
bit-identical after adaptation; only declared parameters change; methods never see labels.
And what the leaderboard page shows of each method: its family, from the allowed set, and
its paper, official code and commit, the ones its provenance header names."""

from __future__ import annotations

import re
import sys

import pytest
import torch
from method_runs import build_with_source, cheap_config

from tta_bench import catalog
from tta_bench.method import GradientMethod, Method
from tta_bench.registry import registry

METHODS = registry("methods").names()
#: The families this plugin's methods belong to (``family:`` in a method's catalogue
#: entry): the leaderboard page filters by them.
FAMILIES = ("reference", "TENT family", "CLIP batch", "episodic", "online", "open-set")


def _digits_source(n: int, labels: bool = False):
    """The first ``n`` digits training images: clean source images [n, 3, 32, 32] in [0, 1],
    as the runner hands them over (EATA's Fisher); with ``labels``, ``(images, labels)``
    (RMT's source replay)."""
    from mura_plugin.datasets.digits import digits_arrays

    x, y = digits_arrays("train")
    images = torch.from_numpy(x[:n]).permute(0, 3, 1, 2).float() / 255.0
    return (images, torch.from_numpy(y[:n]).long()) if labels else images


def _fresh(name: str, classifier) -> Method:
    method_cls = registry("methods").get(name)
    return build_with_source(method_cls, classifier, cheap_config(method_cls), _digits_source)


@pytest.fixture(scope="module")
def batches(test_images):
    x, _ = test_images
    # Shifted inputs so adaptation has something to do: strong contrast reduction.
    x = (x - x.mean(dim=(1, 2, 3), keepdim=True)) * 0.2 + x.mean(dim=(1, 2, 3), keepdim=True)
    return x[:8], x[8:16]


@pytest.mark.parametrize("name", METHODS)
def test_reset_then_step_equals_a_fresh_instance(name, classifier, batches):
    x, other = batches
    fresh = _fresh(name, classifier)
    fresh.reseed(7)
    expected = fresh.step(x)

    used = _fresh(name, classifier)
    for seed in (1, 2):
        used.reseed(seed)
        used.step(other)
    used.reset()
    used.reseed(7)
    got = used.step(x)
    assert got.shape == (x.shape[0], classifier.num_classes)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", METHODS)
def test_only_declared_parameters_change(name, classifier, batches):
    x, other = batches
    method = _fresh(name, classifier)
    declared = {id(p) for p in method.trainable_parameters()}
    before = {k: v.detach().clone() for k, v in method.model.state_dict().items()}
    declared_names = {k for k, p in method.model.named_parameters() if id(p) in declared}
    for seed in (1, 2):
        method.reseed(seed)
        method.step(other if seed == 1 else x)
    after = method.model.state_dict()
    for key, value in before.items():
        if key in declared_names:
            continue
        assert torch.equal(value, after[key]), f"{name} changed undeclared state {key}"


@pytest.mark.parametrize("name", METHODS)
def test_the_source_model_is_never_touched(name, classifier, batches):
    x, _ = batches
    before = {k: v.clone() for k, v in classifier.state_dict().items()}
    method = _fresh(name, classifier)
    method.reseed(0)
    method.step(x)
    for key, value in classifier.state_dict().items():
        assert torch.equal(before[key], value), key


@pytest.mark.parametrize("name", METHODS)
def test_same_seed_same_logits(name, classifier, batches):
    x, _ = batches
    outs = []
    for _ in range(2):
        method = _fresh(name, classifier)
        method.reseed(3)
        outs.append(method.step(x))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


#: The methods whose ``predict`` reads more than the model's forward: a cache, a memory,
#: a prompt or a head of their own (``test_predict_reads_the_state_and_changes_nothing``).
OWN_PREDICT = [
    n for n in METHODS
    if registry("methods").get(n).predict not in (Method.predict, GradientMethod.predict)
]  # fmt: skip


@pytest.mark.parametrize("name", METHODS)
def test_predict_gives_every_class_the_same_under_one_seed(name, classifier, batches):
    """``predict`` (the realtime track's batches while a method is busy) gives finite logits
    of every class, the same twice under one seed (the runner seeds every batch)."""
    x, other = batches
    method = _fresh(name, classifier)
    method.reseed(1)
    method.step(other)
    method.reseed(5)
    first = method.predict(x)
    method.reseed(5)
    again = method.predict(x)
    assert first.shape == (x.shape[0], classifier.num_classes)
    assert torch.isfinite(first).all()
    torch.testing.assert_close(first, again, rtol=0, atol=0)


@pytest.mark.parametrize("name", OWN_PREDICT)
def test_predict_reads_the_state_and_changes_nothing(name, classifier, batches):
    """A method's own ``predict`` leaves its state as it was: the next step equals the step
    of a twin that never predicted."""
    x, other = batches
    twin, method = _fresh(name, classifier), _fresh(name, classifier)
    for m in (twin, method):
        m.reseed(1)
        m.step(other)
    method.reseed(5)
    method.predict(x)
    for m in (twin, method):
        m.reseed(2)
    torch.testing.assert_close(method.step(x), twin.step(x), rtol=0, atol=0)


FEATURE_PATHS = [
    n for n in METHODS if registry("methods").get(n).features_only is not Method.features_only
]


@pytest.mark.parametrize("name", FEATURE_PATHS)
def test_a_feature_path_equals_the_image_path(name, classifier, batches):
    """A method that says it reads its images only through their features
    (``features_only``) gives the same logits from the features as from the images."""
    x, other = batches
    method = _fresh(name, classifier)
    if not method.features_only():
        pytest.skip(f"{name} reads its images itself in this setting")
    twin = _fresh(name, classifier)
    for batch in (other, x):
        with torch.no_grad():
            feats = twin.model.encode_image(batch).float()
        torch.testing.assert_close(twin.step_features(feats), method.step(batch), rtol=0, atol=0)


def test_parameter_free_method_declares_nothing(classifier):
    method = _fresh("zeroshot", classifier)
    assert method.trainable_parameters() == []


def test_methods_never_receive_labels(classifier, digits_stream):
    """A method sees only what the runner hands it: its step() arguments are images only,
    and nothing reachable from the method holds the labels."""
    from tta_bench.run import runner
    from tta_bench.run.protocol import load_protocol
    from tta_bench.run.spec import RunSpec

    seen: list[tuple] = []

    class Spy(Method):
        def step(self, *args, **kwargs):
            seen.append((args, kwargs))
            return self.model(args[0])

    registry("methods").add("spy-labels", Spy)
    try:
        protocol = load_protocol("digits-c", shifts=["contrast"], max_images=40)
        spec = RunSpec(
            method="spy-labels",
            method_config=Spy.Config(),
            model="tiny-clip-digits",
            model_args={},
            protocol=protocol,
            seeds=[0],
            progress=False,
        )
        import tempfile
        from pathlib import Path

        with tempfile.TemporaryDirectory() as d:
            runner.run(spec, Path(d) / "r.json")
    finally:
        registry("methods")._scan().pop("spy-labels")
    assert seen, "the runner never called step()"
    for args, kwargs in seen:
        assert kwargs == {}
        assert len(args) == 1 and args[0].is_floating_point() and args[0].dim() == 4


@pytest.mark.parametrize("name", METHODS)
def test_every_method_declares_a_family_from_the_allowed_set(name):
    family = catalog.entry("methods", name).get("family")
    assert family in FAMILIES, f"{name}: family {family!r} is not one of {FAMILIES}"
    assert (family == "reference") == registry("methods").get(name).is_reference


#: "Official code: <url>[,.] [read at] commit <sha>" in a provenance header.
OFFICIAL = re.compile(
    r"Official code: (https://\S+?)[,.]?\s(?:read at )?(?:commit ([0-9a-f]{40}))?"
)


@pytest.mark.parametrize("name", METHODS)
def test_the_catalogue_links_are_those_of_the_provenance_header(name):
    """The paper, official code and commit the leaderboard links each method to (its
    catalogue entry) are those its module's provenance header names."""
    cls = registry("methods").get(name)
    header = " ".join((sys.modules[cls.__module__].__doc__ or "").split())
    meta = catalog.entry("methods", name)
    assert str(meta.get("paper", "")).startswith("https://"), f"{name}: no paper link"
    found = OFFICIAL.search(header)
    assert meta.get("official_code") == (found.group(1) if found else None), name
    assert meta.get("official_commit") == (found.group(2) if found else None), name


def test_the_header_pattern_reads_a_commit():
    header = "Official code: https://github.com/a/b, read at commit " + "0" * 40 + " (x.py)"
    assert OFFICIAL.search(header).groups() == ("https://github.com/a/b", "0" * 40)
    assert OFFICIAL.search("Official code: https://github.com/a/b. Then").groups() == (
        "https://github.com/a/b",
        None,
    )


LIGHT = [n for n in METHODS if registry("methods").get(n).light]


def test_the_light_methods_are_the_ones_sweeps_pack():
    assert LIGHT, "no method declares light: sweeps would pack nothing"


@pytest.mark.parametrize("name", LIGHT)
def test_a_light_method_runs_one_forward_per_sample_and_no_backward(name, tmp_path):
    """What ``Method.light`` promises (``tta-bench sweep`` packs such jobs several to a
    task), measured by the runner's own pass counters on a short run with the defaults."""
    from tta_bench.run import runner
    from tta_bench.run.protocol import load_protocol
    from tta_bench.run.spec import RunSpec

    cls = registry("methods").get(name)
    spec = RunSpec(
        method=name,
        method_config=cls.Config(),
        model="tiny-clip-digits",
        model_args={},
        protocol=load_protocol("digits-c", shifts=["contrast"], max_images=48, batch_size=16),
        seeds=[0],
        progress=False,
        reference=False,
    )
    cell = runner.run(spec, tmp_path / "r.json")["cells"][0]
    assert cell["forward_passes_per_sample"] <= 1.0, cell["forward_passes_per_sample"]
    assert cell["backward_passes_per_sample"] == 0.0
