"""The evaluation loop: one method, one protocol, several seeds -> cells.

Read top to bottom: build the model and the domains' decoded arrays; for every seed build
the stream (``tta_bench.stream``: the protocol's order, batches and reset points, identical
for every method); drop the groups a previous run already finished (resume); feed the rest
through one DataLoader (``tta_bench.loader``); per batch, move it to the device once,
corrupt it there, let the method adapt and predict, score against labels the method never
sees, and reset where the stream says. When a group (a cell, or a whole seed for the
stateful protocols) is finished its cells are appended to the results file atomically.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import inspect
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tta_bench import SCHEMA_VERSION, malloc, metrics, results
from tta_bench.cost import PassCounter, PeakMemory, PhaseTimer, _rss_bytes
from tta_bench.data import DomainStream, decode
from tta_bench.loader import StreamBatches, make_loader, resolve_settings
from tta_bench.method import Method, config_dict, effective_precision
from tta_bench.model import ZeroShotClassifier, count_parameters, state_sha256
from tta_bench.protocol import Protocol
from tta_bench.registry import provenance, registry
from tta_bench.rng import GeneratorPool, SampleGenerator, stable_seed
from tta_bench.stream import Batch, Domain, Stream, build_stream


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
    #: DataLoader settings: a mapping/object with num_workers, pin_memory, prefetch_factor,
    #: persistent_workers (None = chosen for the device; ``tta_bench.loader``).
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


def spec_from_config(cfg: Any, method: str, model: str) -> RunSpec:
    """The ``RunSpec`` of a composed run config (``tta_bench.config``); ``method`` and
    ``model`` are the config-group choices. Callers adjust CLI-only fields with
    ``dataclasses.replace``."""
    from tta_bench.config import method_config, to_container
    from tta_bench.protocol import load_protocol

    overrides = {k: v for k, v in to_container(cfg.protocol).items() if v is not None}
    protocol = load_protocol(cfg.suite, **overrides)
    cfg_dict = to_container(cfg)
    cfg_dict.pop("defaults", None)
    cfg_dict["method"] = {"name": method, **cfg_dict["method"]}
    cfg_dict["model"] = {"name": model, **cfg_dict["model"]}
    return RunSpec(
        method=method,
        method_config=method_config(cfg),
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
        flops=bool(cfg.get("flops", False)),
    )


class ResumeMismatchError(ValueError):
    """The output file exists but holds a different run."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available; use cpu or auto")
    return device


def seed_torch(seed: int, device: torch.device) -> None:
    """``torch.manual_seed(seed)`` for the generators a run on ``device`` uses. On the CPU
    only the CPU generator is seeded: ``torch.manual_seed`` also queues a lazy CUDA seeding,
    formatting a stack trace each time while CUDA is not initialised (~1 ms per call in a
    deep stack, and the runner seeds every cell)."""
    if device.type == "cpu":
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def build_method(name: str, model: ZeroShotClassifier, config: Any) -> Method:
    method_cls = registry("methods").get(name)
    return method_cls(model, config)


_TAKES_TABLE: dict[Callable[..., Any], bool] = {}


def uint8_entry(kernel: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor] | None:
    """The kernel's optional ``from_uint8`` entry: the same corruption of an 8-bit
    ``[B, H, W, C]`` batch, the decoded cache's own format, returning what the kernel
    returns for ``images.permute(0, 3, 1, 2).float() / 255``. Kernels whose work is 8-bit
    anyway (a JPEG codec) offer it to skip a float -> 8-bit pass; None when absent."""
    entry = getattr(kernel, "from_uint8", None)
    return entry if callable(entry) else None


#: Pixels (images x H x W) corrupted in one kernel call at most (``Evaluation._chunk``):
#: three batches of 64 at 32 px (2.4 MB of float RGB, cache-sized); one batch from 64 px.
CHUNK_PIXELS = 3 * 64 * 32 * 32
#: Decoded arrays up to this size are read into memory before the loop (larger ones stay
#: memory-mapped: ImageNet-C's 5,000 images at 224 px are 750 MB).
IN_MEMORY_BYTES = 64 << 20
#: Pixels per image up to which ``to_float_images`` converts the strided view directly.
SMALL_IMAGE_PIXELS = 64 * 64


