"""Protocols: everything a number depends on, with a stable id
(docs/design.md#protocols-and-the-protocol-id).

A named suite in the catalogue (``registry.yaml``: ``suites:``) is resolved, together with
the run's overrides, into a frozen ``Protocol``. Its ``id`` hashes every field, so results
from different protocols are never compared by accident.

The ``reset`` field names the stream policy: when the method is reset *and* in which order
the samples arrive. ``tta_bench.run.stream.build_stream(protocol, seed, ...)`` turns a protocol
into the ordered batches every method sees. Independent policies (each cell can run alone,
so sweeps and resume work per cell) and stateful ones (a seed's cells depend on each other,
so they run, and resume, per seed) are listed in ``STATEFUL``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from tta_bench import catalog

#: When the harness calls ``method.reset()``.
RESET_POLICIES = {
    "episodic_batch": "reset after every batch",
    "episodic_sample": "batch size 1, reset after every sample",
    "reset_each_shift": "reset at the start of every (shift, severity) cell; online inside it",
    "continual": "all cells in the pinned order, never reset",
    "gradual": "per shift, severity rises 1..5 then falls back to 1; all shifts in the pinned "
    "order, never reset",
    "mixed_domains": "all (shift, severity) domains shuffled into one stream, never reset",
    "non_iid": "reset at the start of every cell; inside it the label order is temporally "
    "correlated, drawn with a Dirichlet(dirichlet_delta) per class over time slots",
    "label_shift": "reset at the start of every cell; each batch holds at most "
    "classes_per_batch classes, drawn per batch; every sample of the cell once",
    "imbalanced": "reset at the start of every cell; the cell keeps a long-tailed subset of "
    "its samples (largest/smallest class imbalance_ratio), shuffled",
    "correlated": "continual, each cell's samples sorted by class label (with dirichlet_delta: "
    "a Dirichlet(dirichlet_delta) label order instead)",
    "gradual_correlated": "gradual, each visit's samples sorted by class label (or a "
    "Dirichlet(dirichlet_delta) label order)",
    "mixed_domains_correlated": "mixed_domains, the whole stream sorted by class label (or a "
    "Dirichlet(dirichlet_delta) label order), domains mixed within each class",
}
#: The class-sorted policies (the reference harness's ``*_correlated`` settings) and the
#: policy whose order of domains and resets each one keeps.
CORRELATED = {
    "correlated": "continual",
    "gradual_correlated": "gradual",
    "mixed_domains_correlated": "mixed_domains",
}
#: Policies whose cells within a seed depend on each other: run and resumed per seed.
STATEFUL = frozenset({"continual", "gradual", "mixed_domains", *CORRELATED})
SHIFT_SOURCES = ("synthetic", "dataset")
#: Fields left out of the id while None (``Protocol.identity``).
OPTIONAL_IN_ID = (
    "dirichlet_delta",
    "classes_per_batch",
    "imbalance_ratio",
    "source",
    "data_fingerprint",
    "ood",
    "severity_table",
    "templates",
    "orders",
    "realtime",
    "text_head",
    "prompts",
)


@dataclass(frozen=True)
class Protocol:
    name: str
    version: int
    dataset: str
    dataset_args: dict[str, Any]
    shifts: tuple[str, ...]
    severities: tuple[int, ...]
    batch_size: int
    reset: str
    #: ``synthetic``: shift kernels corrupt the clean split on the fly; ``dataset``: the
    #: dataset factory serves each (shift, severity) domain itself (a corrupted set on disk,
    #: a natural-shift set).
    shift_source: str = "synthetic"
    #: Severity parameter table for synthetic shifts, by name: one of the shift kernels'
    #: tables (e.g. one for 32 px and one for 224 px images); None: the kernels' own
    #: default, and no ``table`` argument is passed. Part of the id when set.
    severity_table: str | None = None
    max_images: int | None = None
    #: Concentration of the per-class Dirichlet over time slots (``non_iid`` only): small
    #: values put each class into few consecutive batches (strongly non-i.i.d.).
    dirichlet_delta: float | None = None
    #: Classes per batch (``label_shift`` only): each batch holds at most this many classes,
    #: drawn per batch (``tta_bench.run.stream.label_shift_batches``). Part of the id when set.
    classes_per_batch: int | None = None
    #: Largest over smallest class share (``imbalanced`` only, > 1): the cell keeps a
    #: long-tailed subset of each domain (``tta_bench.run.stream.imbalanced_subset``). Part of
    #: the id when set.
    imbalance_ratio: float | None = None
    #: The text head every method starts from: prompt templates (one '{}' each), resolved
    #: from the suite's ``templates`` (a catalogue template set or a list) or else the
    #: dataset's catalogue entry. Part of the id.
    templates: tuple[str, ...] | None = None
    #: The clean source split that methods estimating source statistics draw unlabeled
    #: images from (EATA's Fisher): ``{dataset, dataset_args}``; part of the id when set.
    source: dict[str, Any] | None = None
    #: An identity of the data itself: an ad-hoc suite (``tta-bench run --dataset``) holds
    #: its dataset's content fingerprint, so two folders never share an id. Part of the id
    #: when set.
    data_fingerprint: str | None = None
    default_model: str | None = None
    #: Open-set evaluation (``tta_bench.run.openset``): ``{dataset, dataset_args, ratio, seed,
    #: score}`` of an out-of-distribution set mixed into every test split; part of the id
    #: when set.
    ood: dict[str, Any] | None = None
    #: N stream orders per cell (``tta_bench.run.orders``): the run's seeds are the pinned
    #: list 0..N-1, each the order and method seed of one replicate, while every order sees
    #: the same corrupted images (the shift noise is seeded by ``noise_seed``, not by the
    #: order); None: one order per seed, each seed its own noise. Part of the id when set.
    orders: int | None = None
    #: The compute-matched track (``tta_bench.run.realtime``): the stream reveals one batch
    #: per unit of the reference's cost; a method whose step costs k units adapts on one
    #: batch in k and predicts the others with its current state. Part of the id when set.
    realtime: bool | None = None
    #: The prompt mode of the text head (``tta_bench.prompts``): None (templates), ``cupl``
    #: (the per-class sentences of ``prompts_file``) or ``all`` (templates and sentences).
    #: Part of the id when set.
    text_head: str | None = None
    #: The sentences file's ``tta_bench.prompts.identity`` (content digest and counts), set
    #: with ``text_head``; part of the id. Its path (``prompts_file``) is not: where a file
    #: lives changes no number.
    prompts: dict[str, Any] | None = None
    prompts_file: str | None = field(default=None, compare=False)
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.reset not in RESET_POLICIES:
            raise ValueError(
                f"unknown reset policy {self.reset!r} in suite {self.name!r}; "
                f"available: {', '.join(RESET_POLICIES)}"
            )
        if self.shift_source not in SHIFT_SOURCES:
            raise ValueError(
                f"unknown shift_source {self.shift_source!r}; expected one of {SHIFT_SOURCES}"
            )
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.reset == "episodic_sample" and self.batch_size != 1:
            raise ValueError("reset policy 'episodic_sample' needs batch_size 1")
        bad = [s for s in self.severities if not 1 <= int(s) <= 5]
        if bad:
            raise ValueError(f"severities must be in 1..5, got {bad}")
        if not self.shifts:
            raise ValueError(f"suite {self.name!r} names no shifts")
        if self.ood is not None:
            from tta_bench.run.openset import check_ood

            object.__setattr__(self, "ood", check_ood(self.ood))
        if self.orders is not None and not (isinstance(self.orders, int) and self.orders >= 2):
            raise ValueError(
                f"orders={self.orders!r}: the number of stream orders per cell is an integer "
                ">= 2 (e.g. protocol.orders=100), or null for one order per seed"
            )
        from tta_bench.prompts import check_head

        object.__setattr__(self, "text_head", check_head(self.text_head, self.prompts_file))
        if self.text_head is not None and not self.prompts:
            raise ValueError(f"protocol.text_head={self.text_head} needs the prompts' identity")
        if self.realtime is False:  # the default track: left out of the id as None
            object.__setattr__(self, "realtime", None)
        if self.max_images is not None and self.max_images < 1:
            raise ValueError(f"max_images must be >= 1 or null, got {self.max_images}")
        if self.reset == "non_iid":
            if self.dirichlet_delta is None or not self.dirichlet_delta > 0:
                raise ValueError(
                    "reset policy 'non_iid' needs dirichlet_delta > 0 "
                    f"(e.g. protocol.dirichlet_delta=0.1), got {self.dirichlet_delta!r}"
                )
        elif self.reset in CORRELATED:
            delta = self.dirichlet_delta
            if delta is not None and not (isinstance(delta, (int, float)) and 0 < delta < math.inf):
                raise ValueError(
                    f"reset policy {self.reset!r} takes dirichlet_delta > 0 (a Dirichlet label "
                    f"order, e.g. 0.01) or null (sorted by class label), got {delta!r}"
                )
        elif self.dirichlet_delta is not None:
            raise ValueError(
                f"dirichlet_delta={self.dirichlet_delta} only applies to reset policies "
                f"'non_iid', {', '.join(repr(c) for c in CORRELATED)}, not {self.reset!r}"
            )
        self._check_label_shift_fields()

    def _check_label_shift_fields(self) -> None:
        """``classes_per_batch`` (an integer >= 1) set exactly with ``label_shift``,
        ``imbalance_ratio`` (a finite number > 1) exactly with ``imbalanced``; a
        ``ValueError`` naming the value otherwise. Whether ``classes_per_batch`` fits a
        domain's number of classes is checked when its stream is built."""
        k, ratio = self.classes_per_batch, self.imbalance_ratio
        if self.reset == "label_shift":
            if not (isinstance(k, int) and not isinstance(k, bool) and k >= 1):
                raise ValueError(
                    "reset policy 'label_shift' needs classes_per_batch, an integer >= 1 "
                    f"(e.g. protocol.classes_per_batch=3), got {k!r}"
                )
        elif k is not None:
            raise ValueError(
                f"classes_per_batch={k} only applies to reset policy 'label_shift', "
                f"not {self.reset!r}"
            )
        if self.reset == "imbalanced":
            if not (isinstance(ratio, (int, float)) and 1 < ratio < math.inf):
                raise ValueError(
                    "reset policy 'imbalanced' needs imbalance_ratio, a finite number > 1 "
                    f"(e.g. protocol.imbalance_ratio=10), got {ratio!r}"
                )
        elif ratio is not None:
            raise ValueError(
                f"imbalance_ratio={ratio} only applies to reset policy 'imbalanced', "
                f"not {self.reset!r}"
            )

    def domain_datasets(self) -> list[str]:
        """The datasets the domains are: each shift of a suite whose dataset serves
        registered datasets as its domains (its catalogue entry lists them as
        ``domains:``), else the protocol's dataset alone."""
        domains = catalog.entry("datasets", self.dataset).get("domains")
        if self.shift_source == "dataset" and domains:
            return [s for s in self.shifts if s in domains]
        return [self.dataset]

    @property
    def stateful(self) -> bool:
        """True when a seed's cells depend on each other (no reset between them)."""
        return self.reset in STATEFUL

    @property
    def order_policy(self) -> str:
        """The policy whose order of domains and resets the stream follows: the policy
        itself, or for a class-sorted one (``CORRELATED``) the policy it sorts."""
        return CORRELATED.get(self.reset, self.reset)

    def identity(self) -> dict[str, Any]:
        """Every field a number depends on (what the id hashes)."""
        data = asdict(self)
        data.pop("description")
        data.pop("default_model")
        data.pop("prompts_file")
        # Each optional field is absent unless set, so the ids of protocols from before the
        # field existed hold.
        for name in OPTIONAL_IN_ID:
            if data[name] is None:
                data.pop(name)
        if "templates" in data:
            data["templates"] = list(data["templates"])
        return data

    @property
    def id(self) -> str:
        """``<suite>@v<version>-<policy>[-d<delta>|-k<classes>|-r<ratio>]-bs<batch>
        [-ood<ratio>][-o<orders>][-rt][-cupl|-all]-<digest of identity()>``."""
        blob = json.dumps(self.identity(), sort_keys=True, default=list)
        digest = hashlib.sha256(blob.encode()).hexdigest()[:10]
        policy = self.reset
        if self.dirichlet_delta is not None:  # non_iid, or a Dirichlet-ordered correlated
            policy += f"-d{self.dirichlet_delta:g}"
        elif self.reset == "label_shift":
            policy += f"-k{self.classes_per_batch}"
        elif self.reset == "imbalanced":
            policy += f"-r{self.imbalance_ratio:g}"
        ood = f"-ood{self.ood['ratio']:g}" if self.ood is not None else ""
        extra = (f"-o{self.orders}" if self.orders else "") + ("-rt" if self.realtime else "")
        extra += f"-{self.text_head}" if self.text_head else ""
        return f"{self.name}@v{self.version}-{policy}-bs{self.batch_size}{ood}{extra}-{digest}"

    def noise_seed(self, seed: int) -> int:
        """The seed of the shift noise of replicate ``seed``: the seed itself, or 0 for every
        order of a protocol with ``orders`` (the orders differ in order and method seed
        only, so their images, and their image features, are the same)."""
        return 0 if self.orders else int(seed)

    def default_seeds(self) -> list[int]:
        """The seeds a run uses when it names none: 0, 1, 2, or 0..orders-1."""
        return list(range(self.orders)) if self.orders else [0, 1, 2]


