"""``tta-bench predict --config job.json``: a test-time-adaptation batch job over an image folder.

The job's images are cut into batches; a registered method adapts on each batch as it
does in a benchmark run (``tta_bench.deploy.adapter.Adapter``) and predicts it. The job's
keys are declared in ``tta_bench.deploy.job`` (``PredictJob``: each key's type, default and
range or choices; a value out of range, also one of the method's config, is refused before
anything is built), its batches planned by ``tta_bench.deploy.plan``. Layouts (``layout``):

* ``folder``: the images directly in ``input_dir``, unlabeled, in sorted order, cut into
  batches of ``batch_size`` (``batch-00000``, ...);
* ``subfolders``: each subfolder of ``input_dir`` is a batch (named after it; one larger
  than ``batch_size`` is cut into ``<name>-00000``, ...), unlabeled;
* ``classes``: subfolders named after the class names hold labeled images; all of them, in
  sorted path order (``shuffle=true``: shuffled by ``seed``), are cut into batches and the
  accuracy is reported too (labels never reach the method);
* ``auto`` (default): ``folder`` when ``input_dir`` holds images and no image subfolders;
  ``classes`` when every subfolder is a class name, ``subfolders`` when none is; anything
  else is ambiguous and an error asking for ``layout``.

Image files: ``.png .jpg .jpeg .bmp .gif .webp .tif .tiff`` (any case; subfolders are read
recursively; hidden files are skipped; other files, dangling or looping symlinks and
special files are skipped and listed in the summary, ``ignored_files``, each with its
reason in ``ignored_reasons``). Images are decoded as the harness decodes them
(``tta_bench.run.images.decode_rgb``: any mode as its 8-bit RGB copy, EXIF orientation
applied), each resized (shorter side, bicubic) and centre-cropped to the model's size as
soon as it is read, so a batch holds one full-size image at a time.

Pixel budget: ``max_pixels`` (default ``DEFAULT_MAX_PIXELS``, 40 megapixels, 120 MB
decoded) per image, checked from the file's header before a pixel is decoded (a 32 KB PNG
can declare 12000 x 12000 = 144 megapixels, 432 MB as RGB). A larger image is a bad image
(``on_bad_image``), reported by path with its width, height and pixel count.

Adaptation state: ``reset`` = ``per_batch`` (each batch from the state after setup),
``per_folder`` (a subfolder's batches adapt in sequence; ``subfolders`` and ``folder``
layouts only: in ``classes`` the folders are labels) or ``never`` (the whole job is one
stream).

Outputs in ``output_dir``: ``<batch>_result.json`` per batch (per file: label, score,
top-k, and the true label when labeled; the bad images by path), ``logs/predict.jsonl``
(one line per batch attempt: status, loss, seconds, memory) and ``summary.json``. Every
file is written atomically. A rerun of the same job skips finished batches: a batch is
finished when its result file exists for the same job (fingerprint of method, config,
model, text head, batching) and the same files. Adaptation state is not saved, so with
``per_folder`` or ``never`` a group of batches that share state (a folder, or the whole
job) is skipped only when all its batches are finished, and redone whole otherwise (the
runner's rule for stateful protocols), which gives the results of an uninterrupted run.

Failures: a batch that raises (an unreadable file under ``on_bad_image=fail_batch``, an
error in the method) is retried up to ``max_retry`` times, then reported in the summary
(and left unfinished for the next rerun) while the other batches continue. A failure
inside the method's step resets the adaptation state before the retry (a partial update
cannot be trusted). ``on_bad_image=skip`` (default) leaves a bad image (corrupt,
truncated, unreadable, with no 8-bit meaning, or over ``max_pixels``) out of its batch and
reports it by path in the batch's result and the summary.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from tta_bench.deploy.job import (
    DEFAULT_MAX_PIXELS,
    LAYOUTS,
    ON_BAD_IMAGE,
    RESETS,
    PredictJob,
    load_job,
)
from tta_bench.deploy.plan import (
    IMAGE_EXTENSIONS,
    NOT_AN_IMAGE,
    Plan,
    PlannedBatch,
    plan_batches,
)
from tta_bench.paths import AtomicLog, atomic_write_text
from tta_bench.run.images import ImageDecodeError, ImageTooLargeError, decode_rgb

__all__ = [
    "PredictJob",
    "Plan",
    "PlannedBatch",
    "load_job",
    "plan_batches",
    "run_job",
    "LAYOUTS",
    "RESETS",
    "ON_BAD_IMAGE",
    "IMAGE_EXTENSIONS",
    "DEFAULT_MAX_PIXELS",
]

RESULT_SUFFIX = "_result.json"
LOG_NAME = "predict.jsonl"


# -- running -------------------------------------------------------------------------------
class BadImagesError(ValueError):
    """Images of a batch that cannot be decoded (``on_bad_image=fail_batch``)."""


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def _memory(device: Any) -> tuple[int, str]:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device)), "cuda_allocated"
    from tta_bench.run.cost import rss_bytes

    return int(rss_bytes()), "cpu_rss"


class _ResultStore:
    """The job's files in ``output_dir``: per-batch results (atomic), the log, the
    summary, and which batches an earlier run of the same job (``fingerprint``) finished."""

    def __init__(self, output_dir: Path, fingerprint: str):
        self.output_dir = output_dir
        self.fingerprint = fingerprint

    def result_path(self, batch: PlannedBatch) -> Path:
        return self.output_dir / f"{batch.name}{RESULT_SUFFIX}"

    def prepare(self, resume: bool) -> None:
        """Create the folders, drop a killed write's temporary files, and refuse (or, with
        ``resume`` false, clear) the results of another job."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "logs").mkdir(exist_ok=True)
        for stale in self.output_dir.glob(".*.tmp"):  # a killed write's temporary file
            stale.unlink(missing_ok=True)
        results = sorted(self.output_dir.glob(f"*{RESULT_SUFFIX}"))
        if not resume:
            for p in results:
                p.unlink()
            return
        for p in results:
            old = self.read(p)
            if old is not None and old.get("job") != self.fingerprint:
                raise ValueError(
                    f"output_dir {str(self.output_dir)!r} holds results of another job "
                    f"({p.name}: job {old.get('job')}, this job is {self.fingerprint}: the "
                    "method, its config, the model, classes, batching or seed differ); use "
                    "another output_dir, or set resume to false to start it afresh"
                )

    @staticmethod
    def read(path: Path) -> dict[str, Any] | None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            return None
        return data if isinstance(data, dict) else None

    def finished(self, batch: PlannedBatch) -> dict[str, Any] | None:
        """The batch's result from an earlier run of this job, or None."""
        old = self.read(self.result_path(batch))
        if old and old.get("job") == self.fingerprint and old.get("files") == batch.files:
            return old
        return None

    def write_result(self, batch: PlannedBatch, result: dict[str, Any]) -> None:
        atomic_write_text(self.result_path(batch), json.dumps(result, indent=1, allow_nan=False))

    def open_log(self) -> Any:
        return AtomicLog(self.output_dir / "logs" / LOG_NAME, append=True)  # whole lines only

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write_text(
            self.output_dir / "summary.json", json.dumps(summary, indent=1, allow_nan=False)
        )


