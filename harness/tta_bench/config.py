"""Run configuration: Hydra structured configs composed from the registered components.

Every registered method contributes its ``Config`` dataclass as the config group
``method/<name>``; every model factory contributes ``model/<name>`` built from its
keyword-only parameters. Plugins may add Hydra config packages (``tta_bench.configs``),
which are put on the search path. Overrides use Hydra's grammar
(``method.lr=1e-3 seeds=[0,1,2]``); unknown keys are errors.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib.util
import inspect
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from tta_bench.bounds import bounded, one_of
from tta_bench.registry import registry


@dataclass
class ProtocolOverrides:
    """Changes to the suite's protocol; each one changes the protocol id."""

    #: The text head: a catalogue template set (``tta-bench ls templates``) or a list.
    templates: Optional[Any] = None
    #: The prompt mode (``tta_bench.prompts``): templates (default) | cupl | all; the last two
    #: read ``prompts``, a JSON file of class name -> sentences (CuPL's format). Part of the id.
    text_head: Optional[str] = None
    prompts: Optional[str] = None
    shifts: Optional[list[str]] = None
    severities: Optional[list[int]] = bounded(None, ge=1)
    batch_size: Optional[int] = bounded(None, ge=1)
    reset: Optional[str] = None
    max_images: Optional[int] = bounded(None, ge=1)
    severity_table: Optional[str] = None
    #: ``non_iid`` (needed) and the class-sorted policies (optional): Dirichlet concentration
    #: of the label order (part of the id).
    dirichlet_delta: Optional[float] = bounded(None, gt=0)
    #: ``label_shift`` only: the most classes a batch holds, drawn per batch (part of the id).
    classes_per_batch: Optional[int] = bounded(None, ge=1)
    #: ``imbalanced`` only: largest over smallest class share of the kept long-tailed subset
    #: (part of the id).
    imbalance_ratio: Optional[float] = bounded(None, gt=1)
    #: N stream orders per cell, replicates 0..N-1 sharing one corrupted image set
    #: (``tta_bench.run.orders``; part of the id).
    orders: Optional[int] = bounded(None, ge=2)
    #: The compute-matched track (``tta_bench.run.realtime``; part of the id).
    realtime: Optional[bool] = None
    #: ``INDEX/COUNT``: run only part INDEX of COUNT of every cell (the batches whose number
    #: is INDEX mod COUNT), for reset policies episodic_batch/episodic_sample only; the parts
    #: are combined exactly by ``tta-bench merge`` (``tta_bench.run.shard``). Not part of the id.
    shard: Optional[str] = None
    #: Open-set evaluation (``tta_bench.run.openset``): an out-of-distribution dataset mixed into
    #: every test split (its labels never reach the method), its arguments, its share of the
    #: stream in (0, 1), the seed choosing its images, the OOD score (msp | energy), and
    #: whether a set too small for the ratio is repeated. Part of the id.
    ood_dataset: Optional[str] = None
    ood_dataset_args: Optional[Any] = None
    ood_ratio: Optional[float] = bounded(None, gt=0, lt=1)
    ood_seed: Optional[int] = None
    ood_score: Optional[str] = None
    #: True: an OOD set smaller than the ratio asks is repeated (ZS-NTTA's noisy streams)
    ood_repeat: Optional[bool] = None


@dataclass
class LoaderConfig:
    """DataLoader settings (``tta_bench.run.loader``); ``null`` = chosen for the device.

    Defaults: no worker processes on the CPU, up to 4 on an accelerator; pinned memory on
    CUDA only; prefetch factor 2 with workers; no persistent workers (one pass per run).
    These never change results, only speed.
    """

    num_workers: Optional[int] = bounded(None, ge=0)
    pin_memory: Optional[bool] = None
    prefetch_factor: Optional[int] = bounded(None, ge=1)
    persistent_workers: Optional[bool] = None


