"""The leaderboard's tracks beside its ranking: the compute-matched realtime track
(``protocol.realtime``, ``tta_bench.run.realtime``) and many stream orders per cell
(``protocol.orders``).

A ranked run's *realtime twin* is the same run (suite, method, method config, model and
weights) under the same protocol but for ``realtime: true`` (its id ends in ``-rt``). A twin
is never ranked: it lies in the same results folder and fills its run's ``realtime acc %``
and ``adapted %`` columns, so a reader sees what a method keeps of its gain when the stream
does not wait for it. A board whose runs have ``orders`` shows their spread over the orders
(``stats.order_spread``): the central 95% of the orders and the Expected Tail Accuracy.
Both only add columns and notes: a board with neither renders as it did.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any

from tta_bench.report import stats, tables

#: The columns of a board whose runs have realtime twins.
REALTIME_ACCURACY = "realtime acc %"
ADAPTED = "adapted %"
REALTIME_COLUMNS = (REALTIME_ACCURACY, ADAPTED)
#: The columns of a board whose runs have ``protocol.orders``.
ORDERS = "orders"
ORDER_RANGE = "central 95% of orders"
ETA = "ETA %"
ORDERS_COLUMNS = (ORDERS, ORDER_RANGE, ETA)
#: The accuracy column, and its header on a board of many stream orders.
ACCURACY = "accuracy % (95% CI)"
ORDERS_ACCURACY = "accuracy % (95% CI over orders)"
#: Protocol fields that do not make a twin another run: the id, and the track itself.
_TRACK_FIELDS = ("id", "realtime")


def is_realtime(record: dict[str, Any]) -> bool:
    """The record is of the compute-matched track (``protocol.realtime: true``)."""
    return bool((record.get("protocol") or {}).get("realtime"))


def has_orders(records: Sequence[dict[str, Any]]) -> bool:
    """The records are of a protocol with many stream orders per cell (``orders: N``)."""
    return any((r.get("protocol") or {}).get("orders") for r in records)


def _untracked(proto: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in proto.items() if k not in _TRACK_FIELDS}


def _model(record: dict[str, Any]) -> str:
    model = record.get("model") or {}
    return json.dumps([model.get("name"), model.get("args")], sort_keys=True, default=str)


def same_protocol_but_realtime(record: dict[str, Any], ranked: dict[str, Any]) -> bool:
    """``record`` is of the realtime track of ``ranked``'s protocol (and ``ranked`` is not):
    the two protocol identities are equal once ``realtime`` (and the id) is removed."""
    mine, theirs = record.get("protocol") or {}, ranked.get("protocol") or {}
    return (
        is_realtime(record)
        and not is_realtime(ranked)
        and _untracked(mine) == _untracked(theirs)
        and record.get("suite") == ranked.get("suite")
    )


def twin_of(record: dict[str, Any], ranked: dict[str, Any]) -> bool:
    """``record`` is ``ranked``'s realtime twin: the same suite, method, method config
    (its hash, the run key's, where both record one: fields added to a method after a run
    are out of the hash at their defaults, so a later run of the same config matches;
    else the config itself), model and weights, under ``ranked``'s protocol but for
    ``realtime: true``."""
    config = [r.get("method_config") or {} for r in (record, ranked)]
    hashes = [r.get("method_config_hash") for r in (record, ranked)]
    same_config = (
        hashes[0] == hashes[1]
        if None not in hashes
        else json.dumps(config[0], sort_keys=True, default=str)
        == json.dumps(config[1], sort_keys=True, default=str)
    )
    return (
        same_protocol_but_realtime(record, ranked)
        and record.get("method") == ranked.get("method")
        and same_config
        and _model(record) == _model(ranked)
        and stats.model_hash(record) == stats.model_hash(ranked)
    )


def adapted_share(record: dict[str, Any]) -> float | None:
    """The share of samples a realtime run adapted on, over all its cells (each cell's
    ``realtime: {adapted_samples, samples}``); None where a cell does not say."""
    counts = [c.get("realtime") for c in record.get("cells") or []]
    if not counts or not all(isinstance(c, dict) for c in counts):
        return None
    seen = sum(int(c.get("samples") or 0) for c in counts)
    if seen <= 0:
        return None
    return sum(int(c.get("adapted_samples") or 0) for c in counts) / seen


def realtime_cells(twin: dict[str, Any] | None) -> list[str]:
    """A run's ``REALTIME_COLUMNS``: its twin's suite accuracy (mean ± 95% CI half-width
    over seeds, as the accuracy column) and share adapted on; ``-`` without a twin."""
    if twin is None:
        return [tables.MISSING, tables.MISSING]
    share = adapted_share(twin)
    adapted = tables.MISSING if share is None else f"{100 * share:.1f}"
    return [tables._pct_ci(stats.suite_estimate(twin)), adapted]


def order_cells(record: dict[str, Any]) -> list[str]:
    """A run's ``ORDERS_COLUMNS``: how many orders, the central 95% of their accuracies
    (``low to high``) and the Expected Tail Accuracy, in percent."""
    spread = stats.order_spread(record)
    if spread is None:
        return [tables.MISSING] * len(ORDERS_COLUMNS)
    return [
        str(spread.estimate.n),
        f"{100 * spread.low:.1f} to {100 * spread.high:.1f}",
        f"{100 * spread.tail:.1f}",
    ]


def with_track_columns(
    head: list[str],
    rows: list[list[Any]],
    records: Sequence[dict[str, Any]],
    twins: Sequence[dict[str, Any] | None],
) -> tuple[list[str], list[list[Any]]]:
    """A summary table (``tables.summary_rows``) with the ``ORDERS_COLUMNS`` appended when
    the records have ``protocol.orders`` (the accuracy header then says it is over orders:
    ``ORDERS_ACCURACY``), and the ``REALTIME_COLUMNS`` when any run has a twin (``twins``,
    aligned with ``records``); unchanged otherwise. Callers pick columns by name."""
    head, rows = list(head), [list(r) for r in rows]
    if has_orders(records):
        if ACCURACY in head:
            head[head.index(ACCURACY)] = ORDERS_ACCURACY
        head += ORDERS_COLUMNS
        for row, rec in zip(rows, records):
            row += order_cells(rec)
    if any(t is not None for t in twins):
        head += REALTIME_COLUMNS
        for row, twin in zip(rows, twins):
            row += realtime_cells(twin)
    return head, rows


def accuracy_note(records: Sequence[dict[str, Any]]) -> str:
    """The note on the accuracy column: over seeds, or over stream orders."""
    if has_orders(records):
        return (
            "Accuracy: per stream order the mean over all shift x severity cells, then the "
            "mean and the 95% confidence interval (Student t) over the orders."
        )
    return (
        "Accuracy: per seed the mean over all shift x severity cells, then the mean and the "
        "95% confidence interval (Student t) over seeds."
    )


def orders_note(records: Sequence[dict[str, Any]], code: Callable[[str], str]) -> str | None:
    """What the ``ORDERS_COLUMNS`` show, for records with ``protocol.orders``."""
    if not has_orders(records):
        return None
    n = max(int((r.get("protocol") or {}).get("orders") or 0) for r in records)
    k = max(1, math.ceil(stats.TAIL_FRACTION * n))
    return (
        f"Orders ({code(f'orders: {n}')}): each cell's stream is replayed in {n} orders (the "
        f"run's seeds 0..{n - 1}, each one stream order and method seed, every order on the "
        "same corrupted images). Central 95% of orders: the 2.5th to 97.5th percentile of "
        "the orders' accuracies, where one order's accuracy lands (not an interval of the "
        f"mean). ETA: Expected Tail Accuracy, the mean accuracy of the worst "
        f"{100 * stats.TAIL_FRACTION:.0f}% of orders ({k} of {n}), what a method delivers "
        "on its unlucky orders."
    )


def realtime_note(twins: Sequence[dict[str, Any] | None], code: Callable[[str], str]) -> str | None:
    """What the ``REALTIME_COLUMNS`` show, when any run has a twin."""
    if not any(t is not None for t in twins):
        return None
    return (
        f"Realtime acc %: the same run (method, configuration, model and weights) on the "
        f"compute-matched track ({code('realtime: true')}, after Alfarra et al., ICML 2024), "
        "mean and 95% CI over seeds as for the accuracy: the stream reveals one batch per "
        "unit of the reference's cost, units counted as image-tower passes with a backward "
        "pass counting two forwards; a method whose step costs k units adapts on one batch "
        "in k and predicts the others with its current state. Work outside the image tower "
        "(a text encoder, an optimiser over prototypes) is not charged. Adapted %: the "
        "share of the samples it adapted on, over all its cells. A realtime run is never "
        f"ranked; {code('-')}: no complete realtime run of it in the results folder."
    )
