"""``tta-bench validate KIND NAME``: the contract checks (docs/design.md#contracts) on one
component, each reported as PASS, FAIL or SKIP with its reason.

The checks per kind (``CHECKS`` names them in order):

* **method**: it loads (a ``Method`` subclass with a dataclass ``Config``); it builds with
  its default config and sets up; ``step`` takes images only (no label-like or further
  required parameter); logits ``[B, C]``, floating and finite; no label-like attribute on
  the instance or its class; ``reset()`` restores the state (step, reset, step equals a
  fresh instance's first step); only declared trainable parameters change (state dicts
  compared); a classifier the method does not copy (``adapts = False``: the runner shares
  it) is unchanged; ``reseed(s)`` on two fresh instances gives identical logits.
* **shift**: it loads; the output has the input's shape at severities 1..5; finite and in
  [0, 1] after the harness's clamp (``tta_bench.run.inputs.apply_shift``; the kernel's own range
  is reported); the same per-sample generator seeds give the same output whatever torch's
  and numpy's global RNG state; per-sample seeding (a sample shifted alone, with its own
  generator, equals its row of the batch); a ``from_uint8`` entry matches the float path.
* **loss**: it loads; one value per sample ``[B]`` from logits ``[B, C]``; finite;
  differentiable (backward gives finite gradients); context it does not use (``features=``)
  is accepted.
* **dataset**: it loads; the factory's ``check_args``, when it has one; it builds a
  ``DomainStream``; labels in ``0..C-1``; class names present (non-empty, unique);
  templates present (one ``{}`` each, ``tta_bench.text_head.resolve_templates``), the
  catalogue's too; the size of each split the catalogue lists; a stable fingerprint; the
  first image decodes. A dataset that needs local data it was not given (``--data-dir``)
  is SKIP, "needs data (...)", not FAIL.
* **model**: it loads; its ``check_args``; it builds a ``ModelBundle`` with a valid
  ``Preprocess``; zero-shot logits ``[B, C]``, finite; a second build has the same state.
* **metric**: a finite float on random logits and labels (no bounds assumed; an open-set
  metric's cell has a quarter of its rows labelled -1, out of distribution); the same
  value twice; its inputs left unchanged.

Methods (and shifts) run on a few images of the suite's dataset (``--suite``, default the
catalogues' suite) at the model's input size (``--model``, default the catalogues' model),
with the suite's text head; when that dataset is not available, on random images with the
catalogue's class names for it. ``validate(...)`` returns a ``Report``; the CLI prints it and
exits 0 when no check failed, 1 when one did, 2 for an unknown kind or name.

The checks live in ``cli.checks`` (a check and its outcome), ``cli.checks_method``,
``cli.checks_data`` (shifts, datasets) and ``cli.checks_model`` (models, losses, metrics);
every name of them is importable from here too (docs/plugins.md).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tta_bench.cli.checks import (
    ATOL,
    BATCH,
    FAIL,
    PASS,
    SKIP,
    Check,
    CheckFailed,
    CheckSkipped,
    run_check,
)
from tta_bench.cli.checks_data import dataset_checks, shift_checks
from tta_bench.cli.checks_method import LABEL_LIKE, METHOD_CHECKS, method_checks
from tta_bench.cli.checks_model import loss_checks, metric_checks, model_checks
from tta_bench.registry import RegistryError, UnknownNameError, registry

if TYPE_CHECKING:
    import torch

__all__ = [
    "ATOL",
    "BATCH",
    "FAIL",
    "KINDS",
    "KIND_NAMES",
    "LABEL_LIKE",
    "METHOD_CHECKS",
    "PASS",
    "SKIP",
    "Check",
    "CheckFailed",
    "CheckSkipped",
    "Report",
    "Sample",
    "dataset_checks",
    "kind_of",
    "loss_checks",
    "method_checks",
    "metric_checks",
    "model_checks",
    "run_check",
    "sample",
    "shift_checks",
    "validate",
]

#: The kinds ``validate`` checks, singular (plurals are accepted too), and their registries.
KINDS = {
    "method": "methods",
    "shift": "shifts",
    "loss": "losses",
    "dataset": "datasets",
    "model": "models",
    "metric": "metrics",
}
KIND_NAMES = tuple(KINDS)


@dataclass
class Report:
    """The checks of one component, with what they ran on."""

    kind: str
    name: str
    origin: str
    context: str = ""
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no check failed (skipped checks do not fail)."""
        return all(c.status != FAIL for c in self.checks)

    def counts(self) -> dict[str, int]:
        return {s: sum(c.status == s for c in self.checks) for s in (PASS, FAIL, SKIP)}

    def text(self) -> str:
        head = f"validate {self.kind} {self.name} ({self.origin})"
        lines = [head] + ([f"  on {self.context}"] if self.context else [])
        lines += [c.line() for c in self.checks]
        n = self.counts()
        verdict = "ok" if self.ok else "FAILED"
        lines.append(
            f"{verdict}: {n[PASS]} passed, {n[FAIL]} failed, {n[SKIP]} skipped "
            f"of {len(self.checks)} checks"
        )
        return "\n".join(lines)


