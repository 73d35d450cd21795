"""``tta-bench data check``: what of a suite's data is there before a run reads it.

For each domain a run of the suite reads (each ``(shift, severity)`` of a suite whose dataset
serves its own domains, else the dataset's clean split; and an open-set suite's OOD set), the
dataset factory's ``inventory`` (a plugin attaches it beside ``check_args``; it reads folder
listings and split files, no image) returns a ``tta_bench.data.DataInventory``: found or not,
images against the published size, class folders empty, absent or unknown, the split file's
identity, what to download. A dataset without an ``inventory`` is built once and counted; one
that reads no ``--data-dir`` is bundled. The command prints a table (or ``--json``) and
exits 0 when every domain is complete, 1 when one is not, 2 on bad input before scanning.
"""

from __future__ import annotations

import argparse
import inspect
import json
from collections import Counter
from pathlib import Path
from typing import Any

from tta_bench import catalog
from tta_bench.cli.errors import usage_errors
from tta_bench.data import INVENTORY_STATUSES, DataInventory, DataUnavailableError
from tta_bench.registry import registry
from tta_bench.run.resolve import UsageError

__all__ = ["DATA_CHECK_HELP", "cmd_data", "domain_inventory", "suite_domains", "suite_inventory"]

DATA_CHECK_HELP = (
    "List, for each domain of a suite's data under --data-dir: found / partial / mismatch / "
    "missing / bundled, the images found against the published size, class folders that are "
    "empty, missing or unknown, the split file's version, and what to download for the rest. "
    "Reads folder listings and split files only. Exit status 0 when every domain is found "
    "and complete (or bundled), 1 when one is missing, partial or not the published data, 2 "
    "for bad input (an unknown suite, a --data-dir that is not a folder)."
)


def cmd_data(args: argparse.Namespace) -> int:
    """``tta-bench data check``: print the inventory of the suite's domains."""
    protocol = _protocol(args.suite)
    data_dir = _data_dir(args.data_dir)
    rows = suite_inventory(protocol, data_dir)
    if args.json:
        print(json.dumps(_as_json(protocol, data_dir, rows), indent=1))
    else:
        print(_render(protocol, data_dir, rows))
    return 0 if all(r.complete for r in rows) else 1


def _protocol(suite: str | None) -> Any:
    from tta_bench.run.protocol import load_protocol

    if suite is None:
        try:
            suite = catalog.default("suite")
        except catalog.NoDefaultError as exc:
            raise UsageError(str(exc)) from None
    with usage_errors():  # an unknown suite: "did you mean", the suites listed
        return load_protocol(suite)


def _data_dir(given: str | None) -> str | None:
    if given is None:
        return None
    path = Path(given).expanduser()
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a folder"
        raise UsageError(f"--data-dir {given!r} {what}; give the folder that holds the data")
    return str(path.resolve())


def suite_domains(protocol: Any) -> list[tuple[str, dict[str, Any], str]]:
    """``(dataset, factory keywords, role)`` of each domain a run of ``protocol`` reads:
    each ``(shift, severity)`` where the dataset serves its own domains, else its clean
    split (role ``""``); then the OOD set of an open-set protocol (role ``"OOD set"``)."""
    args = dict(protocol.dataset_args)
    if protocol.shift_source == "dataset":
        domains = [
            (protocol.dataset, {**args, "shift": s, "severity": v}, "")
            for s in protocol.shifts
            for v in protocol.severities
        ]
    else:
        domains = [(protocol.dataset, args, "")]
    if protocol.ood is not None:
        ood_args = dict(protocol.ood.get("dataset_args") or {})
        domains.append((protocol.ood["dataset"], ood_args, "OOD set"))
    return domains


def suite_inventory(protocol: Any, data_dir: str | None) -> list[DataInventory]:
    """The ``DataInventory`` of every domain of ``suite_domains(protocol)`` (a role, such as
    the OOD set's, follows the domain's name in brackets)."""
    rows = []
    for name, kwargs, role in suite_domains(protocol):
        row = domain_inventory(name, kwargs, data_dir)
        row.domain += f" ({role})" if role else ""
        rows.append(row)
    return rows


