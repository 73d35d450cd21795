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
from tta_bench.method import Method
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
def test_seeds_reset_predict_and_what_a_step_may_change(name, classifier, batches):
    """The lifecycle of two instances built alike, each property checked where the
    histories already reach it (one pair of set-ups and six steps instead of one set-up
    per property):

    * two fresh instances under one seed give the same logits, bit for bit;
    * ``predict`` (the realtime track's batches while a method is busy) gives finite logits
      of every class, the same twice under one seed (the runner seeds every batch), and
      leaves the state as it was: the next step equals the step of a twin that never
      predicted, whether the method has a ``predict`` of its own or not;
    * a step changes the declared trainable parameters only;
    * ``reset()`` returns to the state after ``setup()``: the next step equals a fresh
      instance's;
    * the source classifier is never touched."""
    x, other = batches
    source_before = {k: v.clone() for k, v in classifier.state_dict().items()}
    twin, method = _fresh(name, classifier), _fresh(name, classifier)
    declared = {id(p) for p in method.trainable_parameters()}
    declared_names = {k for k, p in method.model.named_parameters() if id(p) in declared}
    before = {k: v.detach().clone() for k, v in method.model.state_dict().items()}

    steps = []
    for m in (twin, method):
        m.reseed(7)
        steps.append(m.step(x))
    first = steps[0]
    assert first.shape == (x.shape[0], classifier.num_classes)
    torch.testing.assert_close(
        steps[1], first, rtol=0, atol=0, msg=lambda m: f"{name}, same seed: {m}"
    )
    for m in (twin, method):
        m.reseed(1)
        m.step(other)

    method.reseed(5)
    predicted = method.predict(x)
    method.reseed(5)
    again = method.predict(x)
    assert predicted.shape == (x.shape[0], classifier.num_classes)
    assert torch.isfinite(predicted).all()
    torch.testing.assert_close(predicted, again, rtol=0, atol=0)
    for m in (twin, method):
        m.reseed(2)
    torch.testing.assert_close(method.step(x), twin.step(x), rtol=0, atol=0,
                               msg=lambda m: f"{name}, predict changed the state: {m}")  # fmt: skip

    after = method.model.state_dict()
    for key, value in before.items():
        if key not in declared_names:
            assert torch.equal(value, after[key]), f"{name} changed undeclared state {key}"

    method.reset()
    method.reseed(7)
    again_fresh = method.step(x)
    torch.testing.assert_close(
        again_fresh, first, rtol=0, atol=1e-5, msg=lambda m: f"{name}, reset(): {m}"
    )
    for key, value in classifier.state_dict().items():
        assert torch.equal(source_before[key], value), key


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