# -- what the method and shift checks run on ---------------------------------------------
@dataclass
class Sample:
    """The model and images the method and shift checks use."""

    model: str
    bundle: Any
    images: torch.Tensor  # [2 * BATCH, 3, S, S] in [0, 1]
    classnames: list[str]
    templates: list[str]
    table: str | None
    about: str


def _default_model(model: str | None, suite: str | None) -> str:
    from tta_bench import catalog
    from tta_bench.run.resolve import UsageError

    if model:
        return model
    suites = catalog.catalog()["suites"]
    if suite and suites.get(suite, {}).get("default_model"):
        return str(suites[suite]["default_model"])
    found = catalog.default_or_none("model")
    if found:
        return found
    default_suite = catalog.default_or_none("suite")
    if default_suite and suites.get(default_suite, {}).get("default_model"):
        return str(suites[default_suite]["default_model"])
    raise UsageError("no installed catalogue names a default model; pass --model NAME")


def sample(
    model: str | None = None,
    suite: str | None = None,
    data_dir: str | None = None,
    device: str = "cpu",
) -> Sample:
    """The model (``model``, else the catalogues' default) and ``2 * BATCH`` images of the
    suite's dataset (``suite``, else the catalogues' default) at its input size, flattened
    towards each image's mean so adaptation has something to do; random images with the
    catalogue's class names when the dataset cannot be read."""
    import numpy as np
    import torch

    from tta_bench import catalog
    from tta_bench.data import to_float_images
    from tta_bench.run.inputs import dataset_stream
    from tta_bench.run.protocol import load_protocol
    from tta_bench.run.sources import open_source

    name = _default_model(model, suite)
    bundle = registry("models").get(name)()
    size = bundle.preprocess.image_size
    n = 2 * BATCH
    suite = suite or catalog.default_or_none("suite")
    classnames: list[str] = ["class a", "class b", "class c", "class d"]
    templates: list[str] = ["a photo of a {}."]
    table: str | None = None
    images, about = None, ""
    if suite is not None:
        protocol = load_protocol(suite)
        table = protocol.severity_table
        meta = catalog.entry("datasets", protocol.dataset)
        classnames = list(meta.get("classnames") or classnames)
        if protocol.templates:
            templates = list(protocol.templates)
        try:
            domain: tuple[Any, ...] = ()
            if protocol.shift_source == "dataset":
                domain = (protocol.shifts[0], protocol.severities[0])
            stream = dataset_stream(protocol, data_dir, *domain)
            rows = np.arange(min(n, len(stream)))
            src = open_source(stream, size, cache="never", on_bad_image="skip")
            images = to_float_images(torch.from_numpy(src.fetch(rows).images))
            classnames = list(stream.classnames)
            templates = list(protocol.templates or stream.templates)
            about = f"{len(rows)} images of suite {suite} (dataset {protocol.dataset})"
        except (ValueError, OSError) as exc:
            about = f"random images (suite {suite}'s dataset is not available: {exc})"
    if images is None or not len(images):
        g = torch.Generator().manual_seed(0)
        images = torch.rand(n, 3, size, size, generator=g)
        about = about or "random images (no suite)"
    while images.shape[0] < n:
        images = torch.cat([images, images])[:n]
    mean = images.mean(dim=(1, 2, 3), keepdim=True)
    images = ((images - mean) * 0.2 + mean).clamp(0, 1)
    bundle.clip.to(device)
    return Sample(
        name, bundle, images.to(device), classnames, templates, table, f"model {name}, {about}"
    )