PROTOCOL_FIELDS = {f.name for f in fields(Protocol)}
#: Fields a run may override (the override changes the protocol id).
OVERRIDABLE = (
    "templates",
    "text_head",
    "prompts",
    "orders",
    "realtime",
    "shifts",
    "severities",
    "batch_size",
    "reset",
    "max_images",
    "severity_table",
    "dirichlet_delta",
    "classes_per_batch",
    "imbalance_ratio",
    "ood_dataset",
    "ood_dataset_args",
    "ood_ratio",
    "ood_seed",
    "ood_score",
    "ood_repeat",
)
#: ``protocol.ood_<key>=`` overrides -> the key of ``Protocol.ood`` they set.
OOD_OVERRIDES = {
    f"ood_{k}": k for k in ("dataset", "dataset_args", "ratio", "seed", "score", "repeat")
}


#: The shift of a clean domain: the images as they are (an ad-hoc suite's default, when no
#: ``protocol.shifts`` are given). The harness registers it in-process when a protocol
#: names it (``register_clean_shift``); a plugin cannot register this name as well.
CLEAN = "clean"
#: The name prefix of ad-hoc suites: ``adhoc-<dataset>``.
ADHOC_PREFIX = "adhoc-"
#: What an ad-hoc suite uses where its run names nothing (``protocol.<field>=`` overrides).
ADHOC_DEFAULTS: dict[str, Any] = {
    "version": 1,
    "shifts": [CLEAN],
    "severities": [1],
    "batch_size": 64,
    "reset": "reset_each_shift",
}
#: Ad-hoc suites defined in this process (``adhoc_suite``), found by ``load_protocol``.
_ADHOC: dict[str, dict[str, Any]] = {}


