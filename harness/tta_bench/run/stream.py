"""Stream construction: a protocol and a seed -> the ordered batches a method sees.

``build_stream(protocol, seed, labels)`` is a pure function of its inputs, so every method
(and every process, worker count and machine) receives the identical sequence of
``(dataset index, shift, severity)`` for a given seed. The runner only consumes it.

Terms:

* a *domain* is one ``(shift, severity)`` pair; a *cell* of the results is one domain for
  one seed. Accuracy is always reported per cell, computed from the predictions on the
  samples of that domain, whatever order the protocol feeds them in;
* a *group* is the unit that runs (and resumes) as a whole: one cell for the independent
  policies, every cell of the seed for the stateful ones (``Protocol.stateful``).

Per policy (``Protocol.reset``):

``episodic_batch`` / ``episodic_sample`` / ``reset_each_shift``
    one segment per domain, in the pinned order (shifts, then severities), samples in a
    seeded random order; the reset comes before every batch (episodic) or every domain.
``continual``
    the same segments, one group per seed, never reset.
``gradual``
    per shift, severities ascending then descending (1,2,3,4,5,4,3,2,1 for the five
    severities); a severity visited twice is one cell holding both visits; never reset.
``mixed_domains``
    the samples of every domain shuffled together into one stream; a batch mixes domains.
``non_iid``
    one segment per domain, reset at its start; the label order follows a Dirichlet draw
    (``dirichlet_delta``) per class over the segment's time slots (one slot per batch).
``label_shift``
    one segment per domain, reset at its start; each batch holds at most
    ``classes_per_batch`` classes, drawn afresh per batch, and every sample of the domain
    comes exactly once (``label_shift_batches``), so a batch may be shorter than the
    protocol's batch size.
``imbalanced``
    one segment per domain, reset at its start, holding a long-tailed subset of the
    domain's samples (``imbalanced_subset``, ``imbalance_ratio``) in a seeded random order;
    the cell's accuracy is over the kept samples.
``correlated`` / ``gradual_correlated`` / ``mixed_domains_correlated``
    the reference harness's class-sorted settings: the stream of ``continual``,
    ``gradual`` or ``mixed_domains`` (same domains, visits and resets), each segment's
    samples (the whole mixed stream for ``mixed_domains_correlated``) sorted by class label
    in a seeded random order within a class (``class_sorted``), or, with
    ``dirichlet_delta``, in the Dirichlet label order of ``non_iid`` (one time slot per
    batch).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from tta_bench.rng import stable_seed
from tta_bench.run.protocol import CORRELATED, Protocol

Domain = tuple[str, int]


@dataclass(frozen=True)
class Batch:
    """One batch of the stream.

    ``indices[i]`` is the dataset index of row ``i`` within the split of domain
    ``domains[i]`` (an index into ``Stream.domains``). ``reset_before``: the runner calls
    ``method.reset()`` before this batch. ``group``: index into ``Stream.groups``.
    """

    number: int
    indices: np.ndarray
    domains: np.ndarray
    reset_before: bool
    group: int

    def __len__(self) -> int:
        return len(self.indices)

    def single_domain(self) -> int | None:
        """The domain id when every row shares it, else None (``mixed_domains``)."""
        first = int(self.domains[0])
        return first if bool((self.domains == first).all()) else None


@dataclass(frozen=True)
class Stream:
    """The whole stream of one seed: domains (cells), groups, and the ordered batches."""

    seed: int
    domains: tuple[Domain, ...]
    #: ``groups[g]`` = the domain ids that group ``g`` produces (run and resumed together).
    groups: tuple[tuple[int, ...], ...]
    batches: tuple[Batch, ...]

    def sequence(self) -> list[tuple[int, str, int]]:
        """The flat ``(dataset index, shift, severity)`` sequence, in stream order."""
        out = []
        for b in self.batches:
            for i, d in zip(b.indices.tolist(), b.domains.tolist()):
                shift, severity = self.domains[d]
                out.append((i, shift, severity))
        return out

    def without_groups(self, done: set[int]) -> Stream:
        """The stream minus the batches of the groups in ``done`` (resume)."""
        keep = tuple(b for b in self.batches if b.group not in done)
        return Stream(self.seed, self.domains, self.groups, keep)


def subset(protocol: Protocol, n: int) -> np.ndarray:
    """The sorted dataset indices the protocol evaluates (``max_images`` of ``n``)."""
    if protocol.max_images is None or protocol.max_images >= n:
        return np.arange(n)
    rng = np.random.default_rng(stable_seed("subset", protocol.name) % 2**32)
    return np.sort(rng.permutation(n)[: protocol.max_images])


def _domain_order(protocol: Protocol) -> list[tuple[Domain, int]]:
    """``((shift, severity), visit)`` segments in stream order for the segment policies."""
    if protocol.order_policy == "gradual":
        ramp = sorted(set(protocol.severities))
        ramp = ramp + ramp[-2::-1]
        out = []
        for shift in protocol.shifts:
            seen: dict[int, int] = {}
            for sev in ramp:
                out.append(((shift, sev), seen.get(sev, 0)))
                seen[sev] = seen.get(sev, 0) + 1
        return out
    return [((s, v), 0) for s in protocol.shifts for v in protocol.severities]


def _shuffled(idx: np.ndarray, seed: int, shift: str, severity: int, visit: int) -> np.ndarray:
    # visit 0 keeps the key of the original runner so reset_each_shift numbers do not move.
    key = (
        ("order", seed, shift, severity) if visit == 0 else ("order", seed, shift, severity, visit)
    )
    rng = np.random.default_rng(stable_seed(*key) % 2**32)
    return idx[rng.permutation(len(idx))]


def dirichlet_order(
    idx: np.ndarray, labels: np.ndarray, n_slots: int, delta: float, rng: np.random.Generator
) -> np.ndarray:
    """Reorder ``idx`` so that labels are temporally correlated.

    The stream is cut into ``n_slots`` consecutive time slots; each class spreads its samples
    over the slots with proportions drawn from ``Dirichlet(delta * 1)``. Small ``delta``
    concentrates a class into few slots; large ``delta`` approaches an i.i.d. order.
    """
    slots: list[list[int]] = [[] for _ in range(n_slots)]
    y = labels[idx]
    for c in np.unique(y):
        members = idx[y == c]
        members = members[rng.permutation(len(members))]
        p = rng.dirichlet(np.full(n_slots, delta))
        cuts = (np.cumsum(p)[:-1] * len(members)).round().astype(int)
        for s, part in enumerate(np.split(members, cuts)):
            slots[s].extend(part.tolist())
    out = []
    for s in slots:
        out.extend(rng.permutation(np.asarray(s, dtype=np.int64)).tolist())
    return np.asarray(out, dtype=np.int64)


def class_sorted(idx: np.ndarray, labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``idx`` sorted by class label (ascending), samples of a class in a random order
    drawn from ``rng`` (the reference harness sorts its file list by label)."""
    shuffled = idx[rng.permutation(len(idx))]
    return shuffled[np.argsort(labels[shuffled], kind="stable")]


