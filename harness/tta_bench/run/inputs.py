"""Input preparation: what the evaluation loop hands a method, batch by batch.

``RunInputs.build`` resolves the protocol's domains to dataset splits (the clean split for
synthetic shifts; one split per domain for datasets that serve their own domains), opens one
``Source`` per distinct split (``tta_bench.data``: decoded cache or on-demand decoding, by
the cache policy), loads the shift kernels, and builds the zero-shot classifier of every
label set with the protocol's text head. ``loader(plan)`` yields the plan's batches in
stream order (``tta_bench.run.loader``); ``prepare(item, batch, stream, seed)`` moves one to
the device, converts it to float in [0, 1] and corrupts it there, seeded per sample.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tta_bench.data import DomainStream, to_float_images
from tta_bench.model import ZeroShotClassifier
from tta_bench.prompts import prompts_for_classes
from tta_bench.registry import registry
from tta_bench.rng import GeneratorPool, SampleGenerator, stable_seed
from tta_bench.run.cache import decoded_bytes
from tta_bench.run.composite import Kernel, apply_shift, shift_kernel, uint8_entry
from tta_bench.run.loader import InProcessBatches, StreamBatches, make_loader, resolve_settings
from tta_bench.run.protocol import Protocol
from tta_bench.run.shifted import ShiftedCache
from tta_bench.run.sources import open_source
from tta_bench.run.stream import Batch, Domain, Stream


def dataset_stream(
    protocol: Protocol,
    data_dir: str | None,
    shift: str | None = None,
    severity: int | None = None,
    *,
    dataset: str | None = None,
    dataset_args: dict[str, Any] | None = None,
) -> DomainStream:
    """A split of the protocol's dataset (or of ``dataset`` with ``dataset_args``); for
    datasets that serve their own domains, the split of ``(shift, severity)``."""
    name = dataset or protocol.dataset
    factory = registry("datasets").get(name)
    kwargs = dict(protocol.dataset_args if dataset_args is None else dataset_args)
    if data_dir is not None and "data_dir" in inspect.signature(factory).parameters:
        kwargs["data_dir"] = data_dir
    if dataset is None and protocol.shift_source == "dataset":
        kwargs.update(shift=shift, severity=severity)
    return factory(**kwargs)


@dataclass
class RunInputs:
    """The domains' sources, labels, kernels and zero-shot heads of one run."""

    protocol: Protocol
    device: torch.device
    domains: list[Domain]
    streams: dict[Domain, DomainStream]
    sources: list[Any]
    source_of: dict[Domain, int]
    labels: dict[Domain, np.ndarray]
    kernels: dict[str, Kernel]
    loader_settings: Any
    image_size: int = 0
    shifted: ShiftedCache | None = None
    #: The in-process loader's dataset (``labels_only`` reads), None with loader workers.
    _in_process: StreamBatches | None = None
    bad_images: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    _bases: dict[tuple[str, ...], ZeroShotClassifier] = field(default_factory=dict)
    _pool: GeneratorPool = field(default_factory=GeneratorPool)

    @classmethod
    def build(
        cls,
        protocol: Protocol,
        bundle: Any,
        device: torch.device,
        *,
        data_dir: str | None,
        cache: str,
        loader: Any,
        progress: bool,
        on_bad_image: str,
        shift_cache: str = "auto",
    ) -> RunInputs:
        size = bundle.preprocess.image_size
        domains = [(s, int(v)) for s in protocol.shifts for v in protocol.severities]
        if protocol.shift_source == "synthetic":
            clean = dataset_stream(protocol, data_dir)
            streams = dict.fromkeys(domains, clean)
        else:
            streams = {d: dataset_stream(protocol, data_dir, *d) for d in domains}
        if protocol.ood is not None:  # open-set: the OOD images join every split
            streams = open_set_streams(protocol, data_dir, streams)
        sources: list[Any] = []
        by_id: dict[int, int] = {}
        pending = 0  # bytes the run's lazily cached splits will write
        for stream in streams.values():
            if id(stream) not in by_id:
                by_id[id(stream)] = len(sources)
                src = open_source(
                    stream,
                    size,
                    cache=cache,
                    progress=progress,
                    on_bad_image=on_bad_image,
                    pending_bytes=pending,
                )
                if getattr(src, "pending", False):
                    pending += decoded_bytes(stream, size)
                sources.append(src)
        decoding = any(s.kind == "streamed" or getattr(s, "pending", False) for s in sources)
        bundle.clip.to(device)  # text heads are encoded (and cached) on the run's device
        kernels = (
            {s: shift_kernel(s) for s in protocol.shifts}
            if protocol.shift_source == "synthetic"
            else {}
        )
        inputs = cls(
            protocol=protocol,
            device=device,
            domains=domains,
            streams=streams,
            sources=sources,
            source_of={d: by_id[id(s)] for d, s in streams.items()},
            labels={d: s.labels for d, s in streams.items()},
            kernels=kernels,
            loader_settings=resolve_settings(loader, device, decoding=decoding),
            image_size=size,
            shifted=ShiftedCache(shift_cache, device) if kernels else None,
        )
        for src in sources:
            if src.bad:
                inputs.bad_images[src.name] = list(src.bad)
        for d in domains:  # text heads are setup, not loop time
            inputs.base(d, bundle)
        return inputs

    def base(self, domain: Domain, bundle: Any = None) -> ZeroShotClassifier:
        """The frozen zero-shot classifier of ``domain``'s label set, with the protocol's
        text head (one per distinct label set; ``bundle`` is needed the first time)."""
        stream = self.streams[domain]
        protocol = self.protocol
        templates = list(protocol.templates or stream.templates)
        dataset = self._dataset_of(stream)
        key = (dataset, *stream.classnames, "\x1f", *templates)
        if key not in self._bases:
            if bundle is None:
                raise KeyError(f"no classifier built for domain {domain}")
            sentences = None
            if protocol.text_head is not None:  # per-class sentences (tta_bench.prompts)
                assert protocol.prompts_file is not None and protocol.prompts is not None
                sentences = prompts_for_classes(
                    protocol.prompts_file, protocol.prompts, stream.classnames
                )
                templates = templates if protocol.text_head == "all" else []
            self._bases[key] = ZeroShotClassifier(
                bundle, stream.classnames, templates, dataset=dataset, class_prompts=sentences
            ).to(self.device)
        return self._bases[key]

    def _dataset_of(self, stream: DomainStream) -> str:
        """The registered dataset a domain's images are (methods whose official code picks
        settings per dataset read it): the stream's ``metadata["dataset"]``, else its name
        when that is a registered dataset (a natural-shift suite's ImageNet-A domain), else
        the protocol's dataset."""
        named = stream.metadata.get("dataset")
        if named:
            return str(named)
        if stream.name in registry("datasets"):
            return stream.name
        return self.protocol.dataset

    def loader(self, plan: list[Batch], seed: int) -> Any:
        """The batches of ``plan`` in order, read by the loader's workers."""
        dom = self.domains
        data = StreamBatches(
            plan,
            self.sources,
            [self.source_of[d] for d in dom],
            [self.labels[d] for d in dom],
        )
        loader = make_loader(data, self.loader_settings, seed=seed)
        self._in_process = data if isinstance(loader, InProcessBatches) else None
        return loader

    def next_batch(
        self, it: Any, batch: Batch, stream: Stream, seed: int, timer: Any
    ) -> tuple[torch.Tensor, torch.Tensor, Batch]:
        """``prepare(next(it), ...)``; a batch the shifted-image cache holds is gathered from
        it, and an in-process loader then reads its labels only."""
        data = self._in_process
        if data is None or self.shifted is None or not self.shifted.enabled:
            return self.prepare(next(it), batch, stream, seed, timer)
        with timer.phase("shift"):
            cached = self._cached(batch, stream, seed)
        if cached is None:
            return self.prepare(next(it), batch, stream, seed, timer, try_cache=False)
        with timer.phase("data"):
            data.labels_only = True
            try:
                item = next(it)
            finally:
                data.labels_only = False
            _check_order(item, batch)
            y = item["labels"].to(self.device)
        return cached, y, batch

    def prepare(
        self,
        item: dict[str, Any],
        batch: Batch,
        stream: Stream,
        seed: int,
        timer: Any,
        *,
        try_cache: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, Batch]:
        """``(images [B, C, H, W] float on the device, labels [B], the batch's kept rows)``:
        the loaded batch moved to the device (phase ``data``) and corrupted (``shift``), or
        its corrupted images read from the shifted-image cache (unless ``try_cache`` is
        False: the caller asked it already). Rows whose images could not be decoded
        (skipped) are left out of the batch."""
        _check_order(item, batch)
        non_blocking = self.loader_settings.pin_memory
        with timer.phase("data"):
            x = item["images"].to(self.device, non_blocking=non_blocking)
            y = item["labels"].to(self.device, non_blocking=non_blocking)
            kept = item["kept"].numpy()
            if item["bad"]:  # unreadable images met while decoding on demand
                self._report_bad(item["bad"])
            if len(kept) != len(batch):
                batch = _subbatch(batch, kept)
            if len(batch) == 0:
                return x, y, batch
        if self.kernels and try_cache:
            with timer.phase("shift"):
                cached = self._cached(batch, stream, seed)
            if cached is not None:
                return cached, y, batch
        with timer.phase("data"):
            if not (self.kernels and self._takes_uint8(batch, stream)):
                x = to_float_images(x)
        with timer.phase("shift"):
            if self.kernels:
                x = self._shift(x, batch, stream, seed)
        return x, y, batch

    def _cached(self, batch: Batch, stream: Stream, seed: int) -> torch.Tensor | None:
        """The batch's corrupted images from the shifted-image cache
        (``tta_bench.run.shifted``; a mixed batch domain by domain), or None when a domain
        of it is not cached."""
        if self.shifted is None or not self.shifted.enabled:
            return None
        dom = batch.single_domain()
        if dom is not None:
            return self.shifted.take(self, stream, dom, batch.indices, seed)
        parts = []
        for d in np.unique(batch.domains).tolist():
            rows = np.flatnonzero(batch.domains == d)
            got = self.shifted.take(self, stream, d, batch.indices[rows], seed)
            if got is None:
                return None
            parts.append((rows, got))
        out = torch.empty((len(batch), *parts[0][1].shape[1:]), device=self.device)
        for rows, got in parts:
            out[torch.from_numpy(rows).to(self.device)] = got
        return out

    def corrupt(
        self, x: torch.Tensor, index: np.ndarray, shift: str, severity: int, seed: int
    ) -> torch.Tensor:
        """``shift`` at ``severity`` applied to ``x`` (float ``[B, C, H, W]``, or the
        decoded uint8 ``[B, H, W, C]``: ``apply_shift`` converts it), sample ``i`` seeded
        by ``(seed, shift, severity, index[i])``: the loop's step and the shifted-image
        cache's."""
        gen = SampleGenerator.for_samples(
            index, seed, shift, severity, device=x.device, pool=self._pool
        )
        try:
            return apply_shift(self.kernels[shift], x, severity, gen, self.protocol.severity_table)
        finally:
            gen.release()

    def _report_bad(self, bad: list[dict[str, Any]]) -> None:
        """Fail the run naming them (``on_bad_image=fail``), or record each skipped image
        once under its split's name (the same image is met again by every domain of a
        synthetic suite, and by every seed)."""
        by_name = {getattr(s, "name", None): s for s in self.sources}
        for entry in bad:
            name = entry.get("source", "?")
            source = by_name.get(name)
            if source is not None and hasattr(source, "check_bad"):
                source.check_bad([entry])  # raises unless the policy is skip
            known = self.bad_images.setdefault(name, [])
            if all(b["index"] != entry["index"] for b in known):
                known.append({k: v for k, v in entry.items() if k != "source"})
                known.sort(key=lambda b: b["index"])

    def _takes_uint8(self, batch: Batch, stream: Stream) -> bool:
        """Whether ``batch`` goes to its kernel as uint8 (one domain, a kernel with a
        ``from_uint8`` entry); mixed batches are converted once for all their kernels."""
        dom = batch.single_domain()
        return dom is not None and uint8_entry(self.kernels[stream.domains[dom][0]]) is not None

    def _shift(self, x: torch.Tensor, batch: Batch, stream: Stream, seed: int) -> torch.Tensor:
        """Corrupt ``x`` on its device, seeded per sample by ``(seed, shift, severity,
        index)``; a mixed batch is corrupted domain by domain."""
        dom = batch.single_domain()
        if dom is not None:
            return self.corrupt(x, batch.indices, *stream.domains[dom], seed)
        out = torch.empty_like(x)
        for d in np.unique(batch.domains).tolist():
            rows = np.flatnonzero(batch.domains == d)
            sel = torch.from_numpy(rows).to(x.device)
            out[sel] = self.corrupt(x[sel], batch.indices[rows], *stream.domains[d], seed)
        return out