def clean(images: Any, severity: int, *, generator: Any) -> Any:
    """The clean domain's shift: ``images`` unchanged (``severity`` and ``generator``
    unused)."""
    return images


def register_clean_shift() -> None:
    """Register ``clean`` (``CLEAN``) in this process's shift registry, once, as the
    harness's own (distribution ``tta-bench``); a plugin's shift of that name is an error."""
    from tta_bench._version import __version__
    from tta_bench.registry import RegistryError, registry

    shifts = registry("shifts")
    if CLEAN in shifts:
        origin = shifts.origin(CLEAN)
        if origin.value != f"{__name__}:clean":
            raise RegistryError(
                f"shift name {CLEAN!r} is the harness's clean domain, but {origin.value} (from "
                f"{origin.distribution}) registers it too; rename that shift"
            )
        return
    shifts.add(CLEAN, clean, distribution="tta-bench", version=__version__)


def adhoc_suite(
    dataset: str,
    dataset_args: dict[str, Any],
    *,
    fingerprint: str,
    default_model: str | None,
    description: str = "",
) -> str:
    """Define the ad-hoc suite of ``dataset`` with ``dataset_args`` in this process and
    return its name, ``adhoc-<dataset>``: ``ADHOC_DEFAULTS`` (the clean images, batch size
    64, ``reset_each_shift``), ``fingerprint`` (the dataset's own content fingerprint) as
    ``data_fingerprint``. The id hashes the dataset, its arguments (a folder's absolute path
    among them) and the fingerprint, so two folders never share an id; ``load_protocol``
    applies a run's ``protocol.<field>=`` overrides as for any suite. A later definition of
    the same dataset replaces the earlier one."""
    name = ADHOC_PREFIX + dataset
    _ADHOC[name] = {
        **ADHOC_DEFAULTS,
        "description": description or f"ad-hoc suite of dataset {dataset!r}",
        "dataset": dataset,
        "dataset_args": dict(dataset_args),
        "data_fingerprint": fingerprint,
        "default_model": default_model,
    }
    return name


