"""Resolving a run from what a user typed: the composed config and ``RunSpec``, with every
value checked before anything is built (exit status 2 in the CLI, ``ValueError`` in the
Python API). Shared by ``tta-bench run/profile`` and ``tta_bench.evaluate``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tta_bench import catalog
from tta_bench.registry import registry


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
    "'tta_bench.*' entry points. Install one, e.g. the MuRA plugin from a clone of the "
    "tta-bench repository: pip install -e . (its root), then `tta-bench ls`"
)


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
) -> tuple[Any, Any]:
    """``(composed config, RunSpec)`` of a run; bad input raises ``UsageError`` (a
    ``ValueError``) or ``RegistryError`` naming the value, before anything is built.
    ``method``/``suite``/``model`` may also come as ``method=...`` overrides."""
    from omegaconf import OmegaConf

    from tta_bench.config import compose

    _require_plugins("methods")
    overrides = [str(o) for o in overrides]
    o_method, overrides = _split_choice(overrides, "method")
    o_model, overrides = _split_choice(overrides, "model")
    o_suite, overrides = _split_choice(overrides, "suite")
    method = method or o_method or _default("method")
    suite = suite or o_suite or _default("suite")
    model = model or o_model
    catalog_suites = catalog.catalog()["suites"]
    if suite not in catalog_suites:
        from tta_bench.registry import UnknownNameError

        raise UnknownNameError("suites", suite, list(catalog_suites))
    model = model or catalog_suites[suite].get("default_model")
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
    from tta_bench.spec import spec_from_config

    try:
        spec = spec_from_config(cfg, method, model)
        spec.method_preset = preset
    except ValueError as exc:  # protocol values (reset policy, severities, ...)
        raise UsageError(str(exc)) from exc
    except Exception as exc:  # the method config failed OmegaConf's validation
        if type(exc).__module__.startswith("omegaconf"):
            raise UsageError(f"bad method configuration: {exc}") from exc
        raise
    _check_spec(spec)
    return cfg, spec


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
    from tta_bench.data import CACHE_POLICIES
    from tta_bench.spec import resolve_device

    if not spec.seeds:
        raise UsageError(
            "seeds=[] names no seed; give at least one seed, e.g. seeds=[0] or [0,1,2]"
        )
    if len(set(spec.seeds)) != len(spec.seeds):
        raise UsageError(f"seeds={spec.seeds} repeats a seed")
    try:
        resolve_device(spec.device)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if spec.cache not in CACHE_POLICIES:
        raise UsageError(
            f"unknown cache policy {spec.cache!r}; available: {', '.join(CACHE_POLICIES)}"
        )
    _check_cache_writable()
    check_components(spec.protocol, spec.method_config)
    factory = registry("models").get(spec.model)
    check = getattr(factory, "check_args", None)
    if callable(check):
        try:
            check(**spec.model_args)
        except ValueError as exc:
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
    import sys

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
        print(
            f"tta-bench: warning: --data-dir {spec.data_dir!r} is ignored: suite "
            f"{protocol.name!r} (dataset {protocol.dataset!r}) reads no local data",
            file=sys.stderr,
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
    try:
        for shift, severity in domains:
            extra = {} if shift is None else {"shift": shift, "severity": severity}
            check(**kwargs, **extra)
    except ValueError as exc:
        raise UsageError(f"dataset {protocol.dataset}: {exc}") from exc


def check_output(path: Any, spec: Any) -> None:
    """The results path must be writable, and an existing file must be this run's."""
    import os
    import tempfile
    from pathlib import Path

    from tta_bench import results
    from tta_bench.resume import spec_key

    path = Path(path)
    if path.is_dir():
        raise UsageError(f"--output {str(path)!r} is a directory; give a file path")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"--output {str(path)!r}: {str(parent)!r} is a file, not a directory")
    try:  # the real test: create the folder and a file in it (permissions, read-only mounts)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as exc:
        raise UsageError(
            f"--output {str(path)!r}: cannot write in {str(path.parent)!r} ({exc.strerror or exc})"
        ) from None
    if path.exists():
        if not os.access(path, os.W_OK):
            raise UsageError(f"--output {str(path)!r} is not writable")
        if spec.resume:
            try:
                old = results.load_results(path)
            except ValueError as exc:
                raise UsageError(f"--output holds no readable results to resume: {exc}") from exc
            if results.record_key(old) != spec_key(spec):
                raise UsageError(
                    f"--output {str(path)!r} holds a different run ({results.record_key(old)}); "
                    "choose another output or set resume=false"
                )


def check_components(protocol: Any, mcfg: Any) -> None:
    """Fail before any work if the suite names unknown components."""
    registry("datasets").origin(protocol.dataset)
    if protocol.shift_source == "synthetic":
        for s in protocol.shifts:
            registry("shifts").origin(s)
    loss = getattr(mcfg, "loss", None)
    if isinstance(loss, str):
        registry("losses").origin(loss)