def _check_order(item: dict[str, Any], batch: Batch) -> None:
    """A ``RuntimeError`` unless the loaded ``item`` is ``batch`` (stream order)."""
    if item["number"] != batch.number:
        raise RuntimeError(f"loader out of stream order: {item['number']} != {batch.number}")


def open_set_streams(
    protocol: Protocol, data_dir: str | None, streams: dict[Domain, DomainStream]
) -> dict[Domain, DomainStream]:
    """Every distinct split of ``streams`` with the protocol's OOD set mixed in
    (``tta_bench.run.openset.mix``; one mixed split per distinct split)."""
    from tta_bench.run.openset import mix

    assert protocol.ood is not None
    ood = dataset_stream(
        protocol,
        data_dir,
        dataset=protocol.ood["dataset"],
        dataset_args=dict(protocol.ood["dataset_args"]),
    )
    mixed: dict[int, DomainStream] = {}
    out = {}
    for d, stream in streams.items():
        if id(stream) not in mixed:
            mixed[id(stream)] = mix(stream, ood, protocol.ood)
        out[d] = mixed[id(stream)]
    return out


def check_labelled_source(protocol: Protocol, method: str = "this method") -> None:
    """A ``ValueError`` unless the protocol's source split is a training split (its
    ``dataset_args.split`` starts with ``train``): a method that trains on the labels of its
    source images (``Method.needs_source_labels``) must not read the labels of the clean
    originals of the test images (e.g. ImageNet validation, the source of ImageNet-C)."""
    spec = dict(protocol.source or {})
    split = str((spec.get("dataset_args") or {}).get("split", "the dataset's default split"))
    if not split.startswith("train"):
        raise ValueError(
            f"{method} trains on the labels of its source images, but suite "
            f"{protocol.name!r} declares source {spec.get('dataset')!r} split {split!r}, not a "
            "training split: its labels may be those of the clean originals of the test "
            "images. Declare a training split as the suite's source (`source: {dataset: "
            "<name>, dataset_args: {split: train}}`), or choose a suite that has one"
        )


