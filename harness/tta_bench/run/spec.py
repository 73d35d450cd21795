"""Run construction: ``RunSpec`` (everything one run needs, resolved and checked) and how it
is made from a composed run config (``spec_from_config``), and the device a run asks for
(``resolve_device``). ``tta_bench.run.resolve`` checks what the user typed and builds a spec
here; ``tta_bench.run.runner`` only runs one. Importing this module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tta_bench.run.protocol import Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["DEVICES", "RunSpec", "resolve_device", "spec_from_config"]

DEVICES = ("auto", "cpu", "cuda", "cuda:N")


@dataclass(frozen=True)
class RunSpec:
    method: str
    method_config: Any
    model: str
    model_args: dict[str, Any]
    protocol: Protocol
    seeds: list[int]
    device: str = "auto"
    data_dir: str | None = None
    reference: bool = True
    progress: bool = True
    config: dict[str, Any] = field(default_factory=dict)  # the resolved config, for the record
    #: DataLoader settings: a mapping/object with num_workers, pin_memory, prefetch_factor,
    #: persistent_workers (None = chosen for the device; ``tta_bench.run.loader``).
    loader: Any = None
    #: Skip cells already in the output file when it holds the same run.
    resume: bool = True
    #: A corrupt/truncated image: "fail" (error naming it) or "skip" (left out, recorded).
    on_bad_image: str = "fail"
    #: JSONL path: one line per batch (loss, accuracy before/after, time, memory).
    batch_log: str | None = None
    per_class_accuracy: bool = False
    #: Count FLOPs per sample on each cell's first batch (that batch is left untimed).
    flops: bool = False
    #: Per-sample outputs: None (off), "topk" or "logits" (``tta_bench.run.samples``).
    log_samples: str | None = None
    log_samples_top_k: int = 5
    #: ``log_samples=auto``: a resumed output whose finished cells have no per-sample files
    #: stays without them (``tta_bench.run.runner``), instead of being refused.
    log_samples_auto: bool = False
    #: Decoded-image cache policy (``tta_bench.data.CACHE_POLICIES``).
    cache: str = "auto"
    #: Image-feature cache policy (``tta_bench.run.features``): auto | never.
    feature_cache: str = "auto"
    #: Shifted-image cache policy (``tta_bench.run.shifted``): auto | always | never.
    shift_cache: str = "auto"
    #: The named preset the method config came from (``method=<preset>``), if any.
    method_preset: str | None = None
    #: Experiment trackers that receive the run (``tta_bench.run.trackers``), checked: known
    #: names whose libraries are installed.
    loggers: list[str] = field(default_factory=list)
    #: Part of every cell this run computes (``protocol.shard=i/N``; ``tta_bench.run.shard``).
    shard: Any = None
    #: ``{dataset: method config}`` where a suite's domains are several datasets whose
    #: configs differ (a per-dataset rule on a suite of several datasets, e.g. a setting
    #: that applies to one dataset family only: ``tta_bench.run.profiles``);
    #: a dataset not in it runs ``method_config``. Part of the run key when set.
    method_configs: dict[str, Any] | None = None

    def config_for(self, dataset: str | None) -> Any:
        """The method config of a domain of ``dataset``."""
        if self.method_configs and dataset in self.method_configs:
            return self.method_configs[dataset]
        return self.method_config


def spec_from_config(cfg: Any, method: str, model: str, preset: str | None = None) -> RunSpec:
    """The ``RunSpec`` of a composed run config (``tta_bench.config``); ``method`` and
    ``model`` are the config-group choices, ``preset`` the named preset the method config
    came from. The spec is frozen: callers adjust CLI-only fields with
    ``dataclasses.replace``. Bad values are ``ValueError``s raised before anything is built:
    out-of-range settings, an unknown ``logger`` name or profile, a chosen tracker whose
    library (the extra ``tta-bench[<name>]``) is not installed."""
    from omegaconf import OmegaConf

    from tta_bench.bounds import check_values
    from tta_bench.config import method_config, to_container
    from tta_bench.run import shard
    from tta_bench.run.protocol import load_protocol
    from tta_bench.run.samples import mode as samples_mode
    from tta_bench.run.trackers import check_loggers

    loggers = check_loggers(cfg.get("logger") or [])  # names and extras, importing none
    for node in ("protocol", "loader"):  # declared ranges, before anything is built
        check_values(OmegaConf.to_object(cfg[node]), node)
    mcfg = method_config(cfg)
    check_values(mcfg, "method")
    overrides = {k: v for k, v in to_container(cfg.protocol).items() if v is not None}
    part = shard.parse(overrides.pop("shard", None))  # not the protocol's: not in its id
    name = cfg.get("profile")
    overrides, applied = _profile_protocol(name, method, overrides)
    protocol = load_protocol(cfg.suite, **overrides)
    _check_text_head(method, protocol.text_head)
    mcfg, by_dataset, changed = _per_dataset_configs(method, mcfg, protocol, name)
    changed = {f"method.{k}": v for k, v in changed.items()}
    official = {} if name else changed  # the method's own per-dataset rule: what ran
    applied.update(changed if name else {})
    log_samples = samples_mode(cfg.get("log_samples", False))
    auto_samples = str(cfg.get("log_samples")) == "auto"
    if auto_samples and protocol.orders:  # N orders of one image set: summarised over
        log_samples = None  # orders, not paired per sample; N x the files would not fit
    if part is not None:
        shard.check_shardable(protocol.reset, protocol.name, part)
        if protocol.realtime:
            raise ValueError(
                f"protocol.shard={part} with protocol.realtime=true: on the realtime track "
                "whether a batch is adapted on depends on every batch before it in the "
                "cell, so a cell cannot be split; run it whole, or split by seed (sweep)"
            )
        log_samples = "logits"  # the merge recomputes every metric from the parts' logits
        auto_samples = False
    if cfg.seeds is None:  # the replicates the protocol implies, recorded as run
        cfg.seeds = protocol.default_seeds()
    cfg_dict = _record_config(cfg, method, model, applied, official)
    return RunSpec(
        method=method,
        method_config=mcfg,
        model=model,
        model_args={k: v for k, v in cfg_dict["model"].items() if k != "name"},
        protocol=protocol,
        seeds=[int(s) for s in cfg.seeds],
        device=cfg.device,
        data_dir=cfg.data_dir,
        reference=bool(cfg.reference),
        progress=bool(cfg.progress),
        config=cfg_dict,
        loader=cfg_dict.get("loader"),
        resume=bool(cfg.resume),
        batch_log=cfg.get("batch_log"),
        per_class_accuracy=bool(cfg.get("per_class_accuracy", False)),
        log_samples=log_samples,
        log_samples_auto=auto_samples,
        log_samples_top_k=int(cfg.get("log_samples_top_k", 5)),
        flops=bool(cfg.get("flops", False)),
        cache=str(cfg.get("cache", "auto")),
        feature_cache=str(cfg.get("feature_cache", "auto")),
        shift_cache=str(cfg.get("shift_cache", "auto")),
        method_preset=preset,
        loggers=loggers,
        shard=part,
        method_configs=by_dataset,
    )


def _profile_protocol(
    name: str | None, method: str, overrides: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(protocol overrides, {protocol.<field>: value the profile set})`` under profile
    ``name`` (``tta_bench.run.profiles``); without one, the overrides as given."""
    if not name:
        return overrides, {}
    from tta_bench.registry import registry
    from tta_bench.run import profiles

    kind = getattr(registry("methods").get(method), "stream_kind", None)
    completed = profiles.protocol_overrides(name, overrides, kind)
    return completed, {f"protocol.{k}": v for k, v in completed.items() if k not in overrides}


