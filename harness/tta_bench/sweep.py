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
are skipped (``tta_bench.runner``), so a finished sweep does no work. When the launcher
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


def register_configs() -> None:
    """Store the run config and every registered method/model as Hydra config nodes."""
    from hydra.core.config_store import ConfigStore

    from tta_bench.config import _register, run_config

    _register(registry("methods").names(), registry("models").names())
    ConfigStore.instance().store(name=CONFIG_NAME, node=run_config())


def build_spec(cfg: DictConfig, method: str, model: str) -> Any:
    """The ``RunSpec`` of one composed job config (``method``/``model``: the group choices).
    ``batch_log`` is a single path that parallel jobs would share, so sweeps leave it off."""
    import dataclasses

    from tta_bench.spec import spec_from_config

    return dataclasses.replace(spec_from_config(cfg, method, model), batch_log=None)


def job_filename(spec: Any) -> str:
    """The results file name of a job: unique per cell key, stable across reruns."""
    from tta_bench.resume import method_config_hash

    seeds = "-".join(str(s) for s in spec.seeds)
    label = getattr(spec, "method_preset", None) or spec.method
    name = (
        f"{label}-{method_config_hash(spec.method_config)}_{spec.model}_"
        f"{spec.protocol.id}_seeds{seeds}.json"
    )
    return re.sub(r"[^A-Za-z0-9@._+-]", "_", name)


def _threads_per_job(hc: Any) -> int | None:
    """Split the cores between the launcher's parallel jobs (joblib ``n_jobs``)."""
    n_jobs = OmegaConf.select(hc.launcher, "n_jobs", default=None)
    if n_jobs is None or int(n_jobs) <= 1:
        return None
    return max(1, (os.cpu_count() or 1) // int(n_jobs))


def job(cfg: DictConfig) -> str:
    """One Hydra job: run the composed config into its own file in the sweep directory."""
    import torch
    from hydra.core.hydra_config import HydraConfig

    from tta_bench import runner

    hc = HydraConfig.get()
    threads = _threads_per_job(hc)
    if threads is not None:
        torch.set_num_threads(threads)
    from tta_bench.config import resolve_method

    method, model = hc.runtime.choices["method"], hc.runtime.choices["model"]
    method, preset = resolve_method(method)
    spec = build_spec(cfg, method, model)
    spec.method_preset = preset
    # Never cfg.output: parallel jobs would share one file.
    output = Path(hc.sweep.dir) / RUNS / job_filename(spec)
    record = runner.run(spec, output)
    mean = record["summary"]["mean_accuracy"]
    print(
        f"[job {hc.job.num} pid {os.getpid()}] {method} seeds {spec.seeds} on {spec.protocol.id}: "
        f"mean accuracy {100 * mean:.2f}%, {len(record['cells'])} cells "
        f"({record.get('skipped_cells', 0)} skipped as finished) -> {output}",
        flush=True,
    )
    return str(output)


def merge(sweep_dir: str | Path) -> list[Path]:
    """Merge the job files of ``sweep_dir/runs`` that share a run key (model, method +
    config hash, protocol id; jobs that differ only in their seeds) into one normal results
    file per key at the top of ``sweep_dir``, where ``tta-bench leaderboard`` reads it.

    Cells are taken from every job file (ordered by seed, then as they were written);
    ``merged_from`` lists the job files. Returns the merged files, written atomically.
    """
    from tta_bench import results
    from tta_bench.results import record_key

    root = Path(sweep_dir)
    groups: dict[str, list[dict[str, Any]]] = {}
    names: dict[str, list[str]] = {}
    for path in sorted((root / RUNS).glob("*.json")):
        record = results.load_results(path)
        key = json.dumps(record_key(record), sort_keys=True, default=str)
        groups.setdefault(key, []).append(record)
        names.setdefault(key, []).append(f"{RUNS}/{path.name}")
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
    from tta_bench.samples import samples_dir

    for job in jobs:
        folder = samples_dir(job)
        if not folder.is_dir():
            continue
        for part in sorted(folder.glob("*.parquet")):
            with atomic_path(samples_dir(merged) / part.name) as tmp:
                shutil.copyfile(part, tmp)


def main(overrides: Sequence[str], sweep_dir: str, *, cfg: str | None = None) -> int:
    """Run the multirun application on ``overrides`` with results in ``sweep_dir``.

    ``cfg``: ``job``/``hydra``/``all`` prints the composed config of the first job (Hydra's
    ``--cfg``, launcher settings included) and runs nothing. Returns the process exit status.
    """
    import hydra

    from tta_bench.config import _search_path_overrides

    register_configs()
    argv = [
        "tta-bench-sweep",
        *(["--cfg", cfg] if cfg else ["--multirun"]),
        *_search_path_overrides(),
        f"hydra.sweep.dir={sweep_dir}",
        "hydra.sweep.subdir=jobs/${hydra.job.num}",
        "hydra.job.chdir=false",
        "progress=false",
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