@dataclass
class RunConfig:
    """A run's config; ``run_config()`` fills the default method, model and suite in from
    the catalogues' ``defaults:`` section (the harness itself names none)."""

    defaults: list[Any] = field(
        default_factory=lambda: ["_self_", {"method": MISSING}, {"model": MISSING}]
    )
    method: Any = MISSING
    model: Any = MISSING
    suite: str = MISSING
    #: The replicates: by default three seeds (the mean over seeds with its 95% interval,
    #: from one plain `run`), or 0..N-1 with ``protocol.orders=N``.
    seeds: Optional[list[int]] = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    #: Results JSON path; default: a timestamped file under ``results_dir``.
    output: Optional[str] = None
    results_dir: str = "tta-results"
    #: Root of local data for hub-backed datasets (see ``tta-bench ls datasets``).
    data_dir: Optional[str] = None
    #: Also score the frozen source model on the identical stream (the table's delta column).
    reference: bool = True
    progress: bool = True
    #: JSONL path for a per-batch log (loss, accuracy before/after adaptation, time, memory).
    batch_log: Optional[str] = None
    #: Also record each cell's accuracy per class.
    per_class_accuracy: bool = False
    #: Per-sample outputs beside the results file (``<stem>.samples/``, one Parquet file
    #: per cell; ``tta_bench.run.samples``): auto (the default: as true, except when resuming
    #: an output whose finished cells have none, which stays without), false, true (label,
    #: prediction, top-k classes and probabilities: what ``tta-bench compare`` pairs) or
    #: logits (also the full logits, which ``tta-bench rescore`` needs).
    log_samples: Any = "auto"
    #: Classes listed per sample with ``log_samples``.
    log_samples_top_k: int = bounded(5, ge=1)
    #: Experiment trackers that receive the run as it goes (``tta_bench.run.trackers``): any of
    #: wandb, mlflow, tensorboard; none by default (no tracker is imported unless chosen).
    logger: list[str] = field(default_factory=list)
    #: Count FLOPs per sample (torch.utils.flop_counter) on each cell's first batch.
    flops: bool = False
    protocol: ProtocolOverrides = field(default_factory=ProtocolOverrides)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    #: Skip the cells already in ``output`` when it exists and holds the same run
    #: (model, method + config hash, protocol id); false starts the file afresh.
    resume: bool = True
    #: A protocol profile from the catalogues' ``profiles:`` section (``tta_bench.run.profiles``;
    #: ``tta-bench ls profiles``): the way another benchmark runs methods, applied where the
    #: run does not set a value itself. None: the suite's protocol and the official settings.
    profile: Optional[str] = None
    #: Decoded-image cache: auto (reuse entries; cache small splits, stream large ones),
    #: always (decode whole splits into the cache first) or never (decode on demand).
    cache: str = "auto"
    #: Image-feature cache of a method that reads its images only through their features
    #: (``Method.features_only``; ``tta_bench.run.features``): auto (on with
    #: ``protocol.orders``: each image is encoded once and every order replays the features)
    #: or never. Results are identical either way.
    feature_cache: str = one_of("auto", ("auto", "never"))
    #: Shifted-image cache (``tta_bench.run.shifted``): auto (on the CPU, each synthetic
    #: domain's corrupted images are computed once, into the cache, then read by every
    #: batch and every later run), always (on any device) or never (the shift kernels run
    #: in the loop). Results are identical either way.
    shift_cache: str = one_of("auto", ("auto", "always", "never"))


def _simple_type(default: Any) -> Any:
    for t in (bool, int, float, str):
        if type(default) is t:
            return t
    return Any


@functools.cache
def factory_config(name: str, factory: Any) -> type:
    """A dataclass of a factory's keyword-only parameters (those with defaults), one per
    registered factory (``_store`` compares it with what it stored)."""
    specs = []
    for p in inspect.signature(factory).parameters.values():
        if p.kind != p.KEYWORD_ONLY or p.name.startswith("_"):
            continue
        if p.default is inspect.Parameter.empty:
            continue
        default = p.default
        if isinstance(default, (list, tuple, dict)):
            specs.append((p.name, Any, field(default_factory=lambda d=default: d)))
        else:
            specs.append((p.name, Optional[_simple_type(default)], field(default=default)))
    return dataclasses.make_dataclass(f"{name.replace('-', '_')}_config", specs)


def run_config() -> RunConfig:
    """``RunConfig`` with the catalogues' default method, model and suite; a choice no
    catalogue names stays mandatory (Hydra asks for it)."""
    from tta_bench import catalog

    def pick(name: str) -> str:
        return catalog.default_or_none(name) or MISSING

    return RunConfig(
        defaults=["_self_", {"method": pick("method")}, {"model": pick("model")}],
        suite=pick("suite"),
    )


#: One composition at a time: ``compose`` sets Hydra's global state and narrows the config
#: store for its duration (a service's threads, a notebook's).
_COMPOSING = threading.RLock()


