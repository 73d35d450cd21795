"""``tta-bench sweep``: a Hydra multirun application, one job per method x model x seed.

Hydra expands the overrides (``method=a,b seeds=[0,1,2] suite=s``) into
independent jobs and hands them to a launcher plugin: the basic one (sequential, in
process), ``hydra/launcher=joblib`` (local processes, ``hydra-joblib-launcher``) or
``hydra/launcher=submitit_slurm`` (SLURM array jobs, ``hydra-submitit-launcher``); the
launchers are the ``sweep`` extra of the package. ``seeds=[0,1,2]`` is split into one job
per seed (``seeds=[0],[1],[2]`` in Hydra's grammar) unless the caller keeps seeds together.

Every job writes its own normal results JSON, atomically, into ``<sweep dir>/runs/``,
under a name built from its cell key (method + config hash, model, protocol id, seeds).
Rerunning the same sweep therefore finds each job's file and resumes it: finished cells
are skipped (``tta_bench.run.runner``), so a finished sweep does no work. When the launcher
returns, the job files that differ only in their seeds are merged into one results file
per (model, method + config, protocol) at the top of the sweep directory, which
``tta-bench leaderboard <sweep dir> --suite ...`` ranks.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from tta_bench.registry import registry

CONFIG_NAME = "tta_bench_sweep"
#: Subdirectory of the sweep directory holding each job's own results file.
RUNS = "runs"
#: The packing plan a sweep writes into its directory: which light jobs run in which task.
PACKS = "jobs/packs.json"
#: Light jobs (``Method.light``) packed into one launcher task, at most (``--pack``).
DEFAULT_PACK = 8
#: The sweeper that packs them: Hydra loads sweepers from the ``hydra_plugins`` namespace
#: only, so it lives there, in this distribution (``hydra_plugins/tta_bench_sweeper``).
SWEEPER = "hydra_plugins.tta_bench_sweeper.packing_sweeper.PackingSweeper"

#: Launcher choices (``hydra/launcher=NAME``): the Hydra plugin module each needs, the
#: scheduler command it calls, if any.
LAUNCHERS: dict[str, tuple[str | None, str | None]] = {
    "basic": (None, None),
    "joblib": ("hydra_plugins.hydra_joblib_launcher", None),
    "submitit_local": ("hydra_plugins.hydra_submitit_launcher", None),
    "submitit_slurm": ("hydra_plugins.hydra_submitit_launcher", "sbatch"),
}
#: What a SLURM sweep sets where the command line does not (``hydra.launcher.<key>``);
#: the rest are the submitit launcher's own defaults (docs/cluster.md lists both).
SLURM_DEFAULTS = {
    # every job resumes its results file, so a task requeued after its time ran out
    # continues where it stopped (submitit's default, 0, would give up at once)
    "max_num_timeout": 3,
}


def launcher_choice(overrides: Sequence[str]) -> str:
    """The launcher an override list chooses (``hydra/launcher=NAME``), ``basic`` if none."""
    for o in overrides:
        if o.strip().startswith("hydra/launcher="):
            return o.split("=", 1)[1].strip()
    return "basic"


def check_launcher(overrides: Sequence[str]) -> str:
    """The chosen launcher, checked before anything runs: a known name, its plugin installed
    and, for SLURM, ``sbatch`` on the PATH; otherwise a ``ValueError`` saying what to do."""
    import importlib.util
    import shutil

    name = launcher_choice(overrides)
    if name not in LAUNCHERS:
        raise ValueError(
            f"unknown launcher hydra/launcher={name}; available: {', '.join(LAUNCHERS)}"
        )
    module, command = LAUNCHERS[name]
    if module is not None and importlib.util.find_spec(module.split(".")[0]) is not None:
        found = importlib.util.find_spec(module) is not None
    else:
        found = module is None
    if not found:
        raise ValueError(
            f"hydra/launcher={name} needs the sweep extra, which is not installed: "
            "pip install 'tta-bench[sweep]' (hydra-joblib-launcher and "
            "hydra-submitit-launcher)"
        )
    if command is not None and shutil.which(command) is None:
        raise ValueError(
            f"hydra/launcher={name} submits with {command!r}, which is not on the PATH: run "
            "the sweep on a SLURM login node (or install the client, e.g. apt-get install "
            "slurm-client, configured for your cluster), or launch locally with "
            "hydra/launcher=joblib"
        )
    return name


#: The choices whose every value a sweep checks against the registries before launching.
CHECKED_CHOICES = ("method", "model", "suite")


def choice_values(overrides: Sequence[str]) -> dict[str, list[str] | None]:
    """The values each ``method=``, ``model=`` and ``suite=`` override names (every value of
    a sweep, ``a,b`` or ``choice(a,b)``), by key; None where they are open: a ``glob``
    sweep (it picks among registered names), a deletion, or a value Hydra cannot parse
    (Hydra reports it, naming the override). Keys no override sets are absent."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType

    parser = OverridesParser.create()
    found: dict[str, list[str] | None] = {}
    for text in overrides:
        key = text.split("=", 1)[0].strip().lstrip("+~")
        if key not in CHECKED_CHOICES:
            continue
        try:
            override = parser.parse_overrides([text])[0]
        except Exception:  # Hydra's grammar errors: Hydra reports them, naming the override
            found[key] = None
            continue
        if override.is_delete() or override.value_type == ValueType.GLOB_CHOICE_SWEEP:
            found[key] = None
            continue
        if override.is_sweep_override():
            values = [str(v) for v in override.sweep_string_iterator()]
        else:
            values = [override.get_value_element_as_str()]
        if key not in found or found[key] is not None:
            found[key] = [*(found.get(key) or []), *values]
    return found


