"""The evaluation loop: one method, one protocol, several seeds -> cells.

``Evaluation.run`` sets up (model, inputs, resume, the results file), then for every group
of every seed's stream calls ``run_group``: the per-batch path, readable top to bottom in
one screen: get the batch, corrupt it, step the method, check it, score it, fold it into its
cell. The rest lives in modules named for their job: ``tta_bench.run.inputs`` (sources,
loader, shift kernels, text heads), ``tta_bench.run.accounting`` (costs and cell entries),
``tta_bench.run.resume`` (which cells a file already holds), ``tta_bench.run.results`` (the locked,
merging, atomic writer), ``tta_bench.run.record`` (what a record says about its run) and
``tta_bench.run.trackers`` (the experiment trackers that observe the finished cells).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tta_bench.method import Method
from tta_bench.model import ZeroShotClassifier, count_parameters
from tta_bench.paths import AtomicLog
from tta_bench.registry import registry
from tta_bench.rng import stable_seed
from tta_bench.run import openset, results, resume, samples, shard
from tta_bench.run.accounting import CellBook, CostMeter, log_batch, non_finite
from tta_bench.run.cost import PeakMemory
from tta_bench.run.features import FeatureStore
from tta_bench.run.inputs import RunInputs
from tta_bench.run.realtime import Pace
from tta_bench.run.record import new_record
from tta_bench.run.resume import finished_record
from tta_bench.run.spec import RunSpec, resolve_device
from tta_bench.run.stream import Batch, Stream, build_stream
from tta_bench.run.trackers import Trackers

__all__ = ["Evaluation", "run"]

#: The share of the loop's time that snapshots of the results file may take: after a
#: snapshot that cost c seconds (summary and serialisation), the next waits until
#: ``c * (1 / SNAPSHOT_SHARE - 1)`` seconds have passed. A small file is written after every
#: group; thousands of short groups over a large file (``protocol.orders``) are spaced. The
#: last groups are written with the run, or when it stops on an error.
SNAPSHOT_SHARE = 0.05


def seed_torch(seed: int, device: torch.device) -> None:
    """Seed the generators a run on ``device`` uses (the CPU one; CUDA's too on CUDA)."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)


class Evaluation:
    """Runs a ``RunSpec`` and writes its results file after every finished group.

    ``bundle``: a prebuilt model bundle (benchmarks) instead of the registered factory.
    ``observer(seed, batch, images)``: called with every batch after the shift, before the
    method sees it (tests record the stream with it). ``max_batches``: stop after that many
    batches (``tta-bench profile``); the partial cells are still written.
    ``on_cells(cells, record)``: called after every finished group, once the results file
    has been handed the record, with the group's new cells (the last of ``record["cells"]``)
    and the record (experiment trackers, ``tta_bench.run.trackers``); never with the cells a
    resumed run skipped.
    """

    def __init__(
        self,
        spec: RunSpec,
        output: Path,
        *,
        bundle: Any = None,
        observer: Callable[[int, Batch, torch.Tensor], None] | None = None,
        max_batches: int | None = None,
        on_cells: Callable[[list[dict[str, Any]], dict[str, Any]], None] | None = None,
    ):
        self.spec = spec
        self.output = Path(output)
        self.protocol = spec.protocol
        self.device = resolve_device(spec.device)
        self.bundle = bundle
        self.observer = observer
        self.max_batches = max_batches
        self.on_cells = on_cells
        #: Filled by ``run()``: cells skipped because a previous run had finished them.
        self.skipped_cells = 0
        #: Filled by ``run()``: seconds per phase over the whole run (profile).
        self.phase_seconds: dict[str, float] = {}
        #: ``{seed: {batch number: the method's seed for that batch}}`` (``batch_seeds``).
        self.batch_seeds: dict[int, dict[int, int]] = {}
        self.meter = CostMeter(self.device)
        self._log: Any = None

    # -- setup ---------------------------------------------------------------------------
    def _setup(self) -> tuple[dict[str, Any], list[Stream]]:
        """Model, inputs, the record (resumed or new) and the streams still to run."""
        spec = self.spec
        seed_torch(0, self.device)  # model construction must not depend on ambient state
        from_registry = self.bundle is None
        self.bundle = self.bundle or registry("models").get(spec.model)(**spec.model_args)
        self.inputs = RunInputs.build(
            self.protocol,
            self.bundle,
            self.device,
            data_dir=spec.data_dir,
            cache=spec.cache,
            loader=spec.loader,
            progress=spec.progress,
            on_bad_image=spec.on_bad_image,
            shift_cache=spec.shift_cache,
        )
        self.method_cls = registry("methods").get(spec.method)
        record = new_record(spec, self.bundle, self.device, from_registry=from_registry)
        previous = resume.previous_record(self.output, record, spec.resume)
        done: set[resume.CellKey] = set()
        if previous is not None:
            record["created"] = previous["created"]
            record["parameters"] = previous.get("parameters")
            record["cells"] = list(previous["cells"])
            done = {resume.cell_key(c) for c in record["cells"]}
        self.log_samples = spec.log_samples
        if spec.log_samples_auto and previous is not None and _lacks_samples(self.output, previous):
            self.log_samples = None  # auto: an output without per-sample files stays so
        streams, finished = [], {}
        for seed in spec.seeds:
            stream = build_stream(self.protocol, seed, self.inputs.labels)
            self.batch_seeds[seed] = batch_seeds(stream)  # of the whole stream, before a shard
            if spec.shard is not None:  # the whole stream's layout, checked by the merge
                record.setdefault("stream_layout", []).extend(shard.stream_layout(stream))
                stream = shard.take(stream, spec.shard)
            finished[seed] = resume.done_groups(stream, done)
            self.skipped_cells += sum(len(stream.groups[g]) for g in finished[seed])
            streams.append(stream.without_groups(finished[seed]))
        record["cells"] = resume.drop_unfinished(record["cells"], streams, finished)
        self.features = FeatureStore() if self._replays_features() else None
        record["seeds"] = sorted(set(spec.seeds) | {int(c["seed"]) for c in record["cells"]})
        record["skipped_cells"] = self.skipped_cells
        record["summary"] = results.summarize(record["cells"])
        return record, streams

    def _replays_features(self) -> bool:
        """Whether the run replays cached image features (``tta_bench.run.features``): a
        protocol with ``orders``, ``feature_cache=auto``, and a method whose instances read
        their images only through their features (a set-up instance is asked)."""
        spec = self.spec
        if spec.feature_cache != "auto" or not self.protocol.orders or self.observer:
            return False
        if self.method_cls.features_only is Method.features_only:
            return False
        probe = self._fresh_method(self.inputs.base(self.inputs.domains[0]), spec.seeds[0])
        return bool(probe.features_only())

    def _fresh_method(
        self, base: ZeroShotClassifier, seed: int, stream_length: int | None = None
    ) -> Method:
        """A new method instance on its own copy of ``base`` (shared when it never adapts),
        given its source images when it asks for them, set up."""
        seed_torch(stable_seed(self.spec.method, "setup", seed) % 2**63, self.device)
        # A method with adapts=False never changes the model (the contract): no copy.
        model = copy.deepcopy(base) if self.method_cls.adapts else base
        method = self.method_cls(model, self.spec.config_for(base.dataset))
        method.stream_length = stream_length
        needed = method.source_images_needed()
        if needed:
            if method.needs_source_labels:
                method.set_source(*self.source_images(needed, labels=True))
            else:
                method.set_source(self.source_images(needed))
        method.setup()
        return method

    def source_images(self, n: int, labels: bool = False) -> Any:
        """``n`` clean images of the protocol's declared source split (with their labels:
        ``(images, labels)``)."""
        from tta_bench.run.inputs import source_images

        return source_images(
            self.protocol, self.bundle, n, self.spec.data_dir, self.device, labels=labels
        )

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        record, streams = self._setup()
        writer = results.SnapshotWriter(self.output)
        if record["cells"]:  # a resumed file, its unfinished cells dropped; a new run's file
            writer.submit(record)  # appears with its first finished group
        plan = [(s, b) for s in streams for b in s.batches][: self.max_batches]
        if self.features is not None and plan:  # every image encoded once, then replayed
            self.features.fill(self.inputs, self.protocol.noise_seed(0), self.meter.timer,
                               self.spec.progress)  # fmt: skip
            record["feature_cache"] = {
                "images_encoded": self.features.encoded,
                "encode_s": self.features.seconds,
            }
            it = _Batches(iter(()))
        else:
            it = _Batches(self.inputs.loader([b for _, b in plan], self.spec.seeds[0]))
        from tqdm.auto import tqdm

        bar = tqdm(
            total=len(plan),
            desc=f"{self.spec.method} on {self.protocol.name}",
            unit="batch",
            disable=not self.spec.progress,
        )
        if self.spec.batch_log:  # one log per run: start it empty; whole after each group
            self._log = AtomicLog(self.spec.batch_log)
        loop_start, k = time.perf_counter(), 0
        saved, next_snapshot = len(record["cells"]), 0.0  # what the writer holds, and when
        try:
            while k < len(plan):  # one group: consecutive batches of one seed and group
                stream, first = plan[k]
                end = k + 1
                while (
                    end < len(plan)
                    and plan[end][0] is stream
                    and (plan[end][1].group == first.group)
                ):
                    end += 1
                group, k = [b for _, b in plan[k:end]], end
                cells = self.run_group(stream, group, it, bar, record)
                record["cells"].extend(cells)
                if time.perf_counter() >= next_snapshot:  # unless over their share
                    # the first snapshot pays one-time costs (the summary's imports): the
                    # spacing starts from the second
                    due = _snapshot(writer, record)
                    next_snapshot = due if saved else 0.0
                    saved = len(record["cells"])
                if self._log is not None:
                    self._log.flush()
                if self.on_cells is not None:  # trackers: the new cells only
                    self.on_cells(cells, record)
        finally:
            try:
                if len(record["cells"]) != saved:  # the groups since the last snapshot
                    _snapshot(writer, record)
            finally:
                it.close()  # loader workers end now, not when a traceback's frames go
                writer.close()  # also on an error or Ctrl-C: every finished group is saved
                self.meter.close()
                bar.close()
                if self._log is not None:
                    self._log.close()
        loop_s = time.perf_counter() - loop_start
        self.phase_seconds = dict(self.meter.timer.seconds)
        n_images = sum(len(b) for _, b in plan)
        record["loop"] = {
            "images": n_images,
            "batches": len(plan),
            "wall_s": loop_s,
            "images_per_s": n_images / loop_s if n_images else None,
            "loader": self.inputs.loader_settings.as_dict(),
            "sources": [getattr(s, "kind", "?") for s in self.inputs.sources],
        }
        if self.inputs.shifted is not None:  # batches served from the shifted-image cache
            record["loop"]["shift_cache"] = self.inputs.shifted.stats()
        record["skipped_images"] = self.inputs.bad_images
        record["finished"] = results.now_iso()
        return writer.file.write(record)

    def run_group(
        self, stream: Stream, group: list[Batch], it: Any, bar: Any, record: dict[str, Any]
    ) -> list[dict[str, Any]]:
        """Run one group's batches through a fresh method; return its cells."""
        spec, seed = self.spec, stream.seed
        base = self.inputs.base(stream.domains[_first_domain(group[0])])
        # samples until the protocol's next reset: the group's first run of batches
        first_reset = next((i for i, b in enumerate(group) if i and b.reset_before), len(group))
        method = self._fresh_method(base, seed, sum(len(b) for b in group[:first_reset]))
        self.meter.watch(method)
        _record_parameters(record, method)
        book = CellBook(
            stream,
            reference=spec.reference,
            is_reference=self.method_cls.is_reference,
            per_class=spec.per_class_accuracy,
            ood_score=self.protocol.ood["score"] if self.protocol.ood else "msp",
        )
        state = _GroupState(method, base, book, Pace(bool(self.protocol.realtime)))
        with PeakMemory(self.device) as memory:
            for batch in group:
                self._run_batch(stream, batch, it, state)
                bar.update(1)
        resolved = method.resolved_settings()
        if resolved:
            record["method_resolved"] = resolved
        if self.log_samples:  # before the results file lists the cells
            names = {d: s.name for d, s in self.inputs.streams.items()}
            label, run_key = samples.method_label(record), results.record_key(record, True)
            for cell in book.samples(seed, names):
                samples.write_cell(
                    samples.samples_dir(self.output), label, cell,
                    spec.log_samples_top_k, self.log_samples == "logits", run_key=run_key,
                )  # fmt: skip
        cells = book.entries(seed, memory)
        state.pace.annotate(cells)
        return cells

    def _batch_inputs(
        self, it: Any, batch: Batch, stream: Stream
    ) -> tuple[torch.Tensor, torch.Tensor, Batch]:
        """The batch's images (corrupted) or, replaying features, its image features; its
        labels; its kept rows."""
        if self.features is not None:
            with self.meter.phase("data"):
                return self.features.take(batch, stream, self.inputs.labels, self.device)
        noise = self.protocol.noise_seed(stream.seed)
        return self.inputs.next_batch(it, batch, stream, noise, self.meter)

    def _run_batch(self, stream: Stream, batch: Batch, it: Any, state: _GroupState) -> None:
        """One batch: its inputs, the method's step (or, on the realtime track while the
        method is busy, its prediction), the checks, the reference, and the cell's books."""
        spec, meter, method, book = self.spec, self.meter, state.method, state.book
        count_flops = spec.flops and not book.seen(_first_domain(batch))
        replay = self.features is not None
        with meter.batch(count_flops) as measured:
            x, y, batch = self._batch_inputs(it, batch, stream)
            if len(batch) == 0:  # every image of it was skipped as unreadable
                return
            if self.observer is not None:
                self.observer(stream.seed, batch, x)
            adapted = state.pace.adapts_now()
            if state.diverged is None:
                with meter.phase("method"), measured.flop_mode:
                    if batch.reset_before:
                        method.reset()
                    method.reseed(self.batch_seeds[stream.seed][batch.number])
                    method.last_ood_score = method.last_ood_decision = None
                    if replay:
                        logits = method.step_features(x).detach().float()
                    else:
                        logits = (method.step(x) if adapted else method.predict(x)).detach()
                        logits = logits.float()
                if replay:  # the features stand for one tower pass per image
                    measured.add_forward(len(batch))
                measured.passes_done()
                state.pace.done(batch, stream, adapted, *measured.passes())
                loss = method.last_loss if method.adapts and adapted else None
                *own, own_problem = openset.take_own(method, len(batch))
                state.diverged = non_finite(logits, loss) or own_problem
                if state.diverged is not None:  # later batches: the state is lost from here
                    state.diverged_at = batch.number
            ref = None
            if state.diverged is None and self.method_cls.is_reference:
                ref = logits.argmax(dim=1)  # the frozen model is its own reference: no rerun
            elif state.diverged is None and (spec.reference or self._log is not None):
                with meter.phase("reference"), torch.no_grad():
                    ref = state.base.logits_from_features(x) if replay else state.base(x)
                    ref = ref.argmax(dim=1)
        if state.diverged is not None:  # reported, never scored; the state is lost
            book.diverge(batch, state.diverged, at=state.diverged_at)
            return
        book.fold(batch, logits, y, ref if spec.reference else None, measured.cost, tuple(own))
        if self._log is not None:
            log_batch(self._log, stream.seed, batch, stream, loss, logits, y, ref,
                      measured.cost, self.device)  # fmt: skip


class _GroupState:
    """What the batches of one group share: the method, the frozen reference, the cells'
    books, the realtime pace, and where (if anywhere) the method diverged."""

    def __init__(self, method: Method, base: ZeroShotClassifier, book: CellBook, pace: Pace):
        self.method, self.base, self.book, self.pace = method, base, book, pace
        self.diverged: str | None = None
        self.diverged_at = -1


class _Batches:
    """The loader's iterator, dropped on ``close()`` so that its worker processes shut down
    at once (an iterator referenced from a traceback lives until garbage collection)."""

    def __init__(self, loader: Any):
        self._it: Any = iter(loader)

    def __next__(self) -> dict[str, Any]:
        return next(self._it)

    def close(self) -> None:
        it, self._it = self._it, None
        shutdown = getattr(it, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()
        del it


def _first_domain(batch: Batch) -> int:
    return int(batch.domains[0])


def batch_seeds(stream: Stream) -> dict[int, int]:
    """The method's seed for every batch of the whole ``stream``, by batch number: keyed by
    the batch's domain and its position among that domain's batches (a mixed batch: by its
    number). Computed before resume or a shard (``protocol.shard``) leaves batches out, so a
    batch gets the same seed however the stream is split."""
    positions: dict[int, int] = {}
    out = {}
    for batch in stream.batches:
        dom = batch.single_domain()
        if dom is None:
            out[batch.number] = stable_seed("batch", stream.seed, "mixed", batch.number) % 2**63
            continue
        position = positions.get(dom, 0)
        positions[dom] = position + 1
        shift, severity = stream.domains[dom]
        out[batch.number] = stable_seed("batch", stream.seed, shift, severity, position) % 2**63
    return out


def _snapshot(writer: results.SnapshotWriter, record: dict[str, Any]) -> float:
    """Hand ``record`` (its summary brought up to date) to the writer; returns when the next
    snapshot is due (``SNAPSHOT_SHARE``)."""
    began = time.perf_counter()
    record["summary"] = results.summarize(record["cells"])
    writer.submit(record)
    now = time.perf_counter()
    return now + (now - began) * (1 / SNAPSHOT_SHARE - 1)


def _lacks_samples(output: Path, record: dict[str, Any]) -> bool:
    """Whether a finished cell of ``record`` (resumed from ``output``) has no per-sample
    file."""
    folder = samples.samples_dir(output)
    return any(
        not c.get("diverged")
        and not samples.cell_file(folder, c["shift"], c["severity"], c["seed"]).is_file()
        for c in record["cells"]
    )


def _record_parameters(record: dict[str, Any], method: Method) -> None:
    if record.get("parameters") is None:
        record["parameters"] = {
            "trainable": sum(p.numel() for p in method.trainable_parameters()),
            "total": count_parameters(method.model),
        }


def run(spec: RunSpec, output: Path, **kwargs: Any) -> dict[str, Any]:
    """Run ``spec`` into ``output`` (resuming it when it holds the same run); see
    ``Evaluation`` for ``kwargs``. A finished run is returned as is, without any work.
    The trackers ``spec.loggers`` names receive the config now, the new cells as they
    finish, and the final results file (and per-sample folder) at the end."""
    if kwargs.get("max_batches") is None:
        done = finished_record(spec, output)
        if done is not None:
            return done
    with Trackers.start(spec, Path(output)) as trackers:  # none chosen: does nothing
        start = time.perf_counter()
        record = Evaluation(spec, output, on_cells=trackers.log_cells, **kwargs).run()
        record["wall_time_s"] = time.perf_counter() - start
        record = results.ResultsFile(Path(output)).write(record)
    return record