def _log_line(
    log: Any, device: Any, batch: PlannedBatch, attempt: int, status: str,
    result: dict[str, Any] | None, seconds: dict[str, float], error: str | None = None,
) -> None:  # fmt: skip
    """One JSONL line per batch attempt: status, loss, seconds, memory."""
    memory, kind = _memory(device)
    line = {
        "time": _now(),
        "batch": batch.name,
        "attempt": attempt,
        "status": status,
        "n": None if result is None else result["n"],
        "bad_images": None if result is None else len(result["bad_images"]),
        "loss": None if result is None else result["loss"],
        "seconds": seconds,
        "memory_bytes": memory,
        "memory_kind": kind,
    }
    if error is not None:
        line["error"] = error
    log.write(json.dumps(line, allow_nan=False) + "\n")
    log.flush()


def _seconds(start: float, loaded: float, done: float) -> dict[str, float]:
    return {"load": loaded - start, "method": done - loaded, "total": done - start}


class _Job:
    """One run of a job: plan, adapter, its result store (``run_job`` drives it)."""

    def __init__(self, job: PredictJob, adapter: Any = None):
        self.job = job
        self.input_dir = Path(job.input_dir)
        if adapter is None:
            from tta_bench.deploy.adapter import Adapter

            adapter = Adapter.from_settings(job)  # its method config checked before the model
        self.adapter = adapter
        self.plan = plan_batches(
            self.input_dir,
            job.layout,
            job.batch_size,
            adapter.classnames,
            shuffle=job.shuffle,
            seed=job.seed,
            reset=job.reset,
        )
        self.store = _ResultStore(Path(job.output_dir), self._fingerprint())
        self.bad_images: list[dict[str, Any]] = []
        self.failed: list[dict[str, Any]] = []

    def _fingerprint(self) -> str:
        a, job = self.adapter, self.job
        key = {
            "method": a.method_name,
            "method_config": a.config_dict,
            "model": job.model,
            "model_args": job.model_args,
            "weights": getattr(a.model, "weights", None),
            "classnames": a.classnames,
            "templates": list(a.model.templates),
            "batch_size": job.batch_size,
            "layout": self.plan.layout,
            "reset": job.reset,
            "shuffle": job.shuffle,
            "seed": job.seed,
            "on_bad_image": job.on_bad_image,
            "top_k": job.top_k,
            "device": a.device.type,
        }
        if job.max_pixels != DEFAULT_MAX_PIXELS:  # so jobs from before the key still resume
            key["max_pixels"] = job.max_pixels
        blob = json.dumps(key, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @property
    def fingerprint(self) -> str:
        return self.store.fingerprint

    # -- one batch --------------------------------------------------------------------------
    def _load(self, batch: PlannedBatch) -> tuple[list[Any], list[int], list[dict[str, Any]]]:
        """The batch's images decoded (``decode_rgb``, within ``max_pixels``, checked from
        the header) and each at once resized to the model's size (uint8 arrays: the batch
        never holds more than one full-size image), their positions in the batch, and its
        bad images (``{file, error}``; over the budget also ``width, height, pixels``)."""
        from tta_bench.run.cache import to_rgb_array

        size = self.adapter.image_size
        images, keep, bad = [], [], []
        for i, rel in enumerate(batch.files):
            try:
                img = decode_rgb(
                    self.input_dir / rel,
                    name=rel,
                    max_pixels=self.job.max_pixels,
                    budget_name="predict job key 'max_pixels'",
                )
                images.append(to_rgb_array(img, size))
                del img
                keep.append(i)
            except ImageDecodeError as exc:
                entry: dict[str, Any] = {"file": rel, "error": f"{type(exc).__name__}: {exc}"}
                if isinstance(exc, ImageTooLargeError):
                    entry.update(width=exc.width, height=exc.height, pixels=exc.pixels)
                bad.append(entry)
        if bad and self.job.on_bad_image == "fail_batch":
            shown = "; ".join(f"{b['file']}: {b['error']}" for b in bad[:5])
            raise BadImagesError(
                f"{len(bad)} image(s) of batch {batch.name} cannot be decoded: {shown}"
            )
        return images, keep, bad

    def _predict(self, batch: PlannedBatch, images: list[Any], keep: list[int]) -> tuple:
        """``(predictions per file, loss)``: adapt on the batch and predict it."""
        adapter, predictions, loss = self.adapter, [], None
        if images:
            pred = adapter(adapter.preprocess(images, max_pixels=self.job.max_pixels))
            loss = pred.loss
            for pos, row in zip(keep, pred.records(self.job.top_k)):
                entry = {"file": batch.files[pos], **row}
                if batch.labels is not None:
                    truth = batch.labels[pos]
                    entry["true_label"] = adapter.classnames[truth]
                    entry["correct"] = row["index"] == truth
                predictions.append(entry)
        return predictions, loss

    def run_batch(self, batch: PlannedBatch, log: Any) -> dict[str, Any] | None:
        """Predict one batch, retrying; its result (written), or None when it failed."""
        job, device = self.job, self.adapter.device
        error = ""
        for attempt in range(1, job.max_retry + 2):
            start = time.perf_counter()
            stepped = False
            try:
                images, keep, bad = self._load(batch)
                loaded = time.perf_counter()
                stepped = bool(images)
                predictions, loss = self._predict(batch, images, keep)
                done = time.perf_counter()
                result = self._result(batch, predictions, bad, loss, attempt, start, loaded, done)
                self.store.write_result(batch, result)
                seconds = _seconds(start, loaded, done)
                _log_line(log, device, batch, attempt, "ok", result, seconds)
                self.bad_images += [{**b, "batch": batch.name} for b in bad]
                return result
            except Exception as exc:  # noqa: BLE001 - any batch failure is retried/reported
                error = f"{type(exc).__name__}: {exc}"
                now = time.perf_counter()
                seconds = _seconds(start, now, now)
                _log_line(log, device, batch, attempt, "failed", None, seconds, error=error)
                if stepped:  # a step that raised may have half-updated the state
                    self.adapter.reset()
        self.failed.append({"batch": batch.name, "attempts": job.max_retry + 1, "error": error})
        return None

    def _result(
        self,
        batch: PlannedBatch,
        predictions: list[dict[str, Any]],
        bad: list[dict[str, Any]],
        loss: float | None,
        attempt: int,
        start: float,
        loaded: float,
        done: float,
    ) -> dict[str, Any]:
        labeled = [p for p in predictions if "correct" in p]
        return {
            "batch": batch.name,
            "job": self.fingerprint,
            "folder": batch.folder,
            "files": batch.files,
            "n": len(predictions),
            "predictions": predictions,
            "bad_images": bad,
            "accuracy": (sum(p["correct"] for p in labeled) / len(labeled) if labeled else None),
            "loss": loss,
            "attempts": attempt,
            "seconds": _seconds(start, loaded, done),
            "method": self.adapter.method_name,
            "finished": _now(),
        }

    # -- the job ----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        from tqdm.auto import tqdm

        self.store.prepare(self.job.resume)
        results, todo = self._resume()
        skipped = len(results)
        start = time.perf_counter()
        status = "running"
        self._write_summary(results, skipped, 0, status, 0.0)
        bar = tqdm(
            total=len(self.plan.batches),
            initial=skipped,
            desc=f"predict {self.adapter.method_name}",
            unit="batch",
            disable=not self.job.progress,
        )
        computed = 0
        try:
            with self.store.open_log() as log:
                for group in todo:
                    self.adapter.reset()  # each group starts from the state after setup
                    for batch in group:
                        result = self.run_batch(batch, log)
                        computed += 1
                        if result is not None:
                            results[batch.name] = result
                        bar.update(1)
            status = "complete" if not self.failed else "incomplete"
        except BaseException:
            status = "interrupted"
            raise
        finally:
            bar.close()
            summary = self._write_summary(
                results, skipped, computed, status, time.perf_counter() - start
            )
        return summary

    def _resume(self) -> tuple[dict[str, dict[str, Any]], list[list[PlannedBatch]]]:
        """The results of groups an earlier run finished, and the groups still to run (a
        group of batches that share adaptation state counts only when whole)."""
        results: dict[str, dict[str, Any]] = {}
        todo: list[list[PlannedBatch]] = []
        for group in self.plan.groups(self.job.reset):
            old = [self.store.finished(b) for b in group]
            if all(o is not None for o in old):
                results.update({b.name: o for b, o in zip(group, old)})  # type: ignore[misc]
            else:
                todo.append(group)
        for old in results.values():
            self.bad_images += [{**b, "batch": old["batch"]} for b in old.get("bad_images", [])]
        return results, todo

    def _write_summary(
        self,
        results: dict[str, dict[str, Any]],
        skipped: int,
        computed: int,
        status: str,
        wall_s: float,
    ) -> dict[str, Any]:
        a = self.adapter
        preds = [p for r in results.values() for p in r["predictions"]]
        labeled = [p for p in preds if "correct" in p]
        summary = {
            "status": status,
            "job": self.fingerprint,
            "config": dataclasses.asdict(self.job),
            "method": a.method_name,
            "method_config": a.config_dict,
            "model": {
                "name": self.job.model,
                "args": self.job.model_args,
                "weights": getattr(a.model, "weights", None),
                "image_size": a.image_size,
            },
            "classnames": a.classnames,
            "layout": self.plan.layout,
            "labeled": self.plan.labeled,
            "batches": len(self.plan.batches),
            "finished_batches": len(results),
            "skipped_batches": skipped,
            "computed_batches": computed,
            "failed": list(self.failed),
            "images": len(preds),
            "bad_images": list(self.bad_images),
            "ignored_files": self.plan.ignored,
            "ignored_reasons": self.plan.reasons,
            "accuracy": sum(p["correct"] for p in labeled) / len(labeled) if labeled else None,
            "labeled_images": len(labeled),
            "wall_s": wall_s,
            "updated": _now(),
        }
        self.store.write_summary(summary)
        return summary


def run_job(job: PredictJob, *, adapter: Any = None) -> dict[str, Any]:
    """Run ``job`` (resuming it) and return its summary (also in ``summary.json``).
    ``adapter``: a prebuilt ``Adapter`` instead of the one the job's config describes
    (its method, model and text head are then the adapter's)."""
    return _Job(job, adapter).run()


def job_exit_status(summary: dict[str, Any]) -> int:
    """0 when every batch is finished, 1 when some failed."""
    return 0 if summary["status"] == "complete" else 1


def main(config: str | Path, quiet: bool = False) -> int:
    """``tta-bench predict --config job.json``: run the job and print its summary. Exit
    status 0 when every batch is finished, 1 when some failed (2, bad input: ValueError)."""
    import sys

    job = load_job(config)
    if quiet:
        job.progress = False
    try:
        summary = run_job(job)
    except KeyboardInterrupt:
        print(
            f"tta-bench predict: interrupted; finished batches are in {job.output_dir}; "
            "rerun the same job to resume",
            file=sys.stderr,
        )
        return 130
    print(
        f"predict {summary['method']} on {job.input_dir} (layout {summary['layout']}): "
        f"{summary['finished_batches']}/{summary['batches']} batches finished, "
        f"{summary['computed_batches']} computed now, {summary['skipped_batches']} finished "
        f"earlier, {len(summary['failed'])} failed; {summary['images']} images"
    )
    if summary["accuracy"] is not None:
        print(
            f"accuracy {100 * summary['accuracy']:.2f}% over {summary['labeled_images']} "
            "labeled images"
        )
    notable = [(f, why) for f, why in summary["ignored_reasons"].items() if why != NOT_AN_IMAGE]
    log = logging.getLogger("tta_bench")
    for file, why in notable[:10]:  # images left out by the layout, broken symlinks, ...
        log.warning(f"ignored {file}: {why}")
    for bad in summary["bad_images"][:10]:
        log.warning(f"bad image {bad['file']} (batch {bad['batch']}): {bad['error']}")
    if len(summary["bad_images"]) > 10:
        log.warning(f"... and {len(summary['bad_images']) - 10} more bad images")
    for fail in summary["failed"]:
        log.error(
            f"failed batch {fail['batch']} after {fail['attempts']} attempt(s): {fail['error']}"
        )
    print(f"results: {job.output_dir} (summary.json, logs/{LOG_NAME})")
    return job_exit_status(summary)