def check_choices(overrides: Sequence[str]) -> None:
    """Every value of the ``method=``, ``model=`` and ``suite=`` overrides
    (``choice_values``) must be a registered method or preset, a registered model, a
    catalogue suite: else the registry's ``UnknownNameError`` (a ``ValueError``: "did you
    mean ...? Available: ..."), before anything is composed or launched (Hydra would stop
    at the first job that names it, after the jobs before it ran)."""
    from tta_bench import catalog
    from tta_bench.config import resolve_method

    for key, values in choice_values(overrides).items():
        for value in values or ():
            if key == "method":
                resolve_method(value)
            elif key == "model":
                registry("models").origin(value)
            else:
                catalog.suite(value)


def launcher_defaults(overrides: Sequence[str]) -> list[str]:
    """``hydra.launcher.<key>=<value>`` for each of the harness's launcher defaults the
    overrides leave unset (SLURM: ``SLURM_DEFAULTS``)."""
    if launcher_choice(overrides) != "submitit_slurm":
        return []
    given = {o.split("=", 1)[0].strip().lstrip("+~") for o in overrides if "=" in o}
    return [
        f"hydra.launcher.{k}={v}"
        for k, v in SLURM_DEFAULTS.items()
        if f"hydra.launcher.{k}" not in given
    ]


def shard_overrides(overrides: Sequence[str], count: int) -> list[str]:
    """``--shards N``: the overrides plus ``protocol.shard=0/N,...,N-1/N`` (one job per part
    of every cell; the sweep's merge combines the parts)."""
    if count < 2:
        raise ValueError(f"--shards {count}: expected 2 or more parts")
    if any(o.strip().startswith("protocol.shard=") for o in overrides):
        raise ValueError("give either --shards N or protocol.shard=..., not both")
    return [*overrides, "protocol.shard=" + ",".join(f"{i}/{count}" for i in range(count))]


def split_seed_overrides(overrides: Sequence[str]) -> list[str]:
    """``seeds=[0,1,2]`` -> ``seeds=[0],[1],[2]`` (one job per seed); other overrides as is.

    A value that is already a sweep (``seeds=[0,1],[2]``) or not a plain list is kept.
    """
    out = []
    for o in overrides:
        m = re.fullmatch(r"seeds=\[([^\[\]]*)\]", o.strip())
        if m and m.group(1).strip():
            items = [s.strip() for s in m.group(1).split(",")]
            out.append("seeds=" + ",".join(f"[{s}]" for s in items))
        else:
            out.append(o)
    return out