def load_protocol(suite: str, **overrides: Any) -> Protocol:
    """Resolve a named suite from the catalogue (or an ad-hoc suite of this process,
    ``adhoc_suite``), applying non-None overrides."""
    if suite in _ADHOC and suite not in catalog.catalog()["suites"]:
        spec = copy.deepcopy(_ADHOC[suite])
    else:
        spec = catalog.suite(suite)
    unknown = set(spec) - PROTOCOL_FIELDS
    if unknown:
        raise ValueError(
            f"suite {suite!r} in the catalogue has unknown fields {sorted(unknown)}; "
            f"known: {sorted(PROTOCOL_FIELDS)}"
        )
    ood = dict(spec.get("ood") or {})
    for key, value in overrides.items():
        if key not in OVERRIDABLE:
            raise ValueError(f"cannot override {key!r}; overridable: {', '.join(OVERRIDABLE)}")
        if value is not None and key in OOD_OVERRIDES:
            ood[OOD_OVERRIDES[key]] = value
        elif value is not None:
            spec[key] = value
    if ood:
        if "dataset" not in ood:
            given = ", ".join(
                f"protocol.{k}" for k in OOD_OVERRIDES if overrides.get(k) is not None
            )
            raise ValueError(
                f"{given} set without an OOD set: name it with protocol.ood_dataset=<dataset>"
            )
        from tta_bench.registry import registry
        from tta_bench.run.openset import check_ood

        spec["ood"] = check_ood(ood, known_datasets=registry("datasets").names())
    if suite in _ADHOC and overrides.get("shifts") and overrides.get("severities") is None:
        spec["severities"] = None  # the run's own shifts: the suites' default severity (5)
    spec["name"] = suite
    spec.setdefault("version", 1)
    spec.setdefault("dataset_args", {})
    spec["dataset_args"] = dict(spec["dataset_args"] or {})
    spec["shifts"] = tuple(spec.get("shifts") or ())
    spec["severities"] = tuple(int(s) for s in spec.get("severities") or (5,))
    if spec.get("dirichlet_delta") is not None:
        spec["dirichlet_delta"] = float(spec["dirichlet_delta"])
    if spec.get("imbalance_ratio") is not None:
        spec["imbalance_ratio"] = float(spec["imbalance_ratio"])
    if spec.get("reset") == "episodic_sample":
        spec["batch_size"] = 1
    given = spec.get("templates")
    if given is None:  # a suite may name its head through the dataset's arguments
        given = spec["dataset_args"].get("templates")
    spec["templates"] = _protocol_templates(given, spec.get("dataset"), suite)
    if isinstance(spec.get("prompts"), str):  # a file: its content identity, kept apart
        from tta_bench.prompts import identity, load_class_prompts

        spec["prompts_file"] = str(Path(spec["prompts"]).expanduser().resolve())
        spec["prompts"] = identity(load_class_prompts(spec["prompts"]))
    return Protocol(**spec)


def _protocol_templates(value: Any, dataset: str | None, suite: str) -> tuple[str, ...] | None:
    """The protocol's prompt templates: ``value`` (a catalogue template-set name or a list of
    format strings: the suite's ``templates``, else its ``dataset_args.templates``), else
    the dataset's catalogue ``templates`` (same forms); None when none names any (the
    dataset's own stream then supplies them)."""
    if value is None and dataset is not None:
        value = catalog.entry("datasets", dataset).get("templates")
    if value is None:
        return None
    from tta_bench.text_head import resolve_templates as resolve

    return tuple(resolve(value, owner=f"suite {suite!r}"))