def _register(method_names: list[str], model_names: list[str]) -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    with _COMPOSING:  # never into a store a composition has narrowed
        _store(cs, None, "tta_bench_run", run_config())
        for name in method_names:
            _store(cs, "method", name, registry("methods").get(name).Config)
        for name in model_names:
            factory = registry("models").get(name)
            _store(cs, "model", name, factory_config(name, factory))


#: (group, name) -> (the node this module stored there, the ConfigNode Hydra made of it)
_STORED: dict[tuple[str | None, str], tuple[Any, Any]] = {}


def _store(cs: Any, group: str | None, name: str, node: Any) -> None:
    """``cs.store(group=group, name=name, node=node)`` unless the store still holds what
    this module stored there from an equal node: Hydra turns every node it stores into an
    OmegaConf config, and each run composes once."""

    def held() -> Any:
        return (cs.repo.get(group, {}) if group else cs.repo).get(f"{name}.yaml")

    before = _STORED.get((group, name))
    if before is not None and held() is before[1] and (before[0] is node or before[0] == node):
        return
    cs.store(group=group, name=name, node=node)
    _STORED[(group, name)] = (node, held())


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named method preset: a YAML file ``method/<name>.yaml`` in a plugin's Hydra config
    package whose defaults list starts with the method it configures, e.g.::

        # my-preset: my-method with a larger learning rate and more steps
        defaults:
          - my-method
          - _self_
        lr: 0.02
        steps: 5

    The first comment line (after ``<name>:``) is its description."""

    name: str
    method: str
    description: str
    package: str
    distribution: str


def presets() -> dict[str, Preset]:
    """Every method preset of the installed config packages (reads YAML only: no torch)."""
    from pathlib import Path

    import yaml

    out: dict[str, Preset] = {}
    configs = registry("configs")
    for name in configs.names():
        origin = configs.origin(name)
        package = origin.value.split(":")[0]
        for folder in _folders(package):
            for path in sorted(Path(folder, "method").glob("*.yaml")):
                text = path.read_text(encoding="utf-8")
                data = yaml.safe_load(text) or {}
                defaults = data.get("defaults") or []
                base = next((d for d in defaults if isinstance(d, str) and d != "_self_"), None)
                if base is None:
                    raise ValueError(
                        f"preset {path} must start its defaults list with the method it "
                        "configures (e.g. `defaults: [<method>, _self_]`)"
                    )
                first = next((ln for ln in text.splitlines() if ln.startswith("#")), "#")
                desc = first.lstrip("# ").split(":", 1)[-1].strip()
                out[path.stem] = Preset(path.stem, base, desc, package, origin.distribution)
    return out


def resolve_method(choice: str) -> tuple[str, str | None]:
    """``(registered method, preset or None)`` for a ``method=`` choice; an unknown name
    is an error listing the methods and presets."""
    from tta_bench.registry import UnknownNameError

    methods = registry("methods")
    if choice in methods:
        return choice, None
    found = presets()
    if choice in found:
        base = found[choice].method
        methods.origin(base)  # the preset's method must be installed
        return base, choice
    raise UnknownNameError("methods", choice, [*methods.names(), *found])


def _config_packages() -> list[str]:
    """The plugins' Hydra config packages (``tta_bench.configs`` entry points)."""
    configs = registry("configs")
    return [configs.origin(n).value.split(":")[0] for n in configs.names()]


def _search_path_overrides(packages: Sequence[str] | None = None) -> list[str]:
    """Hydra's search path override for ``packages`` (default: ``_config_packages()``)."""
    paths = [f"pkg://{p}" for p in (_config_packages() if packages is None else packages)]
    if not paths:
        return []
    return [f"hydra.searchpath=[{','.join(paths)}]"]


#: Hydra's own config groups that a composed run config never reads (the logging of a job
#: Hydra runs, the help texts, the output and environment settings of ``hydra.main``):
#: ``compose`` leaves them out of Hydra's defaults list (its ``~group`` deletion): Hydra
#: loads and merges each of them at every composition (docs/speed.md). The run config it
#: returns is the same (``harness/tests/test_config_compose.py``).
UNREAD_HYDRA_GROUPS = (
    "hydra/job_logging", "hydra/hydra_logging", "hydra/help", "hydra/hydra_help",
    "hydra/output", "hydra/env",
)  # fmt: skip


