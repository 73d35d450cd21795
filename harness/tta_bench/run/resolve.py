"""Resolving a run from what a user typed: the composed config and ``RunSpec``, with every
value checked before anything is built (exit status 2 in the CLI, ``ValueError`` in the
Python API). Shared by ``tta-bench run/profile`` and ``tta_bench.evaluate``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tta_bench import catalog
from tta_bench.registry import registry

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from tta_bench.run.spec import RunSpec


class UsageError(ValueError):
    """Bad input from the user: printed without a traceback, exit status 2."""


# -- run -------------------------------------------------------------------------------
def _split_choice(overrides: list[str], key: str) -> tuple[str | None, list[str]]:
    """Pull ``key=value`` (a config-group choice) out of the Hydra overrides."""
    value, rest = None, []
    for o in overrides:
        if o.startswith(f"{key}="):
            value = o.split("=", 1)[1]
        else:
            rest.append(o)
    return value, rest


NO_PLUGINS = (
    "no {kind} are installed: tta-bench is the harness only, and its methods, shifts, "
    "datasets and models come from plugin distributions registered through the "
    "'tta_bench.*' entry points. Install one, e.g. the first plugin from a clone of the "
    "tta-bench repository: pip install -e . (its root), then `tta-bench ls`"
)


def check_cache_budget() -> None:
    """``TTA_BENCH_CACHE_BUDGET_GB`` read once (``tta_bench.run.cache.cache_budget_gb``): a
    bad value is a ``UsageError`` naming it, before anything is composed or built. Every
    run (``resolve_run``) checks it; so do the commands that read the cache without one
    (``env``, ``cache``, ``sweep``)."""
    from tta_bench.run.cache import cache_budget_gb

    try:
        cache_budget_gb()
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _require_plugins(kind: str) -> None:
    if not registry(kind).names():
        raise UsageError(NO_PLUGINS.format(kind=kind))


def _default(name: str) -> str:
    """A default choice (``suite``, ``method``, ``model``) from the catalogues' ``defaults:``
    section; a UsageError when none names it."""
    try:
        return catalog.default(name)
    except catalog.NoDefaultError as exc:
        raise UsageError(f"{exc} (--{name})") from None


def resolve_run(
    method: str | None = None,
    suite: str | None = None,
    model: str | None = None,
    overrides: Sequence[str] = (),
    *,
    output: str | None = None,
    data_dir: str | None = None,
    dataset: str | None = None,
) -> tuple[DictConfig, RunSpec]:
    """``(composed config, RunSpec)`` of a run; bad input raises ``UsageError`` (a
    ``ValueError``) or ``RegistryError`` naming the value, before anything is built.
    ``method``/``suite``/``model``/``dataset`` may also come as ``method=...`` overrides.

    ``dataset`` (instead of a suite): an ad-hoc suite of that registered dataset, with the
    ``dataset.<arg>=VALUE`` overrides as its factory's arguments (``adhoc_dataset_args``)
    and ``tta_bench.run.protocol.ADHOC_DEFAULTS`` where no ``protocol.<field>=`` says otherwise;
    its model defaults to the catalogues' default model."""
    from omegaconf import OmegaConf

    from tta_bench.config import compose

    _require_plugins("methods")
    check_cache_budget()
    overrides = _profile_switches(overrides)
    o_method, overrides = _split_choice(overrides, "method")
    o_model, overrides = _split_choice(overrides, "model")
    o_suite, overrides = _split_choice(overrides, "suite")
    # logger=wandb means logger=[wandb] (Hydra would refuse a bare string for the list)
    overrides = [
        f"logger=[{o.split('=', 1)[1]}]" if o.startswith("logger=") and "[" not in o else o
        for o in overrides
    ]
    method = method or o_method or _default("method")
    suite, model, dataset, adhoc, data_dir, overrides = _choose_suite(
        suite or o_suite, model or o_model, dataset, data_dir, overrides
    )
    if not model:
        raise UsageError(f"suite {suite!r} names no default model; pass --model")
    from tta_bench.config import resolve_method
    from tta_bench.registry import RegistryError

    try:
        method, preset = resolve_method(method)  # unknown names: "did you mean"
    except RegistryError:
        raise
    except ValueError as exc:  # a broken preset file
        raise UsageError(str(exc)) from exc
    registry("models").origin(model)
    _check_override_keys(overrides, method, model)
    extra = [f"suite={suite}"]
    if output:
        extra.append(f"output={output}")
    if data_dir:
        extra.append(f"data_dir={data_dir}")
    try:
        cfg = compose([*overrides, *extra], method=method, model=model, preset=preset)
    except Exception as exc:  # Hydra's composition errors: unknown keys, bad types
        if type(exc).__module__.startswith(("hydra", "omegaconf")):
            raise UsageError(f"bad configuration override: {exc}") from exc
        raise
    OmegaConf.set_struct(cfg, True)
    _check_run_keys(cfg)
    _check_keys("method", method, cfg.method, registry("methods").get(method).Config)
    _check_keys("model", model, cfg.model, None, registry("models").get(model))
    if adhoc is not None:
        define_adhoc_suite(str(dataset), adhoc, model)
    from tta_bench.run.spec import spec_from_config

    try:
        spec = spec_from_config(cfg, method, model, preset)
    except ValueError as exc:  # protocol values (reset policy, severities, ...)
        raise UsageError(str(exc)) from exc
    except Exception as exc:  # the method config failed OmegaConf's validation
        if type(exc).__module__.startswith("omegaconf"):
            raise UsageError(f"bad method configuration: {exc}") from exc
        raise
    return cfg, _finish_spec(spec, dataset, adhoc)