def domain_inventory(name: str, kwargs: dict[str, Any], data_dir: str | None) -> DataInventory:
    """The inventory of dataset ``name`` called with ``kwargs``: its factory's ``inventory``,
    else the stream built and counted; bundled when the factory reads no ``data_dir``.
    What the dataset raises becomes the row: missing data (``DataUnavailableError``) is
    missing, saying what to download; other bad data is a mismatch naming the problem."""
    factory = registry("datasets").get(name)
    label = _label(name, kwargs)
    if "data_dir" not in inspect.signature(factory).parameters:
        return DataInventory(
            label, bundled=True, notes=[f"nothing to download: {name} reads no --data-dir"]
        )
    kwargs = {**kwargs, "data_dir": data_dir}
    inventory = getattr(factory, "inventory", None)
    try:
        if callable(inventory):
            return inventory(**kwargs)
        return _counted(label, factory, kwargs)
    except DataUnavailableError as exc:
        return DataInventory(label, download=str(exc))
    except (ValueError, OSError, TypeError) as exc:  # TypeError: an argument it does not take
        return DataInventory(label, where=str(data_dir or "."), problems=[str(exc)])


def _label(name: str, kwargs: dict[str, Any]) -> str:
    if kwargs.get("shift") is None:
        return name
    return f"{name}/{kwargs['shift']}/{kwargs.get('severity')}"


def _counted(label: str, factory: Any, kwargs: dict[str, Any]) -> DataInventory:
    """A dataset without an ``inventory``: its ``check_args``, then the stream built."""
    check = getattr(factory, "check_args", None)
    if callable(check):
        check(**kwargs)
    stream = factory(**kwargs)
    where = stream.metadata.get("source") or kwargs.get("data_dir") or "."
    return DataInventory(
        stream.name or label,
        where=str(where),
        images=len(stream),
        notes=["counted by building the stream (the dataset has no inventory)"],
    )


# -- output ------------------------------------------------------------------------------
def _as_json(protocol: Any, data_dir: str | None, rows: list[DataInventory]) -> dict[str, Any]:
    return {
        "suite": protocol.name,
        "dataset": protocol.dataset,
        "data_dir": data_dir,
        "complete": all(r.complete for r in rows),
        "counts": _counts(rows),
        "domains": [r.as_dict() for r in rows],
    }


def _counts(rows: list[DataInventory]) -> dict[str, int]:
    seen = Counter(r.status for r in rows)
    return {s: seen[s] for s in INVENTORY_STATUSES if seen[s]}


def _render(protocol: Any, data_dir: str | None, rows: list[DataInventory]) -> str:
    from tabulate import tabulate

    headers = ["domain", "status", "images", "published", "class folders", "split file", "at"]
    table = [
        [
            r.domain,
            r.status,
            _number(r.images),
            _number(r.published),
            _folders(r) or "-",
            r.split_file or "-",
            _where(r.where, data_dir),
        ]
        for r in rows
    ]
    where = f"--data-dir {data_dir}" if data_dir else "no --data-dir"
    lines = [f"suite {protocol.name} (dataset {protocol.dataset}), {where}", ""]
    lines.append(tabulate(table, headers=headers, tablefmt="simple", disable_numparse=True))
    details = [f"  {r.domain}: {text}" for r in rows for text in (*r.problems, *r.notes)]
    if details:
        lines += ["", "details:", *details]
    lines += _downloads(rows)
    counts = ", ".join(f"{n} {s}" for s, n in _counts(rows).items())
    done = sum(r.complete for r in rows)
    lines += ["", f"{done} of {len(rows)} domain(s) found and complete ({counts})"]
    return "\n".join(lines)


def _downloads(rows: list[DataInventory]) -> list[str]:
    """``to download:`` lines, one per distinct hint, naming the domains it is for."""
    hints: dict[str, list[str]] = {}
    for r in rows:
        if not r.complete and r.download:
            hints.setdefault(r.download, []).append(r.domain)
    if not hints:
        return []
    lines = ["", "to download:"]
    for hint, domains in hints.items():
        named = ", ".join(domains[:4]) + (
            f" and {len(domains) - 4} more" if len(domains) > 4 else ""
        )
        lines.append(f"  {named}: {hint}")
    return lines


def _number(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _folders(r: DataInventory) -> str:
    parts = []
    for what, names in (("empty", r.empty), ("missing", r.absent), ("unknown", r.unknown)):
        if names:
            more = f" +{len(names) - 3}" if len(names) > 3 else ""
            parts.append(f"{len(names)} {what}: {', '.join(names[:3])}{more}")
    if r.missing_files:
        parts.append(f"{r.missing_files:,} listed file(s) missing")
    return "; ".join(parts)


def _where(path: str | None, data_dir: str | None) -> str:
    if path is None:
        return "-"
    if data_dir:
        try:
            return str(Path(path).relative_to(data_dir)) or "."
        except ValueError:
            pass
    return path
