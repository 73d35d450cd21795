"""``tta-bench validate KIND NAME``: the contract checks on one component, a line per check,
exit 0 when none fails, 1 when one does, 2 for an unknown kind or name. The test plugin's
components pass; a deliberately broken component of each kind is reported as FAIL naming
the check it breaks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tta_bench.method import Method
from tta_bench.registry import registry

from .helpers import cli, write_folder


@pytest.fixture()
def add() -> Iterator[Any]:
    """``add(kind, name, obj)``: register in-process for one test (``Registry.add``)."""
    added: list[tuple[str, str]] = []

    def register(kind: str, name: str, obj: Any) -> None:
        registry(kind).add(name, obj, distribution="test_validate")
        added.append((kind, name))

    yield register
    for kind, name in added:
        registry(kind)._scan().pop(name, None)
        registry(kind)._loaded.pop(name, None)


def _lines(out: str) -> dict[str, str]:
    """``{check name: its line}`` of a report."""
    found = {}
    for line in out.splitlines():
        status, _, rest = line.partition("  ")
        if status in ("PASS", "FAIL", "SKIP"):
            found[rest.split(":", 1)[0]] = line
    return found


def _failed(out: str) -> list[str]:
    return [name for name, line in _lines(out).items() if line.startswith("FAIL")]


def _fails(capsys: Any, kind: str, check: str, reason: str) -> str:
    """``tta-bench validate KIND broken`` exits 1 with ``check`` failing for ``reason``;
    returns the report."""
    rc, out, _ = cli(capsys, "validate", kind, "broken")
    assert rc == 1, out
    line = _lines(out)[check]
    assert line.startswith(f"FAIL  {check}: ") and reason in line, out
    return out


# -- the test plugin's components pass ---------------------------------------------------
@pytest.mark.parametrize(
    ("kind", "name"),
    [
        ("method", "norm_tent"),
        ("method", "zeroshot"),
        ("methods", "colour_oracle"),
        ("shift", "noise"),
        ("shift", "dim"),
        ("loss", "entropy"),
        ("dataset", "synthetic"),
        ("model", "tiny-clip"),
        ("metric", "accuracy"),
        ("metric", "ece"),
    ],
)
def test_the_test_plugins_components_pass_every_check(capsys, kind, name):
    rc, out, err = cli(capsys, "validate", kind, name)
    assert rc == 0, out + err
    from tta_bench.cli.validate import kind_of

    assert out.startswith(f"validate {kind_of(kind)} {name} (")
    assert not _failed(out)
    assert "PASS  loads and passes the load-time checks" in out
    assert out.rstrip().splitlines()[-1].startswith("ok: ")


def test_a_method_report_names_each_contract_check(capsys):
    rc, out, _ = cli(capsys, "validate", "method", "norm_tent")
    assert rc == 0
    from tta_bench.cli.validate import METHOD_CHECKS

    checks = _lines(out)
    assert len(checks) == 1 + 1 + len(METHOD_CHECKS), checks  # loads, builds, the contract
    for name in ("builds with its default config and sets up", *METHOD_CHECKS):
        assert checks[name].startswith("PASS"), checks
    assert "on model tiny-clip, 16 images of suite tiny-shifts (dataset synthetic)" in out
    assert "logits [B, C], finite: [8, 4] float32, finite" in out


def test_a_shift_report_checks_range_determinism_and_per_sample_seeding(capsys):
    rc, out, _ = cli(capsys, "validate", "shift", "noise")
    assert rc == 0
    checks = _lines(out)
    assert "clamped by the harness" in checks["finite, in [0, 1] after the harness's clamp"]
    assert checks["per-sample seeding (independent of the batch)"].startswith("PASS")
    assert checks["from_uint8 entry matches"].startswith("SKIP")  # optional, absent


def test_a_dataset_needing_data_is_skipped_not_failed_and_passes_with_it(capsys, tmp_path):
    rc, out, _ = cli(capsys, "validate", "dataset", "folder")
    assert rc == 0, out
    checks = _lines(out)
    assert checks["builds a DomainStream"].startswith(
        "SKIP  builds a DomainStream: skipped: needs data"
    )
    assert "--data-dir" in checks["builds a DomainStream"]
    write_folder(tmp_path / "data", per_class=2)
    rc, out, _ = cli(capsys, "validate", "dataset", "folder", "--data-dir", str(tmp_path / "data"))
    assert rc == 0, out
    checks = _lines(out)
    assert checks["builds a DomainStream"].startswith("PASS"), out
    assert "8 images, 4 classes" in checks["builds a DomainStream"]
    assert checks["labels in range"].startswith("PASS")
    assert checks["an image decodes"].startswith("PASS")


def test_a_dataset_report_gives_the_size_of_each_split(capsys):
    rc, out, _ = cli(capsys, "validate", "dataset", "synthetic")
    assert rc == 0
    assert _lines(out)["split sizes"] == "PASS  split sizes: train: 32, test: 32"


# -- bad kind or name: exit 2 with "did you mean" ----------------------------------------
def test_an_unknown_kind_or_name_exits_2_with_did_you_mean(capsys):
    rc, out, err = cli(capsys, "validate", "methd", "norm_tent")
    assert rc == 2 and not out
    assert "unknown kind 'methd'. Did you mean 'method'?" in err
    assert "Available: method, shift, loss, dataset, model, metric" in err
    rc, _, err = cli(capsys, "validate", "method", "norm_tnet")
    assert rc == 2
    assert "unknown method 'norm_tnet'. Did you mean 'norm_tent'?" in err
    rc, _, err = cli(capsys, "validate", "metric", "acuracy")
    assert rc == 2 and "Did you mean 'accuracy'" in err
    rc, _, err = cli(capsys, "validate", "method", "zeroshot", "--model", "tiny-clp")
    assert rc == 2 and "Did you mean 'tiny-clip'?" in err


# -- one broken component per kind: FAIL naming the check --------------------------------
class Leaky(Method):
    """Adds a bias that grows with every step and survives reset()."""

    def setup(self) -> None:
        self.bias = 0.0

    @torch.no_grad()
    def step(self, images: torch.Tensor) -> torch.Tensor:
        self.bias += 1.0
        return self.model(images).float() + self.bias


class PeeksAtLabels(Method):
    """Takes labels in its step signature."""

    @torch.no_grad()
    def step(self, images: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(images).float()


class KeepsTargets(Method):
    """Holds a label-like attribute."""

    def setup(self) -> None:
        self.targets = None

    @torch.no_grad()
    def step(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images).float()


class EditsTheSharedModel(Method):
    """Claims ``adapts = False`` (the runner shares the frozen classifier) but scales the
    image tower's projection weights in place."""

    @torch.no_grad()
    def step(self, images: torch.Tensor) -> torch.Tensor:
        self.model.visual.proj.weight.mul_(1.01)
        return self.model(images).float()