def _profile_switches(overrides: Sequence[str]) -> list[str]:
    """The overrides with a profile's switch (``<switch>=true``) as ``profile=NAME``."""
    from tta_bench.run.profiles import rewrite_switches

    try:
        return rewrite_switches([str(o) for o in overrides])
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _finish_spec(spec: Any, dataset: str | None, adhoc: dict[str, Any] | None) -> Any:
    """What a resolved spec still needs before it is checked: the clean shift of a synthetic
    suite that runs one, the ad-hoc dataset in the record (a new frozen spec); then
    ``_check_spec``. Returns the spec."""
    from tta_bench.run.protocol import CLEAN, register_clean_shift

    if CLEAN in spec.protocol.shifts and spec.protocol.shift_source == "synthetic":
        register_clean_shift()
    if adhoc is not None:  # the resolved config says which data, after the suite's name
        items = list(spec.config.items())
        at = next((i + 1 for i, (k, _) in enumerate(items) if k == "suite"), len(items))
        items.insert(at, ("dataset", {"name": dataset, **adhoc}))
        spec = dataclasses.replace(spec, config=dict(items))
    _check_spec(spec)
    return spec


def _choose_suite(
    suite: str | None,
    model: str | None,
    dataset: str | None,
    data_dir: str | None,
    overrides: list[str],
) -> tuple[str, str | None, str | None, dict[str, Any] | None, str | None, list[str]]:
    """``(suite, model, dataset, ad-hoc dataset args or None, data_dir, other overrides)``:
    the named suite (or the catalogues' default) and its default model, or the ad-hoc
    suite of ``--dataset`` with its ``dataset.<arg>=`` arguments."""
    o_dataset, overrides = _split_choice(overrides, "dataset")
    dataset_args, overrides = split_dataset_args(overrides)
    dataset = dataset or o_dataset
    adhoc: dict[str, Any] | None = None
    if dataset is not None or dataset_args:
        if dataset is None:
            raise UsageError(
                f"dataset.{next(iter(dataset_args))}= is an argument of --dataset NAME (an "
                "ad-hoc suite); give --dataset, or use a suite's own dataset_args"
            )
        if suite:
            raise UsageError(
                f"--dataset {dataset!r} builds its own suite; drop --suite {suite!r} "
                "(or drop --dataset to run the suite)"
            )
        o_dir, overrides = _split_choice(overrides, "data_dir")
        adhoc = adhoc_dataset_args(dataset, dataset_args, data_dir or o_dir)
        data_dir = None  # it is the dataset's argument now, part of the protocol id
        from tta_bench.run.protocol import ADHOC_PREFIX

        suite = ADHOC_PREFIX + dataset
        model = model or _default("model")
    else:
        suite = suite or _default("suite")
        model = model or catalog.suite(suite).get("default_model")
    return suite, model, dataset, adhoc, data_dir, overrides


