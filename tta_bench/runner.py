"""The evaluation loop: one method, one protocol, several seeds -> cells.

Read top to bottom: build the model and the stream, then for every seed set the method up
once and walk the cells in the protocol's pinned order; per batch, corrupt on the device,
let the method adapt and predict, score against labels the method never sees, and reset
where the protocol says. Each finished cell is appended to the results file atomically.
"""

from __future__ import annotations

import copy
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tta_bench import SCHEMA_VERSION, metrics, results
from tta_bench.cost import PassCounter, PeakMemory, PhaseTimer
from tta_bench.data import DomainStream, batches, decoded_images
from tta_bench.method import Method, config_dict
from tta_bench.model import ZeroShotClassifier, count_parameters
from tta_bench.protocol import Protocol
from tta_bench.registry import provenance, registry
from tta_bench.rng import SampleGenerator, stable_seed


@dataclass
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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available; use cpu or auto")
    return device


def build_method(name: str, model: ZeroShotClassifier, config: Any) -> Method:
    method_cls = registry("methods").get(name)
    return method_cls(model, config)


def apply_shift(
    kernel: Callable[..., torch.Tensor],
    images: torch.Tensor,
    severity: int,
    generator: SampleGenerator,
    table: str,
) -> torch.Tensor:
    kwargs: dict[str, Any] = {"generator": generator}
    if "table" in inspect.signature(kernel).parameters:
        kwargs["table"] = table
    out = kernel(images, severity, **kwargs)
    if out.shape != images.shape:
        raise ValueError(f"shift kernel changed the batch shape {images.shape} -> {out.shape}")
    return out.clamp_(0.0, 1.0)