class WrongShape(Method):
    """Returns one logit per sample."""

    @torch.no_grad()
    def step(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images).float()[:, :1]


class Counter(Method):
    """Offsets its logits by a process-wide count of its steps: two fresh instances after
    the same ``reseed`` differ."""

    steps = 0

    @torch.no_grad()
    def step(self, images: torch.Tensor) -> torch.Tensor:
        Counter.steps += 1
        return self.model(images).float() + Counter.steps


def test_a_method_that_changes_undeclared_state_fails(capsys, add):
    class Undeclared(Leaky):
        adapts = True

        def setup(self) -> None:
            super().setup()
            self.model.requires_grad_(False)

        @torch.no_grad()
        def step(self, images: torch.Tensor) -> torch.Tensor:
            self.model.visual.fc.bias.add_(0.1)  # declares no trainable parameters
            return self.model(images).float()

    add("methods", "undeclared", Undeclared)
    rc, out, _ = cli(capsys, "validate", "method", "undeclared")
    assert rc == 1
    line = _lines(out)["only declared trainable parameters change"]
    assert line.startswith("FAIL") and "clip.visual.fc.bias" in line, out


def test_a_method_whose_setup_raises_fails_and_skips_the_rest(capsys, add):
    class NoSetup(Method):
        def setup(self) -> None:
            raise RuntimeError("no optimiser for you")

        def step(self, images: torch.Tensor) -> torch.Tensor:
            return self.model(images)

    add("methods", "nosetup", NoSetup)
    rc, out, _ = cli(capsys, "validate", "method", "nosetup")
    assert rc == 1
    checks = _lines(out)
    assert (
        "raised RuntimeError: no optimiser for you"
        in checks["builds with its default config and sets up"]
    )
    assert checks["reset() restores the state"] == (
        "SKIP  reset() restores the state: not run: setup failed"
    )


def _batch_dependent(images: torch.Tensor, severity: int, *, generator: Any) -> torch.Tensor:
    """Noise from the first sample's generator broadcast over the batch: a sample's
    corruption depends on which sample leads its batch."""
    noise = generator.normal(*images.shape[1:])[:1]
    return images + 0.05 * severity * noise


def _global_rng(images: torch.Tensor, severity: int, *, generator: Any) -> torch.Tensor:
    return images + 0.05 * severity * torch.randn_like(images)


def _crops(images: torch.Tensor, severity: int, *, generator: Any) -> torch.Tensor:
    return images[..., 1:, 1:]


def _nan(images: torch.Tensor, severity: int, *, generator: Any) -> torch.Tensor:
    return images * float("nan")