# -- ad-hoc suites: any registered dataset from the command line ---------------------------
#: ``dataset.path=`` names a factory's ``data_dir`` (unless the factory takes ``path``).
PATH_ALIAS = ("path", "data_dir")


def split_dataset_args(overrides: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """Pull the ``dataset.<arg>=VALUE`` overrides out of the Hydra overrides: ``({arg:
    value}, the other overrides)``, each value parsed with Hydra's grammar (``[a,b]`` a list,
    ``3`` an int, quotes for strings with commas). A sweep (``a,b``) is refused."""
    import re

    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    args: dict[str, Any] = {}
    rest: list[str] = []
    for o in overrides:
        m = re.match(r"^\+{0,2}dataset\.([A-Za-z_]\w*)=(.*)$", o.strip(), re.DOTALL)
        if m is None:
            rest.append(o)
            continue
        key, text = m.groups()
        try:
            parsed = parser.parse_overrides([f"x={text}"])[0]
        except Exception as exc:  # Hydra's grammar errors
            raise UsageError(f"bad value in {o!r}: {exc}") from None
        if parsed.is_sweep_override():
            raise UsageError(f"{o!r}: a dataset argument takes one value, not a sweep")
        args[key] = _plain(parsed.value())
    return args, rest


def _plain(value: Any) -> Any:
    """Hydra's parsed value as plain Python (lists, dicts, str, numbers, bool, None)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def adhoc_dataset_args(
    dataset: str, args: dict[str, Any], data_dir: str | None = None
) -> dict[str, Any]:
    """The factory arguments of an ad-hoc suite of ``dataset``: every key of ``args`` must
    be a keyword of the factory (unknown ones are refused with "did you mean"), ``path``
    names its ``data_dir`` when it takes no ``path`` (``PATH_ALIAS``), ``data_dir``
    (``--data-dir``) fills in the same argument, a folder is made absolute (so it is part of
    the protocol id wherever the run starts), and the factory's required keywords must be
    given."""
    import difflib
    import inspect
    from pathlib import Path

    factory = registry("datasets").get(dataset)  # unknown names: "did you mean"
    params = {
        p.name: p
        for p in inspect.signature(factory).parameters.values()
        if p.kind == p.KEYWORD_ONLY and not p.name.startswith("_")
    }
    alias, target = PATH_ALIAS
    aliased = target in params and alias not in params
    offered = [*([alias] if aliased else []), *params]
    out: dict[str, Any] = {}
    for key, value in args.items():
        name = target if aliased and key == alias else key
        if name not in params:
            close = difflib.get_close_matches(key, offered, n=1)
            hint = f" (did you mean 'dataset.{close[0]}'?)" if close else ""
            raise UsageError(
                f"unknown dataset option 'dataset.{key}'{hint} for {dataset}; {dataset} takes: "
                f"{', '.join(offered) or 'no options'}"
                + (f" (dataset.{alias} is its {target})" if aliased else "")
            )
        if name in out:
            raise UsageError(f"dataset.{alias} and dataset.{target} name the same argument")
        out[name] = value
    if data_dir is not None:
        if target not in params:
            raise UsageError(f"--data-dir {data_dir!r}: dataset {dataset!r} reads no local data")
        given = out.get(target)
        if (
            given is not None
            and Path(str(given)).expanduser().resolve() != Path(data_dir).expanduser().resolve()
        ):
            raise UsageError(
                f"--data-dir {data_dir!r} and dataset.{alias if aliased else target}={given!r} "
                "disagree; give one"
            )
        out[target] = data_dir
    if out.get(target) is not None:
        out[target] = str(Path(str(out[target])).expanduser().resolve())
    missing = [
        n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in out
    ]
    if missing:
        shown = alias if aliased and missing[0] == target else missing[0]
        raise UsageError(
            f"dataset {dataset!r} needs dataset.{shown}=...; it takes: {', '.join(offered)}"
        )
    return out


def define_adhoc_suite(dataset: str, args: dict[str, Any], model: str | None) -> str:
    """Build the dataset once (after its ``check_args``) for its content fingerprint and
    size, and define its ad-hoc suite (``tta_bench.run.protocol.adhoc_suite``); returns the
    suite's name. Missing data or bad arguments are a ``UsageError`` naming the dataset."""
    from tta_bench.run.protocol import ADHOC_PREFIX, adhoc_suite

    if ADHOC_PREFIX + dataset in catalog.catalog()["suites"]:
        raise UsageError(
            f"a catalogue defines a suite named {ADHOC_PREFIX + dataset!r}, the name of "
            f"--dataset {dataset}'s ad-hoc suite; run it with --suite, or rename it"
        )
    factory = registry("datasets").get(dataset)
    check = getattr(factory, "check_args", None)
    try:
        if callable(check):
            check(**args)
        stream = factory(**args)
    except (ValueError, OSError) as exc:  # DataUnavailableError is both
        raise UsageError(f"dataset {dataset}: {exc}") from exc
    except TypeError as exc:  # an argument of the wrong type
        raise UsageError(f"dataset {dataset}: bad argument: {exc}") from exc
    where = args.get(PATH_ALIAS[1])
    about = f"{dataset}{f' at {where}' if where else ''}: {len(stream)} images, "
    about += f"{len(stream.classnames)} classes ({', '.join(stream.classnames[:5])}"
    about += ", ...)" if len(stream.classnames) > 5 else ")"
    return adhoc_suite(
        dataset, args, fingerprint=stream.fingerprint, default_model=model, description=about
    )


def _check_run_keys(cfg: Any) -> None:
    """The run config's own keys, and those of its ``protocol`` and ``loader`` nodes, must be
    fields (``+severities=[6]`` or ``+foo=1`` would otherwise be composed in and ignored)."""
    import dataclasses
    import difflib

    from tta_bench.config import LoaderConfig, ProtocolOverrides, RunConfig

    nodes = {"": RunConfig, "protocol.": ProtocolOverrides, "loader.": LoaderConfig}
    known = {p: [f.name for f in dataclasses.fields(c)] for p, c in nodes.items()}
    dotted = [p + name for p, names in known.items() for name in names if name != "defaults"]
    for prefix, names in known.items():
        node = cfg if not prefix else cfg[prefix[:-1]]
        unknown = [k for k in node if k not in names]
        if unknown:
            key = prefix + str(unknown[0])
            close = difflib.get_close_matches(str(unknown[0]), [d.split(".")[-1] for d in dotted])
            hint = [d for d in dotted if d.split(".")[-1] in close[:1]]
            did = f" (did you mean {hint[0]!r}?)" if hint else ""
            options = [prefix + n for n in names if n != "defaults"]
            where = f"{prefix[:-1]}'s" if prefix else "the run's"
            raise UsageError(f"unknown option {key!r}{did}; {where} options: {', '.join(options)}")


def _check_override_keys(overrides: Sequence[str], method: str, model: str) -> None:
    """``method.x=``/``model.x=`` overrides must name a field, however they are spelled
    (Hydra itself answers a plain unknown key with "use +method.x", which would then be
    refused too): the same message for every spelling, before composing."""
    import re

    from tta_bench.config import factory_config

    kinds = {
        "method": (method, registry("methods").get(method).Config),
        "model": (model, factory_config(model, registry("models").get(model))),
    }
    for override in overrides:
        m = re.match(r"^[+~]*(method|model)\.([A-Za-z_]\w*)", override.strip())
        if m is None:
            continue
        kind, key = m.groups()
        name, config_cls = kinds[kind]
        _check_keys(kind, name, {key: None}, config_cls)


def _check_keys(kind: str, name: str, node: Any, config_cls: Any, factory: Any = None) -> None:
    """Every key of a composed method/model node must be a field of its config (however it
    was spelled: ``method.x=``, ``+method.x=``, ``++method.x=``)."""
    import dataclasses
    import difflib
    import inspect

    if config_cls is not None:
        known = [f.name for f in dataclasses.fields(config_cls)]
    else:
        known = [
            p.name
            for p in inspect.signature(factory).parameters.values()
            if p.kind == p.KEYWORD_ONLY and not p.name.startswith("_")
        ]
    unknown = [k for k in node if k not in known]
    if unknown:
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(str(k), known, n=1)
            hint = f" (did you mean '{kind}.{close[0]}'?)" if close else ""
            hints.append(f"'{kind}.{k}'{hint}")
        raise UsageError(
            f"unknown {kind} option(s) for {name}: {', '.join(hints)}; "
            f"{name} takes: {', '.join(known) or 'no options'}"
        )


def _check_spec(spec: Any) -> None:
    """Values Hydra's types cannot check, before any setup: seeds, device, cache policy,
    components, model arguments, source images, the output path."""
    from tta_bench.run.cache import CACHE_POLICIES
    from tta_bench.run.features import FEATURE_CACHE_POLICIES
    from tta_bench.run.shifted import POLICIES as SHIFT_CACHE_POLICIES
    from tta_bench.run.spec import resolve_device

    if not spec.seeds:
        raise UsageError(
            "seeds=[] names no seed; give at least one seed, e.g. seeds=[0] or [0,1,2]"
        )
    if len(set(spec.seeds)) != len(spec.seeds):
        raise UsageError(f"seeds={spec.seeds} repeats a seed")
    if any(int(s) < 0 for s in spec.seeds):
        raise UsageError(f"seeds={spec.seeds}: seeds are non-negative integers, e.g. [0,1,2]")
    orders = spec.protocol.orders
    if orders and any(int(s) >= orders for s in spec.seeds):
        raise UsageError(
            f"seeds={spec.seeds} with protocol.orders={orders}: the orders are the pinned "
            f"seeds 0..{orders - 1}; leave seeds out, or name some of them (a shard of orders)"
        )
    if spec.feature_cache not in FEATURE_CACHE_POLICIES:
        raise UsageError(
            f"unknown feature_cache policy {spec.feature_cache!r}; available: "
            f"{', '.join(FEATURE_CACHE_POLICIES)}"
        )
    if spec.shift_cache not in SHIFT_CACHE_POLICIES:
        raise UsageError(
            f"unknown shift_cache policy {spec.shift_cache!r}; available: "
            f"{', '.join(SHIFT_CACHE_POLICIES)}"
        )
    if spec.log_samples and int(spec.log_samples_top_k) < 1:
        raise UsageError(
            f"log_samples_top_k={spec.log_samples_top_k}: the per-sample files keep the k >= 1 "
            "most probable classes of each sample, e.g. log_samples_top_k=5"
        )
    try:
        resolve_device(spec.device)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if spec.cache not in CACHE_POLICIES:
        raise UsageError(
            f"unknown cache policy {spec.cache!r}; available: {', '.join(CACHE_POLICIES)}"
        )
    if spec.cache != "never":  # cache=never writes no decoded image: a read-only cache serves
        _check_cache_writable()
    check_components(spec.protocol, spec.method_config)
    factory = registry("models").get(spec.model)
    check = getattr(factory, "check_args", None)
    if callable(check):
        try:
            check(**spec.model_args)
        except (ValueError, TypeError) as exc:  # TypeError: a null or mistyped argument
            raise UsageError(f"model {spec.model}: {exc}") from exc
    _check_dataset_args(spec)
    _warn_unused_data_dir(spec)
    method = registry("methods").get(spec.method)(None, spec.method_config)
    needed = method.source_images_needed()
    if needed and spec.protocol.source is None:
        raise UsageError(
            f"method {spec.method!r} needs {needed} clean source-domain images, but suite "
            f"{spec.protocol.name!r} declares no source split (`source:` in its registry.yaml)"
        )
    if needed and method.needs_source_labels:
        from tta_bench.run.inputs import check_labelled_source

        try:
            check_labelled_source(spec.protocol, spec.method)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc


def _check_cache_writable() -> None:
    """The cache directory (decoded images, text heads) must be one this process can write
    in: a read-only ``TTA_BENCH_CACHE`` would fail later, inside a loader worker."""
    import os
    import tempfile
    from pathlib import Path

    from tta_bench.paths import cache_dir

    path = Path(os.environ.get("TTA_BENCH_CACHE") or "")
    try:
        path = cache_dir()  # creates it
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        path = Path(exc.filename) if exc.filename and not str(path) else path
        raise UsageError(
            f"cache directory {str(path)!r} is not writable ({exc.strerror or exc}); set "
            f"TTA_BENCH_CACHE to a writable folder"
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"cache directory {str(path)!r} is not writable; set TTA_BENCH_CACHE")


def _warn_unused_data_dir(spec: Any) -> None:
    """``--data-dir`` given to a suite none of whose datasets reads local data: say so."""
    import inspect
    import logging

    if spec.data_dir is None:
        return
    protocol = spec.protocol
    datasets = [protocol.dataset]
    if protocol.source is not None:
        datasets.append(protocol.source.get("dataset") or protocol.dataset)
    reads = [
        "data_dir" in inspect.signature(registry("datasets").get(d)).parameters for d in datasets
    ]
    if not any(reads):
        logging.getLogger("tta_bench").warning(
            f"--data-dir {spec.data_dir!r} is ignored: suite {protocol.name!r} (dataset "
            f"{protocol.dataset!r}) reads no local data"
        )


def _check_dataset_args(spec: Any) -> None:
    """The dataset factory's cheap ``check_args`` (files exist, arguments valid), when it
    has one, for every domain the run needs: missing data fails before the model is built."""
    import inspect

    protocol = spec.protocol
    factory = registry("datasets").get(protocol.dataset)
    check = getattr(factory, "check_args", None)
    if not callable(check):
        return
    kwargs = dict(protocol.dataset_args)
    if spec.data_dir is not None and "data_dir" in inspect.signature(factory).parameters:
        kwargs["data_dir"] = spec.data_dir
    domains = [(None, None)]
    if protocol.shift_source == "dataset":
        domains = [(s, v) for s in protocol.shifts for v in protocol.severities]
    from tta_bench.data import DataUnavailableError

    missing: list[str] = []  # every domain whose data is missing, in one message
    for shift, severity in domains:
        extra = {} if shift is None else {"shift": shift, "severity": severity}
        try:
            check(**kwargs, **extra)
        except DataUnavailableError as exc:
            missing.append(str(exc))
        except ValueError as exc:
            raise UsageError(f"dataset {protocol.dataset}: {exc}") from exc
    if len(missing) == 1:
        raise UsageError(f"dataset {protocol.dataset}: {missing[0]}")
    if missing:
        listed = "\n".join(f"  - {m}" for m in dict.fromkeys(missing))
        raise UsageError(
            f"dataset {protocol.dataset}: the data of {len(missing)} of the suite's "
            f"{len(domains)} domains is missing:\n{listed}"
        )


def check_components(protocol: Any, mcfg: Any) -> None:
    """Fail before any work if the suite names unknown components."""
    registry("datasets").origin(protocol.dataset)
    if protocol.shift_source == "synthetic":
        from tta_bench.run.composite import check_shift

        for s in protocol.shifts:
            check_shift(s)
    loss = getattr(mcfg, "loss", None)
    if isinstance(loss, str):
        registry("losses").origin(loss)
