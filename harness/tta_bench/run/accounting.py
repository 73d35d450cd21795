"""Cost accounting and cell scoring for the evaluation loop.

``CostMeter`` measures one batch of one method: wall time per phase (``data``, ``shift``,
``method``, ``reference``; ``tta_bench.run.cost.PhaseTimer``), the method's own ``adapt``
seconds, image-encoder passes with and without gradients (``PassCounter``) and, when asked,
FLOPs. ``CellBook`` folds each batch's predictions and costs into its cell(s), notes
divergence, and turns every cell into its results entry. A batch of several domains
(``mixed_domains``) is split by rows; its costs are shared by row count.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tta_bench.method import Method
from tta_bench.run.cost import PassCounter, PeakMemory, PhaseTimer, rss_bytes
from tta_bench.run.results import now_iso
from tta_bench.run.samples import CellSamples, score
from tta_bench.run.stream import Batch, Stream

#: Time phases a cell reports, in the order of its entry.
PHASES = ("data", "shift", "method", "reference")


@dataclass
class BatchCost:
    """What one batch cost: seconds per phase, the method's adapt seconds, passes, FLOPs."""

    seconds: dict[str, float]
    adapt_s: float
    forward: int
    backward: int
    flops: float | None  # None: not counted for this batch


class CostMeter:
    """Measures batches of one method instance (``watch``), phase by phase."""

    def __init__(self, device: torch.device):
        self.device = device
        self.timer = PhaseTimer(device)
        self._counter: PassCounter | None = None
        self._method: Method | None = None

    def watch(self, method: Method) -> None:
        """Count the passes of ``method``'s image encoder from now on."""
        self.close()
        self._method = method
        self._counter = PassCounter(method.model.visual)

    def close(self) -> None:
        if self._counter is not None:
            self._counter.close()
            self._counter = None

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        return self.timer.phase(name)

    @contextlib.contextmanager
    def batch(self, count_flops: bool = False) -> Iterator[BatchMeasurement]:
        """Measure one batch; on exit the yielded ``BatchMeasurement`` holds its ``cost``.
        The method's passes are read when ``passes_done()`` is called (before the
        reference forward, which may share the frozen tower), else at the end."""
        assert self._counter is not None and self._method is not None, "watch() first"
        measured = BatchMeasurement(self._counter, count_flops)
        seconds_before = dict(self.timer.seconds)
        adapt_before = self._method.timings.get("adapt", 0.0)
        yield measured
        measured.passes_done()
        spent = {k: self.timer.seconds[k] - seconds_before.get(k, 0.0) for k in self.timer.seconds}
        adapt_s = self._method.timings.get("adapt", 0.0) - adapt_before
        measured.finish(spent, min(adapt_s, spent.get("method", 0.0)))


class BatchMeasurement:
    """One batch being measured by ``CostMeter.batch``: ``flop_mode`` is the context the
    method's step runs in (a FLOP counter when counting, else a no-op), ``passes_done()``
    reads the encoder passes so far, and ``cost`` is set when the batch ends."""

    def __init__(self, counter: PassCounter, count_flops: bool):
        self._counter = counter
        self._before = (counter.forward, counter.backward)
        self._passes: tuple[int, int] | None = None
        self._extra_forward = 0
        self.count_flops = count_flops
        self.flop_mode: Any = _flop_counter(count_flops)
        self.cost: BatchCost | None = None

    def passes_done(self) -> None:
        """Take the method's encoder passes now (the first call counts)."""
        if self._passes is None:
            self._passes = (self._counter.forward + self._extra_forward, self._counter.backward)

    def add_forward(self, n: int) -> None:
        """Count ``n`` forward passes the counter cannot see (replayed image features,
        ``tta_bench.run.features``), before ``passes_done``."""
        self._extra_forward += int(n)

    def passes(self) -> tuple[int, int]:
        """``(forward, backward)`` encoder passes of the method's step (after
        ``passes_done``)."""
        assert self._passes is not None, "passes_done() first"
        return self._passes[0] - self._before[0], self._passes[1] - self._before[1]

    def finish(self, seconds: dict[str, float], adapt_s: float) -> None:
        forward, backward = self.passes()
        self.cost = BatchCost(
            seconds=seconds,
            adapt_s=adapt_s,
            forward=forward,
            backward=backward,
            flops=float(self.flop_mode.get_total_flops()) if self.count_flops else None,
        )