def compose(overrides: list[str], method: str, model: str, preset: str | None = None) -> DictConfig:
    """Compose the run config for ``method`` (with its ``preset``, when given) and
    ``model`` (both already validated)."""
    from hydra import compose as hydra_compose

    names = [o.lstrip("~+").split("=", 1)[0] for o in overrides]
    unread = [f"~{g}" for g in UNREAD_HYDRA_GROUPS if g not in names]
    tail = [f"method={preset or method}", f"model={model}", *unread]

    def composed(lines: list[str]) -> DictConfig:
        with _hydra_without_config_dir():
            return hydra_compose(config_name="tta_bench_run", overrides=lines)

    with _COMPOSING:
        _register([method], [model])
        packages = _config_packages()
        with _store_narrowed_to(method, model):
            return _memoized(_search_path_overrides(packages), overrides, tail, packages, composed)


# -- compositions reused ---------------------------------------------------------------
# Hydra composes a run config in two parts: it builds the defaults list from the config
# group choices (``method=``, ``model=``, ``hydra/...``) and merges the configs it names,
# then applies every other override (``seeds=[0]``, ``suite=...``,
# ``protocol.batch_size=8``, ``+key=...``, ``~key``) to the result in the order given
# (``ConfigLoaderImpl._apply_overrides_to_config``). The first part reads and merges YAML
# and structured configs (~45 ms a run) and depends on the group choices, the config
# store and the config files only. ``compose`` keeps its result per group choice, with
# the store's nodes and the config packages' files it came from, and runs the second part
# itself, with Hydra's own function, on a copy. The config returned and the error a bad
# override raises are Hydra's (``harness/tests/test_compose_memo.py``). Overrides it
# cannot split safely (a sweep, a ``@package``, a line that does not parse) go to Hydra
# whole. The caller holds ``_COMPOSING``.

#: Compositions kept (least recently used dropped first) and override lines kept parsed.
_MAX_BASES = 64
_MAX_PARSED = 4096

#: group-choice key -> (store nodes, config files, the composed config before the rest)
_BASES: OrderedDict[tuple, tuple[tuple, tuple, DictConfig]] = OrderedDict()
_PARSED: dict[str, Any] = {}


def clear_compose_memo() -> None:
    """Forget the compositions kept (a test's fresh start)."""
    _BASES.clear()
    _PARSED.clear()


def _memoized(
    head: Sequence[str],
    overrides: Sequence[str],
    tail: Sequence[str],
    packages: Sequence[str],
    hydra_compose: Callable[[list[str]], DictConfig],
) -> DictConfig:
    """The config ``hydra_compose([*head, *overrides, *tail])`` returns: ``head`` and
    ``tail`` are the harness's own overrides (the search path; the method and model
    choices and the unread Hydra groups' deletions), ``overrides`` the run's, and
    ``packages`` the config packages on the search path. ``hydra_compose`` runs inside
    the caller's Hydra context and narrowed store."""
    folders = [folder for package in packages for folder in _folders(package)]
    split = _split_overrides(overrides, _group_names(folders))
    if split is None:
        return hydra_compose([*head, *overrides, *tail])
    groups, rest = split
    key = (tuple(head), tuple(groups), tuple(tail))
    nodes, files = _store_nodes(), _config_files(folders)
    held = _BASES.get(key)
    if held is None or not _same(held[0], nodes) or held[1] != files:
        base = hydra_compose([*head, *groups, *tail])
        _BASES[key] = held = (nodes, files, base)
        while len(_BASES) > _MAX_BASES:
            _BASES.popitem(last=False)
    _BASES.move_to_end(key)
    return _apply_rest(held[2], rest)


def _apply_rest(base: DictConfig, rest: list[Any]) -> DictConfig:
    """A copy of ``base`` with the config overrides applied as Hydra applies them."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import OmegaConfBaseException

    cfg = copy.deepcopy(base)
    try:
        ConfigLoaderImpl._apply_overrides_to_config(rest, cfg)
    except OmegaConfBaseException as exc:  # as Hydra's load_configuration wraps it
        raise ConfigCompositionException() from exc
    return cfg


def _split_overrides(
    overrides: Sequence[str], known: set[str]
) -> tuple[list[str], list[Any]] | None:
    """``(group and Hydra overrides, the others parsed)`` in their order (``known``: the
    top-level config groups), or None where Hydra must see them whole: a sweep, a
    ``@package``, a line that does not parse."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    groups: list[str] = []
    rest: list[Any] = []
    for line in overrides:
        parsed = _PARSED.get(line)
        if parsed is None:
            try:
                parsed = OverridesParser.create().parse_overrides([line])[0]
            except HydraException:
                return None
            if len(_PARSED) >= _MAX_PARSED:
                _PARSED.clear()
            _PARSED[line] = parsed
        if parsed.is_sweep_override() or parsed.package is not None:
            return None
        name = parsed.key_or_group
        if parsed.is_hydra_override() or name == "hydra" or "/" in name or name in known:
            groups.append(line)
        else:
            rest.append(parsed)
    return groups, rest