def source_images(
    protocol: Protocol,
    bundle: Any,
    n: int,
    data_dir: str | None,
    device: torch.device,
    labels: bool = False,
) -> Any:
    """Up to ``n`` clean, unlabeled images ``[n, C, H, W]`` in [0, 1] (the whole split when
    it is smaller) of the protocol's declared source split (``Protocol.source``: e.g. the
    training split of the test set's dataset), a fixed random subset keyed by the protocol;
    for methods that estimate statistics of the source domain (EATA's Fisher information).
    With ``labels``: ``(images, labels [n] int64)``, the source split's own labels, for a
    method whose source objective is supervised (``Method.needs_source_labels``); without,
    no labels leave this function."""
    if protocol.source is None:
        raise ValueError(
            f"this method needs {n} clean source-domain images, but suite {protocol.name!r} "
            "declares no source split; add `source: {dataset: <name>, dataset_args: {split: "
            "train}}` to the suite in its registry.yaml, or choose a suite that has one"
        )
    if labels:
        check_labelled_source(protocol)
    spec = dict(protocol.source)
    stream = dataset_stream(
        protocol,
        data_dir,
        dataset=spec["dataset"],
        dataset_args=dict(spec.get("dataset_args") or {}),
    )
    n = min(n, len(stream))  # a smaller split is handed over whole (the method is told by size)
    src = open_source(stream, bundle.preprocess.image_size, on_bad_image="skip")
    rng = np.random.default_rng(stable_seed("source", protocol.name) % 2**32)
    rows = np.sort(rng.permutation(len(stream))[:n])
    fetched = src.fetch(rows)
    images = to_float_images(torch.from_numpy(fetched.images)).to(device)
    if not labels:
        return images
    kept = torch.from_numpy(np.asarray(stream.labels)[rows][fetched.kept].astype(np.int64))
    return images, kept.to(device)


def _subbatch(batch: Batch, kept: np.ndarray) -> Batch:
    """``batch`` restricted to the rows ``kept`` (images that could be decoded)."""
    return Batch(
        batch.number, batch.indices[kept], batch.domains[kept], batch.reset_before, batch.group
    )
