"""Experiment trackers chosen by config (``logger=[wandb]``, ``logger=[mlflow,tensorboard]``):
this module sends one run to them.

Each chosen tracker receives the resolved config when the run starts, every cell's metrics
and costs as its group finishes (at step = the cell's index in the results file's cells,
so a resumed run continues the steps and never sends a cell it skipped as finished), and,
when the run ends, the results file and the per-sample folder (``log_samples=...``) as
artifacts. The results file stays the source of truth: a tracker that fails is a warning
on the ``tta_bench`` logger (``tta_bench.log``) and the run goes on (one that fails to
start is left out).

No tracker library is imported unless its tracker is chosen: ``check_loggers`` only looks
the library up (``importlib.util.find_spec``), the imports happen in ``Tracker.start``.

- ``wandb``: ``wandb.init(project=$WANDB_PROJECT or "tta-bench", config=..., mode=$WANDB_MODE)``
  (the other ``WANDB_*`` variables as W&B reads them), ``run.log(metrics, step=...)`` per
  cell, a ``cells`` table, the files as ``wandb.Artifact``s (types ``results``, ``samples``).
- ``mlflow``: ``mlflow.start_run`` (``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``),
  ``log_params`` of the flattened config (keys and values cut to MLflow's limits),
  ``log_metrics(metrics, step=...)`` per cell, ``log_artifact``/``log_artifacts``.
- ``tensorboard``: a ``torch.utils.tensorboard.SummaryWriter`` into ``<results
  stem>.tensorboard/`` beside the results file, or ``$TTA_BENCH_TENSORBOARD_DIR/<results
  stem>/``; scalars per cell, the config and each cell's name as text.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar, Protocol

__all__ = [
    "TENSORBOARD_DIR_ENV",
    "TRACKERS",
    "TRACKER_CLASSES",
    "MlflowTracker",
    "TensorBoardTracker",
    "Tracker",
    "Trackers",
    "WandbTracker",
    "cell_metrics",
    "check_loggers",
    "flatten_config",
    "mlflow_params",
    "require",
    "summary_metrics",
]

#: Tracker name -> the module its library provides (``pip install 'tta-bench[<name>]'``).
TRACKERS: dict[str, str] = {"mlflow": "mlflow", "tensorboard": "tensorboard", "wandb": "wandb"}
#: The project a W&B run goes to unless ``WANDB_PROJECT`` names another.
WANDB_PROJECT = "tta-bench"
#: Where TensorBoard event files go instead of beside the results file (one folder per run).
TENSORBOARD_DIR_ENV = "TTA_BENCH_TENSORBOARD_DIR"
#: A cell's identity: sent as the table's first columns, never as metrics.
CELL_KEYS = ("shift", "severity", "seed")


class RunSpec(Protocol):
    """What the trackers read of a run's ``tta_bench.run.spec.RunSpec`` (which imports this
    module: named here, not imported)."""

    method: str
    method_preset: str | None
    protocol: Any
    config: dict[str, Any]
    loggers: list[str]


# -- choosing ------------------------------------------------------------------------------
def check_loggers(names: Iterable[Any]) -> list[str]:
    """The tracker names of ``logger=[...]``, checked, in order, each once. An unknown name
    or a tracker whose library is not installed is a ``ValueError`` naming it and the
    options or the extra to install. Imports no tracker."""
    chosen: list[str] = []
    for raw in names:
        name = str(raw)
        if name not in TRACKERS:
            raise ValueError(f"unknown logger {name!r}; available: {', '.join(sorted(TRACKERS))}")
        if name not in chosen:
            require(name)
            chosen.append(name)
    return chosen


def require(name: str, module: str | None = None) -> None:
    """A ``ValueError`` naming the extra to install unless tracker ``name``'s library
    (``module``, default ``TRACKERS[name]``) can be imported; it is looked up, not imported.
    A folder of that name without the library (``./wandb/`` of earlier runs) does not
    count."""
    module = module or TRACKERS[name]
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    if found is None or found.origin is None:  # None: absent, or only a namespace folder
        raise ValueError(
            f"logger {name!r} needs the {module!r} package, which is not installed: "
            f"pip install 'tta-bench[{name}]'"
        )


# -- what is sent ----------------------------------------------------------------------------
def _is_number(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


def cell_metrics(cell: dict[str, Any]) -> dict[str, float]:
    """``{"cell/<field>": number}``: a cell's finite numeric fields (scores, costs, its
    severity and seed); None (a diverged cell's accuracy), strings and lists are left out."""
    return {f"cell/{k}": float(v) for k, v in cell.items() if _is_number(v)}


def summary_metrics(record: dict[str, Any] | None) -> dict[str, float]:
    """``{"summary/<key>": number}``: the record's summary's finite numbers, nested mappings
    flattened with ``/`` (``summary/mean_accuracy_per_seed/0``)."""
    out: dict[str, float] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif _is_number(value):
            out[prefix] = float(value)

    walk("summary", (record or {}).get("summary") or {})
    return out


def flatten_config(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"method.lr": "0.001", ...}``: nested mappings joined with ``.``; strings as they
    are, other values as JSON (``null``, ``true``, ``[0, 1]``)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten_config(value, f"{name}."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value, default=str)
    return out


def run_name(spec: RunSpec) -> str:
    """``<method or preset> on <suite>``: the name a tracker shows for the run."""
    return f"{spec.method_preset or spec.method} on {spec.protocol.name}"


def _cell_name(cell: dict[str, Any]) -> str:
    return f"{cell.get('shift')} severity {cell.get('severity')} seed {cell.get('seed')}"


# -- the trackers ----------------------------------------------------------------------------
class Tracker:
    """One tracker's side of a run. ``start`` opens the tracker's run and sends the
    resolved config; ``log_cells`` sends ``(step, cell)`` pairs; ``finish`` sends the
    summary and, when ``ok``, the results file and per-sample folder as artifacts, then
    closes the tracker's run (marked failed unless ``ok``). Any of them may raise."""

    name: ClassVar[str]

    def __init__(self, spec: RunSpec, output: Path):
        self.spec = spec
        self.output = Path(output)

    @property
    def samples(self) -> Path:
        from tta_bench.run.samples import samples_dir

        return samples_dir(self.output)

    def start(self) -> None:
        raise NotImplementedError

    def log_cells(self, steps: list[tuple[int, dict[str, Any]]]) -> None:
        raise NotImplementedError

    def finish(self, record: dict[str, Any] | None, ok: bool) -> None:
        raise NotImplementedError


class WandbTracker(Tracker):
    """Weights & Biases: one W&B run per tta-bench run; ``WANDB_MODE=offline`` and the
    other ``WANDB_*`` variables as W&B reads them."""

    name = "wandb"

    def start(self) -> None:
        import wandb

        self.wandb = wandb
        self.rows: list[tuple[int, dict[str, Any]]] = []
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or WANDB_PROJECT,
            config=self.spec.config,
            mode=os.environ.get("WANDB_MODE") or None,
            name=os.environ.get("WANDB_NAME") or run_name(self.spec),
        )

    def log_cells(self, steps: list[tuple[int, dict[str, Any]]]) -> None:
        for step, cell in steps:
            self.rows.append((step, cell))
            self.run.log(cell_metrics(cell), step=step)

    def finish(self, record: dict[str, Any] | None, ok: bool) -> None:
        try:
            if self.rows:
                self.run.log({"cells": self._table()})
            self.run.summary.update(summary_metrics(record))
            if ok:
                self._artifact("results", self.output)
                if self.samples.is_dir():
                    self._artifact("samples", self.samples)
        finally:
            self.run.finish(exit_code=0 if ok else 1)

    def _table(self) -> Any:
        """The cells this run sent: step, identity, then every metric any of them has."""
        metrics = list(dict.fromkeys(k for _, c in self.rows for k in cell_metrics(c)))
        metrics = [k for k in metrics if k.removeprefix("cell/") not in CELL_KEYS]
        columns = ["step", *CELL_KEYS, *(k.removeprefix("cell/") for k in metrics)]
        data = []
        for step, cell in self.rows:
            numbers = cell_metrics(cell)
            data.append(
                [step, *(cell.get(k) for k in CELL_KEYS), *(numbers.get(k) for k in metrics)]
            )
        return self.wandb.Table(columns=columns, data=data, allow_mixed_types=True)

    def _artifact(self, kind: str, path: Path) -> None:
        stem = re.sub(r"[^A-Za-z0-9._-]", "_", self.output.stem) or "run"
        artifact = self.wandb.Artifact(f"{stem}-{kind}", type=kind)
        if path.is_dir():
            artifact.add_dir(str(path), name=path.name)
        else:
            artifact.add_file(str(path))
        self.run.log_artifact(artifact)