def _mean_loss(logits: torch.Tensor, **_: object) -> torch.Tensor:
    return -(logits.softmax(1) * logits.log_softmax(1)).sum(1).mean()


def _detached_loss(logits: torch.Tensor, **_: object) -> torch.Tensor:
    return logits.detach().logsumexp(1)


def _no_context(logits: torch.Tensor) -> torch.Tensor:
    return logits.logsumexp(1)


#: Per kind: broken components, the check each fails and words of the reason it gives.
BROKEN = {
    "method": [
        (Leaky, "reset() restores the state", "state survives reset()"),
        (PeeksAtLabels, "step takes images only", "step takes 'labels'"),
        (KeepsTargets, "labels never reach it (no label-like attribute)", "['targets']"),
        (EditsTheSharedModel, "the frozen backbone is unchanged", "declare adapts = True"),
        (WrongShape, "logits [B, C], finite", "logits (8, 1), expected (8, 4)"),
        (Counter, "same seed, same logits", "two fresh instances after reseed(3) differ"),
    ],
    "shift": [
        (_batch_dependent, "per-sample seeding (independent of the batch)", "depends on the"),
        (_global_rng, "same generator seeds, same output", "from `generator` only"),
        (_crops, "output has the input's shape", "expected (8, 3, 16, 16)"),
        (_nan, "finite, in [0, 1] after the harness's clamp", "non-finite value(s)"),
    ],
    "loss": [
        (_mean_loss, "one value per sample", "shape () from logits [6, 5], expected [6]"),
        (_detached_loss, "differentiable", "does not require grad"),
        (_no_context, "accepts context keywords", "unexpected keyword argument 'features'"),
    ],
}


@pytest.mark.parametrize(
    ("kind", "broken", "check", "reason"),
    [(kind, *case) for kind, cases in BROKEN.items() for case in cases],
)
def test_a_broken_component_fails_naming_the_check(capsys, add, kind, broken, check, reason):
    from tta_bench.cli.validate import KINDS

    add(KINDS[kind], "broken", broken)
    out = _fails(capsys, kind, check, reason)
    assert out.rstrip().splitlines()[-1].startswith("FAILED: ")


def test_a_broken_dataset_fails_naming_the_check(capsys, add):
    from tta_bench_testplugin.data import synthetic

    def no_slot(*, split: str = "test") -> Any:
        stream = synthetic(split=split)
        stream.templates = ["a photo of a square."]  # no '{}' for the class name
        return stream

    add("datasets", "broken", no_slot)
    out = _fails(capsys, "dataset", "templates", "exactly one '{}'")
    assert _failed(out) == ["templates"]


def test_a_broken_model_fails_naming_the_check(capsys, add):
    def not_a_bundle(*, width: int = 4) -> Any:
        return torch.nn.Linear(width, width)

    add("models", "broken", not_a_bundle)
    rc, out, _ = cli(capsys, "validate", "model", "broken")
    assert rc == 1, out
    assert _lines(out)["builds a ModelBundle"] == "FAIL  builds a ModelBundle: returned Linear"


def test_a_broken_metric_fails_naming_the_check(capsys):
    from tta_bench.metrics import METRICS, register_metric

    register_metric("always_nan", lambda logits, labels: float("nan"))
    try:
        rc, out, _ = cli(capsys, "validate", "metric", "always_nan")
    finally:
        METRICS.pop("always_nan")
    assert rc == 1, out
    assert "registered in-process" in out.splitlines()[0]
    assert _lines(out)["a finite float"] == "FAIL  a finite float: returned nan"


def test_a_component_that_fails_its_load_time_check_is_a_fail(capsys, add):
    reg = registry("shifts")
    reg._scan()["positional"] = (
        reg._scan()["noise"][0],
        lambda: lambda images: images,  # one positional parameter: invalid
    )
    try:
        rc, out, _ = cli(capsys, "validate", "shift", "positional")
    finally:
        reg._scan().pop("positional")
    assert rc == 1
    assert _failed(out) == ["loads and passes the load-time checks"]
    assert "is invalid: expected parameters (images, severity, ...)" in out


def test_the_shared_checks_run_on_any_classifier(plugin_classifier):
    """``method_checks`` is a function the command and tests share."""
    from tta_bench.cli.validate import PASS, method_checks

    classifier, images = plugin_classifier
    checks = method_checks(registry("methods").get("norm_tent"), classifier, images)
    assert [c.status for c in checks] == [PASS] * 8


@pytest.fixture()
def plugin_classifier() -> tuple[Any, torch.Tensor]:
    """The test plugin's classifier and the images ``validate`` runs methods on."""
    from tta_bench.cli.validate import sample
    from tta_bench.model import ZeroShotClassifier

    s = sample()
    return ZeroShotClassifier(s.bundle, s.classnames, s.templates), s.images