def _group_names(folders: Sequence[str]) -> set[str]:
    """The top-level config groups: the store's and the config packages' (``folders``)
    subfolders."""
    from hydra.core.config_store import ConfigStore

    names = {k for k, v in ConfigStore.instance().repo.items() if isinstance(v, dict)}
    for folder in folders:
        with os.scandir(folder) as entries:
            names.update(e.name for e in entries if e.is_dir() and e.name != "__pycache__")
    return names


def _folders(package: str) -> list[str]:
    """The folders of an importable package (none for a module or a missing name)."""
    spec = importlib.util.find_spec(package)
    return list(spec.submodule_search_locations or []) if spec else []


def _store_nodes() -> tuple[tuple[str, ...], tuple[Any, ...]]:
    """The (narrowed) config store's node paths and nodes, compared by identity: storing a
    node again makes a new one."""
    from hydra.core.config_store import ConfigStore

    paths: list[str] = []
    nodes: list[Any] = []

    def walk(tree: dict, prefix: str) -> None:
        for name, value in tree.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{name}/")
            else:
                paths.append(prefix + name)
                nodes.append(value)

    walk(ConfigStore.instance().repo, "")
    return tuple(paths), tuple(nodes)


def _same(held: tuple, now: tuple) -> bool:
    return held[0] == now[0] and all(a is b for a, b in zip(held[1], now[1], strict=True))


def _config_files(folders: Sequence[str]) -> tuple:
    """The config packages' (``folders``) files with their size and modification time: an
    edited preset composes afresh."""
    out = []
    for folder in folders:
        for root, dirs, files in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                st = os.stat(os.path.join(root, name))
                out.append((root, name, st.st_size, st.st_mtime_ns))
    return tuple(out)


@contextlib.contextmanager
def _store_narrowed_to(method: str, model: str) -> Iterator[None]:
    """Hydra's config store without the method and model nodes this module stored for
    other methods and models; restored on exit. Hydra deep-copies the whole store at each
    composition, so in a process that ran many methods (a sweep's, a test session's) every
    composition grew with them. Nodes stored by anyone else stay."""
    from hydra.core.config_store import ConfigStore

    repo = ConfigStore.instance().repo
    keep = {"method": f"{method}.yaml", "model": f"{model}.yaml"}
    saved = {group: repo[group] for group in keep if isinstance(repo.get(group), dict)}
    for group, nodes in saved.items():
        repo[group] = {
            file: node
            for file, node in nodes.items()
            if file == keep[group] or (group, file.removesuffix(".yaml")) not in _STORED
        }
    try:
        yield
    finally:
        repo.update(saved)


def hydra_overrides(
    overrides: list[str], method: str, model: str, preset: str | None = None
) -> list[str]:
    """The overrides ``compose`` hands Hydra: the plugins' config packages on the search
    path, the run's own overrides, then the method (or its preset) and the model."""
    return [*_search_path_overrides(), *overrides, f"method={preset or method}", f"model={model}"]


@contextlib.contextmanager
def _hydra_without_config_dir() -> Iterator[None]:
    """What ``hydra.initialize(config_path=None, version_base="1.3")`` sets up when called
    from this module: Hydra's own configs, the search-path plugins' and the structured
    ones, and no primary config directory; restored on exit. ``initialize`` reads the
    whole call stack (``inspect.stack()``, every frame's source) only to find its caller's
    file, whose directory it then does not use (``config_path=None``); that read grows with
    the stack and the modules loaded (tests: ``harness/tests/test_config_compose.py``)."""
    from hydra import version
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    backup = get_gh_backup()
    version.setbase("1.3")
    try:
        Hydra.create_main_hydra2(
            task_name="config", config_search_path=create_config_search_path(None)
        )
        yield
    finally:
        restore_gh_from_backup(backup)


def method_config(cfg: DictConfig) -> Any:
    """The method's Config dataclass instance from a composed run config."""
    return OmegaConf.to_object(cfg.method)


def to_container(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True, structured_config_mode=None)  # type: ignore[return-value]