def to_float_images(images: torch.Tensor) -> torch.Tensor:
    """uint8 ``[B, H, W, C]`` -> contiguous float ``[B, C, H, W]`` in [0, 1]."""
    # Kernels and the model take their fast paths on contiguous input. For large images,
    # transposing the uint8 bytes first, then converting in place, is several times faster
    # on the CPU than converting the strided view; for small ones (32 px: 0.09 vs 0.16 ms a
    # batch of 64) one strided conversion into the float batch wins. Same values.
    b, h, w, c = images.shape
    nchw = images.permute(0, 3, 1, 2)
    if h * w <= SMALL_IMAGE_PIXELS:
        out = torch.empty((b, c, h, w), device=images.device)
        return out.copy_(nchw).div_(255.0)
    return nchw.contiguous().float().div_(255.0)


def apply_shift(
    kernel: Callable[..., torch.Tensor],
    images: torch.Tensor,
    severity: int,
    generator: SampleGenerator,
    table: str,
) -> torch.Tensor:
    """``kernel(images, severity, generator=..., table=...)``, checked and clamped to [0, 1].

    uint8 ``[B, H, W, C]`` images go to the kernel's ``from_uint8`` entry (``uint8_entry``)
    when it has one, else they are converted (``to_float_images``) first."""
    expected = images.shape
    if images.dtype == torch.uint8:
        b, h, w, c = images.shape
        expected = torch.Size((b, c, h, w))
        entry = uint8_entry(kernel)
        if entry is None:
            images = to_float_images(images)
        else:
            kernel = entry
    takes_table = _TAKES_TABLE.get(kernel)
    if takes_table is None:  # inspect once per kernel, not per batch
        takes_table = _TAKES_TABLE[kernel] = "table" in inspect.signature(kernel).parameters
    kwargs: dict[str, Any] = {"generator": generator}
    if takes_table:
        kwargs["table"] = table
    out = kernel(images, severity, **kwargs)
    if out.shape != expected:
        raise ValueError(f"shift kernel changed the batch shape {expected} -> {out.shape}")
    return out.clamp_(0.0, 1.0)