class Evaluation:
    """Runs a ``RunSpec`` and writes its results file after every cell."""

    def __init__(self, spec: RunSpec, output: Path):
        self.spec = spec
        self.output = Path(output)
        self.protocol = spec.protocol
        self.device = resolve_device(spec.device)

    # -- inputs --------------------------------------------------------------------------
    def _dataset_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self.protocol.dataset_args)
        factory = registry("datasets").get(self.protocol.dataset)
        if self.spec.data_dir is not None and "data_dir" in inspect.signature(factory).parameters:
            kwargs["data_dir"] = self.spec.data_dir
        return kwargs

    def _stream(self, shift: str | None = None, severity: int | None = None) -> DomainStream:
        factory = registry("datasets").get(self.protocol.dataset)
        kwargs = self._dataset_kwargs()
        if self.protocol.shift_source == "dataset":
            kwargs.update(shift=shift, severity=severity)
        return factory(**kwargs)

    def _subset(self, n: int) -> np.ndarray:
        if self.protocol.max_images is None or self.protocol.max_images >= n:
            return np.arange(n)
        rng = np.random.default_rng(stable_seed("subset", self.protocol.name) % 2**32)
        return np.sort(rng.permutation(n)[: self.protocol.max_images])

    def _cells(self) -> list[tuple[str, int]]:
        return [(s, v) for s in self.protocol.shifts for v in self.protocol.severities]

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        spec, protocol, device = self.spec, self.protocol, self.device
        torch.manual_seed(0)  # model construction must not depend on ambient state
        bundle = registry("models").get(spec.model)(**spec.model_args)
        size = bundle.preprocess.image_size
        clean = self._stream() if protocol.shift_source == "synthetic" else None
        kernels = {s: registry("shifts").get(s) for s in protocol.shifts}
        if protocol.shift_source == "synthetic":
            assert clean is not None
            base = ZeroShotClassifier(bundle, clean.classnames, clean.templates).to(device)
        record = self._new_record(bundle, device)
        self._save(record)

        from tqdm.auto import tqdm

        cells = [(seed, s, v) for seed in spec.seeds for s, v in self._cells()]
        bar = tqdm(
            total=len(cells),
            desc=f"{spec.method} on {protocol.name}",
            unit="cell",
            disable=not spec.progress,
        )
        for seed in spec.seeds:
            method = None
            for shift, severity in self._cells():
                if protocol.shift_source == "dataset":
                    stream = self._stream(shift, severity)
                    base = ZeroShotClassifier(bundle, stream.classnames, stream.templates)
                    base = base.to(device)
                    method = None  # a new domain may have a new label set: a fresh method
                else:
                    stream = clean
                if method is None:
                    method = self._new_method(base, seed)
                    record["parameters"] = record["parameters"] or {
                        "trainable": sum(p.numel() for p in method.trainable_parameters()),
                        "total": count_parameters(method.model),
                    }
                elif protocol.reset == "reset_each_shift":
                    method.reset()
                cell = self._run_cell(
                    method, base, stream, seed, shift, severity, kernels, size, bar
                )
                record["cells"].append(cell)
                record["summary"] = results.summarize(record["cells"])
                self._save(record)
                bar.update(1)
        bar.close()
        record["finished"] = results.now_iso()
        self._save(record)
        return record

    def _new_method(self, base: ZeroShotClassifier, seed: int) -> Method:
        torch.manual_seed(stable_seed(self.spec.method, "setup", seed) % 2**63)
        method = build_method(self.spec.method, copy.deepcopy(base), self.spec.method_config)
        method.setup()
        return method

    def _run_cell(
        self,
        method: Method,
        base: ZeroShotClassifier,
        stream: DomainStream,
        seed: int,
        shift: str,
        severity: int,
        kernels: dict[str, Callable[..., torch.Tensor]],
        size: int,
        bar: Any,
    ) -> dict[str, Any]:
        protocol, device = self.protocol, self.device
        images_u8 = decoded_images(stream, size, progress=self.spec.progress)
        labels = stream.labels
        subset = self._subset(len(stream))
        order_rng = np.random.default_rng(stable_seed("order", seed, shift, severity) % 2**32)
        order = subset[order_rng.permutation(len(subset))]

        timer = PhaseTimer(device)
        counter = PassCounter(method.model.visual)
        n = correct = ref_correct = 0
        all_logits: list[torch.Tensor] = []
        n_batches = 0
        with PeakMemory(device) as mem:
            for b, idx in enumerate(batches(order, protocol.batch_size)):
                with timer.phase("data"):
                    x = torch.from_numpy(np.ascontiguousarray(images_u8[idx])).to(device)
                    x = x.permute(0, 3, 1, 2).float().div_(255.0)
                    if protocol.shift_source == "synthetic":
                        gen = SampleGenerator.for_samples(idx, seed, shift, severity, device=device)
                        x = apply_shift(kernels[shift], x, severity, gen, protocol.severity_table)
                with timer.phase("method"):
                    method.reseed(stable_seed("batch", seed, shift, severity, b) % 2**63)
                    logits = method.step(x)
                    if protocol.reset in ("episodic_batch", "episodic_sample"):
                        method.reset()
                y = torch.from_numpy(labels[idx]).to(device)
                logits = logits.detach().float()
                correct += int((logits.argmax(dim=1) == y).sum())
                all_logits.append(logits.cpu())
                n += len(idx)
                n_batches += 1
                if self.spec.reference and self.spec.method != "zeroshot":
                    with timer.phase("reference"), torch.no_grad():
                        ref_correct += int((base(x).argmax(dim=1) == y).sum())
                bar.set_postfix(shift=shift, sev=severity, acc=f"{correct / n:.3f}")
        counter.close()
        method_s = timer.seconds["method"]
        data_s = timer.seconds["data"]
        cell: dict[str, Any] = {
            "shift": shift,
            "severity": severity,
            "seed": seed,
            "n": n,
            **metrics.compute_all(torch.cat(all_logits), torch.from_numpy(labels[order])),
            "error": 1.0 - correct / n,
            "reference_accuracy": (
                (correct / n if self.spec.method == "zeroshot" else ref_correct / n)
                if self.spec.reference
                else None
            ),
            "time_per_sample_s": (method_s + data_s) / n,
            "method_time_per_sample_s": method_s / n,
            "data_time_per_sample_s": data_s / n,
            "data_wait_share": data_s / max(method_s + data_s, 1e-12),
            "samples_per_s": n / max(method_s + data_s, 1e-12),
            "peak_memory_bytes": mem.peak_bytes,
            "peak_memory_kind": mem.kind,
            "forward_passes_per_sample": counter.forward / n,
            "backward_passes_per_sample": counter.backward / n,
            "batches": n_batches,
            "finished": results.now_iso(),
        }
        return cell

    # -- the record ----------------------------------------------------------------------
    def _new_record(self, bundle: Any, device: torch.device) -> dict[str, Any]:
        spec = self.spec
        plugins = [
            provenance("methods", spec.method),
            provenance("models", spec.model),
            provenance("datasets", self.protocol.dataset),
        ]
        plugins += [
            provenance("shifts", s)
            for s in self.protocol.shifts
            if self.protocol.shift_source == "synthetic"
        ]
        loss = getattr(spec.method_config, "loss", None)
        if isinstance(loss, str) and loss in registry("losses"):
            plugins.append(provenance("losses", loss))
        return {
            "schema_version": SCHEMA_VERSION,
            "created": results.now_iso(),
            "method": spec.method,
            "method_config": config_dict(spec.method_config),
            "model": {"name": spec.model, "weights": bundle.weights, "args": spec.model_args},
            "suite": self.protocol.name,
            "protocol": {"id": self.protocol.id, **self.protocol.identity()},
            "seeds": list(spec.seeds),
            "config": spec.config,
            "parameters": None,  # filled when the first method instance is set up
            "provenance": {
                "git_sha": results.git_sha(),
                "packages": results.package_versions(),
                "device": results.device_info(device),
                "torch_threads": torch.get_num_threads(),
                "plugins": plugins,
            },
            "cells": [],
            "summary": results.summarize([]),
        }

    def _save(self, record: dict[str, Any]) -> None:
        results.write_json_atomic(self.output, record)


def run(spec: RunSpec, output: Path) -> dict[str, Any]:
    start = time.perf_counter()
    record = Evaluation(spec, output).run()
    record["wall_time_s"] = time.perf_counter() - start
    results.write_json_atomic(Path(output), record)
    return record