class MlflowTracker(Tracker):
    """MLflow: one MLflow run (nested under an active one) in the experiment and store
    ``MLFLOW_EXPERIMENT_NAME`` and ``MLFLOW_TRACKING_URI`` name (MLflow's defaults)."""

    name = "mlflow"

    def start(self) -> None:
        import mlflow
        from mlflow.tracking import MlflowClient

        self.mlflow = mlflow
        self.run = mlflow.start_run(
            run_name=run_name(self.spec), nested=mlflow.active_run() is not None
        )
        self.run_id = self.run.info.run_id
        self.client = MlflowClient()
        try:
            mlflow.set_tags(
                {
                    "tta_bench.protocol_id": self.spec.protocol.id,
                    "tta_bench.results": str(self.output),
                }
            )
            params = mlflow_params(self.spec.config)
            batch = _mlflow_limit("MAX_PARAMS_TAGS_PER_BATCH", 100)
            for i in range(0, len(params), batch):
                mlflow.log_params(dict(params[i : i + batch]))
        except Exception:
            self._end("FAILED")  # not left active for the next run in this process
            raise

    def log_cells(self, steps: list[tuple[int, dict[str, Any]]]) -> None:
        for step, cell in steps:
            self.mlflow.log_metrics(cell_metrics(cell), step=step)

    def finish(self, record: dict[str, Any] | None, ok: bool) -> None:
        try:
            summary = summary_metrics(record)
            if summary:
                self.mlflow.log_metrics(summary)
            if ok:
                self.mlflow.log_artifact(str(self.output))
                if self.samples.is_dir():
                    self.mlflow.log_artifacts(str(self.samples), artifact_path=self.samples.name)
        finally:
            self._end("FINISHED" if ok else "FAILED")

    def _end(self, status: str) -> None:
        active = self.mlflow.active_run()
        if active is not None and active.info.run_id == self.run_id:
            self.mlflow.end_run(status=status)
        else:  # someone else's run is on top: close ours by id
            self.client.set_terminated(self.run_id, status)