def correlated_order(
    protocol: Protocol, idx: np.ndarray, labels: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """A class-sorted policy's order of ``idx`` (``labels`` indexed by ``idx``): sorted by
    class, or the Dirichlet order when the protocol sets ``dirichlet_delta``."""
    if protocol.dirichlet_delta is None:
        return class_sorted(idx, labels, rng)
    n_slots = max(1, -(-len(idx) // protocol.batch_size))
    return dirichlet_order(idx, labels, n_slots, protocol.dirichlet_delta, rng)


def label_shift_batches(
    idx: np.ndarray, labels: np.ndarray, classes_per_batch: int, batch_size: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:  # fmt: skip
    """Cut ``idx`` into batches of at most ``classes_per_batch`` classes each, every sample
    exactly once.

    Each class's samples wait in a random order. For each batch, ``classes_per_batch``
    classes are drawn uniformly without replacement among the classes that still have
    samples (all of them when fewer remain); the batch then takes ``batch_size`` samples
    uniformly without replacement from the remaining samples of those classes pooled (so a
    class's share follows how many it has left), or all of them when they hold fewer, and
    is shuffled. The batches continue until every sample is used: a batch is shorter than
    ``batch_size`` whenever its classes run short, so there are at least
    ``ceil(len(idx) / batch_size)`` batches. The labels of ``idx`` are the classes (an
    open-set row's label, -1, is one more).

    StatA's batch sampler (MaxZanella/StatA at eea8637, ``sampler.py``, ``BatchSampler``)
    draws the classes and the samples of a batch the same way, but from the whole split
    every time: its batches are independent draws, a sample may come in several batches or
    in none, and the number of batches is a setting (``n_tasks``). Here the draws are from
    what is left, so the cell's accuracy is over the whole split, as in every other policy.
    """
    y = labels[idx]
    queues = [idx[y == c] for c in np.unique(y)]
    queues = [q[rng.permutation(len(q))] for q in queues]
    left = np.array([len(q) for q in queues], dtype=np.int64)
    used = np.zeros(len(queues), dtype=np.int64)
    out = []
    while left.any():
        alive = np.flatnonzero(left)
        chosen = rng.choice(alive, size=min(classes_per_batch, len(alive)), replace=False)
        take = min(batch_size, int(left[chosen].sum()))
        counts = rng.multivariate_hypergeometric(left[chosen], take)
        parts = [queues[c][used[c] : used[c] + n] for c, n in zip(chosen, counts)]
        used[chosen] += counts
        left[chosen] -= counts
        batch = np.concatenate(parts)
        out.append(batch[rng.permutation(len(batch))])
    return out


def imbalanced_subset(
    idx: np.ndarray, labels: np.ndarray, ratio: float, rng: np.random.Generator
) -> np.ndarray:
    """The sorted long-tailed subset of ``idx`` that an ``imbalanced`` cell keeps.

    The ``C`` classes present in ``idx`` are ranked 0..C-1 by a random permutation; the
    class of rank ``r`` keeps ``ratio ** (-r / (C - 1))`` of its samples, rounded to the
    nearest count (halves up) and at least one, chosen at random: rank 0 keeps all of its
    samples, rank C-1 about ``1 / ratio`` of them. A single class keeps everything. The
    labels of ``idx`` are the classes (an open-set row's label, -1, is one more).
    """
    y = labels[idx]
    classes = np.unique(y)
    ranks = rng.permutation(len(classes))
    kept = []
    for c, rank in zip(classes.tolist(), ranks.tolist()):
        members = idx[y == c]
        share = ratio ** (-rank / (len(classes) - 1)) if len(classes) > 1 else 1.0
        n = max(1, int(np.floor(len(members) * share + 0.5)))
        kept.append(members[rng.permutation(len(members))[:n]])
    return np.sort(np.concatenate(kept)) if kept else idx[:0]


def _check_classes_per_batch(
    protocol: Protocol, labels: Mapping[Domain, np.ndarray], domains: tuple[Domain, ...]
) -> None:
    """A ``ValueError`` when ``classes_per_batch`` exceeds the classes of a domain (the
    distinct labels of its split), naming both numbers."""
    k = protocol.classes_per_batch
    if k is None:
        return
    for shift, sev in domains:
        n_classes = len(np.unique(labels[(shift, sev)]))
        if k > n_classes:
            raise ValueError(
                f"classes_per_batch={k} is more than the {n_classes} classes of domain "
                f"({shift!r}, severity {sev}) of suite {protocol.name!r}; choose "
                f"protocol.classes_per_batch between 1 and {n_classes}"
            )


def _cell_order(
    protocol: Protocol, seed: int, domain: Domain, visit: int, labels: np.ndarray
) -> tuple[np.ndarray, list[int] | None]:
    """A segment policy's samples of one domain visit, in stream order, and the batch sizes
    when they are not the protocol's (``label_shift``), else None."""
    shift, sev = domain
    idx = subset(protocol, len(labels))
    if protocol.reset == "non_iid":
        assert protocol.dirichlet_delta is not None
        rng = np.random.default_rng(stable_seed("non_iid", seed, shift, sev) % 2**32)
        n_slots = max(1, -(-len(idx) // protocol.batch_size))
        return dirichlet_order(idx, labels, n_slots, protocol.dirichlet_delta, rng), None
    if protocol.reset == "label_shift":
        assert protocol.classes_per_batch is not None
        rng = np.random.default_rng(stable_seed("label_shift", seed, shift, sev) % 2**32)
        parts = label_shift_batches(
            idx, labels, protocol.classes_per_batch, protocol.batch_size, rng
        )
        flat = np.concatenate(parts) if parts else idx[:0]
        return flat, [len(p) for p in parts]
    if protocol.reset == "imbalanced":
        assert protocol.imbalance_ratio is not None
        # The kept subset is keyed by the seed alone: domains with the same labels (every
        # synthetic shift of one split) keep the same samples, so cells differ in the shift.
        rng = np.random.default_rng(stable_seed("imbalanced", seed) % 2**32)
        kept = imbalanced_subset(idx, labels, protocol.imbalance_ratio, rng)
        order = np.random.default_rng(stable_seed("imbalanced_order", seed, shift, sev) % 2**32)
        return kept[order.permutation(len(kept))], None
    if protocol.reset in CORRELATED:
        rng = np.random.default_rng(stable_seed("correlated", seed, shift, sev, visit) % 2**32)
        return correlated_order(protocol, idx, labels, rng), None
    return _shuffled(idx, seed, shift, sev, visit), None


def build_stream(protocol: Protocol, seed: int, labels: Mapping[Domain, np.ndarray]) -> Stream:
    """The ordered batches of ``protocol`` for ``seed``.

    ``labels[(shift, severity)]`` holds the labels of that domain's split (for synthetic
    shifts every domain is the same clean split); only their length and, for ``non_iid``,
    ``label_shift`` and ``imbalanced``, their values are used. Raises ``ValueError`` when a
    domain of the protocol is missing, or when ``classes_per_batch`` exceeds a domain's
    number of classes.
    """
    gradual = protocol.order_policy == "gradual"
    sevs = sorted(set(protocol.severities)) if gradual else protocol.severities
    domains: tuple[Domain, ...] = tuple((s, int(v)) for s in protocol.shifts for v in sevs)
    if len(set(domains)) != len(domains):
        raise ValueError(f"protocol {protocol.name!r} repeats a (shift, severity): {domains}")
    missing = [d for d in domains if d not in labels]
    if missing:
        raise ValueError(f"no labels for domain(s) {missing}; have {sorted(labels)}")
    _check_classes_per_batch(protocol, labels, domains)
    dom_id = {d: i for i, d in enumerate(domains)}
    bs = protocol.batch_size
    batches: list[Batch] = []

    def emit(
        idx: np.ndarray, dom: np.ndarray, group: int, reset_first: bool,
        sizes: list[int] | None = None,
    ) -> None:  # fmt: skip
        """Append the batches of ``idx``: cut every ``bs`` samples, or by ``sizes``."""
        if sizes is None:
            sizes = [min(bs, len(idx) - k) for k in range(0, len(idx), bs)]
        k = 0
        for j, size in enumerate(sizes):
            reset = protocol.reset in ("episodic_batch", "episodic_sample") or (
                reset_first and j == 0
            )
            rows = slice(k, k + size)
            batches.append(
                Batch(len(batches), idx[rows], dom[rows], reset and bool(batches), group)
            )
            k += size

    if protocol.order_policy == "mixed_domains":
        parts = [(subset(protocol, len(labels[d])), dom_id[d]) for d in domains]
        idx = np.concatenate([p for p, _ in parts])
        dom = np.concatenate([np.full(len(p), i, dtype=np.int64) for p, i in parts])
        perm = np.random.default_rng(stable_seed("mixed", seed) % 2**32).permutation(len(idx))
        if protocol.reset in CORRELATED:  # positions of the mixed stream, ordered by class
            y = np.concatenate([labels[d][p] for d, (p, _) in zip(domains, parts)])
            rng = np.random.default_rng(stable_seed("mixed_correlated", seed) % 2**32)
            perm = correlated_order(protocol, np.arange(len(idx)), y, rng)
        emit(idx[perm], dom[perm], 0, False)
        groups: tuple[tuple[int, ...], ...] = (tuple(range(len(domains))),)
        return Stream(seed, domains, groups, tuple(batches))

    stateful = protocol.stateful
    groups = (tuple(range(len(domains))),) if stateful else tuple((i,) for i in range(len(domains)))
    for domain, visit in _domain_order(protocol):
        d = dom_id[domain]
        idx, sizes = _cell_order(protocol, seed, domain, visit, labels[domain])
        group = 0 if stateful else d
        emit(idx, np.full(len(idx), d, dtype=np.int64), group, not stateful, sizes)
    return Stream(seed, domains, groups, tuple(batches))