def first_job(overrides: Sequence[str]) -> list[str]:
    """The overrides of the sweep's first job (each sweep ``a,b`` -> ``a``), for ``--cfg``:
    Hydra prints the config of one job, and every job composes the same way."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    out = []
    for o in OverridesParser.create().parse_overrides(list(overrides)):
        if o.is_sweep_override():
            out.append(f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}")
        else:
            out.append(o.input_line)
    return out


def register_configs(overrides: Sequence[str] = ()) -> None:
    """Store the run config and the methods and models the sweep's ``overrides`` name
    (``choice_values``; a preset's method; the catalogue's default where none is named)
    as Hydra config nodes; every registered one where the values are open (a ``glob``
    sweep). A method's config is its class's, so storing one imports its module: a sweep
    of two methods imports those two, not every installed method's module (and what they
    import: torchvision, for one) before it launches anything."""
    from hydra.core.config_store import ConfigStore

    from tta_bench import catalog
    from tta_bench.config import _register, resolve_method, run_config

    named = choice_values(overrides)

    def names(key: str, group: str) -> list[str]:
        if key in named and named[key] is None:
            return registry(group).names()
        chosen = named.get(key) or [catalog.default_or_none(key)]
        if None in chosen:  # no catalogue default: Hydra asks for the choice
            return registry(group).names()
        if key == "method":
            chosen = [resolve_method(c)[0] for c in chosen]
        return list(dict.fromkeys(chosen))

    _register(names("method", "methods"), names("model", "models"))
    ConfigStore.instance().store(name=CONFIG_NAME, node=run_config())


def build_spec(cfg: DictConfig, method: str, model: str, preset: str | None = None) -> Any:
    """The ``RunSpec`` of one composed job config (``method``/``model``: the group choices).
    ``batch_log`` is a single path that parallel jobs would share, so sweeps leave it off."""
    import dataclasses

    from tta_bench.run.spec import spec_from_config

    return dataclasses.replace(spec_from_config(cfg, method, model, preset), batch_log=None)


def job_filename(spec: Any) -> str:
    """The results file name of a job: unique per cell key, stable across reruns."""
    from tta_bench.run.resume import method_config_hash

    seeds = "-".join(str(s) for s in spec.seeds)
    label = getattr(spec, "method_preset", None) or spec.method
    part = getattr(spec, "shard", None)
    suffix = f"_shard{part.index}of{part.count}" if part is not None else ""
    name = (
        f"{label}-{method_config_hash(spec.method_config)}_{spec.model}_"
        f"{spec.protocol.id}_seeds{seeds}{suffix}.json"
    )
    return re.sub(r"[^A-Za-z0-9@._+-]", "_", name)


def _threads_per_job(hc: Any) -> int | None:
    """Split the cores between the launcher's parallel jobs (joblib ``n_jobs``); in a
    SLURM task, the CPUs it was given (``cpus_per_task``)."""
    slurm = os.environ.get("SLURM_CPUS_PER_TASK")
    if slurm and slurm.isdigit() and int(slurm) >= 1:
        return int(slurm)
    n_jobs = OmegaConf.select(hc.launcher, "n_jobs", default=None)
    if n_jobs is None or int(n_jobs) <= 1:
        return None
    return max(1, (os.cpu_count() or 1) // int(n_jobs))


# -- packing light jobs -------------------------------------------------------------------
def _choice(job: Sequence[str], key: str) -> str | None:
    for o in job:
        if o.startswith(f"{key}="):
            return o.split("=", 1)[1]
    return None


def _is_light(job: Sequence[str]) -> bool:
    from tta_bench.config import resolve_method

    choice = _choice(job, "method")
    if choice is None:
        from tta_bench import catalog

        choice = catalog.default("method")
    try:
        method, _ = resolve_method(choice)
    except ValueError:
        return False  # Hydra reports the bad name when it composes the job
    return bool(getattr(registry("methods").get(method), "light", False))


def _job_key(job: Sequence[str]) -> str:
    return "\n".join(job)


def pack_jobs(jobs: Sequence[Sequence[str]], size: int) -> tuple[list[list[str]], dict]:
    """``(the jobs to launch, {leader job key: [member jobs]})``: light jobs
    (``Method.light``) that differ only in method and seeds run ``size`` to a task (the
    first is the task, the others its members); ``size`` <= 1 packs nothing."""
    if size <= 1:
        return [list(j) for j in jobs], {}
    rest = {}
    groups: dict[str, list[list[str]]] = {}
    order: list[tuple[str, Any]] = []
    for job in jobs:
        job = list(job)
        if _is_light(job):
            key = _job_key([o for o in job if not o.startswith(("method=", "seeds="))])
            if key not in groups:
                groups[key] = []
                order.append(("pack", key))
            groups[key].append(job)
        else:
            rest[_job_key(job)] = job
            order.append(("job", _job_key(job)))
    launched, plan = [], {}
    for kind, key in order:
        if kind == "job":
            launched.append(rest[key])
            continue
        members = groups[key]
        for k in range(0, len(members), size):
            chunk = members[k : k + size]
            launched.append(chunk[0])
            if len(chunk) > 1:
                plan[_job_key(chunk[0])] = chunk[1:]
    return launched, plan


def _members(hc: Any) -> list[list[str]]:
    """The jobs packed into this task (``packs.json``), none when it runs alone."""
    path = Path(hc.sweep.dir) / PACKS
    if not path.is_file():
        return []
    plan = json.loads(path.read_text())
    return plan.get(_job_key(list(hc.overrides.task)), [])


def _member_spec(overrides: list[str]) -> Any:
    """The ``RunSpec`` of a packed job, composed as ``tta-bench run`` composes one (in a
    Hydra context of its own; the task's own context is restored after)."""
    import dataclasses

    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.singleton import Singleton

    from tta_bench.run.resolve import resolve_run

    state = Singleton.get_state()
    GlobalHydra.instance().clear()
    try:
        _, spec = resolve_run(overrides=overrides)
    finally:
        Singleton.set_state(state)
    return dataclasses.replace(spec, batch_log=None)


def _run_one(spec: Any, sweep_dir: Path, num: Any, packed: str = "") -> str:
    from tta_bench.run import runner

    # Never cfg.output: parallel jobs would share one file.
    output = sweep_dir / RUNS / job_filename(spec)
    record = runner.run(spec, output)
    mean = record["summary"]["mean_accuracy"]
    if not record["cells"]:
        scored = f"no cell (part {spec.shard} got no batch of the stream)"
    elif mean is None:
        scored = f"not scored ({record['summary'].get('n_diverged', 0)} cell(s) diverged)"
    else:
        scored = f"mean accuracy {100 * mean:.2f}%"
    print(
        f"[job {num} pid {os.getpid()}] {spec.method} seeds {spec.seeds} on {spec.protocol.id}: "
        f"{scored}, {len(record['cells'])} cells "
        f"({record.get('skipped_cells', 0)} skipped as finished){packed} -> {output}",
        flush=True,
    )
    return str(output)


def job(cfg: DictConfig) -> str:
    """One Hydra job: run the composed config into its own file in the sweep directory."""
    import torch
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    threads = _threads_per_job(hc)
    if threads is not None:
        torch.set_num_threads(threads)
    from tta_bench.config import resolve_method

    method, model = hc.runtime.choices["method"], hc.runtime.choices["model"]
    method, preset = resolve_method(method)
    spec = build_spec(cfg, method, model, preset)
    members = _members(hc)
    sweep_dir = Path(hc.sweep.dir)
    outputs = [_run_one(spec, sweep_dir, hc.job.num, f" (packed, 1 of {1 + len(members)})"
                        if members else "")]  # fmt: skip
    for k, overrides in enumerate(members, 2):  # light jobs packed into this task
        packed = f" (packed, {k} of {1 + len(members)})"
        outputs.append(_run_one(_member_spec(overrides), sweep_dir, hc.job.num, packed))
    return ",".join(outputs)


def _whole_jobs(root: Path) -> list[tuple[str, dict[str, Any]]]:
    """``(file name under the sweep dir, record)`` of every job of ``root/runs``, the shard
    parts of one job (``protocol.shard``) combined first into the job's whole record
    (``tta_bench.run.shard.merge_parts``, written as ``runs/shards/<job>.json``)."""
    from tta_bench.run import results, shard
    from tta_bench.run.results import record_key

    whole, parts = [], {}
    for path in sorted((root / RUNS).glob("*.json")):
        record = results.load_results(path)
        if record.get("shard"):
            key = {k: v for k, v in record_key(record).items() if k != "shard"}
            key["seeds"] = sorted(record["seeds"])
            parts.setdefault(json.dumps(key, sort_keys=True, default=str), []).append(path)
        else:
            whole.append((f"{RUNS}/{path.name}", record))
    for paths in parts.values():
        name = re.sub(r"_shard\d+of\d+(?=\.json$)", "", paths[0].name)
        out = root / RUNS / "shards" / name
        whole.append((f"{RUNS}/shards/{name}", shard.merge_parts(paths, out)))
    return whole


def merge(sweep_dir: str | Path) -> list[Path]:
    """Merge the job files of ``sweep_dir/runs`` that share a run key (model, method +
    config hash, protocol id; jobs that differ only in their seeds) into one normal results
    file per key at the top of ``sweep_dir``, where ``tta-bench leaderboard`` reads it.
    The shard parts of a job (``protocol.shard=i/N``) are combined into the job first.

    Cells are taken from every job file (ordered by seed, then as they were written);
    ``merged_from`` lists the job files. Returns the merged files, written atomically.
    """
    from tta_bench.run import results
    from tta_bench.run.results import record_key

    root = Path(sweep_dir)
    groups: dict[str, list[dict[str, Any]]] = {}
    names: dict[str, list[str]] = {}
    for name, record in _whole_jobs(root):
        key = json.dumps(record_key(record), sort_keys=True, default=str)
        groups.setdefault(key, []).append(record)
        names.setdefault(key, []).append(name)
    written = []
    for key, records in groups.items():
        records.sort(key=lambda r: min(r["seeds"]))
        merged = dict(records[0])
        merged["seeds"] = sorted({int(s) for r in records for s in r["seeds"]})
        merged["cells"] = [c for r in records for c in r["cells"]]
        merged["summary"] = results.summarize(merged["cells"])
        merged["merged_from"] = names[key]
        merged.pop("skipped_cells", None)
        merged.pop("loop", None)
        if all(r.get("finished") for r in records):
            merged["finished"] = max(r["finished"] for r in records)
        else:
            merged.pop("finished", None)
        merged["wall_time_s"] = sum(float(r.get("wall_time_s") or 0.0) for r in records)
        proto = records[0]["protocol"]["id"]
        first = records[0]
        h = first.get("method_config_hash", "")
        name = f"{first['method']}-{h}_{first['model']['name']}_{proto}.json"
        out = root / re.sub(r"[^A-Za-z0-9@._+-]", "_", name)
        _merge_samples([root / n for n in names[key]], out)  # before the file lists them
        results.write_json_atomic(out, merged)
        written.append(out)
    return written


def _merge_samples(jobs: list[Path], merged: Path) -> None:
    """The job files' per-sample folders (``log_samples``) gathered into the merged file's,
    so ``tta-bench rescore`` reads a sweep's merged file as it reads one run's (each cell's
    Parquet file copied atomically; cells are disjoint across the jobs of one key)."""
    import shutil

    from tta_bench.paths import atomic_path
    from tta_bench.run.samples import samples_dir

    for job in jobs:
        folder = samples_dir(job)
        if not folder.is_dir():
            continue
        for part in sorted(folder.glob("*.parquet")):
            with atomic_path(samples_dir(merged) / part.name) as tmp:
                shutil.copyfile(part, tmp)


def main(
    overrides: Sequence[str], sweep_dir: str, *, cfg: str | None = None, pack: int = DEFAULT_PACK
) -> int:
    """Run the multirun application on ``overrides`` with results in ``sweep_dir``.

    ``cfg``: ``job``/``hydra``/``all`` prints the composed config of the first job (Hydra's
    ``--cfg``, launcher settings included) and runs nothing. ``pack``: light jobs per task
    (``pack_jobs``). Returns the process exit status.
    """
    import hydra
    from hydra.core.config_store import ConfigStore

    from tta_bench.config import _search_path_overrides
    from tta_bench.run.profiles import rewrite_switches

    overrides = rewrite_switches(overrides)  # ``<switch>=true``: ``profile=NAME``
    check_choices(overrides)  # every name of every value list, before Hydra launches one
    register_configs(overrides)
    ConfigStore.instance().store(
        group="hydra/sweeper",
        name="tta_bench_packing",
        node={
            "_target_": SWEEPER,
            "max_batch_size": None,
            "params": None,
            "pack": int(pack),
        },  # fmt: skip
    )
    argv = [
        "tta-bench-sweep",
        *(["--cfg", cfg] if cfg else ["--multirun"]),
        *_search_path_overrides(),
        f"hydra.sweep.dir={sweep_dir}",
        "hydra.sweep.subdir=jobs/${hydra.job.num}",
        "hydra.job.chdir=false",
        "hydra/sweeper=tta_bench_packing",
        "progress=false",
        *launcher_defaults(overrides),
        *(first_job(overrides) if cfg else overrides),
    ]
    app = hydra.main(config_path=None, config_name=CONFIG_NAME, version_base="1.3")(job)
    saved = sys.argv
    sys.argv = argv
    try:
        app()
    finally:
        sys.argv = saved
    if not cfg:
        for path in merge(sweep_dir):
            print(f"merged: {path}")
    return 0