def mlflow_params(config: dict[str, Any]) -> list[tuple[str, str]]:
    """The config as MLflow params: flattened (``flatten_config``), keys in MLflow's alphabet
    and cut to ``MAX_ENTITY_KEY_LENGTH``, values cut to ``MAX_PARAM_VAL_LENGTH`` (MLflow's
    limits where it is installed, else its historical 250 and 500)."""
    key_len = _mlflow_limit("MAX_ENTITY_KEY_LENGTH", 250)
    value_len = _mlflow_limit("MAX_PARAM_VAL_LENGTH", 500)
    out: dict[str, str] = {}
    for key, value in flatten_config(config).items():
        out[re.sub(r"[^\w.\- /]", "_", key)[:key_len]] = value[:value_len]
    return list(out.items())


def _mlflow_limit(name: str, default: int) -> int:
    try:
        from mlflow.utils import validation
    except ImportError:
        return default
    return int(getattr(validation, name, default))


class TensorBoardTracker(Tracker):
    """TensorBoard event files: ``<results stem>.tensorboard/`` beside the results file, or
    ``$TTA_BENCH_TENSORBOARD_DIR/<results stem>/`` (one folder per run under one logdir).
    A resumed run writes into the same folder, its steps continuing the earlier ones."""

    name = "tensorboard"

    @property
    def log_dir(self) -> Path:
        root = os.environ.get(TENSORBOARD_DIR_ENV)
        if root:
            return Path(root) / self.output.stem
        return self.output.with_name(self.output.stem + ".tensorboard")

    def start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.step = 0
        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        try:
            config = json.dumps(self.spec.config, indent=2, default=str)
            self.writer.add_text("config", _code_block(config), global_step=0)
            self.writer.flush()
        except Exception:
            self.writer.close()
            raise

    def log_cells(self, steps: list[tuple[int, dict[str, Any]]]) -> None:
        for step, cell in steps:
            for key, value in cell_metrics(cell).items():
                self.writer.add_scalar(key, value, global_step=step)
            self.writer.add_text("cell", _cell_name(cell), global_step=step)
            self.step = step
        self.writer.flush()

    def finish(self, record: dict[str, Any] | None, ok: bool) -> None:
        try:
            for key, value in summary_metrics(record).items():
                self.writer.add_scalar(key, value, global_step=self.step)
            if ok:
                files = [f"results: {self.output}"]
                if self.samples.is_dir():
                    files.append(f"samples: {self.samples}")
                self.writer.add_text("artifacts", _code_block("\n".join(files)), self.step)
        finally:
            self.writer.close()