# -- the command -------------------------------------------------------------------------
def kind_of(kind: str) -> str:
    """The singular kind ``kind`` names (``method`` or ``methods``); a ``ValueError`` with
    "did you mean" and the kinds otherwise."""
    for singular, plural in KINDS.items():
        if kind in (singular, plural):
            return singular
    from tta_bench.run.resolve import UsageError

    singular = {**{k: k for k in KINDS}, **{v: k for k, v in KINDS.items()}}
    close = difflib.get_close_matches(kind, list(singular), n=1)
    hint = f" Did you mean {singular[close[0]]!r}?" if close else ""
    raise UsageError(f"unknown kind {kind!r}.{hint} Available: {', '.join(KIND_NAMES)}")


def validate(
    kind: str,
    name: str,
    *,
    model: str | None = None,
    suite: str | None = None,
    data_dir: str | None = None,
    device: str = "cpu",
) -> Report:
    """Run the checks of one component (module docstring). An unknown kind, name, model or
    suite is a ``ValueError`` (``UnknownNameError`` with "did you mean" for names); a
    component that fails to load is a FAIL of the report's first check."""
    from tta_bench.run.spec import resolve_device

    kind = kind_of(kind)
    device = str(resolve_device(device))  # unknown or unavailable: a ValueError naming it
    plural = KINDS[kind]
    if kind == "metric":
        return _validate_metric(name)
    reg = registry(plural)
    origin = reg.origin(name)  # UnknownNameError: did you mean, available
    where = f"{origin.value} from {origin.distribution} {origin.version}"
    report = Report(kind, name, where)
    try:
        obj = reg.get(name)
    except RegistryError as exc:
        report.checks.append(Check("loads and passes the load-time checks", FAIL, str(exc)))
        return report
    report.checks.append(Check("loads and passes the load-time checks", PASS, _loaded(kind, obj)))
    if kind == "dataset":
        report.context = f"data dir {data_dir}" if data_dir else ""
        report.checks += dataset_checks(obj, name=name, data_dir=data_dir)
    elif kind == "model":
        report.checks += model_checks(obj)
    elif kind == "loss":
        report.checks += loss_checks(obj)
    else:
        if suite is not None:
            from tta_bench import catalog

            catalog.suite(suite)
        if model is not None:
            registry("models").origin(model)
        s = sample(model, suite, data_dir, device)
        report.context = f"{s.about}, device {device}"
        if kind == "shift":
            report.checks += shift_checks(obj, s.images, name=name, table=s.table)
        else:
            from tta_bench.model import ZeroShotClassifier

            classifier = ZeroShotClassifier(s.bundle, s.classnames, s.templates).to(device)
            pool = s.images

            def source(k: int, labels: bool = False) -> Any:
                import torch

                reps = -(-k // pool.shape[0])
                images = pool.repeat(reps, 1, 1, 1)[:k].clone()
                if not labels:
                    return images
                # the checks test the contract, not accuracy: labels cycle over the classes
                return images, torch.arange(k) % classifier.num_classes

            report.checks += method_checks(obj, classifier, s.images, source=source)
    return report


def _loaded(kind: str, obj: Any) -> str:
    if kind == "method":
        fields = [f.name for f in dataclasses.fields(obj.Config)]
        return f"a Method subclass, Config fields: {', '.join(fields) or 'none'}"
    try:
        return f"{getattr(obj, '__name__', type(obj).__name__)}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        return repr(obj)


def _validate_metric(name: str) -> Report:
    from tta_bench.metrics import METRICS

    reg = registry("metrics")
    names = sorted({*reg.names(), *METRICS})
    if name not in names:
        raise UnknownNameError("metrics", name, names)
    if name in METRICS:
        fn, where = METRICS[name], "registered in-process (register_metric)"
    else:
        origin = reg.origin(name)
        where = f"{origin.value} from {origin.distribution} {origin.version}"
        fn = None
    report = Report("metric", name, where)
    try:
        fn = fn if fn is not None else reg.get(name)
    except RegistryError as exc:
        report.checks.append(Check("loads and passes the load-time checks", FAIL, str(exc)))
        return report
    report.checks.append(
        Check("loads and passes the load-time checks", PASS, _loaded("metric", fn))
    )
    report.checks += metric_checks(fn)
    return report