def _check_text_head(method: str, text_head: str | None) -> None:
    """Refuse a prompt mode the method cannot build (``tta_bench.prompts.check_method``)."""
    from tta_bench.prompts import check_method
    from tta_bench.registry import registry

    methods = registry("methods")
    if method in methods:
        check_method(method, methods.get(method), text_head)


def _record_config(
    cfg: Any, method: str, model: str, applied: dict[str, Any], official: dict[str, Any]
) -> dict[str, Any]:
    """The resolved config as the record keeps it: the method and model named, the values
    a profile or a method's per-dataset rule set written in (per-dataset ones are recorded
    in ``profile_applied``/``per_dataset_applied`` only), and those two beside it."""
    from tta_bench.config import to_container

    cfg_dict = to_container(cfg)
    cfg_dict.pop("defaults", None)
    cfg_dict["method"] = {"name": method, **cfg_dict["method"]}
    for key, value in {**applied, **official}.items():  # the record says what ran
        node, field_name = key.split(".", 1)
        if "@" not in field_name:  # per-dataset values: method_configs, recorded by dataset
            cfg_dict[node][field_name] = value
    if applied:  # what the profile set, beside what it set it on
        cfg_dict["profile_applied"] = applied
    if official:  # what the method's own per-dataset rule set (its catalogue dataset_flags:)
        cfg_dict["per_dataset_applied"] = official
    cfg_dict["model"] = {"name": model, **cfg_dict["model"]}
    return cfg_dict


def _per_dataset_configs(
    method: str, mcfg: Any, protocol: Protocol, profile: str | None
) -> tuple[Any, dict[str, Any] | None, dict[str, Any]]:
    """``(method config, {dataset: config} or None, {field[@dataset]: value set})`` under the
    run's per-dataset rule (``tta_bench.run.profiles.method_rule``): one config when every
    dataset of the suite gets the same, else the datasets whose config differs from
    ``mcfg``."""
    from tta_bench.bounds import check_values
    from tta_bench.run.profiles import method_rule

    rule = method_rule(method, mcfg, profile)
    if rule is None:
        return mcfg, None, {}
    configs = {d: rule(d) for d in protocol.domain_datasets()}
    first, changed = next(iter(configs.values()))
    by_dataset: dict[str, Any] | None = None
    if all(c == first for c, _ in configs.values()):
        mcfg = first
    else:  # several datasets, and the rule sets them differently
        by_dataset = {d: c for d, (c, _) in configs.items() if c != mcfg}
        changed = {}
        for d, (_, ch) in configs.items():
            for k, v in ch.items():
                changed.setdefault(f"{k}@{d}", v)
    for c in [mcfg, *(by_dataset or {}).values()]:
        check_values(c, "method")
    return mcfg, by_dataset, changed


def resolve_device(name: str) -> torch.device:
    """``auto`` (CUDA when available), ``cpu``, ``cuda`` or ``cuda:N``; a bad name or an
    unavailable device is a ValueError naming it and the options."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {name!r}; available: {', '.join(DEVICES)}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}; available: {', '.join(DEVICES)}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {name!r} requested but CUDA is not available; use cpu or auto"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
    return device
