"""The head of a results record: what its numbers depend on.

Model name, weights and their hashes (file and loaded state), method and its resolved
config (+ hash), whether its outputs are logits (``scores_are_logits``), protocol id and
identity, seeds, the resolved run config, and provenance: git sha, package versions, device
(CPU model, the instruction set torch dispatches to, thread count), precision, the
distribution and version of every plugin component used, and each file included with
``--include`` with its full SHA-256 (``provenance.includes``).
"""

from __future__ import annotations

from typing import Any

import torch

from tta_bench import buffers
from tta_bench._version import SCHEMA_VERSION
from tta_bench.include import provenance as included_provenance
from tta_bench.method import config_dict, effective_precision
from tta_bench.model import state_sha256
from tta_bench.registry import provenance, registry
from tta_bench.run import results
from tta_bench.run.resume import method_config_hash


def metric_bins() -> dict[str, Any]:
    """``{metric: its catalogue ``bins``}`` of every installed metric that declares them."""
    from tta_bench import catalog

    out = {}
    for name in registry("metrics").names():
        bins = catalog.entry("metrics", name).get("bins")
        if bins:
            out[name] = dict(bins)
    return out


def precision_record(method_config: Any, device: torch.device) -> dict[str, Any]:
    """Parameter dtype, the configured precision and what it means on ``device`` (autocast
    on CUDA only; float32 on the CPU)."""
    configured = getattr(method_config, "precision", "fp32")
    effective = effective_precision(configured, device)
    return {
        "dtype": "float32",
        "configured": configured,
        "autocast": None if effective == "fp32" else effective,
    }


def new_record(spec: Any, bundle: Any, device: torch.device, *, from_registry: bool) -> dict:
    """An empty results record for ``spec`` run with ``bundle`` on ``device``
    (``from_registry``: the model came from its registered factory, so its plugin origin
    is recorded)."""
    protocol = spec.protocol
    method_cls = registry("methods").get(spec.method)
    plugins = [provenance("methods", spec.method), provenance("datasets", protocol.dataset)]
    if from_registry:
        plugins.insert(1, provenance("models", spec.model))
    if protocol.shift_source == "synthetic":
        from tta_bench.run.composite import parts

        names = [p for s in protocol.shifts for p in parts(s) or (s,)]  # a composite's two
        plugins += [provenance("shifts", s) for s in dict.fromkeys(names)]
    loss = getattr(spec.method_config, "loss", None)
    if isinstance(loss, str) and loss in registry("losses"):
        plugins.append(provenance("losses", loss))
    includes = included_provenance()
    return {
        "schema_version": SCHEMA_VERSION,
        "created": results.now_iso(),
        "method": spec.method,
        "method_preset": getattr(spec, "method_preset", None),
        # whether its outputs are logits of a probability model (Method.scores_are_logits):
        # tables print no NLL/ECE for a method whose outputs are scores; absent: True
        "scores_are_logits": bool(method_cls.scores_are_logits),
        # the method's own OOD score (Method.own_ood_score), scored as auroc_own, ...
        **_own_ood_score(method_cls),
        "method_config": config_dict(spec.method_config),
        **(
            {
                "method_config_by_dataset": {
                    d: config_dict(c) for d, c in spec.method_configs.items()
                }
            }
            if spec.method_configs
            else {}
        ),
        "method_config_hash": method_config_hash(spec.method_config, spec.method_configs),
        "model": {
            "name": spec.model,
            "weights": bundle.weights,
            # what a number depends on: the exact weights (file and loaded state)
            "weights_sha256": getattr(bundle, "weights_sha256", None),
            "state_sha256": state_sha256(bundle.clip),
            "args": spec.model_args,
        },
        "suite": protocol.name,
        "protocol": {"id": protocol.id, **protocol.identity()},
        "seeds": list(spec.seeds),
        "config": spec.config,
        "parameters": None,  # filled when the first method instance is set up
        "provenance": {
            "git_sha": results.git_sha(),
            "packages": results.package_versions(),
            "device": results.device_info(device),
            "torch_threads": torch.get_num_threads(),
            # where batch-sized CPU blocks come from (timings, not values, depend on it):
            # glibc's allocator as the process had it, and the recycled batch buffers
            "malloc": {"policy": "system", "recycled_buffers_max_bytes": buffers.MAX_BYTES},
            "torch": torch.__version__,
            "precision": precision_record(spec.method_config, device),
            "plugins": plugins,
            # --include: every included local file, with its full SHA-256
            **({"includes": includes} if includes else {}),
        },
        # how the binned metrics bin (ece: 15 bins, ece20: C-TPT's 20), from the catalogue
        "metric_bins": metric_bins(),
        "cells": [],
        "summary": results.summarize([]),
        # a part of every cell (protocol.shard=i/N), never a cell: tta-bench merge
        **({"shard": spec.shard.as_dict()} if getattr(spec, "shard", None) else {}),
    }


def _own_ood_score(cls: Any) -> dict[str, Any]:
    """``{"own_ood_score": name}`` for a method with its own OOD score, else nothing (the
    records of the others stay as they were)."""
    name = getattr(cls, "own_ood_score", None)
    return {"own_ood_score": str(name)} if name else {}