def method_config_hash(method_config: Any) -> str:
    """A short hash of the resolved method config (part of the cell key)."""
    blob = json.dumps(config_dict(method_config), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


@dataclass
class _CellAcc:
    """What a cell accumulates over its batches (possibly several visits or mixed batches)."""

    n: int = 0
    correct: int = 0
    ref_correct: int = 0
    batches: int = 0
    wait_s: float = 0.0
    shift_s: float = 0.0
    method_s: float = 0.0
    adapt_s: float = 0.0  # the method's own "adapt" phases (a part of method_s)
    reference_s: float = 0.0
    untimed: int = 0  # samples of the FLOP-counted batch, left out of the times
    flops: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    logits: list[torch.Tensor] = field(default_factory=list)
    labels: list[torch.Tensor] = field(default_factory=list)


class Evaluation:
    """Runs a ``RunSpec`` and writes its results file after every finished group.

    ``bundle``: a prebuilt model bundle (benchmarks) instead of the registered factory.
    ``observer(seed, batch, images)``: called with every batch after the shift, before the
    method sees it (tests record the stream with it). ``max_batches``: stop after that many
    batches (``tta-bench profile``); the partial cells are still written.
    """

    def __init__(
        self,
        spec: RunSpec,
        output: Path,
        *,
        bundle: Any = None,
        observer: Callable[[int, Batch, torch.Tensor], None] | None = None,
        max_batches: int | None = None,
    ):
        self.spec = spec
        self.output = Path(output)
        self.protocol = spec.protocol
        self.device = resolve_device(spec.device)
        self.bundle = bundle
        self.observer = observer
        self.max_batches = max_batches
        self.loader_settings = resolve_settings(spec.loader, self.device)
        #: Filled by ``run()``: cells skipped because a previous run had finished them.
        self.skipped_cells = 0
        self._pixels_per_image = 0  # set by ``run()``
        self._generator_pool = GeneratorPool()  # per-sample generators, reused batch to batch
        #: Filled by ``run()``: seconds per phase over the whole run (profile).
        self.phase_seconds: dict[str, float] = {}
        if spec.batch_log:  # one log per run: start it empty, groups append
            Path(spec.batch_log).parent.mkdir(parents=True, exist_ok=True)
            Path(spec.batch_log).write_text("", encoding="utf-8")

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

    def _domains(self) -> list[Domain]:
        return [(s, int(v)) for s in self.protocol.shifts for v in self.protocol.severities]

    def _load_domains(self, size: int) -> dict[Domain, DomainStream]:
        """The split each domain is drawn from (the clean split for synthetic shifts)."""
        if self.protocol.shift_source == "synthetic":
            clean = self._stream()
            return {d: clean for d in self._domains()}
        return {d: self._stream(*d) for d in self._domains()}

    # -- resume --------------------------------------------------------------------------
    def _run_key(self, record: dict[str, Any]) -> dict[str, Any]:
        return record_key(record)

    def _previous(self, fresh: dict[str, Any]) -> dict[str, Any] | None:
        """The existing results record to continue, or None to start afresh."""
        # Temporary files of a write that a killed run left behind are never results.
        for stale in self.output.parent.glob(f".{self.output.name}.*.tmp"):
            stale.unlink(missing_ok=True)
        if not self.spec.resume or not self.output.exists():
            return None
        old = results.load_results(self.output)  # raises on a corrupt file: never overwrite it
        if self._run_key(old) != self._run_key(fresh):
            raise ResumeMismatchError(
                f"{self.output} holds a different run {self._run_key(old)}, not "
                f"{self._run_key(fresh)}; choose another output or set resume=false"
            )
        return old

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        spec, protocol, device = self.spec, self.protocol, self.device
        malloc.from_env()  # TTA_BENCH_MALLOC=keep: reuse big CPU buffers (tta_bench.malloc)
        torch.manual_seed(0)  # model construction must not depend on ambient state
        bundle = self.bundle or registry("models").get(spec.model)(**spec.model_args)
        size = bundle.preprocess.image_size
        sources = self._load_domains(size)
        kernels = (
            {s: registry("shifts").get(s) for s in protocol.shifts}
            if protocol.shift_source == "synthetic"
            else {}
        )
        # One decoded array per distinct split (synthetic domains all share the clean one).
        arrays: list[np.ndarray] = []
        array_ids: dict[int, int] = {}
        keep: dict[int, np.ndarray] = {}  # rows that decoded (all unless bad images skipped)
        skipped_images: dict[str, list[dict[str, Any]]] = {}
        for src in sources.values():
            if id(src) not in array_ids:
                array_ids[id(src)] = len(arrays)
                dec = decode(src, size, progress=spec.progress, on_bad_image=spec.on_bad_image)
                keep[id(src)] = np.setdiff1d(np.arange(len(src)), dec.skipped)
                images = dec.images[keep[id(src)]] if dec.skipped else dec.images
                # A small decoded array is read into memory once, here in setup: gathering
                # batches from the memory map pays page faults inside the loop.
                if isinstance(images, np.memmap) and images.nbytes <= IN_MEMORY_BYTES:
                    images = np.array(images)
                arrays.append(images)
                if dec.skipped:
                    skipped_images[src.name] = dec.bad
        labels = {d: src.labels[keep[id(src)]] for d, src in sources.items()}
        # Decoded images are all ``size`` square: H x W pixels each (``_chunk``'s budget).
        self._pixels_per_image = int(arrays[0].shape[1] * arrays[0].shape[2]) if arrays else 0

        record = self._new_record(bundle, device)
        record["skipped_images"] = skipped_images
        previous = self._previous(record)
        done: set[tuple[str, int, int]] = set()
        if previous is not None:
            record["created"] = previous["created"]
            record["parameters"] = previous.get("parameters")
            record["cells"] = list(previous["cells"])
            done = {(c["shift"], int(c["severity"]), int(c["seed"])) for c in record["cells"]}

        streams: list[Stream] = []
        for seed in spec.seeds:
            stream = build_stream(protocol, seed, labels)
            finished = {
                g
                for g, doms in enumerate(stream.groups)
                if all((*stream.domains[d], seed) in done for d in doms)
            }
            # A stateful seed only counts as done whole: drop a partial one and redo it.
            for g, doms in enumerate(stream.groups):
                if g not in finished:
                    keys = {(*stream.domains[d], seed) for d in doms}
                    record["cells"] = [
                        c
                        for c in record["cells"]
                        if (c["shift"], int(c["severity"]), int(c["seed"])) not in keys
                    ]
            self.skipped_cells += sum(len(stream.groups[g]) for g in finished)
            streams.append(stream.without_groups(finished))
        record["skipped_cells"] = self.skipped_cells
        record["summary"] = results.summarize(record["cells"])
        record.pop("finished", None)
        self._save(record)

        plan = [(s.seed, b, s) for s in streams for b in s.batches]
        if self.max_batches is not None:
            plan = plan[: self.max_batches]
        domain_list = self._domains() if not plan else list(plan[0][2].domains)
        array_of_domain = [array_ids[id(sources[d])] for d in domain_list]
        dataset = StreamBatches(
            [b for _, b, _ in plan], arrays, array_of_domain, [labels[d] for d in domain_list]
        )
        loader = make_loader(dataset, self.loader_settings, seed=spec.seeds[0])

        from tqdm.auto import tqdm

        bar = tqdm(
            total=len(plan),
            desc=f"{spec.method} on {protocol.name}",
            unit="batch",
            disable=not spec.progress,
        )
        bases: dict[tuple[str, ...], ZeroShotClassifier] = {}

        def base_for(d: int) -> ZeroShotClassifier:
            src = sources[domain_list[d]]
            key = (*src.classnames, "\x1f", *src.templates)
            if key not in bases:
                bases[key] = ZeroShotClassifier(bundle, src.classnames, src.templates).to(device)
            return bases[key]

        for d in range(len(domain_list)):
            base_for(d)  # text embeddings are setup, not loop time
        timer = PhaseTimer(device)
        loop_start = time.perf_counter()
        n_images = 0
        it = iter(loader)
        k = 0
        # Cell snapshots are written in the background (the loop does not wait on fsync);
        # closing the writer, also on an error or Ctrl-C, saves every finished cell.
        writer = results.SnapshotWriter(self.output)
        try:
            while k < len(plan):
                seed, first, stream = plan[k]
                end = k + 1
                while (
                    end < len(plan) and plan[end][0] == seed and plan[end][1].group == first.group
                ):
                    end += 1
                group, k = plan[k:end], end
                cells = self._run_group(seed, stream, group, it, base_for, kernels, timer, bar)
                n_images += sum(len(b) for _, b, _ in group)
                if record["parameters"] is None and self._last_method is not None:
                    m = self._last_method
                    record["parameters"] = {
                        "trainable": sum(p.numel() for p in m.trainable_parameters()),
                        "total": count_parameters(m.model),
                    }
                record["cells"].extend(cells)
                record["summary"] = results.summarize(record["cells"])
                writer.submit(record)
        finally:
            writer.close()
        bar.close()
        loop_s = time.perf_counter() - loop_start
        self.phase_seconds = dict(timer.seconds)
        record["loop"] = {
            "images": n_images,
            "batches": len(plan),
            "wall_s": loop_s,
            "images_per_s": n_images / loop_s if n_images else None,
            "loader": self.loader_settings.as_dict(),
        }
        record["finished"] = results.now_iso()
        self._save(record)
        return record

    _last_method: Method | None = None

    def _new_method(self, base: ZeroShotClassifier, seed: int) -> Method:
        seed_torch(stable_seed(self.spec.method, "setup", seed) % 2**63, self.device)
        method_cls = registry("methods").get(self.spec.method)
        if method_cls.adapts:
            # The tokenizer is stateless and its BPE tables make deepcopy take ~1 s: share it.
            model = copy.deepcopy(base, memo={id(base.tokenizer): base.tokenizer})
        else:
            model = base  # the contract: a method with adapts=False never changes the model
        method = build_method(self.spec.method, model, self.spec.method_config)
        method.setup()
        self._last_method = method
        return method

    def _run_group(
        self,
        seed: int,
        stream: Stream,
        group: list[tuple[int, Batch, Stream]],
        it: Any,
        base_for: Callable[[int], ZeroShotClassifier],
        kernels: dict[str, Callable[..., torch.Tensor]],
        timer: PhaseTimer,
        bar: Any,
    ) -> list[dict[str, Any]]:
        """Run the batches of one group with a fresh method; return its cells."""
        protocol, device, spec = self.protocol, self.device, self.spec
        dataset_source = protocol.shift_source == "dataset"
        first = group[0][1]
        base = base_for(first.single_domain() if first.single_domain() is not None else 0)
        method = self._new_method(base, seed)
        counter = PassCounter(method.model.visual)
        accs: dict[int, _CellAcc] = {}
        cell_batches: dict[int, int] = {}
        score_reference = (spec.reference and spec.method != "zeroshot") or bool(spec.batch_log)
        # closed after the loop (a with-block would re-indent the whole loop)
        log = open(spec.batch_log, "a", encoding="utf-8") if spec.batch_log else None  # noqa: SIM115
        with PeakMemory(device) as mem:
            # Corrupted inputs of later batches, made together with an earlier one.
            ready: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            for pos, (_, batch, _) in enumerate(group):
                dom = batch.single_domain()
                if dataset_source and dom is not None and base_for(dom) is not base:
                    if protocol.stateful:
                        raise ValueError(
                            f"protocol {protocol.name!r} ({protocol.reset}) streams domains with "
                            "different label sets through one method; use reset_each_shift"
                        )
                    base = base_for(dom)
                    method = self._new_method(base, seed)
                    counter.close()
                    counter = PassCounter(method.model.visual)
                seconds_before = dict(timer.seconds)
                passes_before = (counter.forward, counter.backward)
                adapt_before = method.timings.get("adapt", 0.0)
                doms = [dom] if dom is not None else [int(d) for d in np.unique(batch.domains)]
                counting = spec.flops and any(d not in accs for d in doms)
                if batch.number in ready:  # corrupted with an earlier batch of its cell
                    x, y = ready.pop(batch.number)
                else:
                    chunk = self._chunk(group, pos, kernels)
                    x, y = self._inputs(chunk, stream, seed, it, kernels, timer, ready)
                if self.observer is not None:
                    self.observer(seed, batch, x)
                with timer.phase("method"), _flop_counter(counting) as flop_counter:
                    if batch.reset_before:
                        method.reset()
                    if dom is not None:
                        b = cell_batches.get(dom, 0)
                        cell_batches[dom] = b + 1
                        shift, severity = stream.domains[dom]
                        method.reseed(stable_seed("batch", seed, shift, severity, b) % 2**63)
                    else:
                        method.reseed(stable_seed("batch", seed, "mixed", batch.number) % 2**63)
                    logits = method.step(x).detach().float()
                # Passes are the method's own: read them before the reference forward, which
                # may run through the same (shared, frozen) tower for parameter-free methods.
                fwd = counter.forward - passes_before[0]
                bwd = counter.backward - passes_before[1]
                ref_pred = None
                if score_reference:
                    with timer.phase("reference"), torch.no_grad():
                        ref_pred = base(x).argmax(dim=1)
                pred = logits.argmax(dim=1)
                logits_cpu, y_cpu = logits.cpu(), y.cpu()
                hit = (pred == y).cpu()
                ref_hit = (ref_pred == y).cpu() if ref_pred is not None else None
                spent = {k: timer.seconds[k] - seconds_before.get(k, 0.0) for k in timer.seconds}
                adapt_spent = method.timings.get("adapt", 0.0) - adapt_before
                flops = flop_counter.get_total_flops() if counting else 0
                if log is not None:
                    loss = method.last_loss if method.adapts else None
                    _log_batch(log, seed, batch, stream, loss, hit, ref_hit, spent, device)
                rows = (
                    [(dom, slice(None))]
                    if dom is not None
                    else [(int(d), batch.domains == d) for d in np.unique(batch.domains)]
                )
                for d, sel in rows:
                    acc = accs.setdefault(d, _CellAcc())
                    if not isinstance(sel, slice):
                        sel = torch.from_numpy(sel)
                    m = int(hit[sel].numel())
                    share = m / len(batch)
                    acc.n += m
                    acc.correct += int(hit[sel].sum())
                    if ref_hit is not None:
                        acc.ref_correct += int(ref_hit[sel].sum())
                    acc.batches += 1
                    if counting:  # FLOP counting slows the batch down: leave it untimed
                        acc.untimed += m
                        acc.flops += share * flops
                    else:
                        acc.wait_s += share * spent.get("data", 0.0)
                        acc.shift_s += share * spent.get("shift", 0.0)
                        acc.method_s += share * spent.get("method", 0.0)
                        acc.adapt_s += share * min(adapt_spent, spent.get("method", 0.0))
                        acc.reference_s += share * spent.get("reference", 0.0)
                    acc.forward += share * fwd
                    acc.backward += share * bwd
                    acc.logits.append(logits_cpu[sel])
                    acc.labels.append(y_cpu[sel])
                bar.update(1)
        counter.close()
        if log is not None:
            log.close()
        cells = [self._cell(seed, stream.domains[d], accs[d], mem) for d in sorted(accs.keys())]
        if cells:
            last = cells[-1]
            bar.set_postfix(
                shift=last["shift"], sev=last["severity"], acc=f"{last['accuracy']:.3f}"
            )
        return cells

    def _chunk(
        self,
        group: list[tuple[int, Batch, Stream]],
        pos: int,
        kernels: dict[str, Callable[..., torch.Tensor]],
    ) -> list[Batch]:
        """``group[pos]``'s batch and the batches right after it that can be corrupted in
        the same kernel call: same single domain (hence the same cell), at most
        ``CHUNK_PIXELS`` pixels in all. One call per chunk instead of one per batch spares
        the kernels' fixed per-call costs (small images), and the result is the same: a
        kernel's output for a sample does not depend on the batch it is in (its randomness
        is keyed by the sample's index). Chunks are off when FLOPs are counted (the first
        batch of each cell is measured alone there)."""
        first = group[pos][1]
        dom = first.single_domain()
        chunk = [first]
        if not kernels or dom is None or self.spec.flops:
            return chunk
        pixels = self._pixels_per_image * len(first)
        for _, nxt, _ in group[pos + 1 :]:
            pixels += self._pixels_per_image * len(nxt)
            if nxt.single_domain() != dom or pixels > CHUNK_PIXELS:
                break
            chunk.append(nxt)
        return chunk

    def _inputs(
        self,
        chunk: list[Batch],
        stream: Stream,
        seed: int,
        it: Any,
        kernels: dict[str, Callable[..., torch.Tensor]],
        timer: PhaseTimer,
        ready: dict[int, tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Load ``chunk``'s batches, move them to the device, convert and corrupt them in
        one go; return the first batch's ``(images, labels)`` and leave the others' in
        ``ready`` (keyed by batch number)."""
        device, non_blocking = self.device, self.loader_settings.pin_memory
        first = chunk[0]
        with timer.phase("data"):
            images, labels = [], []
            for batch in chunk:
                item = next(it)
                assert item["number"] == batch.number, "loader out of stream order"
                images.append(item["images"].to(device, non_blocking=non_blocking))
                labels.append(item["labels"].to(device, non_blocking=non_blocking))
            x = images[0] if len(chunk) == 1 else torch.cat(images)
            # NHWC uint8 -> NCHW float in [0, 1], unless this batch's kernel takes the uint8
            # batch itself (``uint8_entry``).
            if not self._takes_uint8(first, stream, kernels):
                x = to_float_images(x)
        with timer.phase("shift"):
            if kernels:
                indices = (
                    first.indices if len(chunk) == 1 else np.concatenate([b.indices for b in chunk])
                )
                x = self._shift(x, first, stream, seed, kernels, indices=indices)
        if len(chunk) == 1:
            return x, labels[0]
        parts = torch.split(x, [len(b) for b in chunk])
        for batch, xb, yb in zip(chunk[1:], parts[1:], labels[1:]):
            ready[batch.number] = (xb, yb)
        return parts[0], labels[0]

    def _takes_uint8(
        self, batch: Batch, stream: Stream, kernels: dict[str, Callable[..., torch.Tensor]]
    ) -> bool:
        """Whether ``batch`` goes to its shift kernel as uint8 (one domain, a kernel with a
        ``from_uint8`` entry); mixed batches are converted once for all their kernels."""
        dom = batch.single_domain()
        if not kernels or dom is None:
            return False
        return uint8_entry(kernels[stream.domains[dom][0]]) is not None

    def _shift(
        self,
        x: torch.Tensor,
        batch: Batch,
        stream: Stream,
        seed: int,
        kernels: dict[str, Callable[..., torch.Tensor]],
        indices: np.ndarray | None = None,
    ) -> torch.Tensor:
        """Corrupt ``x`` on its device; a mixed batch is corrupted domain by domain. For a
        single-domain ``batch``, ``indices`` (default: the batch's) are the dataset indices
        of ``x``'s rows (a chunk of several batches of that domain)."""
        table, pool = self.protocol.severity_table, self._generator_pool
        dom = batch.single_domain()
        if dom is not None:
            shift, severity = stream.domains[dom]
            rows = batch.indices if indices is None else indices
            gen = SampleGenerator.for_samples(
                rows, seed, shift, severity, device=x.device, pool=pool
            )
            try:
                return apply_shift(kernels[shift], x, severity, gen, table)
            finally:
                gen.release()
        out = torch.empty_like(x)
        for d in np.unique(batch.domains):
            shift, severity = stream.domains[int(d)]
            sel_np = batch.domains == d
            sel = torch.from_numpy(np.flatnonzero(sel_np)).to(x.device)
            gen = SampleGenerator.for_samples(
                batch.indices[sel_np], seed, shift, severity, device=x.device, pool=pool
            )
            try:
                out[sel] = apply_shift(kernels[shift], x[sel], severity, gen, table)
            finally:
                gen.release()
        return out

    def _cell(self, seed: int, domain: Domain, acc: _CellAcc, mem: PeakMemory) -> dict[str, Any]:
        """The results entry of one cell."""
        shift, severity = domain
        n = acc.n
        data_s = acc.wait_s + acc.shift_s
        method_s = acc.method_s
        timed = n - acc.untimed  # times are per timed sample; None when none was timed

        def per_sample(seconds: float) -> float | None:
            return seconds / timed if timed else None

        is_zeroshot = self.spec.method == "zeroshot"
        logits, labels = torch.cat(acc.logits), torch.cat(acc.labels)
        cell = {
            "shift": shift,
            "severity": severity,
            "seed": seed,
            "n": n,
            **metrics.compute_all(logits, labels),
            "error": 1.0 - acc.correct / n,
            "reference_accuracy": (
                (acc.correct / n if is_zeroshot else acc.ref_correct / n)
                if self.spec.reference
                else None
            ),
            "time_per_sample_s": per_sample(method_s + data_s),
            "method_time_per_sample_s": per_sample(method_s),
            "data_time_per_sample_s": per_sample(data_s),
            "data_wait_time_per_sample_s": per_sample(acc.wait_s),
            "shift_time_per_sample_s": per_sample(acc.shift_s),
            # adaptation (forward + backward + step, resets) vs the rest of the method's step
            "adapt_time_per_sample_s": per_sample(acc.adapt_s),
            "predict_time_per_sample_s": per_sample(method_s - acc.adapt_s),
            "timed_samples": timed,
            "data_wait_share": data_s / max(method_s + data_s, 1e-12),
            "samples_per_s": timed / max(method_s + data_s, 1e-12) if timed else None,
            # Stateful groups share one measurement window: the group's peak.
            "peak_memory_bytes": mem.peak_bytes,
            "peak_memory_kind": mem.kind,
            "forward_passes_per_sample": acc.forward / n,
            "backward_passes_per_sample": acc.backward / n,
            "batches": acc.batches,
            "finished": results.now_iso(),
        }
        if self.spec.flops:
            cell["flops_per_sample"] = acc.flops / max(acc.untimed, 1)
        if self.spec.per_class_accuracy:
            cell["per_class_accuracy"] = metrics.per_class_accuracy(logits, labels, logits.shape[1])
        return cell

    # -- the record ----------------------------------------------------------------------
    def _new_record(self, bundle: Any, device: torch.device) -> dict[str, Any]:
        spec = self.spec
        plugins = [
            provenance("methods", spec.method),
            provenance("datasets", self.protocol.dataset),
        ]
        if self.bundle is None:
            plugins.insert(1, provenance("models", spec.model))
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
            "method_config_hash": method_config_hash(spec.method_config),
            "model": {
                "name": spec.model,
                "weights": bundle.weights,
                # what a number depends on: the exact weights (file and loaded state)
                "weights_sha256": getattr(bundle, "weights_sha256", None),
                "state_sha256": state_sha256(bundle.clip),
                "args": spec.model_args,
            },
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
                "cpu_malloc": malloc.policy(),
                "torch": torch.__version__,
                "precision": _precision(spec.method_config, device),
                "plugins": plugins,
            },
            "cells": [],
            "summary": results.summarize([]),
        }

    def _save(self, record: dict[str, Any]) -> None:
        results.write_json_atomic(self.output, record)


def _flop_counter(counting: bool) -> Any:
    """A FLOP counter over the block when ``counting``, else a context yielding None."""
    if not counting:
        return contextlib.nullcontext()
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(display=False)


def _precision(method_config: Any, device: torch.device) -> dict[str, Any]:
    """Parameter dtype, the configured precision and what it means on ``device`` (autocast
    on CUDA only; float32 on the CPU)."""
    configured = getattr(method_config, "precision", "fp32")
    return {
        "dtype": "float32",
        "configured": configured,
        "autocast": None if effective_precision(configured, device) == "fp32" else configured,
    }


def _log_batch(
    log: Any,
    seed: int,
    batch: Batch,
    stream: Stream,
    loss: Any,
    hit: torch.Tensor,
    ref_hit: torch.Tensor | None,
    spent: dict[str, float],
    device: torch.device,
) -> None:
    """One JSONL line per batch: accuracy of the frozen source model ("before") and of the
    method ("after") on it, the method's last loss, seconds per phase and memory now. When
    several batches of a cell are corrupted together (``Evaluation._chunk``), the first of
    them carries the data and shift seconds of all."""
    dom = batch.single_domain()
    shift, severity = stream.domains[dom] if dom is not None else ("mixed", None)
    memory = torch.cuda.memory_allocated(device) if device.type == "cuda" else _rss_bytes()
    line = {
        "seed": seed,
        "batch": batch.number,
        "shift": shift,
        "severity": severity,
        "n": len(batch),
        "loss": None if loss is None else float(loss),
        "accuracy_before": None if ref_hit is None else float(ref_hit.float().mean()),
        "accuracy_after": float(hit.float().mean()),
        "seconds": {k: v for k, v in sorted(spent.items())},
        "memory_bytes": int(memory),
        "memory_kind": "cuda_allocated" if device.type == "cuda" else "cpu_rss",
    }
    log.write(json.dumps(line) + "\n")


def spec_key(spec: RunSpec) -> dict[str, Any]:
    """The run part of the cell key: model, method + config hash, protocol id."""
    return {
        "model": spec.model,
        "model_args": spec.model_args,
        "method": spec.method,
        "method_config_hash": method_config_hash(spec.method_config),
        "protocol_id": spec.protocol.id,
    }


def record_key(record: dict[str, Any]) -> dict[str, Any]:
    """The run part of the cell key of a results record (compare with ``spec_key``)."""
    return {
        "model": record["model"]["name"],
        "model_args": record["model"].get("args"),
        "method": record["method"],
        "method_config_hash": record.get("method_config_hash"),
        "protocol_id": record["protocol"]["id"],
    }


def finished_record(spec: RunSpec, output: Path) -> dict[str, Any] | None:
    """The record in ``output`` when it already holds every cell of ``spec``, else None.

    Lets a rerun of a finished run (or sweep job) return before building the model or
    touching the data. Raises ``ValueError`` for a corrupt or foreign-schema file.
    """
    output = Path(output)
    if not spec.resume or not output.exists():
        return None
    old = results.load_results(output)
    if record_key(old) != spec_key(spec) or not old.get("finished"):
        return None  # a different run (Evaluation reports it) or an unfinished one
    p = spec.protocol
    sevs = sorted(set(p.severities)) if p.reset == "gradual" else p.severities
    want = {(s, int(v), int(seed)) for seed in spec.seeds for s in p.shifts for v in sevs}
    have = {(c["shift"], int(c["severity"]), int(c["seed"])) for c in old["cells"]}
    if not want <= have:
        return None
    old["skipped_cells"] = len(want)
    return old


def run(spec: RunSpec, output: Path, **kwargs: Any) -> dict[str, Any]:
    """Run ``spec`` into ``output`` (resuming it when it holds the same run); see
    ``Evaluation`` for ``kwargs``. A finished run is returned as is, without any work."""
    if kwargs.get("max_batches") is None:
        done = finished_record(spec, output)
        if done is not None:
            return done
    start = time.perf_counter()
    record = Evaluation(spec, output, **kwargs).run()
    record["wall_time_s"] = time.perf_counter() - start
    results.write_json_atomic(Path(output), record)
    return record