class _CountingFlops:
    """``FlopCounterMode`` with torch's fused attention fast path off while it counts: the
    fast path (``nn.MultiheadAttention`` without gradients) is one fused kernel the counter
    does not see, so a method that never computes gradients (zero-shot, the caches) had no
    attention FLOPs counted while a gradient method had them; counted, every method runs
    the same (unfused) attention. The setting is restored on exit."""

    def __init__(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        self.mode = FlopCounterMode(display=False)
        self.fastpath = True

    def __enter__(self) -> Any:
        self.fastpath = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        self.mode.__enter__()
        return self.mode

    def __exit__(self, *exc: Any) -> None:
        try:
            self.mode.__exit__(*exc)
        finally:
            torch.backends.mha.set_fastpath_enabled(self.fastpath)

    def get_total_flops(self) -> int:
        return self.mode.get_total_flops()


def _flop_counter(counting: bool) -> Any:
    """A FLOP counter when ``counting``, else a no-op context (``get_total_flops`` absent)."""
    if not counting:
        return contextlib.nullcontext()
    return _CountingFlops()


@dataclass
class _Cell:
    """What a cell accumulates over its batches (possibly several visits or mixed batches)."""

    n: int = 0
    batches: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    adapt_s: float = 0.0
    untimed: int = 0  # samples of FLOP-counted batches, left out of the times
    flops: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    logits: list[torch.Tensor] = field(default_factory=list)
    labels: list[torch.Tensor] = field(default_factory=list)
    indices: list[np.ndarray] = field(default_factory=list)  # dataset rows, stream order
    batch_numbers: list[np.ndarray] = field(default_factory=list)
    #: the frozen model's predictions (scored by ``samples.score``)
    references: list[torch.Tensor] = field(default_factory=list)
    #: the method's own OOD scores and decisions (``Method.own_ood_score``)
    own_scores: list[torch.Tensor] = field(default_factory=list)
    decisions: list[torch.Tensor] = field(default_factory=list)
    diverged: dict[str, Any] | None = None


class CellBook:
    """The cells of one group: predictions and costs folded in batch by batch."""

    def __init__(
        self,
        stream: Stream,
        *,
        reference: bool,
        is_reference: bool,
        per_class: bool,
        ood_score: str = "msp",
    ):
        self.stream = stream
        self.reference = reference
        self.is_reference = is_reference  # the method is the frozen model: its own reference
        self.per_class = per_class
        self.ood_score = ood_score  # open-set cells (tta_bench.run.openset)
        self.cells: dict[int, _Cell] = {}

    def seen(self, domain: int) -> bool:
        return domain in self.cells

    def fold(
        self,
        batch: Batch,
        logits: torch.Tensor,
        labels: torch.Tensor,
        ref_pred: torch.Tensor | None,
        cost: BatchCost,
        own: tuple[Any, Any] = (None, None),
    ) -> None:
        """Fold one batch into its cells: logits, labels (which the method never saw), the
        frozen model's predictions and costs, the method's own OOD score and decision
        (``own``, from ``openset.take_own``), scored when the cells are (``entries``)."""
        own_score, decision = own
        logits_cpu, labels_cpu = logits.detach().float().cpu(), labels.cpu()
        ref_cpu = None if ref_pred is None else ref_pred.cpu()
        for d, sel in _rows_by_domain(batch):
            cell = self.cells.setdefault(d, _Cell())
            m = int(labels_cpu[sel].numel())
            share = m / len(batch)
            cell.n += m
            if ref_cpu is not None:
                cell.references.append(ref_cpu[sel])
            cell.batches += 1
            if cost.flops is not None:  # counting slows the batch down: leave it untimed
                cell.untimed += m
                cell.flops += share * cost.flops
            else:
                for k in PHASES:
                    cell.seconds[k] += share * cost.seconds.get(k, 0.0)
                cell.adapt_s += share * cost.adapt_s
            cell.forward += share * cost.forward
            cell.backward += share * cost.backward
            cell.logits.append(logits_cpu[sel])
            if own_score is not None:
                cell.own_scores.append(own_score[sel])
            if decision is not None:
                cell.decisions.append(decision[sel])
            cell.labels.append(labels_cpu[sel])
            rows = batch.indices if isinstance(sel, slice) else batch.indices[sel.numpy()]
            cell.indices.append(np.asarray(rows))
            cell.batch_numbers.append(np.full(len(rows), batch.number, dtype=np.int64))

    def diverge(self, batch: Batch, reason: str, at: int | None = None) -> None:
        """Mark the cell(s) of ``batch`` diverged: reported, never scored. ``at``: the batch
        where the method's output first turned non-finite (default: this one); a stateful
        group's later cells carry it too, since their state was lost there."""
        for d, sel in _rows_by_domain(batch):
            cell = self.cells.setdefault(d, _Cell())
            if cell.diverged is None:
                first = batch.number if at is None or at < 0 else at
                cell.diverged = {"batch": first, "reason": reason}
            cell.n += len(batch) if isinstance(sel, slice) else int(sel.sum())
            cell.batches += 1

    def samples(self, seed: int, domain_names: dict[Any, str]) -> list[CellSamples]:
        """The scored samples of every cell that did not diverge, in domain order
        (``tta_bench.run.samples``); ``domain_names``: the dataset domain of each domain."""
        out = []
        for d in sorted(self.cells):
            c = self.cells[d]
            if c.diverged is not None or not c.logits:
                continue
            shift, severity = self.stream.domains[d]
            out.append(
                CellSamples(
                    shift=shift,
                    severity=severity,
                    seed=seed,
                    domain=domain_names.get((shift, severity), str(shift)),
                    logits=torch.cat(c.logits).numpy(),
                    labels=torch.cat(c.labels).numpy(),
                    indices=np.concatenate(c.indices),
                    batches=np.concatenate(c.batch_numbers),
                    references=self._references(c),
                    own_scores=_joined(c.own_scores, c.logits),
                    decisions=_joined(c.decisions, c.logits),
                )
            )
        return out

    def _references(self, c: _Cell) -> np.ndarray | None:
        """The frozen model's predictions of a cell's rows (the method's own when it is the
        frozen model), or None when the run scores no reference."""
        if not self.reference:
            return None
        if self.is_reference:
            return torch.cat(c.logits).argmax(dim=1).numpy().astype(np.int64)
        if len(c.references) != len(c.logits):
            return None
        return torch.cat(c.references).numpy().astype(np.int64)

    def entries(self, seed: int, memory: PeakMemory) -> list[dict[str, Any]]:
        """The results entries of every cell, in domain order."""
        return [self._entry(seed, d, self.cells[d], memory) for d in sorted(self.cells)]

    def _entry(self, seed: int, d: int, c: _Cell, memory: PeakMemory) -> dict[str, Any]:
        shift, severity = self.stream.domains[d]
        timed = c.n - c.untimed  # times are per timed sample; None when none was timed
        data_s = c.seconds["data"] + c.seconds["shift"]
        method_s = c.seconds["method"]

        def per_sample(seconds: float) -> float | None:
            return seconds / timed if timed else None

        entry: dict[str, Any] = {"shift": shift, "severity": severity, "seed": seed, "n": c.n}
        if c.diverged is not None:
            entry.update(accuracy=None, error=None, reference_accuracy=None, diverged=c.diverged)
        else:
            entry.update(
                score(
                    torch.cat(c.logits),
                    torch.cat(c.labels),
                    self._references(c),
                    ood_score=self.ood_score,
                    per_class=self.per_class,
                    own_scores=_joined(c.own_scores, c.logits),
                    decisions=_joined(c.decisions, c.logits),
                )
            )
        entry.update(
            time_per_sample_s=per_sample(method_s + data_s),
            method_time_per_sample_s=per_sample(method_s),
            data_time_per_sample_s=per_sample(data_s),
            data_wait_time_per_sample_s=per_sample(c.seconds["data"]),
            shift_time_per_sample_s=per_sample(c.seconds["shift"]),
            # adaptation (forward + backward + step, resets) vs the rest of the method's step
            adapt_time_per_sample_s=per_sample(c.adapt_s),
            predict_time_per_sample_s=per_sample(method_s - c.adapt_s),
            timed_samples=timed,
            data_wait_share=data_s / max(method_s + data_s, 1e-12),
            samples_per_s=timed / max(method_s + data_s, 1e-12) if timed else None,
            # Stateful groups share one measurement window: the group's peak.
            peak_memory_bytes=memory.peak_bytes,
            peak_memory_kind=memory.kind,
            forward_passes_per_sample=c.forward / max(c.n, 1),
            backward_passes_per_sample=c.backward / max(c.n, 1),
            batches=c.batches,
            finished=now_iso(),
        )
        if c.untimed:
            entry["flops_per_sample"] = c.flops / c.untimed
        return finite_or_none(entry)


def _joined(parts: list[torch.Tensor], logits: list[torch.Tensor]) -> np.ndarray | None:
    """A cell's own OOD scores (or decisions) in stream order, or None unless every batch
    of the cell gave them."""
    if not parts or len(parts) != len(logits):
        return None
    return torch.cat(parts).numpy()


def _rows_by_domain(batch: Batch) -> list[tuple[int, Any]]:
    """``(domain, row selector)`` pairs of a batch (one pair unless domains are mixed)."""
    dom = batch.single_domain()
    if dom is not None:
        return [(dom, slice(None))]
    return [(int(d), torch.from_numpy(batch.domains == d)) for d in np.unique(batch.domains)]


def finite_or_none(entry: dict[str, Any]) -> dict[str, Any]:
    """Non-finite floats (an infinite NLL, say) become None: results are strict JSON."""
    out = {}
    for k, v in entry.items():
        if isinstance(v, float) and not math.isfinite(v):
            out[k] = None
        elif isinstance(v, dict):
            out[k] = finite_or_none(v)
        else:
            out[k] = v
    return out


def non_finite(logits: torch.Tensor, loss: Any) -> str | None:
    """Why a method's output cannot be scored (non-finite logits or loss), or None."""
    if not bool(torch.isfinite(logits).all()):
        return "non-finite logits"
    if loss is not None:
        value = float(loss)
        if not math.isfinite(value):
            return f"non-finite loss ({value})"
    return None


def log_batch(
    log: Any,
    seed: int,
    batch: Batch,
    stream: Stream,
    loss: Any,
    logits: torch.Tensor,
    labels: torch.Tensor,
    ref_pred: torch.Tensor | None,
    cost: BatchCost,
    device: torch.device,
) -> None:
    """One JSONL line per batch: accuracy of the frozen source model ("before") and of the
    method ("after") on it, the method's last loss, seconds per phase and memory now."""
    dom = batch.single_domain()
    shift, severity = stream.domains[dom] if dom is not None else ("mixed", None)
    memory = torch.cuda.memory_allocated(device) if device.type == "cuda" else rss_bytes()
    labels = labels.cpu()
    after = (logits.detach().float().cpu().argmax(dim=1) == labels).float().mean()
    before = None if ref_pred is None else float((ref_pred.cpu() == labels).float().mean())
    loss_value = None if loss is None else float(loss)
    line = {
        "seed": seed,
        "batch": batch.number,
        "shift": shift,
        "severity": severity,
        "n": len(batch),
        "loss": loss_value if loss_value is None or math.isfinite(loss_value) else None,
        "accuracy_before": before,
        "accuracy_after": float(after) if bool(torch.isfinite(after)) else None,
        "seconds": {k: v for k, v in sorted(cost.seconds.items())},
        "memory_bytes": int(memory),
        "memory_kind": "cuda_allocated" if device.type == "cuda" else "cpu_rss",
    }
    log.write(json.dumps(line, allow_nan=False) + "\n")