def _code_block(text: str) -> str:
    """Markdown code (TensorBoard renders text as Markdown): every line indented."""
    return "\n".join("    " + line for line in text.splitlines())


#: Tracker name -> its class.
TRACKER_CLASSES: dict[str, type[Tracker]] = {
    "mlflow": MlflowTracker,
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
}


# -- the runner's observer -------------------------------------------------------------------
class Trackers:
    """A run's chosen trackers as one observer of the runner; none chosen: does nothing.

        with Trackers.start(spec, output) as trackers:   # each tracker's run, with the config
            Evaluation(spec, output, on_cells=trackers.log_cells).run()
        # on leaving: the summary and artifacts sent, each tracker's run closed; an
        # exception closes them marked failed, without artifacts, and goes on up

    Every call reaches every tracker; a tracker that raises is a warning on the
    ``tta_bench`` logger and the run goes on (one that fails to start is left out).
    """

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers
        self.record: dict[str, Any] | None = None

    @classmethod
    def start(cls, spec: RunSpec, output: Path) -> Trackers:
        """Start the trackers ``spec.loggers`` names (imports their libraries now); an
        unknown name or a missing library is a ``ValueError`` (``check_loggers``)."""
        started = []
        for name in check_loggers(spec.loggers):  # a spec built by hand: checked here too
            tracker = TRACKER_CLASSES[name](spec, Path(output))
            if _attempt(tracker, "start", "it is left out of this run"):
                started.append(tracker)
        return cls(started)

    def log_cells(self, cells: list[dict[str, Any]], record: dict[str, Any]) -> None:
        """The runner's ``on_cells``: ``cells`` just joined ``record["cells"]`` (its last
        ones), each sent at its index there."""
        self.record = record
        first = len(record["cells"]) - len(cells)
        steps = list(enumerate(cells, start=first))
        for tracker in self.trackers:
            _attempt(tracker, "log_cells", "the run goes on", steps)

    def finish(self, ok: bool) -> None:
        """Send the summary (and, when ``ok``, the artifacts) and close every tracker; a
        second call does nothing."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            _attempt(tracker, "finish", "its run may stay open there", self.record, ok)

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.finish(ok=exc_type is None)


def _attempt(tracker: Tracker, what: str, then: str, *args: Any) -> bool:
    """``tracker.<what>(*args)``; True unless it raised, which is logged as a warning."""
    try:
        getattr(tracker, what)(*args)
    except Exception as exc:
        logging.getLogger("tta_bench").warning(
            f"logger {tracker.name!r}: {what} failed ({type(exc).__name__}: {exc}); {then} "
            f"(results are written to {tracker.output} regardless)"
        )
        return False
    return True
